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

With more than one thread, every llama_decode runs on one dedicated compute
thread. llama.cpp's CPU backend (built with OpenMP) keeps a thread team per
calling thread, and alternating callers (one gRPC handler thread per session)
measured 2.5x slower per step than one caller (7.5 ms against 3.0 ms on two
cores), so the hand-off to a fixed thread pays for itself many times over.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import llama_cpp
import numpy as np

from ..errors import MeshnetError
from .contract import (
    HIDDEN,
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
from .cut import ShardInfo, inspect_gguf
from .gguf import align_up
from .llama_native import ensure_backend, hooks
from .recipe import FLASH_ATTN_TYPE, KV_CACHE_GGML_TYPE, KV_UNIFIED, RecipeError, runtime_recipe
from .sampling import sample
from .seam import decode_seam, encode_seam, seam_itemsize
from .sessions import Session, SessionTable


class LlamaCppShardEngine(ShardEngine):
    def __init__(self) -> None:
        self._step_lock = threading.Lock()  # held for every llama.cpp call on the context
        self._table_lock = threading.Lock()  # held briefly for session bookkeeping
        self._model = None
        self._ctx = None
        self._caps: EngineCapabilities | None = None
        self._info: ShardInfo | None = None
        self._table: SessionTable | None = None
        self._running: str | None = None  # session whose step is in llama_decode now
        self._batch: _BatchViews | None = None
        self._compute: ThreadPoolExecutor | None = None  # the one thread that calls llama_decode (n_threads > 1)
        self._state = "not-loaded"
        self._detail = ""
        self._m = dict(steps=0, tokens_processed=0, tokens_sampled=0, refused=0, cancelled=0, failed_steps=0)
        self.keep_logits = False  # tests: keep the tail's last logits per session
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
        model = llama_cpp.llama_model_load_from_file(request.path.encode(), mparams)
        if not model:
            self._state = "failed"
            return LoadResult(Status(StatusCode.LOAD_FAILED, f"llama.cpp could not load {request.path}"))
        n_embd = llama_cpp.llama_model_n_embd(model)
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        is_tail = info.is_tail
        n_ctx_seq = align_up(request.n_ctx_per_session, 256)  # llama.cpp pads per-sequence contexts to 256
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx_seq * request.max_sessions
        cparams.n_batch = request.n_ubatch
        cparams.n_ubatch = request.n_ubatch
        cparams.n_seq_max = request.max_sessions
        cparams.kv_unified = KV_UNIFIED
        # A tail emits one row of logits per step; llama.cpp wants room for one per sequence.
        outputs = request.max_sessions if is_tail else max(request.n_ubatch, request.max_sessions)
        cparams.n_outputs_max = outputs
        cparams.n_outputs_max_per_seq = outputs
        threads = request.n_threads or os.cpu_count() or 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.flash_attn_type = FLASH_ATTN_TYPE
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
        self._logits_addr = 0
        self._logits_view: np.ndarray | None = None
        self._native = native  # keep the callbacks alive as long as the context
        budget = request.kv_token_budget or request.max_sessions * request.n_ctx_per_session
        self._table = SessionTable(request.max_sessions, budget, request.n_ctx_per_session)
        self._caps = EngineCapabilities(
            architecture=info.architecture,
            start=info.start,
            end=info.end,
            source_layers=info.source_layers,
            n_embd=n_embd,
            n_vocab=self._n_vocab,
            role=info.role,
            max_sessions=request.max_sessions,
            kv_token_budget=budget,
            n_ctx_per_session=request.n_ctx_per_session,
            model_digest=info.model_digest,
            recipe_digest=recipe.digest(),
            recipe=recipe.axes(),
            recipe_labels=recipe.labels(),
        )
        if threads > 1:
            self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama-compute")
        self._state = "serving"
        return LoadResult(OK, self._caps)

    def capabilities(self) -> EngineCapabilities | None:
        return self._caps

    def close(self) -> None:
        with self._step_lock:
            if self._compute is not None:
                self._compute.shutdown(wait=True)
                self._compute = None
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
            if self._running == session_id:
                self._capture.abort = 1
            if not keep_session:
                s.cancelled = True
            self._m["cancelled"] += 1
        if not keep_session:
            with self._step_lock:  # waits for the aborted step to unwind
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
        info = self._info
        rows, err = self._check_input(tokens, hidden)
        if err is not None:
            return self._failed(err)
        with self._step_lock:
            with self._table_lock:
                status, s = self._table.lookup(session_id)
                if status.ok:
                    status = self._table.check_step(s, position, len(rows))
                if not status.ok:
                    return self._failed(status)
                self._running = session_id
                self._capture.abort = 0
            try:
                if self._compute is None:
                    out = self._forward(s, rows, tokens is not None)
                else:
                    out = self._compute.submit(self._forward, s, rows, tokens is not None).result()
            except Exception as e:  # a bug or native failure must not take the peer down
                out = Status(StatusCode.INTERNAL, f"step failed: {type(e).__name__}: {e}")
            finally:
                with self._table_lock:
                    self._running = None
                    aborted = self._capture.abort
                    self._capture.abort = 0
            if isinstance(out, Status):
                # Undo whatever part of the step reached the cache.
                llama_cpp.llama_memory_seq_rm(self._mem, s.seq_id, s.position, -1)
                if aborted and out.code is StatusCode.INTERNAL:
                    out = Status(StatusCode.CANCELLED, "step was cancelled")
                return self._failed(out)
            s.position += len(rows)
            self._m["steps"] += 1
            self._m["tokens_processed"] += len(rows)
            if info.is_tail:
                token = self._sample(s, out)
                return StepResult(OK, s.position, token=token)
            bundle = TensorBundle((Tensor(HIDDEN, self._seam, (len(rows), self._n_embd), encode_seam(out, self._seam)),))
            return StepResult(OK, s.position, hidden=bundle)

    def _failed(self, status: Status) -> StepResult:
        self._m["failed_steps"] += 1
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

    def _forward(self, s: Session, rows, is_tokens: bool) -> np.ndarray | Status:
        """Run ``rows`` (token ids or an (n, n_embd) float32 array) through the shard.

        Returns the (n, n_embd) hidden states for a non-tail shard, a view of the
        last row's logits for a tail, or a Status on failure. This is the hot
        path of every token: numpy views over the batch buffers, no per-row ctypes.
        """
        n = len(rows)
        tail = self._info.is_tail
        b = self._batch
        cap = self._capture
        hidden = None if tail else np.empty((n, self._n_embd), dtype=np.float32)
        row_bytes = self._n_embd * 4
        for start in range(0, n, self._n_ubatch):
            m = min(self._n_ubatch, n - start)
            b.batch.n_tokens = m
            if is_tokens:
                b.token[:m] = rows[start : start + m]
            else:
                b.embd[:m] = rows[start : start + m]
            np.add(b.steps[:m], s.position + start, out=b.pos[:m])
            b.seq[:m] = s.seq_id
            if tail:
                b.logits[:m] = 0
                if start + m == n:
                    b.logits[m - 1] = 1
            else:
                cap.cap = m * row_bytes
                cap.len = 0
                cap.captures = 0
            rc = llama_cpp.llama_decode(self._ctx, b.batch)
            if rc == 2 or cap.abort:
                return Status(StatusCode.CANCELLED, "step was cancelled")
            if rc != 0:
                return Status(StatusCode.INTERNAL, f"llama_decode failed with code {rc}")
            if not tail:
                if cap.captures != 1 or cap.len != m * row_bytes:
                    return Status(StatusCode.INTERNAL, "hidden-state capture did not see the shard's last layer")
                hidden[start : start + m] = b.capture[:m]
        if tail:
            return self._last_logits()
        return hidden

    def _last_logits(self) -> np.ndarray:
        # A view over llama.cpp's logits row, rebuilt only if the buffer moves.
        addr = ctypes.cast(llama_cpp.llama_get_logits_ith(self._ctx, -1), ctypes.c_void_p).value
        if addr != self._logits_addr:
            self._logits_view = np.frombuffer((ctypes.c_float * self._n_vocab).from_address(addr), dtype=np.float32)
            self._logits_addr = addr
        return self._logits_view

    def _sample(self, s: Session, logits: np.ndarray) -> TokenOutput:
        if self.keep_logits:
            self.last_logits[s.session_id] = logits.copy()
        token = sample(logits, s.sampling, s.position)
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
            )

    def session_position(self, session_id: str) -> int | None:
        s = self._table.sessions.get(session_id) if self._table else None
        return None if s is None else s.position


class _BatchViews:
    """A llama_batch whose arrays are numpy arrays we own.

    Every row of a step belongs to one sequence (one session per step), so each
    row's seq-id list is one slot of a single contiguous array; per-token work
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
