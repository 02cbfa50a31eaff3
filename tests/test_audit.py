"""Audits by exact replay without processes: which verdict from which comparisons,
the plans replays and audited routes take, the fraud proof's record, and the
driver over unit-test doubles of hops."""

import dataclasses
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from meshnet_p2p.client.audit import Decision, ReplayRun, Verdict, audit_hop, decide, planner_through, replay_planner
from meshnet_p2p.client.errors import GenerationError
from meshnet_p2p.client.hop import Hop
from meshnet_p2p.client.options import RouteOptions
from meshnet_p2p.client.search import RouteSearch
from meshnet_p2p.client.transcript import HopTranscript, StepRecord
from meshnet_p2p.dataplane.stub import ShardConnectionError
from meshnet_p2p.dataplane.wire import Fingerprint
from meshnet_p2p.engine.contract import HIDDEN, SamplingParams, Tensor, TensorBundle, TokenOutput
from meshnet_p2p.swarm.placement import NoRoute, Span
from meshnet_p2p.trust.fraud import FRAUD_PROOF, MAX_PROOF_TOKENS, MAX_REPLAYERS, FraudProof, FraudProofError, InputStep, output_digest

from tests.mutations import mutate_tree

PEER = ("a", "b", "c", "d")  # the audited peer's output digest at each step


def run(outputs, *replayers):
    return ReplayRun(tuple(replayers) or ("r1",), tuple(outputs))


# --- the decision ----------------------------------------------------------------------------------


def test_no_chain_is_no_replayer_and_an_exact_replay_is_a_match():
    assert decide(PEER, None, None) == Decision(Verdict.NO_REPLAYER)
    assert decide(PEER, run(PEER), None) == Decision(Verdict.MATCH)


def test_a_replay_cut_short_is_no_match():
    with pytest.raises(ValueError):
        decide(PEER, run(PEER[:2]), None)


def test_one_replay_that_differs_blames_nobody():
    assert decide(PEER, run(("a", "b", "X")), None) == Decision(Verdict.UNCONFIRMED, 2)


def test_two_independent_replays_that_agree_against_the_peer_prove_a_mismatch():
    assert decide(PEER, run(("a", "b", "X"), "r1"), run(("a", "b", "X"), "r2")) == Decision(Verdict.MISMATCH, 2)
    assert decide(PEER, run(("X",), "r1"), run(("X",), "r2")) == Decision(Verdict.MISMATCH, 0)


def test_a_second_replay_that_agrees_with_the_peer_makes_the_first_replayer_the_suspect():
    d = decide(PEER, run(("a", "b", "X"), "r1", "r1b"), run(("a", "b", "c"), "r2"))
    assert d == Decision(Verdict.UNDECIDED, 2, ("r1", "r1b"))


def test_a_second_replay_that_differs_earlier_is_itself_the_odd_one():
    d = decide(PEER, run(("a", "b", "X"), "r1"), run(("a", "Y"), "r2"))
    assert d == Decision(Verdict.UNDECIDED, 2, ("r2",))


def test_three_different_outputs_name_no_suspect():
    assert decide(PEER, run(("a", "X"), "r1"), run(("a", "Y"), "r2")) == Decision(Verdict.UNDECIDED, 1)


def test_a_second_replay_cut_short_decides_nothing():
    with pytest.raises(ValueError):
        decide(PEER, run(("a", "b", "X"), "r1"), run(("a",), "r2"))


# --- plans ---------------------------------------------------------------------------------------


def spans():
    return [Span("h", 0, 10, 50.0), Span("m1", 10, 20, 50.0), Span("m2", 10, 20, 10.0), Span("m3", 10, 15, 500.0),
            Span("m4", 15, 20, 500.0), Span("t", 20, 30, 50.0)]


def test_a_replay_plans_the_exact_span_unless_the_seam_composes():
    avoid = {"m1"}
    exact = replay_planner(True, avoid)
    assert [s.peer_id for s in exact(spans(), 10, 20)] == ["m2"]  # m3+m4 would be cheaper, but do not compose
    assert [s.peer_id for s in replay_planner(False, avoid)(spans(), 10, 20)] == ["m3", "m4"]
    avoid.add("m2")  # read at each plan: replayers used or failed drop out
    with pytest.raises(NoRoute):
        exact(spans(), 10, 20)


