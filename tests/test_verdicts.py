"""Fraud reports and certifiers' peer verdicts as DHT records (trust/verdicts.py):
what a node stores and what it refuses, with which reason; what a survey's view
and a client's peer records make of a trusted certifier's verdicts; how long a
node keeps either for a model nobody announces. Pure: no network, no model."""

import hashlib

import msgpack
import pytest

from meshnet_p2p.verify.peer_records import PeerRecords, load_records
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import (MAX_RECORD_BYTES, Record, RecordRejected, RecordVerifier, Reject, sign_record,
                                      wall_ms)
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.swarm.capability import model_key
from meshnet_p2p.swarm.node import TYPES, UNANNOUNCED_LIFETIME_MS, lifetime_cap
from meshnet_p2p.swarm.view import build_view
from meshnet_p2p.trust.commitment import GENESIS, Commitment
from meshnet_p2p.trust.evidence import Refusal
from meshnet_p2p.trust.fraud_proof import (MAX_CUTS, MAX_LAYERS, MAX_POSITION, MAX_PROOF_STEPS, MAX_PROOF_TOKENS,
                                           MAX_REPLAYERS, ChainLink, FraudProof, FraudProofError)
from meshnet_p2p.trust.policy import TrustPolicy
from meshnet_p2p.trust.verdicts import (FRAUD_REPORT, MAX_CONTENT_BYTES, MAX_CONVICTED, MAX_VERIFIED, MAX_WHY_CHARS,
                                        PEER_VERDICTS, model_of_key, proof_of, report_key, sign_report, sign_verdicts,
                                        verdicts_key, verdicts_of)

from tests.test_audit import CHEAT, MODEL, OTHER, forged, proof
from tests.test_certification import CERTIFIER, MODEL as SERVED, evidence, signed
from tests.test_swarm_view import record as capability

NOW = 1_800_000_000_000
REPORTER = Identity.from_seed(b"\x43" * 32)
PEERS = [str(Identity.from_seed(bytes([i]) * 32).peer_id) for i in range(1, 64)]  # 52-character peer IDs


def verify(wire: bytes, verifier: RecordVerifier | None = None) -> Record:
    return (verifier or RecordVerifier(TYPES)).verify(wire, NOW)


def certificate() -> Record:
    """A trusted certifier's certificate of the recipe test_swarm_view's reports serve (signed now)."""
    return RecordVerifier(TYPES).verify(signed(evidence()), wall_ms())


def refusal(wire: bytes) -> RecordRejected:
    with pytest.raises(RecordRejected) as e:
        verify(wire)
    return e.value


# --- fraud reports -------------------------------------------------------------------------------


def report(p: FraudProof | None = None, signer: Identity = REPORTER, seq: int = NOW, **change) -> bytes:
    """A report record of ``p`` as anyone could sign it, with any field replaced (None: dropped)."""
    p = proof() if p is None else p
    content = {"key": report_key(p.model_digest, p.peer_id), "reporter": str(signer.peer_id), "proof": p.to_content()}
    content = {k: v for k, v in {**content, **change}.items() if v is not None}
    return sign_record(signer, FRAUD_REPORT, content, seq=seq, now_ms=NOW, ttl_ms=3_600_000)


def test_a_signed_report_verifies_and_carries_its_proof():
    for p in (proof(), proof(start=10, end=20)):
        rec = verify(sign_report(REPORTER, p, now_ms=NOW))
        assert (rec.payload_type, rec.signer, rec.content["reporter"]) == (FRAUD_REPORT, REPORTER.peer_id,
                                                                           str(REPORTER.peer_id))
        assert rec.content["key"] == report_key(MODEL, str(CHEAT.peer_id)) and model_of_key(rec.content["key"]) == MODEL
        assert proof_of(rec) == p and proof_of(rec).transferable() is None


@pytest.mark.parametrize("p", [proof(commitment=None), proof(chain=()), forged(proof(), bytes(64)),
                               proof(peer_output="c" * 64)])
def test_sign_report_refuses_a_proof_others_cannot_check(p):
    with pytest.raises(FraudProofError, match="cannot check"):
        sign_report(REPORTER, p, now_ms=NOW)


