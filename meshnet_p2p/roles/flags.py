"""What the roles share between their flags and their bodies: flag types and
groups (cli.py builds the parser with them) and turning flag values into things
(a model path, an identity, bootstrap peers, a trust policy), printing a line,
and running a listener so that a socket error is one line."""

from __future__ import annotations

import argparse
import os
from typing import Callable

from meshnet_p2p.core.errors import MeshnetError

KEEP_WARM_MS = 0  # off: on shared VMs it measured slower (docs/ring.md, "Keep-warm")



def _whole(text: str, least: int, must: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} must be {must}")
    return value


def positive(text: str) -> int:
    return _whole(text, 1, "at least 1")


def non_negative_int(text: str) -> int:
    return _whole(text, 0, "0 or more")


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def nonneg_float(text: str) -> float:
    value = number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def positive_float(text: str) -> float:
    value = nonneg_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def peer_id(text: str) -> str:
    """A peer ID (12D3KooW...), checked by the parser: a typo is one error line, before any network work."""
    from meshnet_p2p.core.identity import IdentityError, PeerId

    try:
        return str(PeerId.from_string(text))
    except IdentityError as e:
        raise argparse.ArgumentTypeError(f"{text[:60]!r} is not a peer ID ({e})") from None


def add_identity(p: argparse.ArgumentParser, *, peer: bool = False) -> None:
    """``--identity``; for a peer (a role others know by its peer ID: join, serve, relay,
    bootstrap) the default is the machine's key file, and ``--ephemeral-identity`` asks for
    a throwaway one; for a client role, no key unless named."""
    if not peer:
        p.add_argument("--identity", metavar="FILE", help="key file (created 0600 if missing; default: a fresh "
                                                          "identity per run)")
        return
    p.add_argument("--identity", metavar="FILE", help="this peer's key file, created 0600 if missing (default: "
                                                      "$XDG_CONFIG_HOME/meshnet-p2p/identity.key): the same peer ID, "
                                                      "and the same verified record, after every restart")
    p.add_argument("--ephemeral-identity", action="store_true",
                   help="a fresh identity for this run only, kept nowhere: a new peer at every start")


