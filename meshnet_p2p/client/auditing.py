"""The client's audits: which hop-sessions of a generation are replayed, and
what their verdicts do to each peer's record.

After a generation (off its latency: the answer is already out), each hop of
each route it used is audited with the probability its peer's record gives
(records.py: every session until the peer has a verified record, then
falling to the audit rate), by exact replay on other peers (audit.py), in a
background thread. A match adds to the peer's record; a proven mismatch
catches it (never planned again); one replay that disagrees and none that
confirms resets its record (checked every session again), and nobody is
blamed. ``localize`` audits every hop of a route that was outvoted, at once.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
from typing import Callable

from meshnet_p2p.core.errors import MeshnetError, sanitize

from .audit import AuditResult, Verdict, audit_hop
from .chain import Chain
from .options import PeerMeasures, RouteOptions
from .records import PeerRecords
from .transcript import HopTranscript, transcript_of


def transcripts(route: Chain, n_layer: int) -> list[HopTranscript]:
    """Every hop of ``route`` that computed anything, failed-over ones too."""
    o = route.opts
    return [transcript_of(h, n_layer, o.sampling, o.max_tokens) for h in [*route.hops, *route.retired] if h.history]


class Auditor:
    """Audits hop transcripts and keeps ``records`` up to date with the verdicts."""

    def __init__(self, records: PeerRecords, spans_provider: Callable[[], list], opts: Callable[[], RouteOptions],
                 measures: PeerMeasures, rate: float, on_event: Callable[[str], None] = lambda m: None) -> None:
        self.records = records
        self.spans_provider = spans_provider  # plain code: usable from the auditing thread
        self.opts = opts
        self.measures = measures
        self.rate = rate
        self.on_event = on_event
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.results: list[AuditResult] = []
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._closed = False  # audits not yet started are dropped

    def audit(self, t: HopTranscript, *, exclude: set[str] = frozenset(), spans_provider=None) -> AuditResult:
        """One audit, now (blocking); its verdict applied to the records. ``spans_provider``:
        the caller's, when it runs in a generation's thread (its surveys go back to its loop)."""
        opts = dataclasses.replace(self.opts(), on_event=lambda m: None)
        result = audit_hop(t, spans_provider or self.spans_provider, opts, exclude=exclude, measures=self.measures)
        self._apply(result)
        return result

    def _apply(self, r: AuditResult) -> None:
        if r.verdict is Verdict.MATCH:
            self.records.matched(r.peer_id)
        elif r.verdict is Verdict.MISMATCH:
            self.records.catch(r.peer_id, r.detail)
            self.on_event(f"peer {r.peer_id} caught by audit: {r.detail}; it is left out from now on")
        elif r.verdict is Verdict.UNCONFIRMED:
            self.records.unconfirmed(r.peer_id)
        elif r.verdict is Verdict.UNDECIDED:
            for suspect in r.suspect:
                self.records.unconfirmed(suspect)
        with self._lock:
            self.results.append(r)

    def localize(self, route: Chain, n_layer: int, spans_provider=None) -> list[str]:
        """Audit every hop of an outvoted route now: the peers proven to mismatch."""
        caught = []
        for t in transcripts(route, n_layer):
            try:
                if self.audit(t, spans_provider=spans_provider).verdict is Verdict.MISMATCH:
                    caught.append(t.peer_id)
            except MeshnetError as e:
                self.on_event(f"could not audit {t.peer_id}: {sanitize(e)}")
        return caught

    def pick(self, routes: list[Chain], n_layer: int) -> list[HopTranscript]:
        """The hop-sessions of ``routes`` to audit, each with its peer's probability."""
        caught = self.records.caught()
        return [t for r in routes for t in transcripts(r, n_layer)
                if t.peer_id not in caught and random.random() < self.records.audit_probability(t.peer_id, self.rate)]

    def submit(self, items: list[HopTranscript]) -> None:
        """Audit ``items`` in the background, one at a time."""
        if not items:
            return
        with self._lock:
            self._pending += len(items)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="audits", daemon=True)
                self._thread.start()
        for t in items:
            self._queue.put(t)

    def _work(self) -> None:
        while True:
            t = self._queue.get()
            if t is None:
                return
            try:
                if not self._closed:
                    self.audit(t)
            except Exception as e:  # an audit that cannot run blames nobody; the next one still runs
                self.on_event(f"could not audit {t.peer_id}: {sanitize(e)}")
            finally:
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted audit ran; False if ``timeout`` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
