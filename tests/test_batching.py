"""Steps of many sessions share llama_decode calls and still compute exactly
what each session computes alone, on every shard role (issue 13)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from meshnet_p2p.engine.batching import Pass, Waiting, plan_round
from meshnet_p2p.engine.contract import HIDDEN, DecodeRequest, OpenRequest, PrefillRequest, Tensor, TensorBundle
from meshnet_p2p.engine.tokenizer import Tokenizer

from tests.conftest import N_UBATCH

# --- the plan, as data ------------------------------------------------------------------------


def test_single_rows_of_consecutive_sequences_share_a_pass():
    waiting = [Waiting(0, 3, 1), Waiting(1, 0, 1), Waiting(2, 1, 1), Waiting(3, 2, 1), Waiting(4, 5, 1)]
    assert plan_round(waiting, 64) == [Pass(((1, 0, 1), (2, 0, 1), (3, 0, 1), (0, 0, 1))), Pass(((4, 0, 1),))]


def test_a_pass_never_exceeds_the_micro_batch():
    waiting = [Waiting(i, i, 1) for i in range(5)]
    assert [p.rows for p in plan_round(waiting, 2)] == [2, 2, 1]


def test_a_long_step_runs_one_micro_batch_per_round_at_its_own_boundaries():
    waiting = [Waiting(7, 0, 150, done=64), Waiting(9, 1, 40), Waiting(8, 2, 1)]
    # every single row first, then one micro-batch of the oldest multi-row step, from where it stopped
    assert plan_round(waiting, 64) == [Pass(((8, 0, 1),)), Pass(((7, 64, 64),))]
    assert plan_round([Waiting(7, 0, 150, done=128)], 64) == [Pass(((7, 128, 22),))]


def test_two_steps_of_one_sequence_are_refused():
    with pytest.raises(ValueError):
        plan_round([Waiting(0, 1, 1), Waiting(1, 1, 3)], 64)


# --- the engine: batched equals serial --------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once", "The three primary colors are red,",
           "import numpy as np\nimport", "Bonjour"]
DECODES = 6


@pytest.fixture(scope="module")
def prompts(model_path):
    tok = Tokenizer(model_path)
    ids = [tok.encode(p) for p in PROMPTS]
    ids[2] = ids[2][:1]  # a one-token prompt: its prefill is a single row, batched with decodes
    ids[4] = (ids[4] * 40)[: 2 * N_UBATCH + 22]  # longer than two micro-batches: chunked between decodes
    return ids


def _hidden(rows: np.ndarray) -> TensorBundle:
    return TensorBundle((Tensor(HIDDEN, "f32", rows.shape, rows.astype(np.float32).tobytes()),))


def _run(engine, sid: str, position: int, given, decode: bool):
    kw = {"hidden": _hidden(given)} if isinstance(given, np.ndarray) else {}
    if decode:
        r = engine.decode(DecodeRequest(sid, position, token_id=None if kw else given[0], **kw))
    else:
        r = engine.prefill(PrefillRequest(sid, position, token_ids=None if kw else tuple(given), **kw))
    r.status.raise_for_status()
    return r


def _output(r):
    if r.token is not None:
        return r.token.token_id
    return np.frombuffer(r.hidden.tensors[0].data, np.float32).reshape(r.hidden.tensors[0].shape).copy()


@pytest.fixture(scope="module")
def serial(shard_dir, prompts):
    """Each session alone through a 3-shard chain: every hop's inputs and outputs, step by step."""
    from meshnet_p2p.engine.contract import LoadRequest
    from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine

    engines = []
    for r in [(0, 10), (10, 20), (20, 30)]:
        e = LlamaCppShardEngine()
        e.load(LoadRequest(shard_dir[r], n_ubatch=N_UBATCH, n_threads=2, max_sessions=8, n_ctx_per_session=512)).status.raise_for_status()
        e.keep_logits = True
        engines.append(e)
    steps: dict[int, list] = {}  # session -> [(position, decode, [input per hop], [output per hop], tail logits)]
    try:
        for i, ids in enumerate(prompts):
            sid = f"s{i}"
            for e in engines:
                assert e.open_session(OpenRequest(sid, 256)).ok
            feed, position, decode, out = list(ids), 0, False, []
            for _ in range(1 + DECODES):
                given, ins, outs = feed, [], []
                for e in engines:
                    ins.append(given)
                    given = _output(_run(e, sid, position, given, decode))
                    outs.append(given)
                out.append((position, decode, ins, outs, engines[-1].last_logits[sid].copy()))
                position += len(feed)
                feed, decode = [outs[-1]], True
            steps[i] = out
            for e in engines:
                assert e.release(sid).ok
    finally:
        for e in engines:
            e.close()
    return steps


