"""The cheating peers of tests/cheaters.py, each shown to cheat (issue 26): the
hijacker is what a fresh client routes through today, and the perturbing
peers' hidden states differ from an honest shard's on exactly the steps they
say. Real processes, the real data plane; an honest engine in this process
as the reference."""


import numpy as np
import pytest
import trio

from meshnet_p2p import Client
from meshnet_p2p.dataplane.stub import ShardClient
from meshnet_p2p.engine.contract import HIDDEN, DecodeRequest, OpenRequest, PrefillRequest, Tensor, TensorBundle
from meshnet_p2p.engine.cut import inspect_gguf
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.swarm.capability import MAX_THROUGHPUT
from meshnet_p2p.swarm.view import survey
from meshnet_p2p.trust.policy import TrustPolicy

from tests.cheaters import HIJACK_TEXT, PERTURBATION, perturbs
from tests.conftest import N_UBATCH
from tests.reference import reference_generate
from tests.swarm import Cheater, start_swarm

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def reference(model_path):
    return reference_generate(model_path, Tokenizer(model_path).encode(PROMPT), 16, n_ubatch=64)[0]


@pytest.fixture(scope="module")
def hijacked(tmp_path_factory, model_path):
    """A certified swarm of two honest peers, and the hijacker announced in it."""
    boot, addr, joins = start_swarm(tmp_path_factory.mktemp("hijack"), ["0:15", "15:30"])
    hijacker = None
    try:
        hijacker = Cheater("hijack", "--bootstrap", addr)
        hijacker.address(60)  # it announces before it says so
        yield addr, hijacker, joins
    finally:
        codes = [p.stop() for p in ([hijacker] if hijacker else []) + joins + [boot]]
    assert codes == [0] * len(codes)


def test_the_hijacker_claims_the_whole_model_and_answers_with_its_text(hijacked, model_path):
    addr, hijacker, _ = hijacked
    info = inspect_gguf(model_path)
    view = trio.run(survey, [addr], info.model_digest, info.source_layers, TrustPolicy.default([addr]))
    [recipe] = view.certified()
    [claim] = [s for s in recipe.spans if s.peer_id == hijacker.peer_id]  # in the certified recipe's group
    assert (claim.start, claim.end, claim.throughput) == (0, info.source_layers, MAX_THROUGHPUT)
    evil = Tokenizer(model_path).encode(HIJACK_TEXT)
    client = hijacker.client()
    try:
        cap = client.capability()
        assert (cap.layers.start, cap.layers.end) == (0, info.source_layers)
        with client.session(cap.fingerprint, max_tokens=64) as s:
            prompt = Tokenizer(model_path).encode(PROMPT)
            out = [s.step(0, token_ids=prompt).token_id]
            for pos in range(len(prompt), len(prompt) + len(evil) - 1):
                r = s.step(pos, token_ids=[out[-1]], decode=True)
                assert not r.is_eog
                out.append(r.token_id)
        assert out == evil
    finally:
        client.close()


def test_a_fresh_client_never_returns_the_hijackers_text(hijacked, model_path, reference):
    """The issue's first paragraph, which printed the hijacker's text before verified
    compute: its one-hop claim was the cheapest route, and nothing checked what it
    computed. Now peers a trusted certificate vouches for are preferred, and a route
    through a peer with no record is cross-checked (tests/test_verified_compute.py)."""
    addr, hijacker, joins = hijacked
    events = []
    client = Client([addr], model_path=model_path, step_timeout=5.0, on_event=events.append)
    try:
        result = client.generate(PROMPT, 16, stop_at_eog=False)
    except Exception as e:
        raise AssertionError(f"{e}; events: {events}; records: {client.records.snapshot()}") from e
    assert HIJACK_TEXT[:20] not in result.text, (result.route, events)
    assert result.token_ids == reference


# --- the perturbing peers ---------------------------------------------------------------------------


