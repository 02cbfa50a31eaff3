"""The client's audits: which hop-sessions of a generation are replayed, and
what their verdicts do to each peer's record.

After a generation (off its latency: the answer is already out), each hop of
each route it used is audited with the probability its peer's record gives
(peer_records.py: every session until the peer has a verified record, then
falling to the audit rate), by exact replay on other peers (replay.py), in a
background thread. A match adds to the peer's record; a proven mismatch
catches it (never planned again); one replay that disagrees and none that
confirms resets its record (checked every session again), and nobody is
blamed. ``localize`` audits every hop of a route that was outvoted, at once.

Proofs travel (trust/verdicts.py): a proven mismatch whose proof others can
check is published as a signed fraud report, and the reports others published
against the peers a generation used are fetched (each peer at most once per
``REPORT_LOOKUP_INTERVAL_S``, at most 4 reports each) and re-checked here by
replay (recheck.py): a peer is caught on a report only when this client's own
replays confirm it. Each report is re-checked once; a reporter whose report
the replays refute is not heard again (a false report costs its maker a
session with the peer, and this client one replay).
"""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
import time
from typing import Callable, Iterable

from meshnet_p2p.core.records import Record
from meshnet_p2p.trust.fraud_proof import FraudProof, FraudProofError
from meshnet_p2p.trust.verdicts import proof_of

from meshnet_p2p.core.errors import MeshnetError, sanitize

from meshnet_p2p.route.chain import Chain
from meshnet_p2p.route.errors import ClientClosed
from meshnet_p2p.route.options import PeerMeasures, RouteOptions

from .replay import AuditResult, Verdict, audit_hop
from .recheck import Recheck, RecheckResult, recheck_proof
from .peer_records import PeerRecords
from .transcript import HopTranscript, route_tokens, transcript_of


REPORT_LOOKUP_INTERVAL_S = 600.0  # how often one peer's fraud reports are looked up again
MAX_SEEN_REPORTS = 4096

# the network calls the auditor is given: sign a report of a proof -> (key, record wire), and
# publish reports / fetch those against peers -> {peer: [verified report records]}
SignReport = Callable[[FraudProof], tuple[str, bytes]]
ExchangeReports = Callable[[list[tuple[str, bytes]], list[str]], dict[str, list[Record]]]


def transcripts(route: Chain, n_layer: int) -> list[HopTranscript]:
    """Every hop of ``route`` that computed anything, failed-over ones too."""
    o, hops = route.opts, [*route.hops, *route.retired]
    tokens = route_tokens(hops)
    return [transcript_of(h, n_layer, o.sampling, o.max_tokens, tokens,
                          tuple(sorted({x.span.start for x in route.hops if x.span.end <= h.span.start})))
            for h in hops if h.history]


class Auditor:
    """Audits hop transcripts and keeps ``records`` up to date with the verdicts."""

    def __init__(self, records: PeerRecords, spans_provider: Callable[[], list], opts: Callable[[], RouteOptions],
                 measures: PeerMeasures, rate: float, on_event: Callable[[str], None] = lambda m: None, *,
                 sign_report: SignReport | None = None, exchange: ExchangeReports | None = None) -> None:
        self.records = records
        self._spans_provider = spans_provider  # plain code: usable from the auditing thread
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
        self.sign_report = sign_report
        self.exchange = exchange
        self._outbox: list[tuple[str, bytes]] = []  # reports of proofs found here, not yet published
        self._looked_up: dict[str, float] = {}  # peer -> when its reports were last fetched
        self._seen: set[bytes] = set()  # report signatures already re-checked
        self._liars: set[str] = set()  # reporters whose report this client's replays refuted: not heard again
        self.rechecks: list[RecheckResult] = []

    def spans_provider(self) -> list:
        """The spans an audit routes over; once closed, ClientClosed: a closed client's
        audit under way surveys the swarm no more."""
        if self._closed:
            raise ClientClosed("the client was closed")
        return self._spans_provider()

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
            if r.proof is not None and self.sign_report is not None and r.proof.transferable() is None:
                with self._lock:
                    self._outbox.append(self.sign_report(r.proof))
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

    def submit(self, items: list[HopTranscript], peers: Iterable[str] = ()) -> None:
        """Audit ``items`` in the background, one at a time; then publish the reports those
        audits made and fetch and re-check reports against ``peers`` (those a generation used)."""
        if self.exchange is not None:
            now = time.monotonic()
            due = sorted(p for p in set(peers) if now - self._looked_up.get(p, -REPORT_LOOKUP_INTERVAL_S)
                         >= REPORT_LOOKUP_INTERVAL_S)
            for p in due:
                self._looked_up[p] = now
            if due or items or self._outbox:
                items = [*items, ("reports", tuple(due))]
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
                if self._closed:
                    pass
                elif isinstance(t, tuple):
                    self._exchange(list(t[1]))
                else:
                    self.audit(t)
            except ClientClosed:
                pass
            except Exception as e:  # an audit that cannot run blames nobody; the next one still runs
                self.on_event(f"could not audit {getattr(t, 'peer_id', 'reports')}: {sanitize(e)}")
            finally:
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()

    def _exchange(self, peers: list[str]) -> None:
        """Publish the reports made here; fetch those against ``peers`` and re-check each new one."""
        with self._lock:
            outbox, self._outbox = self._outbox, []
        if not outbox and not peers:
            return
        if self._closed:
            raise ClientClosed("the client was closed")
        found = self.exchange(outbox, peers)
        for peer, reports in found.items():
            for record in reports:
                if peer in self.records.caught() or record.signature in self._seen or str(record.signer) in self._liars:
                    continue
                if len(self._seen) < MAX_SEEN_REPORTS:
                    self._seen.add(record.signature)
                self.recheck(record)

    def recheck(self, record: Record) -> RecheckResult | None:
        """Re-check one verified report record by this client's own replays; catch its peer if confirmed."""
        try:
            proof = proof_of(record)
        except FraudProofError as e:
            self.on_event(f"a fraud report from {record.signer} does not parse: {e}")
            return None
        opts = dataclasses.replace(self.opts(), on_event=lambda m: None)
        result = recheck_proof(proof, self.spans_provider, opts, measures=self.measures)
        with self._lock:
            self.rechecks.append(result)
        if result.outcome is Recheck.CONFIRMED:
            self.records.catch(proof.peer_id, f"a fraud report from {record.signer}, re-checked here: {result.detail}")
            self.on_event(f"peer {proof.peer_id} caught on a fraud report from {record.signer} that this client's "
                          "own replays confirm; it is left out from now on")
        elif result.outcome is Recheck.REFUTED:
            self._liars.add(str(record.signer))
            self.on_event(f"a fraud report from {record.signer} against {proof.peer_id} is false: {result.detail}")
        return result

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted audit ran; False if ``timeout`` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
