"""What this client knows of each peer's computing, and how often it checks it.

A peer earns a *verified record* only from what this client checked itself
(an audit by exact replay matched its outputs) or what a certifier it trusts
vouched for (the peers whose work its certificate's evidence shows: they
computed the certified forward exactly; the peers its signed verdicts say it
verified by its own audits). Nothing a peer or a stranger says counts. A
proven mismatch (its output contradicted by two independent replays, here or
in a stranger's report this client re-checked) marks it caught: it is left
out of every plan; so is a peer a trusted certifier convicted (held in memory
only, from the last survey: a certifier may retract). A mismatch one replay
shows but none confirms is no proof, so nobody is blamed, but the record is
reset: the peer is checked on every session again.

The client updates it from what its routes and audits saw, and keeps it in a
file of its own (``records_path``: one per model, under the cache directory,
0600), so a client run after run builds on what it verified before and
``status`` can show it. A file that will not parse is started afresh.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Iterable

import msgpack

from meshnet_p2p.engine.models import cache_dir

AUDIT_RATE = 0.05  # default: at least one hop-session in twenty is replayed, however long a peer's record
VOUCHED_SESSIONS = 4  # a trusted certificate's evidence counts as this many verified sessions
MAX_KEPT = 4096  # peers a records file keeps (the caught and the best verified first)
MAX_FILE_BYTES = 4 << 20


def records_path(model_digest: str) -> str:
    """Where a client keeps its records of the peers of one model."""
    return os.path.join(cache_dir(), "records", f"{model_digest}.msgpack")


@dataclass
class PeerRecord:
    verified: int = 0  # sessions of its whose audit matched exactly
    unconfirmed: int = 0  # mismatches one replay showed and none confirmed
    caught: str = ""  # why it was proven to compute something else ("" while it was not)

    def to_dict(self, vouched: bool) -> dict:
        return {"verified_sessions": self.verified, "vouched": vouched, "unconfirmed_mismatches": self.unconfirmed,
                "caught": self.caught or None}


class PeerRecords:
    """Per peer: its record with this client. Thread-safe (routes and audits run in worker
    threads). With ``path``, loaded from that file and written back at every change."""

    def __init__(self, path: str | None = None) -> None:
        self._by: dict[str, PeerRecord] = load_records(path) if path else {}
        self._vouched: set[str] = set()
        self._convicted: dict[str, str] = {}  # by trusted certifiers, as the last survey found
        self._lock = threading.Lock()
        self.path = path

    def vouch(self, peers: Iterable[str]) -> None:
        """Peers a trusted certifier's evidence shows computing exactly (replaces the last set)."""
        with self._lock:
            self._vouched = set(peers)

    def convict(self, convicted: dict[str, str]) -> None:
        """Peers trusted certifiers convicted: peer -> why (replaces the last set)."""
        with self._lock:
            self._convicted = dict(convicted)

    def _get(self, peer: str) -> PeerRecord:
        return self._by.setdefault(peer, PeerRecord())

    def verified(self, peer: str) -> bool:
        with self._lock:
            r = self._by.get(peer)
            if (r is not None and r.caught) or peer in self._convicted:
                return False
            return (r is not None and r.verified > 0) or (peer in self._vouched and (r is None or not r.unconfirmed))

    def caught(self) -> dict[str, str]:
        with self._lock:
            return {**self._convicted, **{p: r.caught for p, r in self._by.items() if r.caught}}

    def audit_probability(self, peer: str, rate: float = AUDIT_RATE) -> float:
        """How likely one session of ``peer`` is audited: every session until it has a
        verified record, then falling with that record (1/(1+n)) to ``rate``."""
        with self._lock:
            r = self._by.get(peer) or PeerRecord()
            n = r.verified + (VOUCHED_SESSIONS if peer in self._vouched and not r.unconfirmed else 0)
        if r.caught or n == 0 or peer in self._convicted:
            return 1.0
        return max(min(1.0, rate), 1.0 / (1 + n))

    def matched(self, peer: str) -> None:
        with self._lock:
            self._get(peer).verified += 1
            self._save()

    def unconfirmed(self, peer: str) -> None:
        """One replay disagreed, none confirmed: no blame, but its record starts again."""
        with self._lock:
            r = self._get(peer)
            r.verified = 0
            r.unconfirmed += 1
            self._save()

    def catch(self, peer: str, why: str) -> None:
        with self._lock:
            r = self._get(peer)
            r.verified = 0
            r.caught = (why or "computed something else than the certified recipe")[:1000]
            self._save()

    def _save(self) -> None:
        """Under the lock: the records to their file, whole or not at all (a reader never sees half)."""
        if self.path is not None:
            save_records(self.path, self._by)

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            peers = set(self._by) | self._vouched | set(self._convicted)
            out = {p: (self._by.get(p) or PeerRecord()).to_dict(p in self._vouched) for p in sorted(peers)}
            for p, why in self._convicted.items():
                out[p]["convicted"] = why
            return out


def load_records(path: str) -> dict[str, PeerRecord]:
    """A records file's peers; empty when it is missing, too big or malformed (it is only this client's memory)."""
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            return {}
        with open(path, "rb") as f:
            doc = msgpack.unpackb(f.read(), raw=False, strict_map_key=True)
    except (OSError, ValueError, TypeError, msgpack.UnpackException):
        return {}
    if not isinstance(doc, dict):
        return {}
    out = {}
    for peer, entry in list(doc.items())[:MAX_KEPT]:  # a malformed entry is left out
        if type(peer) is str and len(peer) <= 128 and isinstance(entry, list) and len(entry) == 3 and \
                [type(x) for x in entry] == [int, int, str] and entry[0] >= 0 and entry[1] >= 0:
            out[peer] = PeerRecord(entry[0], entry[1], entry[2][:1000])
    return out


def save_records(path: str, by: dict[str, PeerRecord]) -> None:
    kept = sorted(by.items(), key=lambda kv: (not kv[1].caught, -kv[1].verified))[:MAX_KEPT]
    data = msgpack.packb({p: [r.verified, r.unconfirmed, r.caught] for p, r in kept})
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".records-")  # 0600
    except OSError:  # a read-only cache: the records live in this process only
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
