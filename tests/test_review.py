"""`meshnet-peer review`: a certifier audits the peers of the certified recipe
and signs its verdicts; clients that trust it take them, others do not.

The live tests run a certified swarm of processes whose middle span has three
honest peers, two sub-span peers and one that flips one bit of its decode hidden
states (tests/test_audit_live.py's PERTURBING_JOIN: its route's tokens do not
change). The round's logic is tested first with doubles for the network."""

import json
import os
import sys
from types import SimpleNamespace

import pytest
import trio

from meshnet_p2p.client import Client
from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import RecordVerifier, wall_ms
from meshnet_p2p.dht.node import Stored
from meshnet_p2p.swarm.placement import Span
from meshnet_p2p.swarm.view import survey
from meshnet_p2p.trust.policy import TrustPolicy
from meshnet_p2p.trust.verdicts import TYPES, proof_of, verdicts_of
from meshnet_p2p.verify.peer_records import PeerRecords
from meshnet_p2p.verify.recheck import Recheck, RecheckResult
from meshnet_p2p.verify.replay import AuditResult, Verdict
from meshnet_p2p.verify.reports import exchange_reports
from meshnet_p2p.verify.review import Heard, ReviewNet, review_round, to_review

MODEL = "ab" * 32
ME = Identity.generate()
PEERS = {name: str(Identity.generate().peer_id) for name in ("head", "a", "b", "c", "tail")}


# --- a round, with doubles for the network -------------------------------------------------------


def spans():
    p = PEERS
    return [Span(p["head"], 0, 10), Span(p["a"], 10, 20), Span(p["b"], 10, 20), Span(p["c"], 10, 20),
            Span(p["tail"], 20, 30)]


def result(peer, verdict, replayers=(), step=None):
    s = next(s for s in spans() if s.peer_id == peer)
    return AuditResult(verdict, peer, s.start, s.end, 4, tuple(replayers), step=step, position=step,
                       detail=f"{verdict.value} detail")


class Net:
    """A swarm as a round sees it: scripted audit verdicts (a list per peer, one per audit),
    reports and re-checks; what it published is kept."""

    def __init__(self, verdicts, reports=None, rechecks=None):
        self.verdicts = {p: list(v) for p, v in verdicts.items()}
        self.reports = reports or {}
        self.rechecks = rechecks or {}
        self.audited, self.excluded, self.rechecked, self.published = [], [], [], []

    def as_net(self) -> ReviewNet:
        return ReviewNet(spans, self.audit, self.fetch, self.recheck, self.publish)

    def audit(self, peer, exclude):
        self.audited.append(peer)
        self.excluded.append(set(exclude))
        r = self.verdicts[peer].pop(0)
        if isinstance(r, Exception):
            raise r
        return r

    def fetch(self, peers):
        return {p: r for p, r in self.reports.items() if p in peers}

    def recheck(self, record, exclude):
        self.rechecked.append(record.signer)
        return self.rechecks[record.signature]

    def publish(self, items):
        self.published = items
        return [Stored(2, 1)] * len(items), 1


def verdicts_published(net):
    key, wire = net.published[-1]
    [v] = verdicts_of([RecordVerifier(TYPES).verify(wire, wall_ms())], [str(ME.peer_id)], MODEL)
    assert key == f"verdicts/{MODEL}/{ME.peer_id}"
    return v


def honest(**over):
    p = PEERS
    base = {p["head"]: [result(p["head"], Verdict.NO_REPLAYER)], p["tail"]: [result(p["tail"], Verdict.MATCH, [[p["head"]]])]}
    for name in "abc":
        base[p[name]] = [result(p[name], Verdict.MATCH, [[p["b" if name != "b" else "a"]]])]
    return {**base, **over}