REFUSED_REPORTS = {
    "a proof others cannot check": (lambda: report(forged(proof(), bytes(64))), Reject.MALFORMED, "signature"),
    "a proof that is malformed": (lambda: report(proof=[1]), Reject.MALFORMED, "not a meshnet/fraud-proof/v2"),
    "no proof": (lambda: report(proof=None), Reject.MALFORMED, "not a meshnet/fraud-proof/v2"),
    "a key naming another peer": (lambda: report(key=report_key(MODEL, str(OTHER.peer_id))), Reject.MALFORMED, "key"),
    "a key naming another model": (lambda: report(key=report_key("3" * 64, str(CHEAT.peer_id))), Reject.MALFORMED,
                                   "key"),
    "a key that is no report's": (lambda: report(key="verdicts/" + MODEL + "/" + str(CHEAT.peer_id)),
                                  Reject.MALFORMED, "key"),
    "a reporter that is not the signer": (lambda: report(reporter=str(OTHER.peer_id)), Reject.SIGNER_MISMATCH,
                                          "signed by"),
    "no reporter": (lambda: report(reporter=None), Reject.MALFORMED, "key, reporter and proof only"),
    "a reporter that is not a string": (lambda: report(reporter=7), Reject.MALFORMED, "key, reporter and proof only"),
    "an extra field": (lambda: report(note="trust me"), Reject.MALFORMED, "key, reporter and proof only"),
    "a payload over the bound": (lambda: report(proof={**proof().to_content(), "pad": "x" * 14_000}),
                                 Reject.OVERSIZED, "payload"),
    "a record over the bound": (lambda: report(note="x" * MAX_RECORD_BYTES), Reject.OVERSIZED, "bytes >"),
    # issue 59, the shield: the accused reporting itself only ever buries others' reports
    "a report by the accused": (lambda: report(signer=CHEAT), Reject.MALFORMED, "does not report itself"),
}


@pytest.mark.parametrize("case", REFUSED_REPORTS)
def test_a_report_a_node_must_not_store_is_refused_with_its_reason(case):
    make, reason, why = REFUSED_REPORTS[case]
    wire = make()
    e = refusal(wire)
    assert e.reason is reason and why in e.detail, e
    if case == "a payload over the bound":  # the payload's own bound, not the envelope's
        assert len(wire) <= MAX_RECORD_BYTES


def test_a_reporter_keeps_one_report_per_accused_peer():
    verifier = RecordVerifier(TYPES)
    verify(report(seq=NOW), verifier)
    other = proof(OTHER)
    verify(report(other, seq=NOW - 1), verifier)  # another key: its own sequence
    assert refusal_by(verifier, report(seq=NOW - 1)).reason is Reject.REPLAYED


def refusal_by(verifier: RecordVerifier, wire: bytes) -> RecordRejected:
    with pytest.raises(RecordRejected) as e:
        verify(wire, verifier)
    return e.value


def largest_proof(replayer_chars: int = 52) -> FraudProof:
    """The largest transferable proof: MAX_PROOF_STEPS - 1 links and MAX_PROOF_TOKENS tokens, every
    integer, string and list at its widest, MAX_REPLAYERS replayers of ``replayer_chars``
    characters (a peer ID: 52), a middle hop's (cuts and arbitrary input digests)."""
    session, start, epoch = "S" * 128, MAX_LAYERS - 1, MAX_POSITION - 1
    ids = [(1 << 32) - 1 - i for i in range(MAX_PROOF_TOKENS)]
    prompt = MAX_PROOF_TOKENS - (MAX_PROOF_STEPS - 1)
    steps = [(0, prompt, False)] + [(prompt + i, 1, True) for i in range(MAX_PROOF_STEPS - 1)]
    out, prev = [], GENESIS
    for i, (position, _, decode) in enumerate(steps):
        c = Commitment(str(CHEAT.peer_id), session, "f" * 64, "e" * 64, start, start + 1, epoch, i, position, decode,
                       hashlib.sha256(b"in %d" % i).digest(), hashlib.sha256(b"out %d" % i).digest(), prev)
        out.append(c.signed_by(CHEAT))
        prev = out[-1].link()
    replayers = tuple(p[:replayer_chars].ljust(replayer_chars, "x") for p in PEERS[:MAX_REPLAYERS])
    return FraudProof(str(CHEAT.peer_id), "f" * 64, "e" * 64, start, start + 1, MAX_LAYERS, session, len(steps) - 1,
                      steps[-1][0], out[-1].output_digest.hex(), "b" * 64, replayers,
                      SamplingParams(1e300, (1 << 64) - 1, 0.999, (1 << 64) - 1), MAX_POSITION - 1, tuple(ids),
                      tuple(ChainLink.of(c) for c in out[:-1]), out[-1],
                      (0, *range(MAX_LAYERS - MAX_CUTS, MAX_LAYERS - 1)))


