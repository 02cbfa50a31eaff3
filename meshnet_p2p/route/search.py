"""Finding a route: the spans surveyed, a probe of the candidates' round trips,
the cheapest plan over peers not set aside, first contacts side by side, and bans of peers at fault. A search
spends no failover: candidates that fail are set aside until none is left or
the open timeout passes; busy peers are asked again after a backoff."""

from __future__ import annotations

import ipaddress
import random
import time
from collections import Counter
from concurrent import futures
from typing import Callable, Generator

from meshnet_p2p.core.errors import MeshnetError, sanitize
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.swarm.placement import NoRoute, Span

from .errors import GenerationError, RequestRefused, is_full, refuses_the_request
from .hop import Contact, Hop, first_contact, open_hop
from .options import PeerMeasures, RouteOptions
from .probe import PROBES_PER_HOST, probe_candidates, probe_round_trips

# A search's first round contacts its route's peers and, beside them, those of the next-best
# routes up to this many: a first contact is the only measure of a round trip, and a plan
# whose every hop answered stands without a look at what it left out
FIRST_PROBE_WIDTH = 8
PROBE_WIDTH = 16  # first contacts at once, once a search has met a failing candidate...
# ...and, as more fail, as many as have failed, up to this: reports cost nothing to forge, and
# a first contact with a made-up address costs its timeout, so a swarm full of liars must cost
# rounds that grow as the log of their number, not in proportion (400 liars: 7 rounds, not 26)
MAX_PROBE_WIDTH = 256
MIN_GRACE_S = 0.5  # a round's wait, at least, for contacts still out once a route of answered peers stands
MAX_OPEN_TRIES = 1024  # candidates one route search may set aside (a refused dial costs ~1 ms; open_timeout bounds the rest)
BACKOFF_BASE_S = 0.25  # the first wait for busy peers; doubling to BACKOFF_MAX_S
BACKOFF_MAX_S = 4.0


def backoff(waits: int, hint_s: float) -> float:
    """How long to wait before asking busy peers again: exponential, at least
    their own hint (bounded: a hint costs a peer nothing to inflate), jittered so
    clients turned away together do not come back together."""
    base = max(min(BACKOFF_BASE_S * 2 ** waits, BACKOFF_MAX_S), min(hint_s, BACKOFF_MAX_S))
    return base * random.uniform(0.75, 1.25)


def probe_width(route_hops: int, failed: int, first: bool = False) -> int:
    """First contacts to make at once: FIRST_PROBE_WIDTH in a search's first round, then
    the route's own until a candidate has failed, then PROBE_WIDTH, then as many as have
    failed, up to MAX_PROBE_WIDTH."""
    if failed:
        return min(MAX_PROBE_WIDTH, max(PROBE_WIDTH, failed))
    return max(route_hops, FIRST_PROBE_WIDTH) if first else route_hops


def grace_until(began: float, ready: float) -> float:
    """Until when a round of first contacts waits for those still out, once a route of
    peers that answered stood at ``ready`` (the round began at ``began``): as long again,
    at least MIN_GRACE_S. A made-up address hangs for the whole connect timeout; an honest
    peer a little farther than the rest answers within the grace and is weighed."""
    return ready + max(ready - began, MIN_GRACE_S)


def direct_address(span: Span) -> tuple[str, int] | None:
    """The IP address and port a span's report says its peer is reached at directly, or
    None (no report, a relayed peer, a name to resolve, another peer's address)."""
    if span.record is None or span.relayed:
        return None
    addrs = span.record.content.get("addrs") or []
    try:
        addr = Multiaddr.parse(addrs[0])
        ipaddress.ip_address(addr.host or "")
    except (MeshnetError, ValueError, TypeError, IndexError):
        return None
    if addr.port is None or str(addr.peer_id) != span.peer_id:
        return None
    return addr.host, addr.port


