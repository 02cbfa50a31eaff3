"""One failure in one background loop must never end a peer.

Every role runs background loops (the DHT node's gossip pulls and maintenance,
a peer's announces, a relay's record publishing, a monitor's surveys) and
short background tasks (a gossip push, a ping). An exception that escapes
one of them ends its nursery, and with it the whole process: issue 24 #0 saw
one oversized gossip digest take down every process of a swarm. Each loop
iteration (or task) runs inside a :class:`Guard` instead:

    guard = Guard("gossip_pull", node.stats)
    while True:
        async with guard:
            ...one iteration...

An ``Exception`` from the body is counted (``loop_errors_<name>``), logged and
swallowed; a loop that fails again and again waits longer each time (0.1 s
doubling to 30 s) rather than spinning. ``trio.Cancelled``, ``KeyboardInterrupt``
and groups holding them are BaseExceptions and pass through untouched: a
nursery's cancellation and a signal still stop the loop.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import trio

from .stats import Counters

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 30.0
LOOP_ERRORS = Counters()  # for roles with no counter of their own (metrics may read it)


def count(counts: Counter | Counters | None, name: str) -> None:
    """Add one to ``name`` in a collections.Counter (a DHT node's stats) or a stats.Counters."""
    if counts is None:
        counts = LOOP_ERRORS
    if isinstance(counts, Counters):
        counts.add(name)
    else:
        counts[name] += 1


class Guard:
    """A loop iteration's (or a background task's) fence; see the module's doc.
    ``backoff=False`` for one-shot tasks: nothing to wait for after a failure."""

    def __init__(self, name: str, counts: Counter | Counters | None = None, *, backoff: bool = True) -> None:
        self.name = name
        self.counts = counts
        self.backoff = backoff
        self.errors = 0  # failures in a row (0 after a good iteration)
        self.total = 0  # failures ever

    async def __aenter__(self) -> "Guard":
        return self

    async def __aexit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            self.errors = 0
            return False
        if not isinstance(exc, Exception):
            return False  # trio.Cancelled, KeyboardInterrupt, SystemExit: not ours to stop
        await self.failed(exc)
        return True

    async def failed(self, exc: Exception) -> None:
        """Count and log ``exc``, then back off (for a loop that catches its own)."""
        self.errors += 1
        self.total += 1
        count(self.counts, "loop_errors_" + self.name)
        # the first failure with its traceback; a stretch of them is one line each
        log.warning("background %s failed (%d in a row): %r", self.name, self.errors, exc,
                    exc_info=exc if self.errors == 1 else None)
        if self.backoff:
            await trio.sleep(min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** (self.errors - 1)))

