"""A peer that cannot be dialled keeps itself reachable through a relay it found
in the DHT, and moves to another when that one dies or refuses.

:class:`RelayKeeper` reads the relays' signed records (``relays.py``),
measures its own round trip to each (a TCP connect: what a client's hop
through that relay will pay on top), reserves on the best one
(``dataplane/relay.py``: the reservation is renewed by a ping every
KEEPALIVE_S), dials itself through the relay as a client would (a relay that
takes reservations but carries nothing is passed over, and checked again
every VERIFY_INTERVAL_S, sooner after a failure), and tells its owner the
relay it is reachable through, so the owner re-announces its circuit address
at once. When the reservation ends (the relay died, froze, refused, or dropped
it), or the relay keeps turning this peer's clients away (its circuits are all
held: it says so in its LOAD line after each PONG), that relay is set aside
for a while and the next best is tried; when none is left it looks again,
with backoff. No operator action at any step.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Sequence

import trio

from meshnet_p2p.core.guard import Guard
from .relay import KEEPALIVE_S, RelayError, Reservation, first_error, hold_reservation
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.multiaddr import Multiaddr
from .reachability import relay_dial_check
from meshnet_p2p.core.records import keep_newest
from meshnet_p2p.swarm.relay_offers import RELAYS_KEY, RelayOffer, one_per_network, rank_relays, usable_host

SET_ASIDE_S = 120.0  # a relay that refused or failed at once goes to the back of the line this long
LOST_SET_ASIDE_S = 10.0  # one lost after it worked a while (a restart, a blink): this long
MAX_CANDIDATES = 32  # relays measured per search (a random sample of what the DHT holds)
RTT_TIMEOUT_S = 2.0
RTT_SAMPLES = 2
VERIFY_INTERVAL_S = 60.0  # a reserved peer dials itself through its relay this often
VERIFY_RETRY_S = 10.0  # and this soon again after a dial failed (two in a row: it moves on)
# A relay that turned this many clients away within its last TURNED_AWAY_REPORTS
# LOAD reports (one per keepalive: ~30 s) is left for another. Only clients
# refused because every circuit was held count (not a source over its own share,
# which an attacker could otherwise use to chase a peer from relay to relay).
TURNED_AWAY_TO_LEAVE = 3
TURNED_AWAY_REPORTS = 3


class RelayTurnsAway(RelayError):
    """The relay keeps refusing this peer's clients: reachable through it in name only."""


def turned_away_lately(totals: Sequence[int], reports: int = TURNED_AWAY_REPORTS) -> int:
    """Clients a relay turned away over its last ``reports`` LOAD reports, from
    its running totals (oldest first; a total that went down counts nothing)."""
    window = list(totals)[-(reports + 1):]
    return max(0, window[-1] - window[0]) if len(window) > 1 else 0


async def measure_rtt(addr: Multiaddr, timeout: float = RTT_TIMEOUT_S, samples: int = RTT_SAMPLES) -> float | None:
    """The best of ``samples`` TCP connects to ``addr``, in ms; None if it never answered."""
    best = None
    for _ in range(samples):
        t0 = time.perf_counter()
        with trio.move_on_after(timeout):
            try:
                stream = await trio.open_tcp_stream(addr.host, addr.port)
            except OSError:
                return best
            ms = (time.perf_counter() - t0) * 1000
            await trio.aclose_forcefully(stream)
            best = ms if best is None else min(best, ms)
            continue
        return best
    return best


