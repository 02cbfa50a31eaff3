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

import contextlib
import functools
import gc
import math
import os
import random
import resource
import time
from collections import Counter
from dataclasses import dataclass, field

import trio

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import Identity, PeerId
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.nat.dialer import DIAL_TIMEOUT, serve_dial_backs
from meshnet_p2p.nat.keeper import RTT_TIMEOUT_S, RelayKeeper
from meshnet_p2p.nat.dialback import relay_of
from meshnet_p2p.nat.reachability import RELAY_DIAL_TIMEOUT, check_reachability, relay_check
from meshnet_p2p.nat.relay import RelayError, Reservation
from meshnet_p2p.dht.node import DHTConfig, DHTNode
from meshnet_p2p.dht.routing import Contact, key_id, node_id_of
from meshnet_p2p.swarm.announcer import ANNOUNCE_INTERVAL_S, Announcer
from meshnet_p2p.swarm.capability import model_key
from meshnet_p2p.swarm.node import TYPES, lifetime_cap, peers_for_model
from meshnet_p2p.swarm.placement import Span, choose_span, default_num_layers
from meshnet_p2p.swarm.placing import PLACEMENT_DIAL_TIMEOUT_S, answering_spans
from meshnet_p2p.swarm.relay_offers import RELAY_ANNOUNCE_INTERVAL_S, RELAYS_KEY, sign_relay_record
from meshnet_p2p.trust.evidence import cert_key, index_key
from meshnet_p2p.trust.policy import TrustPolicy
from meshnet_p2p.trust.verdicts import sign_verdicts, verdicts_key

from . import records
from .churn import Churn
from .clients import SETTLED_S, Clients, Measures, carried
from .crypto import stand_in_signatures
from .shared import shared_record_checks
from .net import Host, NetModel, SimNetwork
from .records import N_LAYER, SLICES
from .report import Part, report
from .split import Partner, RemotePeerNode, run_split
from .sybil import Behaviour, SybilNode, grind

AUDITED_AFTER_S = 30.0  # a volunteer the certifier has served a while: audited (its replays matched)
VERDICTS_EVERY_S = 30.0
EPOCH_MS = 1_800_000_000_000  # the simulated wall clock at time 0 (records carry wall-clock times)


MEASURED_PEER_MINUTES = 10_000  # the default measured window holds as many peer-minutes at any size


def default_window(peers: int) -> tuple[float, float]:
    """(measured, warm-up) simulated minutes when none are given. What a node does
    (its requests, bytes, joins and leaves, newcomers to find) is counted per
    peer-minute, so a window of 10,000 peer-minutes measures as many at 10,000 peers
    in one minute as at 1,000 in ten, for a tenth of the work. A window shorter than
    a node's longest period (republishing, 5 minutes) measures its rate because each
    node draws the phase of its periodic work at random (``dht.node.phased``).
    Swarm-wide workloads (model lookups, surveys) give fewer samples in a shorter
    window; the report counts them. The warm-up lets the starting swarm join (over
    its first half) and announce: two minutes up to 1,000 peers, as every figure
    before 2026-12-06 was measured, one beyond (two announcement rounds)."""
    measured = min(10.0, max(1.0, MEASURED_PEER_MINUTES / max(1, peers)))
    return measured, (2.0 if peers <= 1000 else 1.0)


