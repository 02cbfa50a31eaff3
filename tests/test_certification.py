"""Certification evidence: every refusal reason, the trust policy, and the
evidence parser under arbitrary input (pure; no network, no model)."""

import dataclasses
import json
import pathlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_p2p.trust.attestation import (
    SEAM_DOMAIN,
    TOKENS_DOMAIN,
    Attestation,
    CertificationError,
    RowDigest,
    ids_digest,
)
from meshnet_p2p.trust.evidence import (
    TWO_ROUTES,
    WHOLE_MODEL,
    Evidence,
    EvidenceRefused,
    Refusal,
    RouteRun,
    check_evidence,
    expected_digests,
)
from meshnet_p2p.trust.policy import TrustPolicy, certified, evaluate
from meshnet_p2p.engine.recipe import recipe_digest
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.swarm.node import TYPES
from meshnet_p2p.core.records import RecordRejected, RecordVerifier, Reject, sign_record, wall_ms

VECTORS = json.loads((pathlib.Path(__file__).parent / "data" / "recipe_vectors.json").read_text())["recipes"]
AXES = VECTORS[0]["axes"]
MODEL, RECIPE, OTHER = "ab" * 32, recipe_digest(AXES), "ef" * 32
N_LAYER = 30
PROMPT = (11, 12, 13)
GENERATED = [21, 22, 23]
STEPS = [(0, 3, 21), (3, 1, 22), (4, 1, 23)]  # a prefill of the prompt, then two decodes
PEERS = [Identity.from_seed(bytes([i]) * 32) for i in range(1, 7)]
CERTIFIER = Identity.from_seed(b"\x09" * 32)


def route(peers=PEERS[:3], cuts=((0, 10), (10, 20), (20, 30)), *, generated=GENERATED, steps=STEPS,
          fingerprint=(MODEL, RECIPE), session="s1") -> RouteRun:
    """A route whose hops chain: the head took the prompt, each hop took what the
    one before gave, the tail emitted the tokens; each hop signs its part."""
    run = RouteRun(list(steps), list(generated), [], session)
    head_in, tail_out = expected_digests(PROMPT, run)
    seams = [head_in] + [f"{i:02x}" * 32 for i in range(1, len(cuts))] + [tail_out]
    for i, (ident, (a, b)) in enumerate(zip(peers, cuts)):
        att = Attestation(str(ident.peer_id), f"{session}-{i}", *fingerprint, a, b, len(steps), seams[i], seams[i + 1])
        run.hops.append(att.signed_by(ident))
    return run


def evidence(*routes: RouteRun, method=WHOLE_MODEL, reference=GENERATED, **kw) -> dict:
    ev = Evidence(MODEL, RECIPE, N_LAYER, method, PROMPT, routes or (route(),),
                  ids_digest(TOKENS_DOMAIN, reference), AXES, {"recipe_name": "default"})
    return {**ev.content(CERTIFIER.peer_id), **kw}


def refusal(content) -> Refusal | None:
    r = check_evidence(content)
    return None if r is None else r[0]


def test_honest_evidence_certifies():
    assert check_evidence(evidence()) is None
    assert check_evidence(evidence(route(), route(PEERS[3:6], session="s2"), method=TWO_ROUTES)) is None


def test_evidence_from_one_node_is_refused():
    assert refusal(evidence(route(PEERS[:1], ((0, 30),)))) is Refusal.ONE_NODE


def test_evidence_that_names_a_node_twice_is_refused():
    assert refusal(evidence(route([PEERS[0], PEERS[1], PEERS[0]]))) is Refusal.NODE_TWICE


def test_two_routes_that_share_a_peer_are_refused():
    second = route([PEERS[3], PEERS[4], PEERS[2]], session="s2")
    assert refusal(evidence(route(), second, method=TWO_ROUTES)) is Refusal.NODE_TWICE


@pytest.mark.parametrize("cuts", [((0, 10), (20, 30)), ((0, 10), (10, 20)), ((5, 20), (20, 30))],
                         ids=["middle", "tail", "head"])
def test_a_hole_in_layer_coverage_is_refused(cuts):
    assert refusal(evidence(route(PEERS[: len(cuts)], cuts))) is Refusal.COVERAGE_HOLE


def test_evidence_that_generated_no_tokens_is_refused():
    assert refusal(evidence(route(generated=[]), reference=[])) is Refusal.NO_TOKENS


def test_evidence_that_disagrees_with_the_certifiers_own_run_is_refused():
    assert refusal(evidence(reference=[21, 22, 99])) is Refusal.DISAGREES


def test_two_routes_with_different_tokens_are_refused():
    other = route(PEERS[3:6], generated=[21, 22, 99], steps=[(0, 3, 21), (3, 1, 22), (4, 1, 99)], session="s2")
    assert refusal(evidence(route(), other, method=TWO_ROUTES)) is Refusal.DISAGREES