def test_an_audited_route_goes_through_the_audited_peer():
    plan = planner_through("m2")  # the slowest of the middle peers: never the cheapest plan
    assert [s.peer_id for s in plan(spans(), 0, 30)] == ["h", "m2", "t"]
    assert [s.peer_id for s in plan(spans(), 20, 30)] == ["t"]  # a failover elsewhere plans as usual
    assert [s.peer_id for s in plan(spans(), 10, 20)] == ["m2"]  # a failover of its own span keeps it
    with pytest.raises(NoRoute):  # the audited peer failed: no route without it
        plan(spans(), 0, 30, banned={"m2"})


# --- output digests and fraud proofs --------------------------------------------------------------


def bundle(data: bytes) -> TensorBundle:
    return TensorBundle((Tensor(HIDDEN, "f32", (1, len(data) // 4), data),))


def test_an_output_digest_sees_every_bit():
    base = output_digest(5, bundle(b"\0" * 16))
    assert output_digest(5, bundle(b"\0" * 16)) == base
    assert output_digest(5, bundle(b"\1" + b"\0" * 15)) != base
    assert output_digest(6, bundle(b"\0" * 16)) != base
    tok = output_digest(5, TokenOutput(7, False))
    assert tok != output_digest(5, TokenOutput(7, True)) != output_digest(5, TokenOutput(8, False))
    with pytest.raises(TypeError):
        output_digest(5, (7,))


def proof(**kw) -> FraudProof:
    fields = dict(peer_id="cheat", model_digest="1" * 64, recipe_digest="2" * 64, start=0, end=10, session_id="s-1",
                  step=2, position=9, peer_output="a" * 64, replay_output="b" * 64, replayers=("r1", "r2"),
                  sampling=SamplingParams(0.7, 40, 0.9, 3),
                  inputs=(InputStep(0, tuple(range(8)), False), InputStep(8, (8,), True), InputStep(9, (9,), True)))
    return FraudProof(**{**fields, **kw})


def test_a_fraud_proof_round_trips_through_its_content():
    p = proof()
    assert FraudProof.from_content(p.to_content()) == p
    middle = proof(start=10, end=20, inputs=())
    assert FraudProof.from_content(middle.to_content()) == middle


def signed_commitment(identity, **kw):
    from meshnet_p2p.trust.commitment import Commitment

    fields = dict(peer_id=str(identity.peer_id), session_id="s-1", model_digest="1" * 64, recipe_digest="2" * 64,
                  start=10, end=20, route_epoch=0, index=2, position=9, decode=True, input_digest=bytes(32),
                  output_digest=bytes.fromhex("a" * 64), prev=bytes(32))
    return Commitment(**{**fields, **kw}).signed_by(identity)


def test_a_proof_carries_the_peers_signed_commitment_to_the_output_the_replays_contradict():
    import msgpack

    from meshnet_p2p.core.identity import Identity

    cheat = Identity.generate()
    c = signed_commitment(cheat)
    p = proof(peer_id=str(cheat.peer_id), start=10, end=20, inputs=(), commitment=c)
    assert FraudProof.from_content(msgpack.unpackb(msgpack.packb(p.to_content()))) == p  # a record's encoding
    assert p.signed_by_peer()
    assert not proof(peer_id=str(cheat.peer_id), start=10, end=20, inputs=()).signed_by_peer()  # none: not signed
    other = signed_commitment(cheat, output_digest=bytes.fromhex("c" * 64))  # signed, but another output
    assert not proof(peer_id=str(cheat.peer_id), start=10, end=20, inputs=(), commitment=other).signed_by_peer()
    forged = dataclasses.replace(c, signature=bytes(64))
    assert not proof(peer_id=str(cheat.peer_id), start=10, end=20, inputs=(), commitment=forged).signed_by_peer()
    for wrong in (dict(index=3), dict(session_id="s-2"), dict(start=0)):  # not the audited step's
        with pytest.raises(FraudProofError, match="commitment"):
            proof(peer_id=str(cheat.peer_id), start=10, end=20, inputs=(), commitment=signed_commitment(cheat, **wrong))
    content = p.to_content()
    content["commitment"]["signature"] = "not bytes"
    with pytest.raises(FraudProofError, match="commitment"):
        FraudProof.from_content(content)


@pytest.mark.parametrize("bad", [
    dict(peer_output="b" * 64),  # outputs that agree prove nothing
    dict(replayers=()), dict(replayers=("cheat",)), dict(replayers=tuple(f"r{i}" for i in range(MAX_REPLAYERS + 1))),
    dict(model_digest="xyz"), dict(session_id="a b"), dict(start=10, end=10),
    dict(start=10, end=20),  # inputs are a head's only
    dict(inputs=(InputStep(0, tuple(range(8)), False),)),  # not every step up to the one that differs
    dict(inputs=(InputStep(0, (1,), False), InputStep(2, (8,), True), InputStep(3, (9,), True))),  # a gap
    dict(step=0, position=0, inputs=(InputStep(0, tuple(range(MAX_PROOF_TOKENS + 1)), False),)),
    dict(step=0, position=0, inputs=(InputStep(0, (1, 2), True),)),
])
def test_a_fraud_proof_out_of_bounds_is_refused(bad):
    with pytest.raises(FraudProofError):
        proof(**bad)


@pytest.mark.parametrize("mutate", [
    lambda c: c.update(type="other"), lambda c: c.pop("session"), lambda c: c.update(step=True),
    lambda c: c.update(layers=[0]), lambda c: c.update(replayers="r1"), lambda c: c.update(peer_id="p" * 129),
    lambda c: c["sampling"].update(top_p=2.0), lambda c: c["inputs"][0].__setitem__(1, "abc"),
    lambda c: c.update(inputs=[[0, [1], "yes"]]),
])
def test_fraud_proof_content_from_anyone_is_checked(mutate):
    c = proof().to_content()
    mutate(c)
    with pytest.raises(FraudProofError):
        FraudProof.from_content(c)


_values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=140),
                    st.binary(max_size=70), st.sampled_from(["1" * 64, "2" * 64, "a" * 64, "cheat", "r1", "s-1",
                                                             FRAUD_PROOF, 0, 1, 9, 10, 2**31, 2**64, -1]))
_any = st.recursive(_values, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                    st.dictionaries(st.text(max_size=12), kids, max_size=4)),
                    max_leaves=12)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(0, 4))