@dataclass
class SimConfig:
    peers: int = 1000
    minutes: float = 10.0  # simulated time measured, after the warm-up
    warmup_minutes: float = 2.0  # simulated time for the starting swarm to join, not measured
    seed: int = 1
    models: int = 4
    volunteer_share: float = 0.5  # the others are clients: they look models up
    nat_share: float = 0.3
    bootstrap: int = 8  # always-online bootstrap peers (public, not counted as volunteers); the first certifies
    lookups_per_s: float = 2.0  # model lookups by clients, over the whole swarm
    find_nodes_per_s: float = 1.0  # lookups of a random online node's ID
    surveys_per_s: float = 0.5  # fresh clients surveying a model for a route, as ``generate`` does
    # a partition: ``partition_regions`` cut off from the rest for ``partition_minutes``,
    # starting ``partition_at_minutes`` into the measured time
    partition_regions: tuple[str, ...] = ()
    partition_at_minutes: float = 0.0
    partition_minutes: float = 0.0
    relays: int = 0  # public relays announcing offers; NATed volunteers reserve on one
    relay_capacity: int = 128  # reservations a relay holds (nat/relay.py's default)
    relay_session_minutes: float = 0.0  # a relay's median session (and offline gap); 0: always online
    # relays that misbehave, besides ``relays`` honest ones: "blackhole" takes reservations and
    # carries nothing; "selective" carries only dials from the reserved peer's own address (its
    # self-check passes) and drops every client's
    bad_relays: int = 0
    bad_relay_behaviour: str = "blackhole"
    reachability: bool = False  # public peers dial others back; each volunteer checks its own reachability
    verdicts: bool = False  # the certifier also publishes verdicts vouching for the volunteers it audited
    probe: bool = True  # a fresh client probes its candidates' round trips before its first plan (route/probe.py)
    generation_tokens: int = 64  # each routed survey then generates this many tokens on its route (0: none)
    # "slices": each volunteer serves one of SLICES at random; "auto": each session's span
    # chosen as ``join --layers auto`` chooses it, from the model's reports its node finds
    placement: str = "slices"
    layer_ms_median: float = 1.0  # a volunteer's compute per layer per token (log-normal)
    layer_ms_sigma: float = 0.5
    # attackers (sybil.py): identities ground close to model 0's key ("model") or to the
    # certifier's index of model 0 ("certifier"), on ``sybil_networks`` /24s, always online
    sybils: int = 0
    sybil_behaviour: str = "eclipse"
    sybil_target: str = "model"
    sybil_networks: int = 1
    sybil_layers: tuple[int, int] = (0, N_LAYER)  # what a liar claims to serve
    sybil_bits: int | None = None  # shared with the key; None: log2(peers) + 4 (closer than any honest node)
    slow_s: float = 3.0
    churn: Churn = field(default_factory=Churn)
    # a record's checks that hang on its bytes alone run once for the swarm (shared.py);
    # False: every node runs them itself, as a real node does (same verdicts, slower)
    share_checks: bool = True
    # processes the run is split over (split.py): 1, or 2 (a core each, half the peers each)
    procs: int = 1

    @property
    def partitioned(self) -> bool:
        return bool(self.partition_regions) and self.partition_minutes > 0
    net: NetModel = field(default_factory=NetModel)
    # as the roles start their nodes (swarm.node.start_node): each gossips only the topics it
    # follows, but the bootstrap peers every topic; follow_all=True here: every node every topic
    dht: DHTConfig = field(default_factory=lambda: DHTConfig(follow_all=False))


@dataclass
class Peer:
    index: int
    identity: Identity
    host: Host
    model: int | None  # the model it serves; None: a client
    layers: tuple[int, int] | None = None
    compute_ms: float = 0.0  # its span's compute per token (what it claims: honest peers claim the truth)
    layer_ms: float = 0.0  # its compute per layer per token
    sybil: Behaviour | None = None
    online_since: float | None = None
    node: DHTNode | None = None
    scope: trio.CancelScope | None = None
    announced_at: float | None = None  # its first announce of this session stored
    is_relay: bool = False
    relay: "Peer | None" = None  # the relay it holds a reservation on (a NATed volunteer)
    reserved: set[int] = field(default_factory=set)  # a relay's: the peers holding a reservation
    relay_behaviour: str = "honest"  # a relay's: "honest", "blackhole" or "selective" (SimConfig.bad_relays)
    session_over: trio.Event | None = None  # a relay's: set when its current session ends (reservations end)
    vanished: bool = False  # its last session ended with the machine gone, not its process exiting


def _identity(seed: int, i: int) -> Identity:
    return Identity.from_seed(random.Random(seed * 1_000_003 + i).randbytes(32))


