"""What this client knows of each peer's computing, and how often it checks it.

A peer earns a *verified record* only from what this client checked itself
(an audit by exact replay matched its outputs) or what a certifier it trusts
vouched for (the peers whose work its certificate's evidence shows: they
computed the certified forward exactly; the peers its signed verdicts say it
verified by its own audits). Nothing a peer or a stranger says counts. A
vouch lets a peer be planned without a second route beside it; it does not
lower how often this client replays the peer's sessions: that falls only with
this client's own exact checks (issue 59: a peer vouched once, then lying,
fooled every fresh client that trusted the vouch for four sessions' worth).
A peer someone published a fraud report against is *reported* until this
client's replays settle every such report: meanwhile it has no verified
record (it is never the one route an answer depends on), whatever vouched. A
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

import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import msgpack

from meshnet_p2p.engine.models import cache_dir

AUDIT_RATE = 0.05  # default: at least one hop-session in twenty is replayed, however long a peer's record
MAX_REPORTED = 4096  # unsettled fraud reports held in memory (each a signature)
# A verified record decays: its sessions halve for every week since its last exact match, so a
# peer nobody has checked for a while is checked as often as a newcomer again (issue 59: trust
# is earned from many checks over time, and kept only while they go on)
HALF_LIFE_S = 7 * 24 * 3600.0
MAX_KEPT = 4096  # peers a records file keeps (the caught and the best verified first)
MAX_FILE_BYTES = 4 << 20


def records_path(model_digest: str) -> str:
    """Where a client keeps its records of the peers of one model."""
    return os.path.join(cache_dir(), "records", f"{model_digest}.msgpack")


@dataclass
class PeerRecord:
    verified: int = 0  # sessions of its whose audit matched exactly (as of ``at``)
    unconfirmed: int = 0  # mismatches one replay showed and none confirmed
    caught: str = ""  # why it was proven to compute something else ("" while it was not)
    at: float = 0.0  # when its last session matched (wall seconds; 0: unknown, an old file's)

    def sessions(self, now: float) -> int:
        """Its verified sessions, decayed (HALF_LIFE_S) since the last match."""
        if not self.verified or not self.at:
            return self.verified
        return math.floor(self.verified * 0.5 ** (max(0.0, now - self.at) / HALF_LIFE_S) + 0.5)  # nearest

    def to_dict(self, vouched: bool, now: float | None = None) -> dict:
        """Its fields as shown (``now``: its sessions as decayed then; default the wall clock's)."""
        return {"verified_sessions": self.sessions(time.time() if now is None else now), "vouched": vouched,
                "unconfirmed_mismatches": self.unconfirmed, "caught": self.caught or None}


class PeerRecords:
    """Per peer: its record with this client. Thread-safe (routes and audits run in worker
    threads). With ``path``, loaded from that file and written back at every change."""

    def __init__(self, path: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self._by: dict[str, PeerRecord] = load_records(path) if path else {}
        self._vouched: set[str] = set()
        self._convicted: dict[str, str] = {}  # by trusted certifiers, as the last survey found
        self._reported: dict[str, set[bytes]] = {}  # peer -> its fraud reports not settled here yet
        self._lock = threading.Lock()
        self.path = path
        self.clock = clock

    def vouch(self, peers: Iterable[str]) -> None:
        """Peers a trusted certifier's evidence shows computing exactly (replaces the last set)."""
        with self._lock:
            self._vouched = set(peers)

    def convict(self, convicted: dict[str, str]) -> None:
        """Peers trusted certifiers convicted: peer -> why (replaces the last set)."""
        with self._lock:
            self._convicted = dict(convicted)

    def report(self, peer: str, report_id: bytes) -> None:
        """A fraud report against ``peer`` that this client has not settled: the peer has
        no verified record until every such report is settled (:meth:`settle`)."""
        with self._lock:
            if sum(len(v) for v in self._reported.values()) < MAX_REPORTED:
                self._reported.setdefault(peer, set()).add(report_id)

    def settle(self, peer: str, report_id: bytes) -> None:
        """A report against ``peer`` this client's replays refuted (or that is moot)."""
        with self._lock:
            left = self._reported.get(peer)
            if left is not None:
                left.discard(report_id)
                if not left:
                    del self._reported[peer]

    def reported(self, peer: str) -> bool:
        with self._lock:
            return bool(self._reported.get(peer))

    def _get(self, peer: str) -> PeerRecord:
        return self._by.setdefault(peer, PeerRecord())

    def verified(self, peer: str) -> bool:
        with self._lock:
            r = self._by.get(peer)
            if (r is not None and r.caught) or peer in self._convicted or self._reported.get(peer):
                return False
            return (r is not None and r.sessions(self.clock()) > 0) or \
                (peer in self._vouched and (r is None or not r.unconfirmed))

    def checked(self, peer: str) -> bool:
        """Verified by this client's own exact checks (its decayed sessions), not only vouched:
        what a peer that alone computes a whole answer needs to be stepped without a second route."""
        with self._lock:
            r = self._by.get(peer)
            if r is None or r.caught or peer in self._convicted or self._reported.get(peer):
                return False
            return r.sessions(self.clock()) > 0

    def caught(self) -> dict[str, str]:
        with self._lock:
            return {**self._convicted, **{p: r.caught for p, r in self._by.items() if r.caught}}

    def audit_probability(self, peer: str, rate: float = AUDIT_RATE) -> float:
        """How likely one session of ``peer`` is audited: every session until this client's
        own audits matched one, then falling with its own record (1/(1+n)) to ``rate``.
        A certifier's vouch does not count here (see the module's doc), nor while the
        peer is reported."""
        with self._lock:
            r = self._by.get(peer) or PeerRecord()
            n = r.sessions(self.clock())
            reported = bool(self._reported.get(peer))
        if r.caught or n == 0 or peer in self._convicted or reported:
            return 1.0
        return max(min(1.0, rate), 1.0 / (1 + n))

    def matched(self, peer: str) -> None:
        with self._lock:
            r, now = self._get(peer), self.clock()
            r.verified, r.at = r.sessions(now) + 1, now
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
            peers = set(self._by) | self._vouched | set(self._convicted) | set(self._reported)
            now = self.clock()
            out = {}
            for p in sorted(peers):
                r = self._by.get(p) or PeerRecord()
                out[p] = r.to_dict(p in self._vouched, now)
            for p, why in self._convicted.items():
                out[p]["convicted"] = why
            for p, left in self._reported.items():
                if p in out:
                    out[p]["reported"] = len(left)
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
            out[peer] = PeerRecord(entry[0], entry[1], entry[2][:1000])  # before decay: no time (kept as is)
        elif type(peer) is str and len(peer) <= 128 and isinstance(entry, list) and len(entry) == 4 and \
                [type(x) for x in entry[:3]] == [int, int, str] and type(entry[3]) in (int, float) and \
                entry[0] >= 0 and entry[1] >= 0 and math.isfinite(entry[3]) and entry[3] >= 0:
            out[peer] = PeerRecord(entry[0], entry[1], entry[2][:1000], float(entry[3]))
    return out


def save_records(path: str, by: dict[str, PeerRecord]) -> None:
    kept = sorted(by.items(), key=lambda kv: (not kv[1].caught, -kv[1].verified))[:MAX_KEPT]
    data = msgpack.packb({p: [r.verified, r.unconfirmed, r.caught, r.at] for p, r in kept})
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
