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
check is published as a signed fraud report. The reports others published are
fetched before a route is planned, against the peers this client would trust
without a second route (the client's survey: :meth:`due` and :meth:`heard`),
and again after a generation against the peers it used (each peer at most once
per ``REPORT_LOOKUP_INTERVAL_S``; every report a key holds, earliest first,
verify/reports.py). A peer with a report this client has not settled is
*reported* (peer_records.py): it has no verified record, so it never decides an
answer alone. Each report is re-checked here by replay (recheck.py), in a
worker of its own, off every user's path (:meth:`wait` does not wait for it):
a peer is caught only when this client's own replays confirm a report; a
refuted one settles it, and its reporter is not heard again. A proof is
re-checked once however many reports carry it (cached by its digest), and at
most ``MAX_RECHECKS_PER_PEER`` proofs a peer are re-checked: one source's
flood of forged reports costs this client that many replays, not one each.
"""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import random
import threading
import time
from typing import Callable, Iterable

from meshnet_p2p.core.records import Record, canonical
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
MAX_RECHECKS_PER_PEER = 8  # distinct proofs against one peer this client re-checks by replay
MAX_LOOKED_UP = 64  # peers whose reports one survey looks up (the rest in later ones)

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


def proof_id(record: Record) -> bytes:
    """Which proof a report carries: two reports of one proof are re-checked once."""
    return hashlib.sha256(canonical(record.content.get("proof"))).digest()


class _Worker:
    """One background thread working through a queue, one item at a time, and a
    count of the items not done yet (:meth:`wait`)."""

    def __init__(self, name: str, work: Callable[[object], None]) -> None:
        self.name, self.work = name, work
        self.queue: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.pending = 0
        self.idle = threading.Condition(self.lock)

    def put(self, items: list) -> None:
        with self.lock:
            self.pending += len(items)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.thread.start()
        for t in items:
            self.queue.put(t)

    def _run(self) -> None:
        while True:
            t = self.queue.get()
            if t is None:
                return
            try:
                self.work(t)
            finally:
                with self.lock:
                    self.pending -= 1
                    self.idle.notify_all()

    def wait(self, timeout: float | None) -> bool:
        with self.lock:
            return self.idle.wait_for(lambda: self.pending == 0, timeout)

    def close(self) -> None:
        if self.thread is not None:
            self.queue.put(None)


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
        self._audits = _Worker("audits", self._work)
        self._rechecks = _Worker("rechecks", self._recheck_work)
        self._lock = threading.Lock()
        self.results: list[AuditResult] = []
        self._closed = False  # audits not yet started are dropped
        self.sign_report = sign_report
        self.exchange = exchange
        self._outbox: list[tuple[str, bytes]] = []  # reports of proofs found here, not yet published
        self._looked_up: dict[str, float] = {}  # peer -> when its reports were last fetched
        self._seen: set[bytes] = set()  # proofs (proof_id) already queued for a re-check
        self._per_peer: dict[str, int] = {}  # proofs against a peer queued for a re-check
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
        result = audit_hop(t, spans_provider or self.spans_provider, opts, exclude=exclude, measures=self.measures,
                           verified=self.records.verified)
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

    def pick(self, routes: list[Chain], n_layer: int, skip: Iterable[str] = ()) -> list[HopTranscript]:
        """The hop-sessions of ``routes`` to audit, each with its peer's probability; none of the
        peers in ``skip`` (their session was checked already)."""
        leave = {*self.records.caught(), *skip}
        return [t for r in routes for t in transcripts(r, n_layer)
                if t.peer_id not in leave and random.random() < self.records.audit_probability(t.peer_id, self.rate)]

    def due(self, peers: Iterable[str], limit: int = MAX_LOOKED_UP) -> list[str]:
        """Those of ``peers`` whose reports are due to be looked up (at most ``limit``, the
        longest unlooked first), marked as looked up now."""
        now = time.monotonic()
        with self._lock:
            due = sorted((p for p in set(peers) if now - self._looked_up.get(p, -REPORT_LOOKUP_INTERVAL_S)
                          >= REPORT_LOOKUP_INTERVAL_S), key=lambda p: (self._looked_up.get(p, -1.0), p))[:limit]
            for p in due:
                self._looked_up[p] = now
        return due

    def forget(self, peers: Iterable[str]) -> None:
        """``peers``' reports were not looked up after all (the look-up failed): due again."""
        with self._lock:
            for p in peers:
                self._looked_up.pop(p, None)

    def heard(self, found: dict[str, list[Record]]) -> int:
        """Reports fetched against peers (earliest first): each new one makes its peer
        reported and is queued for a re-check. Returns how many were queued."""
        caught, queued = self.records.caught(), []
        for peer, reports in found.items():
            for record in reports:
                if peer in caught or str(record.signer) in self._liars or str(record.signer) == peer:
                    continue
                pid = proof_id(record)
                with self._lock:
                    if pid in self._seen or self._per_peer.get(peer, 0) >= MAX_RECHECKS_PER_PEER \
                            or len(self._seen) >= MAX_SEEN_REPORTS:
                        if pid not in self._seen:  # past the bound: it keeps the peer reported, unchecked
                            self.records.report(peer, pid)
                        continue
                    self._seen.add(pid)
                    self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
                self.records.report(peer, pid)
                queued.append(record)
        if queued and not self._closed:
            self._rechecks.put(queued)
        return len(queued)

    def submit(self, items: list[HopTranscript], peers: Iterable[str] = ()) -> None:
        """Audit ``items`` in the background, one at a time; then publish the reports those
        audits made and fetch reports against ``peers`` (those a generation used) to re-check."""
        if self.exchange is not None:
            due = self.due(peers)
            if due or items or self._outbox:
                items = [*items, ("reports", tuple(due))]
        if items:
            self._audits.put(items)

    def _work(self, t) -> None:
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

    def _recheck_work(self, record) -> None:
        try:
            if not self._closed:
                self.recheck(record)
        except ClientClosed:
            pass
        except Exception as e:  # a report that cannot be re-checked now stays unsettled
            self.on_event(f"could not re-check a fraud report from {record.signer}: {sanitize(e)}")

    def _exchange(self, peers: list[str]) -> None:
        """Publish the reports made here; fetch those against ``peers`` to re-check."""
        with self._lock:
            outbox, self._outbox = self._outbox, []
        if not outbox and not peers:
            return
        if self._closed:
            raise ClientClosed("the client was closed")
        self.heard(self.exchange(outbox, peers))

    def recheck(self, record: Record) -> RecheckResult | None:
        """Re-check one verified report record by this client's own replays; catch its peer if confirmed."""
        try:
            proof = proof_of(record)
        except FraudProofError as e:
            self.on_event(f"a fraud report from {record.signer} does not parse: {e}")
            return None
        opts = dataclasses.replace(self.opts(), on_event=lambda m: None)
        result = recheck_proof(proof, self.spans_provider, opts, measures=self.measures, verified=self.records.verified)
        with self._lock:
            self.rechecks.append(result)
        pid = proof_id(record)
        if result.outcome is Recheck.CONFIRMED:
            self.records.catch(proof.peer_id, f"a fraud report from {record.signer}, re-checked here: {result.detail}")
            self.on_event(f"peer {proof.peer_id} caught on a fraud report from {record.signer} that this client's "
                          "own replays confirm; it is left out from now on")
        elif result.outcome in (Recheck.REFUTED, Recheck.INPUTS_DIFFER, Recheck.NOT_TRANSFERABLE):
            # the proof does not stand against the peer: settled. A refuted one's reporter lied
            self.records.settle(proof.peer_id, pid)
            if result.outcome is Recheck.REFUTED:
                self._liars.add(str(record.signer))
                self.on_event(f"a fraud report from {record.signer} against {proof.peer_id} is false: "
                              f"{result.detail}")
        # undecided, no replayer: the report stands unsettled, and the peer stays reported here
        return result

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted audit ran, and the reports they made were published;
        False if ``timeout`` passed first. Re-checks of others' reports are not waited for."""
        return self._audits.wait(timeout)

    def wait_rechecks(self, timeout: float | None = None) -> bool:
        """Wait until every report heard so far was re-checked (False if ``timeout`` passed first)."""
        return self._rechecks.wait(timeout)

    def close(self) -> None:
        self._closed = True
        self._audits.close()
        self._rechecks.close()
