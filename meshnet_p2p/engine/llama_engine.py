"""LlamaCppShardEngine: the ShardEngine contract on llama.cpp's low-level API.

One llama.cpp context serves every session of the shard; each session is a
sequence id with its own KV stream (``kv_unified = False``), so one session's
cache never changes another's attention numerics, and interleaved sessions
give exactly what they give run one after another.

How a non-tail shard hands over hidden states: every row of a micro-batch is
flagged as an output, and the native eval callback copies the tensor
``l_out-{n_layer-1}`` (the residual stream after the shard's last layer) and
stops the graph there, so the final norm and lm_head are never computed. The
tail computes logits for the last row only and samples; logits never leave it.

Bit-exactness rests on three rules, checked by the tests: the seam is float32
(by default), every shard and the reference use the same micro-batch size, and
a step is split into micro-batches at the same boundaries everywhere (we call
llama_decode once per ``n_ubatch`` rows, from the step's first position).

Every llama_decode runs on one compute thread, which batches: steps of
different sessions that wait at the same time share a llama_decode where that
keeps each one exact (batching.py decides which). The one thread matters for
speed too: llama.cpp's CPU backend (built with OpenMP) keeps a thread team per
calling thread, and alternating callers (one gRPC handler thread per session)
measured 1.4-2.5x slower per step than one caller on two cores.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import threading
import time
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.stats import BATCH_ROWS, Histogram
from .contract import (
    HIDDEN,
    MAX_AUTO_SESSIONS,
    OK,
    DecodeRequest,
    EngineCapabilities,
    HealthResult,
    LoadRequest,
    LoadResult,
    MetricsResult,
    OpenRequest,
    PrefillRequest,
    ShardEngine,
    Status,
    StatusCode,
    StepResult,
    Tensor,
    TensorBundle,
    TokenOutput,
)
from .batching import Pass, Waiting, plan_round
from .cut import ShardInfo, inspect_gguf
from .gguf import align_up
from .llama_native import ensure_backend, hooks
from .recipe import FLASH_ATTN_TYPE, KV_CACHE_GGML_TYPE, KV_UNIFIED, RecipeError, runtime_recipe
from .sampling import sample
from .seam import decode_seam, encode_seam, seam_itemsize
from .sessions import Session, SessionTable
from .threads import FixedThreads, ThreadChooser


_CAPTURE_MISSED = -100  # _decode's code when the hidden-state capture missed


class LlamaCppShardEngine(ShardEngine):
    def __init__(self) -> None:
        self._step_lock = threading.Lock()  # held for every llama.cpp call on the context
        self._table_lock = threading.Lock()  # held briefly for session bookkeeping
        self._model = None
        self._ctx = None
        self._caps: EngineCapabilities | None = None
        self._info: ShardInfo | None = None
        self._table: SessionTable | None = None
        self._running: str | None = None  # the session of a one-session pass in llama_decode now (abortable)
        self._batch: _BatchViews | None = None
        self._compute: threading.Thread | None = None  # the one thread that calls llama_decode
        self._work: dict[int, _Work] = {}  # steps waiting or computing, by arrival
        self._wake = threading.Condition(self._table_lock)  # work arrived, or the engine closes
        self._keys = itertools.count()
        self._stopping = False
        self._state = "not-loaded"
        self._detail = ""
        self._m = dict(steps=0, tokens_processed=0, tokens_sampled=0, refused=0, cancelled=0, failed_steps=0,
                       passes=0, shared_passes=0, rows=0, compute_seconds=0.0, fewer_thread_passes=0)
        self._pass_rows = Histogram(BATCH_ROWS)  # rows per llama_decode: the batch sizes it achieved
        self.keep_logits = False  # tests: keep the tail's last logits per session
        # how many threads each pass runs on (threads.py); set at load, replaceable (tests)
        self.thread_chooser: ThreadChooser | FixedThreads | None = None
        self._threads_now = 0  # what the context computes with now
        self._last_pass_end = float("-inf")  # when the last llama_decode returned: the idle before the next
        self.last_logits: dict[str, np.ndarray] = {}

    # --- lifecycle -------------------------------------------------------------

    def load(self, request: LoadRequest) -> LoadResult:
        if self._model is not None:
            return LoadResult(Status(StatusCode.INVALID_ARGUMENT, "engine is already loaded"), self._caps)
        try:
            # A cut shard's bytes are checked against its binding here (verify_shard):
            # a shard that changed after cutting is refused before it is served.
            info = inspect_gguf(request.path, source_sha256=request.source_sha256)
        except MeshnetError as e:  # bad file, unsupported architecture, bad shard metadata
            self._state, self._detail = "failed", str(e)
            return LoadResult(Status(StatusCode.LOAD_FAILED, str(e)))
        except OSError as e:
            self._state, self._detail = "failed", str(e)
            return LoadResult(Status(StatusCode.LOAD_FAILED, f"{request.path}: {e}"))
        ensure_backend()
        native = hooks()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = False  # AMX repacking crashes on these CPUs (see FACTS)
        if request.progress is not None:  # kept alive for the call; llama.cpp asks it from this thread
            progress_cb = llama_cpp.llama_progress_callback(_load_progress(request.progress))
            mparams.progress_callback = progress_cb
        model = llama_cpp.llama_model_load_from_file(request.path.encode(), mparams)
        if not model:
            self._state = "failed"
            return LoadResult(Status(StatusCode.LOAD_FAILED, f"llama.cpp could not load {request.path}"))
        n_embd = llama_cpp.llama_model_n_embd(model)
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        is_tail = info.is_tail
        n_ctx_seq = align_up(request.n_ctx_per_session, 256)  # llama.cpp pads per-sequence contexts to 256
        max_sessions = request.max_sessions or sessions_for_memory(model, n_ctx_seq, request.kv_memory_mib)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx_seq * max_sessions
        cparams.n_batch = request.n_ubatch
        cparams.n_ubatch = request.n_ubatch
        cparams.n_seq_max = max_sessions
        cparams.kv_unified = KV_UNIFIED
        # A tail emits one row of logits per step; llama.cpp wants room for one per sequence.
        outputs = max_sessions if is_tail else max(request.n_ubatch, max_sessions)
        cparams.n_outputs_max = outputs
        cparams.n_outputs_max_per_seq = outputs
        threads = request.n_threads or os.cpu_count() or 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.flash_attn_type = FLASH_ATTN_TYPE
        # a sliding-window model (gemma3) keeps its whole KV, not only the window: a
        # rollback deeper than the window (failover, audits) must find what it rewinds to
        cparams.swa_full = True
        cparams.type_k = KV_CACHE_GGML_TYPE
        cparams.type_v = KV_CACHE_GGML_TYPE
        cparams.no_perf = True
        self._capture = native.new_state()
        self._capture.stop_after = 1
        state_ptr = ctypes.cast(ctypes.pointer(self._capture), ctypes.c_void_p)
        if not is_tail:
            cparams.cb_eval = native.eval_cb
            cparams.cb_eval_user_data = state_ptr
        cparams.abort_callback = native.abort_cb
        cparams.abort_callback_data = state_ptr
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            llama_cpp.llama_model_free(model)
            self._state = "failed"
            return LoadResult(Status(StatusCode.LOAD_FAILED, "llama.cpp could not create a context"))
        # The recipe names what this context runs: the loaded file's metadata, the
        # parameters as set (read back), the micro-batch llama.cpp will split by.
        try:
            if cparams.type_k != cparams.type_v:
                raise RecipeError(f"K and V caches of different types ({cparams.type_k}, {cparams.type_v})")
            if llama_cpp.llama_n_ubatch(ctx) != request.n_ubatch:
                raise RecipeError(f"llama.cpp runs micro-batches of {llama_cpp.llama_n_ubatch(ctx)}, not {request.n_ubatch}")
            recipe = runtime_recipe(
                seam_dtype=request.seam_dtype,
                n_ubatch=int(llama_cpp.llama_n_ubatch(ctx)),
                weight_quantization=info.weight_quantization,
                tokenizer_digest=info.tokenizer_digest,
                adapter_id=info.adapter_id,
                kv_ggml_type=cparams.type_k,
                flash_attn_type=cparams.flash_attn_type,
                kv_unified=cparams.kv_unified,
            )
        except RecipeError as e:
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(model)
            self._state, self._detail = "failed", str(e)
            return LoadResult(Status(StatusCode.LOAD_FAILED, f"no well-defined recipe: {e}"))
        if not is_tail:
            self._capture.target = f"l_out-{info.n_layers - 1}".encode()
        self._model, self._ctx, self._vocab, self._info = model, ctx, vocab, info
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._n_embd, self._n_vocab = n_embd, (n_vocab if (info.is_head or is_tail) else 0)
        self._seam = request.seam_dtype
        self._n_ubatch = request.n_ubatch
        self._batch = _BatchViews(request.n_ubatch, n_embd, embd_input=not info.is_head, all_outputs=not is_tail)
        if not is_tail:
            self._capture.buf = self._batch.capture.__array_interface__["data"][0]  # a fixed buffer for every step
        self._native = native  # keep the callbacks alive as long as the context
        self._threads_now = threads
        self.thread_chooser = ThreadChooser(threads) if request.choose_threads else FixedThreads(threads)
        budget = request.kv_token_budget or max_sessions * request.n_ctx_per_session
        self._table = SessionTable(max_sessions, budget, request.n_ctx_per_session)
        self._caps = EngineCapabilities(
            architecture=info.architecture,
            start=info.start,
            end=info.end,
            source_layers=info.source_layers,
            n_embd=n_embd,
            n_vocab=self._n_vocab,
            role=info.role,
            max_sessions=max_sessions,
            kv_token_budget=budget,
            n_ctx_per_session=request.n_ctx_per_session,
            model_digest=info.model_digest,
            recipe_digest=recipe.digest(),
            recipe=recipe.axes(),
            recipe_labels=recipe.labels(),
        )
        self._compute = threading.Thread(target=self._compute_loop, name="llama-compute", daemon=True)
        self._compute.start()
        self._state = "serving"
        return LoadResult(OK, self._caps)

    def capabilities(self) -> EngineCapabilities | None:
        return self._caps

    def close(self) -> None:
        with self._table_lock:
            self._stopping = True  # steps still waiting end NOT_LOADED
            self._wake.notify_all()
        if self._compute is not None and self._compute is not threading.current_thread():
            self._compute.join()
            self._compute = None
        with self._step_lock:
            if self._ctx is not None:
                llama_cpp.llama_free(self._ctx)
                self._ctx = None
            self._batch = None  # numpy arrays: nothing native to free
            if self._model is not None:
                llama_cpp.llama_model_free(self._model)
                self._model = None
            self._state = "closed"

    def __del__(self) -> None:  # a safety net; callers should close()
        try:
            self.close()
        except Exception:
            pass

    # --- sessions --------------------------------------------------------------

    def open_session(self, request: OpenRequest) -> Status:
        if self._table is None:
            return Status(StatusCode.NOT_LOADED, "engine is not loaded")
        with self._table_lock:
            status, _ = self._table.admit(request.session_id, request.max_tokens, request.sampling)
            if not status.ok:
                self._m["refused"] += 1
            return status

    def rollback(self, session_id: str, position: int) -> Status:
        if self._table is None:
            return Status(StatusCode.NOT_LOADED, "engine is not loaded")
        with self._step_lock:
            with self._table_lock:
                status, s = self._table.lookup(session_id)
                if not status.ok:
                    return status
                if not 0 <= position <= s.position:
                    return Status(
                        StatusCode.POSITION_MISMATCH,
                        f"cannot roll back to {position}: session {session_id!r} is at {s.position}",
                    )
            llama_cpp.llama_memory_seq_rm(self._mem, s.seq_id, position, -1)
            s.position = position
            self.last_logits.pop(session_id, None)
            return OK

    def cancel(self, session_id: str, *, keep_session: bool = False) -> Status:
        if self._table is None:
            return Status(StatusCode.NOT_LOADED, "engine is not loaded")
        with self._table_lock:
            s = self._table.sessions.get(session_id)
            if s is None:
                return Status(StatusCode.UNKNOWN_SESSION, f"no open session {session_id!r}")
            if s.cancelled:
                return OK
            for w in self._work.values():
                if w.session is s:
                    w.cancelled = True  # dropped before its next pass, or its result is
            if self._running == session_id:
                self._capture.abort = 1  # a pass of this session alone: stop it now
            if not keep_session:
                s.cancelled = True
            self._m["cancelled"] += 1
        if not keep_session:
            with self._step_lock:  # waits for the aborted step to unwind
                with self._table_lock:
                    current = self._holds(s)  # released meanwhile: its cache is gone, its id maybe another's
                if current:
                    llama_cpp.llama_memory_seq_rm(self._mem, s.seq_id, -1, -1)
                    s.position = 0
        return OK

    def release(self, session_id: str) -> Status:
        if self._table is None:
            return Status(StatusCode.NOT_LOADED, "engine is not loaded")
        with self._table_lock:
            s = self._table.sessions.get(session_id)
            if s is not None and self._running == session_id:
                self._capture.abort = 1
        if s is None:
            return OK
        with self._step_lock:
            with self._table_lock:
                if self._table.sessions.get(session_id) is not s:
                    return OK
                llama_cpp.llama_memory_seq_rm(self._mem, s.seq_id, -1, -1)
                self._table.release(session_id)
                self.last_logits.pop(session_id, None)
        return OK

    # --- steps -----------------------------------------------------------------

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._step(request.session_id, request.position, request.token_ids, request.hidden)

    def decode(self, request: DecodeRequest) -> StepResult:
        tokens = None if request.token_id is None else (request.token_id,)
        return self._step(request.session_id, request.position, tokens, request.hidden)

    def _step(
        self, session_id: str, position: int, tokens: tuple[int, ...] | None, hidden: TensorBundle | None
    ) -> StepResult:
        if self._table is None or self._ctx is None:
            return StepResult(Status(StatusCode.NOT_LOADED, "engine is not loaded"))
        rows, err = self._check_input(tokens, hidden)
        if err is not None:
            return self._failed(err)
        with self._table_lock:
            if self._stopping:
                return self._failed_locked(Status(StatusCode.NOT_LOADED, "engine is closing"))
            status, s = self._table.lookup(session_id)
            if status.ok:
                status = self._table.check_step(s, position, len(rows))
            if status.ok and any(w.session is s for w in self._work.values()):
                status = Status(StatusCode.INVALID_ARGUMENT, f"session {session_id!r} has a step computing already")
            if not status.ok:
                return self._failed_locked(status)
            work = _Work(next(self._keys), s, rows, tokens is not None, len(rows))
            self._work[work.key] = work
            self._wake.notify_all()  # the compute thread (and a test that waits for a batch to gather)
        work.finished.wait()
        if work.status is not None:
            return self._failed(work.status)
        if work.token is not None:
            return StepResult(OK, work.position, token=work.token)
        bundle = TensorBundle((Tensor(HIDDEN, self._seam, (len(rows), self._n_embd), encode_seam(work.hidden, self._seam)),))
        return StepResult(OK, work.position, hidden=bundle)

    def _failed(self, status: Status) -> StepResult:
        with self._table_lock:
            return self._failed_locked(status)

    def _failed_locked(self, status: Status) -> StepResult:
        self._m["failed_steps"] += 1  # (handler threads fail steps at once: counted under the lock)
        return StepResult(status)

    def _check_input(self, tokens: tuple[int, ...] | None, hidden: TensorBundle | None) -> tuple[object, Status | None]:
        info = self._info
        if info.is_head:
            if tokens is None:
                return None, Status(StatusCode.WRONG_INPUT, "this is a head shard: it takes token ids, not hidden states")
            bad = [t for t in tokens if not 0 <= t < self._n_vocab]
            if bad:
                return None, Status(StatusCode.INVALID_ARGUMENT, f"token id {bad[0]} is outside the vocabulary of {self._n_vocab}")
            return tokens, None
        if hidden is None:
            return None, Status(StatusCode.WRONG_INPUT, f"this shard starts at layer {info.start}: it takes hidden states, not token ids")
        t = hidden.get(HIDDEN)
        if t is None:
            return None, Status(StatusCode.BAD_TENSOR, f"bundle has no {HIDDEN!r} tensor")
        if t.dtype != self._seam:
            return None, Status(StatusCode.BAD_TENSOR, f"hidden state dtype is {t.dtype!r}; this shard's seam is {self._seam!r}")
        if len(t.shape) != 2 or t.shape[1] != self._n_embd:
            return None, Status(StatusCode.BAD_TENSOR, f"hidden state shape {t.shape} is not (n_tokens, {self._n_embd})")
        if len(t.data) != t.shape[0] * t.shape[1] * seam_itemsize(t.dtype):
            return None, Status(StatusCode.BAD_TENSOR, f"hidden state has {len(t.data)} bytes, shape {t.shape} needs {t.shape[0] * t.shape[1] * seam_itemsize(t.dtype)}")
        rows = decode_seam(t.data, t.dtype, t.shape)
        # One reduction instead of an elementwise isfinite: any NaN or inf (or a
        # sum so large it overflows, which is garbage anyway) makes the sum non-finite.
        if not math.isfinite(float(np.add.reduce(rows, axis=None))):
            return None, Status(StatusCode.BAD_TENSOR, "hidden state holds NaN or infinite values")
        return rows, None

    # --- the compute thread ------------------------------------------------------

    def _compute_loop(self) -> None:
        """Rounds of passes (batching.plan_round) over the steps that wait, until
        close. A round holds _step_lock (rollback and release wait at most a
        round: every waiting row and one micro-batch)."""
        while True:
            with self._table_lock:
                while not self._work and not self._stopping:
                    self._wake.wait()
            with self._step_lock:
                try:
                    if not self._round_locked():
                        return
                except Exception as e:  # a bug in planning fails what waits, never the thread (waiters would hang)
                    self._fail_on_bug_locked(None, e)

    def _round_locked(self) -> bool:
        """One round, under _step_lock: plan what waits, run its passes. False once closing."""
        with self._table_lock:  # (the order rollback and release take them in)
            if self._stopping:
                for w in list(self._work.values()):
                    self._finish_locked(w, Status(StatusCode.NOT_LOADED, "engine is closing"))
                return False
            self._drop_dead_locked()
            works = list(self._work.values())
            if len(works) == 1:  # one step alone (a lone user): its next micro-batch, no planning
                w = works[0]
                plan = [Pass(((w.key, w.done, min(self._n_ubatch, w.n - w.done)),))]
            else:
                plan = plan_round([Waiting(w.key, w.session.seq_id, w.n, w.done) for w in works],
                                  self._n_ubatch)
        for p in plan:
            try:
                self._run_pass_locked(p)
            except Exception as e:  # a bug or native failure fails its steps, never the thread
                self._fail_on_bug_locked([key for key, _, _ in p.parts], e)
        return True

    def _fail_on_bug_locked(self, keys: list[int] | None, e: Exception) -> None:
        """Under _step_lock: the steps ``keys`` (None: every one waiting) end INTERNAL, their rows out of the cache."""
        with self._table_lock:
            self._running = None
            for key in list(self._work) if keys is None else keys:
                w = self._work.get(key)
                if w is not None:
                    self._finish_locked(w, Status(StatusCode.INTERNAL, f"step failed: {type(e).__name__}: {e}"),
                                        undo=True)

    def _holds(self, s: Session) -> bool:
        """Whether ``s`` is still open: a released session's sequence id may be another's by now."""
        return self._table.sessions.get(s.session_id) is s

    def _drop_dead_locked(self) -> None:
        """Steps whose session was released, replaced or cancelled meanwhile end now,
        so no two steps of one sequence ever wait together."""
        for w in list(self._work.values()):
            s = w.session
            if not self._holds(s) or s.cancelled:
                # a released or cancelled session's cache is cleared by release/cancel itself
                self._finish_locked(w, Status(StatusCode.CANCELLED, "step was cancelled"))
            elif w.cancelled:
                self._finish_locked(w, Status(StatusCode.CANCELLED, "step was cancelled"), undo=w.done > 0)

    def _finish_locked(self, w: "_Work", status: Status | None, *, undo: bool = False) -> None:
        # What part of the step reached the cache is forgotten (the caller holds _step_lock too),
        # unless its session was released: its sequence id may be another session's by now.
        if undo and self._holds(w.session):
            llama_cpp.llama_memory_seq_rm(self._mem, w.session.seq_id, w.session.position, -1)
        w.status = status
        self._work.pop(w.key, None)
        w.finished.set()

    def _run_pass_locked(self, p: Pass) -> None:
        """One llama_decode of a planned pass (the caller holds _step_lock)."""
        with self._table_lock:
            live = [(w, start, m) for key, start, m in p.parts
                    if (w := self._work.get(key)) is not None and not w.cancelled and not w.session.cancelled
                    and self._holds(w.session)]
            if not live:
                return
        # A step cancelled after planning leaves a gap in a run of sequence ids, which
        # llama.cpp would split into micro-batches of its own: run each consecutive part alone.
        for part in _consecutive(live):
            self._run_part_locked(part)

    def _run_part_locked(self, live: list[tuple["_Work", int, int]]) -> None:
        with self._table_lock:
            self._running = live[0][0].session.session_id if len(live) == 1 else None
            self._capture.abort = 0
        rows = sum(m for _, _, m in live)
        t0 = time.perf_counter()
        gap = t0 - self._last_pass_end
        threads = self.thread_chooser.choose(gap, rows)
        if threads != self._threads_now:  # (a field write: takes effect at the next llama_decode)
            llama_cpp.llama_set_n_threads(self._ctx, threads, threads)
            self._threads_now = threads
        rc = self._decode(live)
        self._last_pass_end = time.perf_counter()
        took = self._last_pass_end - t0
        with self._table_lock:
            self._running = None
            aborted = self._capture.abort
            self._capture.abort = 0
            if rc == 0 and not aborted:  # (a pass cut short says nothing of what its thread count costs)
                self.thread_chooser.observe(gap, rows, threads, took)
            self._m["passes"] += 1
            self._m["rows"] += rows
            if threads < self.thread_chooser.max_threads:
                self._m["fewer_thread_passes"] += 1
            self._pass_rows.observe(rows)
            self._m["compute_seconds"] += took
            if len(live) > 1:
                self._m["shared_passes"] += 1
            end = 0  # each step's rows end here in the pass (a tail's logits are its last row's)
            for w, start, m in live:
                end += m
                if rc == 2 or aborted or w.cancelled:
                    self._finish_locked(w, Status(StatusCode.CANCELLED, "step was cancelled"), undo=True)
                elif rc == _CAPTURE_MISSED:
                    self._finish_locked(w, Status(StatusCode.INTERNAL, "hidden-state capture did not see the "
                                                  "shard's last layer"), undo=True)
                elif rc != 0:
                    self._finish_locked(w, Status(StatusCode.INTERNAL, f"llama_decode failed with code {rc}"), undo=True)
                else:
                    self._complete_part_locked(w, start, m, end - 1 if self._info.is_tail else None)

    def _decode(self, live: list[tuple["_Work", int, int]]) -> int:
        """One llama_decode of ``live``'s rows (at most n_ubatch, in pass order); a
        non-tail copies each step's hidden rows out of the capture buffer."""
        b, cap = self._batch, self._capture
        tail = self._info.is_tail
        j = 0
        for w, start, m in live:
            rows = slice(j, j + m)
            if w.is_tokens:
                b.token[rows] = w.rows[start : start + m]
            else:
                b.embd[rows] = w.rows[start : start + m]
            np.add(b.steps[:m], w.session.position + start, out=b.pos[rows])
            b.seq[rows] = w.session.seq_id
            if tail:
                b.logits[rows] = 0
                if start + m == w.n:
                    b.logits[j + m - 1] = 1  # the step's last row: its logits are sampled
            j += m
        b.batch.n_tokens = j
        row_bytes = self._n_embd * 4
        if not tail:
            cap.cap = j * row_bytes
            cap.len = 0
            cap.captures = 0
        rc = llama_cpp.llama_decode(self._ctx, b.batch)
        if rc == 0 and not tail:
            if cap.captures != 1 or cap.len != j * row_bytes:
                return _CAPTURE_MISSED
            j = 0
            for w, start, m in live:
                if w.hidden is None:
                    w.hidden = np.empty((w.n, self._n_embd), dtype=np.float32)
                w.hidden[start : start + m] = b.capture[j : j + m]
                j += m
        return rc

    def _complete_part_locked(self, w: "_Work", start: int, m: int, row: int | None) -> None:
        w.done = start + m
        if w.done < w.n:
            return  # more micro-batches to come, in later rounds
        s = w.session
        if row is not None:  # a tail: sample now, while llama.cpp's logits row is this pass's (before the
            w.token = self._sample(s, self._logits_row(row), s.position + w.n)  # position moves: it may raise)
        s.position += w.n
        w.position = s.position
        self._m["steps"] += 1
        self._m["tokens_processed"] += w.n
        self._finish_locked(w, None)

    def _logits_row(self, i: int) -> np.ndarray:
        addr = ctypes.cast(llama_cpp.llama_get_logits_ith(self._ctx, i), ctypes.c_void_p).value
        return np.frombuffer((ctypes.c_float * self._n_vocab).from_address(addr), dtype=np.float32)

    def _sample(self, s: Session, logits: np.ndarray, position: int) -> TokenOutput:
        """The token after ``position`` rows; its random draw is a function of (seed, position)."""
        if self.keep_logits:
            self.last_logits[s.session_id] = logits.copy()
        token = sample(logits, s.sampling, position)
        self._m["tokens_sampled"] += 1
        return TokenOutput(token, bool(llama_cpp.llama_vocab_is_eog(self._vocab, token)))

    # --- observability -----------------------------------------------------------

    def health(self) -> HealthResult:
        active = len(self._table.sessions) if self._table else 0
        return HealthResult(self._state == "serving", self._state, active, self._detail)

    def metrics(self) -> MetricsResult:
        t = self._table
        with self._table_lock:
            return MetricsResult(
                active_sessions=len(t.sessions) if t else 0,
                kv_tokens_reserved=t.reserved if t else 0,
                kv_tokens_used=t.used if t else 0,
                **self._m,
                rows_per_pass=self._pass_rows.snapshot(),
            )

    def session_position(self, session_id: str) -> int | None:
        s = self._table.sessions.get(session_id) if self._table else None
        return None if s is None else s.position


