"""Prometheus metrics for every long-running role (``--metrics HOST:PORT``).

The engine, the DHT node, the data plane, the relay and the client keep plain
counters (``stats.py``, ``node.stats``, ``relay.stats``); the collectors here
read them at scrape time and turn them into metric families with the official
``prometheus_client`` library, whose text format Prometheus and every scraper
read. Nothing below the roles imports this module.

Each process has its own ``CollectorRegistry`` (not the library's global one),
so two roles in one process, and tests, stay apart. The exposition is
prometheus_client's ASGI app served by hypercorn's trio worker (the API's
server already): it lives in the role's nursery and ends with it, and a scrape
runs the collectors on the trio thread, where the DHT node and the relay
change their counters, so it reads them whole. (prometheus_client's own
``start_http_server`` would run them on a thread of its own, racing both.)

Names: ``meshnet_`` prefix, ``_total`` on counters, base units (``_seconds``,
``_bytes``); label values come from small fixed sets (phases, kinds, reasons,
error code names), never a session or a peer ID.

    bound = await serve_metrics(nursery, "127.0.0.1:0", "join", EngineCollector(engine), ...)
"""

from __future__ import annotations

from typing import Iterable, Iterator

import trio
from prometheus_client import CollectorRegistry, ProcessCollector, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from meshnet_p2p import __version__
from meshnet_p2p.core.errors import MeshnetError, unwrap_errors
from meshnet_p2p.swarm.node import parse_listen
from meshnet_p2p.core.stats import Counters, HistogramSnapshot

PATH = "/metrics"


class MetricsError(MeshnetError):
    pass


# --- building families ------------------------------------------------------------------------------


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _labelled(name: str, doc: str, label: str, values: dict, allowed: Iterable[str] | None = None) -> Metric:
    """A counter with one sample per label value; with ``allowed``, only those (each one, 0 if unseen)."""
    f = CounterMetricFamily(name, doc, labels=[label])
    keys = sorted(values) if allowed is None else list(allowed)
    for key in keys:
        f.add_metric([str(key)], values.get(key, 0))
    return f


def _histogram(f: HistogramMetricFamily, labels: list[str], snap: HistogramSnapshot) -> None:
    buckets = [("+Inf" if b == float("inf") else repr(float(b)), n) for b, n in snap.cumulative()]
    f.add_metric(labels, buckets, snap.total)


def histogram_family(name: str, doc: str, snap: HistogramSnapshot) -> HistogramMetricFamily:
    f = HistogramMetricFamily(name, doc)
    _histogram(f, [], snap)
    return f


# --- collectors: each reads one part's counters at scrape time ------------------------------------


class InfoCollector(Collector):
    def __init__(self, role: str) -> None:
        self.role = role

    def collect(self) -> Iterator[Metric]:
        f = GaugeMetricFamily("meshnet_build_info", "this process: its meshnet-p2p version and role",
                              labels=["version", "role"])
        f.add_metric([__version__, self.role], 1)
        yield f


