"""A volunteer: what ``meshnet-peer join`` runs, as one object that composes its duties.

:class:`Volunteer` takes a span (the one asked for, or the one the swarm most
needs), loads it, serves it on the data plane, makes itself reachable, and keeps
its report in the DHT until it is told to leave; then it drains. Each duty is a
class of its own, as petals' server composes a ``ModuleAnnouncerThread``:

- :class:`~meshnet_p2p.swarm.announcer.Announcer`: the signed report and the
  model's index entry, re-published every period or when something changed (the
  simulator runs the same one);
- :class:`Reachable`: whether others can dial the address it would announce (asked
  of several peers), asking again while nobody can tell, and going through a relay
  (nat/keeper.py's RelayKeeper) when nobody can dial it;
- :class:`StatusReporter`: the one line a terminal shows (span, sessions, rows/s,
  peers seen, how it is reached);
- :class:`Drain`: leaving politely: no report after the departing one,
  newcomers refused, open sessions let finish (bounded).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from ipaddress import ip_address
from typing import TYPE_CHECKING, Callable

import numpy as np
import trio

from meshnet_p2p.client.named import find_model, obtain
from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.guard import Guard
from meshnet_p2p.core.identity import PeerId
from meshnet_p2p.core.lifecycle import until_signalled
from meshnet_p2p.core.multiaddr import Multiaddr, ip_of
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.dataplane.weights import WeightStore
from meshnet_p2p.engine.contract import HIDDEN, DecodeRequest, OpenRequest, PrefillRequest, Tensor, TensorBundle
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.engine.manifest import Manifest
from meshnet_p2p.engine.models import ensure_shard
from meshnet_p2p.nat.dialback import UNKNOWN, UNREACHABLE, Reachability
from meshnet_p2p.nat.keeper import RelayKeeper
from meshnet_p2p.nat.reachability import ReachabilityError, check_reachability, dial_checks, relay_check, \
    relay_dial_check, tls_dial_check
from meshnet_p2p.swarm.announcer import ANNOUNCE_INTERVAL_S, Announcer
from meshnet_p2p.swarm.capability import CAPABILITY_TTL_MS, MODELS_KEY, CapabilityReport, model_key, sign_model_index
from meshnet_p2p.swarm.node import advertised_host, peers_for_model, start_node
from meshnet_p2p.swarm.placement import Span, choose_span, default_num_layers
from meshnet_p2p.swarm.placing import answering_spans
from meshnet_p2p.swarm.relay_offers import circuit_addr
from meshnet_p2p.trust.policy import TrustPolicy

from .progress import StatusLine
from .serve import start_data_plane

if TYPE_CHECKING:
    from .join import JoinOptions

DRAIN_GRACE_S = 30.0
DRAIN_IDLE_MS = 2_000  # while leaving, a session silent this long is released
UNCHECKED = "unchecked"  # an address no dialer would dial (a DNS --announce): taken as given
RECHECK_S = 30.0  # after an undecided reachability check, ask again after this, doubling...
RECHECK_MAX_S = 600.0  # ...up to this
STATUS_EVERY_S = 1.0


@dataclass
class Source:
    """The model file shards are cut from: whole, or a partial copy of it (fetched)."""

    path: str
    source_sha: str
    n_layer: int
    digest: str  # the model digest
    name: str
    manifest: Manifest
    parts: Callable[[], set[str]] | None = None  # what a partial copy holds now; None: all


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


class Reachable:
    """How others reach this volunteer, and the duty of keeping it reachable."""

    def __init__(self, node, opts: "JoinOptions", plane, here: str, print_line: Callable[[str], None],
                 wake: Callable[[], None]) -> None:
        self.node = node
        self.opts = opts
        self.plane = plane  # its data plane (whose server adopts relayed connections)
        self.here = here  # where it listens, as others would dial it directly
        self.print_line = print_line
        self.wake = wake  # announce now: how it is reached changed
        self.relay: Multiaddr | None = opts.relay  # the relay it is reachable through now
        self.unreachable = False  # others cannot dial it directly

    @property
    def announceable(self) -> bool:
        """Whether anyone could dial it: a report otherwise would only cost clients a timeout."""
        return not (self.unreachable and self.relay is None)

    async def check(self, addr: str) -> Reachability:
        try:
            return await check_reachability(self.node, [addr], avoid=self.opts.bootstrap_peer_ids)
        except ReachabilityError as e:  # an address no dialer would dial (a DNS name): announced as given
            return Reachability(UNCHECKED, str(e), (), (), None, 0)

    async def settle(self, nursery, addr: str) -> None:
        """At start: can others dial ``addr``? Several peers try (nat/reachability.py). Undecided:
        announced, and asked again in the background; unreachable: through a relay from now on."""
        if self.opts.relay is not None:
            self.print_line(f"reachable via {circuit_addr(self.opts.relay, self.opts.identity.peer_id)}")
            return
        verdict = await self.check(addr)
        self.print_line(f"reachability: {verdict.status} ({verdict.reason})")
        if verdict.status == UNKNOWN:
            nursery.start_soon(self.recheck, addr)
        if verdict.status == UNREACHABLE:
            await self.go_relayed(nursery)

    async def go_relayed(self, nursery) -> None:
        """Nobody can dial this peer: reachable through a relay it finds, from now on.
        Returns once a relay holds a slot for it (until then it announces nothing)."""
        self.unreachable = True
        self.node.config.client_mode = True  # an address others cannot reach must not enter their tables

        def relay_changed(held) -> None:
            self.relay = held.relay if held is not None else None
            if held is not None:
                self.print_line(f"reachable via {circuit_addr(held.relay, self.opts.identity.peer_id)}")
                self.wake()

        on_loopback = (ip_of(Multiaddr.parse(self.here).host) or ip_address("0.0.0.0")).is_loopback
        # the relay is checked by others dialling through it (a relay sees who dials), itself if too few answer
        await nursery.start(RelayKeeper(self.node, self.opts.identity, self.plane.server.adopt,
                                        on_change=relay_changed, print_line=self.print_line,
                                        allow_loopback=on_loopback,
                                        verify=relay_check(self.node, avoid=self.opts.bootstrap_peer_ids)).run)

    async def recheck(self, addr: str) -> None:
        """Ask again until the swarm can tell (every RECHECK_S, then less often); if it
        is unreachable after all, go relayed."""
        wait = RECHECK_S
        guard = Guard("recheck", self.node.stats)  # a check that fails is asked again, never the end of the peer
        while True:
            await trio.sleep(wait)
            wait = min(wait * 2, RECHECK_MAX_S)
            async with guard:
                verdict = await self.check(addr)
                if verdict.status == UNKNOWN:
                    continue
                if verdict.status == UNCHECKED:
                    return
                self.print_line(f"reachability: {verdict.status} ({verdict.reason})")
                if verdict.status == UNREACHABLE:
                    async with trio.open_nursery() as nursery:
                        await self.go_relayed(nursery)
                return

    def how(self) -> str:
        return f"via relay {str(self.relay.peer_id)[-8:]}" if self.relay else (
            "unreachable, finding a relay" if self.unreachable else "direct")


class StatusReporter:
    """``join``'s line on a terminal: what it serves, its sessions, the rows it computes per
    second, the peers its DHT node knows, how it is reached."""

    def __init__(self, status: StatusLine, engine, node, span: tuple[int, int], reach: Reachable) -> None:
        self.status, self.engine, self.node, self.span, self.reach = status, engine, node, span, reach

    async def run(self) -> None:
        before, at = self.engine.metrics(), time.monotonic()
        guard = Guard("status_line", self.node.stats)
        while True:
            await trio.sleep(STATUS_EVERY_S)
            async with guard:
                m, now = self.engine.metrics(), time.monotonic()
                rate = (m.rows - before.rows) / max(1e-3, now - at)
                before, at = m, now
                self.status.update(f"layers {self.span[0]}-{self.span[1] - 1} | {m.active_sessions} sessions | "
                                   f"{rate:.1f} tok/s | {len(self.node.table)} peers seen | {self.reach.how()}")


class Volunteer:
    """One volunteer serving one span of one model (see the module's doc). ``source``: the
    whole model's file, or None to fetch the span's parts from the peers (``opts.model_ref``).
    The engine is the caller's (it outlives every task here)."""

    def __init__(self, opts: "JoinOptions", engine, source: Source | None, print_line: Callable[[str], None],
                 status: StatusLine) -> None:
        self.opts = opts
        self.engine = engine
        self.source = source
        self.print_line = print_line
        self.status = status
        self.span: tuple[int, int] | None = None
        self._last = {"at": time.monotonic(), "m": None}

    async def run(self) -> None:
        """Serve until signalled, then drain."""
        opts, print_line = self.opts, self.print_line
        async with trio.open_nursery() as nursery:
            self.node = await start_node(nursery, opts.identity, listen=f"{opts.listen_host}:0",
                                         bootstrap=opts.bootstrap,
                                         serve=dial_checks)  # it checks others' reachability, as they check its
            self.span = await self._take_span()
            await self._load()
            await self._serve_plane(nursery)
            # listening on every address: it is dialled at the one it reaches the swarm from
            here = str(Multiaddr.for_socket(advertised_host(opts.listen_host, opts.bootstrap), "tcp",
                                            self.plane.server.port, opts.identity.peer_id))
            self.addr = str(opts.announce) if opts.announce is not None else here  # where others dial it directly
            self.announcer = Announcer(self.node.publish, self._records, interval=ANNOUNCE_INTERVAL_S,
                                       log=print_line, counts=self.node.stats,
                                       can_announce=lambda: self.reach.announceable)
            self.reach = Reachable(self.node, opts, self.plane, here, print_line, self.announcer.wake)
            print_line(f"serving on {here}")  # (announced below, once others can reach it)
            await self.reach.settle(nursery, self.addr)
            await self.announcer.announce()
            for local in self.plane.addrs:  # on every address: a line each, loopback last
                print_line(f"listening on {local}")
            if self.addr != here and not self.reach.unreachable:
                print_line(f"announcing {self.addr}")
            print_line(f"recipe {self.caps.recipe_digest}")
            nursery.start_soon(self.announcer.run, False)
            if self.status.enabled:
                nursery.start_soon(StatusReporter(self.status, self.engine, self.node, self.span, self.reach).run)
            await until_signalled()
            await self.drain()
            nursery.cancel_scope.cancel()

    async def _take_span(self) -> tuple[int, int]:
        """The span to serve: asked for, or the one the swarm most needs; with no file, its
        parts fetched from the peers (self.source set either way)."""
        opts = self.opts
        if self.source is None:  # no file: the span's parts from the peers that serve the model
            named = await find_model(self.node, opts.model_ref, opts.trust or TrustPolicy.default(opts.bootstrap))
            partial, start, end, fetched = await obtain(self.node, named, self._choose, self.print_line,
                                                        opts.progress)
            self.print_line(f"fetched {fetched['bytes']} bytes of {partial.manifest.file_size} "
                            f"for layers {start}:{end}")
            self.source = Source(partial.path, partial.manifest.source_sha256, partial.manifest.n_layer,
                                 partial.manifest.model_digest, named.entry.name, partial.manifest,
                                 lambda: set(partial.present))
            return start, end
        spans = [Span.from_report(r) for r in await peers_for_model(self.node, self.source.digest)] \
            if opts.layers is None else []
        return await self._choose(spans, self.source.n_layer)

    async def _choose(self, spans: list[Span], n_layer: int) -> tuple[int, int]:
        if self.opts.layers is not None:
            return self.opts.layers
        mine = str(self.opts.identity.peer_id)  # a restart's own report is not someone else's coverage
        answered = await answering_spans([s for s in spans if s.peer_id != mine], dial_report)
        return choose_span(answered, n_layer, self.opts.num_layers or default_num_layers(n_layer))

    async def _load(self) -> None:
        """The span's shard (cut if needed), loaded; its decode speed measured."""
        opts, source, (start, end) = self.opts, self.source, self.span
        whole = (start, end) == (0, source.n_layer) and source.parts is None
        shard = source.path if whole else await trio.to_thread.run_sync(
            lambda: ensure_shard(source.path, start, end, source.source_sha, opts.progress))
        load = await trio.to_thread.run_sync(
            lambda: self.engine.load(opts.engine.load_request(shard, source_sha256=source.source_sha if whole else None,
                                                              progress=opts.progress)))
        load.status.raise_for_status()
        self.throughput = await trio.to_thread.run_sync(measure_throughput, self.engine)
        self.caps = self.engine.capabilities()
        self._last.update(at=time.monotonic(), m=self.engine.metrics())

    async def _serve_plane(self, nursery) -> None:
        opts = self.opts
        weights = WeightStore()  # this file's parts, for volunteers that fetch only their span
        weights.add(self.source.manifest, self.source.path, self.source.parts)
        self.plane = await start_data_plane(nursery, self.engine, opts.identity, opts.listen_host, opts.listen_port,
                                            relay=opts.relay, limits=opts.limits, weights=weights,
                                            on_open=lambda sid: self.print_line(f"session {sid[:12]} opened"))
        if opts.metrics is not None:
            from .metrics import DataPlaneCollector, DhtCollector, EngineCollector, metrics_url, serve_metrics

            bound = await serve_metrics(nursery, opts.metrics, "join", EngineCollector(self.engine),
                                        DataPlaneCollector(self.plane.servicer, self.plane.server),
                                        DhtCollector(self.node))
            self.print_line(f"metrics on {metrics_url(*bound)}")

    def _recent_load(self, m) -> dict:
        """What it did since its last report: for monitors (a claim, never used to route)."""
        now = time.monotonic()
        dt, before = max(1e-3, now - self._last["at"]), self._last["m"]
        passes, rows = m.passes - before.passes, m.rows - before.rows
        self._last.update(at=now, m=m)
        return {"sessions": min(m.active_sessions, 4096), "rows_per_pass": round(rows / passes, 3) if passes else 0.0,
                "tokens_per_s": round(min(rows / dt, 100_000.0), 3),
                "busy": round(min(1.0, max(0.0, (m.compute_seconds - before.compute_seconds) / dt)), 4)}

    def report(self, departing: bool = False) -> bytes:
        """Its capability report, signed now."""
        m, caps, relay, me = self.engine.metrics(), self.caps, self.reach.relay, self.opts.identity
        rep = CapabilityReport(
            self.source.digest, caps.recipe_digest, self.span,
            (circuit_addr(relay, me.peer_id),) if relay else (self.addr,), throughput=round(self.throughput, 2),
            free_sessions=0 if departing else self.plane.servicer.open_to_newcomers(),
            kv_tokens_free=caps.kv_token_budget - m.kv_tokens_reserved,
            relay=str(relay) if relay else None, tls_cert=self.plane.creds.cert_pem.decode(),
            public_name=self.opts.public_name, departing=departing,
            recipe=caps.recipe, recipe_labels=getattr(caps, "recipe_labels", None) or {},
            load=self._recent_load(m),
        )
        now = wall_ms()
        return rep.sign(me, seq=now, now_ms=now, ttl_ms=10_000 if departing else CAPABILITY_TTL_MS)

    def _records(self) -> list[tuple[str, bytes]]:
        """One announcement: its report, and its model's entry in the index of model names."""
        s = self.source
        return [(model_key(s.digest), self.report()),
                (MODELS_KEY, sign_model_index(self.opts.identity, s.digest, s.name, s.n_layer, now_ms=wall_ms()))]

    async def drain(self) -> None:
        """Leave politely (:class:`Drain`)."""
        await Drain(self.plane.servicer, self.engine, self.announcer).run(model_key(self.source.digest),
                                                                          self.report(departing=True))


class Drain:
    """Leaving politely: refuse newcomers, say so (no regular report may follow the departing
    one: it would say "come" again for 120 s), let open sessions finish, at most ``grace`` s."""

    def __init__(self, servicer, engine, announcer: Announcer, grace: float = DRAIN_GRACE_S) -> None:
        self.servicer, self.engine, self.announcer, self.grace = servicer, engine, announcer, grace

    async def run(self, key: str, departing: bytes) -> None:
        self.servicer.draining = True
        await self.announcer.depart(key, departing)
        with trio.move_on_after(self.grace):
            while self.engine.metrics().active_sessions:
                # generations finish; sessions that only sit hold nothing up
                await trio.to_thread.run_sync(self.servicer.reap_idle, DRAIN_IDLE_MS)
                await trio.sleep(0.1)
