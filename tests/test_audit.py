"""Audits by exact replay without processes: which verdict from which comparisons,
the plans replays and audited routes take, the fraud proof's record, and the
driver over unit-test doubles of hops."""

import copy
import dataclasses
import hashlib
from types import SimpleNamespace

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from meshnet_p2p.verify.replay import Decision, ReplayRun, Verdict, audit_hop, decide, planner_through, replay_planner
from meshnet_p2p.route.errors import GenerationError
from meshnet_p2p.route.hop import Hop
from meshnet_p2p.route.options import RouteOptions
from meshnet_p2p.route.search import RouteSearch
from meshnet_p2p.verify.transcript import HopTranscript, StepRecord
from meshnet_p2p.dataplane.stub import ShardConnectionError
from meshnet_p2p.dataplane.wire import Fingerprint
from meshnet_p2p.engine.contract import HIDDEN, SamplingParams, Tensor, TensorBundle, TokenOutput
from meshnet_p2p.swarm.placement import NoRoute, Span
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import canonical
from meshnet_p2p.trust.commitment import GENESIS, Commitment, tokens_digest
from meshnet_p2p.trust.fraud_proof import (FRAUD_PROOF, MAX_CUTS, MAX_PROOF_STEPS, MAX_PROOF_TOKENS, MAX_REPLAYERS,
                                           ChainLink, FraudProof, FraudProofError, output_digest)

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


def test_a_replay_looks_first_for_replayers_with_a_record_as_a_conviction_needs_one():
    # m3+m4 are the cheapest chain; m2 alone holds a record: only a replay wholly on such peers
    # convicts (issue 59), so an audit that could run one does not leave it to the planner's ms
    assert [s.peer_id for s in replay_planner(False, {"m1"})(spans(), 10, 20)] == ["m3", "m4"]
    plan = replay_planner(False, {"m1"}, verified=lambda p: p == "m2")
    assert [s.peer_id for s in plan(spans(), 10, 20)] == ["m2"]
    plan = replay_planner(False, {"m1", "m2"}, verified=lambda p: p == "m2")
    assert [s.peer_id for s in plan(spans(), 10, 20)] == ["m3", "m4"]  # none left: the cheapest again


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


CHEAT = Identity.from_seed(b"\x41" * 32)  # the audited peer: it signs what it answered
MODEL, RECIPE = "1" * 64, "2" * 64
PEER_OUT, REPLAY_OUT = "a" * 64, "b" * 64  # what it signed at the step that differs, what both replays gave


def route_steps(prompt: int = 8, decodes: int = 2) -> list[tuple[int, tuple[int, ...], bool]]:
    """A route's steps (position, token ids, decode): a prefill chunk, then one-token decodes."""
    ids = tuple(range(100, 100 + prompt + decodes))
    return [(0, ids[:prompt], False)] + [(prompt + i, (ids[prompt + i],), True) for i in range(decodes)]


def signed_chain(identity: Identity, steps, *, start: int, end: int) -> list[Commitment]:
    """The peer's commitments to ``steps``, each chained to the one before by ``prev``: a
    head signs the tokens' own digests as its inputs, a later hop whatever it was given."""
    out, prev = [], GENESIS
    for i, (position, ids, decode) in enumerate(steps):
        given = tokens_digest(position, ids) if start == 0 else hashlib.sha256(b"hidden %d" % i).digest()
        answered = bytes.fromhex(PEER_OUT) if i == len(steps) - 1 else hashlib.sha256(b"output %d" % i).digest()
        c = Commitment(str(identity.peer_id), "s-1", MODEL, RECIPE, start, end, 0, i, position, decode, given,
                       answered, prev).signed_by(identity)
        out.append(c)
        prev = c.link()
    return out


def proof(identity: Identity = CHEAT, *, steps=None, start: int = 0, end: int = 10, **kw) -> FraudProof:
    """A transferable proof against ``identity`` at the last of ``steps`` (route_steps() by default),
    with any field replaced by ``kw`` (the commitments stay as signed)."""
    steps = route_steps() if steps is None else steps
    signed = signed_chain(identity, steps, start=start, end=end)
    fields = dict(peer_id=str(identity.peer_id), model_digest=MODEL, recipe_digest=RECIPE, start=start, end=end,
                  n_layer=30, session_id="s-1", step=len(steps) - 1, position=steps[-1][0], peer_output=PEER_OUT,
                  replay_output=REPLAY_OUT, replayers=("r1", "r2"), sampling=SamplingParams(0.7, 40, 0.9, 3),
                  max_tokens=64, tokens=tuple(t for _, ids, _ in steps for t in ids),
                  chain=tuple(ChainLink.of(c) for c in signed[:-1]), commitment=signed[-1],
                  cuts=(0, 4) if start > 0 else ())
    return FraudProof(**{**fields, **kw})


