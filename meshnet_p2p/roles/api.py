"""``meshnet-peer api``: an OpenAI-compatible HTTP API in front of the swarm.

FastAPI on hypercorn's trio worker (both well kept; hypercorn is the ASGI
server that runs natively on trio, so the API lives in the same nursery tree
as everything else). Endpoints: ``/v1/models`` (what the swarm can serve right
now: a route must exist), ``/v1/completions`` and ``/v1/chat/completions``,
with SSE streaming (``stream: true``), as the official ``openai`` client
expects.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

import trio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from meshnet_p2p.client import Client, GenerationError
from meshnet_p2p.core.stats import Counters
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.lifecycle import until_signalled
from meshnet_p2p.core.local_addrs import listen_urls
from meshnet_p2p.swarm.node import BootstrapError
from meshnet_p2p.swarm.placement import NoRoute, plan_route


class CompletionRequest(BaseModel):
    model: str
    prompt: str | list[str] = ""
    max_tokens: int | None = Field(default=16, ge=1, le=8192)
    temperature: float | None = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0)
    stream: bool = False
    verify: Literal["auto", "always", "off"] | None = None  # meshnet: how the output is checked (default: the server's)


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=8192)
    temperature: float | None = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0)
    stream: bool = False
    verify: Literal["auto", "always", "off"] | None = None


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": kind}}, status_code=status)


def create_app(client: Client, model_name: str) -> FastAPI:
    app = FastAPI(title="meshnet-p2p", version="1")
    names = {model_name, client.model_digest}

    def sampling(req) -> SamplingParams:
        seed = req.seed if req.seed is not None else uuid.uuid4().int % 2**63
        return SamplingParams(temperature=req.temperature if req.temperature is not None else 1.0,
                              top_p=req.top_p if req.top_p is not None else 1.0, seed=seed)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        # OpenAI answers 400 with an error object, not FastAPI's 422
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:])}: {e.get('msg')}" for e in exc.errors())
        return _error(400, problems or "invalid request", "invalid_request_error")

    @app.exception_handler(MeshnetError)
    async def meshnet_error(request: Request, exc: MeshnetError):
        status = 503 if isinstance(exc, (NoRoute, GenerationError, BootstrapError)) else 400
        return _error(status, str(exc), "swarm_unavailable" if status == 503 else "invalid_request_error")

    def unknown_model(name: str):
        if name not in names:
            return _error(404, f"model {name!r} is not served here (try {model_name!r})", "model_not_found")
        return None

    @app.get("/v1/models")
    async def models():
        data = []
        try:  # a model whose recipe is dark here (or that no route serves) is not listed
            spans = await client.spans()
            plan_route(spans, 0, client.n_layer)
            data.append({"id": model_name, "object": "model", "created": 0, "owned_by": "meshnet-p2p",
                         "digest": client.model_digest, "peers": len({s.peer_id for s in spans})})
        except NoRoute:
            pass
        return {"object": "list", "data": data}

    async def run(prompt: str, max_tokens: int, params: SamplingParams, stream: bool, make_chunk, make_final,
                  verify: str | None = None):
        """The prompt goes to the swarm as is (a chat request's template is already applied)."""
        if not stream:
            result = await client.agenerate(prompt, max_tokens, params, verify=verify)
            return {**make_final(result), "meshnet_verification": result.verification}
        # every event is a dict until it is written out: text chunks, the final chunk, an error
        send, recv = trio.open_memory_channel[dict[str, Any]](1024)
        token = trio.lowlevel.current_trio_token()

        def on_token(text: str) -> None:
            if text:  # blocks the generation thread while the HTTP client is slow to read
                trio.from_thread.run(send.send, make_chunk(text, None), trio_token=token)

        async def produce(task_status=trio.TASK_STATUS_IGNORED):
            async with send:
                task_status.started()
                try:
                    result = await client.agenerate(prompt, max_tokens, params, on_token=on_token, verify=verify)
                    await send.send({**make_chunk("", result.stopped), "meshnet_verification": result.verification})
                except MeshnetError as e:
                    await send.send({"error": {"message": str(e), "type": "swarm_unavailable"}})

        async def events():
            async with trio.open_nursery() as nursery:
                await nursery.start(produce)
                async for item in recv:
                    yield f"data: {json.dumps(item)}\n\n"
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if (missing := unknown_model(req.model)) is not None:
            return missing
        prompt = req.prompt if isinstance(req.prompt, str) else "".join(req.prompt)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": cid, "object": "text_completion", "created": created, "model": req.model,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(finish)}]}

        def final(result) -> dict[str, Any]:
            doc = chunk(result.text, result.stopped)
            doc["usage"] = _usage(result)
            return doc

        return await run(prompt, req.max_tokens or 16, sampling(req), req.stream, chunk, final, req.verify)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        if (missing := unknown_model(req.model)) is not None:
            return missing
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        prompt = client.tokenizer.apply_chat_template(messages)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            delta = {"content": text} if text or finish is None else {}
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    "choices": [{"index": 0, "delta": {"role": "assistant", **delta}, "finish_reason": _finish(finish)}]}

        def final(result) -> dict[str, Any]:
            return {"id": cid, "object": "chat.completion", "created": created, "model": req.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                                 "finish_reason": _finish(result.stopped)}],
                    "usage": _usage(result)}

        max_tokens = req.max_completion_tokens or req.max_tokens or 256
        return await run(prompt, max_tokens, sampling(req), req.stream, chunk, final, req.verify)

    return app


ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions")  # any other path counts as "other"


