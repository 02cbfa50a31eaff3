"""The auditor's part in fraud reports (verify/auditor.py), with the network calls
passed in as doubles: what it publishes, whom it looks up and how often, which
reports it re-checks, and what a re-check's outcome does to its records. The
replays themselves are tests/test_audit_live.py's (real processes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from meshnet_p2p.verify import auditor
from meshnet_p2p.verify.auditor import Auditor
from meshnet_p2p.route.options import PeerMeasures, RouteOptions
from meshnet_p2p.verify.recheck import Recheck, RecheckResult
from meshnet_p2p.verify.peer_records import PeerRecords


def report(reporter: str, accused: str, n: int, proof: str | None = None) -> SimpleNamespace:
    """A report record's double: ``proof`` names the proof it carries (by default its own)."""
    return SimpleNamespace(signer=reporter, signature=f"{reporter}-{accused}-{n}".encode(), accused=accused,
                           content={"proof": proof or f"{reporter}-{accused}-{n}"})


@pytest.fixture
def rig(monkeypatch):
    """An auditor whose re-checks answer from ``outcomes`` (accused -> outcome), and whose
    exchange records each call and answers from ``published`` (accused -> reports)."""
    calls, published, outcomes, rechecked = [], {}, {}, []
    monkeypatch.setattr(auditor, "proof_of", lambda r: SimpleNamespace(peer_id=r.accused))

    def fake_recheck(proof, provider, opts, measures=None, verified=None):
        rechecked.append(proof.peer_id)
        return RecheckResult(outcomes.get(proof.peer_id, Recheck.UNDECIDED), proof.peer_id, "replayed")

    monkeypatch.setattr(auditor, "recheck_proof", fake_recheck)

    def exchange(publish, lookup):
        calls.append((list(publish), list(lookup)))
        return {p: published[p] for p in lookup if p in published}

    records = PeerRecords()
    events: list[str] = []
    a = Auditor(records, lambda: [], lambda: RouteOptions(max_tokens=1), PeerMeasures(), 0.05, on_event=events.append,
                sign_report=lambda proof: ("fraud/key", b"wire"), exchange=exchange)
    yield SimpleNamespace(auditor=a, records=records, calls=calls, published=published, outcomes=outcomes,
                          rechecked=rechecked, events=events)
    a.close()
    assert not [e for e in events if e.startswith("could not")], events  # nothing failed inside the auditor


def run(rig, peers) -> None:
    rig.auditor.submit([], peers=peers)
    assert rig.auditor.wait(30) and rig.auditor.wait_rechecks(30)


def test_a_report_confirmed_by_this_clients_replays_catches_the_peer_and_hearsay_alone_does_not(rig):
    rig.published.update(cheat=[report("r1", "cheat", 0)], honest=[report("r2", "honest", 0)])
    rig.outcomes.update(cheat=Recheck.CONFIRMED, honest=Recheck.UNDECIDED)
    run(rig, ["cheat", "honest"])
    assert set(rig.records.caught()) == {"cheat"}
    assert "re-checked here" in rig.records.caught()["cheat"]
    assert sorted(rig.rechecked) == ["cheat", "honest"]


def test_each_peer_is_looked_up_once_per_interval_and_each_report_rechecked_once(rig, monkeypatch):
    rig.published.update(p=[report("r1", "p", 0)])
    run(rig, ["p"])
    run(rig, ["p"])  # within the interval: not looked up again
    assert [look for _, look in rig.calls] == [["p"]]
    assert rig.rechecked == ["p"]
    monkeypatch.setattr(auditor, "REPORT_LOOKUP_INTERVAL_S", 0.0)
    run(rig, ["p"])  # looked up again: the same report is not re-checked again
    assert [look for _, look in rig.calls] == [["p"], ["p"]] and rig.rechecked == ["p"]


def test_a_reporter_whose_report_is_refuted_is_not_heard_again(rig, monkeypatch):
    monkeypatch.setattr(auditor, "REPORT_LOOKUP_INTERVAL_S", 0.0)
    rig.published.update(a=[report("liar", "a", 0)])
    rig.outcomes.update(a=Recheck.REFUTED, b=Recheck.CONFIRMED)
    run(rig, ["a"])
    rig.published.update(b=[report("liar", "b", 1)])
    run(rig, ["b"])
    assert rig.rechecked == ["a"] and rig.records.caught() == {}


def test_a_reported_peer_has_no_verified_record_until_its_reports_are_settled_here(rig):
    """Issue 59, the sleeper: a vouched peer someone reported is never the one route an answer
    depends on until this client's replays settle the report (refuted: verified again;
    undecided: still reported; confirmed: caught)."""
    rig.records.vouch({"a", "b", "c"})
    rig.outcomes.update(a=Recheck.REFUTED, b=Recheck.UNDECIDED, c=Recheck.CONFIRMED)
    gate = __import__("threading").Event()
    real = auditor.recheck_proof
    auditor.recheck_proof = lambda *a, **k: gate.wait(30) and real(*a, **k)
    try:
        queued = rig.auditor.heard({p: [report("r", p, 0)] for p in "abc"})
        assert queued == 3
        assert not any(rig.records.verified(p) for p in "abc")  # before any re-check: reported
        assert all(rig.records.audit_probability(p) == 1.0 for p in "abc")
    finally:
        gate.set()
    assert rig.auditor.wait_rechecks(30)
    auditor.recheck_proof = real
    assert rig.records.verified("a") and not rig.records.verified("b") and not rig.records.verified("c")
    assert set(rig.records.caught()) == {"c"}
    assert rig.records.snapshot()["b"]["reported"] == 1


