"""A certifier's own replay: the whole model on its own machine is an oracle for every span.

Replays on other peers need peers that cut the model as the audited hop does (or, with a
float32 seam, chains of sub-spans inside it); a span nobody else serves has no replayer and
no audit ever checks it (issue 59: one identity alone decides what its layers give). A
certifier that holds the whole model's file needs nobody: it loads the hop's very layers
(a cut of its own copy, engine/models.py ``ensure_shard``) with the hop's recipe axes, and
replays the transcript's steps itself, in the same micro-batch structure, exactly as a peer
of the recipe would. It is its own witness, never a stranger's: a difference convicts for
the certifier (and for the clients that trust its verdicts), and the proof it publishes is
re-checked by anyone else's own replays as any proof is.

It is an oracle only for the recipe it computes: after loading, its engine's model and
recipe digests must be the hop's (the build, the CPU kernels, the seam, the micro-batch
size); otherwise it says nothing (None) and the audit replays on peers as before.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from types import SimpleNamespace
from typing import Callable

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.engine.contract import DecodeRequest, LoadRequest, OpenRequest, PrefillRequest, TensorBundle
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.engine.models import ensure_shard
from meshnet_p2p.trust.fraud_proof import output_digest

from .replay import ReplayRun
from .transcript import HopTranscript

MAX_ENGINES = 2  # spans kept loaded at once (the least recently used is closed first)


class LocalOracle:
    """Replays hop transcripts on this machine's copy of the whole model (``model_path``: its
    model digest ``model_digest``, the file's sha256 ``source_sha256``); ``name`` is who replays (the certifier's peer id), as
    a proof names its replayers. Thread-safe; :meth:`close` frees every engine."""

    def __init__(self, model_path: str, model_digest: str, source_sha256: str, name: str, *,
                 n_threads: int | None = None, load: Callable[[str, LoadRequest], object] | None = None) -> None:
        self.model_path = model_path
        self.model_digest = model_digest
        self.source_sha256 = source_sha256  # the file's own sha256 (what its cuts are bound to)
        self.name = name
        self.n_threads = n_threads
        self._load = load or _load_engine
        self._engines: OrderedDict[tuple, object] = OrderedDict()
        self._not_mine: set[tuple] = set()  # recipes this machine does not compute
        self._lock = threading.Lock()
        self.error = ""  # why the last span could not be loaded, if one could not

    def replay(self, t: HopTranscript) -> ReplayRun | None:
        """Every step of ``t`` through its layers here: the output digest of each, or None when
        this machine is no oracle for its recipe (or its engine refused a step)."""
        if t.fingerprint.model_digest != self.model_digest or not t.steps:
            return None
        with self._lock:  # one replay at a time: an engine's sessions are few
            engine = self._engine(t)
            if engine is None:
                return None
            sid = uuid.uuid4().hex
            if not engine.open_session(OpenRequest(sid, t.max_tokens, t.sampling)).ok:
                return None
            try:
                outputs = []
                for s in t.steps:
                    hidden = s.input if isinstance(s.input, TensorBundle) else None
                    tokens = None if hidden is not None else tuple(s.input)
                    if s.decode:
                        result = engine.decode(DecodeRequest(sid, s.position, token_id=None if hidden is not None
                                                             else tokens[0], hidden=hidden))
                    else:
                        result = engine.prefill(PrefillRequest(sid, s.position, token_ids=tokens, hidden=hidden))
                    if not result.status.ok:
                        return None
                    out = result.hidden if result.token is None else SimpleNamespace(
                        token_id=result.token.token_id, is_eog=result.token.is_eog, position=result.position)
                    outputs.append(output_digest(s.position, out))
            finally:
                engine.release(sid)
        return ReplayRun((self.name,), tuple(outputs))

    def _engine(self, t: HopTranscript):
        """Under the lock: an engine over ``t``'s layers with its recipe, or None."""
        axes = t.fingerprint.recipe_axes
        key = (t.start, t.end, t.n_layer, t.fingerprint.recipe_digest)
        if key in self._not_mine:
            return None
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key]
        while len(self._engines) >= MAX_ENGINES:
            self._engines.popitem(last=False)[1].close()
        whole = (t.start, t.end) == (0, t.n_layer)
        try:
            path = self.model_path if whole else ensure_shard(self.model_path, t.start, t.end, self.source_sha256)
            request = LoadRequest(path, max_sessions=1, n_ctx_per_session=max(t.max_tokens, LoadRequest.n_ctx_per_session),
                                  n_threads=self.n_threads, seam_dtype=str(axes.get("seam_dtype", "f32")),
                                  n_ubatch=int(axes.get("n_ubatch", 64)),
                                  source_sha256=self.source_sha256 if whole else None)
            engine = self._load(path, request)
        except (OSError, ValueError, TypeError, MeshnetError) as e:  # a bad axis or a file it cannot cut: no oracle
            self._not_mine.add(key)
            self.error = str(e)
            return None
        caps = engine.capabilities() if engine is not None else None
        if caps is None or (caps.model_digest, caps.recipe_digest, caps.start, caps.end) != \
                (t.fingerprint.model_digest, t.fingerprint.recipe_digest, t.start, t.end):
            if engine is not None:
                engine.close()
            self._not_mine.add(key)  # another build or kernels: its replay would not be exact
            return None
        self._engines[key] = engine
        return engine

    def close(self) -> None:
        with self._lock:
            while self._engines:
                self._engines.popitem()[1].close()


def _load_engine(path: str, request: LoadRequest):
    engine = LlamaCppShardEngine()
    result = engine.load(request)
    if not result.status.ok:
        engine.close()
        return None
    return engine