class SimSwarm:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.net = SimNetwork(self.rng, cfg.net)
        self.models = [f"{m:02x}" * 32 for m in range(1, cfg.models + 1)]
        self.peers: list[Peer] = []
        self.by_id: dict[str, Peer] = {}
        self.by_ip: dict[str, Peer] = {}
        self.m = Measures()
        self.clients = Clients(self)
        self.tasks: trio.Nursery | None = None
        self.partition_began: float | None = None
        self.partition_healed: float | None = None
        self.measuring = False
        self.seeds: list[Contact] = []
        self.certifier: Identity | None = None  # the first bootstrap peer's operator
        self.trust = TrustPolicy()
        self.kinds: Counter[str] = Counter()  # requests sent while measuring, by kind
        self.full_key: Counter[str] = Counter()  # stores that met a full key while measuring: full_key_refused, _replaced
        self.kind_bytes: Counter[tuple[str, str]] = Counter()  # their bytes: (kind, "asks" or "answers")
        self._kinds_at_start: dict[int, dict] = {}  # node -> its counts when measuring began
        # a run split over two processes (split.py): this one's number and its link to the other
        self.me = 0
        self.partner: Partner | None = None

    def now_ms(self) -> int:
        return EPOCH_MS + int(trio.current_time() * 1000)

    def fresh_identity(self) -> Identity:
        return Identity.from_seed(self.rng.randbytes(32))

    def online(self, *, settled: bool = False, public: bool = False, clients: bool | None = None,
               sybils: bool = False, local: bool = False) -> list[Peer]:
        """Honest peers online (and, with ``sybils``, the attackers too; with ``local``,
        only those this process runs, whose nodes are here: split.py)."""
        now = trio.current_time()
        return [p for p in self.peers if p.node is not None and p.node.running and (sybils or p.sybil is None)
                and (not settled or now - p.online_since >= SETTLED_S)
                and (not public or not p.host.natted)
                and (clients is None or (p.model is None and not p.is_relay) == clients)
                and (not local or self.runs(p))]

    def owner(self, p: Peer) -> int:
        """The process that runs ``p`` (0, unless the run is split: split.py)."""
        return p.index % self.cfg.procs

    def runs(self, p: Peer) -> bool:
        """Whether this process runs ``p``."""
        return self.owner(p) == self.me

    def tell(self, p: Peer, name: str, value) -> None:
        """What changed of ``p``, for the other process's view of it (split.py)."""
        if self.partner is not None:
            self.partner.changes.append([p.index, name, value])

    def _told(self, index: int, name: str, value) -> None:
        """What changed of a peer the other process runs: its stand-in here (split.py)."""
        p = self.peers[index]
        if name == "up":
            p.node, p.online_since, p.vanished, p.announced_at = RemotePeerNode(node_id_of(p.identity.peer_id)), *value, None
        elif name == "down":
            p.node = None
        elif name == "announced":
            p.announced_at = value
        elif name == "layers":
            self._serves(p, tuple(value))

    # --- who is in the swarm ------------------------------------------------------------------

    def populate(self) -> None:
        """Draw who is in the swarm (before a split run forks: both halves the same)."""
        if self.peers:
            return
        cfg = self.cfg
        for i in range(cfg.peers + cfg.bootstrap):
            boot = i < cfg.bootstrap
            natted = not boot and self.rng.random() < cfg.nat_share
            serves = not boot and self.rng.random() < cfg.volunteer_share
            p = Peer(i, _identity(cfg.seed, i), self.net.host(natted=natted),
                     self.rng.randrange(cfg.models) if serves else None)
            if serves:
                p.layer_ms = cfg.layer_ms_median * math.exp(self.rng.gauss(0, cfg.layer_ms_sigma))
                self._serves(p, self.rng.choice(SLICES))
            self.peers.append(p)
        self.by_id = {str(p.identity.peer_id): p for p in self.peers}
        self.by_ip = {p.host.addr[0]: p for p in self.peers}
        self.certifier = self.peers[0].identity
        self.trust = TrustPolicy(frozenset({str(self.certifier.peer_id)}))
        self.seeds = [Contact.of(p.identity.peer_id, *p.host.addr) for p in self.peers[:cfg.bootstrap]]
        for j in range(cfg.relays + cfg.bad_relays):  # public, not volunteers
            p = Peer(len(self.peers), self.fresh_identity(), self.net.host(), None, is_relay=True,
                     relay_behaviour="honest" if j < cfg.relays else cfg.bad_relay_behaviour)
            self.peers.append(p)
            self.by_id[str(p.identity.peer_id)], self.by_ip[p.host.addr[0]] = p, p
        if cfg.sybils:
            self._add_sybils()

    @staticmethod
    def _serves(p: Peer, layers: tuple[int, int]) -> None:
        p.layers = layers
        p.compute_ms = (layers[1] - layers[0]) * p.layer_ms

    def _add_sybils(self) -> None:
        cfg = self.cfg
        target = model_key(self.models[0]) if cfg.sybil_target == "model" else \
            index_key(self.models[0], str(self.certifier.peer_id))
        bits = cfg.sybil_bits if cfg.sybil_bits is not None else max(1, math.ceil(math.log2(max(2, cfg.peers)))) + 4
        idents = grind(key_id(target.encode()), cfg.sybils, bits, random.Random(cfg.seed + 7))
        prefixes = [self.net.network() for _ in range(cfg.sybil_networks)]
        behaviour = Behaviour(cfg.sybil_behaviour)
        for j, ident in enumerate(idents):
            ip = f"{prefixes[j % len(prefixes)]}.{10 + j // len(prefixes)}"
            p = Peer(len(self.peers), ident, self.net.host(ip=ip), 0 if behaviour is Behaviour.LIAR else None,
                     sybil=behaviour)
            if behaviour is Behaviour.LIAR:  # claims its layers (the whole model unless told), fast
                p.layers, p.compute_ms = tuple(cfg.sybil_layers), 1.0
            self.peers.append(p)
            self.by_id[str(ident.peer_id)] = p
            self.by_ip[ip] = p

    # --- peers coming and going -----------------------------------------------------------------

    def _node(self, p: Peer) -> DHTNode:
        config = DHTConfig(**{**self.cfg.dht.__dict__, "client_mode": p.host.natted,
                              "follow_all": self.cfg.dht.follow_all or p.index < self.cfg.bootstrap})
        if p.sybil is None:
            node = DHTNode(p.identity, self.net.attach(p.host), TYPES, config, now_ms=self.now_ms,
                           lifetime_cap=lifetime_cap)
            if self.cfg.reachability:  # as roles' start_node(..., serve=dial_checks)
                serve_dial_backs(node, functools.partial(self._dial_back, p.host))
            return node
        node = SybilNode(p.identity, self.net.attach(p.host), TYPES, config, now_ms=self.now_ms,
                         lifetime_cap=lifetime_cap)
        node.behaviour, node.slow_s = p.sybil, self.cfg.slow_s
        node.siblings = [Contact.of(q.identity.peer_id, *q.host.addr) for q in self.peers if q.sybil is not None]
        return node

    async def _serve(self, p: Peer) -> None:
        """One online session of ``p``: start its node, join, announce until cancelled."""
        node = self._node(p)
        started = trio.current_time()
        p.announced_at = None  # this session has announced nothing yet
        try:
            async with trio.open_nursery() as inner:
                await inner.start(node.run)
                p.node, p.online_since = node, started
                self.tell(p, "up", [started, p.vanished])
                if self.measuring:
                    self.m.joins += 1
                if p.index >= self.cfg.bootstrap:
                    seeds = self.seeds
                    for timeout in (None, 2.0, 5.0):  # as start_node: a late answer is not none
                        if await node.bootstrap(seeds, timeout=timeout):
                            break
                if p.model is not None and p.sybil is None and self.cfg.reachability:
                    inner.start_soon(self._check_reachability, p, node)
                if p.is_relay:
                    p.session_over = trio.Event()
                    inner.start_soon(self._offer_relay, p, node)
                if p.model is not None and p.sybil is None and p.host.natted and self.cfg.relays + self.cfg.bad_relays:
                    inner.start_soon(self._keep_relay, p, node)
                if p.model is not None:
                    if p.sybil is None and self.cfg.placement == "auto":
                        await self._place(p, node)
                    inner.start_soon(self._announce, p, node, started)
                if p.index == 0:
                    inner.start_soon(self._certify, node)
        finally:
            node.transport.close()
            p.node = None
            self.tell(p, "down", None)
            if p.session_over is not None:  # a relay's reservations end with it
                p.session_over.set()
                p.session_over = None
            if p.relay is not None:  # its reservation ends with its connection
                p.relay.reserved.discard(p.index)
                p.relay = None
            self._count(node)

    def _count(self, node: DHTNode) -> None:
        """Add what ``node`` sent, by kind, to the run's totals (while measuring)."""
        if self.measuring:
            start = self._kinds_at_start.pop(id(node), {})
            for k, v in _full_key(node).items():
                self.full_key[k] += v - start.get(k, 0)
            for k, v in node.stats.items():
                if k.startswith("sent_"):
                    self.kinds[k[5:]] += v - start.get(k, 0)
                elif k.startswith("bytes_sent_"):
                    self.kind_bytes[k[11:], "asks"] += v - start.get(k, 0)
                elif k.startswith("bytes_answered_"):
                    self.kind_bytes[k[15:], "answers"] += v - start.get(k, 0)

    async def _dial_back(self, dialer: Host, peer_id: PeerId, addr_text: str) -> tuple[bool, str]:
        """A dialer's TCP connect and TLS handshake to ``addr_text`` (reachability.tls_dial_check's
        outcomes): two round trips to a host that takes connections and is its signer's,
        the dial timeout to one behind NAT or gone. Through a relay (a circuit address):
        the relay's CONNECT, its call to the peer and the handshake, if the relay is
        online, carries clients (an honest one) and holds the peer's reservation."""
        addr = Multiaddr.parse(addr_text)
        relay_addr = relay_of(addr)
        if relay_addr is not None:
            relay, peer = self.by_ip.get(relay_addr.host), self.by_id.get(str(peer_id))
            if relay is None or relay.node is None or relay.relay_behaviour != "honest" or peer is None \
                    or peer.index not in relay.reserved:
                await trio.sleep(DIAL_TIMEOUT)
                return False, "timeout"
            await trio.sleep(4 * self.net.one_way_s(dialer, relay.host) + 2 * self.net.one_way_s(relay.host, peer.host))
            return True, "ok"
        target = self.by_ip.get(addr.host)
        if target is None or target.node is None or target.host.natted or target.identity.peer_id != peer_id:
            await trio.sleep(DIAL_TIMEOUT)
            return False, "timeout"
        await trio.sleep(4 * self.net.one_way_s(dialer, target.host))
        return True, "ok"

    async def _offer_relay(self, p: Peer, node: DHTNode) -> None:
        """As the ``relay`` role: its signed offer (address, limits, load) every 30 s."""
        addr = Multiaddr.for_socket(p.host.addr[0], "tcp", 4002, p.identity.peer_id)
        limits = {"max_reservations": self.cfg.relay_capacity, "max_connections_per_peer": 8,
                  "bytes_per_second_per_peer": 1 << 20}
        while True:
            with contextlib.suppress(MeshnetError):
                load = 0 if p.relay_behaviour != "honest" else len(p.reserved)  # a bad one looks empty
                await node.publish(RELAYS_KEY, sign_relay_record(p.identity, addr, limits,
                                                                 {"reservations_now": load},
                                                                 now_ms=self.now_ms()))
            await trio.sleep(RELAY_ANNOUNCE_INTERVAL_S)

    async def _keep_relay(self, p: Peer, node: DHTNode) -> None:
        """A NATed volunteer's RelayKeeper, the production one (nat/keeper.py): its
        offers() (the DHT's relay records, one per network), rank_relays, a
        reservation on the best, a check that it carries (``relay_check``: other
        peers dial it through the relay, as ``join`` has it; with no dialers in the
        run, a dial of itself), and a move when the relay leaves, refuses or stops
        carrying. Its network stand-ins: ``measure`` (the round trip, known here),
        ``hold`` (a reservation within the relay's bound, ended by the relay's
        session ending), the dialers' dials (``_dial_back``) and the self-dial (it
        passes through an honest relay and through a selective one, which carries
        what comes from the reserved peer's own address)."""
        one_way = self.net.one_way_s
        looking_since, held_before = trio.current_time(), False  # (on_change's)

        async def measure(addr: Multiaddr) -> float | None:
            relay = self.by_ip.get(addr.host)
            if relay is None or relay.node is None:
                await trio.sleep(RTT_TIMEOUT_S)
                return None
            rtt = 2 * one_way(p.host, relay.host)
            await trio.sleep(rtt)
            return rtt * 1000

        async def hold(addr: Multiaddr, identity, local, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
            relay = self.by_ip.get(addr.host)
            if relay is None or relay.node is None:
                await trio.sleep(RTT_TIMEOUT_S)
                raise RelayError("connect timed out")
            await trio.sleep(4 * one_way(p.host, relay.host))  # its connect, TLS, RESERVE and OK
            over = relay.session_over
            if relay.node is None or over is None:
                raise RelayError("the relay closed the connection")
            if len(relay.reserved) >= self.cfg.relay_capacity:
                raise RelayError("refused: the relay holds all the reservations it takes")
            relay.reserved.add(p.index)
            try:
                task_status.started(Reservation(addr))
                await over.wait()
                raise RelayError("the relay closed the reservation")
            finally:
                relay.reserved.discard(p.index)

        async def dial_itself(peer_id: PeerId, addr: Multiaddr) -> tuple[bool, str]:
            relay = self.by_ip.get(addr.host)
            if relay is None or relay.node is None or relay.relay_behaviour == "blackhole":
                await trio.sleep(RELAY_DIAL_TIMEOUT)
                return False, "timeout"
            await trio.sleep(4 * one_way(p.host, relay.host))  # CONNECT, OPEN, attach and TLS, from itself
            return True, "ok"

        def on_change(held: Reservation | None) -> None:
            nonlocal looking_since, held_before
            now = trio.current_time()
            if held is None:
                p.relay, looking_since = None, now
                if self.measuring:
                    self.m.relay_losses += 1
                return
            p.relay = self.by_ip[held.relay.host]
            self.m.relayed.append({"t": now, "s": now - looking_since, "relay": p.relay.index, "again": held_before})
            held_before = True  # (any later reservation follows a loss)

        await RelayKeeper(node, p.identity, None, on_change=on_change, print_line=lambda m: None,
                          measure=measure, verify=relay_check(node, fallback=dial_itself), hold=hold).run()

    async def _check_reachability(self, p: Peer, node: DHTNode) -> None:
        """What ``join`` asks before announcing: can others dial the address it would announce?"""
        t0 = trio.current_time()
        addr = str(Multiaddr.for_socket(p.host.addr[0], "tcp", 7000, p.identity.peer_id))
        try:
            found = await check_reachability(node, [addr], avoid=[c.peer_id for c in self.seeds])
            status = found.status
        except MeshnetError as e:
            status = f"error: {e}"
        # every join's, the warm-up's too: most joins are there (a swarm forming)
        self.m.reachability.append({"t": t0, "natted": p.host.natted, "status": status, "s": trio.current_time() - t0})

    async def _place(self, p: Peer, node: DHTNode) -> None:
        """``join --layers auto``: the span the swarm most needs, by the reports of the
        model's peers that answered a dial where their reports say (swarm.placing)."""
        try:
            found = await peers_for_model(node, self.models[p.model])
        except MeshnetError:  # as join: no reports found, the coverage is empty
            found = []

        async def dial(span: Span) -> str | None:  # a TCP connect and a TLS handshake: two round trips
            q = self.by_id.get(span.peer_id)
            if q is None or q.sybil is not None or q.node is None:  # nobody answers there
                await trio.sleep(PLACEMENT_DIAL_TIMEOUT_S)
                return None
            await trio.sleep(4 * self.net.one_way_s(p.host, q.host))
            return q.host.addr[0]

        spans = [Span.from_report(r) for r in found if r.signer != p.identity.peer_id]
        spans = await answering_spans(spans, dial, rng=self.rng)
        self._serves(p, choose_span(spans, N_LAYER, default_num_layers(N_LAYER)))
        self.tell(p, "layers", list(p.layers))

    async def _announce(self, p: Peer, node: DHTNode, started: float) -> None:
        """join's announcer (swarm/announcer.py), over this peer's node and report."""
        digest = self.models[p.model]
        liar = p.sybil is Behaviour.LIAR
        first = [True]

        def report() -> list[tuple[str, bytes]]:
            return [(model_key(digest), records.report(p.identity, digest, p.layers, ip=p.host.addr[0],
                                                       port=7001 if liar else 7000,
                                                       throughput=1000.0 / p.compute_ms, now_ms=self.now_ms()))]

        def stored(n: int) -> None:  # its first report taken: announced
            if first[0] and not liar:
                first[0] = False
                p.announced_at = trio.current_time()
                self.tell(p, "announced", p.announced_at)
                if self.measuring:
                    self.tasks.start_soon(self._probe_routable, p, started)

        await Announcer(node.publish, report, interval=ANNOUNCE_INTERVAL_S, on_stored=stored, counts=node.stats).run()

    async def _certify(self, node: DHTNode) -> None:
        """The certifier's records for every model, once the swarm has begun to form
        (as ``certify`` puts them: under its own keys, also at its homes)."""
        await trio.sleep(self.cfg.warmup_minutes * 20)
        me = self.certifier
        homes = node.homes_of(me.peer_id)
        hops = [self.fresh_identity() for _ in SLICES]  # the route it certified through (stand-ins)
        for digest in self.models:
            now = self.now_ms()
            for key, wire in ((cert_key(digest, records.recipe_of(digest), str(me.peer_id)),
                               records.certificate(me, digest, hops, now_ms=now)),
                              (index_key(digest, str(me.peer_id)), records.index(me, digest, now_ms=now))):
                with contextlib.suppress(MeshnetError):
                    await node.publish(key, wire, also=homes)
        while self.cfg.verdicts:  # as `review` does after auditing: vouch for the volunteers checked
            for model, digest in enumerate(self.models):
                now = trio.current_time()
                audited = {str(p.identity.peer_id): 1 for p in self.online()
                           if p.model == model and p.announced_at is not None and now - p.announced_at >= AUDITED_AFTER_S}
                with contextlib.suppress(MeshnetError):
                    await node.publish(verdicts_key(digest, str(me.peer_id)),
                                       sign_verdicts(me, digest, audited, {}, now_ms=self.now_ms()), also=homes)
            await trio.sleep(VERDICTS_EVERY_S)

    async def _probe_routable(self, p: Peer, started: float) -> None:
        """How long until a stranger's lookup of the model finds ``p``'s report."""
        key = model_key(self.models[p.model])
        for wait in (0.0, 5.0, 15.0, 45.0):
            await trio.sleep(wait)
            askers = [q for q in self.online(settled=True, clients=True, local=True) if q is not p]
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
        """Online sessions and offline gaps, for ever (bootstrap peers and attackers stay)."""
        # each peer's sessions from the seed and its index alone: no other draw (a datagram's
        # loss, a task's timing) moves who is online when, so a seed's churn is the same in
        # every run and with every change to what the nodes send
        churn, rng = self.cfg.churn, random.Random(f"sessions/{self.cfg.seed}/{p.index}")
        how = random.Random(f"vanish/{self.cfg.seed}/{p.index}")  # (apart: the sessions' draws stay as they were)
        always = p.index < self.cfg.bootstrap or p.sybil is not None or \
            (p.is_relay and not self.cfg.relay_session_minutes)
        if p.is_relay and not always:  # relays come and go as their operators do
            median = self.cfg.relay_session_minutes * 60
            churn = Churn(session_median_s=median, gap_median_s=median, shape=churn.shape)
        online = always or churn.online_at_start(rng)
        first = True
        while True:
            if online:
                length = None if always else (churn.remaining(rng) if first else churn.session(rng))
                with trio.move_on_after(length if length is not None else float("inf")) as scope:
                    p.scope = scope
                    p.vanished = how.random() < churn.vanish_share  # how this session will end
                    await self._serve(p)
                    await trio.sleep_forever()
                if self.measuring:
                    self.m.leaves += 1
            else:
                await trio.sleep(churn.gap(rng) * (rng.random() if first else 1.0))
            online, first = not online, False

    async def _partition(self) -> None:
        cfg = self.cfg
        await trio.sleep(cfg.partition_at_minutes * 60)
        self.partition_began = trio.current_time()
        self.net.cut = frozenset(cfg.partition_regions)
        await trio.sleep(cfg.partition_minutes * 60)
        self.net.cut = frozenset()
        self.partition_healed = trio.current_time()

    def phase(self, t: float) -> str:
        """Whether ``t`` was before, during or after the partition ("all" with none)."""
        if not self.cfg.partitioned:
            return "all"
        if self.partition_began is None or t < self.partition_began:
            return "before"
        return "during" if self.partition_healed is None or t < self.partition_healed else "after"

    async def _sample_online(self) -> None:
        while True:
            online = self.online()
            self.m.online_samples.append(len(online))
            if self.cfg.relays + self.cfg.bad_relays:  # NATed volunteers online: how many hold a reservation,
                natted = [p for p in online if p.model is not None and p.host.natted]  # and on a relay that carries
                per_relay = sorted((len(r.reserved) for r in self.peers if r.is_relay), reverse=True)
                self.m.relay_samples.append({"natted": len(natted), "held": sum(1 for p in natted if p.relay),
                                             "carried": sum(1 for p in natted if carried(p)),
                                             "per_relay": per_relay})
            for model in range(len(self.models)):  # how many announced honest volunteers serve each layer
                per_layer = [0] * N_LAYER
                for p in online:
                    if p.model == model and p.announced_at is not None:
                        for layer in range(*p.layers):
                            per_layer[layer] += 1
                self.m.coverage.append({"model": model, "min": min(per_layer), "mean": sum(per_layer) / N_LAYER})
            await trio.sleep(10.0)

    # --- the run ---------------------------------------------------------------------------------

    async def run(self) -> dict:
        """The run; its report (a split run: this process's part, ``Part``)."""
        cfg = self.cfg
        self.populate()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        wall0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            self.tasks = nursery  # what users do runs here: an error in it ends the run, with its traceback
            nursery.start_soon(self.net.run)
            met = trio.Event()  # a split run: both processes agreed to end
            if self.partner is not None:
                nursery.start_soon(self._meet, met)
            for p in self.peers[:cfg.bootstrap]:
                if self.runs(p):
                    nursery.start_soon(self._lifecycle, p)
            await trio.sleep(1.0)  # the bootstrap peers are up before anyone joins through them
            # relays and attackers first: in place before the swarm forms (for attackers the hardest case)
            arrivals = sorted(self.peers[cfg.bootstrap:], key=lambda p: p.sybil is None and not p.is_relay)
            for p in arrivals:
                if self.runs(p):
                    nursery.start_soon(self._lifecycle, p)
                await trio.sleep(cfg.warmup_minutes * 60 / 2 / max(1, len(arrivals)))  # over half the warm-up
            await trio.sleep(cfg.warmup_minutes * 30)
            self.measuring = True
            self.m.wall_phases["warmup"] = time.perf_counter() - wall0
            for p in self.online(sybils=True, local=True):
                self._kinds_at_start[id(p.node)] = {**p.node.stats, **_full_key(p.node)}
            sent0, bytes0, t0 = self.net.sent_total, self.net.sent_bytes_total, trio.current_time()
            until = t0 + cfg.minutes * 60
            nursery.start_soon(self.clients.model_lookups, until)
            nursery.start_soon(self.clients.node_lookups, until)
            if cfg.surveys_per_s > 0:
                nursery.start_soon(self.clients.surveys, until)
            if self.me == 0:  # (it sees every peer: one process samples)
                nursery.start_soon(self._sample_online)
            if cfg.partitioned:
                nursery.start_soon(self._partition)
            await trio.sleep(cfg.minutes * 60)
            for p in self.online(sybils=True, local=True):
                self._count(p.node)
            self.m.gossip_held = [len(p.node.gossip) for p in self.online(local=True) if p.index >= cfg.bootstrap]
            self.measuring = False
            span = trio.current_time() - t0
            sent, sent_bytes = self.net.sent_total - sent0, self.net.sent_bytes_total - bytes0
            self.m.wall_phases["measured"] = time.perf_counter() - wall0 - self.m.wall_phases["warmup"]
            grace0 = trio.current_time()
            if self.partner is None:
                with trio.move_on_after(SURVEY_GRACE_S):  # the window's surveys, generations and lookups end (not counted)
                    await self.clients.reported()
            else:  # both processes' (they end at the same meeting point)
                self.partner.wants_end = lambda: not self.clients.running or trio.current_time() >= grace0 + SURVEY_GRACE_S
                await met.wait()
            self.m.grace_s = trio.current_time() - grace0
            self.m.wall_phases["grace"] = time.perf_counter() - wall0 - sum(self.m.wall_phases.values())
            nursery.cancel_scope.cancel()
        rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
        part = Part(span, sent, sent_bytes, rss, self.m, self.kinds, self.kind_bytes, self.full_key, self.net.lost,
                    self.net.partitioned, [self.partner.waited_s] if self.partner is not None else [],
                    self.net.queue_dropped)
        if self.partner is not None:
            return part
        return self.report(part, time.perf_counter() - wall0)

    def report(self, part: "Part", wall_s: float) -> dict:
        online = sum(part.m.online_samples) / max(1, len(part.m.online_samples))
        peak = max(part.m.online_samples, default=0)
        return report(self.cfg, part, online, peak, wall_s)

    async def _meet(self, met: trio.Event) -> None:
        await self.partner.run(self.net, self._told)
        met.set()


def _full_key(node: DHTNode) -> dict[str, int]:
    return {"full_key_refused": node.store.full_key_refused, "full_key_replaced": node.store.full_key_replaced}


def _run(swarm: SimSwarm):
    from trio.testing import MockClock

    return trio.run(swarm.run, clock=MockClock(autojump_threshold=0))


# A survey's look is bounded well inside this (bootstrap and fetch timeouts), and so is a
# generation of the default 64 tokens with its failovers: what is still running then is cut.
SURVEY_GRACE_S = 300.0


def simulate(cfg: SimConfig) -> dict:
    """Run ``cfg`` in virtual time (trio's MockClock), signatures stood in for
    (crypto.py), in one process or split over two (``cfg.procs``, split.py); its measures."""
    if cfg.procs not in (1, 2):
        raise ValueError(f"procs must be 1 or 2, not {cfg.procs}")
    if cfg.procs > 1 and cfg.relays + cfg.bad_relays:
        # a reservation is state one process's volunteer changes on the other's relay
        raise ValueError("a run split over two processes does not simulate relays: run it in one (procs=1)")
    # The nodes' own random choices (gossip targets, refreshes) from the seed too. A run is
    # still not exactly repeatable: trio shuffles its run queue on purpose (docs/scale.md).
    random.seed(cfg.seed)
    # One process holds the whole swarm, and the collector's full passes walk every object
    # of it, a heap that grows faster than the swarm (each node keeps the records of many
    # others): at 400 peers they were a fifth of the wall time. The nodes make almost no
    # reference cycles (~2,000 objects freed by collection in such a run), so collection
    # is off while the swarm runs and one pass follows it. (The simulator's process only:
    # a real node is one per process.)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with stand_in_signatures(os.urandom(32)):  # (one secret: a split run's halves check each other's)
            swarm = SimSwarm(cfg)
            shared = shared_record_checks(swarm.now_ms) if cfg.share_checks else contextlib.nullcontext()
            with shared:
                return _run(swarm) if cfg.procs == 1 else run_split(swarm, _run)
    finally:
        if collecting:
            gc.enable()
        gc.collect()