@example(None, -1)
def test_fraud_proof_content_of_any_shape_parses_or_raises_fraud_proof_error(data, edits):
    """Valid content with up to four structural edits, or anything at all: a proof
    that is well formed (and round-trips), or FraudProofError, never another exception."""
    if edits < 0:  # a number no float holds, where a float is read
        content = proof().to_content()
        content["sampling"]["temperature"] = 10**400
    elif edits == 4:
        content = data.draw(_any, label="content")
    else:
        content = mutate_tree(data, proof().to_content(), edits + 1, _any)
    try:
        p = FraudProof.from_content(content)
    except FraudProofError:
        return
    assert FraudProof.from_content(p.to_content()) == p


# --- the audit's driver, over a fake network (unit-test doubles of hops) --------------------------


REPORT = {"model_digest": "1" * 64, "recipe_digest": "2" * 64, "recipe": {"seam_dtype": "f16"}}


def computed(position: int, given: TensorBundle, lie: bool) -> TensorBundle:
    """What a middle hop 'computes' here: a function of its input and position (or not, if it lies)."""
    data = bytes((b + position + (1 if lie else 0)) % 256 for b in given.tensors[0].data)
    return bundle(data)


class FakeStream:
    def __init__(self, peer: str, net: dict) -> None:
        self.peer, self.net, self.steps, self.released = peer, net, 0, False

    def step(self, position, *, decode, timeout, idempotency_step=None, hidden=None, token_ids=None):
        self.steps += 1
        if self.peer in self.net["breaks"] and self.steps == 2:
            raise ShardConnectionError(f"{self.peer} went away")
        return SimpleNamespace(position=position + 1, hidden=computed(position, hidden, self.peer in self.net["liars"]),
                               token_id=None, is_eog=False, commitment=None)  # a stand-in signs nothing

    def release(self, timeout=None):
        self.released = True