@pytest.mark.parametrize("role", [0, 1, 2], ids=["head", "middle", "tail"])
def test_batched_steps_equal_serial_steps_on_every_role(role, shard_dir, load_engine, serial):
    span = [(0, 10), (10, 20), (20, 30)][role]
    engine = load_engine(shard_dir[span], max_sessions=8, n_ctx_per_session=512)
    engine.keep_logits = True
    sessions = list(serial)
    for i in sessions:
        assert engine.open_session(OpenRequest(f"s{i}", 256)).ok
    with ThreadPoolExecutor(len(sessions)) as pool:
        for k in range(1 + DECODES):
            # Hold the compute thread back until every session's k-th step waits, so they
            # meet in one round: a long prefill's micro-batches among everyone's single rows.
            with engine._step_lock:
                futures = {i: pool.submit(_run, engine, f"s{i}", serial[i][k][0], serial[i][k][2][role], serial[i][k][1])
                           for i in sessions}
                with engine._wake:
                    assert engine._wake.wait_for(lambda: len(engine._work) == len(sessions), timeout=60)
            for i, f in futures.items():
                position, decode, ins, outs, logits = serial[i][k]
                got = _output(f.result(timeout=60))
                if role == 2:
                    assert got == outs[role], (i, k)
                    assert engine.last_logits[f"s{i}"].tobytes() == logits.tobytes(), (i, k)  # bit-identical
                else:
                    assert got.tobytes() == outs[role].tobytes(), (i, k)
    m = engine.metrics()
    assert m.shared_passes >= DECODES, "steps never shared a llama_decode: nothing was tested"
    assert m.steps == len(sessions) * (1 + DECODES)


def test_a_step_cancelled_while_it_waits_for_a_batch_ends_alone(shard_dir, load_engine, prompts):
    """Cancelling one session's waiting step spares the steps it would have shared a pass with."""
    engine = load_engine(shard_dir[(0, 10)], max_sessions=4)
    for sid in ("a", "b"):
        assert engine.open_session(OpenRequest(sid, 64)).ok
    results = {}

    def step(sid):
        results[sid] = engine.prefill(PrefillRequest(sid, 0, token_ids=(prompts[0][0],)))

    with engine._step_lock:
        threads = [threading.Thread(target=step, args=(sid,)) for sid in ("a", "b")]
        for t in threads:
            t.start()
        with engine._wake:
            assert engine._wake.wait_for(lambda: len(engine._work) == 2, timeout=60)
        assert engine.cancel("a", keep_session=True).ok
    for t in threads:
        t.join(timeout=60)
    assert results["a"].status.code.name == "CANCELLED"
    assert results["b"].status.ok
    assert engine.session_position("a") == 0 and engine.session_position("b") == 1
    # the cancelled session goes on from where it was
    assert engine.prefill(PrefillRequest("a", 0, token_ids=(prompts[0][0],))).status.ok


