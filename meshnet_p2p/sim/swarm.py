"""A swarm of real DHT nodes on the simulated internet, with churn, in virtual time.

Every peer runs the production ``DHTNode`` (routing table, lookups along disjoint
paths, gossip, record verification, cookies, rate limits, republishing) on a
``SimTransport``, with the clock the simulation keeps (``now_ms``: records are
signed and checked in simulated time). Volunteers announce signed capability
reports for one of a few models every ANNOUNCE_INTERVAL_S, as ``join`` does;
peers behind NAT run in client mode, as ``join`` decides for a peer no dialer
reached. Clients look up a model's peers and random nodes, and the run reports
what they found against what was true (``Measures``).
"""

from __future__ import annotations

import random
import resource
import time
from collections import Counter
from dataclasses import dataclass, field

import trio

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.dht.node import DHTConfig, DHTNode
from meshnet_p2p.dht.routing import Contact
from meshnet_p2p.roles.join import ANNOUNCE_INTERVAL_S
from meshnet_p2p.swarm.capability import model_key
from meshnet_p2p.swarm.node import TYPES, lifetime_cap
from meshnet_p2p.testing import sample_report

from .churn import Churn
from .crypto import stand_in_signatures
from .net import Host, NetModel, SimNetwork

EPOCH_MS = 1_800_000_000_000  # the simulated wall clock at time 0 (records carry wall-clock times)
SETTLED_S = 30.0  # a peer online this long has joined, and a volunteer announced (every 30 s): it should be found


@dataclass
class SimConfig:
    peers: int = 1000
    minutes: float = 10.0  # simulated time measured, after the warm-up
    warmup_minutes: float = 2.0  # simulated time for the starting swarm to join, not measured
    seed: int = 1
    models: int = 4
    volunteer_share: float = 0.5  # the others are clients: they look models up
    nat_share: float = 0.3
    bootstrap: int = 8  # always-online bootstrap peers (public, not counted as volunteers)
    lookups_per_s: float = 2.0  # model lookups by clients, over the whole swarm
    find_nodes_per_s: float = 1.0  # lookups of a random online node's ID
    churn: Churn = field(default_factory=Churn)
    net: NetModel = field(default_factory=NetModel)
    dht: DHTConfig = field(default_factory=DHTConfig)


@dataclass
class Peer:
    index: int
    identity: Identity
    host: Host
    model: int | None  # the model it serves; None: a client
    online_since: float | None = None
    node: DHTNode | None = None
    scope: trio.CancelScope | None = None
    announced_at: float | None = None  # its first announce of this session stored


@dataclass
class Measures:
    model_lookups: list[dict] = field(default_factory=list)  # {t, s, recall, found, live}
    node_lookups: list[dict] = field(default_factory=list)  # {t, s, found, queried}
    routable_s: list[float] = field(default_factory=list)  # join -> a stranger's lookup finds its report
    never_routable: int = 0
    online_samples: list[int] = field(default_factory=list)
    joins: int = 0
    leaves: int = 0


def _identity(seed: int, i: int) -> Identity:
    return Identity.from_seed(random.Random(seed * 1_000_003 + i).randbytes(32))


