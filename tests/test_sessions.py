"""Many sessions on one engine: isolation, admission, typed refusals, rollback, cancel."""

import threading

import numpy as np
import pytest

from meshnet_p2p.engine.contract import (
    HIDDEN,
    DecodeRequest,
    OpenRequest,
    PrefillRequest,
    SamplingParams,
    StatusCode,
    Tensor,
    TensorBundle,
)
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.route.local import LocalRoute

PROMPTS = ["Once upon a time", "The three primary colors are", "import numpy as np\n", "Bonjour, je m'appelle"]


@pytest.fixture(scope="module")
def prompts(model_path):
    tok = Tokenizer(model_path)
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture
def chain(shard_dir, load_engine):
    return [load_engine(shard_dir[r]) for r in [(0, 10), (10, 20), (20, 30)]]


def test_interleaved_sessions_equal_serial_runs(chain, prompts):
    n_new = 12
    serial = [LocalRoute(chain).generate(p, n_new, stop_at_eog=False).token_ids for p in prompts]

    sids = [f"s{i}" for i in range(len(prompts))]
    for sid, p in zip(sids, prompts, strict=True):
        for e in chain:
            assert e.open_session(OpenRequest(sid, len(p) + n_new)).ok
    out = {sid: [] for sid in sids}
    pos = {}
    # prefill every session, then decode them round-robin, one step each
    for sid, p in zip(sids, prompts, strict=True):
        r = LocalRoute(chain).step(sid, 0, p)
        out[sid].append(r.token.token_id)
        pos[sid] = len(p)
    for _ in range(n_new - 1):
        for sid in sids:
            r = LocalRoute(chain).step(sid, pos[sid], out[sid][-1:], decode=True)
            out[sid].append(r.token.token_id)
            pos[sid] += 1
    assert [out[s] for s in sids] == serial
    assert len({tuple(s) for s in serial}) == len(serial)  # the prompts really differ


def test_admission_is_bounded_by_sessions_and_kv_budget(shard_dir, load_engine):
    e = load_engine(shard_dir[(10, 20)], max_sessions=2, n_ctx_per_session=256, kv_token_budget=300)
    assert e.open_session(OpenRequest("a", 200)).ok
    refused = e.open_session(OpenRequest("b", 200))
    assert refused.code is StatusCode.CAPACITY_EXHAUSTED and "KV" in refused.message
    assert e.open_session(OpenRequest("b", 100)).ok
    full = e.open_session(OpenRequest("c", 1))
    assert full.code is StatusCode.CAPACITY_EXHAUSTED and "slots" in full.message
    too_long = e.open_session(OpenRequest("c", 257))
    assert too_long.code is StatusCode.CAPACITY_EXHAUSTED
    assert e.open_session(OpenRequest("a", 10)).code is StatusCode.SESSION_EXISTS
    assert e.release("a").ok
    assert e.open_session(OpenRequest("c", 200)).ok  # released capacity is reusable at once
    assert e.metrics().refused == 4


def _hidden(rows: int, n_embd: int = 576, dtype: str = "f32", value: float = 0.5) -> TensorBundle:
    data = np.full((rows, n_embd), value, dtype=np.float32).tobytes() if dtype == "f32" else b"\0" * rows * n_embd * 2
    return TensorBundle((Tensor(HIDDEN, dtype, (rows, n_embd), data),))