class EngineCollector(Collector):
    """A ShardEngine's ``metrics()``: sessions, KV, steps, tokens, llama_decode passes and batch sizes."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        m = self.engine.metrics()
        yield _gauge("meshnet_engine_open_sessions", "sessions open in the engine", m.active_sessions)
        yield _gauge("meshnet_engine_kv_tokens_reserved", "KV cache positions reserved by open sessions",
                     m.kv_tokens_reserved)
        yield _gauge("meshnet_engine_kv_tokens_used", "KV cache positions filled", m.kv_tokens_used)
        yield _counter("meshnet_engine_steps_total", "steps computed (prefill and decode)", m.steps)
        yield _counter("meshnet_engine_tokens_processed_total", "rows (positions) computed through this shard",
                       m.tokens_processed)
        yield _counter("meshnet_engine_tokens_sampled_total", "tokens sampled (tail shards)", m.tokens_sampled)
        yield _counter("meshnet_engine_sessions_refused_total", "sessions the engine refused (no capacity)", m.refused)
        yield _counter("meshnet_engine_cancels_total", "cancels of sessions or steps", m.cancelled)
        yield _counter("meshnet_engine_steps_failed_total", "steps that ended in an error", m.failed_steps)
        yield _counter("meshnet_engine_passes_total", "llama_decode calls", m.passes)
        yield _counter("meshnet_engine_shared_passes_total", "llama_decode calls carrying steps of several sessions",
                       m.shared_passes)
        yield _counter("meshnet_engine_rows_total", "rows the llama_decode calls carried", m.rows)
        yield _counter("meshnet_engine_compute_seconds_total", "time spent inside llama_decode", m.compute_seconds)
        yield _counter("meshnet_engine_fewer_thread_passes_total",
                       "llama_decode calls run on fewer than --threads (measured faster there, e.g. after idle)",
                       m.fewer_thread_passes)
        if m.rows_per_pass is not None:  # (an engine that keeps no batch sizes shows none)
            yield histogram_family("meshnet_engine_batch_rows", "rows per llama_decode call (batch size)",
                                   m.rows_per_pass)


class DataPlaneCollector(Collector):
    """The ShardRuntime servicer's sessions and steps, and its server's connections and bytes."""

    def __init__(self, servicer, server=None) -> None:
        self.servicer = servicer
        self.server = server

    def collect(self) -> Iterator[Metric]:
        from meshnet_p2p.core.stats import LINK_OUTCOMES, STEP_KINDS, STEP_PHASES

        s = self.servicer.stats
        sessions, refused, errors = s.sessions.snapshot(), s.refused.snapshot(), s.step_errors.snapshot()
        yield _counter("meshnet_dataplane_sessions_opened_total", "sessions opened", sessions["opened"])
        yield _labelled("meshnet_dataplane_sessions_refused_total",
                        "session opens refused, by the error code answered (CAPACITY, FINGERPRINT_MISMATCH, ...)",
                        "reason", refused, _codes(refused, ("CAPACITY", "FINGERPRINT_MISMATCH")))
        yield _labelled("meshnet_dataplane_sessions_released_total",
                        "sessions the peer ended: idle too long, or reclaimed for a fair share when full", "reason",
                        {"idle": sessions["released_idle"], "reclaimed": sessions["reclaimed"]}, ("idle", "reclaimed"))
        yield _gauge("meshnet_dataplane_free_sessions", "sessions a new client could open now",
                     self.servicer.open_to_newcomers())
        yield _labelled("meshnet_dataplane_steps_total", "steps computed, by kind", "kind", s.steps.snapshot(),
                        STEP_KINDS)
        yield _labelled("meshnet_dataplane_tokens_total", "rows (token ids or hidden states) the computed steps carried",
                        "kind", s.tokens.snapshot(), STEP_KINDS)
        yield _labelled("meshnet_dataplane_step_errors_total", "steps answered with an error, by error code",
                        "code", errors, _codes(errors, ()))
        yield _labelled("meshnet_dataplane_ring_links_total", "ring links clients asked for, by outcome (docs/ring.md)",
                        "outcome", s.links.snapshot(), LINK_OUTCOMES)
        f = HistogramMetricFamily("meshnet_dataplane_step_seconds",
                                  "a step's time on this peer, by phase (docs/metrics.md)", labels=["phase"])
        for phase in STEP_PHASES:
            _histogram(f, [phase], s.step_seconds[phase].snapshot())
        yield f
        yield _counter("meshnet_dataplane_keep_warm_seconds_total",
                       "CPU time spent keeping CPUs awake between steps, at idle priority (--keep-warm)",
                       self.servicer.keep_warm.stats().spun_s)
        if self.server is not None:
            wire = self.server.stats.snapshot()
            yield _counter("meshnet_dataplane_received_bytes_total", "bytes read from clients' connections (TLS)",
                           wire["bytes_in"])
            yield _counter("meshnet_dataplane_sent_bytes_total", "bytes written to clients' connections (TLS)",
                           wire["bytes_out"])
            yield _counter("meshnet_dataplane_connections_total", "client connections served", wire["connections"])
            yield _gauge("meshnet_dataplane_open_connections", "client connections open now",
                         self.server.open_connections())


def _codes(seen: dict, always: Iterable[str]) -> list[str]:
    """The data plane's error code names to show: ``always`` (at 0 if unseen), and
    any other once seen (names of an enum: a bounded set)."""
    from meshnet_p2p.dataplane.wire import error_names

    names = set(error_names())
    return sorted({*always, *(k for k in seen if k in names)})


class DhtCollector(Collector):
    """A DHT node's ``stats`` (a Counter of named events) as labelled families, and its lookups."""

    def __init__(self, node) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        from meshnet_p2p.dht.node import LOOKUP_OPS
        from meshnet_p2p.dht.wire import REQUESTS
        from meshnet_p2p.core.records import Reject
        from meshnet_p2p.nat.dialback import DIAL_BACK

        st = dict(self.node.stats)  # one copy: the node's task may count while this reads
        kinds = sorted(REQUESTS | {DIAL_BACK})  # the DHT's own kinds and the one the roles add (nat/dialer.py)
        yield _labelled("meshnet_dht_requests_sent_total", "requests sent, by kind", "kind",
                        {k: st.get("sent_" + k, 0) for k in kinds}, kinds)
        yield _labelled("meshnet_dht_requests_received_total", "requests received, by kind", "kind",
                        {k: st.get("received_" + k, 0) for k in kinds}, kinds)
        b = CounterMetricFamily("meshnet_dht_sent_bytes_total", "datagram bytes sent, by the request kind "
                                "they ask or answer", labels=["kind", "part"])
        for kind in kinds:
            b.add_metric([kind, "request"], st.get("bytes_sent_" + kind, 0))
            b.add_metric([kind, "answer"], st.get("bytes_answered_" + kind, 0))
        yield b
        yield _counter("meshnet_dht_request_timeouts_total", "requests sent that got no answer in time",
                       st.get("timeouts", 0))
        f = HistogramMetricFamily("meshnet_dht_lookup_seconds", "iterative lookups and how long they took, "
                                  "by operation", labels=["op"])
        for op in LOOKUP_OPS:
            _histogram(f, [op], self.node.lookup_seconds[op].snapshot())
        yield f
        yield _labelled("meshnet_dht_lookup_failures_total", "lookups no remote node answered (a put: none stored)",
                        "op", dict(self.node.lookup_failures), LOOKUP_OPS)
        g = CounterMetricFamily("meshnet_dht_gossip_messages_total", "gossip requests, by direction and kind",
                                labels=["direction", "kind"])
        for direction, prefix in (("in", "received_"), ("out", "sent_")):
            for kind in ("push", "pull"):
                g.add_metric([direction, kind], st.get(f"{prefix}gossip_{kind}", 0))
        yield g
        outcomes = ("new", "duplicate", "rate_limited", "full")  # full: a new signer to a full topic
        yield _labelled("meshnet_dht_gossip_records_total", "records offered by gossip, by outcome", "outcome",
                        {o: st.get("gossip_" + o, 0) for o in outcomes}, outcomes)
        yield _counter("meshnet_dht_gossip_pushes_skipped_total", "gossip pushes skipped (too many in flight)",
                       st.get("gossip_push_skipped", 0))
        reasons = [r.value for r in Reject]
        yield _labelled("meshnet_dht_records_rejected_total", "records refused, by reason", "reason",
                        {r: st.get("rejected_" + r, 0) for r in reasons}, reasons)
        dropped = {"malformed": "bad_datagrams", "replayed": "replayed_datagrams",
                   "unexpected_response": "unexpected_responses", "bad_request": "bad_requests"}
        yield _labelled("meshnet_dht_dropped_datagrams_total", "datagrams dropped, by reason", "reason",
                        {r: st.get(key, 0) for r, key in dropped.items()}, dropped)
        yield _counter("meshnet_dht_cookies_sent_total", "address cookies sent instead of an answer",
                       st.get("cookies_sent", 0))
        yield _counter("meshnet_dht_evictions_total", "contacts evicted from the routing table", st.get("evicted", 0))
        yield _counter("meshnet_dht_rejoins_total", "times the node found its bootstrap peers again",
                       st.get("rejoined", 0))
        yield _labelled("meshnet_dht_dial_backs_total", "dial-backs this node made for others' reachability "
                        "checks, by result", "result", {"ok": st.get("dial_back_ok", 0),
                                                        "failed": st.get("dial_back_failed", 0)}, ("ok", "failed"))
        yield _labelled("meshnet_dht_dial_back_refusals_total", "dial-back requests refused, by reason", "reason",
                        _suffixed(st, "dial_back_refused_"), _DIAL_BACK_REFUSALS)
        answers = ("answered", "silent", "refused", "discarded")
        yield _labelled("meshnet_dht_reachability_answers_total", "answers to this node's own reachability "
                        "checks, by result", "result",
                        {a: _sum_under(st, "reachability_" + a) for a in answers}, answers)
        yield _counter("meshnet_dht_stores_rate_limited_total", "stores refused: too many from one network",
                       st.get("store_rate_limited", 0))
        store = self.node.store
        yield _labelled("meshnet_dht_full_key_stores_total", "stores that met a key holding its most values: "
                        "refused, or taken in place of a value whose signer is not known live", "result",
                        {"refused": store.full_key_refused, "replaced": store.full_key_replaced},
                        ("refused", "replaced"))
        # the node's and the role's loops (guard.py): the names are a small fixed set, from the code
        from meshnet_p2p.core.guard import LOOP_ERRORS

        loops = {**LOOP_ERRORS.snapshot(), **{k: v for k, v in st.items() if k.startswith("loop_errors_")}}
        yield _labelled("meshnet_loop_errors_total", "exceptions a background loop caught and survived, by loop",
                        "loop", _suffixed(loops, "loop_errors_"))
        yield _gauge("meshnet_dht_routing_table_contacts", "contacts in the routing table", len(self.node.table))
        yield _gauge("meshnet_dht_stored_records", "records this node stores for the DHT", len(self.node.store))


