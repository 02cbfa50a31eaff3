"""``meshnet-peer join``: a volunteer serving a range of layers to the swarm.

Cut (or reuse) the shard, load it, serve it over the gRPC data plane, join the
DHT through the bootstrap peers, and announce a signed capability report
(layers, addresses, TLS certificate, measured throughput, free capacity)
under ``model/<model digest>``, re-announced while alive. On SIGINT/SIGTERM:
announce departure, refuse new sessions, let open ones finish (bounded), exit 0.
"""

from __future__ import annotations

import argparse
import os
import time
from ipaddress import ip_address
from dataclasses import dataclass
from typing import Callable

import numpy as np
import trio

from meshnet_p2p.swarm.capability import CAPABILITY_TTL_MS, MODELS_KEY, CapabilityReport, model_key, sign_model_index
from .serve import start_data_plane
from meshnet_p2p.dataplane.servicer import Limits
from meshnet_p2p.engine.contract import HIDDEN, DecodeRequest, EngineOptions, OpenRequest, PrefillRequest, Tensor, TensorBundle
from meshnet_p2p.engine.cut import inspect_gguf
from meshnet_p2p.engine.manifest import Manifest, build_manifest
from meshnet_p2p.dataplane.weights import WeightStore
from meshnet_p2p.trust.policy import TrustPolicy
from meshnet_p2p.client.named import find_model, obtain
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.core.errors import MeshnetError, unwrap_errors
from meshnet_p2p.core.guard import Guard
from meshnet_p2p.core.identity import Identity, PeerId
from meshnet_p2p.core.lifecycle import until_signalled
from meshnet_p2p.engine.models import ensure_shard
from meshnet_p2p.core.multiaddr import Multiaddr, ip_of
from meshnet_p2p.swarm.node import advertised_host, peers_for_model, start_node
from meshnet_p2p.swarm.placement import Span, choose_span, default_num_layers
from meshnet_p2p.nat.dialback import UNKNOWN, UNREACHABLE, Reachability
from meshnet_p2p.nat.reachability import ReachabilityError, check_reachability, dial_checks, relay_check, \
    relay_dial_check, tls_dial_check
from meshnet_p2p.swarm.placing import answering_spans
from .progress import StatusLine
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.nat.keeper import RelayKeeper
from meshnet_p2p.swarm.relay_offers import circuit_addr

ANNOUNCE_INTERVAL_S = 30.0
DRAIN_GRACE_S = 30.0
DRAIN_IDLE_MS = 2_000  # while leaving, a session silent this long is released


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


@dataclass
class _Reach:
    relay: Multiaddr | None = None  # the relay it is reachable through now
    unreachable: bool = False  # others cannot dial it directly
    plane: object = None  # its data plane (whose server adopts relayed connections)
    here: str = ""  # where it listens, as others would dial it directly
    announcing: bool = True  # its last announce was stored by some peer


def measure_throughput(engine: LlamaCppShardEngine, steps: int = 8) -> float:
    """Decode tokens/s of this shard alone, from a few real steps."""
    caps = engine.capabilities()
    sid = "__throughput__"
    engine.open_session(OpenRequest(sid, steps + 2)).raise_for_status()
    try:
        def req(kind, pos):
            if caps.is_head:
                return kind(sid, pos, **({"token_ids": (1,)} if kind is PrefillRequest else {"token_id": 1}))
            h = TensorBundle((Tensor(HIDDEN, str(caps.recipe["seam_dtype"]), (1, caps.n_embd),
                                     np.zeros((1, caps.n_embd), np.float32).tobytes()),))
            return kind(sid, pos, hidden=h)

        engine.prefill(req(PrefillRequest, 0)).status.raise_for_status()
        t0 = time.perf_counter()
        for pos in range(1, steps + 1):
            engine.decode(req(DecodeRequest, pos)).status.raise_for_status()
        return steps / (time.perf_counter() - t0)
    finally:
        engine.release(sid)


def run(args: argparse.Namespace) -> int:
    """The ``join`` command: its flags become :class:`JoinOptions`."""
    from meshnet_p2p.engine.cut import parse_layer_range
    from meshnet_p2p.core.multiaddr import announced
    from meshnet_p2p.swarm.node import parse_listen
    from .flags import engine_options, keep_warm, load_or_create_identity, metrics_listen, model_source, print_line, \
        required_seeds, run_listener, trust_policy
    from .progress import TerminalProgress

    host, port = parse_listen(args.listen)
    metrics = metrics_listen(args)
    layers = None if args.layers == "auto" else parse_layer_range(args.layers)
    seeds = required_seeds(args)
    identity = load_or_create_identity(args.identity)
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