@pytest.mark.parametrize("kw", [dict(), dict(start=10, end=20), dict(start=10, end=20, cuts=()),
                                dict(steps=route_steps(5, 0))], ids=["head", "later hop", "no cuts", "one step"])
def test_a_real_proof_is_transferable_and_round_trips_through_its_content_and_msgpack(kw):
    p = proof(**kw)
    assert p.transferable() is None
    assert FraudProof.from_content(p.to_content()) == p
    assert FraudProof.from_content(msgpack.unpackb(canonical(p.to_content()))) == p  # a record's encoding
    assert [c.index for c in p.commitments()] == list(range(p.step + 1)) and p.commitments()[-1] == p.commitment
    assert p.steps() == kw.get("steps", route_steps())


def test_a_later_hops_inputs_are_checked_by_replay_not_by_the_proof():
    middle = proof(start=10, end=20, tokens=tuple(range(200, 210)))  # its signed inputs are hidden states
    assert middle.transferable() is None  # the tokens through the layers before it (recheck.py) decide


def altered(chain: tuple[ChainLink, ...], i: int, **change) -> tuple[ChainLink, ...]:
    return tuple(dataclasses.replace(x, **change) if j == i else x for j, x in enumerate(chain))


def relinked(p: FraudProof, i: int, **change) -> FraudProof:
    return dataclasses.replace(p, chain=altered(p.chain, i, **change))


def shifted(steps, by: int):
    return [(position + by, ids, decode) for position, ids, decode in steps]


def forged(p: FraudProof, signature: bytes) -> FraudProof:
    return dataclasses.replace(p, commitment=dataclasses.replace(p.commitment, signature=signature))


OTHER = Identity.from_seed(b"\x42" * 32)
NOT_TRANSFERABLE = {
    "no signed commitment": (lambda: proof(commitment=None), "lacks"),
    "no chain before the step": (lambda: proof(chain=()), "lacks"),
    "a link's output altered": (lambda: relinked(proof(), 0, output_digest=bytes(32)), "does not chain"),
    "a link's input altered": (lambda: relinked(proof(), 1, input_digest=bytes(32)), "does not chain"),
    "a link's position altered": (lambda: relinked(proof(), 1, position=7), "does not chain"),
    "a link's decode flag altered": (lambda: relinked(proof(), 0, decode=True), "does not chain"),
    "a link's epoch altered": (lambda: relinked(proof(), 1, route_epoch=1), "does not chain"),
    "the head's tokens are not what it signed": (lambda: proof(tokens=(100, 101, 102, 103, 104, 105, 106, 107, 108, 999)),
                                                 "head's signed input at position 9"),
    "the head's prompt is not what it signed": (lambda: proof(tokens=(0,) + tuple(range(101, 110))),
                                                "head's signed input at position 0"),
    "a session that does not start at 0": (lambda: proof(steps=shifted(route_steps(), 1), start=10, end=20,
                                                         tokens=tuple(range(11))), "position 0"),
    "tokens that end before the step": (lambda: proof(tokens=tuple(range(100, 109))), "do not fit"),
    "tokens that run past the step": (lambda: proof(tokens=tuple(range(100, 111))), "do not fit"),
    "a decode step of two tokens": (lambda: proof(steps=[(0, (1, 2, 3), False), (3, (4, 5), True), (5, (6,), True)]),
                                    "position 3 do not fit"),
    "a forged signature": (lambda: forged(proof(), bytes(64)), "signature"),
    "another peer's signature": (lambda: forged(proof(), OTHER.sign(proof().commitment.link())), "signature"),
    "an unsigned commitment": (lambda: forged(proof(), b""), "signature"),
    "a peer output it did not sign": (lambda: proof(peer_output="c" * 64), "signature"),
    "a session too short for its steps": (lambda: proof(max_tokens=9), "reserved 9 positions"),
}


@pytest.mark.parametrize("case", NOT_TRANSFERABLE)
def test_a_proof_anyone_could_not_check_says_why_not(case):
    make, why = NOT_TRANSFERABLE[case]
    p = make()
    assert why in (p.transferable() or "")
    assert FraudProof.from_content(p.to_content()) == p  # still well formed: it tells the client that made it
    if why in ("lacks", "does not chain", "position 0") or "fit" in why:
        with pytest.raises(FraudProofError):  # nor are the steps a re-checker replays built from it
            p.steps()


