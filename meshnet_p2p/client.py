"""The client: find a route through the swarm and generate tokens through it.

    client = Client(bootstrap=["/ip4/127.0.0.1/udp/4001/p2p/12D3KooW..."])
    result = client.generate("The capital of France is", max_tokens=32)   # plain code
    result = await client.agenerate(...)                                  # from trio

Discovery: a DHT node in client mode fetches the signed capability reports
for the model; only reports that agree on the recipe form a route (a peer on
another recipe would compute other numbers). The route is the cheapest chain
of peers covering every layer (:func:`meshnet_p2p.placement.plan_route`).

The client drives every hop itself and keeps each hop's inputs. When a peer
dies, stalls past the step deadline or answers with an error, the client bans
it for a while, plans a replacement for just that span of layers, replays the
span's inputs into the replacement (rebuilding its cache), and goes on. With
greedy sampling (or a seed) the output is the same as without the failure.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

import trio

from ._proto import shard_runtime_pb2 as pb
from .capability import model_key
from .dataplane.client import (
    SessionStream,
    ShardClient,
    ShardConnectionError,
    ShardError,
    open_channel,
)
from .dataplane.tls import cert_identity
from .engine.contract import SamplingParams, TensorBundle
from .errors import MeshnetError, unwrap_errors
from .identity import Identity, PeerId
from .multiaddr import Multiaddr
from .local import Generation, prefill_chunks
from .network import start_node
from .placement import NoRoute, Span, plan_route


class GenerationError(MeshnetError):
    pass


@dataclass
class GenerationResult(Generation):
    """A generation through the swarm: the local one's figures, plus its text and route."""

    text: str = ""
    route: list[dict] = field(default_factory=list)
    failovers: int = 0


async def discover(bootstrap: Sequence[str | Multiaddr], model_digest: str) -> list[Span]:
    """Capability reports for a model, as spans, from a short-lived client-mode DHT node."""
    with unwrap_errors():
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, Identity.generate(), bootstrap=bootstrap, client_mode=True)
            records = await node.get(model_key(model_digest))
            nursery.cancel_scope.cancel()
    spans = [Span.from_report(r) for r in records]
    return [s for s in spans if not s.departing]


def pick_recipe(spans: list[Span], n_layer: int) -> list[Span]:
    """The spans of the one recipe that can serve the whole model (the one with most peers)."""
    groups: dict[str, list[Span]] = {}
    for s in spans:
        groups.setdefault(s.record.content["recipe_digest"], []).append(s)
    for group in sorted(groups.values(), key=len, reverse=True):
        try:
            plan_route(group, 0, n_layer)
            return group
        except NoRoute:
            continue
    return max(groups.values(), key=len) if groups else []


@dataclass
class _Hop:
    span: Span
    client: ShardClient
    stream: SessionStream
    n_ubatch: int  # the route's recipe: prefill steps must be whole micro-batches of it
    history: list[tuple[int, object, bool]] = field(default_factory=list)  # (position, input, decode)

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            self.client.close()