def hidden(rows: int, seed: int) -> TensorBundle:
    data = (np.random.default_rng(seed).standard_normal((rows, 576)) * 0.1).astype(np.float32).tobytes()
    return TensorBundle((Tensor(HIDDEN, "f32", (rows, 576), data),))


def step_both(cheater: ShardClient, honest, session_id: str, decodes: int, seed: int = 0) -> list[int]:
    """The same steps (a prefill of 5 rows, then single-row decodes) through the
    cheater and the honest engine; the positions where their outputs differ,
    each checked to differ by one float nudged by PERTURBATION."""
    fingerprint = cheater.capability().fingerprint
    honest.open_session(OpenRequest(session_id, 5 + decodes)).raise_for_status()
    differ = []
    try:
        with cheater.session(fingerprint, max_tokens=5 + decodes, session_id=session_id) as s:
            pos = 0
            for rows in [5] + [1] * decodes:
                h = hidden(rows, seed + pos)
                got = s.step(pos, hidden=h, decode=rows == 1)
                kind = DecodeRequest if rows == 1 else PrefillRequest
                want = honest.decode(kind(session_id, pos, hidden=h)) if rows == 1 else honest.prefill(
                    kind(session_id, pos, hidden=h))
                want.status.raise_for_status()
                pos += rows
                assert got.position == want.position == pos
                a = np.frombuffer(got.hidden.get(HIDDEN).data, np.float32)
                b = np.frombuffer(want.hidden.get(HIDDEN).data, np.float32)
                if a.tobytes() != b.tobytes():
                    [at] = np.flatnonzero(a != b)  # one float, nudged slightly
                    assert a[at] - b[at] == pytest.approx(PERTURBATION, rel=1e-2)
                    differ.append(pos)
    finally:
        honest.release(session_id)
    return differ


@pytest.fixture
def honest_middle(shard_dir, load_engine):
    return load_engine(shard_dir[(10, 20)])


def start_cheater(mode: str, shard: str, *args: str) -> Cheater:
    return Cheater(mode, "--shard", shard, "--n-ubatch", str(N_UBATCH), "--threads", "2", *args)


def test_the_perturbing_peer_nudges_the_steps_it_picks_and_no_others(shard_dir, honest_middle):
    cheater = start_cheater("perturb", shard_dir[(10, 20)], "--rate", "0.25", "--seed", "7")
    client = cheater.client()
    try:
        sid = "perturbed-1"
        differ = step_both(client, honest_middle, sid, decodes=40)
        expected = [p for p in [5] + list(range(6, 46)) if perturbs(7, sid, p, 0.25)]
        assert differ == expected and 3 <= len(differ) <= 20  # some steps, not all: the rate's, exactly
    finally:
        client.close()
        assert cheater.stop() == 0


def test_the_perturbing_rate_is_the_configured_fraction_of_steps():
    for rate in (0.01, 0.25):
        hits = sum(perturbs(0, f"s{i // 100}", i % 100, rate) for i in range(20_000))
        assert abs(hits / 20_000 - rate) < 4 * (rate * (1 - rate) / 20_000) ** 0.5
    assert not any(perturbs(3, "s", p, 0.0) for p in range(1000))
    assert all(perturbs(3, "s", p, 1.0) for p in range(1000))


def test_the_late_cheater_is_honest_for_its_first_sessions_then_perturbs_every_step(shard_dir, honest_middle):
    cheater = start_cheater("late", shard_dir[(10, 20)], "--honest-sessions", "2")
    client = cheater.client()
    try:
        assert step_both(client, honest_middle, "late-1", decodes=6) == []
        assert step_both(client, honest_middle, "late-2", decodes=6, seed=1) == []
        assert step_both(client, honest_middle, "late-3", decodes=6, seed=2) == [5, 6, 7, 8, 9, 10, 11]
    finally:
        client.close()
        assert cheater.stop() == 0