class SimSwarm:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.net = SimNetwork(self.rng, cfg.net)
        self.models = [f"{m:02x}" * 32 for m in range(1, cfg.models + 1)]
        self.peers: list[Peer] = []
        self.m = Measures()
        self.measuring = False
        self.seeds: list[Contact] = []
        self.kinds: Counter[str] = Counter()  # requests sent while measuring, by kind
        self._kinds_at_start: dict[int, dict] = {}  # node -> its counts when measuring began

    def now_ms(self) -> int:
        return EPOCH_MS + int(trio.current_time() * 1000)

    def online(self, *, settled: bool = False, public: bool = False, clients: bool | None = None) -> list[Peer]:
        now = trio.current_time()
        return [p for p in self.peers if p.node is not None and p.node.running
                and (not settled or now - p.online_since >= SETTLED_S)
                and (not public or not p.host.natted)
                and (clients is None or (p.model is None) == clients)]

    # --- peers coming and going -----------------------------------------------------------------

    async def _serve(self, p: Peer) -> None:
        """One online session of ``p``: start its node, join, announce until cancelled."""
        natted = p.host.natted
        node = DHTNode(p.identity, self.net.attach(p.host), TYPES,
                       DHTConfig(**{**self.cfg.dht.__dict__, "client_mode": natted}),
                       now_ms=self.now_ms, lifetime_cap=lifetime_cap)
        started = trio.current_time()
        p.announced_at = None  # this session has announced nothing yet
        try:
            async with trio.open_nursery() as inner:
                await inner.start(node.run)
                p.node, p.online_since = node, started
                if self.measuring:
                    self.m.joins += 1
                if p.index >= self.cfg.bootstrap:
                    seeds = self.seeds
                    for timeout in (None, 2.0, 5.0):  # as start_node: a late answer is not none
                        if await node.bootstrap(seeds, timeout=timeout):
                            break
                if p.model is not None:
                    inner.start_soon(self._announce, p, node, started)
        finally:
            node.transport.close()
            p.node = None
            self._count(node)

    def _count(self, node: DHTNode) -> None:
        """Add what ``node`` sent, by kind, to the run's totals (while measuring)."""
        if self.measuring:
            start = self._kinds_at_start.pop(id(node), {})
            for k, v in node.stats.items():
                if k.startswith("sent_"):
                    self.kinds[k[5:]] += v - start.get(k, 0)

    async def _announce(self, p: Peer, node: DHTNode, started: float) -> None:
        digest = self.models[p.model]
        first = True
        while True:
            now = self.now_ms()
            report = sample_report(p.identity, digest, layers=(0, 10)).sign(p.identity, seq=now, now_ms=now)
            try:
                await node.publish(model_key(digest), report)
            except MeshnetError:  # as join: this announce failed, the next may not
                await trio.sleep(ANNOUNCE_INTERVAL_S)
                continue
            if first:
                first = False
                p.announced_at = trio.current_time()
                if self.measuring:
                    trio.lowlevel.spawn_system_task(self._probe_routable, p, started)
            await trio.sleep(ANNOUNCE_INTERVAL_S)

    async def _probe_routable(self, p: Peer, started: float) -> None:
        """How long until a stranger's lookup of the model finds ``p``'s report."""
        key = model_key(self.models[p.model])
        for wait in (0.0, 5.0, 15.0, 45.0):
            await trio.sleep(wait)
            askers = [q for q in self.online(settled=True, clients=True) if q is not p]
            if not askers or p.node is None:
                return
            node = self.rng.choice(askers).node
            try:
                got = await node.get(key)
            except MeshnetError:
                continue
            if any(r.signer == p.identity.peer_id for r in got):
                self.m.routable_s.append(trio.current_time() - started)
                return
        self.m.never_routable += 1

    async def _lifecycle(self, p: Peer) -> None:
        """Online sessions and offline gaps, for ever (bootstrap peers stay)."""
        churn, rng = self.cfg.churn, random.Random(self.rng.random())
        always = p.index < self.cfg.bootstrap
        online = always or churn.online_at_start(rng)
        first = True
        while True:
            if online:
                length = None if always else (churn.remaining(rng) if first else churn.session(rng))
                with trio.move_on_after(length if length is not None else float("inf")) as scope:
                    p.scope = scope
                    await self._serve(p)
                    await trio.sleep_forever()
                if self.measuring:
                    self.m.leaves += 1
            else:
                await trio.sleep(churn.gap(rng) * (rng.random() if first else 1.0))
            online, first = not online, False

    # --- what clients do -------------------------------------------------------------------------

    async def _model_lookups(self) -> None:
        while True:
            await trio.sleep(self.rng.expovariate(self.cfg.lookups_per_s))
            askers = self.online(settled=True, clients=True)
            if askers:
                trio.lowlevel.spawn_system_task(self._model_lookup, self.rng.choice(askers), self.rng.randrange(len(self.models)))

    async def _model_lookup(self, asker: Peer, model: int) -> None:
        live = {p.identity.peer_id for p in self.online(settled=True) if p.model == model
                and p.announced_at is not None and trio.current_time() - p.announced_at >= SETTLED_S}
        t0 = trio.current_time()
        node = asker.node
        if node is None:
            return
        try:
            got = await node.get(model_key(self.models[model]))
        except MeshnetError:  # counted as a lookup that found nothing
            got = []
        found = {r.signer for r in got}
        self.m.model_lookups.append({"t": t0, "s": trio.current_time() - t0, "live": len(live),
                                     "found": len(found & live),
                                     "recall": len(found & live) / len(live) if live else 1.0})

    async def _node_lookups(self) -> None:
        while True:
            await trio.sleep(self.rng.expovariate(self.cfg.find_nodes_per_s))
            askers, targets = self.online(settled=True), self.online(settled=True, public=True)
            if askers and targets:
                trio.lowlevel.spawn_system_task(self._node_lookup, self.rng.choice(askers), self.rng.choice(targets))

    async def _node_lookup(self, asker: Peer, target: Peer) -> None:
        node = asker.node
        if node is None or target is asker:
            return
        t0 = trio.current_time()
        try:  # (the private call: a lookup's request count is what is measured)
            result = await node._find_node(target.node.node_id if target.node else 0)
        except MeshnetError:
            self.m.node_lookups.append({"t": t0, "s": trio.current_time() - t0, "queried": 0, "found": False})
            return
        self.m.node_lookups.append({"t": t0, "s": trio.current_time() - t0, "queried": result.queried,
                                    "found": bool(result.closest) and result.closest[0].peer_id == target.identity.peer_id})

    async def _sample_online(self) -> None:
        while True:
            self.m.online_samples.append(len(self.online()))
            await trio.sleep(10.0)

    # --- the run ---------------------------------------------------------------------------------

    async def run(self) -> dict:
        cfg = self.cfg
        for i in range(cfg.peers + cfg.bootstrap):
            boot = i < cfg.bootstrap
            natted = not boot and self.rng.random() < cfg.nat_share
            serves = not boot and self.rng.random() < cfg.volunteer_share
            self.peers.append(Peer(i, _identity(cfg.seed, i), self.net.host(natted=natted),
                                   self.rng.randrange(cfg.models) if serves else None))
        self.seeds = [Contact.of(p.identity.peer_id, *p.host.addr) for p in self.peers[:cfg.bootstrap]]
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        wall0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.net.run)
            for p in self.peers[:cfg.bootstrap]:
                nursery.start_soon(self._lifecycle, p)
            await trio.sleep(1.0)  # the bootstrap peers are up before anyone joins through them
            for p in self.peers[cfg.bootstrap:]:
                nursery.start_soon(self._lifecycle, p)
                await trio.sleep(cfg.warmup_minutes * 60 / 2 / max(1, cfg.peers))  # arrivals over half the warm-up
            await trio.sleep(cfg.warmup_minutes * 30)
            self.measuring = True
            for p in self.online():
                self._kinds_at_start[id(p.node)] = dict(p.node.stats)
            sent0, bytes0, t0 = self.net.sent_total, self.net.sent_bytes_total, trio.current_time()
            nursery.start_soon(self._model_lookups)
            nursery.start_soon(self._node_lookups)
            nursery.start_soon(self._sample_online)
            await trio.sleep(cfg.minutes * 60)
            for p in self.online():
                self._count(p.node)
            self.measuring = False
            span = trio.current_time() - t0
            sent, sent_bytes = self.net.sent_total - sent0, self.net.sent_bytes_total - bytes0
            nursery.cancel_scope.cancel()
        online = sum(self.m.online_samples) / max(1, len(self.m.online_samples))
        peak = max(self.m.online_samples, default=0)
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return report(self, span, sent, sent_bytes, online, peak, (rss1 - rss0) * 1024, time.perf_counter() - wall0)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def report(sim: SimSwarm, span: float, sent: int, sent_bytes: int, online: float, peak: int, rss_bytes: int,
           wall_s: float) -> dict:
    m, cfg = sim.m, sim.cfg
    ml, nl = m.model_lookups, m.node_lookups
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return {
        "peers": cfg.peers, "simulated_s": round(span), "wall_s": round(wall_s, 1), "seed": cfg.seed,
        "online_mean": round(online, 1), "online_peak": peak, "joins": m.joins, "leaves": m.leaves,
        "model_lookups": len(ml),
        "model_lookup_recall_mean": r3(sum(x["recall"] for x in ml) / len(ml)) if ml else None,
        "model_lookup_complete": r3(sum(1 for x in ml if x["found"] == x["live"]) / len(ml)) if ml else None,
        "model_lookup_found_any": r3(sum(1 for x in ml if x["found"] or not x["live"]) / len(ml)) if ml else None,
        "model_lookup_s_p50": r3(_pct([x["s"] for x in ml], 0.5)),
        "model_lookup_s_p90": r3(_pct([x["s"] for x in ml], 0.9)),
        "model_lookup_s_p99": r3(_pct([x["s"] for x in ml], 0.99)),
        "node_lookups": len(nl),
        "node_lookup_success": r3(sum(1 for x in nl if x["found"]) / len(nl)) if nl else None,
        "node_lookup_s_p50": r3(_pct([x["s"] for x in nl], 0.5)),
        "node_lookup_s_p90": r3(_pct([x["s"] for x in nl], 0.9)),
        "node_lookup_queried_p50": _pct([x["queried"] for x in nl], 0.5),
        "node_lookup_queried_p90": _pct([x["queried"] for x in nl], 0.9),
        "routable_s_p50": r3(_pct(m.routable_s, 0.5)), "routable_s_p90": r3(_pct(m.routable_s, 0.9)),
        "never_routable": m.never_routable, "routable_probed": len(m.routable_s) + m.never_routable,
        "messages_per_node_s": r3(sent / span / max(1.0, online)),
        "bytes_per_node_s": round(sent_bytes / span / max(1.0, online)),
        "requests_per_node_s": {k: r3(v / span / max(1.0, online)) for k, v in sim.kinds.most_common(8)},
        "lost_datagrams": sim.net.lost,
        "rss_per_peer_kb": round(rss_bytes / 1024 / max(1, peak), 1),
    }


def simulate(cfg: SimConfig) -> dict:
    """Run ``cfg`` in virtual time (trio's MockClock), signatures stood in for
    (crypto.py); its measures."""
    from trio.testing import MockClock

    # The nodes' own random choices (gossip targets, refreshes) from the seed too. A run is
    # still not exactly repeatable: trio shuffles its run queue on purpose (docs/scale.md).
    random.seed(cfg.seed)
    with stand_in_signatures():
        return trio.run(SimSwarm(cfg).run, clock=MockClock(autojump_threshold=0))