@dataclass
class _Source:
    """The model file shards are cut from: whole, or a partial copy of it (fetched)."""

    path: str
    source_sha: str
    n_layer: int
    digest: str  # the model digest
    name: str
    manifest: Manifest
    parts: Callable[[], set[str]] | None = None  # what a partial copy holds now; None: all


async def dial_report(span: Span) -> str | None:
    """placing's dial: a TLS handshake bound to the report's signer at the address its
    report names, or through the relay it names; the host it answered at."""
    c, peer = span.record.content, PeerId.from_string(span.peer_id)
    try:
        if c["relay"]:
            relay = Multiaddr.parse(c["relay"])
            return relay.host if (await relay_dial_check(peer, relay))[0] else None
        for addr in c["addrs"][:2]:
            if (await tls_dial_check(peer, addr))[0]:
                return Multiaddr.parse(addr).host
    except MeshnetError:  # an address this side cannot parse: not answered
        return None
    return None


async def join(opts: JoinOptions, print_line: Callable[[str], None] = print) -> None:
    source = None
    if opts.model_path is not None:
        info = await trio.to_thread.run_sync(lambda: inspect_gguf(opts.model_path, source_sha256="0" * 64, verify=False))
        if info.is_cut:
            raise MeshnetError(f"{opts.model_path} is a shard; join needs the whole model to cut from")
        # the manifest's one pass over the file also gives its sha256, and so the model digest
        manifest = await trio.to_thread.run_sync(lambda: build_manifest(opts.model_path, opts.progress))
        source = _Source(opts.model_path, manifest.source_sha256, manifest.n_layer, manifest.model_digest,
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
        await _serving(opts, engine, source, print_line, status)
    finally:
        status.close()


async def _serving(opts, engine, source: "_Source | None", print_line, status: StatusLine) -> None:
    async with trio.open_nursery() as nursery:
        node = await start_node(nursery, opts.identity, listen=f"{opts.listen_host}:0", bootstrap=opts.bootstrap,
                                serve=dial_checks)  # it checks others' reachability, as they check its

        async def choose(spans: list[Span], n_layer: int) -> tuple[int, int]:
            if opts.layers is not None:
                return opts.layers
            mine = str(opts.identity.peer_id)  # a restart's own report is not someone else's coverage
            answered = await answering_spans([s for s in spans if s.peer_id != mine], dial_report)
            return choose_span(answered, n_layer, opts.num_layers or default_num_layers(n_layer))

        if source is None:  # no file: the span's parts from the peers that serve the model
            named = await find_model(node, opts.model_ref, opts.trust or TrustPolicy.default(opts.bootstrap))
            partial, start, end, fetched = await obtain(node, named, choose, print_line, opts.progress)
            print_line(f"fetched {fetched['bytes']} bytes of {partial.manifest.file_size} for layers {start}:{end}")
            source = _Source(partial.path, partial.manifest.source_sha256, partial.manifest.n_layer,
                             partial.manifest.model_digest, named.entry.name, partial.manifest,
                             lambda: set(partial.present))
        else:
            spans = [Span.from_report(r) for r in await peers_for_model(node, source.digest)] if opts.layers is None else []
            start, end = await choose(spans, source.n_layer)
        digest, key, source_sha = source.digest, model_key(source.digest), source.source_sha
        whole = (start, end) == (0, source.n_layer) and source.parts is None
        shard = source.path if whole else await trio.to_thread.run_sync(
            lambda: ensure_shard(source.path, start, end, source_sha, opts.progress))
        load = await trio.to_thread.run_sync(
            lambda: engine.load(opts.engine.load_request(shard, source_sha256=source_sha if whole else None,
                                                         progress=opts.progress)))
        load.status.raise_for_status()
        throughput = await trio.to_thread.run_sync(measure_throughput, engine)
        weights = WeightStore()  # this file's parts, for volunteers that fetch only their span
        weights.add(source.manifest, source.path, source.parts)
        plane = await start_data_plane(nursery, engine, opts.identity, opts.listen_host, opts.listen_port,
                                       relay=opts.relay, limits=opts.limits, weights=weights,
                                       on_open=lambda sid: print_line(f"session {sid[:12]} opened"))
        servicer, creds = plane.servicer, plane.creds
        if opts.metrics is not None:
            from .metrics import DataPlaneCollector, DhtCollector, EngineCollector, metrics_url, serve_metrics

            bound = await serve_metrics(nursery, opts.metrics, "join", EngineCollector(engine),
                                        DataPlaneCollector(servicer, plane.server), DhtCollector(node))
            print_line(f"metrics on {metrics_url(*bound)}")
        # listening on every address: it is dialled at the one it reaches the swarm from
        here = str(Multiaddr.for_socket(advertised_host(opts.listen_host, opts.bootstrap), "tcp", plane.server.port,
                                        opts.identity.peer_id))
        addr = str(opts.announce) if opts.announce is not None else here  # where others dial it directly
        caps = engine.capabilities()
        reach = _Reach(relay=opts.relay, plane=plane, here=here)  # the relay it is reachable through now, if any
        wake = [trio.Event()]  # set: announce now (a new relay), not at the next period

        last = {"at": time.monotonic(), "m": engine.metrics()}

        def recent_load(m) -> dict:
            """What it did since its last report: for monitors (a claim, never used to route)."""
            now = time.monotonic()
            dt, before = max(1e-3, now - last["at"]), last["m"]
            passes, rows = m.passes - before.passes, m.rows - before.rows
            last.update(at=now, m=m)
            return {"sessions": min(m.active_sessions, 4096), "rows_per_pass": round(rows / passes, 3) if passes else 0.0,
                    "tokens_per_s": round(min(rows / dt, 100_000.0), 3),
                    "busy": round(min(1.0, max(0.0, (m.compute_seconds - before.compute_seconds) / dt)), 4)}

        def report(departing: bool = False) -> bytes:
            m = engine.metrics()
            relay = reach.relay
            rep = CapabilityReport(
                digest, caps.recipe_digest, (start, end),
                (circuit_addr(relay, opts.identity.peer_id),) if relay else (addr,), throughput=round(throughput, 2),
                free_sessions=0 if departing else servicer.open_to_newcomers(),
                kv_tokens_free=caps.kv_token_budget - m.kv_tokens_reserved,
                relay=str(relay) if relay else None, tls_cert=creds.cert_pem.decode(),
                public_name=opts.public_name, departing=departing,
                recipe=caps.recipe, recipe_labels=getattr(caps, "recipe_labels", None) or {},
                load=recent_load(m),
            )
            now = wall_ms()
            return rep.sign(opts.identity, seq=now, now_ms=now, ttl_ms=10_000 if departing else CAPABILITY_TTL_MS)

        name = source.name

        async def publish_all() -> None:
            if reach.unreachable and reach.relay is None:
                return  # nobody could dial it: its report would only cost clients a timeout
            try:  # a refusal by other nodes is theirs to have; this peer keeps serving and tries again
                stored = await node.publish(key, report())
                await node.publish(MODELS_KEY, sign_model_index(opts.identity, digest, name, source.n_layer,
                                                                now_ms=wall_ms()))
            except MeshnetError as e:
                print_line(f"announce failed, retrying in {ANNOUNCE_INTERVAL_S:g} s: {e}")
                return
            # say so when the swarm stops (or starts again) taking its report: a partition, a lost bootstrap
            if (stored > 0) != reach.announcing:
                reach.announcing = stored > 0
                print_line(f"announce reaching peers again ({stored})" if stored else
                           f"announce reached no peer; retrying every {ANNOUNCE_INTERVAL_S:g} s")

        print_line(f"serving on {here}")  # (announced below, once others can reach it)
        if opts.relay is None:
            # Can others dial the address it would announce? Several peers try (reachability.py).
            verdict = await _reachability(node, addr, opts)
            print_line(f"reachability: {verdict.status} ({verdict.reason})")
            if verdict.status == UNKNOWN:  # nobody could tell: announce it, and ask again in the background
                nursery.start_soon(_recheck, node, addr, opts, print_line, reach, wake)
            if verdict.status == UNREACHABLE:
                await _go_relayed(nursery, node, opts, reach, wake, print_line)
        else:
            print_line(f"reachable via {circuit_addr(opts.relay, opts.identity.peer_id)}")
        await publish_all()
        for local in plane.addrs:  # on every address: a line each, loopback last
            print_line(f"listening on {local}")
        if addr != here and not reach.unreachable:
            print_line(f"announcing {addr}")
        print_line(f"recipe {caps.recipe_digest}")

        announcing = trio.CancelScope()

        async def announce_until_leaving() -> None:
            with announcing:
                await announce_loop(publish_all, wake, node.stats)

        nursery.start_soon(announce_until_leaving)
        if status.enabled:
            nursery.start_soon(_status_line, status, engine, node, (start, end), reach)
        await until_signalled()
        # Leave politely: say so, refuse newcomers, let open sessions finish. No regular
        # report may follow the departing one (it would say "come" again for 120 s).
        announcing.cancel()
        servicer.draining = True
        if not (reach.unreachable and reach.relay is None):  # nobody could reach it: nothing to retract
            with trio.move_on_after(5):
                await node.publish(key, report(departing=True))
        with trio.move_on_after(DRAIN_GRACE_S):
            while engine.metrics().active_sessions:
                await trio.to_thread.run_sync(servicer.reap_idle, DRAIN_IDLE_MS)  # generations finish; sessions that only sit hold nothing up
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()


async def announce_loop(publish: Callable, wake: list, counts, interval: float = ANNOUNCE_INTERVAL_S) -> None:
    """Announce every ``interval`` (or at once when ``wake[0]`` is set). A failing
    announce is counted (``loop_errors_announce``) and tried again: never the end of the peer."""
    guard = Guard("announce", counts)
    while True:
        with trio.move_on_after(interval):
            await wake[0].wait()
        wake[0] = trio.Event()
        async with guard:
            await publish()


UNCHECKED = "unchecked"  # an address no dialer would dial (a DNS --announce): taken as given
RECHECK_S = 30.0  # after an undecided reachability check, ask again after this, doubling...
RECHECK_MAX_S = 600.0  # ...up to this


async def _reachability(node, addr: str, opts: JoinOptions):
    try:
        return await check_reachability(node, [addr], avoid=opts.bootstrap_peer_ids)
    except ReachabilityError as e:  # an address no dialer would dial (a DNS name): announced as given
        return Reachability(UNCHECKED, str(e), (), (), None, 0)


async def _go_relayed(nursery, node, opts: JoinOptions, reach: "_Reach", wake, print_line) -> None:
    """Nobody can dial this peer: reachable through a relay it finds, from now on.
    Returns once a relay holds a slot for it (until then it announces nothing)."""
    reach.unreachable = True
    node.config.client_mode = True  # an address others cannot reach must not enter their tables

    def relay_changed(held) -> None:
        reach.relay = held.relay if held is not None else None
        if held is not None:
            print_line(f"reachable via {circuit_addr(held.relay, opts.identity.peer_id)}")
            wake[0].set()

    on_loopback = (ip_of(Multiaddr.parse(reach.here).host) or ip_address("0.0.0.0")).is_loopback
    # the relay is checked by others dialling through it (a relay sees who dials), itself if too few answer
    await nursery.start(RelayKeeper(node, opts.identity, reach.plane.server.adopt, on_change=relay_changed,
                                    print_line=print_line, allow_loopback=on_loopback,
                                    verify=relay_check(node, avoid=opts.bootstrap_peer_ids)).run)


async def _recheck(node, addr: str, opts: JoinOptions, print_line, reach: "_Reach", wake) -> None:
    """Ask again until the swarm can tell (every RECHECK_S, then less often); if it
    is unreachable after all, go relayed."""
    wait = RECHECK_S
    guard = Guard("recheck", node.stats)  # a check that fails is asked again, never the end of the peer
    while True:
        await trio.sleep(wait)
        wait = min(wait * 2, RECHECK_MAX_S)
        async with guard:
            verdict = await _reachability(node, addr, opts)
            if verdict.status == UNKNOWN:
                continue
            if verdict.status == UNCHECKED:
                return
            print_line(f"reachability: {verdict.status} ({verdict.reason})")
            if verdict.status == UNREACHABLE:
                async with trio.open_nursery() as nursery:
                    await _go_relayed(nursery, node, opts, reach, wake, print_line)
            return



STATUS_EVERY_S = 1.0


async def _status_line(status: StatusLine, engine, node, span: tuple[int, int], reach: "_Reach") -> None:
    """``join``'s line on a terminal: what it serves, its sessions, the rows it
    computes per second, the peers its DHT node knows, how it is reached."""
    before, at = engine.metrics(), time.monotonic()
    guard = Guard("status_line", node.stats)
    while True:
        await trio.sleep(STATUS_EVERY_S)
        async with guard:
            m, now = engine.metrics(), time.monotonic()
            rate = (m.rows - before.rows) / max(1e-3, now - at)
            before, at = m, now
            how = f"via relay {str(reach.relay.peer_id)[-8:]}" if reach.relay else (
                "unreachable, finding a relay" if reach.unreachable else "direct")
            status.update(f"layers {span[0]}-{span[1] - 1} | {m.active_sessions} sessions | {rate:.1f} tok/s | "
                          f"{len(node.table)} peers seen | {how}")
