"""The ShardEngine contract: the boundary between a peer's protocol code and the
code that runs model layers.

Everything here is project-owned plain data: no llama.cpp handles, no protobuf
messages, no numpy arrays in the public fields (tensors cross as bytes with a
dtype and shape). A transport (the gRPC servicer, the in-process chain) talks
only to :class:`ShardEngine`.

Expected outcomes a peer can cause (an unknown session, a position gap, a
hidden state of the wrong shape, no capacity left) come back as a
:class:`Status` with a :class:`StatusCode`, never as an exception: a server maps
the code to its wire error, and one session's failure never disturbs another.
Exceptions are for programming errors at the call site (a malformed request
object), which the request types reject when constructed.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Mapping

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.stats import HistogramSnapshot


class StatusCode(str, Enum):
    OK = "ok"
    NOT_LOADED = "not-loaded"
    LOAD_FAILED = "load-failed"
    INVALID_ARGUMENT = "invalid-argument"
    UNKNOWN_SESSION = "unknown-session"
    SESSION_EXISTS = "session-exists"
    CAPACITY_EXHAUSTED = "capacity-exhausted"  # admission refused: sessions or KV budget
    CONTEXT_EXHAUSTED = "context-exhausted"  # a session went past the tokens it reserved
    POSITION_MISMATCH = "position-mismatch"  # a gap or overlap with the session's position
    BAD_TENSOR = "bad-tensor"  # hidden state of the wrong name, dtype or shape
    WRONG_INPUT = "wrong-input"  # token ids to a non-head shard, hidden states to a head
    CANCELLED = "cancelled"
    INTERNAL = "internal"


@dataclass(frozen=True)
class Status:
    code: StatusCode
    message: str = ""
    retryable: bool = False

    @property
    def ok(self) -> bool:
        return self.code is StatusCode.OK

    def raise_for_status(self) -> None:
        if not self.ok:
            raise EngineError(self)


OK = Status(StatusCode.OK)


class EngineError(MeshnetError):
    """A non-OK :class:`Status`, raised by callers that want exceptions."""

    def __init__(self, status: Status) -> None:
        self.status = status
        super().__init__(f"{status.code.value}: {status.message}")


SEAM_DTYPES = ("f32", "f16", "bf16")
HIDDEN = "hidden"  # the name of the hidden-state tensor in a bundle


@dataclass(frozen=True)
class Tensor:
    """One named tensor crossing the boundary, as owned bytes (row-major)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tensor needs a name")
        if not self.shape or any(d <= 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: shape must be positive dimensions, got {self.shape}")


@dataclass(frozen=True)
class TensorBundle:
    """Named tensors handed from one shard to the next (today: ``hidden``)."""

    tensors: tuple[Tensor, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if not names or len(set(names)) != len(names):
            raise ValueError("a bundle needs at least one tensor and unique names")

    def get(self, name: str) -> Tensor | None:
        for t in self.tensors:
            if t.name == name:
                return t
        return None


@dataclass(frozen=True)
class TokenOutput:
    """What a tail returns: the sampled token, never logits."""

    token_id: int
    is_eog: bool = False


@dataclass(frozen=True)
class SamplingParams:
    """Tail sampling. ``temperature == 0`` is greedy (argmax, first index on ties).

    Random draws are a pure function of (seed, position), so a replayed or
    failed-over step samples the same token as the original run would.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**64:
            raise ValueError("seed must fit in 64 unsigned bits")


KV_MEMORY_MIB = 256  # what a peer gives its sessions' KV caches by default
MAX_AUTO_SESSIONS = 32  # sessions a peer sizes itself to at most when not told


@dataclass(frozen=True)
class LoadRequest:
    path: str
    # None: as many as kv_memory_mib holds at n_ctx_per_session each (1..MAX_AUTO_SESSIONS);
    # 17 for a 10-layer shard of the embedded model
    max_sessions: int | None = None
    n_ctx_per_session: int = 2048
    kv_token_budget: int | None = None  # default: max_sessions * n_ctx_per_session
    kv_memory_mib: int = KV_MEMORY_MIB
    n_threads: int | None = None
    # per small pass, compute on as many of n_threads as measured fastest (threads.py); False: all of them
    choose_threads: bool = True
    seam_dtype: str = "f32"
    n_ubatch: int = 64
    source_sha256: str | None = None  # for an uncut model file, skips hashing it again
    # told ("loading", done, total) as llama.cpp reads the weights (done/total in thousandths)
    progress: Callable[[str, int, int], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.max_sessions is not None and self.max_sessions < 1) or self.n_ctx_per_session < 1:
            raise ValueError("max_sessions and n_ctx_per_session must be positive")
        if self.kv_memory_mib < 1:
            raise ValueError("kv_memory_mib must be positive")
        if self.kv_token_budget is not None and self.kv_token_budget < 1:
            raise ValueError("kv_token_budget must be positive")
        if self.seam_dtype not in SEAM_DTYPES:
            raise ValueError(f"seam dtype must be one of {SEAM_DTYPES}, got {self.seam_dtype!r}")
        if not 1 <= self.n_ubatch <= 8192:
            raise ValueError("n_ubatch must be in 1..8192")


@dataclass(frozen=True)
class EngineOptions:
    """How a serving process runs its engine (the knobs `serve` and `join` share)."""

    max_sessions: int | None = LoadRequest.max_sessions
    n_ctx_per_session: int = LoadRequest.n_ctx_per_session
    kv_memory_mib: int = LoadRequest.kv_memory_mib
    n_ubatch: int = LoadRequest.n_ubatch
    n_threads: int | None = LoadRequest.n_threads
    choose_threads: bool = LoadRequest.choose_threads

    def load_request(self, path: str, *, source_sha256: str | None = None,
                     progress: Callable[[str, int, int], None] | None = None) -> "LoadRequest":
        return LoadRequest(path, source_sha256=source_sha256, progress=progress, **dataclasses.asdict(self))


@dataclass(frozen=True)
class LoadResult:
    status: Status
    capabilities: "EngineCapabilities | None" = None


@dataclass(frozen=True)
class EngineCapabilities:
    architecture: str
    start: int
    end: int
    source_layers: int
    n_embd: int
    n_vocab: int  # 0 for a shard without a vocabulary (middle)
    role: str
    max_sessions: int
    kv_token_budget: int
    n_ctx_per_session: int
    model_digest: str
    recipe_digest: str
    recipe: Mapping[str, object]
    recipe_labels: Mapping[str, object] = field(default_factory=dict)

    @property
    def is_head(self) -> bool:
        return self.start == 0

    @property
    def is_tail(self) -> bool:
        return self.end == self.source_layers


@dataclass(frozen=True)
class OpenRequest:
    session_id: str
    max_tokens: int  # KV positions this session reserves (prompt + generated)
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        check_session_id(self.session_id)
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be positive")


@dataclass(frozen=True)
class PrefillRequest:
    """A chunk of the prompt. Exactly one of ``token_ids`` (head) or ``hidden`` (others)."""

    session_id: str
    position: int  # position of the first row; must equal the session's position
    token_ids: tuple[int, ...] | None = None
    hidden: TensorBundle | None = None

    def __post_init__(self) -> None:
        check_session_id(self.session_id)
        _check_one_input(self.token_ids, self.hidden, self.position)
        if self.token_ids is not None and not self.token_ids:
            raise ValueError("a prefill needs at least one token")


@dataclass(frozen=True)
class DecodeRequest:
    """One generated token's step. Exactly one of ``token_id`` (head) or ``hidden``."""

    session_id: str
    position: int
    token_id: int | None = None
    hidden: TensorBundle | None = None

    def __post_init__(self) -> None:
        check_session_id(self.session_id)
        _check_one_input(None if self.token_id is None else (self.token_id,), self.hidden, self.position)


_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def check_session_id(session_id: str) -> None:
    # IDs reach logs and terminals: letters, digits and ._:- only, never control characters
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        raise ValueError("a session id must be 1..128 characters of A-Z a-z 0-9 . _ : -")


def _check_one_input(tokens: tuple[int, ...] | None, hidden: TensorBundle | None, position: int) -> None:
    if (tokens is None) == (hidden is None):
        raise ValueError("exactly one of token ids or a hidden-state bundle must be set")
    if position < 0:
        raise ValueError("position must be >= 0")


@dataclass(frozen=True)
class StepResult:
    """A step's outcome. On OK exactly one of ``hidden`` (head/middle) or ``token`` (tail)."""

    status: Status
    position: int = 0  # the session's position after the step
    hidden: TensorBundle | None = None
    token: TokenOutput | None = None


@dataclass(frozen=True)
class HealthResult:
    serving: bool
    state: str  # "not-loaded", "serving", "failed", "closed"
    active_sessions: int = 0
    detail: str = ""


@dataclass(frozen=True)
class MetricsResult:
    active_sessions: int = 0
    kv_tokens_reserved: int = 0
    kv_tokens_used: int = 0
    steps: int = 0
    tokens_processed: int = 0
    tokens_sampled: int = 0
    refused: int = 0
    cancelled: int = 0
    failed_steps: int = 0
    passes: int = 0  # llama_decode calls
    shared_passes: int = 0  # of them, those that carried steps of several sessions
    rows: int = 0  # rows those calls carried (rows / passes: batch occupancy)
    compute_seconds: float = 0.0  # time spent inside them
    fewer_thread_passes: int = 0  # of them, those run on fewer than n_threads (faster after idle: threads.py)
    rows_per_pass: HistogramSnapshot | None = None  # how many rows each call carried (batch sizes)


class ShardEngine(abc.ABC):
    """What every shard execution engine implements. Methods never raise for
    outcomes a peer can cause; they return a status."""

    @abc.abstractmethod
    def load(self, request: LoadRequest) -> LoadResult: ...

    @abc.abstractmethod
    def capabilities(self) -> EngineCapabilities | None: ...

    @abc.abstractmethod
    def open_session(self, request: OpenRequest) -> Status:
        """Admit a session, reserving its KV tokens; refused beyond capacity."""

    @abc.abstractmethod
    def prefill(self, request: PrefillRequest) -> StepResult: ...

    @abc.abstractmethod
    def decode(self, request: DecodeRequest) -> StepResult: ...

    @abc.abstractmethod
    def rollback(self, session_id: str, position: int) -> Status:
        """Forget everything at and after ``position`` (for replay after a failover)."""

    @abc.abstractmethod
    def cancel(self, session_id: str, *, keep_session: bool = False) -> Status:
        """Abort the session's in-flight step. Without ``keep_session`` the session
        is ended too (its cache freed; only ``release`` remains valid)."""

    @abc.abstractmethod
    def release(self, session_id: str) -> Status:
        """Free the session and its capacity. Idempotent."""

    @abc.abstractmethod
    def health(self) -> HealthResult: ...

    @abc.abstractmethod
    def metrics(self) -> MetricsResult: ...

    def close(self) -> None:  # noqa: B027 - a no-op default, not an abstract method
        """Free native resources. Idempotent."""
