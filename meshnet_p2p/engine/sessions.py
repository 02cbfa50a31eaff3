"""Session admission and bookkeeping for one engine, as pure data (no llama.cpp).

Each session owns one llama.cpp sequence id and reserves, when admitted, the KV
positions it may use (prompt plus generation). Admission reserves up front and
refuses at once when a session slot or the KV budget is not free: a session
never fails half-way for lack of cache, and nothing queues silently.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .contract import OK, SamplingParams, Status, StatusCode


def context_refusal(max_tokens: int, n_ctx_per_session: int) -> Status | None:
    """The refusal of a session longer than a shard holds: the request's own error, never retried."""
    if max_tokens <= n_ctx_per_session:
        return None
    return Status(StatusCode.CAPACITY_EXHAUSTED,
                  f"session asks for {max_tokens} tokens; this shard holds at most {n_ctx_per_session} per session")


@dataclass
class Session:
    session_id: str
    seq_id: int
    reserved: int
    sampling: SamplingParams
    position: int = 0  # next position expected; everything before is in the cache
    cancelled: bool = False


@dataclass
class SessionTable:
    max_sessions: int
    kv_token_budget: int
    n_ctx_per_session: int
    sessions: dict[str, Session] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # lowest first: open sessions then hold consecutive sequence ids, which is what
        # lets llama.cpp batch their steps (batching.py)
        self._free_seq = list(range(self.max_sessions))

    @property
    def reserved(self) -> int:
        return sum(s.reserved for s in self.sessions.values())

    @property
    def used(self) -> int:
        return sum(s.position for s in self.sessions.values())

    def admit(self, session_id: str, max_tokens: int, sampling: SamplingParams) -> tuple[Status, Session | None]:
        if session_id in self.sessions:
            return Status(StatusCode.SESSION_EXISTS, f"session {session_id!r} is already open"), None
        too_long = context_refusal(max_tokens, self.n_ctx_per_session)
        if too_long is not None:
            return too_long, None
        if not self._free_seq:
            return (
                Status(StatusCode.CAPACITY_EXHAUSTED, f"all {self.max_sessions} session slots are in use", retryable=True),
                None,
            )
        free = self.kv_token_budget - self.reserved
        if max_tokens > free:
            return (
                Status(
                    StatusCode.CAPACITY_EXHAUSTED,
                    f"session asks for {max_tokens} KV tokens; {free} of {self.kv_token_budget} are free",
                    retryable=True,
                ),
                None,
            )
        session = Session(session_id, heapq.heappop(self._free_seq), max_tokens, sampling)
        self.sessions[session_id] = session
        return OK, session

    def lookup(self, session_id: str) -> tuple[Status, Session | None]:
        session = self.sessions.get(session_id)
        if session is None:
            return Status(StatusCode.UNKNOWN_SESSION, f"no open session {session_id!r} (never opened, or released)"), None
        if session.cancelled:
            return Status(StatusCode.CANCELLED, f"session {session_id!r} was cancelled; release it"), None
        return OK, session

    def check_step(self, session: Session, position: int, n_tokens: int) -> Status:
        if position != session.position:
            kind = "gap" if position > session.position else "overlap"
            return Status(
                StatusCode.POSITION_MISMATCH,
                f"step starts at position {position}, but session {session.session_id!r} is at {session.position} ({kind}); "
                "roll back first to replay",
            )
        if position + n_tokens > session.reserved:
            return Status(
                StatusCode.CONTEXT_EXHAUSTED,
                f"step would reach position {position + n_tokens}; the session reserved {session.reserved} tokens",
            )
        return OK

    def release(self, session_id: str) -> Session | None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            heapq.heappush(self._free_seq, session.seq_id)
        return session