class RouteSession:
    """One generation's session across a chain of peers, with failover."""

    def __init__(self, spans_provider: Callable[[], list[Span]], n_layer: int, *, max_tokens: int,
                 sampling: SamplingParams, step_timeout: float = 10.0, max_failovers: int = 4,
                 ban_seconds: float = 60.0, on_event: Callable[[str], None] | None = None,
                 latency_ms: dict[str, float] | None = None) -> None:
        self.spans_provider = spans_provider
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.step_timeout = step_timeout
        self.max_failovers = max_failovers
        self.ban_seconds = ban_seconds
        self.on_event = on_event or (lambda msg: None)
        self.session_id = uuid.uuid4().hex
        self.epoch = 0
        self.banned: dict[str, float] = {}
        self.latency_ms: dict[str, float] = latency_ms if latency_ms is not None else {}
        self.failovers = 0
        self.spans = spans_provider()
        self.hops = self._open_chain(0, n_layer)

    # --- building the chain -------------------------------------------------------------------

    def _banned_now(self) -> set[str]:
        now = time.monotonic()
        return {p for p, until in self.banned.items() if until > now}

    def _open_chain(self, start: int, end: int) -> list[_Hop]:
        last_error: Exception | None = None
        for attempt in range(self.max_failovers + 1):
            route = plan_route(self.spans, start, end, banned=self._banned_now(), latency_ms=self.latency_ms)
            hops: list[_Hop] = []
            try:
                for span in route:
                    hops.append(self._open_hop(span))
                return hops
            except MeshnetError as e:  # typed peer errors and broken connections included
                last_error = e
                bad = route[len(hops)].peer_id
                self.banned[bad] = time.monotonic() + self.ban_seconds
                self.on_event(f"cannot open a session on {bad}: {e}")
                for h in hops:
                    h.close()
                time.sleep(min(2.0, 0.1 * 2**attempt))
                self.spans = self.spans_provider()
        raise GenerationError(f"could not open a route for layers {start}-{end - 1}: {last_error}")

    def _open_hop(self, span: Span) -> _Hop:
        c = span.record.content
        cert = c.get("tls_cert", "").encode()
        peer = PeerId.from_string(c["peer_id"])
        if cert_identity(cert) != peer:  # a report cannot pass off another peer's certificate
            raise MeshnetError(f"the TLS certificate in {peer}'s report belongs to another peer")
        if c.get("relay"):
            relay = Multiaddr.parse(c["relay"])
            channel = open_channel(cert, relay=(relay.host, relay.port), peer_id=peer)
        else:
            addr = Multiaddr.parse(c["addrs"][0])
            if addr.peer_id != peer:
                raise MeshnetError(f"report of {peer} advertises an address of another peer")
            channel = open_channel(cert, address=(addr.host, addr.port))
        client = ShardClient(channel, timeout=self.step_timeout)
        try:
            cap = client.capability()  # also sets up the connection (TLS handshake)
            t0 = time.perf_counter()
            client.health()
            self.latency_ms[span.peer_id] = (time.perf_counter() - t0) * 1000  # a round trip, used when re-planning
            if cap.fingerprint.model_digest != c["model_digest"] or cap.fingerprint.recipe_digest != c["recipe_digest"]:
                raise MeshnetError(f"{peer} serves another model or recipe than it announced")
            if (cap.layers.start, cap.layers.end) != (span.start, span.end):
                raise MeshnetError(f"{peer} serves other layers than it announced")
            s = self.sampling
            stream = client.session(cap.fingerprint, max_tokens=self.max_tokens, session_id=self.session_id,
                                    route_epoch=self.epoch, timeout=None,
                                    sampling=pb.Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed))
        except BaseException:
            client.close()
            raise
        return _Hop(span, client, stream, int(cap.fingerprint.recipe_axes["n_ubatch"]))

    # --- stepping -------------------------------------------------------------------------------

    def _through(self, hop: _Hop, position: int, payload, decode: bool):
        """One hop of a step, remembered for replay; returns what the next hop takes
        (the tail's reply at the end). A peer that froze (or a route that died)
        misses step_timeout: ShardConnectionError."""
        given = {"hidden": payload} if isinstance(payload, TensorBundle) else {"token_ids": payload}
        reply = hop.stream.step(position, decode=decode, timeout=self.step_timeout, **given)
        hop.history.append((position, payload, decode))
        return reply.hidden if reply.hidden is not None else reply

    @property
    def n_ubatch(self) -> int:
        return self.hops[0].n_ubatch  # every hop serves the same recipe

    def step(self, position: int, token_ids: Sequence[int], decode: bool):
        """One step through every hop; returns the tail's reply."""
        payload: object = tuple(token_ids)
        i = 0
        while i < len(self.hops):
            try:
                payload = self._through(self.hops[i], position, payload, decode)
            except (ShardConnectionError, ShardError) as e:
                self._replace(i, e)
                continue  # retry this step on the replacement
            i += 1
        return payload

    def _replace(self, index: int, error: Exception) -> None:
        failed = self.hops[index]
        self.failovers += 1
        if self.failovers > self.max_failovers:
            raise GenerationError(f"gave up after {self.max_failovers} failovers; last: {error}")
        self.banned[failed.span.peer_id] = time.monotonic() + self.ban_seconds
        self.on_event(f"peer {failed.span.peer_id} failed on layers {failed.span.start}-{failed.span.end - 1} ({error}); rerouting")
        failed.close()
        self.spans = self.spans_provider()
        self.epoch += 1
        new_hops = self._open_chain(failed.span.start, failed.span.end)
        # Rebuild the replacement's caches: replay everything the failed hop was given.
        for position, payload, decode in failed.history:
            for hop in new_hops:
                payload = self._through(hop, position, payload, decode)
        self.hops[index : index + 1] = new_hops

    def route(self) -> list[dict]:
        return [{"peer_id": h.span.peer_id, "layers": [h.span.start, h.span.end]} for h in self.hops]

    def close(self) -> None:
        for hop in self.hops:
            try:
                hop.stream.release(timeout=self.step_timeout)  # a peer that froze must not hang us here
            except MeshnetError:
                pass
            hop.client.close()


