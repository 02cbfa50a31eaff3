"""What this client knows of each peer's computing, and how often it checks it.

A peer earns a *verified record* only from what this client checked itself
(an audit by exact replay matched its outputs) or what a certifier it trusts
vouched for (the peers whose work its certificate's evidence shows: they
computed the certified forward exactly). Nothing a peer or a stranger says
counts. A proven mismatch (its output contradicted by two independent
replays) marks it caught: it is left out of every plan. A mismatch one replay
shows but none confirms is no proof, so nobody is blamed, but the record is
reset: the peer is checked on every session again.

Pure: the client updates it from what its routes and audits saw.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable

AUDIT_RATE = 0.05  # default: at least one hop-session in twenty is replayed, however long a peer's record
VOUCHED_SESSIONS = 4  # a trusted certificate's evidence counts as this many verified sessions


@dataclass
class PeerRecord:
    verified: int = 0  # sessions of its whose audit matched exactly
    unconfirmed: int = 0  # mismatches one replay showed and none confirmed
    caught: str = ""  # why it was proven to compute something else ("" while it was not)

    def to_dict(self, vouched: bool) -> dict:
        return {"verified_sessions": self.verified, "vouched": vouched, "unconfirmed_mismatches": self.unconfirmed,
                "caught": self.caught or None}


class PeerRecords:
    """Per peer: its record with this client. Thread-safe (routes and audits run in worker threads)."""

    def __init__(self) -> None:
        self._by: dict[str, PeerRecord] = {}
        self._vouched: set[str] = set()
        self._lock = threading.Lock()

    def vouch(self, peers: Iterable[str]) -> None:
        """Peers a trusted certifier's evidence shows computing exactly (replaces the last set)."""
        with self._lock:
            self._vouched = set(peers)

    def _get(self, peer: str) -> PeerRecord:
        return self._by.setdefault(peer, PeerRecord())

    def verified(self, peer: str) -> bool:
        with self._lock:
            r = self._by.get(peer)
            if r is not None and r.caught:
                return False
            return (r is not None and r.verified > 0) or (peer in self._vouched and (r is None or not r.unconfirmed))

    def caught(self) -> dict[str, str]:
        with self._lock:
            return {p: r.caught for p, r in self._by.items() if r.caught}

    def audit_probability(self, peer: str, rate: float = AUDIT_RATE) -> float:
        """How likely one session of ``peer`` is audited: every session until it has a
        verified record, then falling with that record (1/(1+n)) to ``rate``."""
        with self._lock:
            r = self._by.get(peer) or PeerRecord()
            n = r.verified + (VOUCHED_SESSIONS if peer in self._vouched and not r.unconfirmed else 0)
        if r.caught or n == 0:
            return 1.0
        return max(min(1.0, rate), 1.0 / (1 + n))

    def matched(self, peer: str) -> None:
        with self._lock:
            self._get(peer).verified += 1

    def unconfirmed(self, peer: str) -> None:
        """One replay disagreed, none confirmed: no blame, but its record starts again."""
        with self._lock:
            r = self._get(peer)
            r.verified = 0
            r.unconfirmed += 1

    def catch(self, peer: str, why: str) -> None:
        with self._lock:
            r = self._get(peer)
            r.verified = 0
            r.caught = why or "computed something else than the certified recipe"

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            peers = set(self._by) | self._vouched
            return {p: (self._by.get(p) or PeerRecord()).to_dict(p in self._vouched) for p in sorted(peers)}
