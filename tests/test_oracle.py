"""A certifier's own replay (verify/oracle.py) on real llama.cpp engines: a hop's
transcript, made by stepping two real shards as a route does, is replayed on this
machine's copy of the whole model, exactly; a changed output is a mismatch the
certifier's own replay alone decides; another recipe or model is not its to judge."""

from __future__ import annotations

import dataclasses
import uuid
from types import SimpleNamespace

import pytest

from meshnet_p2p.dataplane.wire import Fingerprint
from meshnet_p2p.engine.contract import DecodeRequest, LoadRequest, OpenRequest, PrefillRequest, SamplingParams
from meshnet_p2p.engine.cut import inspect_gguf
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.engine.models import ensure_shard
from meshnet_p2p.verify.oracle import LocalOracle
from meshnet_p2p.verify.replay import Verdict, audit_hop
from meshnet_p2p.verify.transcript import HopTranscript, StepRecord

CUT = 10


@pytest.fixture(scope="module")
def hop(model_path, tmp_path_factory, monkeypatch_module):
    """The transcript of the hop over layers CUT..end of a two-shard route that generated 4
    tokens greedily: what a client keeps of a peer's session."""
    monkeypatch_module.setenv("MESHNET_CACHE_DIR", str(tmp_path_factory.mktemp("oracle-cache")))
    info = inspect_gguf(model_path)
    engines = []
    try:
        for start, end in ((0, CUT), (CUT, info.source_layers)):
            e = LlamaCppShardEngine()
            e.load(LoadRequest(ensure_shard(model_path, start, end, info.source_sha256), max_sessions=1,
                               n_threads=1)).status.raise_for_status()
            engines.append(e)
        head, tail = engines
        sid, sampling, max_tokens = uuid.uuid4().hex, SamplingParams(), 16
        for e in engines:
            e.open_session(OpenRequest(sid, max_tokens, sampling)).raise_for_status()
        steps, token, position = [], None, 0
        for i in range(4):
            if i == 0:
                ids = (1, 504, 3458, 282, 4649, 314)
                h = head.prefill(PrefillRequest(sid, 0, token_ids=ids)).hidden
                out = tail.prefill(PrefillRequest(sid, 0, hidden=h))
                rows = len(ids)
            else:
                h = head.decode(DecodeRequest(sid, position, token_id=token)).hidden
                out = tail.decode(DecodeRequest(sid, position, hidden=h))
                rows = 1
            reply = SimpleNamespace(hidden=None, token_id=out.token.token_id, is_eog=out.token.is_eog,
                                    position=out.position)
            steps.append(StepRecord(position, h, i > 0, reply))
            token, position = out.token.token_id, position + rows
        caps = tail.capabilities()
        fp = Fingerprint(caps.model_digest, caps.recipe_digest, {k: str(v) for k, v in caps.recipe.items()})
        yield model_path, info, HopTranscript("12D3KooWTail", CUT, info.source_layers, info.source_layers, fp, 64, sampling,
                                  max_tokens, sid, tuple(steps))
    finally:
        for e in engines:
            e.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def no_network():
    raise AssertionError("an audit its own replay decides asks no peer")


def test_the_certifiers_own_replay_matches_an_honest_hop_exactly_and_convicts_a_changed_one(hop):
    path, info, t = hop
    oracle = LocalOracle(path, info.model_digest, info.source_sha256, "12D3KooWCertifier")
    try:
        r = audit_hop(t, no_network, None, own_replay=oracle.replay)
        assert r.verdict is Verdict.MATCH and r.replayers == (("12D3KooWCertifier",),), r.detail
        # the peer answered another token at its third step: the certifier's own replay alone convicts
        bad = list(t.steps)
        reply = bad[2].reply
        bad[2] = dataclasses.replace(bad[2], reply=SimpleNamespace(**{**vars(reply), "token_id": reply.token_id + 1}))
        r = audit_hop(dataclasses.replace(t, steps=tuple(bad)), no_network, None, own_replay=oracle.replay)
        assert r.verdict is Verdict.MISMATCH and r.step == 2 and "own replay" in r.detail
        assert r.proof is not None and r.proof.replayers == ("12D3KooWCertifier",)
    finally:
        oracle.close()


def test_another_recipe_or_model_is_not_the_oracles_to_judge(hop):
    path, info, t = hop
    loads = []

    def load(path, request):
        loads.append(request)
        e = LlamaCppShardEngine()
        e.load(request).status.raise_for_status()
        return e

    oracle = LocalOracle(path, info.model_digest, info.source_sha256, "me", load=load)
    try:
        other_recipe = dataclasses.replace(t, fingerprint=dataclasses.replace(t.fingerprint, recipe_digest="0" * 64))
        assert oracle.replay(other_recipe) is None and len(loads) == 1  # loaded, compared, refused
        assert oracle.replay(other_recipe) is None and len(loads) == 1  # remembered: not loaded again
        other_model = dataclasses.replace(t, fingerprint=dataclasses.replace(t.fingerprint, model_digest="f" * 64))
        assert oracle.replay(other_model) is None and len(loads) == 1  # not even loaded
        assert oracle.replay(t) is not None and len(loads) == 2
    finally:
        oracle.close()