def test_bad_input_gets_typed_errors_and_other_sessions_keep_going(chain, prompts):
    head, middle, tail = chain
    good = "good"
    for e in chain:
        assert e.open_session(OpenRequest(good, 64)).ok
        assert e.open_session(OpenRequest("bad", 64)).ok
    p = tuple(prompts[0])
    first = LocalRoute(chain).step(good, 0, p)

    def code(result):
        return result.status.code

    # unknown and released sessions
    assert code(head.prefill(PrefillRequest("nobody", 0, token_ids=(1,)))) is StatusCode.UNKNOWN_SESSION
    assert head.release("bad").ok and head.release("bad").ok  # release is idempotent
    assert code(head.prefill(PrefillRequest("bad", 0, token_ids=(1,)))) is StatusCode.UNKNOWN_SESSION
    # a position gap, and an overlap
    assert code(middle.prefill(PrefillRequest("bad", 5, hidden=_hidden(1)))) is StatusCode.POSITION_MISMATCH
    assert code(middle.prefill(PrefillRequest(good, 0, hidden=_hidden(1)))) is StatusCode.POSITION_MISMATCH
    # hidden states of the wrong shape, dtype, size, name or value
    assert code(middle.prefill(PrefillRequest("bad", 0, hidden=_hidden(2, n_embd=100)))) is StatusCode.BAD_TENSOR
    assert code(middle.prefill(PrefillRequest("bad", 0, hidden=_hidden(2, dtype="f16")))) is StatusCode.BAD_TENSOR
    short = TensorBundle((Tensor(HIDDEN, "f32", (2, 576), b"\0" * 100),))
    assert code(middle.prefill(PrefillRequest("bad", 0, hidden=short))) is StatusCode.BAD_TENSOR
    wrong_name = TensorBundle((Tensor("x", "f32", (1, 576), b"\0" * 2304),))
    assert code(middle.prefill(PrefillRequest("bad", 0, hidden=wrong_name))) is StatusCode.BAD_TENSOR
    assert code(middle.prefill(PrefillRequest("bad", 0, hidden=_hidden(1, value=np.nan)))) is StatusCode.BAD_TENSOR
    # the wrong kind of input for the shard, and tokens outside the vocabulary
    assert code(middle.prefill(PrefillRequest("bad", 0, token_ids=(1, 2)))) is StatusCode.WRONG_INPUT
    assert code(head.prefill(PrefillRequest(good, len(p), hidden=_hidden(1)))) is StatusCode.WRONG_INPUT
    assert code(head.decode(DecodeRequest(good, len(p), token_id=10**6))) is StatusCode.INVALID_ARGUMENT
    # beyond the tokens the session reserved
    assert code(middle.prefill(PrefillRequest("bad", 0, hidden=_hidden(65)))) is StatusCode.CONTEXT_EXHAUSTED

    # ...and the good session continues exactly where it was
    tok = first.token.token_id
    after = LocalRoute(chain).step(good, len(p), (tok,), decode=True)
    solo = LocalRoute(chain).generate(list(p), 2, stop_at_eog=False).token_ids
    assert [tok, after.token.token_id] == solo


def test_rollback_and_replay_reproduce_the_same_tokens(chain, prompts):
    p = prompts[1]
    route = LocalRoute(chain)
    expected = route.generate(p, 8, stop_at_eog=False).token_ids
    sid = "replay"
    for e in chain:
        assert e.open_session(OpenRequest(sid, 64)).ok
    route = LocalRoute(chain)
    out = [route.step(sid, 0, p).token.token_id]
    for i in range(4):
        out.append(route.step(sid, len(p) + i, out[-1:], decode=True).token.token_id)
    # forget the last three positions everywhere, then replay them
    keep = len(p) + 1
    for e in chain:
        assert e.rollback(sid, keep).ok
        assert e.session_position(sid) == keep
    assert chain[0].rollback(sid, keep + 5).code is StatusCode.POSITION_MISMATCH
    out = out[:2]
    for i in range(1, 7):
        out.append(route.step(sid, len(p) + i, out[-1:], decode=True).token.token_id)
    assert out == expected