def test_the_largest_proof_of_peer_id_replayers_fits_one_record():
    p = largest_proof()
    assert p.transferable() is None and len(p.chain) == MAX_PROOF_STEPS - 1 and len(p.tokens) == MAX_PROOF_TOKENS
    wire = sign_report(REPORTER, p, now_ms=NOW)
    rec = verify(wire)
    assert len(wire) <= MAX_RECORD_BYTES and len(msgpack.unpackb(wire)[1]) <= MAX_CONTENT_BYTES
    assert proof_of(rec) == p
    # what does not fit is refused at signing, not published for every node to refuse
    with pytest.raises(FraudProofError, match="exceed"):
        sign_report(REPORTER, largest_proof(128), now_ms=NOW)


# --- a certifier's verdicts ----------------------------------------------------------------------


def verdicts(signer: Identity = CERTIFIER, **change) -> bytes:
    """A verdicts record as ``signer`` could sign it, with any field replaced (None: dropped)."""
    me = str(signer.peer_id)
    content = {"key": verdicts_key(MODEL, me), "certifier": me, "model_digest": MODEL,
               "verified": [[PEERS[0], 3], [PEERS[1], 1]], "convicted": [[PEERS[2], "a proof re-checked here"]]}
    content = {k: v for k, v in {**content, **change}.items() if v is not None}
    return sign_record(signer, PEER_VERDICTS, content, seq=NOW, now_ms=NOW, ttl_ms=3_600_000)


def test_signed_verdicts_verify_and_say_whom_the_certifier_verified_and_convicted():
    wire = sign_verdicts(CERTIFIER, MODEL, {PEERS[0]: 3, PEERS[1]: 1, PEERS[3]: 0, PEERS[2]: 9},
                         {PEERS[2]: "a proof re-checked here"}, now_ms=NOW)
    rec = verify(wire)
    assert rec.content["verified"] == [[PEERS[0], 3], [PEERS[1], 1]]  # most first; none unverified or convicted
    assert rec.content["key"] == verdicts_key(MODEL, str(CERTIFIER.peer_id)) and model_of_key(rec.content["key"]) == MODEL
    [v] = verdicts_of([rec], {str(CERTIFIER.peer_id)}, MODEL)
    assert (v.certifier, v.model_digest, dict(v.verified), dict(v.convicted), v.issued_at_ms) == (
        str(CERTIFIER.peer_id), MODEL, {PEERS[0]: 3, PEERS[1]: 1}, {PEERS[2]: "a proof re-checked here"}, NOW)
    assert verify(verdicts()).content["convicted"] == [[PEERS[2], "a proof re-checked here"]]


def test_sign_verdicts_keeps_the_convicted_then_the_most_verified_that_fit_one_record():
    many = {p: 1 + i for i, p in enumerate(PEERS)} | {f"{p[:40]}-{i}": 1 for i, p in enumerate(PEERS * 3)}
    rec = verify(sign_verdicts(CERTIFIER, MODEL, many, {}, now_ms=NOW))
    kept = rec.content["verified"]
    assert len(kept) == MAX_VERIFIED and kept[:2] == [[PEERS[-1], len(PEERS)], [PEERS[-2], len(PEERS) - 1]]
    assert [n for _, n in kept] == sorted(many.values(), reverse=True)[:MAX_VERIFIED]
    # convictions with the longest whys (two bytes a character): more than fit one record
    convicted = {f"{p[:40]}-c{i}": "é" * (2 * MAX_WHY_CHARS) for i, p in enumerate(PEERS[:MAX_CONVICTED + 8])}
    for some in (dict(list(convicted.items())[:8]), convicted):
        rec = verify(sign_verdicts(CERTIFIER, MODEL, many, some, now_ms=NOW))
        kept, gone = rec.content["verified"], rec.content["convicted"]
        assert 0 < len(gone) <= MAX_CONVICTED and [p for p, _ in gone] == sorted(some)[:len(gone)]
        assert all(why == "é" * MAX_WHY_CHARS for _, why in gone)
        assert [n for _, n in kept] == sorted(many.values(), reverse=True)[:len(kept)]  # the most verified, if any
    assert len(verify(sign_verdicts(CERTIFIER, MODEL, many, dict(list(convicted.items())[:8]),
                                    now_ms=NOW)).content["convicted"]) == 8


def entries(n: int, second) -> list:
    return [[f"peer-{i}", second(i)] for i in range(n)]


