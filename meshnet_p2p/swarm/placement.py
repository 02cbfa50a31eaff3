"""Which layers a volunteer should serve, and which chain of peers a client
should use: pure functions of the capability reports (no network here).

- :func:`choose_span` is the volunteer's side (petals' block selection idea):
  serve the window whose weakest layer has the least throughput today, so
  missing layers are covered first and the swarm's bottleneck rises. Its
  spans are those whose peers answered a dial (placing.py), counted by
  network (:func:`coverage`).
- :func:`plan_route` is the client's side: a shortest path over layer
  boundaries, where a peer serving [a, b) is an edge a -> b costing its
  per-token time; full or departing peers and banned ones are left out. When
  there is no path it says which layers nobody serves.

A report's throughput is the peer's own claim, and a claim costs something:
it only seeds the cost of a peer not yet used, and never prices that peer's
compute per layer below what the client already knows of others: the best
per-layer time it measured, or with nothing measured the median per-layer
claim (one liar cannot move a median). So a report alone cannot make a peer
cheaper per layer than honest ones; a whole-model claim can still save the
round trips of hops it replaces (verification, not routing, answers that).
Once the client has timed a peer's decode steps, that measure replaces the
claim. Peers outside ``prefer`` (those without a verified record) cost a
layer's compute more (at least UNVERIFIED_PENALTY_MS_PER_LAYER) for each layer
they would compute, and with nothing measured their claims are priced no better
per layer than the verified peers' median claim.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Iterable

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.core.netgroup import network_of

DEFAULT_HOP_MS = 2.0
DEFAULT_TOKENS_PER_S = 50.0
MIN_UNMEASURED_MS_PER_TOKEN = 1.0  # no unmeasured claim buys a cheaper compute estimate than this


class NoRoute(MeshnetError):
    def __init__(self, missing: list[tuple[int, int]], detail: str = "") -> None:
        self.missing = missing
        ranges = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in missing)
        super().__init__(f"no route: no available peer serves layers {ranges}" + (f" ({detail})" if detail else ""))


@dataclass(frozen=True)
class Span:
    peer_id: str
    start: int
    end: int
    throughput: float = 0.0  # tokens/s this peer measured for its span
    free_sessions: int = 1
    departing: bool = False
    record: Any = None  # the verified capability report it came from
    relayed: bool = False  # reached through a relay: a round trip costs two crossings until measured
    network: str | None = None  # the network its peer answered a dial from (placing.py); None: not dialled

    @classmethod
    def from_report(cls, record) -> "Span":
        """The span of a verified capability report (its content passed
        :func:`meshnet_p2p.swarm.capability._valid`): only validated fields are read."""
        c = record.content
        start, end = c["layers"]
        return cls(str(c["peer_id"]), int(start), int(end), float(c["throughput"]),
                   int(c["free_sessions"]), c["departing"] is True, record, c["direct"] is False)


def replayable(span: Span, spans: Iterable[Span], composes: bool = True) -> bool:
    """Whether peers of ``spans`` on networks other than ``span``'s serve its layers so that an
    audit could replay its outputs exactly: one over the very same layers, or (``composes``: a
    float32 seam, which carries every bit across a cut) a chain of them from its first layer to
    its last. A span no one else can replay is never checked by an audit: one identity alone
    decides what it computes."""
    net = span_network(span)
    parts = sorted((s for s in spans if s.peer_id != span.peer_id and span_network(s) != net
                    and span.start <= s.start < s.end <= span.end
                    and (composes or (s.start, s.end) == (span.start, span.end))), key=lambda s: s.start)
    reach = {span.start}
    for s in parts:  # by start: every chain reaching s.start was built before s is looked at
        if s.start in reach:
            reach.add(s.end)
    return span.end in reach


def span_network(span: Span) -> str:
    """The network a span's peer counts in when witnesses must be independent (two
    routes that check each other, two replays that convict): the network it answered
    a dial from when one did (``Span.network``), else that of the address its signed
    report gives (a relayed peer's: its relay's, so that the identities one operator
    hides behind one relay count once). Identities cost nothing; addresses do
    (core/netgroup.py). A span with no report counts alone."""
    if span.network:
        return span.network
    c = getattr(span.record, "content", None) or {}
    try:
        host = Multiaddr.parse(c["relay"] if c.get("relay") else c["addrs"][0]).host
    except (KeyError, IndexError, TypeError, ValueError, MeshnetError):
        host = None
    return network_of(host) if host else f"peer:{span.peer_id}"


def coverage(spans: Iterable[Span], n_layer: int) -> list[float]:
    """Throughput serving each layer (a peer without a measure counts 1), summed over
    networks, each network counting on a layer at most what the median network's
    busiest layer has: throughput and identities are free to claim, and networks are
    not, so one host's crowd of fast claims counts as one ordinary network. A span
    with no ``network`` (not dialled) counts as a network of its own."""
    by_net: dict[str, list[float]] = {}
    for s in spans:
        if s.departing:
            continue
        mine = by_net.setdefault(s.network or f"peer:{s.peer_id}", [0.0] * n_layer)
        for layer in range(max(0, s.start), min(n_layer, s.end)):
            mine[layer] += s.throughput or 1.0
    if not by_net:
        return [0.0] * n_layer
    peaks = sorted(max(v) for v in by_net.values())
    cap = peaks[(len(peaks) - 1) // 2]  # of an even count the lower middle: half the networks cannot lift it
    return [sum(min(v[layer], cap) for v in by_net.values()) for layer in range(n_layer)]


def default_num_layers(n_layer: int) -> int:
    """How many layers ``join --layers auto`` serves unless told (``--num-layers``): a third."""
    return max(1, n_layer // 3)


def choose_span(spans: Iterable[Span], n_layer: int, num_layers: int) -> tuple[int, int]:
    """The window of ``num_layers`` layers this new peer should serve."""
    num_layers = max(1, min(num_layers, n_layer))
    per_layer = coverage(spans, n_layer)
    best = min(
        range(0, n_layer - num_layers + 1),
        key=lambda a: (min(per_layer[a : a + num_layers]), sum(per_layer[a : a + num_layers]), a),
    )
    return best, best + num_layers


def missing_layers(spans: Iterable[Span], start: int, end: int) -> list[tuple[int, int]]:
    """The runs of layers in [start, end) no span covers. A sweep over the spans'
    ends, so its cost follows the number of spans, never the layer count a
    report (anyone's claim) may name."""
    out, at = [], start
    for a, b in sorted((max(start, s.start), min(end, s.end)) for s in spans if s.start < end and s.end > start):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < end:
        out.append((at, end))
    return out


def _finite_nonneg(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


CLAIM_ADVANTAGE = 2.0  # an unmeasured claim this much faster per layer than the best measured peer is implausible
IMPLAUSIBLE_PENALTY_MS = 1000.0  # such a claim is tried only after every plausible candidate
# A layer computed by a peer without a verified record costs this much more
# (ms per token). Per layer, not per hop: an unverified peer is audited (its
# steps replayed elsewhere) on every session, a cost that grows with the
# layers it computes; and a per-hop charge would favour routes of fewer hops
# -- the whole-model claim -- whenever nobody is verified yet, while a
# per-layer one shifts every such route by the same amount (the order is the
# same as without ``prefer``). 0.5 ms is about a layer's decode compute on
# the embedded model (0.26-0.52 ms measured by join's measure_throughput on
# a 2-core CPU), i.e. what replaying that layer in an audit costs; and one
# unverified whole-model hop (30 layers: +15 ms) loses to a verified chain
# that pays a few more round trips (2 ms each by default). Over a WAN a saved
# round trip outweighs it: there plan_route ranks routes by their unverified
# layers first, and this charge orders routes with as many.
# It is a floor: a plan charges a layer's compute as the client prices it (the
# best measured, or the claim floor below), so the charge keeps its proportion
# to compute on a loaded machine or a larger model, where 0.5 ms is nothing.
UNVERIFIED_PENALTY_MS_PER_LAYER = 0.5


def best_measured_ms_per_layer(spans: Iterable[Span], measured_ms: dict[str, float] | None) -> float | None:
    """The fastest per-layer time the client measured itself, over ``spans``."""
    rates = [float(measured_ms[s.peer_id]) / (s.end - s.start) for s in spans
             if measured_ms and _finite_nonneg(measured_ms.get(s.peer_id)) and s.end > s.start]
    return min(rates) if rates else None


def _claimed_compute_ms(span: Span) -> float:
    tps = span.throughput if _finite_nonneg(span.throughput) and span.throughput > 0 else DEFAULT_TOKENS_PER_S
    return max(1000.0 / tps, MIN_UNMEASURED_MS_PER_TOKEN)


def median_claim_ms_per_layer(spans: Iterable[Span]) -> float | None:
    """The median per-layer compute the reports of ``spans`` claim; of an even
    count, the slower of the middle two, so one fast liar beside one honest
    peer moves nothing, and beside more moves it at most onto an honest claim. (Many identities can still move it: a Sybil's claims
    buy it first contact, never a lower price than its own claim.)"""
    per_layer = sorted(_claimed_compute_ms(s) / (s.end - s.start) for s in spans if s.end > s.start)
    return per_layer[len(per_layer) // 2] if per_layer else None


def span_cost_ms(span: Span, latency_ms: dict[str, float] | None = None,
                 measured_ms: dict[str, float] | None = None, ref_ms_per_layer: float | None = None,
                 prefer: set[str] | frozenset[str] | None = None, *,
                 claim_floor_ms_per_layer: float | None = None) -> float:
    """Estimated ms per token through ``span``.

    ``measured_ms[peer]``, the per-token time the client measured for this
    peer (round trip plus compute of a decode step), replaces any estimate.
    Otherwise: the round trip (``latency_ms[peer]``, or DEFAULT_HOP_MS, twice
    for a peer behind a relay: client to relay to peer) plus the compute the
    report claims, never below MIN_UNMEASURED_MS_PER_TOKEN, nor below
    ``ref_ms_per_layer`` (the best measured) per layer -- a claim beyond
    CLAIM_ADVANTAGE times faster than that is implausible and pays
    IMPLAUSIBLE_PENALTY_MS -- nor, when nothing is measured, below
    ``claim_floor_ms_per_layer`` (the median claim) per layer. A peer with one
    free session left is nudged below one with room (it may be gone by the
    time we ask). With ``prefer`` given, a peer outside it pays, for each of
    its layers, ``ref_ms_per_layer`` or else ``claim_floor_ms_per_layer``, at
    least UNVERIFIED_PENALTY_MS_PER_LAYER."""
    layers = span.end - span.start
    extra = 1.0 / max(1, span.free_sessions)  # crowding
    if prefer is not None and span.peer_id not in prefer:  # replaying a layer costs about a layer's compute
        per_layer = ref_ms_per_layer if ref_ms_per_layer is not None else claim_floor_ms_per_layer
        extra += max(UNVERIFIED_PENALTY_MS_PER_LAYER, per_layer or 0.0) * layers
    measured = (measured_ms or {}).get(span.peer_id)
    if _finite_nonneg(measured):
        return float(measured) + extra
    hop = (latency_ms or {}).get(span.peer_id, DEFAULT_HOP_MS * (2 if span.relayed else 1))
    if not _finite_nonneg(hop):
        hop = DEFAULT_HOP_MS
    compute = _claimed_compute_ms(span)
    if ref_ms_per_layer is not None:  # what we measured bounds what a claim can win: nothing
        floor = ref_ms_per_layer * layers
        if compute < floor / CLAIM_ADVANTAGE:
            return hop + floor + IMPLAUSIBLE_PENALTY_MS + extra
        compute = max(compute, floor)
    elif claim_floor_ms_per_layer is not None:
        compute = max(compute, claim_floor_ms_per_layer * layers)
    return hop + compute + extra


def plan_route(
    spans: Iterable[Span],
    start: int,
    end: int,
    *,
    banned: set[str] = frozenset(),
    latency_ms: dict[str, float] | None = None,
    measured_ms: dict[str, float] | None = None,
    prefer: set[str] | frozenset[str] | None = None,
) -> list[Span]:
    """The cheapest chain of peers covering layers [start, end), boundary to boundary
    (costs per :func:`span_cost_ms`; ``measured_ms`` beats advertised throughput;
    ``prefer``: the peers with a verified record, None for no preference; a route
    with fewer layers outside it wins whatever its ms)."""
    usable = [s for s in spans if s.peer_id not in banned and not s.departing and s.free_sessions > 0 and s.start < s.end]
    ref = best_measured_ms_per_layer(usable, measured_ms)
    floor = median_claim_ms_per_layer(usable) if ref is None else None
    # A peer with no record is priced no better per layer than the verified peers' median claim:
    # the median of all claims is, beside one liar, the fastest honest one, and a whole-model
    # claim at that rate undercuts a verified chain by however far apart its hops measured.
    vouched = median_claim_ms_per_layer([s for s in usable if s.peer_id in prefer]) if prefer and floor else None
    unverified_floor = max(floor, vouched) if vouched is not None else floor
    edges: dict[int, list[Span]] = {}
    for s in usable:
        edges.setdefault(s.start, []).append(s)
    # A route's cost: first the layers it puts on peers without a verified record, then ms
    # per token. With real round trips (tens of ms) a whole-model claim outbids a vouched
    # chain by the crossings it saves, whatever a per-layer charge, and each such claim at
    # a made-up address cost a fresh client a first contact's timeout (bench/sim.py with
    # --verdicts, docs/scale.md): so strangers fill only the layers no vouched peer serves.
    # With ``prefer`` None, or nobody in it, the first part is the same for every route.
    inf = (float("inf"), float("inf"))
    best: dict[int, tuple[int, float]] = {start: (0, 0.0)}
    prev: dict[int, Span] = {}
    heap = [((0, 0.0), start)]
    while heap:
        cost, at = heapq.heappop(heap)
        if at == end:
            break
        if cost > best.get(at, inf):
            continue
        for s in edges.get(at, []):
            if s.end > end:
                continue
            unverified = prefer is not None and s.peer_id not in prefer
            ms = span_cost_ms(s, latency_ms, measured_ms, ref, prefer,
                              claim_floor_ms_per_layer=unverified_floor if unverified else floor)
            c = (cost[0] + (s.end - s.start if unverified else 0), cost[1] + ms)
            if c < best.get(s.end, inf):
                best[s.end] = c
                prev[s.end] = s
                heapq.heappush(heap, (c, s.end))
    if end not in best:
        gaps = missing_layers(usable, start, end)
        detail = "" if gaps else "peers exist for every layer, but their ranges do not chain from one boundary to the next"
        raise NoRoute(gaps or [(start, end)], detail)
    route, at = [], end
    while at != start:
        s = prev[at]
        route.append(s)
        at = s.start
    return route[::-1]