@pytest.mark.parametrize("signature", [b"", b"\0" * 64, None], ids=["missing", "zeros", "tampered"])
def test_a_bad_or_missing_hop_signature_is_refused(signature):
    run = route()
    att = run.hops[1]
    sig = bytes([att.signature[0] ^ 1]) + att.signature[1:] if signature is None else signature
    run.hops[1] = dataclasses.replace(att, signature=sig)
    assert refusal(evidence(run)) is Refusal.BAD_SIGNATURE


def test_a_hop_that_attests_work_it_did_not_sign_is_refused():
    run = route()
    run.hops[2] = dataclasses.replace(run.hops[2], steps=99)  # the numbers changed after signing
    assert refusal(evidence(run)) is Refusal.BAD_SIGNATURE


def test_evidence_whose_hop_names_another_fingerprint_is_refused():
    run = route()
    other = route(fingerprint=(MODEL, OTHER))  # properly signed, for another recipe
    run.hops[1] = other.hops[1]
    assert refusal(evidence(run)) is Refusal.OTHER_FINGERPRINT


def test_hops_that_do_not_chain_are_refused():
    run = route()
    run.hops[1] = dataclasses.replace(run.hops[1], input_digest="77" * 32).signed_by(PEERS[1])
    assert refusal(evidence(run)) is Refusal.BROKEN_CHAIN


@pytest.mark.parametrize("steps", [[(2, 1, 21), (3, 1, 22), (4, 1, 23)], [(0, 2, 21), (3, 1, 22), (4, 1, 23)],
                                   [(0, 4, 21), (4, 1, 22), (5, 1, 23)], [(0, 3, 21), (3, 2, 22), (5, 1, 23)]],
                         ids=["prompt-never-fed", "gap", "prefill-past-prompt", "two-token-decode"])
def test_steps_that_are_not_a_prefill_then_decodes_are_refused(steps):
    assert refusal(evidence(route(steps=steps))) is Refusal.BROKEN_CHAIN


def test_each_hop_attests_a_session_of_its_own():
    run = route()
    run.hops[1] = dataclasses.replace(run.hops[1], session_id=run.hops[0].session_id).signed_by(PEERS[1])
    assert refusal(evidence(run)) is Refusal.MALFORMED
    assert refusal(evidence(route(), route(PEERS[3:6]), method=TWO_ROUTES)) is Refusal.MALFORMED  # one route session twice


def test_recipe_axes_that_do_not_hash_to_the_digest_are_refused():
    assert refusal(evidence(recipe={**AXES, "n_ubatch": 32})) is Refusal.OTHER_FINGERPRINT
    assert refusal(evidence(recipe={})) is Refusal.OTHER_FINGERPRINT


def test_a_head_that_took_another_prompt_is_refused():
    run = route()
    run.hops[0] = dataclasses.replace(run.hops[0], input_digest="77" * 32).signed_by(PEERS[0])
    assert refusal(evidence(run)) is Refusal.BROKEN_CHAIN


def test_tokens_the_tail_never_emitted_are_refused():
    run = route()
    run.generated = [21, 22, 24]
    run.steps = [(0, 3, 21), (3, 1, 22), (4, 1, 24)]
    assert refusal(evidence(run, reference=[21, 22, 24])) is Refusal.BROKEN_CHAIN


def signed(content, identity=CERTIFIER) -> bytes:
    return sign_record(identity, "meshnet/certificate/v1", content, seq=1, now_ms=wall_ms(), ttl_ms=60_000)


def test_untrusted_certifiers_certify_nothing():
    rec = RecordVerifier(TYPES).verify(signed(evidence()), wall_ms())
    with pytest.raises(EvidenceRefused) as e:
        evaluate(rec, TrustPolicy(frozenset({str(PEERS[5].peer_id)})), model_digest=MODEL)
    assert e.value.reason is Refusal.UNTRUSTED and "--trust" in str(e.value)
    cert = evaluate(rec, TrustPolicy(frozenset({str(CERTIFIER.peer_id)})), model_digest=MODEL, n_layer=N_LAYER)
    assert cert.certifier == str(CERTIFIER.peer_id) and cert.method == WHOLE_MODEL
    assert [layers for _, *layers in cert.route] == [[0, 10], [10, 20], [20, 30]]


def test_a_certificate_lives_under_its_certifiers_own_key():
    content = evidence()
    assert content["key"].endswith("/" + str(CERTIFIER.peer_id))
    assert refusal({**content, "key": content["key"].rsplit("/", 1)[0] + "/" + str(PEERS[0].peer_id)}) is Refusal.MALFORMED


def test_certified_keeps_accepted_and_counts_refused():
    verifier = RecordVerifier(TYPES)
    good = verifier.verify(signed(evidence()), wall_ms(), remember=False)
    refused = []
    held = certified([good], TrustPolicy(frozenset()), model_digest=MODEL, refused=refused)
    assert held == {} and refused[0][1].reason is Refusal.UNTRUSTED
    held = certified([good], TrustPolicy.default(own=CERTIFIER), model_digest=MODEL)
    assert set(held) == {RECIPE}
    with pytest.raises(EvidenceRefused) as e:
        evaluate(good, TrustPolicy.default(own=CERTIFIER), model_digest=OTHER)
    assert e.value.reason is Refusal.OTHER_FINGERPRINT


