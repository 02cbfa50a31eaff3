"""Who gets a peer's sessions when they run short: a pure function of who
holds what (hivemind/petals style: data in, a decision out, no I/O).

A lone client may use every session a peer has: capacity nobody else wants
is not rationed. When the peer is full, shares are max-min fair in two
levels. Source addresses come first (an IPv4 address, an IPv6 /64), because
addresses cost an attacker something and identities cost nothing; within
one address, client identities (from the client's TLS certificate) share
its part. A newcomer whose group holds at least two fewer sessions than the
biggest group takes one back from it, the one idle longest, so shares move
toward equal and never flip back and forth. Anonymous clients (no
certificate) count as one client per address and together hold at most the
anonymous budget.

Clients behind one relay share the relay's address: a relay splices bytes
and cannot vouch for where they came from.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence


ANONYMOUS = "anonymous"




@dataclass(frozen=True)
class Claimant:
    host: str  # host_group() of the source address
    client: str | None  # the client's peer ID, proven by its TLS certificate; None: anonymous

    @property
    def slot(self) -> str:
        return self.client or ANONYMOUS


@dataclass(frozen=True)
class Held:
    session_id: str
    claimant: Claimant
    idle_ms: int  # since its last request
    running: bool  # a step is computing now


@dataclass(frozen=True)
class Admit:
    pass


@dataclass(frozen=True)
class Reclaim:
    """Admit, after releasing ``session_id`` from the group that holds most."""
    session_id: str


@dataclass(frozen=True)
class Refuse:
    reason: str


Decision = Admit | Reclaim | Refuse


def anonymous_budget(capacity: int) -> int:
    return max(1, capacity // 4)


def decide(held: Sequence[Held], who: Claimant, *, capacity: int, anonymous: int | None = None) -> Decision:
    """Admit ``who`` to one more session, reclaim one from another group first,
    or refuse. ``held``: the sessions admitted now."""
    budget = anonymous_budget(capacity) if anonymous is None else anonymous
    if who.client is None and sum(1 for h in held if h.claimant.client is None) >= budget:
        return Refuse(f"anonymous clients hold this peer's anonymous budget of {budget} "
                      f"session{'s' * (budget != 1)}; connect with a client identity")
    if len(held) < capacity:
        return Admit()
    hosts = Counter(h.claimant.host for h in held)
    top_host, top = _most(hosts)
    if top >= hosts[who.host] + 2:
        pool = [h for h in held if h.claimant.host == top_host]
    else:  # addresses are even enough: share the requester's address between its clients
        pool = [h for h in held if h.claimant.host == who.host]
        if not pool:
            return Refuse(f"all {capacity} sessions are in use")
        slots = Counter(h.claimant.slot for h in pool)
        if _most(slots)[1] < slots[who.slot] + 2:
            return Refuse(f"all {capacity} sessions are in use, shared fairly between their clients")
    biggest, _ = _most(Counter(h.claimant.slot for h in pool))  # within that address, its biggest client gives
    victim = max((h for h in pool if h.claimant.slot == biggest), key=lambda h: (not h.running, h.idle_ms, h.session_id))
    return Reclaim(victim.session_id)


def _most(counts: Counter) -> tuple[str, int]:
    """The biggest group and its count (ties: the greatest name, so the choice is deterministic)."""
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))