def test_the_signed_commitment_must_be_the_audited_peers_for_that_session_span_and_step():
    c = proof().commitment
    for wrong in (dict(index=3), dict(session_id="s-2"), dict(start=10), dict(position=8),
                  dict(peer_id=str(OTHER.peer_id)), dict(model_digest="3" * 64)):
        with pytest.raises(FraudProofError, match="commitment"):
            proof(commitment=dataclasses.replace(c, **wrong))


def test_a_proof_at_its_bounds_is_transferable_and_past_them_is_refused():
    longest = proof(steps=route_steps(8, MAX_PROOF_STEPS - 1), max_tokens=MAX_PROOF_TOKENS)  # MAX_PROOF_STEPS - 1 links
    assert len(longest.chain) == MAX_PROOF_STEPS - 1 and longest.transferable() is None
    with pytest.raises(FraudProofError, match="chain"):
        proof(steps=route_steps(8, MAX_PROOF_STEPS))
    widest = proof(steps=route_steps(MAX_PROOF_TOKENS - 2, 2), max_tokens=MAX_PROOF_TOKENS)
    assert len(widest.tokens) == MAX_PROOF_TOKENS and widest.transferable() is None
    with pytest.raises(FraudProofError, match="token"):
        proof(steps=route_steps(MAX_PROOF_TOKENS - 1, 2))
    content = widest.to_content()
    content["tokens"].append(1)
    with pytest.raises(FraudProofError, match="tokens"):
        FraudProof.from_content(content)
    content = longest.to_content()
    content["chain"].append(content["chain"][-1])
    with pytest.raises(FraudProofError, match="chain"):
        FraudProof.from_content(content)
    assert proof(replayers=tuple(f"r{i}" for i in range(MAX_REPLAYERS))).transferable() is None
    assert proof(start=20, end=30, cuts=tuple(range(MAX_CUTS))).transferable() is None


@pytest.mark.parametrize("bad", [
    dict(peer_output=REPLAY_OUT),  # outputs that agree prove nothing
    dict(replayers=()), dict(replayers=(str(CHEAT.peer_id),)), dict(replayers=("r1", "")),
    dict(replayers=tuple(f"r{i}" for i in range(MAX_REPLAYERS + 1))),
    dict(model_digest="xyz"), dict(replay_output="B" * 64), dict(session_id="a b"), dict(n_layer=9),
    dict(tokens=(1 << 32,)), dict(tokens=(-1,)), dict(max_tokens=-1),
    dict(chain=proof().chain[:1]),  # a chain, but not of every step before the one that differs
    dict(chain=altered(proof().chain, 0, output_digest=b"x")), dict(chain=altered(proof().chain, 1, input_digest="ab")),
    dict(chain=altered(proof().chain, 0, decode=1)), dict(chain=altered(proof().chain, 1, position=-1)),
    dict(cuts=(0,)),  # a head has no hops before it
    dict(start=10, end=20, cuts=(4, 8)),  # not from 0
    dict(start=10, end=20, cuts=(0, 8, 4)),  # not ascending
    dict(start=10, end=20, cuts=(0, 4, 4)),  # a hop of no layers
    dict(start=10, end=20, cuts=(0, 10)),  # reaching the peer's own first layer
    dict(start=10, end=20, cuts=tuple(range(MAX_CUTS + 1))),
])
def test_a_fraud_proof_out_of_bounds_is_refused(bad):
    with pytest.raises(FraudProofError):
        proof(**bad)


@pytest.mark.parametrize("mutate", [
    lambda c: c.update(type="meshnet/fraud-proof/v1"), lambda c: c.pop("session"), lambda c: c.pop("chain"),
    lambda c: c.update(step=True), lambda c: c.update(layers=[0]), lambda c: c.update(replayers="r1"),
    lambda c: c["sampling"].update(top_k=2**64),  # parsed, it would not pack into a report again
    lambda c: c.update(peer_id="p" * 129), lambda c: c["sampling"].update(top_p=2.0),
    lambda c: c.update(tokens="abc"), lambda c: c["tokens"].__setitem__(0, 1.0), lambda c: c.update(cuts=[0.0]),
    lambda c: c.update(cuts="0"), lambda c: c.update(chain={}), lambda c: c["chain"].__setitem__(0, [0, 0, False]),
    lambda c: c["chain"][0].__setitem__(3, "ab" * 32),  # a digest as hex, not bytes
    lambda c: c["chain"][0].__setitem__(4, bytes(31)), lambda c: c["chain"][1].__setitem__(2, 1),
    lambda c: c["chain"][1].__setitem__(1, -1), lambda c: c["chain"][1].__setitem__(0, True),
    lambda c: c["commitment"].update(signature="not bytes"), lambda c: c["commitment"].pop("prev"),
    lambda c: c["commitment"].update(extra=1), lambda c: c.update(commitment=[]),
])
def test_fraud_proof_content_from_anyone_is_checked(mutate):
    c = proof().to_content()
    mutate(c)
    with pytest.raises(FraudProofError):
        FraudProof.from_content(c)


