"""Finding a route: the spans surveyed, the cheapest plan over peers not set
aside, first contacts side by side, and bans of peers at fault. A search
spends no failover: candidates that fail are set aside until none is left or
the open timeout passes; busy peers are asked again after a backoff."""

from __future__ import annotations

import random
import time
from concurrent import futures
from typing import Callable

from meshnet_p2p.core.errors import MeshnetError, sanitize
from meshnet_p2p.swarm.placement import NoRoute, Span

from .errors import GenerationError, RequestRefused, is_full, refuses_the_request
from .hop import Contact, Hop, first_contact, open_hop
from .options import PeerMeasures, RouteOptions

PROBE_WIDTH = 16  # first contacts at once, once a search has met a failing candidate...
# ...and, as more fail, as many as have failed, up to this: reports cost nothing to forge, and
# a first contact with a made-up address costs its timeout, so a swarm full of liars must cost
# rounds that grow as the log of their number, not in proportion (400 liars: 7 rounds, not 26)
MAX_PROBE_WIDTH = 256
MAX_OPEN_TRIES = 1024  # candidates one route search may set aside (a refused dial costs ~1 ms; open_timeout bounds the rest)
BACKOFF_BASE_S = 0.25  # the first wait for busy peers; doubling to BACKOFF_MAX_S
BACKOFF_MAX_S = 4.0


def backoff(waits: int, hint_s: float) -> float:
    """How long to wait before asking busy peers again: exponential, at least
    their own hint (bounded: a hint costs a peer nothing to inflate), jittered so
    clients turned away together do not come back together."""
    base = max(min(BACKOFF_BASE_S * 2 ** waits, BACKOFF_MAX_S), min(hint_s, BACKOFF_MAX_S))
    return base * random.uniform(0.75, 1.25)


def probe_width(route_hops: int, failed: int) -> int:
    """First contacts to make at once: the route's own until a candidate has failed,
    then PROBE_WIDTH, then as many as have failed, up to MAX_PROBE_WIDTH."""
    return min(MAX_PROBE_WIDTH, max(PROBE_WIDTH, failed)) if failed else route_hops


def _tried_text(tried: dict[str, str]) -> str:
    if not tried:
        return ""
    shown = "; ".join(f"{peer[-8:]}: {sanitize(why)[:120]}" for peer, why in list(tried.items())[:4])
    more = f" and {len(tried) - 4} more" if len(tried) > 4 else ""
    return f" (tried {len(tried)} peers: {shown}{more})"


