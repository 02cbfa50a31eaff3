"""Who gets a relayed peer's circuits when a client asks for one: a pure
function of who holds them (data in, a decision out, no I/O).

A relay carries at most ``capacity`` circuits to each reserved peer. Without
more, whoever opens them first holds them: 16 idle connections from one host
took a relayed volunteer off the network (issue 24 #2). So:

- Each client source (its network, ``netgroup.ip_group``: IPv4 /24, IPv6 /48;
  an exempt loopback or private address counts alone) holds at most
  ``per_source`` of one peer's circuits once fewer than ``per_source`` are
  free: addresses cost an attacker something, and the relay knows nothing
  else about a client (TLS runs end to end, it sees no certificate). While
  more are free, a source may go over its share (a crowd behind one NAT);
  the circuits kept free serve newcomers from elsewhere at once, and the
  take-back below returns the rest.
- When the peer's circuits are all held, a newcomer takes one back from the
  source holding most, the circuit idle longest, as the peer's own session
  admission does (``admission.decide``, reused here: one notion of a fair
  share); a source that holds no more than the newcomer's plus one keeps
  what it has, so shares move toward equal and never flip back and forth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from meshnet_p2p.core.netgroup import network_of
from meshnet_p2p.dataplane.admission import Admit, Claimant, Held, Reclaim, Refuse, decide

SOURCE_LIMIT = "source_limit"  # the client's network holds its share of this peer's circuits
CIRCUIT_LIMIT = "circuit_limit"  # the peer's circuits are all held, and fairly shared: nothing to take back


def circuit_source(host: str) -> str:
    """A client's source for the per-source bound: its public network (IPv4
    /24, IPv6 /48), or the exact address where ``ip_group`` exempts it."""
    return network_of(host)


def per_source_limit(capacity: int) -> int:
    """Circuits one source may hold to one peer: a quarter of the peer's, at
    least 2 (a client's own channel and a ring link from the same host), never
    more than the peer's."""
    return min(capacity, max(2, capacity // 4))


@dataclass(frozen=True)
class Circuit:
    circuit_id: str
    source: str  # circuit_source() of the client
    idle_s: float  # since it last moved a byte (or since it was opened)


def admit_circuit(held: Sequence[Circuit], source: str, *, capacity: int, per_source: int) -> Admit | Reclaim | Refuse:
    """Admit a new circuit from ``source`` to a peer, after taking one back
    (``Reclaim``: close that circuit first), or refuse it (``Refuse.reason``:
    SOURCE_LIMIT or CIRCUIT_LIMIT). ``held``: the peer's circuits now."""
    if sum(1 for c in held if c.source == source) >= per_source and capacity - len(held) <= per_source:
        return Refuse(SOURCE_LIMIT)
    sessions = [Held(c.circuit_id, Claimant(c.source, c.source), int(c.idle_s * 1000), False) for c in held]
    # every source has its one "client" (the relay cannot tell clients apart): the anonymous budget never applies
    decision = decide(sessions, Claimant(source, source), capacity=capacity)
    return Refuse(CIRCUIT_LIMIT) if isinstance(decision, Refuse) else decision


__all__ = ["Admit", "Circuit", "CIRCUIT_LIMIT", "Reclaim", "Refuse", "SOURCE_LIMIT", "admit_circuit",
           "circuit_source", "per_source_limit"]