class Client:
    def __init__(self, bootstrap: Sequence[str | Multiaddr], *, model_path: str | None = None,
                 model_digest: str | None = None, step_timeout: float = 10.0, max_failovers: int = 4,
                 on_event: Callable[[str], None] | None = None) -> None:
        from .engine.cut import inspect_gguf
        from .engine.tokenizer import Tokenizer
        from .models import default_model_path

        self.bootstrap = list(bootstrap)
        path = model_path or default_model_path()
        info = inspect_gguf(path)  # hashes an uncut model; a shard carries its source's digest
        self.n_layer = info.source_layers
        self.model_digest = model_digest or info.model_digest
        self.tokenizer = Tokenizer(path)
        # the file name up to its first dot: "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
        self.model_name = os.path.basename(path).split(".")[0] or self.model_digest
        self.step_timeout = step_timeout
        self.max_failovers = max_failovers
        self.on_event = on_event
        self.latency_ms: dict[str, float] = {}  # peer -> measured round trip, kept across generations

    async def spans(self) -> list[Span]:
        return pick_recipe(await discover(self.bootstrap, self.model_digest), self.n_layer)

    def generate(self, prompt: str, max_tokens: int = 64, sampling: SamplingParams | None = None, *,
                 chat: bool = False, on_token: Callable[[str], None] | None = None, stop_at_eog: bool = True) -> GenerationResult:
        """From plain (non-trio) code."""
        return self._generate(lambda: trio.run(self.spans), prompt, max_tokens, sampling or SamplingParams(),
                              chat, on_token, stop_at_eog)

    async def agenerate(self, prompt: str, max_tokens: int = 64, sampling: SamplingParams | None = None, *,
                        chat: bool = False, on_token: Callable[[str], None] | None = None,
                        stop_at_eog: bool = True) -> GenerationResult:
        """From trio: the token loop runs in one worker thread (blocking gRPC), and
        route discovery comes back to this trio loop."""
        provider = lambda: trio.from_thread.run(self.spans)  # noqa: E731
        return await trio.to_thread.run_sync(self._generate, provider, prompt, max_tokens,
                                             sampling or SamplingParams(), chat, on_token, stop_at_eog)

    def _generate(self, provider, prompt, max_tokens, sampling, chat, on_token, stop_at_eog) -> GenerationResult:
        text = self.tokenizer.chat_prompt(prompt) if chat else prompt
        ids = self.tokenizer.encode(text)
        if not ids:
            raise GenerationError("the prompt is empty")
        session = RouteSession(provider, self.n_layer, max_tokens=len(ids) + max_tokens, sampling=sampling,
                               step_timeout=self.step_timeout, max_failovers=self.max_failovers, on_event=self.on_event,
                               latency_ms=self.latency_ms)
        decoder = self.tokenizer.stream_decoder()
        out: list[int] = []
        stopped = "length"
        try:
            t0 = time.perf_counter()
            reply = None
            for start, end in prefill_chunks(len(ids), session.n_ubatch):
                reply = session.step(start, ids[start:end], decode=False)
            t1 = time.perf_counter()
            position = len(ids)
            while True:
                if reply.is_eog and stop_at_eog:
                    stopped = "eog"
                    break
                out.append(reply.token_id)
                if on_token:
                    on_token(decoder.feed(reply.token_id))
                if len(out) >= max_tokens:
                    break
                reply = session.step(position, [reply.token_id], decode=True)
                position += 1
            t2 = time.perf_counter()
            if on_token:
                on_token(decoder.flush())
            return GenerationResult(prompt_tokens=len(ids), token_ids=out, ttft_ms=(t1 - t0) * 1000,
                                    decode_ms=(t2 - t1) * 1000, stopped=stopped, text=self.tokenizer.decode(out),
                                    route=session.route(), failovers=session.failovers)
        finally:
            session.close()