@dataclass(eq=False)
class _Work:
    """One step on its way through the compute thread."""

    key: int  # arrival order
    session: Session
    rows: object  # token ids, or an (n, n_embd) float32 array
    is_tokens: bool
    n: int
    done: int = 0  # rows computed (a multi-row step runs one micro-batch per round)
    cancelled: bool = False  # cancel(keep_session=True): its result is dropped
    hidden: np.ndarray | None = None  # a non-tail's output rows
    token: TokenOutput | None = None  # a tail's sample
    position: int = 0  # the session's position after it
    status: Status | None = None  # why it failed; None: it completed
    finished: threading.Event = field(default_factory=threading.Event)


def _load_progress(report):
    """llama.cpp's load callback (a fraction, 0..1) as a progress report in thousandths;
    it returns True (go on): a progress display must never abort a load."""
    def cb(fraction: float, _user_data) -> bool:
        try:
            report("loading", int(max(0.0, min(1.0, fraction)) * 1000), 1000)
        except Exception:
            pass
        return True
    return cb


def _consecutive(parts: list[tuple["_Work", int, int]]) -> list[list[tuple["_Work", int, int]]]:
    """``parts`` (in sequence-id order, as planned) cut where sequence ids stop running consecutively."""
    runs: list[list] = []
    for p in parts:
        if runs and p[0].session.seq_id == runs[-1][-1][0].session.seq_id + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def kv_bytes_per_token(model) -> int:
    """What one position of one sequence costs in this shard's K and V caches (f16)."""
    n_layer = llama_cpp.llama_model_n_layer(model)
    head_dim = llama_cpp.llama_model_n_embd(model) // max(1, llama_cpp.llama_model_n_head(model))
    return n_layer * 2 * llama_cpp.llama_model_n_head_kv(model) * head_dim * 2


