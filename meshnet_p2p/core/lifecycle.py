"""Process lifecycle shared by every long-running role."""

from __future__ import annotations

import signal

import trio


async def until_signalled() -> None:
    """Return at the first SIGINT or SIGTERM (roles then shut down cleanly and exit 0)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return