def test_a_round_signs_verified_peers_with_their_sessions_and_no_verdict_without_a_replayer(tmp_path):
    tally = PeerRecords(str(tmp_path / "tally"))
    net = Net(honest())
    r = review_round(net.as_net(), tally, ME, MODEL, now_ms=wall_ms)
    p = PEERS
    assert r.verified == {p[n]: 1 for n in ("a", "b", "c", "tail")} and r.convicted == {}
    assert r.peers[p["head"]].how == "no-replayer" and p["head"] not in r.verified  # no verdict
    v = verdicts_published(net)
    assert v.verified == r.verified and v.convicted == {}
    assert (r.stored, r.networks, r.reports, r.warning) == (2, 1, 0, "")
    # the tally accumulates, run after run (a file of its own)
    again = review_round(Net(honest()).as_net(), PeerRecords(str(tmp_path / "tally")), ME, MODEL, now_ms=wall_ms)
    assert again.verified == {p[n]: 2 for n in ("a", "b", "c", "tail")}


def test_a_proven_mismatch_convicts_and_an_undecided_audit_it_spoiled_is_run_again_without_it(tmp_path):
    p = PEERS
    # a's audit replays on b (the cheater), which the second replay outvotes: undecided, b the suspect;
    # then b's own audit proves it wrong; a is audited again, b left out of the replays
    net = Net(honest(**{p["a"]: [result(p["a"], Verdict.UNDECIDED, [[p["b"]], [p["c"]]], 1),
                                 result(p["a"], Verdict.MATCH, [[p["c"]]])],
                        p["b"]: [result(p["b"], Verdict.MISMATCH, [[p["a"]], [p["c"]]], 1)],
                        p["c"]: [result(p["c"], Verdict.UNCONFIRMED, [[p["a"]]], 2)]}))
    tally = PeerRecords()
    r = review_round(net.as_net(), tally, ME, MODEL, now_ms=wall_ms)
    assert net.audited.count(p["a"]) == 2 and p["b"] in net.excluded[-1]
    assert p["b"] in r.convicted and "step 1" in r.convicted[p["b"]]
    assert r.verified == {p["a"]: 1, p["tail"]: 1}  # c: unconfirmed, no verdict
    assert verdicts_published(net).convicted == {p["b"]: r.convicted[p["b"]][:200]}
    assert len(net.published) == 1  # the proof was not transferable (none): no report
    # next round: b is not audited again, and stays convicted
    net2 = Net(honest())
    r2 = review_round(net2.as_net(), tally, ME, MODEL, now_ms=wall_ms)
    assert p["b"] not in net2.audited and p["b"] in r2.convicted and r2.peers[p["b"]].how == "convicted"


def test_reports_count_only_when_replays_here_confirm_them(tmp_path):
    p = PEERS
    stranger, liar = Identity.generate().peer_id, Identity.generate().peer_id
    reports = {p["b"]: [SimpleNamespace(signer=stranger, signature=b"s1")],
               p["c"]: [SimpleNamespace(signer=liar, signature=b"s2")],
               p["a"]: [SimpleNamespace(signer=ME.peer_id, signature=b"s3")]}  # its own: already counted
    rechecks = {b"s1": RecheckResult(Recheck.CONFIRMED, p["b"], "replayed here: the proof stands"),
                b"s2": RecheckResult(Recheck.REFUTED, p["c"], "the proof is false")}
    net = Net(honest(), reports, rechecks)
    heard = Heard()
    r = review_round(net.as_net(), PeerRecords(), ME, MODEL, now_ms=wall_ms, heard=heard)
    assert sorted(map(str, net.rechecked)) == sorted(map(str, [stranger, liar]))
    assert r.convicted == {p["b"]: f"a fraud report from {stranger}, re-checked by replay"}
    assert p["b"] not in net.audited and r.peers[p["b"]].how == "report"  # convicted: not audited
    assert p["c"] in r.verified  # a refuted report convicts nobody
    # a report already re-checked this run is not re-checked again; a reporter caught in a lie is not heard again
    more = {**reports, p["tail"]: [SimpleNamespace(signer=liar, signature=b"s4")]}
    net2 = Net(honest(), more, {**rechecks, b"s4": RecheckResult(Recheck.CONFIRMED, p["tail"], "")})
    r2 = review_round(net2.as_net(), PeerRecords(), ME, MODEL, now_ms=wall_ms, heard=heard)
    assert net2.rechecked == [] and p["tail"] in r2.verified