def sessions_for_memory(model, n_ctx_seq: int, kv_memory_mib: int) -> int:
    """The session count a peer sizes itself to: what its KV memory holds at full length each."""
    per_session = max(1, n_ctx_seq * kv_bytes_per_token(model))
    return max(1, min(MAX_AUTO_SESSIONS, (kv_memory_mib << 20) // per_session))


class _BatchViews:
    """A llama_batch whose arrays are numpy arrays we own.

    Every row belongs to one sequence (its session's), so each row's seq-id
    list is one slot of a single contiguous array; per-token work
    is then a few numpy slice assignments instead of per-row ctypes calls. The
    struct is built by hand (not llama_batch_init) so llama.cpp never frees it.
    """

    def __init__(self, n: int, n_embd: int, *, embd_input: bool, all_outputs: bool) -> None:
        self.token = None if embd_input else np.zeros(n, dtype=np.int32)
        self.embd = np.zeros((n, n_embd), dtype=np.float32) if embd_input else None
        self.pos = np.zeros(n, dtype=np.int32)
        self.n_seq_id = np.ones(n, dtype=np.int32)
        self.seq = np.zeros(n, dtype=np.int32)
        self.logits = np.full(n, 1 if all_outputs else 0, dtype=np.int8)  # a non-tail outputs every row, for capture
        self.steps = np.arange(n, dtype=np.int32)
        self.capture = np.zeros((n, n_embd), dtype=np.float32)
        seq_base = self.seq.__array_interface__["data"][0]
        self._seq_ptrs = np.array([seq_base + 4 * i for i in range(n)], dtype=np.uintp)
        b = llama_cpp.llama_batch()
        b.n_tokens = 0
        if self.token is not None:
            b.token = _ptr(self.token, llama_cpp.llama_token)
        if self.embd is not None:
            b.embd = _ptr(self.embd, ctypes.c_float)
        b.pos = _ptr(self.pos, llama_cpp.llama_pos)
        b.n_seq_id = _ptr(self.n_seq_id, ctypes.c_int32)
        b.seq_id = _ptr(self._seq_ptrs, ctypes.POINTER(llama_cpp.llama_seq_id))
        b.logits = _ptr(self.logits, ctypes.c_int8)
        self.batch = b


def _ptr(array: np.ndarray, ctype) -> ctypes._Pointer:
    return ctypes.cast(array.__array_interface__["data"][0], ctypes.POINTER(ctype))


__all__ = ["LlamaCppShardEngine"]
