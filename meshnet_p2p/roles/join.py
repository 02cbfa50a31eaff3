"""``meshnet-peer join``: a volunteer serving a range of layers to the swarm.

Cut (or reuse) the shard, load it, serve it over the gRPC data plane, join the
DHT through the bootstrap peers, and announce a signed capability report
(layers, addresses, TLS certificate, measured throughput, free capacity)
under ``model/<model digest>``, re-announced while alive. On SIGINT/SIGTERM:
announce departure, refuse new sessions, let open ones finish (bounded), exit 0.
This module turns the command's flags into :class:`JoinOptions` and opens the
model; the volunteer itself, and its duties, are roles/volunteer.py's.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable

import trio

from meshnet_p2p.core.errors import MeshnetError, unwrap_errors
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.dataplane.servicer import Limits
from meshnet_p2p.engine.contract import EngineOptions
from meshnet_p2p.engine.cut import inspect_gguf
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.engine.manifest import build_manifest
from meshnet_p2p.trust.policy import TrustPolicy

from .progress import StatusLine
from .volunteer import Source, Volunteer


@dataclass
class JoinOptions:
    model_path: str | None  # a whole GGUF file; None: fetch ``model_ref``'s span from peers
    layers: tuple[int, int] | None  # None: choose automatically
    num_layers: int | None  # for automatic choice; default: a third of the model
    listen_host: str
    listen_port: int
    bootstrap: list
    identity: Identity
    relay: Multiaddr | None = None
    announce: Multiaddr | None = None  # where others reach the data plane, if not where it listens
    engine: EngineOptions = EngineOptions()
    public_name: str = ""
    progress: Callable | None = None
    limits: Limits = Limits()
    metrics: str | None = None  # HOST:PORT to serve Prometheus metrics at (metrics.py)
    model_ref: str | None = None  # with no model_path: a name or model digest the trusted certifiers list
    trust: TrustPolicy | None = None  # whose catalogues name models (default: the bootstrap peers')

    @property
    def bootstrap_peer_ids(self) -> set:
        """Asked for a reachability check only when too few other peers are known."""
        addrs = (Multiaddr.parse(b) if isinstance(b, str) else b for b in self.bootstrap)
        return {a.peer_id for a in addrs if a.peer_id is not None}


def run(args: argparse.Namespace) -> int:
    """The ``join`` command: its flags become :class:`JoinOptions`."""
    from meshnet_p2p.engine.cut import parse_layer_range
    from meshnet_p2p.core.multiaddr import announced
    from meshnet_p2p.swarm.node import parse_listen
    from .flags import engine_options, keep_warm, metrics_listen, model_source, peer_identity, print_line, \
        required_seeds, run_listener, trust_policy
    from .progress import TerminalProgress

    host, port = parse_listen(args.listen)
    metrics = metrics_listen(args)
    layers = None if args.layers == "auto" else parse_layer_range(args.layers)
    seeds = required_seeds(args)
    identity = peer_identity(args, print_line)
    path, ref = model_source(args.model)
    opts = JoinOptions(
        model_path=path, model_ref=ref, trust=trust_policy(args, seeds), layers=layers, num_layers=args.num_layers,
        listen_host=host, listen_port=port, bootstrap=seeds, identity=identity,
        relay=Multiaddr.parse(args.relay) if args.relay else None,
        announce=announced(args.announce, identity.peer_id) if args.announce else None, engine=engine_options(args),
        public_name=args.public_name, progress=TerminalProgress("preparing the shard"),
        limits=Limits(session_idle_ms=int(args.idle_timeout * 1000), **keep_warm(args)), metrics=metrics,
    )
    return run_listener(args.listen, join, opts, print_line, doing="serve")


async def join(opts: JoinOptions, print_line: Callable[[str], None] = print) -> None:
    source = None
    if opts.model_path is not None:
        info = await trio.to_thread.run_sync(lambda: inspect_gguf(opts.model_path, source_sha256="0" * 64, verify=False))
        if info.is_cut:
            raise MeshnetError(f"{opts.model_path} is a shard; join needs the whole model to cut from")
        # the manifest's one pass over the file also gives its sha256, and so the model digest
        manifest = await trio.to_thread.run_sync(lambda: build_manifest(opts.model_path, opts.progress))
        source = Source(opts.model_path, manifest.source_sha256, manifest.n_layer, manifest.model_digest,
                         os.path.basename(opts.model_path).split(".")[0], manifest)
    engine = LlamaCppShardEngine()
    try:
        with unwrap_errors():
            await _serve(opts, engine, source, print_line)
    finally:
        engine.close()  # only after every task that could touch it has ended


async def _serve(opts, engine, source, print_line) -> None:
    status = StatusLine()  # on a terminal: one line redrawn in place, the others printed above it
    print_line = status.wrap(print_line)
    try:
        await Volunteer(opts, engine, source, print_line, status).run()
    finally:
        status.close()
