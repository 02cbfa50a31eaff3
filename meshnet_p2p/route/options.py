"""What a route is opened with: one generation's request and limits
(:class:`RouteOptions`), and what the client measured of peers, kept across
its generations (:class:`PeerMeasures`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from meshnet_p2p.dataplane.transport.pool import ChannelPool
from meshnet_p2p.dataplane.transport.tls import TlsCredentials
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.swarm.placement import plan_route


@dataclass(frozen=True)
class RouteOptions:
    max_tokens: int  # KV positions each hop reserves (prompt + generated)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ring: bool = False  # peers forward to each other (docs/ring.md); else the client carries every hop
    stop_at_eog: bool = True  # where the ring's tail stops feeding the head, as generate() stops
    step_timeout: float = 10.0  # a hop's answer to one step
    open_timeout: float = 60.0  # seconds to find and open a route, across candidates
    max_failovers: int = 4
    ban_seconds: float = 60.0  # how long a peer at fault is left out of plans
    attest: bool = False  # keep each hop's digests, to check its attestation (certification only)
    planner: Callable[..., list] = plan_route  # or a certifier's (at least two peers, some banned)
    client_creds: TlsCredentials | None = None  # the certificate presented to peers (default: this process's)
    pool: ChannelPool | None = None  # channels shared with the owner's other sessions (None: one per hop)
    on_event: Callable[[str], None] = lambda msg: None

    def __post_init__(self) -> None:
        if self.ring and self.attest:
            raise ValueError("a ring route does not attest: certification drives every hop itself")


# An unmeasured peer is priced at this quantile of the round trips measured so far (0.5:
# the median; of an even count, the slower middle one). bench/sim.py, 200 peers, seed 1,
# 3 simulated minutes, 92 surveys (docs/scale.md): routes opened in 2.0 s p50 against
# 7.4 s in the 2 ms default's rounds, their rings as good within one run's noise (p50
# 1.1-1.5x the oracle's across runs of this rule and the lower quartile's, 1.34x before).
# Lower quantiles explore more: the least measured took 6 rounds p90 for no better rings.
UNMEASURED_QUANTILE = 0.5


def _quantile(values) -> float | None:
    seen = sorted(values)
    return seen[min(len(seen) - 1, int(UNMEASURED_QUANTILE * len(seen)))] if seen else None


@dataclass
class PeerMeasures:
    """Per peer, what re-planning goes by instead of what reports claim."""

    latency_ms: dict[str, float] = field(default_factory=dict)  # a measured round trip
    measured_ms: dict[str, float] = field(default_factory=dict)  # ms per decode step, smoothed

    def round_trip(self, peer: str, ms: float) -> None:
        """A round trip measured at first contact: the least seen counts (one sample on a busy
        host can be 20x the link's, and would price an honest peer out of its route)."""
        old = self.latency_ms.get(peer)
        self.latency_ms[peer] = ms if old is None else min(old, ms)

    def unmeasured_round_trip_ms(self) -> float | None:
        """What a peer not yet measured is priced at: UNMEASURED_QUANTILE of the round
        trips measured so far, None before any. Read from a copy: first contacts left to
        finish alone still write to the table."""
        return _quantile(self.latency_ms.copy().values())

    def round_trips(self, spans) -> dict[str, float]:
        """The round trip to plan with, for each of ``spans``' peers: measured, or
        :meth:`unmeasured_round_trip_ms` (twice for a peer behind a relay: client to relay
        to peer). Priced at placement's DEFAULT_HOP_MS, a LAN's, beside measured ones at
        an internet's, a peer never contacted looked cheaper than every one just measured,
        and the search went on contacting instead of opening (bench/sim.py: up to 8 rounds)."""
        known = self.latency_ms.copy()
        typical = self.unmeasured_round_trip_ms()  # (no await between: the same table as known)
        if typical is None:
            return known
        out = {s.peer_id: typical * (2 if s.relayed else 1) for s in spans if s.peer_id not in known}
        out.update(known)
        return out

    def decode_step(self, peer: str, ms: float) -> None:
        old = self.measured_ms.get(peer)
        self.measured_ms[peer] = ms if old is None else 0.8 * old + 0.2 * ms
