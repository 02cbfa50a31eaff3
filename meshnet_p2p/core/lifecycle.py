"""Process lifecycle shared by every long-running role.

A role prints ``listening on ...`` and its parent (a test, a bench, the demo)
may SIGTERM it the instant it reads that line. So the signals are caught from
the first moment of the run (``catching_signals`` wraps the role's main), not
from when the role reaches ``until_signalled``: a signal that arrives in
between is queued and ends the role cleanly, never by the default action."""

from __future__ import annotations

import signal

import trio

SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_caught: trio.lowlevel.RunVar = trio.lowlevel.RunVar("meshnet_shutdown_signals")


async def catching_signals(async_fn, *args):
    """Run ``async_fn(*args)`` with SIGINT and SIGTERM caught throughout (``trio.run(catching_signals, main, ...)``)."""
    with trio.open_signal_receiver(*SHUTDOWN_SIGNALS) as signals:
        _caught.set(signals)
        return await async_fn(*args)


async def until_signalled() -> None:
    """Return at the first SIGINT or SIGTERM (roles then shut down cleanly and exit 0),
    counting one that arrived since ``catching_signals`` began."""
    try:
        signals = _caught.get()
    except LookupError:  # not under catching_signals: catch from now on
        with trio.open_signal_receiver(*SHUTDOWN_SIGNALS) as signals:
            async for _ in signals:
                return
    async for _ in signals:
        return