class RelayKeeper:
    def __init__(self, node, identity: Identity, local, *, on_change: Callable[[Reservation | None], None],
                 print_line: Callable[[str], None] = print, measure=measure_rtt, verify=relay_dial_check,
                 hold=hold_reservation, allow_loopback: bool = False) -> None:
        self.node = node
        self.identity = identity
        self.local = local  # what serves a relayed client: the server's adopt(), or an address
        self.on_change = on_change  # told of each new reservation, and None when one is lost
        self.print_line = print_line
        self.measure = measure
        # verify(peer_id, relay) -> (ok, why): a dial of this peer through the relay, as a client's
        self.verify = verify
        # hold(relay, identity, local, task_status=): hold_reservation, or the simulator's stand-in
        self.hold = hold
        self.allow_loopback = allow_loopback  # relays on 127.0.0.1: only for a peer on loopback itself
        self.current: Reservation | None = None
        self.set_aside: dict[str, float] = {}  # relay peer id -> until (trio time)
        self.searches = 0
        self._started = False  # (run's task_status is told once)

    async def offers(self) -> list[RelayOffer]:
        """The relays the DHT knows, each with this peer's round trip to it."""
        found = keep_newest({r.signer.multihash: r for r in self.node.records(RELAYS_KEY)},
                            await self.node.get(RELAYS_KEY))
        contents = [r.content for r in found.values() if r.content["peer_id"] != str(self.identity.peer_id)
                    and usable_host(Multiaddr.parse(r.content["addr"]).host, allow_loopback=self.allow_loopback)]
        contents = one_per_network(contents, random)[:MAX_CANDIDATES]
        rtts: dict[str, float | None] = {}
        async with trio.open_nursery() as nursery:
            async def one(c) -> None:
                rtts[c["peer_id"]] = await self.measure(Multiaddr.parse(c["addr"]))

            for c in contents:
                nursery.start_soon(one, c)
        return [RelayOffer.from_record(c, rtts.get(c["peer_id"])) for c in contents]

    def _avoid(self) -> set[str]:
        now = trio.current_time()
        self.set_aside = {p: until for p, until in self.set_aside.items() if until > now}
        return set(self.set_aside)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Keep a reservation for good. Started once the first one is held. A
        failure of the search itself (not a relay's: those are handled below) is
        counted and the search starts again, after a pause: never the end of the peer."""
        guard = Guard("relay_keeper", getattr(self.node, "stats", None))
        while True:
            async with guard:
                await self._keep(task_status)
            if self.current is not None:  # a failure the search did not expect took its reservation along
                self.current = None
                async with guard:
                    self.on_change(None)

    async def _keep(self, task_status) -> None:
        backoff = 1.0
        while True:
            self.searches += 1
            ranked = rank_relays(await self.offers(), me=str(self.identity.peer_id), avoid=self._avoid())
            if not ranked:
                self.print_line(f"no usable relay found; looking again in {backoff:g} s")
                await trio.sleep(backoff * random.uniform(0.75, 1.25))
                backoff = min(backoff * 2, 30.0)
                continue
            for offer in ranked:
                addr = Multiaddr.parse(offer.addr)
                why = leaf = None
                since = trio.current_time()
                try:
                    async with trio.open_nursery() as nursery:
                        held = await nursery.start(self.hold, addr, self.identity, self.local)
                        held.rtt_ms = offer.rtt_ms
                        # a relay that takes the reservation but carries nothing is no relay: try it first
                        await self._check(addr)
                        nursery.start_soon(self._watch, addr)
                        nursery.start_soon(self._watch_load, held)
                        self.current = held
                        self.print_line(f"reserved on relay {offer.peer_id} ({offer.rtt_ms:.1f} ms away)")
                        self.on_change(held)
                        if not self._started:
                            task_status.started(held)
                            self._started = True
                except* (RelayError, OSError, trio.BrokenResourceError, ValueError) as group:
                    leaf = first_error(group)
                    why = str(leaf) or type(leaf).__name__
                if self.current is not None:
                    # it worked a while: a blink (a restart) is retried soon; one that drops at once,
                    # or turns clients away, is not
                    held_for = trio.current_time() - since
                    blink = held_for > 4 * KEEPALIVE_S and not isinstance(leaf, RelayTurnsAway)
                    self.set_aside[offer.peer_id] = trio.current_time() + (LOST_SET_ASIDE_S if blink else SET_ASIDE_S)
                    self.current = None
                    self.on_change(None)
                    self.print_line(f"lost relay {offer.peer_id}: {why}; finding another")
                    backoff = 1.0
                    break  # look again: the swarm may have changed since this search
                self.set_aside[offer.peer_id] = trio.current_time() + SET_ASIDE_S
                self.print_line(f"relay {offer.peer_id} refused: {why}")
            else:  # every relay of this search failed: wait before the next
                await trio.sleep(backoff * random.uniform(0.75, 1.25))
                backoff = min(backoff * 2, 30.0)


    async def _check(self, relay: Multiaddr) -> None:
        ok, why = await self.verify(self.identity.peer_id, relay)
        if not ok:
            raise RelayError(f"a dial through it did not reach this peer ({why})")

    async def _watch(self, relay: Multiaddr) -> None:
        """Dial itself through the relay every VERIFY_INTERVAL_S; two failures in a
        row end the reservation (one may be a busy moment)."""
        failures = 0
        while True:
            await trio.sleep(VERIFY_RETRY_S if failures else VERIFY_INTERVAL_S)
            ok, why = await self.verify(self.identity.peer_id, relay)
            failures = 0 if ok else failures + 1
            if failures >= 2:
                raise RelayError(f"dials through it stopped reaching this peer ({why})")

    async def _watch_load(self, held: Reservation) -> None:
        """Leave a relay that keeps turning this peer's clients away (its LOAD
        reports say so): a stranger holding every circuit, or more clients than
        it carries. Taking back idle circuits (dataplane/circuits.py) makes room
        against one source; this is for many."""
        while True:
            await held.next_report()
            n = turned_away_lately(held.turned_away)
            if n >= TURNED_AWAY_TO_LEAVE:
                raise RelayTurnsAway(f"it turned {n} of this peer's clients away lately (every circuit held)")


__all__ = ["RelayKeeper", "RelayTurnsAway", "measure_rtt", "turned_away_lately", "SET_ASIDE_S"]