class RouteSearch:
    """One route's view of the swarm for its whole life: the spans it plans over
    (``survey`` asks ``spans_provider`` again) and the peers it banned."""

    def __init__(self, spans_provider: Callable[[], list[Span]], opts: RouteOptions,
                 measures: PeerMeasures | None = None) -> None:
        self.spans_provider = spans_provider
        self.opts = opts
        self.measures = measures if measures is not None else PeerMeasures()
        self.spans: list[Span] = []  # empty until the first survey
        self.banned: dict[str, float] = {}  # peer -> until when (monotonic)

    def survey(self) -> None:
        self.spans = self.spans_provider()

    def ban(self, peer: str) -> None:
        self.banned[peer] = time.monotonic() + self.opts.ban_seconds

    def banned_now(self) -> set[str]:
        now = time.monotonic()
        return {p for p, until in self.banned.items() if until > now}

    def open_chain(self, start: int, end: int, epoch: int) -> list[Hop]:
        """Open a session (on route ``epoch``) on every hop of the cheapest route for [start, end).

        Reports cost nothing to forge, so a candidate that fails at first contact
        or session open (dead address, another peer's certificate, a handshake
        that hangs, a refusal) is set aside and the search goes on: that spends
        no failover, only time, bounded by ``open_timeout`` and MAX_OPEN_TRIES.
        First contacts run side by side: the route's new peers at once, and once
        anything has failed, up to PROBE_WIDTH candidates of the next-best
        routes with them (as many as have failed, once more have: up to
        MAX_PROBE_WIDTH), so lies behind addresses that hang cost their timeout
        together, not one after another. Hops already open are kept for the next
        plan. It gives up only when no untried route is left, naming what it tried."""
        opts = self.opts
        tried: dict[str, str] = {}
        refused: dict[str, str] = {}  # the subset that refused the request itself
        full: dict[str, float] = {}  # the subset that was full: asked again after a wait (their hint, seconds)
        busy: dict[str, str] = {}  # what full peers said, kept for the error once the deadline passes
        waits = 0
        contacts: dict[str, Contact] = {}  # first contact made, no session yet
        opened: dict[str, Hop] = {}
        deadline = time.monotonic() + opts.open_timeout
        rediscovered = False

        def set_aside(peer: str, e: MeshnetError) -> None:
            tried[peer] = str(e)
            if refuses_the_request(e):  # rightly refused: set aside for this search, not banned
                refused[peer] = str(e)
            elif is_full(e):  # busy, not faulty: tried again once the search has waited
                full[peer] = getattr(e, "retry_after_s", 0.0)
            else:  # anything else is the peer's fault
                self.ban(peer)
            opts.on_event(f"cannot open a session on {peer}: {e}")

        try:
            while True:
                if len(tried) >= MAX_OPEN_TRIES or time.monotonic() > deadline:
                    why = f"{opts.open_timeout:g} s: the peers that serve them stayed busy ({waits} waits)" if waits \
                        else f"{len(tried)} tries"
                    raise GenerationError(f"could not open a route for layers {start}-{end - 1} in {why}"
                                          + _tried_text({**busy, **tried}))
                try:
                    route = self.plan(start, end, self.banned_now() | set(tried))
                except NoRoute as e:
                    if tried and not rediscovered:  # the swarm may have changed while we tried
                        rediscovered = True
                        self.survey()
                        continue
                    if full and time.monotonic() < deadline:  # busy peers: wait our turn, then ask them again
                        pause = min(backoff(waits, max(full.values())), max(0.0, deadline - time.monotonic()))
                        opts.on_event(f"every peer that serves layers {start}-{end - 1} is busy "
                                      f"({len(full)} full); asking again in {pause:.1f} s")
                        # While it waits, this search holds no session it opened (a failover's other
                        # hops stay open: their caches are this generation's; see docs/swarm.md)
                        for hop in opened.values():
                            hop.close()
                        opened.clear()
                        time.sleep(pause)
                        waits += 1
                        for peer in full:
                            busy[peer] = tried.pop(peer, "busy")
                        full.clear()
                        rediscovered = False
                        continue
                    if tried and len(refused) == len(tried):
                        raise RequestRefused(f"the request was refused by every peer that could serve layers "
                                             f"{start}-{end - 1}: {sanitize(next(iter(refused.values())))}") from None
                    waited = f" after waiting {waits} times for busy peers" if waits else ""
                    raise GenerationError(f"could not open a route for layers {start}-{end - 1}{waited}: {e}"
                                          + _tried_text(tried)) from None
                known = set(opened) | set(contacts)
                if any(s.peer_id not in known for s in route):
                    width = probe_width(len(route), len(tried))
                    batch = self.to_contact(start, end, route, self.banned_now() | set(tried), known, width)
                    for peer, outcome in self._first_contacts(batch).items():
                        if isinstance(outcome, Contact):
                            contacts[peer] = outcome
                        else:
                            set_aside(peer, outcome)
                    continue  # plan again with what was learned
                try:
                    for span in route:
                        if span.peer_id not in opened:
                            opened[span.peer_id] = open_hop(contacts.pop(span.peer_id), opts, epoch)
                    return [opened.pop(span.peer_id) for span in route]
                except MeshnetError as e:  # typed peer errors and broken connections included
                    set_aside(next(s.peer_id for s in route if s.peer_id not in opened), e)
        finally:
            for hop in opened.values():  # opened for a plan that was not taken
                hop.close()
            for contact in contacts.values():
                contact.client.close()

    def plan(self, start: int, end: int, banned: set[str]) -> list[Span]:
        return self.opts.planner(self.spans, start, end, banned=banned, latency_ms=self.measures.latency_ms,
                                 measured_ms=self.measures.measured_ms)

    def to_contact(self, start: int, end: int, route: list[Span], banned: set[str], known: set[str],
                    width: int) -> list[Span]:
        """The new peers of ``route``, then those of the next-best routes (each
        planned without the peers already chosen), up to ``width``."""
        batch = {s.peer_id: s for s in route if s.peer_id not in known}
        skip = banned | set(batch)
        while len(batch) < width:
            try:
                new = [s for s in self.plan(start, end, skip) if s.peer_id not in known]
            except NoRoute:
                break
            if not new:  # a route of peers already contacted: nothing more to learn here
                break
            for s in new[: width - len(batch)]:
                batch[s.peer_id] = s
            skip |= {s.peer_id for s in new}
        return list(batch.values())

    def _first_contacts(self, spans: list[Span]) -> dict[str, "Contact | MeshnetError"]:
        """First contact with each of ``spans``' peers, side by side."""
        with futures.ThreadPoolExecutor(max_workers=max(1, len(spans)), thread_name_prefix="first-contact") as pool:
            pending = {s.peer_id: pool.submit(first_contact, s, self.opts, self.measures) for s in spans}
        out: dict[str, Contact | MeshnetError] = {}
        for peer, f in pending.items():
            e = f.exception()
            out[peer] = f.result() if e is None else e
        bug = next((e for e in out.values() if isinstance(e, BaseException) and not isinstance(e, MeshnetError)), None)
        if bug is not None:  # not a peer's fault but ours: close what opened, and say so
            for c in out.values():
                if isinstance(c, Contact):
                    c.client.close()
            raise bug
        return out
