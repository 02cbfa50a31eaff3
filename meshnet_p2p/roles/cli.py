"""``meshnet-peer``: the one place that parses flags; each command's body is in
its role module (roles/<command>.py, ``run(args)``), except ``generate``'s, here.

Every expected failure is a :class:`MeshnetError` and is printed as one line
``error: ...`` with exit status 2 (argparse uses 2 for bad flags too).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Sequence

from meshnet_p2p import __version__
from meshnet_p2p.core.errors import MeshnetError, sanitize, unwrap_errors
# the shared flag helpers (flags.py), by the names this module's parser and `generate` use
from .flags import (
    add_bootstrap as _add_bootstrap, add_engine_flags as _add_engine_flags, add_identity as _add_identity,
    add_metrics as _add_metrics, add_trust as _add_trust, add_verify as _add_verify, model_path as _model_path,
    model_source as _model_source,
    nonneg_float as _nonneg_float, positive as _positive, positive_float as _positive_float, required_seeds as _required_seeds,
    trust_policy as _trust,
)

EXIT_ERROR = 2


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
    _add_identity(boot, peer=True)
    _add_bootstrap(boot, "other bootstrap peers to join (repeatable; default $MESHNET_BOOTSTRAP)")
    _add_metrics(boot)

    relay = sub.add_parser("relay", help="run a relay for peers behind NAT (splices TLS it cannot read)")
    relay.add_argument("--listen", default="0.0.0.0:4002", help="HOST:PORT for the TCP socket (port 0: any); on "
                       "every address by default, announced at the one this machine reaches its bootstrap peers from")
    _add_identity(relay, peer=True)
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
    join.add_argument("--model", help="GGUF model file to serve (default: the embedded SmolLM2-135M-Instruct); or, "
                                      "with no such file here, a model name or digest the trusted certifiers list: "
                                      "only this peer's span is fetched from the peers serving it")
    join.add_argument("--layers", default="auto", help="A:B, or auto: what the swarm most needs (default)")
    join.add_argument("--num-layers", type=_positive, help="with --layers auto: how many layers (default: a third)")
    join.add_argument("--listen", default="0.0.0.0:0", help="HOST:PORT for the data plane (gRPC over TLS); on every "
                      "address by default, announced at the one this machine reaches its bootstrap peers from")
    _add_bootstrap(join, "bootstrap peers (repeatable; default $MESHNET_BOOTSTRAP, then bootstrap/peers.txt)")
    _add_identity(join, peer=True)
    join.add_argument("--relay", metavar="MULTIADDR", help="be reachable through this relay (behind NAT)")
    join.add_argument("--announce", metavar="MULTIADDR", help="the address others reach the data plane at, when "
                      "not where it listens (port forwarding, a proxy): /ip4/HOST/tcp/PORT")
    _add_engine_flags(join)
    join.add_argument("--public-name", default="", help="a name shown to clients")
    _add_trust(join)
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
    api.add_argument("--model", help="GGUF model whose tokenizer to use (default: the embedded model), or a model "
                                     "name or digest the trusted certifiers list (its tokenizer fetched from peers)")
    api.add_argument("--step-timeout", type=float, default=10.0)
    _add_verify(api)
    _add_trust(api)
    _add_identity(api)
    _add_metrics(api)

    cert = sub.add_parser("certify", help="certify a dark recipe by a real distributed forward (signed evidence)")
    _add_bootstrap(cert, "bootstrap peers (repeatable; default $MESHNET_BOOTSTRAP)")
    cert.add_argument("--identity", metavar="FILE", help="key file that signs the evidence (e.g. a bootstrap peer's; "
                                                         "default: this machine's, $XDG_CONFIG_HOME/meshnet-p2p/"
                                                         "identity.key)")
    cert.add_argument("--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct)")
    cert.add_argument("--name", help="the name this model is listed under in the certifier's catalogue "
                                     "(default: its file name up to the first dot)")
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
    gen.add_argument("--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct); over the network "
                                     "also, with no file here, a model name or digest the trusted certifiers list "
                                     "(only its tokenizer is fetched, from peers)")
    gen.add_argument("--split", default="", help="layer cut points, e.g. 10,20 for shards [0,10) [10,20) [20,N)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=_positive, default=64)
    gen.add_argument("--temperature", type=_nonneg_float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_verify(gen)
    gen.add_argument("--n-ubatch", type=_positive, default=64, help="micro-batch size (part of the recipe)")
    gen.add_argument("--seam-dtype", choices=("f32", "f16", "bf16"), default="f32")
    gen.add_argument("--threads", type=_positive, default=None)
    from .monitor import add_parser as _add_monitor  # light: the role's imports load when it runs
    from .audit import add_parser as _add_audit
    from .review import add_parser as _add_review

    _add_monitor(sub)
    _add_audit(sub)
    _add_review(sub)
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


# each command's body lives in the role module of its name, as ``run(args)``; imported when
# it runs, so that a role's imports (llama.cpp's among them) load only for that role
ROLES = frozenset({"shard", "identity", "demo", "join", "bootstrap", "relay", "serve", "api", "certify", "status",
                   "monitor", "audit", "review"})


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "generate":
        return _generate(args)
    if args.command not in ROLES:
        parser.error(f"unknown command {args.command!r}")
    return importlib.import_module(f"{__package__}.{args.command}").run(args)


def _write_out(text: str) -> None:
    """Generated text to stdout as it comes."""
    sys.stdout.write(text)
    sys.stdout.flush()


AUDIT_WAIT_S = 120.0  # how long `generate` waits, after the answer, for the audits of the hops it used


def _generate_network(args: argparse.Namespace, sampling) -> int:
    from meshnet_p2p.client import Client

    seeds = _required_seeds(args, ", or --local")
    model, ref = _model_source(args.model)  # a file here, or a name/digest whose header is fetched
    events = (lambda msg: print(f"[{sanitize(msg)}]", file=sys.stderr, flush=True))
    client = Client(seeds, model_path=model, model_ref=ref, step_timeout=args.step_timeout, on_event=events,
                    trust=_trust(args, seeds), ring=not args.star, verify=args.verify,
                    audit_rate=args.audit_rate, keep_records=True)
    from meshnet_p2p.verify.crosscheck import OutputWithheld

    try:
        result = client.generate(args.prompt, args.max_tokens, sampling, chat=args.chat,
                                 on_token=None if args.json else _write_out)
    except OutputWithheld:
        # the routes disagreed and nothing here could decide: the audits of both may still
        # prove which one lied and publish it, so that the next user is not withheld again
        if not client.wait_audits(AUDIT_WAIT_S):
            events(f"audits still running after {AUDIT_WAIT_S:g} s: left undone")
        for a in client.auditor.results:
            events(f"audit of {a.peer_id} on layers {a.start}-{a.end - 1}: {a.verdict.value}")
        client.close()
        raise
    if not args.json:  # the answer first; the audits of the hops it used after it (docs/verification.md)
        sys.stdout.write("\n")
        sys.stdout.flush()
    if not client.wait_audits(AUDIT_WAIT_S):
        events(f"audits still running after {AUDIT_WAIT_S:g} s: left undone")
    audits = [a.to_json() for a in client.auditor.results]
    client.close()
    if args.json:
        print(json.dumps({
            "token_ids": result.token_ids,
            "text": result.text,
            "prompt_tokens": result.prompt_tokens,
            "stopped": result.stopped,
            "route": result.route,
            "failovers": result.failovers,
            "model_digest": client.model_digest,
            "verification": {**result.verification, "audits": audits},
            "timing": {"ttft_ms": round(result.ttft_ms, 3), "decode_ms": round(result.decode_ms, 3),
                       "decode_tokens_per_s": round(result.decode_tokens_per_s, 3)},
        }))
    else:
        for a in audits:
            print(f"[audit of {a['peer']} on layers {a['span'][0]}-{a['span'][1] - 1}: {a['verdict']}"
                  f"{'' if a['verdict'] == 'match' else ': ' + sanitize(a['detail'])}]", file=sys.stderr)
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
    from meshnet_p2p.route.local import LocalRoute, parse_split
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