def _dial_back_refusals() -> tuple[str, ...]:
    from meshnet_p2p.nat import dialback

    reasons = (dialback.NOT_A_DIALER, dialback.BUSY, dialback.RATE_LIMITED, dialback.DNS_NAME, dialback.NOT_TCP,
               dialback.PORT_ZERO, dialback.ANOTHER_PEER)
    return tuple(r.replace(" ", "_") for r in reasons)


_DIAL_BACK_REFUSALS = _dial_back_refusals()


def _sum_under(st: dict, key: str) -> float:
    """``key``'s count plus those of ``key_<why>`` (reasons given in free text: summed, never labels)."""
    return sum(v for k, v in st.items() if k == key or k.startswith(key + "_"))


def _suffixed(st: dict, prefix: str) -> dict[str, float]:
    """The keys under ``prefix`` (``prefix + reason``), by reason."""
    return {k[len(prefix):]: v for k, v in st.items() if k.startswith(prefix) and len(k) > len(prefix)}


class RelayCollector(Collector):
    """A relay's reservations and circuits now, and its counters."""

    def __init__(self, relay) -> None:
        self.relay = relay

    def collect(self) -> Iterator[Metric]:
        r = self.relay
        load = r.load()
        yield _gauge("meshnet_relay_active_reservations", "peers holding a reservation now", load["reservations_now"])
        yield _gauge("meshnet_relay_open_circuits", "spliced connections open now", load["circuits_now"])
        yield _counter("meshnet_relay_reservations_total", "reservations granted", load["reservations"])
        yield _counter("meshnet_relay_reservations_expired_total", "reservations ended for silence", load["expired"])
        yield _counter("meshnet_relay_circuits_total", "connections spliced to a reserved peer", load["spliced"])
        reasons = ("unproven", "full", "network_limit", "circuit_limit", "source_limit", "no_reservation", "bad_target")
        yield _labelled("meshnet_relay_refusals_total", "reservations and connections refused, by reason", "reason",
                        dict(r.refusals), reasons)
        yield _labelled("meshnet_relay_circuits_closed_total", "circuits the relay closed itself: taken back for a "
                        "newcomer's fair share, or over a circuit's data or time cap", "reason", dict(r.closed),
                        ("taken_back", "data_cap", "time_cap"))
        f = CounterMetricFamily("meshnet_relay_spliced_bytes_total", "bytes spliced, by direction",
                                labels=["direction"])
        f.add_metric(["to_peer"], r.spliced_bytes["a->b"])
        f.add_metric(["from_peer"], r.spliced_bytes["b->a"])
        yield f