@pytest.fixture
def net(monkeypatch):
    """Peers of layers 10:20 (r1 the cheapest, then r2, r3), sessions opened as the plan says."""
    net = {"liars": set(), "breaks": set(), "opened": [], "spans": ["r1", "r2", "r3"]}

    def open_chain(self, start, end, epoch):
        try:
            plan = self.opts.planner(self.spans, start, end, banned=self.banned_now())
        except NoRoute as e:  # as the real search says it
            raise GenerationError(str(e)) from None
        hops = []
        for s in plan:
            stream = FakeStream(s.peer_id, net)
            net["opened"].append(stream)
            hops.append(Hop(s, SimpleNamespace(close=lambda: None), stream, 64))
        return hops

    monkeypatch.setattr(RouteSearch, "open_chain", open_chain)
    return net


def provider(net):
    record = SimpleNamespace(content=REPORT)
    return lambda: [Span(p, 10, 20, 100.0 - i, record=record) for i, p in enumerate(net["spans"])]


def transcript(peer: str, lie: bool, n: int = 4) -> HopTranscript:
    steps = []
    for position in range(n):
        given = bundle(bytes([position]) * 8)
        steps.append(StepRecord(position, given, position > 0, SimpleNamespace(hidden=computed(position, given, lie))))
    return HopTranscript(peer, 10, 20, 30, Fingerprint(REPORT["model_digest"], REPORT["recipe_digest"], {"seam_dtype": "f16"}),
                         64, SamplingParams(), 16, "sess-1", tuple(steps))


def audit(net, t, **kw):
    return audit_hop(t, provider(net), RouteOptions(max_tokens=1), **kw)


def test_an_honest_hop_is_replayed_once_and_every_session_released(net):
    r = audit(net, transcript("p", lie=False))
    assert (r.verdict, r.replayers, r.steps, r.proof) == (Verdict.MATCH, (("r1",),), 4, None)
    assert [s.peer for s in net["opened"]] == ["r1"] and all(s.released for s in net["opened"])


def test_a_lying_hop_is_proven_by_two_disjoint_replays(net):
    r = audit(net, transcript("p", lie=True))
    assert (r.verdict, r.replayers, r.step, r.position) == (Verdict.MISMATCH, (("r1",), ("r2",)), 0, 0)
    assert r.proof.replayers == ("r1", "r2") and r.proof.peer_output != r.proof.replay_output
    assert all(s.released for s in net["opened"])


def test_one_replayer_that_differs_blames_nobody(net):
    net["spans"] = ["r1"]
    r = audit(net, transcript("p", lie=True))
    assert (r.verdict, r.replayers, r.proof) == (Verdict.UNCONFIRMED, (("r1",),), None)


def test_a_lying_replayer_is_outvoted_not_the_peer(net):
    net["liars"].add("r1")
    r = audit(net, transcript("p", lie=False))
    assert (r.verdict, r.suspect, r.replayers, r.proof) == (Verdict.UNDECIDED, ("r1",), (("r1",), ("r2",)), None)


def test_a_failing_replayer_is_set_aside_at_no_cost_to_the_peer(net):
    net["breaks"].add("r1")
    r = audit(net, transcript("p", lie=False))
    assert (r.verdict, r.replayers) == (Verdict.MATCH, (("r2",),))
    assert [s.peer for s in net["opened"]] == ["r1", "r2"] and all(s.released for s in net["opened"])


def test_excluded_peers_and_the_peer_itself_never_replay(net):
    r = audit(net, transcript("r1", lie=False), exclude={"r2"})
    assert r.replayers == (("r3",),)
    net["spans"] = ["r1", "r2"]
    assert audit(net, transcript("r1", lie=False), exclude={"r2"}).verdict is Verdict.NO_REPLAYER