class _GatedLock:
    """A lock one named thread must be let through (review finding: a cancel
    that waits for the step lock while the session is released and its
    sequence id reused)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.gates: dict[str, threading.Event] = {}

    def __enter__(self):
        gate = self.gates.get(threading.current_thread().name)
        if gate is not None:
            assert gate.wait(timeout=60)
        self._lock.acquire()

    def __exit__(self, *exc):
        self._lock.release()


def test_a_late_cancel_never_touches_the_session_that_reused_its_sequence(model_path, load_engine):
    engine = load_engine(model_path, max_sessions=2, n_ctx_per_session=256)
    engine.keep_logits = True
    gated = engine._step_lock = _GatedLock()
    prompt = (1, 504, 3458, 314, 4649)
    assert engine.open_session(OpenRequest("a", 64)).ok
    assert engine.prefill(PrefillRequest("a", 0, token_ids=prompt)).status.ok
    gate = gated.gates["canceller"] = threading.Event()
    canceller = threading.Thread(target=engine.cancel, args=("a",), name="canceller")
    canceller.start()
    for _ in range(10_000_000):  # bounded: until the cancel has marked "a" and waits at the gate
        if engine._table.sessions["a"].cancelled:
            break
    assert engine._table.sessions["a"].cancelled
    assert engine.release("a").ok  # the stream's handler ends "a" meanwhile...
    assert engine.open_session(OpenRequest("b", 64)).ok and engine._table.sessions["b"].seq_id == 0  # ...reused
    assert engine.prefill(PrefillRequest("b", 0, token_ids=prompt)).status.ok
    assert engine.decode(DecodeRequest("b", 5, token_id=28)).status.ok
    reference = engine.last_logits["b"].copy()
    assert engine.rollback("b", 5).ok
    gate.set()
    canceller.join(timeout=60)
    assert not canceller.is_alive()
    assert engine.decode(DecodeRequest("b", 5, token_id=28)).status.ok
    assert engine.last_logits["b"].tobytes() == reference.tobytes()  # b's cache was left alone


def test_a_cancel_between_plan_and_pass_spares_the_steps_beside_it(shard_dir, load_engine, prompts):
    """Cancelling the middle step of a planned run of sequences 0, 1, 2 leaves 0
    and 2, which llama.cpp would split: they run apart, and both succeed."""
    engine = load_engine(shard_dir[(0, 10)], max_sessions=4)
    for sid in "abc":
        assert engine.open_session(OpenRequest(sid, 64)).ok
        assert engine.prefill(PrefillRequest(sid, 0, token_ids=(prompts[0][0],))).status.ok
    real = engine._run_pass_locked

    def cancel_first(p):
        if len(p.parts) == 3:
            engine.cancel("b", keep_session=True)  # lands after planning, before the pass
        return real(p)

    engine._run_pass_locked = cancel_first
    results = {}

    def step(sid):
        results[sid] = engine.decode(DecodeRequest(sid, 1, token_id=prompts[0][1]))

    with engine._step_lock:
        threads = [threading.Thread(target=step, args=(sid,)) for sid in "abc"]
        for t in threads:
            t.start()
        with engine._wake:
            assert engine._wake.wait_for(lambda: len(engine._work) == 3, timeout=60)
    for t in threads:
        t.join(timeout=60)
    assert results["b"].status.code.name == "CANCELLED"
    assert results["a"].status.ok and results["c"].status.ok, (results["a"].status, results["c"].status)
    assert results["a"].hidden.tensors[0].data == results["c"].hidden.tensors[0].data  # same token, same position


def test_a_second_step_of_a_session_while_its_first_computes_is_refused(shard_dir, load_engine, prompts):
    """The engine never holds two steps of one sequence; the second is the
    caller's error (typed), and the first still completes."""
    engine = load_engine(shard_dir[(0, 10)], max_sessions=2)
    assert engine.open_session(OpenRequest("a", 64)).ok
    first = {}
    with engine._step_lock:  # the first step waits for the compute thread
        t = threading.Thread(target=lambda: first.setdefault("r", engine.prefill(
            PrefillRequest("a", 0, token_ids=(prompts[0][0],)))))
        t.start()
        with engine._wake:
            assert engine._wake.wait_for(lambda: len(engine._work) == 1, timeout=60)
        second = engine.prefill(PrefillRequest("a", 0, token_ids=(prompts[0][0],)))
        assert second.status.code.name == "INVALID_ARGUMENT" and "computing already" in second.status.message
    t.join(timeout=60)
    assert first["r"].status.ok and engine.session_position("a") == 1
