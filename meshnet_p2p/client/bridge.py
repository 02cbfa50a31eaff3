"""The one bridge between trio and the client's blocking code.

A route's calls block (gRPC on the calling thread, dataplane/stub.py), while
surveying the swarm is trio (the DHT). So a generation runs in blocking code,
and each survey it needs comes back through an *async runner*: ``trio.run``
when the caller is plain code, ``trio.from_thread.run`` (back to the caller's
loop) when the caller is trio and the generation runs in a worker thread.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import trio

T = TypeVar("T")
AsyncRunner = Callable[..., object]  # runner(async_fn, *args) -> its result, from blocking code


def from_plain_code(work: Callable[[AsyncRunner], T]) -> T:
    """Run ``work`` here; each async call it makes runs in a trio loop of its own."""
    return work(trio.run)


async def from_trio(work: Callable[[AsyncRunner], T]) -> T:
    """Run blocking ``work`` in a worker thread; its async calls come back to this trio loop."""
    return await trio.to_thread.run_sync(work, trio.from_thread.run)


async def wait_event(event: threading.Event) -> None:
    """Wait, from trio, for an event another thread sets (without blocking the loop)."""
    await trio.to_thread.run_sync(event.wait)