def test_a_flood_of_reports_costs_a_bounded_number_of_rechecks_and_one_proof_is_rechecked_once(rig):
    """Issue 59, framing: forty reports of one proof are one re-check; forty distinct proofs
    against one peer are at most MAX_RECHECKS_PER_PEER; a peer's reports of itself carry nothing."""
    rig.outcomes.update(x=Recheck.REFUTED, y=Recheck.REFUTED)
    rig.auditor.heard({"x": [report(f"fresh{i}", "x", i, proof="one") for i in range(40)]})
    rig.auditor.heard({"y": [report(f"fresh{i}", "y", i) for i in range(40)]})
    rig.auditor.heard({"z": [report("z", "z", 0)]})  # signed by the accused itself
    assert rig.auditor.wait_rechecks(30)
    assert rig.rechecked.count("x") == 1
    assert rig.rechecked.count("y") == auditor.MAX_RECHECKS_PER_PEER
    assert "z" not in rig.rechecked and not rig.records.reported("z")
    assert not rig.records.reported("x")  # its one proof refuted: settled
    assert rig.records.reported("y")  # the proofs past the bound were never checked: it stays reported


def test_a_vouch_lets_a_peer_be_planned_but_its_sessions_are_audited_until_this_client_verified_one():
    """Issue 59, the sleeper: one certifier verdict counted as four verified sessions, so a fresh
    client audited a vouched peer one time in five. Now only this client's own matches lower it."""
    records = PeerRecords()
    records.vouch({"v"})
    assert records.verified("v") and records.audit_probability("v") == 1.0
    records.matched("v")
    assert records.audit_probability("v") == 0.5
    for _ in range(100):
        records.matched("v")
    assert records.audit_probability("v", 0.05) == 0.05  # the floor


def test_a_proof_found_here_is_published_with_the_next_exchange(rig):
    from meshnet_p2p.verify.replay import AuditResult, Verdict

    proof = SimpleNamespace(transferable=lambda: None)
    rig.auditor._apply(AuditResult(Verdict.MISMATCH, "cheat", 10, 20, 3, (("r",), ("s",)), 1, 5, detail="x",
                                   proof=proof))
    untransferable = SimpleNamespace(transferable=lambda: "the peer signed nothing")
    rig.auditor._apply(AuditResult(Verdict.MISMATCH, "mute", 10, 20, 3, (("r",), ("s",)), 1, 5, detail="x",
                                   proof=untransferable))
    run(rig, [])
    assert rig.calls == [([("fraud/key", b"wire")], [])]  # the transferable one only
    assert set(rig.records.caught()) == {"cheat", "mute"}  # both caught here, whatever others can check


def test_an_audit_under_way_when_its_client_closes_surveys_the_swarm_no_more(monkeypatch):
    """A closed client's audit thread went on: its next survey ran after the client was
    closed (CI: test_load's survey double, patched in for the next test, was consumed by
    a previous test's client still auditing). After close, nothing of it looks at the swarm."""
    import threading

    surveys: list[int] = []
    looked, closed, done = threading.Event(), threading.Event(), threading.Event()
    outcome: list[BaseException] = []

    def fake_audit_hop(t, provider, opts, exclude=(), measures=None, verified=None):
        try:
            provider()  # a route's first look
            looked.set()
            assert closed.wait(30)
            provider()  # looking again (a failover), after close
        except BaseException as e:
            outcome.append(e)
            raise
        finally:
            done.set()

    monkeypatch.setattr(auditor, "audit_hop", fake_audit_hop)
    events: list[str] = []
    a = Auditor(PeerRecords(), lambda: surveys.append(1) or [], lambda: RouteOptions(max_tokens=1), PeerMeasures(),
                0.05, on_event=events.append)
    a.submit([SimpleNamespace(peer_id="p")])
    assert looked.wait(30)
    a.close()
    closed.set()
    assert done.wait(30) and a.wait(30)
    assert surveys == [1], surveys
    assert outcome and "closed" in str(outcome[0]), outcome
    assert not [e for e in events if "could not audit" in e], events  # a closed client's audit blames nobody


def test_a_verified_record_decays_and_a_records_file_keeps_when_it_was_earned(tmp_path):
    """Issue 59: trust is kept only while checks go on. Sessions halve every HALF_LIFE_S since
    the last match; a peer nobody checked for weeks is audited as a newcomer is; the file keeps
    the time (and a file of the format before it still loads, undecayed)."""
    import msgpack

    from meshnet_p2p.verify.peer_records import HALF_LIFE_S, load_records

    now = [1_000_000.0]
    path = str(tmp_path / "records")
    records = PeerRecords(path, clock=lambda: now[0])
    for _ in range(8):
        records.matched("p")
    assert records.snapshot()["p"]["verified_sessions"] == 8 and records.audit_probability("p", 0.01) == 1 / 9
    now[0] += HALF_LIFE_S
    assert records.snapshot()["p"]["verified_sessions"] == 4 and records.verified("p")
    records.matched("p")  # a match adds to what is left, and restarts the clock
    assert records.snapshot()["p"]["verified_sessions"] == 5
    now[0] += 4 * HALF_LIFE_S  # 5/16: none left
    assert records.snapshot()["p"]["verified_sessions"] == 0
    assert not records.verified("p") and records.audit_probability("p") == 1.0
    assert PeerRecords(path, clock=lambda: now[0]).snapshot()["p"]["verified_sessions"] == 0  # kept in the file
    old = tmp_path / "old"
    old.write_bytes(msgpack.packb({"q": [3, 0, ""]}))
    assert load_records(str(old))["q"].verified == 3 and PeerRecords(str(old)).verified("q")
