"""``meshnet-peer serve``: one shard behind the gRPC data plane, no DHT.

The building block ``join`` stands on, and a way for an operator (and the
tests) to run a shard as its own process. It prints, when ready::

    listening on /ip4/127.0.0.1/tcp/PORT/p2p/<peer id>
    tls-binding <hex of the signed record vouching for its TLS certificate>
    reachable via <relay multiaddr>/p2p-circuit/p2p/<peer id>      (with --relay)
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import trio

from ..engine.contract import LoadRequest
from ..engine.llama_engine import LlamaCppShardEngine
from ..identity import Identity
from ..multiaddr import Multiaddr
from .relay import attach_to_relay
from .server import ShardServer
from .servicer import Limits, ShardRuntimeServicer
from .tls import make_tls_credentials, sign_binding


@dataclass
class ServeOptions:
    shard_path: str
    listen_host: str
    listen_port: int
    identity: Identity
    relay: Multiaddr | None = None
    max_sessions: int = 4
    n_ctx_per_session: int = 2048
    n_ubatch: int = 64
    n_threads: int | None = None
    limits: Limits = Limits()


def load_engine(opts: ServeOptions) -> LlamaCppShardEngine:
    engine = LlamaCppShardEngine()
    engine.load(LoadRequest(opts.shard_path, max_sessions=opts.max_sessions, n_ctx_per_session=opts.n_ctx_per_session,
                            n_ubatch=opts.n_ubatch, n_threads=opts.n_threads)).status.raise_for_status()
    return engine


async def serve(opts: ServeOptions, print_line=print) -> None:
    engine = load_engine(opts)
    try:
        creds = make_tls_credentials()
        servicer = ShardRuntimeServicer(engine, peer_id=str(opts.identity.peer_id), limits=opts.limits)
        server = ShardServer(servicer, creds, host=opts.listen_host, port=opts.listen_port)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            proto = "ip6" if ":" in opts.listen_host else "ip4"
            print_line(f"listening on /{proto}/{opts.listen_host}/tcp/{server.port}/p2p/{opts.identity.peer_id}")
            print_line(f"tls-binding {sign_binding(opts.identity, creds, now_ms=int(time.time() * 1000)).hex()}")
            if opts.relay is not None:
                await nursery.start(attach_to_relay, opts.relay, opts.identity, ("127.0.0.1", server.port))
                print_line(f"reachable via {opts.relay}/p2p-circuit/p2p/{opts.identity.peer_id}")
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    break
            nursery.cancel_scope.cancel()
    finally:
        engine.close()


__all__ = ["ServeOptions", "serve", "Limits"]