def test_a_shield_of_newer_reports_hides_nothing_and_an_unsettled_report_withholds_the_vouch():
    """Issue 59, the shield: a cheater buried the one true report against it under newer junk
    ones (fetches took the 4 newest), and the next review vouched it again. Reports come
    earliest first and are re-checked one peer's after another's: the true one is found;
    a peer whose reports the round could not all settle is not vouched for."""
    from meshnet_p2p.verify import review

    p = PEERS
    true = SimpleNamespace(signer=Identity.generate().peer_id, signature=b"true")
    junk = {who: [SimpleNamespace(signer=Identity.generate().peer_id, signature=f"{who}{i}".encode())
                  for i in range(40)] for who in ("b", "c")}
    reports = {p["b"]: [true, *junk["b"]], p["c"]: junk["c"],
               p["a"]: [SimpleNamespace(signer=Identity.generate().peer_id, signature=b"maybe")],
               p["tail"]: [SimpleNamespace(signer=p["tail"], signature=b"self")]}  # the accused's own: nothing
    rechecks = {b"true": RecheckResult(Recheck.CONFIRMED, p["b"], "the proof stands"),
                b"maybe": RecheckResult(Recheck.UNDECIDED, p["a"], "the replays disagree")}
    for who in ("b", "c"):
        rechecks.update({r.signature: RecheckResult(Recheck.REFUTED, p[who], "false") for r in junk[who]})
    net = Net(honest(), reports, rechecks)
    r = review_round(net.as_net(), PeerRecords(), ME, MODEL, now_ms=wall_ms)
    assert len(net.rechecked) == review.MAX_RECHECKS and str(true.signer) in map(str, net.rechecked[:3])
    assert p["b"] in r.convicted  # the true report, though 40 newer ones came after it
    assert p["c"] not in r.verified and "not settled" in r.peers[p["c"]].detail  # 40 reports, 16 re-checks a round
    assert p["a"] not in r.verified  # its report undecided
    assert p["tail"] in r.verified  # a peer's report of itself is no report


def test_an_audit_is_given_prompts_and_lengths_drawn_afresh_not_one_fixed_prompt():
    """Issue 59, the trigger: the review audited "The capital of France is" for 4 tokens, every time."""
    import random

    from meshnet_p2p.verify.review import AUDIT_TOKENS, audit_request

    rng = random.Random(0)
    drawn = [audit_request(rng) for _ in range(200)]
    assert len({prompt for prompt, _ in drawn}) > 100
    assert {n for _, n in drawn} == set(range(AUDIT_TOKENS[0], AUDIT_TOKENS[1] + 1))
    assert {audit_request(rng, ["only this"])[0] for _ in range(5)} == {"only this"}


def test_an_audit_that_cannot_run_gives_no_verdict_and_an_unstored_record_is_an_error():
    p = PEERS
    net = Net(honest(**{p["a"]: [MeshnetError("no route through it")]}))
    r = review_round(net.as_net(), PeerRecords(), ME, MODEL, now_ms=wall_ms)
    assert r.peers[p["a"]].how == "error" and p["a"] not in r.verified
    bad = Net(honest())
    bad.publish = lambda items: ([Stored(0, 0)] * len(items), 1)
    with pytest.raises(MeshnetError, match="no node took the verdicts"):
        review_round(bad.as_net(), PeerRecords(), ME, MODEL, now_ms=wall_ms)


def test_the_least_verified_peers_are_reviewed_first_and_the_convicted_not_at_all():
    p = PEERS
    tally = PeerRecords()
    for _ in range(3):
        tally.matched(p["a"])
    tally.matched(p["tail"])
    tally.catch(p["b"], "proven")
    order = [s.peer_id for s in to_review(spans(), tally)]
    assert order == [p["head"], p["c"], p["tail"], p["a"]]
    assert [s.peer_id for s in to_review(spans(), tally, limit=2)] == [p["head"], p["c"]]