def test_the_dht_stores_no_evidence_that_fails_its_checks():
    verifier = RecordVerifier(TYPES)
    with pytest.raises(RecordRejected) as e:
        verifier.verify(signed(evidence(reference=[1])), wall_ms())
    assert e.value.reason is Reject.MALFORMED and "disagrees" in str(e.value)
    # a record that names one certifier and is signed by another
    with pytest.raises(RecordRejected) as e:
        verifier.verify(signed(evidence(), PEERS[0]), wall_ms())
    assert e.value.reason is Reject.SIGNER_MISMATCH


def test_signing_refuses_evidence_that_does_not_hold():
    ev = Evidence(MODEL, RECIPE, N_LAYER, WHOLE_MODEL, PROMPT, (route(PEERS[:1], ((0, 30),)),),
                  ids_digest(TOKENS_DOMAIN, GENERATED), AXES)
    with pytest.raises(EvidenceRefused, match="one node"):
        ev.sign(CERTIFIER, now_ms=wall_ms())


def test_an_attestation_is_signed_only_by_the_peer_it_names():
    att = Attestation(str(PEERS[0].peer_id), "s", MODEL, RECIPE, 0, 10, 1, "00" * 32, "11" * 32)
    with pytest.raises(CertificationError):
        att.signed_by(PEERS[1])
    assert att.signed_by(PEERS[0]).verifies() and not att.verifies()


def test_the_seam_digest_frames_every_step():
    a, b = RowDigest(SEAM_DOMAIN), RowDigest(SEAM_DOMAIN)
    a.tokens(0, [1, 2])
    b.tokens(0, [1])
    b.tokens(1, [2])  # the same tokens, stepped differently, are other work
    assert a.hexdigest() != b.hexdigest()


def test_trust_policy_sources(tmp_path):
    boot = Multiaddr.for_socket("127.0.0.1", "udp", 4001, PEERS[0].peer_id)
    trust_file = tmp_path / "trusted.txt"
    trust_file.write_text(f"# operators\n{PEERS[2].peer_id}  # alice\n\n")
    policy = TrustPolicy.default([boot, str(Multiaddr.for_socket("127.0.0.1", "udp", 4002, PEERS[3].peer_id))],
                                 own=CERTIFIER, extra=[str(PEERS[1].peer_id)], trust_file=str(trust_file))
    assert policy.certifiers == {str(p.peer_id) for p in (PEERS[0], PEERS[3], CERTIFIER, PEERS[1], PEERS[2])}
    assert not policy.trusts(str(PEERS[4].peer_id))
    with pytest.raises(CertificationError, match="not a peer ID"):
        TrustPolicy.default(extra=["not-a-peer"])
    with pytest.raises(CertificationError, match="cannot read trust file"):
        TrustPolicy.default(trust_file=str(tmp_path / "missing.txt"))


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**64), st.text(max_size=80),
                    st.binary(max_size=80), st.floats(allow_nan=True))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=12)


@given(st.sampled_from(sorted(evidence())), values)
def test_any_one_field_replaced_gives_a_reason_or_holds_never_an_exception(name, value):
    content = evidence()
    content[name] = value
    r = check_evidence(content)
    assert r is None or isinstance(r[0], Refusal)


@given(st.integers(0, 2), st.sampled_from(["peer_id", "session", "model_digest", "layers", "steps", "input_digest",
                                           "output_digest", "signature"]), values)
def test_any_hop_field_replaced_gives_a_reason_never_an_exception(hop, name, value):
    content = evidence()
    content["routes"][0]["hops"][hop][name] = value
    r = check_evidence(content)
    assert r is None or isinstance(r[0], Refusal)


def test_a_certifiers_index_names_only_its_own_key():
    from meshnet_p2p.trust.evidence import sign_index

    verifier = RecordVerifier(TYPES)
    rec = verifier.verify(sign_index(CERTIFIER, MODEL, [RECIPE, OTHER, RECIPE], now_ms=wall_ms()), wall_ms())
    assert rec.content["recipes"] == [RECIPE, OTHER] and rec.content["key"].endswith(str(CERTIFIER.peer_id))
    forged = {**rec.content, "key": f"certs/{MODEL}/{PEERS[0].peer_id}"}
    with pytest.raises(RecordRejected):
        verifier.verify(sign_record(CERTIFIER, "meshnet/certified-index/v1", forged, seq=2, now_ms=wall_ms(),
                                    ttl_ms=1000), wall_ms())


@given(st.dictionaries(st.sampled_from(["key", "certifier", "model_digest", "recipes", "n_layer", "name", "peer_id"]),
                       values, max_size=7))
def test_index_validators_give_a_reason_never_an_exception(content):
    from meshnet_p2p.swarm.capability import _valid_index as model_index
    from meshnet_p2p.trust.evidence import _valid_index as cert_index

    for check in (model_index, cert_index):
        assert check(content) is None or isinstance(check(content), str)