def add_bootstrap(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR", help=help)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """What `serve` and `join` share: how the engine runs (defaults: EngineOptions')."""
    from meshnet_p2p.engine.contract import EngineOptions

    d = EngineOptions()
    p.add_argument("--max-sessions", type=positive, default=d.max_sessions,
                   help="concurrent sessions (default: as many as --kv-memory holds at --n-ctx each, at most 32)")
    p.add_argument("--kv-memory", type=positive, default=d.kv_memory_mib, metavar="MIB",
                   help=f"memory for the sessions' KV caches when --max-sessions is not given (default {d.kv_memory_mib})")
    p.add_argument("--n-ubatch", type=positive, default=d.n_ubatch)
    p.add_argument("--n-ctx", type=positive, default=d.n_ctx_per_session, help="KV tokens per session")
    p.add_argument("--threads", type=positive, default=d.n_threads,
                   help="llama.cpp threads (default: as many as the machine has CPUs)")
    p.add_argument("--fixed-threads", action="store_true",
                   help="compute every step on all --threads; by default a one-token step runs on as many of "
                        "them as measured fastest (fewer after idle where waking CPUs is slow; docs/engine.md)")
    p.add_argument("--idle-timeout", type=positive_float, default=120.0, metavar="SECONDS",
                   help="release a session that sends nothing for this long (default 120)")
    p.add_argument("--keep-warm", type=non_negative_int, default=KEEP_WARM_MS, metavar="MS",
                   help=f"after each step, keep --threads CPUs awake this long at idle priority, so that a "
                        f"session's next step does not wait for sleeping CPUs (0: off; default {KEEP_WARM_MS}; "
                        f"docs/ring.md)")


def add_metrics(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics "
                   "(port 0: any; docs/metrics.md)")


def add_trust(p: argparse.ArgumentParser) -> None:
    """Whose certificates count, beyond the bootstrap peers' keys (and --identity's)."""
    p.add_argument("--trust", action="append", default=[], metavar="PEER_ID",
                   help="also accept certificates signed by this peer (repeatable)")
    p.add_argument("--trust-file", metavar="PATH", help="a file of certifier peer IDs to accept, one a line")


def audit_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0 and 1")
    return value


def add_verify(p: argparse.ArgumentParser) -> None:
    """How a generation's output is checked (docs/verification.md)."""
    p.add_argument("--verify", nargs="?", const="always", default="auto", choices=("auto", "always", "off"),
                   help="check every step on two routes with no peer in common (alone: always; auto, the default: "
                        "when the route depends on a peer with no verified record; off: never)")
    p.add_argument("--audit-rate", type=audit_rate, default=0.05, metavar="Q",
                   help="at least this share of hop-sessions of peers with a verified record is audited by exact "
                        "replay after the generation (peers without one: every session; default 0.05)")


def metrics_listen(args: argparse.Namespace) -> str | None:
    """--metrics, checked before anything starts (a bad value: one error line, exit 2)."""
    if args.metrics is None:
        return None
    from .metrics import parse_metrics_listen

    parse_metrics_listen(args.metrics)
    return args.metrics


async def serve_metrics(nursery, listen: str, role: str, *collectors) -> None:
    from .metrics import metrics_url, serve_metrics as serve

    print_line(f"metrics on {metrics_url(*await serve(nursery, listen, role, *collectors))}")


def model_path(arg: str | None) -> str:
    """A GGUF path, or the embedded model (no argument, or its name)."""
    from meshnet_p2p.engine.models import DEFAULT_MODEL_NAME, ModelNotFound, default_model_path

    if arg is None or arg == DEFAULT_MODEL_NAME:
        return default_model_path()
    if not os.path.isfile(arg):
        raise ModelNotFound(f"no model file at {arg} (and it is not the name {DEFAULT_MODEL_NAME!r})")
    return arg


def model_source(arg: str | None) -> tuple[str | None, str | None]:
    """``--model`` of join, generate and api: (a GGUF path, None), or (None, a name or
    model digest the catalogues give) when no such file is here: join fetches its
    span's parts from peers, a client only the tokenizer."""
    import re

    from meshnet_p2p.engine.models import DEFAULT_MODEL_NAME, ModelNotFound, default_model_path
    from meshnet_p2p.trust.catalogue import name_problem

    if arg is None or arg == DEFAULT_MODEL_NAME:
        try:
            return default_model_path(), None
        except ModelNotFound:
            if arg is None:
                raise
            return None, arg  # the embedded model's name, without its package: fetched like any name
    if os.path.isfile(arg):
        return arg, None
    if re.fullmatch(r"[0-9a-f]{64}", arg) or (name_problem(arg) is None and not arg.endswith(".gguf")):
        return None, arg
    raise ModelNotFound(f"no model file at {arg}, and it is not a model name or digest")


def engine_options(args: argparse.Namespace):
    from meshnet_p2p.engine.contract import EngineOptions

    return EngineOptions(max_sessions=args.max_sessions, n_ctx_per_session=args.n_ctx, kv_memory_mib=args.kv_memory,
                         n_ubatch=args.n_ubatch, n_threads=args.threads, choose_threads=not args.fixed_threads)


def keep_warm(args: argparse.Namespace) -> dict:
    """The Limits fields of --keep-warm: as many threads as the engine computes with."""
    threads = args.threads or len(os.sched_getaffinity(0))
    return {"keep_warm_ms": args.keep_warm, "keep_warm_threads": threads}


def required_seeds(args: argparse.Namespace, alternative: str = "") -> list:
    from meshnet_p2p.swarm.node import bootstrap_addrs

    seeds = bootstrap_addrs(args.bootstrap)
    if not seeds:
        raise MeshnetError(f"{args.command} needs bootstrap peers (--bootstrap MULTIADDR or MESHNET_BOOTSTRAP){alternative}")
    return seeds


def print_line(line: str) -> None:
    print(line, flush=True)  # a line at a time: supervisors and tests read these as they come


def run_listener(listen: str, async_fn, *args, doing: str = "listen") -> int:
    """trio.run a command that listens on ``listen``; a socket error raised
    outside its nurseries becomes one line here (grouped ones, in cli.main)."""
    import trio

    from meshnet_p2p.core.lifecycle import catching_signals

    try:
        trio.run(catching_signals, async_fn, *args)
    except OSError as e:
        raise MeshnetError(f"cannot {doing} on {listen}: {e.strerror or e}") from None
    return 0


def load_or_create_identity(path: str | None):
    from meshnet_p2p.core.identity import Identity

    if path is None:
        return Identity.generate()
    if not os.path.exists(path):
        ident = Identity.generate()
        ident.save(path)
        return ident
    return Identity.load(path)


_HELD: list = []  # the lock files of the keys this process serves as (held until it exits)


def peer_identity(args: argparse.Namespace, say: Callable[[str], None]):
    """A peer role's identity (``add_identity(peer=True)``'s flags): the key file named, else
    the machine's default one (created 0600 on first use), held for this process's life (a
    second peer running on the same key would be the same peer twice: refused with what to
    do), or a throwaway one on request. Says which, with its peer ID."""
    from meshnet_p2p.core.identity import Identity, default_identity_path

    if getattr(args, "ephemeral_identity", False):
        if args.identity:
            raise MeshnetError("--identity and --ephemeral-identity name two identities; give one")
        ident = Identity.generate()
        say(f"identity {ident.peer_id} (ephemeral: a new peer at every start)")
        return ident
    path = os.path.abspath(args.identity or default_identity_path())
    made = not os.path.exists(path)
    ident = load_or_create_identity(path)
    hold_identity(path)
    say(f"identity {ident.peer_id} ({'created ' if made else ''}{path})")
    return ident


def signing_identity(path: str | None):
    """What ``certify`` and ``review`` sign with: the key file named, else the machine's (created
    0600 on first use; not held: they do not run as that peer). Says which on stderr (their
    stdout may be JSON)."""
    import sys

    from meshnet_p2p.core.identity import default_identity_path

    path = os.path.abspath(path or default_identity_path())
    made = not os.path.exists(path)
    ident = load_or_create_identity(path)
    print(f"signing as {ident.peer_id} ({'created ' if made else ''}{path})", file=sys.stderr, flush=True)
    return ident


def hold_identity(path: str) -> None:
    """Take ``path``'s lock (``path.lock``) for this process's life, or a clear error when
    another running process holds it."""
    import fcntl

    lock = open(path + ".lock", "a")  # noqa: SIM115 (kept open: the lock lives as long as the process)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise MeshnetError(f"the identity {path} is in use by another running peer on this machine; give this "
                           "one its own key (--identity FILE) or --ephemeral-identity") from None
    _HELD.append(lock)


def trust_policy(args: argparse.Namespace, seeds: list):
    """The trust policy of a client command: bootstrap peers, --identity, --trust, --trust-file."""
    from meshnet_p2p.trust.policy import TrustPolicy

    own = load_or_create_identity(args.identity) if getattr(args, "identity", None) else None
    return TrustPolicy.default(seeds, own=own, extra=args.trust, trust_file=args.trust_file)