# --- live: real processes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reviewed(tmp_path_factory):
    """A certified swarm, a second certificate from another key (C), a perturbing middle
    peer joined after both, and one review by the bootstrap's key."""
    from tests.swarm import Proc, certify_swarm, meshnet_peer, own_address, start_swarm
    from tests.test_audit_live import PERTURBING_JOIN

    tmp = tmp_path_factory.mktemp("review")
    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp)}
    boot, addr, joins = start_swarm(tmp, ["0:10", "10:20", "20:30", "10:20", "10:20", "10:15", "15:20", "20:30"],
                                    spread=True)
    procs = [*joins, boot]
    try:
        other = certify_swarm(addr, str(tmp / "other.key"), "--max-tokens", "2")
        cheater = Proc("join", "--layers", "10:20", "--bootstrap", addr, "--threads", "1", "--listen",
                       f"{own_address()}:0", env=env,
                       prefix=(sys.executable, "-c", PERTURBING_JOIN))
        procs.insert(0, cheater)
        cheater.address()  # announced; a survey on a loaded host may still miss it: looked for, bounded
        seen = Client([addr], ring=False)
        assert any(cheater.peer_id in {s.peer_id for s in trio.run(seen.spans)} for _ in range(5))
        seen.close()
        # replays on other peers only, as a certifier without the whole model's file reviews
        r = meshnet_peer("review", "--bootstrap", addr, "--identity", boot.identity_path, "--json",
                         "--no-own-replay", env=env, timeout=300)
        yield SimpleNamespace(addr=addr, boot=boot, joins=joins, cheater=cheater, other=other, run=r, tmp=tmp,
                              env=env)
    finally:
        for p in procs:
            p.stop()


def test_review_verifies_the_honest_peers_and_convicts_the_perturbing_one(reviewed):
    r, joins, cheater = reviewed.run, reviewed.joins, reviewed.cheater
    assert r.returncode == 3, r.stderr  # it published, and convicted someone
    doc = json.loads(r.stdout)
    assert doc["convicted"].keys() == {cheater.peer_id}, doc
    assert "its own audit: layers 10-19" in doc["convicted"][cheater.peer_id]
    # every honest peer a replay can check is verified; nobody else serves the head's layers, nor
    # exactly 10-14 or 15-19 (a span is replayed by its own span or a chain of sub-spans): no verdict
    assert doc["verified"] == {joins[i].peer_id: 1 for i in (1, 2, 3, 4, 7)}, (r.stdout, r.stderr)
    for i in (0, 5, 6):
        assert doc["peers"][joins[i].peer_id]["audit"] == "no-replayer", (doc["peers"][joins[i].peer_id], r.stderr)
        assert doc["peers"][joins[i].peer_id]["verdict"] is None
    assert doc["peers"][cheater.peer_id] | {"detail": ""} == {"layers": [10, 20], "audit": "mismatch",
                                                             "verdict": "convicted", "detail": ""}
    assert doc["published"]["nodes"] >= 1 and doc["published"]["networks"] >= 1
    assert doc["published"]["fraud_reports"] == 1 and doc["published"]["warning"] is None
    assert doc["certifier"] == reviewed.boot.peer_id
    # the tally is the certifier's own file, apart from a client's records
    assert os.path.exists(os.path.join(reviewed.tmp, "records", f"review-{doc['model_digest']}-{doc['certifier']}.msgpack"))
    # the proof went out as a fraud report the certifier signed, which anyone can fetch and check
    found, _ = trio.run(exchange_reports, [reviewed.addr], doc["model_digest"], (), [cheater.peer_id])
    [report] = found[cheater.peer_id]
    assert str(report.signer) == reviewed.boot.peer_id and proof_of(report).peer_id == cheater.peer_id
    assert proof_of(report).transferable() is None