class ClientCollector(Collector):
    """A Client's generations, tokens, failovers and first-token latency."""

    def __init__(self, client) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        s = self.client.stats
        yield _labelled("meshnet_client_generations_total", "generations, by outcome", "outcome",
                        s.generations.snapshot(), ("completed", "failed"))
        yield _labelled("meshnet_client_tokens_total", "tokens of completed generations: the prompt's, and "
                        "those generated", "kind", s.tokens.snapshot(), ("prompt", "generated"))
        yield _counter("meshnet_client_failovers_total", "peers replaced mid-generation",
                       s.failovers.snapshot()["failovers"])
        yield histogram_family("meshnet_client_first_token_seconds", "time to the first token of a generation",
                               s.first_token_seconds.snapshot())


class ApiCollector(Collector):
    """The HTTP API's requests, by endpoint and status (both from small sets: see api.py)."""

    def __init__(self, requests: Counters) -> None:
        self.requests = requests

    def collect(self) -> Iterator[Metric]:
        f = CounterMetricFamily("meshnet_api_requests_total", "HTTP requests, by endpoint and status",
                                labels=["endpoint", "status"])
        for (endpoint, status), n in sorted(self.requests.snapshot().items()):
            f.add_metric([endpoint, status], n)
        yield f


# --- serving ------------------------------------------------------------------------------------------