def test_cancel_mid_prefill_frees_capacity_and_spares_other_sessions(shard_dir, load_engine, prompts):
    head = load_engine(shard_dir[(0, 15)], max_sessions=2, n_ctx_per_session=2048, n_ubatch=8)
    tail = load_engine(shard_dir[(15, 30)], max_sessions=2, n_ctx_per_session=2048, n_ubatch=8)
    long_prompt = tuple((prompts[0] * 200)[:1500])
    expected = LocalRoute([head, tail]).generate(prompts[2], 6, stop_at_eog=False).token_ids
    for e in (head, tail):
        assert e.open_session(OpenRequest("victim", 2048)).ok
    started = threading.Event()
    result = {}

    def run():
        started.set()
        result["r"] = head.prefill(PrefillRequest("victim", 0, token_ids=long_prompt))

    t = threading.Thread(target=run)
    t.start()
    started.wait()
    # Wait (bounded) until the step is really inside llama_decode, then cancel it.
    for _ in range(10_000_000):
        if head._running == "victim":
            break
    assert head._running == "victim", "the prefill never started"
    assert head.cancel("victim").ok
    t.join(timeout=60)
    assert not t.is_alive()
    assert result["r"].status.code is StatusCode.CANCELLED
    assert head.prefill(PrefillRequest("victim", 0, token_ids=(1,))).status.code is StatusCode.CANCELLED
    assert head.release("victim").ok and tail.release("victim").ok
    assert head.metrics().active_sessions == 0
    # the freed slot and its whole KV reservation are usable at once...
    for e in (head, tail):
        assert e.open_session(OpenRequest("x", 2048)).ok
    # ...and the engine still computes exactly what it computed before the cancel
    assert LocalRoute([head, tail]).generate(prompts[2], 6, stop_at_eog=False).token_ids == expected


def test_seeded_sampling_is_reproducible_and_differs_by_seed(chain, prompts):
    route = LocalRoute(chain)
    p = prompts[0]
    a = route.generate(p, 16, SamplingParams(temperature=0.9, top_p=0.95, seed=7), stop_at_eog=False).token_ids
    b = route.generate(p, 16, SamplingParams(temperature=0.9, top_p=0.95, seed=7), stop_at_eog=False).token_ids
    c = route.generate(p, 16, SamplingParams(temperature=0.9, top_p=0.95, seed=8), stop_at_eog=False).token_ids
    assert a == b
    assert a != c


def test_engine_reports_health_and_metrics(chain, prompts):
    route = LocalRoute(chain)
    route.generate(prompts[0], 4, stop_at_eog=False)
    h = chain[1].health()
    assert h.serving and h.state == "serving" and h.active_sessions == 0
    m = chain[2].metrics()
    assert m.steps == 4 and m.tokens_sampled == 4
    caps = chain[1].capabilities()
    assert (caps.start, caps.end, caps.role, caps.n_vocab) == (10, 20, "middle", 0)


def test_llama_decode_always_runs_on_the_engines_own_thread(shard_dir, load_engine, monkeypatch):
    """With OpenMP, llama.cpp keeps a thread team per calling thread; steps
    arriving from many handler threads must still reach llama_decode from one."""
    import llama_cpp

    callers = []
    real = llama_cpp.llama_decode

    def recording(ctx, batch):
        callers.append(threading.get_ident())
        return real(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", recording)
    e = load_engine(shard_dir[(10, 20)], n_threads=2)
    n_embd = e.capabilities().n_embd
    rows = TensorBundle((Tensor(HIDDEN, "f32", (1, n_embd), np.full((1, n_embd), 0.01, np.float32).tobytes()),))
    step_threads = []

    def run(sid: str) -> None:
        step_threads.append(threading.get_ident())
        assert e.open_session(OpenRequest(sid, 8)).ok
        for pos in range(3):
            e.decode(DecodeRequest(sid, pos, hidden=rows)).status.raise_for_status()

    for sid in ("a", "b", "c"):
        t = threading.Thread(target=run, args=(sid,))
        t.start()
        t.join()
    assert len(callers) == 9
    assert len(set(callers)) == 1
    assert callers[0] not in step_threads
    e.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("llama-compute")]