_values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=140),
                    st.binary(max_size=70), st.sampled_from(["1" * 64, "2" * 64, "a" * 64, "cheat", "r1", "s-1",
                                                             FRAUD_PROOF, 0, 1, 9, 10, 2**31, 2**64, -1, bytes(32),
                                                             bytes(64), b"", str(CHEAT.peer_id)]))
_any = st.recursive(_values, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                    st.dictionaries(st.text(max_size=12), kids, max_size=4)),
                    max_leaves=12)
VALID = {"head": proof().to_content(), "middle": proof(start=10, end=20).to_content()}


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(0, 4), st.sampled_from(sorted(VALID)))
@example(None, -1, "head")
def test_fraud_proof_content_of_any_shape_parses_or_raises_fraud_proof_error(data, edits, which):
    """Valid content (a head's or a later hop's) with up to four structural edits, or
    anything at all: a proof that is well formed (it round-trips, through msgpack too,
    and says whether it is transferable), or FraudProofError, never another exception."""
    if edits < 0:  # a number no float holds, where a float is read
        content = copy.deepcopy(VALID[which])
        content["sampling"]["temperature"] = 10**400
    elif edits == 4:
        content = data.draw(_any, label="content")
    else:
        content = mutate_tree(data, VALID[which], edits + 1, _any)
    try:
        p = FraudProof.from_content(content)
    except FraudProofError:
        return
    assert FraudProof.from_content(p.to_content()) == p
    assert FraudProof.from_content(msgpack.unpackb(canonical(p.to_content()))) == p
    why = p.transferable()
    assert why is None or isinstance(why, str)


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
    nets = net.get("networks", {})  # peer -> the network it answered from (default: its own)
    return lambda: [Span(p, 10, 20, 100.0 - i, record=record, network=nets.get(p)) for i, p in enumerate(net["spans"])]


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


def test_no_replayer_shares_a_network_with_the_peer_and_the_second_none_with_the_first(net):
    """Issue 59, the Sybil pair: two identities of one network replayed each other (a Sybil
    vouched) and agreed against an honest peer (convicted). Many identities of one network
    are one witness: the first replay is from another network than the peer's, the second
    from another than both."""
    net["spans"] = ["r1", "r2", "r3", "r4"]
    net["networks"] = {"r1": "sybils", "r2": "sybils", "r3": "home", "r4": "office"}
    net["liars"].update({"r1", "r2"})
    honest = audit(net, dataclasses.replace(transcript("p", lie=False), network="elsewhere"))
    # r1 (cheapest) differs; r2 is r1's network: the second opinion is r3's, which agrees with the peer
    assert (honest.verdict, honest.replayers, honest.suspect) == (Verdict.UNDECIDED, (("r1",), ("r3",)), ("r1",))
    sybil = audit(net, dataclasses.replace(transcript("r2", lie=True), network="sybils"))
    assert sybil.replayers[0] == ("r3",)  # its twin r1 never replays it
    assert sybil.verdict is Verdict.MISMATCH and sybil.replayers == (("r3",), ("r4",))


def test_two_replays_convict_only_when_one_ran_on_peers_verified_here(net):
    """An attacker with two networks can still agree with itself: a conviction needs a witness
    this node holds a record of (a certifier's vouch, or its own audits)."""
    t = transcript("p", lie=True)
    r = audit(net, t, verified=lambda peer: False)
    assert r.verdict is Verdict.UNDECIDED and r.proof is None and "verified record" in r.detail
    assert r.suspect == ()  # nobody blamed, the replayers neither
    assert audit(net, t, verified=lambda peer: peer == "r2").verdict is Verdict.MISMATCH


def test_excluded_peers_and_the_peer_itself_never_replay(net):
    r = audit(net, transcript("r1", lie=False), exclude={"r2"})
    assert r.replayers == (("r3",),)
    net["spans"] = ["r1", "r2"]
    assert audit(net, transcript("r1", lie=False), exclude={"r2"}).verdict is Verdict.NO_REPLAYER