def _close_contact(f: futures.Future) -> None:
    """A first contact nobody took: its connection is let go once it is made."""
    if not f.cancelled() and f.exception() is None:
        f.result().client.close()


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
                 measures: PeerMeasures | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.spans_provider = spans_provider
        self.opts = opts
        self.measures = measures if measures is not None else PeerMeasures()
        self.clock = clock  # what bans run out by (the simulator's: virtual time)
        self.spans: list[Span] = []  # empty until the first survey
        self.banned: dict[str, float] = {}  # peer -> until when (``clock``)

    def survey(self) -> None:
        self.spans = self.spans_provider()

    def ban(self, peer: str) -> None:
        self.banned[peer] = self.clock() + self.opts.ban_seconds

    def banned_now(self) -> set[str]:
        now = self.clock()
        return {p for p, until in self.banned.items() if until > now}

    def open_chain(self, start: int, end: int, epoch: int) -> list[Hop]:
        """Open a session (on route ``epoch``) on every hop of the cheapest route for [start, end).

        First the candidates not yet measured are probed (``probe``): each one's round
        trip prices the plans, and those that did not answer are left out of the first.
        Reports cost nothing to forge, so a candidate that fails at first contact
        or session open (dead address, another peer's certificate, a handshake
        that hangs, a refusal) is set aside and the search goes on: that spends
        no failover, only time, bounded by ``open_timeout`` and MAX_OPEN_TRIES.
        First contacts run side by side: the route's new peers at once, and once
        anything has failed, up to PROBE_WIDTH candidates of the next-best
        routes with them (as many as have failed, once more have: up to
        MAX_PROBE_WIDTH), so lies behind addresses that hang cost their timeout
        together, not one after another; a search's first round contacts the
        next-best routes' peers too (FIRST_PROBE_WIDTH). A round ends once its plan
        holds only peers that answered, or a grace (``grace_until``) after a route of
        such peers first stood; what is still out is then left out of this search's
        plans. Hops already open are kept for the next plan. It gives up only when
        no untried route is left, naming what it tried."""
        opts = self.opts
        tried: dict[str, str] = {}
        refused: dict[str, str] = {}  # the subset that refused the request itself
        full: dict[str, float] = {}  # the subset that was full: asked again after a wait (their hint, seconds)
        busy: dict[str, str] = {}  # what full peers said, kept for the error once the deadline passes
        waits = rounds = 0
        slow: set[str] = set()  # still out when their round stopped waiting: not at fault, left out of plans
        contacts: dict[str, Contact] = {}  # first contact made, no session yet
        opened: dict[str, Hop] = {}
        deadline = time.monotonic() + opts.open_timeout
        rediscovered = False
        unanswered = self.probe(start, end, self.banned_now())
        if unanswered:  # not at fault (a lost SYN, a far peer): left out of the first plans, as slow ones are
            opts.on_event(f"{len(unanswered)} candidates did not answer a probe: planning without them first")
            slow |= unanswered

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
                    route = self.plan(start, end, self.banned_now() | set(tried) | slow)
                except NoRoute as e:
                    if slow:  # those left out for answering slowly are all that is left: ask them again
                        slow.clear()
                        continue
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
                batch = self.to_contact(start, end, route, self.banned_now() | set(tried) | slow, known,
                                        probe_width(len(route), len(tried), first=not rounds))
                if batch:
                    rounds += 1
                    pending = {s.peer_id for s in batch}
                    began, ready = time.monotonic(), None

                    def wait_s() -> float | None:
                        return None if ready is None else max(0.0, grace_until(began, ready) - time.monotonic())

                    outcomes = self._first_contacts(batch, wait_s)
                    try:
                        for peer, outcome in outcomes:
                            pending.discard(peer)
                            if isinstance(outcome, Contact):
                                contacts[peer] = outcome
                            else:
                                set_aside(peer, outcome)
                            over, ready = self.settle(start, end, set(tried) | slow, set(opened) | set(contacts),
                                                      pending, ready, time.monotonic())
                            if over:
                                pending.clear()  # the rest of the round is not waited for, nor left out
                                break
                    finally:
                        outcomes.close()
                    if pending:  # still out when the grace ran out: left out of this search's plans
                        opts.on_event(f"not waiting for {len(pending)} slow first contacts")
                        slow |= pending
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

    def probe(self, start: int, end: int, out: set[str]) -> set[str]:
        """Before a first plan: the client's round trip to each candidate not yet measured
        (``probe.py``), into ``measures``; returns the probed peers that did not answer.
        Each address is probed once, and at most PROBES_PER_HOST ports of one IP: a report
        may name anyone's address, and a crowd of them must not make every fresh client
        knock on one victim's door hundreds of times. A peer past that is taken as
        unanswered if no probed port of its IP answered (a crowd of liars on one made-up
        address), else it stays unmeasured (the host is up; its own port is for a first
        contact to find out)."""
        claimants: dict[tuple[str, int], list[str]] = {}
        beyond: dict[str, list[str]] = {}  # host -> peers at ports past PROBES_PER_HOST
        per_host: Counter[str] = Counter()
        for s in probe_candidates(self.spans, start, end, out, self.measures.latency_ms):
            addr = direct_address(s)
            if addr is None:
                continue
            if addr not in claimants:
                if per_host[addr[0]] >= PROBES_PER_HOST:
                    beyond.setdefault(addr[0], []).append(s.peer_id)
                    continue
                per_host[addr[0]] += 1
                claimants[addr] = []
            claimants[addr].append(s.peer_id)
        if not claimants:
            return set()
        answered = self._probe_round_trips({addr: addr for addr in claimants})
        unanswered = set()
        for addr, peers in claimants.items():
            for peer in peers:
                if addr in answered:
                    self.measures.round_trip(peer, answered[addr])
                else:
                    unanswered.add(peer)
        up = {host for host, _ in answered}
        for host, peers in beyond.items():
            if host not in up:
                unanswered.update(peers)
        return unanswered

    def _probe_round_trips(self, targets: dict) -> dict:
        return probe_round_trips(targets)  # the network call (a test's stand-in replaces it)

    def plan(self, start: int, end: int, banned: set[str]) -> list[Span]:
        """The cheapest route over peers not ``banned``, each round trip measured or, if
        not yet, as ``PeerMeasures.round_trips`` prices it."""
        return self.opts.planner(self.spans, start, end, banned=banned,
                                 latency_ms=self.measures.round_trips(self.spans),
                                 measured_ms=self.measures.measured_ms.copy())

    def stands(self, start: int, end: int, tried: set[str], known: set[str]) -> bool:
        """Whether the plan made now, with what first contacts said so far, is of peers
        that all answered (``known``): the round's other contacts cannot change it unless
        they answer with a round trip below the unmeasured price, and waiting for them (a made-up
        address costs its timeout) costs more than that would save. Also when no route is
        left: what is still out cannot make one."""
        try:
            route = self.plan(start, end, self.banned_now() | tried)
        except NoRoute:
            return True
        return all(s.peer_id in known for s in route)

    def settle(self, start: int, end: int, out: set[str], known: set[str], pending: set[str],
               ready: float | None, now: float) -> tuple[bool, float | None]:
        """A round of first contacts after one more answer: whether it is over (its plan
        :meth:`stands`), and since when a route of peers that answered stands without the
        contacts still ``pending`` (``ready``: what the grace for those counts from)."""
        if self.stands(start, end, out, known):
            return True, ready
        if ready is None and self.stands(start, end, out | pending, known):
            ready = now
        return False, ready

    def to_contact(self, start: int, end: int, route: list[Span], banned: set[str], known: set[str],
                    width: int) -> list[Span]:
        """The new peers of ``route``, then those of the next-best routes (each
        planned without the peers already chosen), up to ``width``; none when every
        peer of ``route`` answered already (the plan stands)."""
        if all(s.peer_id in known for s in route):
            return []
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

    def _first_contacts(self, spans: list[Span], wait_s: Callable[[], float | None] = lambda: None,
                        ) -> Generator[tuple[str, "Contact | MeshnetError"], None, None]:
        """First contact with each of ``spans``' peers, side by side: each peer and what
        came of it, in the order they come, until ``wait_s`` (asked before each wait: the
        seconds left, None for no bound) runs out. Closed or run out early, the contacts
        still out finish alone and their connections are closed; a contact the caller took
        is its own. An error that is not a peer's fault (a bug of ours) is raised."""
        pool = futures.ThreadPoolExecutor(max_workers=max(1, len(spans)), thread_name_prefix="first-contact")
        pending = {pool.submit(first_contact, s, self.opts, self.measures): s.peer_id for s in spans}
        handed: set[futures.Future] = set()
        try:
            left = set(pending)
            while left:
                done, left = futures.wait(left, timeout=wait_s(), return_when=futures.FIRST_COMPLETED)
                if not done:
                    return  # the caller waits no longer
                for f in done:
                    e = f.exception()
                    if e is not None and not isinstance(e, MeshnetError):
                        raise e  # not a peer's fault but ours: say so (what opened is closed below)
                    handed.add(f)
                    yield pending[f], (f.result() if e is None else e)
        finally:
            pool.shutdown(wait=False)
            for f in pending:
                if f not in handed:
                    f.add_done_callback(_close_contact)
