"""``meshnet-peer serve``: one shard behind the gRPC data plane, no DHT.

The building block ``join`` stands on, and a way for an operator (and the
tests) to run a shard as its own process. It prints, when ready::

    listening on /ip4/127.0.0.1/tcp/PORT/p2p/<peer id>      (on a wildcard: a line per local address, loopback last)
    tls-binding <hex of the signed record vouching for its TLS certificate>
    reachable via <relay multiaddr>/p2p-circuit/p2p/<peer id>      (with --relay)
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import trio

from meshnet_p2p.engine.contract import EngineOptions
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.core.guard import Guard
from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.local_addrs import listen_multiaddrs
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.core.lifecycle import until_signalled
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.nat.relay import attach_to_relay
from meshnet_p2p.dataplane.transport.server import Server
from meshnet_p2p.dataplane.servicer import Limits, ShardRuntimeServicer
from meshnet_p2p.dataplane.transport.tls import TlsCredentials, make_tls_credentials, sign_binding


@dataclass
class ServeOptions:
    shard_path: str
    listen_host: str
    listen_port: int
    identity: Identity
    relay: Multiaddr | None = None
    engine: EngineOptions = EngineOptions()
    limits: Limits = Limits()


def load_engine(opts: ServeOptions) -> LlamaCppShardEngine:
    engine = LlamaCppShardEngine()
    engine.load(opts.engine.load_request(opts.shard_path)).status.raise_for_status()
    return engine


@dataclass
class DataPlane:
    servicer: ShardRuntimeServicer
    server: Server
    creds: TlsCredentials
    addrs: list[str]  # this peer's gRPC multiaddrs: where it listens, or every local address for a wildcard


async def start_data_plane(nursery: trio.Nursery, engine, identity: Identity, host: str, port: int, *,
                           relay: Multiaddr | None = None, limits: Limits = Limits(), on_open=None,
                           weights=None) -> DataPlane:
    """Serve ``engine`` over gRPC with a fresh identity-bound TLS certificate (and
    through ``relay`` too, if given), in ``nursery``; and ``weights`` (a WeightStore)
    on the same server, if given. Shared by serve and join."""
    creds = make_tls_credentials(identity)
    servicer = ShardRuntimeServicer(engine, identity=identity, limits=limits, on_open=on_open)
    # a worker per session the engine admits, and room beside them for sessions being refused or reclaimed
    server = servicer.register(Server(creds, host=host, port=port,
                                      max_workers=max(32, 2 * engine.capabilities().max_sessions + 8)))
    if weights is not None:  # parts of the model file, beside the shard (dataplane/weights.py)
        weights.register(server)
    await nursery.start(server.serve)
    nursery.start_soon(_reap_idle_sessions, servicer)
    if relay is not None:
        await nursery.start(attach_to_relay, relay, identity, server.adopt)  # relayed clients go straight to the server
    return DataPlane(servicer, server, creds, [str(a) for a in listen_multiaddrs(host, "tcp", server.port, identity.peer_id)])


async def _reap_idle_sessions(servicer: ShardRuntimeServicer) -> None:
    period = max(0.05, servicer.limits.session_idle_ms / 4000)
    guard = Guard("reap_idle")
    while True:
        await trio.sleep(period)
        async with guard:
            await trio.to_thread.run_sync(servicer.reap_idle)  # engine calls may wait for a step


async def serve(opts: ServeOptions, print_line=print) -> None:
    engine = load_engine(opts)
    try:
        async with trio.open_nursery() as nursery:
            plane = await start_data_plane(nursery, engine, opts.identity, opts.listen_host, opts.listen_port,
                                           relay=opts.relay, limits=opts.limits)
            for addr in plane.addrs:
                print_line(f"listening on {addr}")
            print_line(f"tls-binding {sign_binding(opts.identity, plane.creds, now_ms=wall_ms()).hex()}")
            if opts.relay is not None:
                print_line(f"reachable via {opts.relay}/p2p-circuit/p2p/{opts.identity.peer_id}")
            await until_signalled()
            nursery.cancel_scope.cancel()
    finally:
        engine.close()


def run(args: argparse.Namespace) -> int:
    """The ``serve`` command: a shard file, or one cut (once, cached) from --model at --layers."""
    from meshnet_p2p.engine.cut import parse_layer_range, sha256_file
    from meshnet_p2p.engine.models import ensure_shard
    from meshnet_p2p.swarm.node import parse_listen
    from .flags import engine_options, keep_warm, load_or_create_identity, model_path, print_line, run_listener
    from .progress import TerminalProgress

    host, port = parse_listen(args.listen)
    relay = Multiaddr.parse(args.relay) if args.relay else None
    if args.shard:
        if args.layers or args.model:
            raise MeshnetError("give either --shard, or --model/--layers, not both")
        shard = args.shard
        if not os.path.isfile(shard):
            raise MeshnetError(f"no shard file at {shard}")
    elif args.layers:
        start, end = parse_layer_range(args.layers)
        model = model_path(args.model)
        progress = TerminalProgress(f"layers {start}:{end}")
        shard = ensure_shard(model, start, end, sha256_file(model, progress), progress)
    else:
        raise MeshnetError("serve needs --shard PATH, or --layers A:B (with --model or the embedded model)")
    opts = ServeOptions(shard, host, port, load_or_create_identity(args.identity), relay=relay,
                        engine=engine_options(args), limits=Limits(max_message_bytes=args.max_message_bytes,
                                                                   session_idle_ms=int(args.idle_timeout * 1000),
                                                                   **keep_warm(args)))
    return run_listener(args.listen, serve, opts, print_line, doing="serve")


__all__ = ["ServeOptions", "serve", "Limits", "start_data_plane", "run"]