def test_a_certifier_holding_the_whole_model_is_a_witness_for_every_span_even_one_nobody_else_serves(reviewed):
    """Issue 59: a head nobody else serves, and sub-spans nobody else cuts, have no replayer
    among the peers; a certifier with the whole model's file replays every audited hop on its
    own weights (verify/oracle.py), so it verifies them and convicts the perturber alone."""
    from tests.swarm import meshnet_peer

    r = meshnet_peer("review", "--bootstrap", reviewed.addr, "--identity", str(reviewed.tmp / "oracle.key"),
                     "--json", env=reviewed.env, timeout=300)
    assert r.returncode == 3, r.stderr
    doc = json.loads(r.stdout)
    me = doc["certifier"]
    assert doc["convicted"].keys() == {reviewed.cheater.peer_id}, doc
    # the first review's report against it, re-checked here on these weights (or its own audit)
    assert doc["peers"][reviewed.cheater.peer_id]["audit"] in ("report", "mismatch"), doc["peers"]
    assert f"own replay ({me}" in doc["peers"][reviewed.cheater.peer_id]["detail"], doc["peers"]
    assert doc["verified"] == {p.peer_id: 1 for p in reviewed.joins}, (r.stdout, r.stderr[-3000:])
    for p in reviewed.joins:
        assert doc["peers"][p.peer_id]["audit"] == "match" and doc["peers"][p.peer_id]["verdict"] == "verified"



def test_a_client_that_trusts_the_reviewer_holds_its_verified_peers_vouched_and_never_plans_the_convicted(
        reviewed, model_path):
    cheater = reviewed.cheater
    client = Client([reviewed.addr], model_path=model_path, ring=False)  # trusts the bootstrap's key
    try:
        surveyed = {s.peer_id for s in trio.run(client.spans)}
        planned = {s.peer_id for s in client._provider(trio.run)()}
    finally:
        client.close()
    assert cheater.peer_id in surveyed and cheater.peer_id not in planned  # it still announces; never planned
    why = client.records.caught()[cheater.peer_id]
    assert why.startswith(f"convicted by certifier {reviewed.boot.peer_id}: its own audit")
    snap = client.records.snapshot()
    # the certificate's route and the review's verified peers: a verified record, fewer audits
    reviewed_ok = set(json.loads(reviewed.run.stdout)["verified"])
    [certified] = trio.run(survey, [reviewed.addr], client.model_digest, client.n_layer,
                           TrustPolicy.default([reviewed.addr])).certified()
    vouched = reviewed_ok | {p for p, _, _ in certified.certificate.route}
    assert {p for p, r in snap.items() if r["vouched"]} == vouched
    assert reviewed_ok - {p for p, _, _ in certified.certificate.route}  # some vouched by the review only
    for p in vouched:
        # planned without a second route; still audited every session until this client verified it
        assert client.records.verified(p) and client.records.audit_probability(p) == 1.0, p
    assert not client.records.verified(cheater.peer_id) and client.records.audit_probability(cheater.peer_id) == 1.0


def test_a_client_that_does_not_trust_the_reviewer_ignores_its_verdicts(reviewed, model_path):
    cheater, other = reviewed.cheater, reviewed.other
    # it trusts the second certifier only: the recipe is certified for it, the review is a stranger's
    client = Client([reviewed.addr], model_path=model_path, ring=False,
                    trust=TrustPolicy(frozenset({other["certifier"]})))
    try:
        planned = {s.peer_id for s in client._provider(trio.run)()}
    finally:
        client.close()
    assert cheater.peer_id in planned and client.records.caught() == {}
    route = {h["peer_id"] for h in other["routes"][0]}
    vouched = {p for p, r in client.records.snapshot().items() if r["vouched"]}
    assert vouched == route  # its certificate's only, not the review's
    assert set(json.loads(reviewed.run.stdout)["verified"]) - route


def test_a_prompts_file_is_read_bounded_and_a_bad_one_is_a_typed_error(tmp_path):
    """review --prompts-file: its lines (escaped newlines kept as \\n), and a clear error for a
    file that is missing, not UTF-8, or holds no prompt."""
    from meshnet_p2p.roles.review import MAX_PROMPT_CHARS, read_prompts

    good = tmp_path / "prompts"
    good.write_text("What is a bank?\n\n  \nQ: one\\nA:\n" + "x" * (MAX_PROMPT_CHARS + 10) + "\n")
    assert read_prompts(str(good)) == ["What is a bank?", "Q: one\nA:", "x" * MAX_PROMPT_CHARS]
    assert read_prompts(None) == []
    (tmp_path / "empty").write_text("\n \n")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00bad")
    for name, why in (("missing", "cannot read"), ("empty", "has no prompt"), ("binary", "cannot read")):
        with pytest.raises(MeshnetError, match=why):
            read_prompts(str(tmp_path / name))
