"""A whole route in one process: a chain of shard engines covering every layer.

This is what ``meshnet-peer generate --local`` runs, and the in-process
baseline that the networked route must match token for token. The chain
drives each engine through the same ShardEngine calls a network hop makes.
"""

from __future__ import annotations

import uuid
from typing import Callable, Sequence

from meshnet_p2p.engine.contract import (
    DecodeRequest,
    EngineError,
    LoadRequest,
    OpenRequest,
    PrefillRequest,
    SamplingParams,
    ShardEngine,
    StepResult,
    TokenOutput,
)
from meshnet_p2p.engine.cut import LayerRangeError
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.core.errors import MeshnetError
from .generation import PREFILL_STEP_UBATCHES, Generation, generate, prefill_chunks  # noqa: F401 (re-exported)
from meshnet_p2p.engine.models import ensure_shard

class RouteError(MeshnetError):
    pass


def parse_split(text: str, n_layer: int) -> list[tuple[int, int]]:
    """``"10,20"`` with 30 layers -> [(0, 10), (10, 20), (20, 30)]. Empty -> one whole range."""
    cuts: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit():
            raise LayerRangeError(f"split {text!r}: {part!r} is not a layer number")
        cuts.append(int(part))
    bounds = [0, *cuts, n_layer]
    if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise LayerRangeError(f"split {text!r} must be strictly increasing layer numbers between 1 and {n_layer - 1}")
    return list(zip(bounds, bounds[1:], strict=False))


class LocalRoute:
    def __init__(self, engines: Sequence[ShardEngine]) -> None:
        caps = [e.capabilities() for e in engines]
        if not caps or any(c is None for c in caps):
            raise RouteError("every engine of a route must be loaded")
        expect = 0
        for c in caps:
            if c.start != expect:
                raise RouteError(f"route has a gap or overlap at layer {expect} (next shard starts at {c.start})")
            if (c.model_digest, c.recipe_digest) != (caps[0].model_digest, caps[0].recipe_digest):
                raise RouteError("shards of one route disagree on the model or the recipe")
            expect = c.end
        if expect != caps[0].source_layers:
            raise RouteError(f"route stops at layer {expect} of {caps[0].source_layers}")
        self.engines = list(engines)
        self.caps = caps
        self.n_ubatch = int(caps[0].recipe["n_ubatch"])

    @classmethod
    def from_model(
        cls,
        model_path: str,
        ranges: Sequence[tuple[int, int]],
        *,
        source_sha256: str,
        n_ubatch: int = 64,
        seam_dtype: str = "f32",
        max_sessions: int = 4,
        n_ctx_per_session: int = 2048,
        n_threads: int | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> "LocalRoute":
        engines: list[LlamaCppShardEngine] = []
        try:
            for start, end in ranges:
                whole = (start, end) == (0, ranges[-1][1]) and len(ranges) == 1
                path = model_path if whole else ensure_shard(model_path, start, end, source_sha256, progress)
                engine = LlamaCppShardEngine()
                result = engine.load(
                    LoadRequest(
                        path,
                        max_sessions=max_sessions,
                        n_ctx_per_session=n_ctx_per_session,
                        n_threads=n_threads,
                        seam_dtype=seam_dtype,
                        n_ubatch=n_ubatch,
                        source_sha256=source_sha256 if whole else None,
                        progress=progress,
                    )
                )
                engines.append(engine)
                result.status.raise_for_status()
            return cls(engines)
        except BaseException:
            for e in engines:
                e.close()
            raise

    def close(self) -> None:
        for e in self.engines:
            e.close()

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        *,
        stop_at_eog: bool = True,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """Generate up to ``max_tokens`` tokens after ``prompt`` (stopping early at an
        end-of-generation token, which is not included): the one loop every route
        runs (generation.py), here over this chain of engines."""
        if not prompt:
            raise RouteError("the prompt is empty")
        if max_tokens < 1:
            raise RouteError("max_tokens must be at least 1")
        sid = self.open(len(prompt) + max_tokens, sampling)
        try:
            return generate(LocalSession(self, sid), prompt, max_tokens, stop_at_eog=stop_at_eog, on_token=on_token)
        finally:
            self.release(sid)

    def open(self, max_tokens: int, sampling: SamplingParams | None = None, *, session_id: str | None = None) -> str:
        """Open a session on every shard (all or none). Returns its id."""
        sid = session_id or uuid.uuid4().hex
        opened: list[ShardEngine] = []
        try:
            for e in self.engines:
                e.open_session(OpenRequest(sid, max_tokens, sampling or SamplingParams())).raise_for_status()
                opened.append(e)
        except BaseException:
            for e in opened:
                e.release(sid)
            raise
        return sid

    def release(self, session_id: str) -> None:
        for e in self.engines:
            e.release(session_id)

    def prefill(self, session_id: str, prompt: Sequence[int]) -> StepResult:
        """The whole prompt (see :func:`prefill_chunks`). Returns the last step's result."""
        result = None
        for start, end in prefill_chunks(len(prompt), self.n_ubatch):
            result = self.step(session_id, start, prompt[start:end])
        return result

    def step(self, session_id: str, position: int, token_ids: Sequence[int], *, decode: bool = False) -> StepResult:
        """Run one prefill chunk (or one decode token) through every shard in turn;
        returns the tail's result. Raises :class:`EngineError` on a non-OK status."""
        hidden = None
        result = None
        for engine in self.engines:
            if decode:
                request = DecodeRequest(session_id, position, token_id=None if hidden else token_ids[0], hidden=hidden)
                result = engine.decode(request)
            else:
                request = PrefillRequest(session_id, position, token_ids=None if hidden else tuple(token_ids), hidden=hidden)
                result = engine.prefill(request)
            if not result.status.ok:
                raise EngineError(result.status)
            hidden = result.hidden
        return result


class LocalSession:
    """One open session of a :class:`LocalRoute`, as generation.py steps a route."""

    def __init__(self, route: LocalRoute, session_id: str) -> None:
        self.route = route
        self.session_id = session_id
        self.n_ubatch = route.n_ubatch

    def step(self, position: int, token_ids: Sequence[int], decode: bool) -> TokenOutput:
        return self.route.step(self.session_id, position, token_ids, decode=decode).token
