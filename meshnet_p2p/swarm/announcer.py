"""A peer's announcements: its signed records kept in the DHT while it serves.

One duty of a volunteer (roles/volunteer.py), as petals' ``ModuleAnnouncerThread``
is one of its server's: every ``interval`` (or at once when woken: a new relay, a
changed report) it signs its records afresh and publishes them; a failed round is
said, counted and tried again next time, never the end of the peer; it says when
the swarm stops, or starts again, taking its report (a partition, a lost
bootstrap). When the peer leaves, :meth:`depart` stops the rounds first (no
regular report may follow the departing one: it would say "come" again for the
report's lifetime) and publishes the departing report.

The network is passed in (``publish``), and what to publish is asked for at each
round (``records``), so the simulator (sim/swarm.py) runs this same loop over its
own nodes and reports as ``join`` does over real ones.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Sequence

import trio

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.guard import Guard

ANNOUNCE_INTERVAL_S = 30.0
DEPART_TIMEOUT_S = 5.0

Publish = Callable[[str, bytes], Awaitable[int]]  # (key, signed record) -> how many nodes took it


class Announcer:
    """``records()``: the (key, signed record) pairs of one round, the capability report
    first (its store count is the one watched); ``can_announce()``: False while nobody
    could dial the peer (its report would only cost clients a timeout); ``on_stored``:
    told each round the count of nodes that took the first record (e.g. the simulator
    marks the peer announced at the first); ``counts``: where failures are counted
    (``loop_errors_announce``)."""

    def __init__(self, publish: Publish, records: Callable[[], Sequence[tuple[str, bytes]]], *,
                 interval: float = ANNOUNCE_INTERVAL_S, can_announce: Callable[[], bool] = lambda: True,
                 log: Callable[[str], None] = lambda msg: None, on_stored: Callable[[int], None] = lambda n: None,
                 counts=None) -> None:
        self.publish = publish
        self.records = records
        self.interval = interval
        self.can_announce = can_announce
        self.log = log
        self.on_stored = on_stored
        self.counts = counts
        self.reaching = True  # the last round's report was taken by some node
        self._wake = trio.Event()
        self._scope = trio.CancelScope()

    def wake(self) -> None:
        """Announce now, not at the next period (a new relay, a changed report)."""
        self._wake.set()

    async def announce(self) -> int | None:
        """One round: how many nodes took the report, or None when it was not (or could not be) published."""
        if not self.can_announce():
            return None
        try:  # a refusal by other nodes is theirs to have; this peer keeps serving and tries again
            stored = None
            for key, record in self.records():
                n = await self.publish(key, record)
                stored = n if stored is None else stored
        except MeshnetError as e:
            self.log(f"announce failed, retrying in {self.interval:g} s: {e}")
            return None
        if stored is None:
            return None
        if (stored > 0) != self.reaching:
            self.reaching = stored > 0
            self.log(f"announce reaching peers again ({stored})" if stored else
                     f"announce reached no peer; retrying every {self.interval:g} s")
        self.on_stored(stored)
        return stored

    async def run(self, at_once: bool = True) -> None:
        """Announce (at once, or after a period when ``at_once`` is False: a first round
        already ran), then every ``interval`` or when woken, until :meth:`depart` (or
        cancelled). A round that raises is counted and tried again."""
        guard = Guard("announce", self.counts)
        with self._scope:
            if not at_once:
                await self._until_due()
            while True:
                async with guard:
                    await self.announce()
                await self._until_due()

    async def _until_due(self) -> None:
        with trio.move_on_after(self.interval):
            await self._wake.wait()
        self._wake = trio.Event()

    async def depart(self, key: str, record: bytes, timeout: float = DEPART_TIMEOUT_S) -> None:
        """Stop the rounds, then publish the departing ``record`` under ``key`` (bounded)."""
        self._scope.cancel()
        if not self.can_announce():  # nobody could reach it: nothing to retract
            return
        with trio.move_on_after(timeout):
            try:
                await self.publish(key, record)
            except MeshnetError as e:
                self.log(f"departure not announced: {e}")