REFUSED_VERDICTS = {
    "too many verified": (lambda: verdicts(verified=entries(MAX_VERIFIED + 1, lambda i: 1)), "verified"),
    "too many convicted": (lambda: verdicts(convicted=entries(MAX_CONVICTED + 1, str), verified=[]), "convicted"),
    "a peer verified twice": (lambda: verdicts(verified=[[PEERS[0], 1], [PEERS[0], 2]]), "verified"),
    "a peer convicted twice": (lambda: verdicts(convicted=[[PEERS[2], "a"], [PEERS[2], "b"]]), "convicted"),
    "a peer both verified and convicted": (lambda: verdicts(convicted=[[PEERS[0], "a"]]), "both"),
    "a why too long": (lambda: verdicts(convicted=[[PEERS[2], "w" * (MAX_WHY_CHARS + 1)]]), "convicted"),
    "a why that is not text": (lambda: verdicts(convicted=[[PEERS[2], 1]]), "convicted"),
    "no sessions": (lambda: verdicts(verified=[[PEERS[0], 0]]), "verified"),
    "sessions out of range": (lambda: verdicts(verified=[[PEERS[0], (1 << 31) + 1]]), "verified"),
    "sessions as a flag": (lambda: verdicts(verified=[[PEERS[0], True]]), "verified"),
    "an empty peer": (lambda: verdicts(verified=[["", 1]]), "verified"),
    "a peer id too long": (lambda: verdicts(verified=[["p" * 129, 1]]), "verified"),
    "an entry of three": (lambda: verdicts(verified=[[PEERS[0], 1, 1]]), "verified"),
    "verified as a map": (lambda: verdicts(verified={PEERS[0]: 1}), "verified"),
    "the key of another certifier": (lambda: verdicts(key=verdicts_key(MODEL, str(OTHER.peer_id))), "key"),
    "the key of another model": (lambda: verdicts(key=verdicts_key("3" * 64, str(CERTIFIER.peer_id))), "key"),
    "a model that is no digest": (lambda: verdicts(model_digest="xyz", key=f"verdicts/xyz/{CERTIFIER.peer_id}"),
                                  "key"),
    "no convicted list": (lambda: verdicts(convicted=None), "names its key"),
    "an extra field": (lambda: verdicts(note="trust me"), "names its key"),
}


@pytest.mark.parametrize("case", REFUSED_VERDICTS)
def test_verdicts_out_of_bounds_are_refused_with_a_reason(case):
    make, why = REFUSED_VERDICTS[case]
    e = refusal(make())
    assert e.reason is Reject.MALFORMED and why in e.detail, e


def test_only_the_certifier_signs_its_verdicts():
    me = str(OTHER.peer_id)  # a record that names OTHER, consistently, signed by CERTIFIER
    e = refusal(verdicts(certifier=me, key=verdicts_key(MODEL, me)))
    assert e.reason is Reject.SIGNER_MISMATCH


def test_verdicts_of_keeps_each_trusted_certifiers_newest_for_the_model():
    second = Identity.from_seed(b"\x44" * 32)
    old = verify(sign_verdicts(CERTIFIER, MODEL, {PEERS[0]: 1}, {}, now_ms=NOW - 10))
    new = verify(sign_verdicts(CERTIFIER, MODEL, {PEERS[1]: 2}, {PEERS[0]: "caught"}, now_ms=NOW - 5))
    theirs = verify(sign_verdicts(second, MODEL, {PEERS[3]: 1}, {}, now_ms=NOW))
    elsewhere = verify(sign_verdicts(CERTIFIER, "3" * 64, {PEERS[4]: 1}, {}, now_ms=NOW))
    stranger = verify(sign_verdicts(OTHER, MODEL, {PEERS[5]: 9}, {PEERS[1]: "lies"}, now_ms=NOW))
    records = [new, certificate(), theirs, old, elsewhere, stranger]
    trusted = {str(CERTIFIER.peer_id), str(second.peer_id)}
    got = {v.certifier: (dict(v.verified), dict(v.convicted)) for v in verdicts_of(records, trusted, MODEL)}
    assert got == {str(CERTIFIER.peer_id): ({PEERS[1]: 2}, {PEERS[0]: "caught"}), str(second.peer_id): ({PEERS[3]: 1}, {})}
    assert verdicts_of(records, set(), MODEL) == [] and verdicts_of(records, trusted, "4" * 64) == []
    # a record that says it is CERTIFIER's but was signed by another (never through a verifier) counts for nobody
    forged_rec = Record(PEER_VERDICTS, {**stranger.content, "certifier": str(CERTIFIER.peer_id),
                                        "key": verdicts_key(MODEL, str(CERTIFIER.peer_id))},
                        NOW + 1, NOW, NOW + 1, OTHER.peer_id, b"", b"")
    assert verdicts_of([forged_rec], trusted, MODEL) == []


