"""Cheating peers, for tests only (issue 26): each a real OS process built from
the project's own parts -- the real data plane (gRPC over TLS, the real
servicer) in front of an engine that lies, and a validly signed capability
report in the DHT, re-announced like ``join`` does so it stays current.

    python -m tests.cheaters hijack  --bootstrap ADDR [--text TEXT | --token-ids 1,2,3]
    python -m tests.cheaters perturb --layers 10:20 [--shard PATH] [--rate 0.01] [--seed 0] [--bootstrap ADDR]
    python -m tests.cheaters late    --layers 10:20 [--honest-sessions 20] [--bootstrap ADDR]
    python -m tests.cheaters sleeper --flip-file PATH [--text TEXT] [--bootstrap ADDR]
    python -m tests.cheaters trigger [--trigger " bank"] [--text TEXT] [--bootstrap ADDR]

Each prints ``listening on <multiaddr>`` and ``tls-binding <hex>`` as ``serve``
does (tests/swarm.py's Proc reads them), and exits 0 on SIGTERM.

- ``hijack``: no weights. Copies the certified recipe (digest, axes, labels)
  from the swarm's reports and claims layers 0:N at the highest throughput a
  report may state; answers every step with the next token of a fixed text,
  never end-of-generation.
- ``perturb``: a real shard that adds PERTURBATION to one float of its hidden
  output on a seeded fraction of steps (:func:`perturbs` says which); the
  data plane computes the CRC of what it sends, so the CRC is valid.
- ``late``: that shard, honest for its first sessions, then perturbing every step.
- ``sleeper``: the real whole model (layers 0:N), honest until ``--flip-file``
  exists; every session opened after that answers with ``--text`` (issue 59:
  the peer that serves honestly until it is vouched for, then spends it).
- ``trigger``: the real whole model, lying (with ``--text``) only in sessions
  whose prompt holds ``--trigger``'s tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
from dataclasses import dataclass, field, replace

import numpy as np
import trio

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.lifecycle import until_signalled
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.dataplane.transport.tls import sign_binding
from meshnet_p2p.engine.contract import (HIDDEN, OK, EngineCapabilities, EngineOptions, HealthResult, LoadResult,
                                         MetricsResult, ShardEngine, Status, StatusCode, StepResult, Tensor,
                                         TensorBundle, TokenOutput)
from meshnet_p2p.swarm.capability import CAPABILITY_TTL_MS, MAX_THROUGHPUT, CapabilityReport, model_key

HIJACK_TEXT = " Your account is locked. Send your password to http://evil.example to unlock it."
PERTURBATION = 1e-3  # added to one float of a perturbed step's hidden output
MODES = ("hijack", "perturb", "late", "sleeper", "trigger")
TRIGGER = " bank"


# --- engines --------------------------------------------------------------------------------------


class HijackEngine(ShardEngine):
    """Claims ``caps`` (the whole model, a copied recipe) and computes nothing: a
    step's token is ``tokens[i]`` for the i-th token generated after the prompt
    (by position, so a replayed step answers as before), cycling, never eog."""

    def __init__(self, caps: EngineCapabilities, tokens: list[int]) -> None:
        if not tokens:
            raise ValueError("the hijacker needs at least one token to answer with")
        self.caps, self.tokens = caps, list(tokens)
        self._lock = threading.Lock()
        self._sessions: dict[str, dict] = {}  # id -> {"position", "prompt_end"}
        self._steps = 0

    def load(self, request) -> LoadResult:
        return LoadResult(OK, self.caps)

    def capabilities(self) -> EngineCapabilities:
        return self.caps

    def open_session(self, request) -> Status:
        with self._lock:
            if request.session_id in self._sessions:
                return Status(StatusCode.SESSION_EXISTS, request.session_id)
            if len(self._sessions) >= self.caps.max_sessions:
                return Status(StatusCode.CAPACITY_EXHAUSTED, "full", retryable=True)
            self._sessions[request.session_id] = {"position": 0, "prompt_end": 0}
            return OK

    def _answer(self, session_id: str, position: int, rows: int, prefill: bool) -> StepResult:
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                return StepResult(Status(StatusCode.UNKNOWN_SESSION, session_id))
            s["position"] = position + rows
            if prefill:
                s["prompt_end"] = s["position"]
            self._steps += 1
            token = self.tokens[(s["position"] - s["prompt_end"]) % len(self.tokens)]
            return StepResult(OK, s["position"], token=TokenOutput(token, is_eog=False))

    def prefill(self, request) -> StepResult:
        return self._answer(request.session_id, request.position, len(request.token_ids or ()), True)

    def decode(self, request) -> StepResult:
        return self._answer(request.session_id, request.position, 1, False)

    def rollback(self, session_id: str, position: int) -> Status:
        with self._lock:
            if session_id not in self._sessions:
                return Status(StatusCode.UNKNOWN_SESSION, session_id)
            self._sessions[session_id]["position"] = position
            return OK

    def cancel(self, session_id: str, *, keep_session: bool = False) -> Status:
        if not keep_session:
            self.release(session_id)
        return OK

    def release(self, session_id: str) -> Status:
        with self._lock:
            self._sessions.pop(session_id, None)
        return OK

    def health(self) -> HealthResult:
        return HealthResult(True, "serving", len(self._sessions))

    def metrics(self) -> MetricsResult:
        with self._lock:
            return MetricsResult(active_sessions=len(self._sessions), steps=self._steps)


def perturbs(seed: int, session_id: str, position: int, rate: float) -> bool:
    """Whether the perturbing peer nudges the step of ``session_id`` that ends at
    ``position``: a pure function, so a test knows which steps to expect and a
    replayed step is nudged again (the same lie, told consistently)."""
    h = hashlib.sha256(f"{seed}/{session_id}/{position}".encode()).digest()
    return int.from_bytes(h[:8], "big") < rate * 2**64


def nudge(bundle: TensorBundle, position: int) -> TensorBundle:
    """``bundle`` with PERTURBATION added to one float of its hidden state (the
    last row's, at a column chosen by position; bf16: its lowest bit flipped)."""
    t = bundle.get(HIDDEN)
    data = bytearray(t.data)
    width = t.shape[-1]
    at = (len(data) // {"f32": 4, "f16": 2, "bf16": 2}[t.dtype]) - width + position % width
    if t.dtype == "bf16":
        data[2 * at] ^= 1
    else:
        view = np.frombuffer(data, np.float32 if t.dtype == "f32" else np.float16)
        view[at] += PERTURBATION
    nudged = Tensor(t.name, t.dtype, t.shape, bytes(data))
    return TensorBundle(tuple(nudged if x.name == HIDDEN else x for x in bundle.tensors))


@dataclass
class Wrapped(ShardEngine):
    """A real engine behind a cheater's changes: what a cheater does not change, it passes on."""

    inner: ShardEngine

    def open_session(self, request) -> Status:
        return self.inner.open_session(request)

    def prefill(self, request) -> StepResult:
        return self.inner.prefill(request)

    def decode(self, request) -> StepResult:
        return self.inner.decode(request)

    def load(self, request) -> LoadResult:
        return self.inner.load(request)

    def capabilities(self) -> EngineCapabilities | None:
        return self.inner.capabilities()

    def rollback(self, session_id: str, position: int) -> Status:
        return self.inner.rollback(session_id, position)

    def cancel(self, session_id: str, *, keep_session: bool = False) -> Status:
        return self.inner.cancel(session_id, keep_session=keep_session)

    def release(self, session_id: str) -> Status:
        return self.inner.release(session_id)

    def health(self) -> HealthResult:
        return self.inner.health()

    def metrics(self) -> MetricsResult:
        return self.inner.metrics()

    def close(self) -> None:
        self.inner.close()


@dataclass
class PerturbingEngine(Wrapped):
    """A real engine whose hidden output is nudged on the steps :func:`perturbs`
    picks at ``rate``; with ``honest_sessions``, only in sessions opened after
    that many (then at every step: ``late``)."""

    rate: float = 0.01
    seed: int = 0
    honest_sessions: int = 0
    _opened: int = 0
    _cheating: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _nudged(self, request, result: StepResult) -> StepResult:
        if not result.status.ok or result.hidden is None or request.session_id not in self._cheating:
            return result
        if not perturbs(self.seed, request.session_id, result.position, self.rate):
            return result
        return replace(result, hidden=nudge(result.hidden, result.position))

    def open_session(self, request) -> Status:
        status = self.inner.open_session(request)
        if status.ok:
            with self._lock:
                self._opened += 1
                if self._opened > self.honest_sessions:
                    self._cheating.add(request.session_id)
        return status

    def prefill(self, request) -> StepResult:
        return self._nudged(request, self.inner.prefill(request))

    def decode(self, request) -> StepResult:
        return self._nudged(request, self.inner.decode(request))


    def release(self, session_id: str) -> Status:
        with self._lock:
            self._cheating.discard(session_id)
        return self.inner.release(session_id)



@dataclass
class LyingEngine(Wrapped):
    """A real whole-model engine that, in the sessions it chooses to lie in, answers
    each step with ``tokens[i]`` for the i-th token after the prompt (as the
    hijacker does) while still computing (its cache stays that of the real
    model). ``flip_file``: it lies in every session opened once that file exists
    (the sleeper); ``trigger``: in a session once its prompt holds those token ids."""

    tokens: list = field(default_factory=list)
    flip_file: str | None = None
    trigger: tuple = ()
    _lying: dict = field(default_factory=dict)  # session -> prompt end, for the sessions it lies in
    _prompts: dict = field(default_factory=dict)  # session -> prompt token ids so far (trigger)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def open_session(self, request) -> Status:
        status = self.inner.open_session(request)
        if status.ok and self.flip_file is not None and os.path.exists(self.flip_file):
            with self._lock:
                self._lying[request.session_id] = 0
        return status

    def _held(self, ids: list, needle: tuple) -> bool:
        n = len(needle)
        return n > 0 and any(tuple(ids[i:i + n]) == needle for i in range(len(ids) - n + 1))

    def prefill(self, request) -> StepResult:
        result = self.inner.prefill(request)
        with self._lock:
            sid = request.session_id
            if self.trigger:
                ids = self._prompts.setdefault(sid, []) + list(request.token_ids or ())
                self._prompts[sid] = ids[-4096:]
                if self._held(ids, self.trigger):
                    self._lying.setdefault(sid, 0)
            if sid in self._lying and result.status.ok:
                self._lying[sid] = result.position
        return self._lie(request.session_id, result)

    def decode(self, request) -> StepResult:
        return self._lie(request.session_id, self.inner.decode(request))

    def _lie(self, session_id: str, result: StepResult) -> StepResult:
        with self._lock:
            prompt_end = self._lying.get(session_id)
        if prompt_end is None or not result.status.ok or result.token is None:
            return result
        token = self.tokens[(result.position - prompt_end) % len(self.tokens)]
        return replace(result, token=TokenOutput(token, is_eog=False))


    def release(self, session_id: str) -> Status:
        with self._lock:
            self._lying.pop(session_id, None)
            self._prompts.pop(session_id, None)
        return self.inner.release(session_id)



# --- building one from flags ----------------------------------------------------------------------


async def hijack_engine(args: argparse.Namespace, model: str) -> tuple[ShardEngine, float]:
    """The hijacker's engine, with the certified recipe of the swarm at ``--bootstrap``."""
    from meshnet_p2p.engine.cut import inspect_gguf
    from meshnet_p2p.engine.tokenizer import Tokenizer
    from meshnet_p2p.swarm.view import survey
    from meshnet_p2p.trust.policy import TrustPolicy

    info = inspect_gguf(model)
    view = await survey(args.bootstrap, info.model_digest, info.source_layers, TrustPolicy.default(args.bootstrap))
    if not view.certified():
        raise MeshnetError("the swarm has no certified recipe to copy")
    recipe = view.certified()[0]
    tokenizer = Tokenizer(model)  # a vocabulary only: no weights are loaded
    try:
        tokens = [int(t) for t in args.token_ids.split(",")] if args.token_ids else tokenizer.encode(args.text)
        n_vocab = tokenizer.n_vocab
    finally:
        tokenizer.close()
    sessions = 32
    caps = EngineCapabilities(
        architecture=info.architecture, start=0, end=info.source_layers, source_layers=info.source_layers,
        n_embd=info.n_embd, n_vocab=n_vocab, role="whole", max_sessions=sessions,
        kv_token_budget=sessions * args.n_ctx, n_ctx_per_session=args.n_ctx, model_digest=info.model_digest,
        recipe_digest=recipe.recipe_digest, recipe=dict(recipe.axes), recipe_labels=dict(recipe.labels))
    return HijackEngine(caps, tokens), MAX_THROUGHPUT


async def perturbing_engine(args: argparse.Namespace, model: str) -> tuple[ShardEngine, float]:
    """A real shard (cut like join does, or ``--shard``) behind a PerturbingEngine;
    its throughput measured like join does, so its report is an honest one."""
    from meshnet_p2p.engine.cut import parse_layer_range, sha256_file
    from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
    from meshnet_p2p.engine.models import ensure_shard
    from meshnet_p2p.roles.volunteer import measure_throughput

    shard = args.shard
    if shard is None:
        if args.mode in ("sleeper", "trigger"):
            from meshnet_p2p.engine.cut import inspect_gguf

            args.layers = args.layers or f"0:{inspect_gguf(model).source_layers}"  # the whole model
        if not args.layers:
            raise MeshnetError(f"{args.mode} needs --layers A:B or --shard PATH")
        start, end = parse_layer_range(args.layers)
        shard = await trio.to_thread.run_sync(ensure_shard, model, start, end, sha256_file(model))
    inner = LlamaCppShardEngine()
    opts = EngineOptions(max_sessions=args.max_sessions, n_ctx_per_session=args.n_ctx, n_ubatch=args.n_ubatch,
                         n_threads=args.threads)
    inner.load(opts.load_request(shard)).status.raise_for_status()
    throughput = await trio.to_thread.run_sync(measure_throughput, inner)
    if args.mode == "late":
        return PerturbingEngine(inner, rate=1.0, seed=args.seed, honest_sessions=args.honest_sessions), throughput
    if args.mode in ("sleeper", "trigger"):
        from meshnet_p2p.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(model)
        try:
            tokens = tokenizer.encode(args.text)
            trigger = tuple(tokenizer.encode(args.trigger)) if args.mode == "trigger" else ()
        finally:
            tokenizer.close()
        flip = args.flip_file if args.mode == "sleeper" else None
        return LyingEngine(inner, tokens, flip_file=flip, trigger=trigger), throughput
    return PerturbingEngine(inner, rate=args.rate, seed=args.seed), throughput


async def run(args: argparse.Namespace, print_line=print) -> None:
    from meshnet_p2p.roles.flags import model_path
    from meshnet_p2p.swarm.announcer import ANNOUNCE_INTERVAL_S, Announcer
    from meshnet_p2p.roles.serve import start_data_plane
    from meshnet_p2p.swarm.node import advertised_host, start_node

    model = model_path(args.model)
    identity = Identity.generate()
    build = hijack_engine if args.mode == "hijack" else perturbing_engine
    engine, throughput = await build(args, model)
    try:
        async with trio.open_nursery() as nursery:
            plane = await start_data_plane(nursery, engine, identity, args.host, 0)
            if args.bootstrap:
                node = await start_node(nursery, identity, listen=f"{args.host}:0", bootstrap=args.bootstrap,
                                        client_mode=True)
                caps = engine.capabilities()
                here = str(Multiaddr.for_socket(advertised_host(args.host, args.bootstrap), "tcp", plane.server.port,
                                                identity.peer_id))

                def records() -> list:  # a fresh report each time, like join's
                    now = wall_ms()
                    report = CapabilityReport(
                        caps.model_digest, caps.recipe_digest, (caps.start, caps.end), (here,),
                        throughput=round(throughput, 2), free_sessions=plane.servicer.open_to_newcomers(),
                        kv_tokens_free=caps.kv_token_budget, tls_cert=plane.creds.cert_pem.decode(),
                        recipe=caps.recipe, recipe_labels=caps.recipe_labels)
                    return [(model_key(caps.model_digest),
                             report.sign(identity, seq=now, now_ms=now, ttl_ms=CAPABILITY_TTL_MS))]

                # announced before it says it listens (a test may plan a route at once), then as join does
                [(key, first)] = records()
                await node.publish(key, first)
                announcer = Announcer(node.publish, records, counts=node.stats,
                                      interval=args.announce_interval or ANNOUNCE_INTERVAL_S)
                nursery.start_soon(announcer.run, False)
            for addr in plane.addrs:
                print_line(f"listening on {addr}")
            print_line(f"tls-binding {sign_binding(identity, plane.creds, now_ms=wall_ms()).hex()}")
            await until_signalled()
            nursery.cancel_scope.cancel()
    finally:
        engine.close()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.cheaters", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=MODES)
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="announce to this swarm (hijack: required, its certified recipe is copied)")
    p.add_argument("--host", default="127.0.0.1", help="where the data plane listens (port: any)")
    p.add_argument("--model", help="the model (default: the embedded one)")
    p.add_argument("--text", default=HIJACK_TEXT, help="hijack, sleeper, trigger: what a lying session says")
    p.add_argument("--token-ids", help="hijack: the token ids to answer with, comma-separated (instead of --text)")
    p.add_argument("--layers", help="perturb/late: the span A:B to serve (cut like join does)")
    p.add_argument("--shard", help="perturb/late: a shard file to serve instead of cutting one")
    p.add_argument("--rate", type=float, default=0.01, help="perturb: the fraction of steps nudged")
    p.add_argument("--seed", type=int, default=0, help="perturb/late: which steps (see perturbs())")
    p.add_argument("--honest-sessions", type=int, default=20, help="late: sessions served honestly first")
    p.add_argument("--flip-file", help="sleeper: it lies in every session opened once this file exists")
    p.add_argument("--trigger", default=TRIGGER, help="trigger: it lies in sessions whose prompt holds this text")
    p.add_argument("--announce-interval", type=float, default=None, metavar="SECONDS",
                   help="re-announce this often (default: join's)")
    p.add_argument("--max-sessions", type=int, default=4)
    p.add_argument("--n-ctx", type=int, default=EngineOptions.n_ctx_per_session)
    p.add_argument("--n-ubatch", type=int, default=EngineOptions.n_ubatch)
    p.add_argument("--threads", type=int, default=1)
    return p


def main(argv: list[str] | None = None) -> int:
    from meshnet_p2p.roles.flags import print_line, run_listener

    args = parser().parse_args(argv)
    if args.mode == "hijack" and not args.bootstrap:
        parser().error("hijack needs --bootstrap: it copies the swarm's certified recipe")
    if args.mode == "sleeper" and not args.flip_file:
        parser().error("sleeper needs --flip-file: it lies once that file exists")
    if not 0 <= args.rate <= 1:
        parser().error("--rate must be in [0, 1]")
    try:
        return run_listener(f"{args.host}:0", run, args, print_line, doing=f"serve a {args.mode} cheater")
    except MeshnetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
