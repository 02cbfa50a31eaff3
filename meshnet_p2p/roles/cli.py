"""``meshnet-peer``: the one place that parses flags and prints.

Every expected failure is a :class:`MeshnetError` and is printed as one line
``error: ...`` with exit status 2 (argparse uses 2 for bad flags too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from meshnet_p2p import __version__
from meshnet_p2p.core.errors import MeshnetError, sanitize, unwrap_errors

EXIT_ERROR = 2


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _positive_float(text: str) -> float:
    value = _nonneg_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _add_identity(p: argparse.ArgumentParser) -> None:
    p.add_argument("--identity", help="key file (created if missing; default: a fresh identity per run)")


def _add_bootstrap(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR", help=help)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """What `serve` and `join` share: how the engine runs (defaults: EngineOptions')."""
    from meshnet_p2p.engine.contract import EngineOptions

    d = EngineOptions()
    p.add_argument("--max-sessions", type=_positive, default=d.max_sessions,
                   help="concurrent sessions (default: as many as --kv-memory holds at --n-ctx each, at most 32)")
    p.add_argument("--kv-memory", type=_positive, default=d.kv_memory_mib, metavar="MIB",
                   help=f"memory for the sessions' KV caches when --max-sessions is not given (default {d.kv_memory_mib})")
    p.add_argument("--n-ubatch", type=_positive, default=d.n_ubatch)
    p.add_argument("--n-ctx", type=_positive, default=d.n_ctx_per_session, help="KV tokens per session")
    p.add_argument("--threads", type=_positive, default=d.n_threads)
    p.add_argument("--idle-timeout", type=_positive_float, default=120.0, metavar="SECONDS",
                   help="release a session that sends nothing for this long (default 120)")


def _add_metrics(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics "
                   "(port 0: any; docs/metrics.md)")


def _metrics_listen(args: argparse.Namespace) -> str | None:
    """--metrics, checked before anything starts (a bad value: one error line, exit 2)."""
    if args.metrics is None:
        return None
    from .metrics import parse_metrics_listen

    parse_metrics_listen(args.metrics)
    return args.metrics


def _add_trust(p: argparse.ArgumentParser) -> None:
    """Whose certificates count, beyond the bootstrap peers' keys (and --identity's)."""
    p.add_argument("--trust", action="append", default=[], metavar="PEER_ID",
                   help="also accept certificates signed by this peer (repeatable)")
    p.add_argument("--trust-file", metavar="PATH", help="a file of certifier peer IDs to accept, one a line")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshnet-peer", description="meshnet-p2p: run LLMs across volunteer peers.")
    p.add_argument("--version", action="version", version=f"meshnet-p2p {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    shard = sub.add_parser("shard", help="cut and inspect layer shards of a GGUF model")
    shard_sub = shard.add_subparsers(dest="shard_command", required=True)
    cut = shard_sub.add_parser("cut", help="write the shard of layers [A, B) of a model")
    cut.add_argument("--model", help="source GGUF (default: the embedded SmolLM2-135M-Instruct)")
    cut.add_argument("--layers", required=True, help="layer range A:B (B exclusive)")
    cut.add_argument("--out", required=True, help="output GGUF path")
    info = shard_sub.add_parser("info", help="print a model's or shard's identity as JSON")
    info.add_argument("path")

    ident = sub.add_parser("identity", help="create or show this peer's Ed25519 identity")
    ident_sub = ident.add_subparsers(dest="identity_command", required=True)
    for name, text in (("new", "create a new identity key file (0600)"), ("show", "print the peer ID of a key file")):
        cmd = ident_sub.add_parser(name, help=text)
        cmd.add_argument("--identity", help="key file (default: $XDG_CONFIG_HOME/meshnet-p2p/identity.key)")
        if name == "new":
            cmd.add_argument("--force", action="store_true", help="replace an existing key file")

    boot = sub.add_parser("bootstrap", help="run a bootstrap peer (DHT and gossip only, no model)")
    boot.add_argument("--listen", default="127.0.0.1:4001", help="HOST:PORT for the UDP socket (port 0: any)")
    _add_identity(boot)
    _add_bootstrap(boot, "other bootstrap peers to join (repeatable; default $MESHNET_BOOTSTRAP)")
    _add_metrics(boot)

    relay = sub.add_parser("relay", help="run a relay for peers behind NAT (splices TLS it cannot read)")
    relay.add_argument("--listen", default="0.0.0.0:4002", help="HOST:PORT for the TCP socket (port 0: any); on "
                       "every address by default, announced at the one this machine reaches its bootstrap peers from")
    _add_identity(relay)
    _add_bootstrap(relay, "also join the DHT through these peers (repeatable; default $MESHNET_BOOTSTRAP)")
    relay.add_argument("--announce", metavar="MULTIADDR", help="the address peers and clients reach this relay at, "
                       "when not where it listens (port forwarding, a proxy): /ip4/HOST/tcp/PORT")
    relay.add_argument("--max-reservations", type=_positive, default=128, help="peers it keeps reachable at once")
    relay.add_argument("--max-connections-per-peer", type=_positive, default=16,
                       help="circuits (spliced connections) per reserved peer at once")
    relay.add_argument("--max-circuits-per-source", type=_positive, default=None,
                       help="circuits to one reserved peer from one client network (IPv4 /24, IPv6 /48; a private "
                       "address alone) at once (default: a quarter of --max-connections-per-peer, at least 2)")
    relay.add_argument("--max-mbps-per-peer", type=_positive_float, default=512.0,
                       help="bandwidth per reserved peer, all its circuits together, megabits/s")
    _add_metrics(relay)

    serve = sub.add_parser("serve", help="serve one shard over the gRPC data plane (no DHT)")
    serve.add_argument("--shard", help="a cut shard GGUF (or use --model with --layers)")
    serve.add_argument("--model", help="source GGUF to cut from (default: the embedded model)")
    serve.add_argument("--layers", help="layer range A:B to cut from --model")
    serve.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT for gRPC")
    _add_identity(serve)
    serve.add_argument("--relay", metavar="MULTIADDR", help="also be reachable through this relay")
    _add_engine_flags(serve)
    serve.add_argument("--max-message-bytes", type=_positive, default=16 << 20)

    join = sub.add_parser("join", help="volunteer: serve a range of layers to the swarm")
    join.add_argument("--model", help="GGUF model to serve (default: the embedded SmolLM2-135M-Instruct)")
    join.add_argument("--layers", default="auto", help="A:B, or auto: what the swarm most needs (default)")
    join.add_argument("--num-layers", type=_positive, help="with --layers auto: how many layers (default: a third)")
    join.add_argument("--listen", default="0.0.0.0:0", help="HOST:PORT for the data plane (gRPC over TLS); on every "
                      "address by default, announced at the one this machine reaches its bootstrap peers from")
    _add_bootstrap(join, "bootstrap peers (repeatable; default $MESHNET_BOOTSTRAP, then bootstrap/peers.txt)")
    _add_identity(join)
    join.add_argument("--relay", metavar="MULTIADDR", help="be reachable through this relay (behind NAT)")
    join.add_argument("--announce", metavar="MULTIADDR", help="the address others reach the data plane at, when "
                      "not where it listens (port forwarding, a proxy): /ip4/HOST/tcp/PORT")
    _add_engine_flags(join)
    join.add_argument("--public-name", default="", help="a name shown to clients")
    _add_metrics(join)

    demo = sub.add_parser("demo", help="start a local swarm (bootstrap + 3 volunteers), generate, shut down")
    demo.add_argument("--prompt", default=None, help="what to ask (default: a short question)")
    demo.add_argument("--max-tokens", type=_positive, default=64)
    demo.add_argument("--no-chat", action="store_true", help="send the prompt as is, without the chat template")
    demo.add_argument("--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct)")
    demo.add_argument("--json", action="store_true", help="print the result as JSON")

    api = sub.add_parser("api", help="serve an OpenAI-compatible HTTP API in front of the swarm")
    _add_bootstrap(api, "bootstrap peers (repeatable; default $MESHNET_BOOTSTRAP)")
    api.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT for HTTP (port 0: any)")
    api.add_argument("--model", help="GGUF model whose tokenizer to use (default: the embedded model)")
    api.add_argument("--step-timeout", type=float, default=10.0)
    _add_trust(api)
    _add_identity(api)
    _add_metrics(api)

    cert = sub.add_parser("certify", help="certify a dark recipe by a real distributed forward (signed evidence)")
    _add_bootstrap(cert, "bootstrap peers (repeatable; default $MESHNET_BOOTSTRAP)")
    cert.add_argument("--identity", help="key file that signs the evidence (e.g. a bootstrap peer's; default: a fresh one)")
    cert.add_argument("--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct)")
    cert.add_argument("--recipe", metavar="DIGEST", help="the recipe to certify (a digest or its prefix; default: "
                                                         "the dark recipe most peers serve)")
    cert.add_argument("--method", choices=("auto", "whole-model", "two-routes"), default="auto",
                      help="compare with a whole-model run here, or two routes with no peer in common (auto: "
                           "whole-model when this machine runs the same recipe)")
    cert.add_argument("--prompt", default=None, help="the certification prompt (default: a short one)")
    cert.add_argument("--max-tokens", type=_positive, default=16)
    cert.add_argument("--step-timeout", type=float, default=10.0)
    cert.add_argument("--json", action="store_true")

    status = sub.add_parser("status", help="models, recipes (dark or certified), coverage and peers of a swarm")
    _add_bootstrap(status, "bootstrap peers (repeatable; default $MESHNET_BOOTSTRAP)")
    status.add_argument("--model", action="append", default=[], help="a GGUF model or model digest to show "
                        "(repeatable; default: every model the swarm announces)")
    _add_trust(status)
    _add_identity(status)
    status.add_argument("--no-probe", action="store_true", help="do not measure each peer's round trip")
    status.add_argument("--json", action="store_true")

    gen = sub.add_parser("generate", help="generate text through a route of shards")
    gen.add_argument("--local", action="store_true", help="run the whole route in this process (no network)")
    _add_bootstrap(gen, "bootstrap peers to find the swarm (repeatable; default $MESHNET_BOOTSTRAP)")
    gen.add_argument("--step-timeout", type=float, default=10.0, help="seconds before a silent peer is failed over")
    gen.add_argument("--star", action="store_true",
                     help="carry every hop's hidden state through this client (two crossings a hop) instead of "
                          "the ring, where peers forward to each other (docs/ring.md)")
    _add_trust(gen)
    gen.add_argument("--identity", help="this client's key file (its own certificates are trusted too)")
    gen.add_argument("--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct); "
                                     "over the network also a model digest, with the embedded model's tokenizer")
    gen.add_argument("--split", default="", help="layer cut points, e.g. 10,20 for shards [0,10) [10,20) [20,N)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=_positive, default=64)
    gen.add_argument("--temperature", type=_nonneg_float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--n-ubatch", type=_positive, default=64, help="micro-batch size (part of the recipe)")
    gen.add_argument("--seam-dtype", choices=("f32", "f16", "bf16"), default="f32")
    gen.add_argument("--threads", type=_positive, default=None)
    from .monitor import add_parser as _add_monitor  # light: the role's imports load when it runs

    _add_monitor(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with unwrap_errors(MeshnetError, OSError, ValueError):
            return _dispatch(parser, args)
    except MeshnetError as e:  # may quote what a peer said: escaped before it reaches a terminal
        print(f"error: {sanitize(e, 4000)}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:  # a port taken, an address not ours, a peer refusing the connection
        print(f"error: meshnet-peer {args.command}: {e.strerror or e}", file=sys.stderr)
        return EXIT_ERROR
    except ValueError as e:  # request types reject bad values (e.g. top_p) this way
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    handlers = {
        "shard": _shard, "identity": _identity, "generate": _generate, "demo": _demo, "join": _join,
        "bootstrap": _bootstrap, "relay": _relay, "serve": _serve, "api": _api,
        "certify": _certify, "status": _status, "monitor": _monitor,
    }
    handler = handlers.get(args.command)
    if handler is None:
        parser.error(f"unknown command {args.command!r}")
    return handler(args)


def _model_path(arg: str | None) -> str:
    """A GGUF path, or the embedded model (no argument, or its name)."""
    from meshnet_p2p.engine.models import DEFAULT_MODEL_NAME, ModelNotFound, default_model_path

    if arg is None or arg == DEFAULT_MODEL_NAME:
        return default_model_path()
    if not os.path.isfile(arg):
        raise ModelNotFound(f"no model file at {arg} (and it is not the name {DEFAULT_MODEL_NAME!r})")
    return arg


def _shard(args: argparse.Namespace) -> int:
    from meshnet_p2p.engine.cut import cut_shard, inspect_gguf, parse_layer_range
    from .progress import TerminalProgress

    if args.shard_command == "cut":
        start, end = parse_layer_range(args.layers)
        model = _model_path(args.model)
        info = cut_shard(model, start, end, args.out, progress=TerminalProgress(f"layers {start}:{end}"))
        print(json.dumps(_info_doc(info)))
        return 0
    info = inspect_gguf(args.path)
    print(json.dumps(_info_doc(info)))
    return 0


def _info_doc(info) -> dict:
    return {
        "path": info.path,
        "architecture": info.architecture,
        "layers": [info.start, info.end],
        "source_layers": info.source_layers,
        "role": info.role,
        "source_sha256": info.source_sha256,
        "model_digest": info.model_digest,
        "weight_quantization": info.weight_quantization,
        "tokenizer_digest": info.tokenizer_digest,
        "data_sha256": info.data_sha256,
    }


def _identity(args: argparse.Namespace) -> int:
    from meshnet_p2p.core.identity import Identity, default_identity_path

    path = args.identity or default_identity_path()
    if args.identity_command == "new":
        ident = Identity.generate()
        ident.save(path, overwrite=args.force)
    else:
        ident = Identity.load(path)
    print(json.dumps({"peer_id": str(ident.peer_id), "path": os.path.abspath(path)}))
    return 0


def _engine_options(args: argparse.Namespace):
    from meshnet_p2p.engine.contract import EngineOptions

    return EngineOptions(max_sessions=args.max_sessions, n_ctx_per_session=args.n_ctx, kv_memory_mib=args.kv_memory,
                         n_ubatch=args.n_ubatch, n_threads=args.threads)


def _required_seeds(args: argparse.Namespace, alternative: str = "") -> list:
    from meshnet_p2p.swarm.node import bootstrap_addrs

    seeds = bootstrap_addrs(args.bootstrap)
    if not seeds:
        raise MeshnetError(f"{args.command} needs bootstrap peers (--bootstrap MULTIADDR or MESHNET_BOOTSTRAP){alternative}")
    return seeds


def _print_line(line: str) -> None:
    print(line, flush=True)  # a line at a time: supervisors and tests read these as they come


def _run_listener(listen: str, async_fn, *args, doing: str = "listen") -> int:
    """trio.run a command that listens on ``listen``; a socket error raised
    outside its nurseries becomes one line here (grouped ones, in main)."""
    import trio

    try:
        trio.run(async_fn, *args)
    except OSError as e:
        raise MeshnetError(f"cannot {doing} on {listen}: {e.strerror or e}") from None
    return 0


def _load_or_create_identity(path: str | None):
    from meshnet_p2p.core.identity import Identity

    if path is None:
        return Identity.generate()
    if not os.path.exists(path):
        ident = Identity.generate()
        ident.save(path)
        return ident
    return Identity.load(path)


def _bootstrap(args: argparse.Namespace) -> int:
    import trio

    from meshnet_p2p.core.lifecycle import until_signalled

    from meshnet_p2p.swarm.node import bootstrap_addrs, node_multiaddr, parse_listen, start_node
    from meshnet_p2p.nat.reachability import dial_checks

    parse_listen(args.listen)  # a bad flag fails before anything starts
    metrics = _metrics_listen(args)
    identity = _load_or_create_identity(args.identity)
    seeds = bootstrap_addrs(args.bootstrap)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            # it also tells joining peers whether their address answers (reachability.py)
            node = await start_node(nursery, identity, listen=args.listen, bootstrap=seeds, require_bootstrap=False,
                                    serve=dial_checks)
            if metrics is not None:
                from .metrics import DhtCollector

                await _serve_metrics(nursery, metrics, "bootstrap", DhtCollector(node))
            _print_line(f"listening on {node_multiaddr(node)}")
            await until_signalled()
            nursery.cancel_scope.cancel()

    return _run_listener(args.listen, serve)


def _relay(args: argparse.Namespace) -> int:
    import trio

    from meshnet_p2p.core.lifecycle import until_signalled

    from meshnet_p2p.nat.relay import Relay, RelayLimits
    from meshnet_p2p.core.guard import Guard
    from meshnet_p2p.core.multiaddr import Multiaddr, announced
    from meshnet_p2p.swarm.node import advertised_host, bootstrap_addrs, parse_listen, start_node
    from meshnet_p2p.nat.reachability import dial_checks
    from meshnet_p2p.core.records import wall_ms
    from meshnet_p2p.swarm.relay_offers import RELAY_ANNOUNCE_INTERVAL_S, RELAYS_KEY, sign_relay_record

    host, port = parse_listen(args.listen)
    metrics = _metrics_listen(args)
    identity = _load_or_create_identity(args.identity)
    announce = announced(args.announce, identity.peer_id) if args.announce else None
    seeds = bootstrap_addrs(args.bootstrap)
    limits = RelayLimits(max_reservations=args.max_reservations, max_connections_per_peer=args.max_connections_per_peer,
                         bytes_per_second_per_peer=args.max_mbps_per_peer * 1e6 / 8,
                         max_circuits_per_source=args.max_circuits_per_source)

    def splice_line(peer, moved: int, seconds: float) -> None:
        _print_line(f"splice to {peer} closed: {moved} bytes in {seconds:.1f} s")

    async def run() -> None:
        relay = Relay(identity, limits, on_splice=splice_line)
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(relay.serve, host, port)
            # on every address: announced at the one this machine reaches its bootstrap peers from
            here = Multiaddr.for_socket(advertised_host(host, seeds), "tcp", bound, identity.peer_id)
            addr = announce or here
            if seeds:
                node = await start_node(nursery, identity, listen=f"{host}:0", bootstrap=seeds, require_bootstrap=False,
                                        serve=dial_checks)

                async def publish() -> None:  # peers behind NAT find this relay, its limits and load, here
                    guard = Guard("relay_publish", node.stats)  # a failure: counted, tried again, relaying goes on
                    while True:
                        async with guard:
                            record = sign_relay_record(identity, addr, {
                                "max_reservations": limits.max_reservations,
                                "max_connections_per_peer": limits.max_connections_per_peer,
                                "bytes_per_second_per_peer": int(limits.bytes_per_second_per_peer)}, relay.load(),
                                now_ms=wall_ms())
                            try:
                                await node.publish(RELAYS_KEY, record)
                            except MeshnetError as e:  # others' refusal is theirs: keep relaying, try again
                                _print_line(f"announce failed, retrying: {e}")
                        await trio.sleep(RELAY_ANNOUNCE_INTERVAL_S)

                nursery.start_soon(publish)
            if metrics is not None:
                from .metrics import DhtCollector, RelayCollector

                await _serve_metrics(nursery, metrics, "relay", RelayCollector(relay),
                                     *([DhtCollector(node)] if seeds else []))
            _print_line(f"listening on {here}")
            if announce is not None:
                _print_line(f"announcing {announce}")
            await until_signalled()
            nursery.cancel_scope.cancel()

    return _run_listener(args.listen, run)


async def _serve_metrics(nursery, listen: str, role: str, *collectors) -> None:
    from .metrics import metrics_url, serve_metrics

    _print_line(f"metrics on {metrics_url(*await serve_metrics(nursery, listen, role, *collectors))}")


def _monitor(args: argparse.Namespace) -> int:
    from .monitor import run

    return run(args)


def _serve(args: argparse.Namespace) -> int:
    from .serve import Limits, ServeOptions, serve
    from meshnet_p2p.engine.cut import parse_layer_range, sha256_file
    from meshnet_p2p.engine.models import ensure_shard
    from meshnet_p2p.core.multiaddr import Multiaddr
    from meshnet_p2p.swarm.node import parse_listen
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
        model = _model_path(args.model)
        progress = TerminalProgress(f"layers {start}:{end}")
        shard = ensure_shard(model, start, end, sha256_file(model, progress), progress)
    else:
        raise MeshnetError("serve needs --shard PATH, or --layers A:B (with --model or the embedded model)")
    opts = ServeOptions(shard, host, port, _load_or_create_identity(args.identity), relay=relay,
                        engine=_engine_options(args), limits=Limits(max_message_bytes=args.max_message_bytes,
                                                                    session_idle_ms=int(args.idle_timeout * 1000)))
    return _run_listener(args.listen, serve, opts, _print_line, doing="serve")


def _demo(args: argparse.Namespace) -> int:
    import io

    from .demo import DEFAULT_PROMPT, run_demo

    model = _model_path(args.model) if args.model else None
    out = io.StringIO() if args.json else sys.stdout
    result = run_demo(args.prompt or DEFAULT_PROMPT, args.max_tokens, chat=not args.no_chat, model=model, out=out)
    if args.json:
        print(json.dumps(result))
    return 0


def _trust(args: argparse.Namespace, seeds: list):
    """The trust policy of a client command: bootstrap peers, --identity, --trust, --trust-file."""
    from meshnet_p2p.trust.policy import TrustPolicy

    own = _load_or_create_identity(args.identity) if getattr(args, "identity", None) else None
    return TrustPolicy.default(seeds, own=own, extra=args.trust, trust_file=args.trust_file)


def _certify(args: argparse.Namespace) -> int:
    import trio

    from .certify import DEFAULT_PROMPT, CertifyOptions, certify

    seeds = _required_seeds(args)
    opts = CertifyOptions(bootstrap=seeds, identity=_load_or_create_identity(args.identity),
                          model_path=_model_path(args.model), recipe=args.recipe, method=args.method,
                          prompt=args.prompt or DEFAULT_PROMPT, max_tokens=args.max_tokens,
                          step_timeout=args.step_timeout)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else _print_line
    summary = trio.run(certify, opts, log)
    if args.json:
        print(json.dumps(summary))
    return 0


def _status(args: argparse.Namespace) -> int:
    import re

    import trio

    from .status import format_status, swarm_status

    seeds = _required_seeds(args)
    models = []
    for m in args.model:
        if re.fullmatch(r"[0-9a-f]{64}", m):
            models.append((m, "", 0))
        else:
            from meshnet_p2p.engine.cut import inspect_gguf

            path = _model_path(m)
            info = inspect_gguf(path)
            models.append((info.model_digest, os.path.basename(path).split(".")[0], info.source_layers))
    doc = trio.run(lambda: swarm_status(seeds, _trust(args, seeds), models, probe_peers=not args.no_probe))
    print(json.dumps(doc) if args.json else format_status(doc))
    return 0


def _api(args: argparse.Namespace) -> int:
    from .api import serve_api
    from meshnet_p2p.client import Client
    from meshnet_p2p.swarm.node import parse_listen

    host, port = parse_listen(args.listen)
    metrics = _metrics_listen(args)
    seeds = _required_seeds(args)
    client = Client(seeds, model_path=_model_path(args.model) if args.model else None, step_timeout=args.step_timeout,
                    trust=_trust(args, seeds))
    return _run_listener(args.listen, serve_api, client, client.model_name, host, port, _print_line, metrics)


def _join(args: argparse.Namespace) -> int:
    from meshnet_p2p.dataplane.servicer import Limits
    from meshnet_p2p.engine.cut import parse_layer_range
    from meshnet_p2p.core.multiaddr import Multiaddr, announced
    from meshnet_p2p.swarm.node import parse_listen
    from .join import JoinOptions, join
    from .progress import TerminalProgress

    host, port = parse_listen(args.listen)
    metrics = _metrics_listen(args)
    layers = None if args.layers == "auto" else parse_layer_range(args.layers)
    seeds = _required_seeds(args)
    identity = _load_or_create_identity(args.identity)
    opts = JoinOptions(
        model_path=_model_path(args.model), layers=layers, num_layers=args.num_layers, listen_host=host,
        listen_port=port, bootstrap=seeds, identity=identity,
        relay=Multiaddr.parse(args.relay) if args.relay else None,
        announce=announced(args.announce, identity.peer_id) if args.announce else None, engine=_engine_options(args),
        public_name=args.public_name, progress=TerminalProgress("preparing the shard"),
        limits=Limits(session_idle_ms=int(args.idle_timeout * 1000)), metrics=metrics,
    )
    return _run_listener(args.listen, join, opts, _print_line, doing="serve")


def _write_out(text: str) -> None:
    """Generated text to stdout as it comes."""
    sys.stdout.write(text)
    sys.stdout.flush()


def _generate_network(args: argparse.Namespace, sampling) -> int:
    import re

    from meshnet_p2p.client import Client

    seeds = _required_seeds(args, ", or --local")
    digest = None
    model = None
    if args.model and re.fullmatch(r"[0-9a-f]{64}", args.model):
        digest = args.model
    else:
        model = _model_path(args.model)
    events = (lambda msg: print(f"[{sanitize(msg)}]", file=sys.stderr, flush=True))
    client = Client(seeds, model_path=model, model_digest=digest, step_timeout=args.step_timeout, on_event=events,
                    trust=_trust(args, seeds), ring=not args.star)
    result = client.generate(args.prompt, args.max_tokens, sampling, chat=args.chat,
                             on_token=None if args.json else _write_out)
    if args.json:
        print(json.dumps({
            "token_ids": result.token_ids,
            "text": result.text,
            "prompt_tokens": result.prompt_tokens,
            "stopped": result.stopped,
            "route": result.route,
            "failovers": result.failovers,
            "model_digest": client.model_digest,
            "timing": {"ttft_ms": round(result.ttft_ms, 3), "decode_ms": round(result.decode_ms, 3),
                       "decode_tokens_per_s": round(result.decode_tokens_per_s, 3)},
        }))
    else:
        sys.stdout.write("\n")
        route = " -> ".join(f"{h['layers'][0]}:{h['layers'][1]}@{h['peer_id'][-8:]}" for h in result.route)
        print(f"[{len(result.token_ids)} tokens, first after {result.ttft_ms:.0f} ms, "
              f"{result.decode_tokens_per_s:.1f} tok/s, route {route}]", file=sys.stderr)
    return 0


def _generate(args: argparse.Namespace) -> int:
    import time

    from meshnet_p2p.engine.contract import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if not args.local:
        return _generate_network(args, sampling)

    from meshnet_p2p.engine.cut import inspect_gguf, sha256_file
    from meshnet_p2p.engine.tokenizer import Tokenizer
    from meshnet_p2p.client.local import LocalRoute, parse_split
    from meshnet_p2p.client.text import TextStream, prompt_ids
    from .progress import TerminalProgress

    t0 = time.perf_counter()
    model = _model_path(args.model)
    progress = TerminalProgress("preparing shards")
    digest = sha256_file(model, progress)
    info = inspect_gguf(model, source_sha256=digest)
    if info.is_cut:
        raise MeshnetError(f"{model} is a shard (layers {info.start}:{info.end}); --local needs the whole model")
    ranges = parse_split(args.split, info.source_layers)
    tokenizer = Tokenizer(model)
    prompt = prompt_ids(tokenizer, args.prompt, args.chat)
    route = LocalRoute.from_model(
        model,
        ranges,
        source_sha256=digest,
        n_ubatch=args.n_ubatch,
        seam_dtype=args.seam_dtype,
        max_sessions=1,
        n_ctx_per_session=len(prompt) + args.max_tokens,
        n_threads=args.threads,
        progress=progress,
    )
    load_ms = (time.perf_counter() - t0) * 1000
    try:
        text = TextStream(tokenizer, None if args.json else _write_out)
        gen = route.generate(prompt, args.max_tokens, sampling, on_token=text.on_token)
    finally:
        route.close()
    if args.json:
        doc = {
            "token_ids": gen.token_ids,
            "text": tokenizer.decode(gen.token_ids),
            "prompt_tokens": gen.prompt_tokens,
            "stopped": gen.stopped,
            "route": [{"layers": [c.start, c.end], "role": c.role} for c in route.caps],
            "model": {"path": model, "source_sha256": digest, "model_digest": route.caps[0].model_digest},
            "recipe": dict(route.caps[0].recipe, digest=route.caps[0].recipe_digest),
            "timing": {
                "load_ms": round(load_ms, 3),
                "ttft_ms": round(gen.ttft_ms, 3),
                "decode_ms": round(gen.decode_ms, 3),
                "decode_tokens_per_s": round(gen.decode_tokens_per_s, 3),
            },
        }
        print(json.dumps(doc))
    else:
        text.finish()
        _write_out("\n")
        print(
            f"[{len(gen.token_ids)} tokens, first after {gen.ttft_ms:.0f} ms, {gen.decode_tokens_per_s:.1f} tok/s, "
            f"route {' -> '.join(f'{c.start}:{c.end}' for c in route.caps)}]",
            file=sys.stderr,
        )
    return 0