# --- what a survey's view and a client's records make of them ------------------------------------


def test_a_view_holds_only_trusted_certifiers_verdicts_and_certificates_still_certify():
    reports = [capability((0, 30))]  # of test_certification's model and recipe, which its evidence certifies
    cert = certificate()
    words = verify(sign_verdicts(CERTIFIER, SERVED, {PEERS[0]: 2, PEERS[1]: 1}, {PEERS[2]: "caught"}, now_ms=NOW))
    second = Identity.from_seed(b"\x44" * 32)
    theirs = verify(sign_verdicts(second, SERVED, {}, {PEERS[1]: "caught too"}, now_ms=NOW))
    trusted = TrustPolicy(frozenset({str(CERTIFIER.peer_id), str(second.peer_id)}))
    v = build_view(SERVED, 30, reports, [words, cert, theirs], trusted)
    assert [r.certificate is not None for r in v.recipes] == [True] and v.recipes[0].refused == []
    assert {x.certifier for x in v.verdicts} == {str(CERTIFIER.peer_id), str(second.peer_id)}
    assert v.convicted() == {PEERS[2]: f"convicted by certifier {CERTIFIER.peer_id}: caught",
                             PEERS[1]: f"convicted by certifier {second.peer_id}: caught too"}
    assert v.verified_by_certifiers() == {PEERS[0]}  # PEERS[1]: one trusted certifier convicted it

    untrusted = build_view(SERVED, 30, reports, [words, cert], TrustPolicy(frozenset({str(OTHER.peer_id)})))
    assert untrusted.verdicts == [] and untrusted.convicted() == {} and untrusted.verified_by_certifiers() == set()
    [(who, err)] = untrusted.recipes[0].refused  # the certificate, untrusted; the verdicts are no evidence to refuse
    assert (who, err.reason) == (str(CERTIFIER.peer_id), Refusal.UNTRUSTED)
    only = build_view(SERVED, 30, reports, [words], trusted)  # verdicts without a certificate certify nothing
    assert only.recipes[0].certificate is None and only.recipes[0].refused == [] and only.verdicts


def test_a_peer_a_trusted_certifier_convicted_is_caught_until_the_certifier_retracts(tmp_path):
    path = str(tmp_path / "records.msgpack")
    records = PeerRecords(path)
    records.matched("p")
    records.vouch({"p", "q"})
    assert records.verified("p") and records.caught() == {}
    records.convict({"p": "convicted by certifier c: caught"})
    assert records.caught() == {"p": "convicted by certifier c: caught"}
    assert not records.verified("p") and records.verified("q")
    # q is vouched, not verified by this client's own audits: every session of it is still audited
    assert records.audit_probability("p") == 1.0 and records.audit_probability("q") == 1.0
    assert records.snapshot()["p"]["convicted"] == "convicted by certifier c: caught"
    assert "convicted" not in records.snapshot()["q"]
    assert load_records(path)["p"].caught == ""  # held in memory only: the certifier may retract
    records.matched("q")  # a later write keeps it out of the file too
    assert load_records(path)["p"].caught == ""
    records.convict({})
    assert records.caught() == {} and records.verified("p") and records.audit_probability("p") < 1.0
    assert "convicted" not in records.snapshot()["p"]
    assert PeerRecords(path).caught() == {}  # nor does a new run start with it


def test_reports_and_verdicts_of_a_model_nobody_announces_live_minutes():
    served, other = "cd" * 32, "ef" * 32
    announced = lambda key: key == model_key(served)  # noqa: E731
    for key in (report_key(served, PEERS[0]), verdicts_key(served, PEERS[1])):
        assert lifetime_cap(key, announced) is None
    for key in (report_key(other, PEERS[0]), verdicts_key(other, PEERS[1])):
        assert lifetime_cap(key, announced) == UNANNOUNCED_LIFETIME_MS
    assert model_of_key("fraud/xyz/" + PEERS[0]) is None and model_of_key(f"fraud/{served}") is None
    assert model_of_key(f"verdicts/{served}/{PEERS[1]}/x") is None
