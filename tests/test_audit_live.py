"""Audits by exact replay on a real swarm of processes: a certified recipe whose
middle span has three honest peers and one that perturbs its hidden states
(one bit of one float, on decode steps only: its route's tokens do not change)."""

import json
import os
import sys

import msgpack
import pytest

import trio

from meshnet_p2p.client import Client
from meshnet_p2p.verify.recheck import recheck_proof
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.roles.audit import generate_and_audit
from meshnet_p2p.trust.fraud_proof import FraudProof
from tests.reference import reference_generate
from tests.swarm import Proc, meshnet_peer, own_address, start_swarm

# `meshnet-peer join` whose engine flips the lowest bit of the first float of every
# hidden state a decode step gives out: a real shard behind the real data plane
# and a validly signed report of the certified recipe, computing something else.
# (Proc runs `python -m meshnet_p2p ARGS` after its prefix: argv[4:] are ARGS.)
PERTURBING_JOIN = """
import dataclasses, sys
from meshnet_p2p.engine.contract import TensorBundle
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.roles import cli, join

class Perturbing(LlamaCppShardEngine):
    def decode(self, request):
        result = super().decode(request)
        if result.hidden is None:
            return result
        t, *rest = result.hidden.tensors
        t = dataclasses.replace(t, data=bytes([t.data[0] ^ 1]) + t.data[1:])
        return dataclasses.replace(result, hidden=TensorBundle((t, *rest)))

join.LlamaCppShardEngine = Perturbing
raise SystemExit(cli.main(sys.argv[4:]))
"""
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("audit")
    boot, addr, joins = start_swarm(tmp, ["0:10", "10:20", "20:30", "10:20", "10:20", "10:15", "15:20", "20:30"],
                                    spread=True)  # each peer a network of its own: independent witnesses
    try:
        yield addr, joins, {**os.environ, "MESHNET_CACHE_DIR": str(tmp)}
    finally:
        for p in [*joins, boot]:
            p.stop()


def test_honest_hops_match_exactly(swarm, model_path):
    addr, joins, _ = swarm
    head, middle, tail, other_middles, sub_spans, other_tail = joins[0], joins[1], joins[2], joins[3:5], joins[5:7], joins[7]
    client = Client([addr], model_path=model_path, ring=False)
    try:
        done, result = generate_and_audit(client, middle.peer_id, PROMPT, 6)
        # with a float32 seam, a chain of sub-spans replays the hop exactly too
        _, on_cuts = generate_and_audit(client, middle.peer_id, PROMPT, 6, exclude={p.peer_id for p in other_middles})
        _, at_tail = generate_and_audit(client, tail.peer_id, PROMPT, 6)  # a tail's sampled tokens are replayed too
        _, at_head = generate_and_audit(client, head.peer_id, PROMPT, 6)
    finally:
        client.close()
    assert done["route"][1]["peer_id"] == middle.peer_id
    assert result.verdict.value == "match", result.detail
    assert (result.start, result.end, result.steps) == (10, 20, 6)  # one prefill step, five decode steps
    [replayers] = result.replayers
    assert middle.peer_id not in replayers and result.proof is None
    assert on_cuts.verdict.value == "match" and on_cuts.replayers == (tuple(p.peer_id for p in sub_spans),)
    assert at_tail.verdict.value == "match" and at_tail.replayers == ((other_tail.peer_id,),)
    assert at_head.verdict.value == "no-replayer" and at_head.replayers == ()  # nobody else serves layers 0-9


def test_meshnet_peer_audit_on_an_honest_peer_exits_0_with_a_match(swarm):
    addr, joins, env = swarm
    r = meshnet_peer("audit", "--bootstrap", addr, "--peer", joins[3].peer_id, "--max-tokens", "4", "--json",
                     env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["verdict"], doc["peer"], doc["span"], doc["steps"]) == ("match", joins[3].peer_id, [10, 20], 4)
    assert doc["replayers"] and joins[3].peer_id not in doc["replayers"][0]
    assert doc["route"][1]["peer_id"] == joins[3].peer_id