def count_requests(app, requests: Counters):
    """``app`` counting each HTTP request by (endpoint, status): both from small sets,
    so a scanner trying paths cannot grow the metrics (docs/metrics.md)."""

    async def counted(scope, receive, send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        endpoint = scope.get("path") if scope.get("path") in ENDPOINTS else "other"
        status = []

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await app(scope, receive, sending)
        finally:  # nothing sent: the server answers 500
            requests.add((endpoint, str(status[0] if status else 500)))

    return counted


def _finish(stopped: str | None) -> str | None:
    return None if stopped is None else ("stop" if stopped == "eog" else "length")


def _usage(result) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": result.prompt_tokens + len(result.token_ids)}


def run(args) -> int:
    """The ``api`` command: a :class:`Client` of the swarm behind the HTTP API."""
    from meshnet_p2p.swarm.node import parse_listen
    from .flags import metrics_listen, model_source, print_line, required_seeds, run_listener, trust_policy

    host, port = parse_listen(args.listen)
    metrics = metrics_listen(args)
    seeds = required_seeds(args)
    path, ref = model_source(args.model)  # a file here, or a name/digest whose tokenizer is fetched
    client = Client(seeds, model_path=path, model_ref=ref, step_timeout=args.step_timeout,
                    trust=trust_policy(args, seeds), verify=args.verify, audit_rate=args.audit_rate,
                    keep_records=True)
    return run_listener(args.listen, serve_api, client, client.model_name, host, port, print_line, metrics)


async def serve_api(client: Client, model_name: str, host: str, port: int, print_line=print,
                    metrics: str | None = None) -> None:
    """``metrics``: HOST:PORT to serve Prometheus metrics at (the client's and the requests')."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    requests = Counters()
    app = count_requests(create_app(client, model_name), requests)
    async with trio.open_nursery() as outer:  # the metrics outlive the API's graceful shutdown, then end
        if metrics is not None:
            from .metrics import ApiCollector, ClientCollector, metrics_url, serve_metrics

            bound = await serve_metrics(outer, metrics, "api", ClientCollector(client), ApiCollector(requests))
            print_line(f"metrics on {metrics_url(*bound)}")
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            bound = await nursery.start(lambda task_status: serve(app, config, shutdown_trigger=stop.wait,
                                                                  task_status=task_status))
            for url in listen_urls(host, bound[0]):  # on a wildcard: a line per local address, loopback last
                print_line(f"listening on {url}")
            await until_signalled()
            stop.set()
        outer.cancel_scope.cancel()
