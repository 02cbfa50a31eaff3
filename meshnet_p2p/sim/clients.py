"""What the simulated swarm's users do, and what they found against what was true.

- *Model lookups*: a long-lived client's DHT ``get`` of a model's key, against
  the model's volunteers online and announced (recall).
- *Node lookups*: a lookup of a random online public node's ID (is it first?).
- *Surveys*: what ``generate`` does before its first token, with the production
  code: a fresh client-mode node bootstraps, ``swarm.view.fetch_believable``
  gathers reports and the certifier's certificates (gossip, lookups, the
  certifier's homes, asked again when thin), ``build_view`` and
  ``routable_spans`` decide whether a certified route exists, and
  the route search plans it (``_open``). There is no data plane here:
  a planned hop that could not answer (a liar's made-up address, a volunteer
  gone since its report) is set aside as a failed first contact would set it;
  the route that stands is priced against an oracle that knows every link (a
  ring token: each hop's compute, each link from hop to hop, and the tail's
  back to the head).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Iterable

import trio

from meshnet_p2p.route.hop import CONNECT_TIMEOUT_S, ROUND_TRIP_SAMPLES
from meshnet_p2p.route.options import RouteOptions
from meshnet_p2p.route.probe import probe_candidates, probe_wait_s
from meshnet_p2p.route.search import MAX_OPEN_TRIES, RouteSearch, grace_until, probe_width
from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.dht.node import DHTConfig, DHTNode
from meshnet_p2p.dht.routing import key_id
from meshnet_p2p.swarm.capability import model_key
from meshnet_p2p.swarm.node import TYPES, lifetime_cap
from meshnet_p2p.swarm.placement import NoRoute, Span, plan_route
from meshnet_p2p.swarm.view import RecipeNotCertified, build_view, fetch_believable, routable_spans

from .net import RTT_MS, Host
from .records import N_LAYER
from .split import RemotePeerNode

if TYPE_CHECKING:
    from meshnet_p2p.core.identity import PeerId

    from .swarm import Peer, SimSwarm

SETTLED_S = 30.0  # a peer online this long has joined, and a volunteer announced (every 30 s): it should be found
REPLAY_SPEEDUP = 8  # a replay is a prefill: a position costs about 1/8 of a decode step's compute (llama.cpp, CPU)
# a first contact (route/hop.py first_contact): a TCP connect, a TLS 1.3 handshake, the
# capability call, then the calls whose round trips it measures, one after another
FIRST_CONTACT_RTTS = 3 + ROUND_TRIP_SAMPLES
ORACLE_HEADS = 40  # heads the oracle tries (the cheapest by compute): bounds its cost at large N
# Surveys start no later than this before the window's end (at most half the window): a
# look and the generation on its route take ~15-25 simulated seconds at 10,000 peers.
SURVEY_LEAD_S = 30.0


@dataclass
class Measures:
    model_lookups: list[dict] = field(default_factory=list)  # {t, s, recall, found, live}
    missed: list[dict] = field(default_factory=list)  # per volunteer a model lookup missed: {signer, holders, nearest_rank}
    node_lookups: list[dict] = field(default_factory=list)  # {t, s, found, queried}
    surveys: list[dict] = field(default_factory=list)  # {t, s, model, outcome, failed_contacts, contact_rounds, quality, quality_rtt}
    routable_s: list[float] = field(default_factory=list)  # join -> a stranger's lookup finds its report
    never_routable: int = 0
    online_samples: list[int] = field(default_factory=list)
    relayed: list[dict] = field(default_factory=list)  # a NATed volunteer's reservation: {t, s (looking), relay}
    relay_losses: int = 0  # reservations that ended (the relay left, refused or stopped carrying), measured
    relay_samples: list[dict] = field(default_factory=list)  # every 10 s: {natted, held, per_relay (most first)}
    reachability: list[dict] = field(default_factory=list)  # a joining volunteer's check: {natted, status, s}
    coverage: list[dict] = field(default_factory=list)  # every 10 s per model: {model, min, mean} volunteers a layer
    joins: int = 0
    leaves: int = 0
    gossip_held: list[int] = field(default_factory=list)  # at the window's end: records each honest peer's node holds
    grace_s: float = 0.0  # simulated time after the window until its surveys' generations ended
    wall_phases: dict[str, float] = field(default_factory=dict)  # wall seconds: warmup, measured, grace


def carried(p: "Peer") -> bool:
    """Whether clients reach NATed ``p`` through its relay: it holds a reservation on
    one that is online and carries what clients send (not a bad one)."""
    r = p.relay
    return r is not None and r.node is not None and r.relay_behaviour == "honest"


class Clients:
    def __init__(self, sim: "SimSwarm") -> None:
        self.sim = sim
        self.m = sim.m
        self.probe = sim.cfg.probe
        self.rng = random.Random(f"probes/{sim.cfg.seed}")  # which probes are lost
        self._running = 0  # surveys and lookups started in the window and not ended
        self._ended = trio.Event()

    def _settled_volunteers(self, model: int) -> list["Peer"]:
        now = trio.current_time()
        return [p for p in self.sim.online(settled=True) if p.model == model and p.announced_at is not None
                and now - p.announced_at >= SETTLED_S]

    # --- model and node lookups -------------------------------------------------------------

    @property
    def running(self) -> int:
        """Surveys and lookups started in the window and not ended."""
        return self._running

    def _arrivals(self, name: str, rate_per_s: float, until: float):
        """Arrivals of users picking from the peers this process runs: in a run split
        over two processes (split.py), each draws its share from a stream of its own."""
        procs = self.sim.cfg.procs
        return self._poisson(name if procs == 1 else f"{name}/half {self.sim.me}", rate_per_s / procs, until)

    async def _poisson(self, name: str, rate_per_s: float, until: float):
        """A Poisson process of ``rate_per_s`` until ``until``, drawn from a stream of its
        own (yielded at each arrival, for the arrival's own choices): how many arrive in a
        window is then the seed's alone, not moved by what else drew from a shared stream."""
        rng = random.Random(f"{name}/{self.sim.cfg.seed}")
        while True:
            gap = rng.expovariate(rate_per_s)
            if trio.current_time() + gap >= until:
                return
            await trio.sleep(gap)
            yield rng

    async def model_lookups(self, until: float) -> None:
        async for rng in self._arrivals("model lookups", self.sim.cfg.lookups_per_s, until):
            askers = self.sim.online(settled=True, clients=True, local=True)
            if askers:
                self._start(self._model_lookup, rng.choice(askers), rng.randrange(len(self.sim.models)))

    async def _model_lookup(self, asker: "Peer", model: int) -> None:
        side = self.sim.net.side  # during a partition, what the asker's side of it holds
        live = {p.identity.peer_id for p in self._settled_volunteers(model) if side(p.host) == side(asker.host)}
        t0 = trio.current_time()
        node = asker.node
        if node is None:
            return
        try:
            got = await node.get(model_key(self.sim.models[model]))
        except MeshnetError:  # counted as a lookup that found nothing
            got = []
        if asker.node is not node:
            return  # the asker left meanwhile: its node stopped answering itself, not the swarm
        found = {r.signer for r in got}
        self.m.model_lookups.append({"t": t0, "s": trio.current_time() - t0, "live": len(live), "model": model,
                                     "phase": self.sim.phase(t0), "cut_side": side(asker.host),
                                     "found": len(found & live),
                                     "recall": len(found & live) / len(live) if live else 1.0})
        if live - found:
            elsewhere = None
            if self.sim.partner is not None:  # the other process's nodes, asked at the next meeting point
                elsewhere = await self.sim.partner.ask("where_held", model, [p.multihash for p in live - found])
            self.m.missed.extend(self._where_held(model, live - found, elsewhere))

    def held_here(self, model: int, signers: list[bytes]) -> dict[bytes, list[int]]:
        """For the other process of a split run (split.py): which of the DHT servers
        this one runs hold each signer's record under ``model``'s key (peer indices)."""
        key = model_key(self.sim.models[model])
        servers = [p for p in self.sim.online(sybils=True, local=True) if not p.host.natted]
        return {s: [p.index for p in servers if p.node.store.expires_at(key, s) is not None] for s in signers}

    def _where_held(self, model: int, missed: Iterable[PeerId], elsewhere: dict[bytes, list[int]] | None = None
                    ) -> list[dict]:
        """For each volunteer a lookup missed: how many online nodes store its record
        under the model's key, and how far from the key the nearest of them is (its
        rank among the DHT's servers online, nearest 0): a record no reader's lookup
        reaches, or one hardly anyone holds (the oracle's view). ``elsewhere``: the
        holders among the other process's nodes (``held_here``)."""
        key = model_key(self.sim.models[model])
        target = key_id(key.encode())
        servers = sorted((p for p in self.sim.online(sybils=True) if not p.host.natted),
                         key=lambda p: p.node.node_id ^ target)
        out = []
        for peer_id in missed:
            there = set((elsewhere or {}).get(peer_id.multihash, ()))
            ranks = [i for i, p in enumerate(servers)
                     if (p.index in there if isinstance(p.node, RemotePeerNode)
                         else p.node.store.expires_at(key, peer_id.multihash) is not None)]
            out.append({"signer": str(peer_id), "holders": len(ranks), "nearest_rank": ranks[0] if ranks else None})
        return out

    async def node_lookups(self, until: float) -> None:
        async for rng in self._arrivals("node lookups", self.sim.cfg.find_nodes_per_s, until):
            askers, targets = self.sim.online(settled=True, local=True), self.sim.online(settled=True, public=True)
            if askers and targets:
                self._start(self._node_lookup, rng.choice(askers), rng.choice(targets))

    async def _node_lookup(self, asker: "Peer", target: "Peer") -> None:
        node = asker.node
        if node is None or target is asker:
            return
        t0 = trio.current_time()
        try:  # (the private call: a lookup's request count is what is measured)
            result = await node._find_node(target.node.node_id if target.node else 0)
        except MeshnetError:
            result = None
        if asker.node is not node:
            return  # the asker left meanwhile
        if result is None:
            self.m.node_lookups.append({"t": t0, "s": trio.current_time() - t0, "queried": 0, "found": False})
            return
        self.m.node_lookups.append({"t": t0, "s": trio.current_time() - t0, "queried": result.queried,
                                    "found": bool(result.closest) and result.closest[0].peer_id == target.identity.peer_id})

    # --- surveys: a fresh client's way to its first route ------------------------------------

    async def surveys(self, until: float) -> None:
        """Fresh clients arriving (a Poisson process) over the window but its last
        SURVEY_LEAD_S (at most half of it), at the rate raised so that as many arrive:
        the same arrivals as over the whole window, drawn from the same stream, each
        earlier by the window's ratio. So a survey and its generation end inside the
        window, where the swarm is measured, and the run need not go on for them
        after it (a simulated second after the window costs the swarm's whole work,
        as one inside it: 12 % of a 10,000-peer run's wall time, docs/scale.md)."""
        window = until - trio.current_time()
        lead = min(SURVEY_LEAD_S, window / 2)
        if window <= 0:
            return
        rate = self.sim.cfg.surveys_per_s * window / (window - lead)  # (lead <= window / 2)
        procs = self.sim.cfg.procs
        arrival = 0
        async for rng in self._poisson("surveys", rate, until - lead):
            model = rng.randrange(len(self.sim.models))
            if arrival % procs == self.sim.me:  # (a split run: the two processes take turns, split.py)
                self._start(self._survey, model)
            arrival += 1

    def _start(self, fn, *args) -> None:
        self._running += 1
        self.sim.tasks.start_soon(self._to_its_end, fn, *args)

    async def _to_its_end(self, fn, *args) -> None:
        try:
            await fn(*args)
        finally:
            self._running -= 1
            self._ended.set()

    async def reported(self) -> None:
        """Until every survey and lookup started in the window has ended (with a
        survey, the generation on its route): a window's end would otherwise censor
        the slow ones (a thin model's look takes seconds, a generation that waits out
        a vanished hop ten more, a lookup a few) and bias what is reported."""
        while self._running:
            await self._ended.wait()
            self._ended = trio.Event()

    async def _look(self, model: int, host) -> tuple[list[Span] | str, int, int, frozenset[str]]:
        """What ``generate`` does to see the model's certified spans (a first look and
        every failover's): a new client-mode node on ``host`` bootstraps and runs
        ``fetch_believable``, ``build_view`` and ``routable_spans``. (the spans, or
        "dark"/"hole"; reports and certificates found; the peers it holds verified: those
        of a trusted certificate's route and those a trusted certifier's verdicts vouch
        for, as api.py's ``spans`` vouches for them)."""
        sim = self.sim
        digest = sim.models[model]
        node = DHTNode(sim.fresh_identity(), sim.net.attach(host), TYPES,
                       DHTConfig(**{**sim.cfg.dht.__dict__, "client_mode": True}), now_ms=sim.now_ms,
                       lifetime_cap=lifetime_cap)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                for timeout in (None, 2.0, 5.0):  # as start_node
                    if await node.bootstrap(sim.seeds, timeout=timeout):
                        break
                reports, certs = await fetch_believable(node, digest, sim.trust, N_LAYER)
                nursery.cancel_scope.cancel()
        finally:
            node.transport.close()
        view = build_view(digest, N_LAYER, reports, certs, sim.trust)
        vouched = frozenset({p for r in view.certified() for p, _, _ in r.certificate.route}
                            | view.verified_by_certifiers())
        try:
            return routable_spans(view, sim.trust), len(reports), len(certs), vouched
        except RecipeNotCertified:
            return "dark", len(reports), len(certs), vouched
        except NoRoute:
            return "hole", len(reports), len(certs), vouched

    async def _survey(self, model: int) -> None:
        host = self.sim.net.host(natted=True)  # a user's machine, behind its home router
        t0 = trio.current_time()
        spans, n_reports, n_certs, vouched = await self._look(model, host)
        entry = {"t": t0, "s": trio.current_time() - t0, "model": model, "reports": n_reports,
                 "phase": self.sim.phase(t0), "cut_side": self.sim.net.side(host),
                 "certs": n_certs, "failed_contacts": 0, "contact_rounds": 0, "quality": None}
        if isinstance(spans, str):
            entry["outcome"] = spans
            self.m.surveys.append(entry)
            return
        entry["vouched"] = sum(1 for s in spans if s.peer_id in vouched)
        search = self._search(spans, vouched)
        answering = self._answering()
        opened = await self._open(search, 0, N_LAYER, answering, host)
        entry.update({k: v for k, v in opened.items() if k != "route"})
        if opened["outcome"] == "route":
            entry.update(self._quality(host, spans, opened["route"], answering))
        self.m.surveys.append(entry)
        if opened["outcome"] == "route" and self.sim.cfg.generation_tokens:
            await self._generate(model, host, search, opened["route"], entry)

    @staticmethod
    def _planner(vouched: frozenset[str]):
        """api.py's planner for a fresh client: it holds verified records of the ``vouched`` peers only."""
        return functools.partial(plan_route, prefer=vouched)

    @classmethod
    def _search(cls, spans: list[Span], vouched: frozenset[str] = frozenset()) -> RouteSearch:
        """The client's route search over ``spans``, preferring the ``vouched`` peers."""
        search = RouteSearch(lambda: spans, SimpleNamespace(planner=cls._planner(vouched),
                                                            ban_seconds=RouteOptions.ban_seconds),
                             clock=trio.current_time)
        search.survey()
        return search

    async def _open(self, search: RouteSearch, start: int, end: int, answering: dict[str, "Peer"], host,
                    *, spend: bool = True) -> dict:
        """The route search's own decisions for layers [start, end) (``route.search.RouteSearch``:
        the plan, whom to contact in each round (``to_contact``, ``probe_width``: wider in
        the first round and as candidates fail), when a round's plan stands without the
        contacts still out (``stands``), each round trip an answer measures
        (``PeerMeasures.round_trip``) and what the unmeasured are priced at, ``settle`` and
        the grace a round gives contacts still out once a route of answered peers stands), with each first
        contact's outcome known here. A peer that answers does so in FIRST_CONTACT_RTTS
        round trips from the client on ``host``; one that cannot (a liar's made-up address,
        a volunteer gone since its report) fails after the first contact's timeout and is
        banned, as production bans it. A round takes until its plan stood (``spend=False``:
        no time passes, a what-if). ``answering``: who answers now."""
        tried: set[str] = set()  # set aside
        known: set[str] = set()  # answered their first contact
        slow: set[str] = set()  # still out when their round stopped waiting
        rounds, abandoned, t0 = 0, 0, trio.current_time()
        if self.probe:
            took, slow = self._probe(search, start, end, answering, host)
            if spend:
                await trio.sleep(took)

        def done(outcome: str, **more) -> dict:
            return {"outcome": outcome, "failed_contacts": len(tried), "contact_rounds": rounds,
                    "abandoned_contacts": abandoned, "open_s": trio.current_time() - t0, **more}

        while len(tried) < MAX_OPEN_TRIES:
            try:
                route = search.plan(start, end, search.banned_now() | tried | slow)
            except NoRoute:
                if slow:
                    slow.clear()
                    continue
                return done("no live route")
            batch = search.to_contact(start, end, route, search.banned_now() | tried | slow, known,
                                      probe_width(len(route), len(tried), first=not rounds))
            if not batch:
                return done("route", hops=len(route), route=route)
            rounds += 1
            outcomes = []
            for s in batch:
                peer = answering.get(s.peer_id)
                rtt = 2 * self._client_link_s(host, peer) if peer is not None else None
                outcomes.append((CONNECT_TIMEOUT_S if rtt is None else FIRST_CONTACT_RTTS * rtt, s.peer_id, rtt))
            pending, ready, took = {s.peer_id for s in batch}, None, 0.0
            for at, peer_id, rtt in sorted(outcomes):  # in the order they come
                if ready is not None and at > grace_until(0.0, ready):
                    took = grace_until(0.0, ready)  # the rest are not waited for, and left out
                    break
                took = at
                pending.discard(peer_id)
                if rtt is not None:
                    known.add(peer_id)
                    search.measures.round_trip(peer_id, rtt * 1000)
                else:
                    tried.add(peer_id)
                    search.ban(peer_id)
                over, ready = search.settle(start, end, tried | slow, known, pending, ready, at)
                if over:
                    pending.clear()  # the rest of the round is not waited for, nor left out
                    break
            slow |= pending
            abandoned += len(pending)
            if spend:
                await trio.sleep(took)
        return done("gave up")

    def _probe(self, search: RouteSearch, start: int, end: int, answering: dict[str, "Peer"], host
               ) -> tuple[float, set[str]]:
        """``RouteSearch.probe`` before the first plan: whom it connects to
        (``probe_candidates``), each answer after a round trip from the client (a
        made-up address, a volunteer gone since its report, a SYN or its answer lost:
        none), how long it waits (``probe_wait_s``), the round trips it measures.
        Returns the wait and the probed that did not answer in it. A NATed volunteer's
        report names its relay (production probes none of those). Every simulated peer
        has an address of its own, so production's bound of probes per IP never binds here."""
        loss = self.sim.net.model.loss
        targets = [s for s in probe_candidates(search.spans, start, end, search.banned_now(), search.measures.latency_ms)
                   if not (s.peer_id in self.sim.by_id and self.sim.by_id[s.peer_id].host.natted)]
        answers = sorted((2 * self._client_link_s(host, answering[s.peer_id]), s.peer_id) for s in targets
                         if s.peer_id in answering and self.rng.random() >= 1 - (1 - loss) ** 2)
        after: list[float] = []
        for at, peer_id in answers:
            if at > probe_wait_s(after, len(targets)):
                break
            after.append(at)
            search.measures.round_trip(peer_id, at * 1000)
        measured = set(search.measures.latency_ms)
        return probe_wait_s(after, len(targets)), {s.peer_id for s in targets} - measured

    def _answering(self) -> dict[str, "Peer"]:
        """The volunteers a first contact reaches: online, honest, and with relays in the
        simulation, public or holding a reservation on a relay that carries clients."""
        relays = self.sim.cfg.relays + self.sim.cfg.bad_relays
        return {str(p.identity.peer_id): p for p in self.sim.online() if p.sybil is None and p.model is not None
                and not (relays and p.host.natted and not carried(p))}

    def _quality(self, client_host, spans: list[Span], route: list[Span], answering: dict[str, "Peer"]) -> dict:
        """The route that stands, priced against the oracle; and the route the same
        planner finds after measuring the client's round trip to every live candidate
        (what first contacts tell the planner; no client measures them all)."""
        live = [s for s in spans if s.peer_id in answering]
        best = self._oracle_ms(live, answering)
        got = self._ring_ms([answering[s.peer_id] for s in route])
        rtt = {p: 2000 * self._client_link_s(client_host, answering[p]) for p in answering}
        near = plan_route(live, 0, N_LAYER, latency_ms=rtt, prefer=frozenset())
        informed = self._ring_ms([answering[s.peer_id] for s in near])
        return {"quality": got / best if best else None, "quality_rtt": informed / best if best else None}

    # --- a generation on the route, failing over as peers leave ----------------------------------

    async def _generate(self, model: int, host, search: RouteSearch, route: list[Span], entry: dict) -> None:
        """``generation_tokens`` ring tokens on ``route``, each taking the ring's time
        (compute, hop-to-hop links, the tail's link back). A hop whose peer left (its
        session gone with its node) fails the next step, and the client fails over as
        route/failover.py does: a failover spent (at most RouteOptions.max_failovers),
        the peer banned, a fresh look at the swarm (``_look``, as the provider's second
        look surveys afresh), a replacement for the hop's layers opened by the route
        search, its inputs replayed (a prefill of every position so far on the new hops).
        The client notices a departure at its next step when the peer's process exited
        (its connections closed); when its machine vanished (``Peer.vanished``: no FIN),
        only once that step's timeout (RouteOptions.step_timeout) has passed: ``stalled_s``."""
        peers = {p: self.sim.by_id[p] for p in {s.peer_id for s in route}}
        nodes = {p: q.node for p, q in peers.items()}  # a hop's session lives in this node's run
        t0, left, failovers, stalled = trio.current_time(), self.sim.cfg.generation_tokens, 0, 0.0
        max_failovers = RouteOptions.max_failovers
        while True:
            hops = [peers[s.peer_id] for s in route]
            token_s = self._ring_ms(hops) / 1000
            while left and all(peers[s.peer_id].node is nodes[s.peer_id] for s in route):
                await trio.sleep(token_s)
                left -= 1
            gone = [i for i, s in enumerate(route) if peers[s.peer_id].node is not nodes[s.peer_id]]
            if not gone:
                break
            if any(peers[route[i].peer_id].vanished for i in gone):  # no FIN: the step waits out its timeout
                wait = max(0.0, RouteOptions.step_timeout - token_s)
                stalled += wait
                await trio.sleep(wait)
            left += 1  # the step that failed is taken again
            failovers += 1
            index = gone[-1]
            failed = route[index]
            if failovers > max_failovers:
                entry["generation"] = "too many failovers"
                break
            search.ban(failed.peer_id)
            spans, _, _, vouched = await self._look(model, host)
            if isinstance(spans, str):
                entry["generation"] = f"failover found {spans}"
                break
            search.spans = spans
            search.opts.planner = self._planner(vouched)
            answering = self._answering()
            opened = await self._open(search, failed.start, failed.end, answering, host)
            if opened["outcome"] != "route":
                # route/failover.py replaces the failed hop's layers exactly; would a whole new route have done?
                whole = (await self._open(search, 0, N_LAYER, answering, host, spend=False))["outcome"] == "route"
                entry["generation"] = f"failover: {opened['outcome']}" + (" (a whole new route existed)" if whole else "")
                break
            new = opened["route"]
            for s in new:
                peers[s.peer_id] = self.sim.by_id[s.peer_id]
                nodes[s.peer_id] = peers[s.peer_id].node
            done = self.sim.cfg.generation_tokens - left
            replay_s = sum(peers[s.peer_id].layer_ms * (s.end - s.start) for s in new) * \
                (1 + done / REPLAY_SPEEDUP) / 1000
            await trio.sleep(replay_s)
            route = route[:index] + new + route[index + 1:]
        entry.setdefault("generation", "complete")
        entry["failovers"] = failovers
        entry["stalled_s"] = stalled
        entry["generation_s"] = trio.current_time() - t0

    def _client_link_s(self, host, b: "Peer") -> float:
        """One way from a client on ``host`` to hop ``b``: direct, or through its relay."""
        one_way = self.sim.net.one_way_s
        relay = b.relay
        return one_way(host, b.host) if relay is None else one_way(host, relay.host) + one_way(relay.host, b.host)

    def _link_s(self, a: "Peer", b: "Peer") -> float:
        """One way from hop ``a`` to hop ``b``: direct, or through ``b``'s relay when it
        is behind one (``a`` dials ``b``; a NATed ``a`` dials out directly)."""
        return self._client_link_s(a.host, b)

    def _ring_ms(self, hops: list["Peer"]) -> float:
        """A token's time around a ring of ``hops``: compute, hop to hop, tail to head."""
        links = sum(self._link_s(a, b) for a, b in zip(hops, hops[1:] + hops[:1])) if len(hops) > 1 else 0.0
        return sum(h.compute_ms for h in hops) + links * 1000

    def _oracle_ms(self, spans: list[Span], peers: dict[str, "Peer"]) -> float | None:
        """The fastest ring over ``spans`` (boundary to boundary), knowing every link:
        for each head, the cheapest chain to every span by dynamic programming over
        the spans in order of their start, closed by the tail's link back.

        A link's one-way time is the two regions' delay plus each end's access delay
        (``SimNetwork.one_way_s``; into a peer behind a relay, to the relay and on), so
        the cheapest way into a span from every span ending where it starts is the
        cheapest per region the senders are in: a boundary keeps, per region, the least
        of (a chain's cost + its last hop's access delay), and a span pays its region's
        delay from each of those few. Pairing every span with every span ending where
        it starts instead was 29 % of a profile of a measured minute at 3,000 peers of
        one model (docs/scale.md)."""
        one_way = self.sim.net.one_way_s
        by_start: dict[int, list[Span]] = {}
        for s in spans:
            by_start.setdefault(s.start, []).append(s)
        starts = sorted(by_start)
        into: dict[str, tuple[Host, float]] = {}  # a span's way in: the host dialled first, and the rest of the way (s)
        for s in spans:
            relay = peers[s.peer_id].relay
            into[s.peer_id] = (peers[s.peer_id].host, 0.0) if relay is None else \
                (relay.host, one_way(relay.host, peers[s.peer_id].host))
        heads = sorted(by_start.get(0, []), key=lambda s: peers[s.peer_id].compute_ms)[:ORACLE_HEADS]
        best = None
        for head in heads:
            h = peers[head.peer_id]
            if head.end == N_LAYER:  # one hop: no link
                best = h.compute_ms if best is None else min(best, h.compute_ms)
                continue
            # boundary -> region -> the cheapest chain from the head ending there, plus its last hop's access (ms)
            ending: dict[int, dict[str, float]] = {head.end: {h.host.region: h.compute_ms + 1000 * h.host.access_s}}
            for start in starts:
                arriving = ending.get(start)
                if arriving is None:
                    continue
                for b in by_start[start]:
                    if b.peer_id == head.peer_id:
                        continue
                    pb = peers[b.peer_id]
                    entry, rest = into[b.peer_id]
                    c = min(m + RTT_MS[region, entry.region] / 2 for region, m in arriving.items()) \
                        + 1000 * (entry.access_s + rest) + pb.compute_ms
                    if b.end == N_LAYER:
                        total = c + self._link_s(pb, h) * 1000
                        best = total if best is None else min(best, total)
                        continue
                    slot = ending.setdefault(b.end, {})
                    c += 1000 * pb.host.access_s
                    if c < slot.get(pb.host.region, float("inf")):
                        slot[pb.host.region] = c
        return best