def test_a_middle_peer_that_perturbs_its_hidden_states_is_proven_to_mismatch(swarm, model_path):
    addr, joins, env = swarm
    cheater = Proc("join", "--layers", "10:20", "--bootstrap", addr, "--threads", "1", "--listen",
                   f"{own_address()}:0", env=env, prefix=(sys.executable, "-c", PERTURBING_JOIN))
    client = Client([addr], model_path=model_path, ring=False)
    try:
        cheater.address()
        done, result = generate_and_audit(client, cheater.peer_id, PROMPT, 6)
        r = meshnet_peer("audit", "--bootstrap", addr, "--peer", cheater.peer_id, "--max-tokens", "3", "--json",
                         env=env, timeout=120)
        # another machine re-checks the report that audit published, by its own replays
        again = meshnet_peer("audit", "--bootstrap", addr, "--peer", cheater.peer_id, "--recheck", "--json",
                             env=env, timeout=120)
    finally:
        client.close()
        cheater.stop()
    assert r.returncode == 3, r.stderr
    assert json.loads(r.stdout)["verdict"] == "mismatch" and json.loads(r.stdout)["published"] > 0
    assert again.returncode == 3, again.stderr
    [report] = json.loads(again.stdout)["reports"]
    assert report["outcome"] == "confirmed" and report["peer"] == cheater.peer_id
    assert done["route"][1]["peer_id"] == cheater.peer_id
    # what the user got is the whole model's: the cheat shows only in the hidden states
    assert done["token_ids"] == reference_generate(model_path, Tokenizer(model_path).encode(PROMPT), 6, n_ubatch=64)[0]
    assert result.verdict.value == "mismatch", result.detail
    assert result.step == 1 and result.position > 0  # the prefill is honest; the first decode step is not
    first, second = result.replayers  # two independent replays: disjoint, neither the cheater
    assert not set(first) & set(second) and cheater.peer_id not in first + second
    proof = result.proof
    assert FraudProof.from_content(msgpack.unpackb(msgpack.packb(proof.to_content()))) == proof  # a record's encoding
    assert proof.signed_by_peer()  # the cheater signed the very output two replays contradict
    assert proof.peer_id == cheater.peer_id and proof.peer_output != proof.replay_output
    assert (proof.start, proof.end, proof.step) == (10, 20, 1)
    # anyone can re-check it: the cheater's signed, linked commitments over the route's tokens
    assert proof.transferable() is None and proof.cuts == (0,) and len(proof.chain) == 1
    assert list(proof.tokens) == Tokenizer(model_path).encode(PROMPT) + done["token_ids"][:1]


def test_a_fraud_proof_travels_through_the_dht_and_a_stranger_convicts_only_on_its_own_replays(swarm, model_path):
    """A client that caught a middle cheater publishes the proof; a stranger fetches it,
    re-checks it by its own replays (layers 0-9 replayed to the cheater's signed inputs,
    then layers 10-19) and only then leaves the cheater out."""
    addr, joins, env = swarm
    cheater = Proc("join", "--layers", "10:20", "--bootstrap", addr, "--threads", "1", "--listen",
                   f"{own_address()}:0", env=env, prefix=(sys.executable, "-c", PERTURBING_JOIN))
    finder = Client([addr], model_path=model_path, ring=False)
    stranger = Client([addr], model_path=model_path, ring=False)
    try:
        cheater.address()
        _, result = generate_and_audit(finder, cheater.peer_id, PROMPT, 4)
        assert result.verdict.value == "mismatch", result.detail
        finder.auditor._apply(result)  # as the finder's own audits do: caught, and a report queued
        found, stored = finder.exchange_reports(finder.auditor._outbox, [cheater.peer_id])
        assert stored > 0
        [report] = found[cheater.peer_id]
        assert str(report.signer) == str(finder.reporter.peer_id)
        assert stranger.records.caught() == {}  # a report alone is hearsay
        checked = stranger.auditor.recheck(report)
    finally:
        finder.close()
        stranger.close()
        cheater.stop()
    assert checked.outcome.value == "confirmed", checked.detail
    assert cheater.peer_id in stranger.records.caught()
    first, second = checked.audit.replayers  # its own two replays, disjoint, neither the cheater
    assert not set(first) & set(second) and cheater.peer_id not in first + second


def test_a_false_fraud_proof_against_an_honest_peer_is_refuted_and_blames_nobody(swarm, model_path):
    """A reporter who says an honest peer's signed output differs from the replays
    (refuted: the stranger's replay gives exactly what the peer signed), or who makes up
    the tokens the peer was given (its signed inputs are not what layers 0-9 compute
    from them), convicts nobody."""
    import dataclasses

    from meshnet_p2p.roles.audit import generate_through
    from meshnet_p2p.trust.fraud_proof import ChainLink

    addr, joins, _ = swarm
    honest = joins[3]
    liar = Client([addr], model_path=model_path, ring=False)
    stranger = Client([addr], model_path=model_path, ring=False)
    try:
        _, t, _, _ = generate_through(liar, honest.peer_id, PROMPT, 3)
        k = 1
        signed = [s.commitment for s in t.steps]
        end = t.steps[k].position + t.steps[k].rows
        lie = FraudProof(honest.peer_id, t.fingerprint.model_digest, t.fingerprint.recipe_digest, t.start, t.end,
                         t.n_layer, t.session_id, k, t.steps[k].position, signed[k].output_digest.hex(), "f" * 64,
                         (joins[4].peer_id,), t.sampling, t.max_tokens, t.tokens[:end],
                         (ChainLink.of(signed[0]),), signed[k], t.cuts)
        assert lie.transferable() is None  # well formed, and signed by the peer: only a replay shows it false
        made_up = dataclasses.replace(lie, tokens=tuple(reversed(lie.tokens)))
        refuted = recheck_proof(lie, stranger._provider(trio.run), stranger._audit_options())
        differ = recheck_proof(made_up, stranger._provider(trio.run), stranger._audit_options())
    finally:
        liar.close()
        stranger.close()
    assert refuted.outcome.value == "refuted", refuted.detail
    assert differ.outcome.value == "inputs-differ", differ.detail
    assert stranger.records.caught() == {}