def make_registry(role: str, *collectors: Collector) -> CollectorRegistry:
    """A registry of its own, with ``meshnet_build_info``, the standard ``process_*``
    metrics (CPU seconds, resident memory, open descriptors) and ``collectors``."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(InfoCollector(role))
    for c in collectors:
        registry.register(c)
    return registry


def _app(registry: CollectorRegistry):
    """prometheus_client's ASGI app on ``/metrics`` only, with the lifespan events hypercorn sends."""
    metrics = make_asgi_app(registry)

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif scope["type"] == "http" and scope["path"] == PATH:
            await metrics(scope, receive, send)
        elif scope["type"] == "http":
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": f"metrics are at {PATH}\n".encode()})

    return app


def parse_metrics_listen(text: str) -> tuple[str, int]:
    """``--metrics HOST:PORT`` (port 0: any), as ``--listen`` is parsed."""
    return parse_listen(text, flag="--metrics")


async def serve_metrics(nursery: trio.Nursery, listen: str, role: str, *collectors: Collector) -> tuple[str, int]:
    """Serve ``/metrics`` on ``listen`` (HOST:PORT) in ``nursery`` until it ends;
    returns the bound (host, port). The role's name labels ``meshnet_build_info``."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    host, port = parse_metrics_listen(listen)
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    app = _app(make_registry(role, *collectors))
    try:
        with unwrap_errors(OSError):  # hypercorn's nurseries wrap a bind error in a group
            binds = await nursery.start(lambda task_status: serve(app, config, task_status=task_status))
    except OSError as e:  # a port taken, an address not this machine's
        raise MetricsError(f"cannot serve metrics on {listen}: {e.strerror or e}") from None
    return host, int(binds[0].rsplit(":", 1)[1])


def metrics_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}{PATH}" if ":" in host else f"http://{host}:{port}{PATH}"
