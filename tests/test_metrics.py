"""Prometheus metrics (``--metrics HOST:PORT``): the collectors' families and
names, the exposition, and a real swarm whose counters move while it
generates, read back with prometheus_client's own text parser."""

import json
import os
import socket
import urllib.error
import urllib.request
from collections import Counter

import pytest
import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meshnet_p2p.engine.keepwarm import KeepWarm
from meshnet_p2p import Client
from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.dataplane.servicer import ShardRuntimeServicer
from meshnet_p2p.nat.relay import Relay
from meshnet_p2p.engine.contract import MetricsResult
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.roles.metrics import (ApiCollector, ClientCollector, DataPlaneCollector, DhtCollector, EngineCollector,
                                 MetricsError, RelayCollector, make_registry, serve_metrics)
from meshnet_p2p.roles.peer_process import Swarm
from meshnet_p2p.core.stats import BATCH_ROWS, LOOKUP_SECONDS, ClientStats, Counters, Histogram, ServingStats

from tests.swarm import Proc, certify_swarm, meshnet_peer

PROMPT = "The capital of France is"


# --- reading an exposition ----------------------------------------------------------------------


def parse(text: str) -> dict:
    """{(sample name, sorted labels): value}, by prometheus_client's own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return parse(r.read().decode())


# --- unit: collectors over in-memory counters --------------------------------------------------


class FakeEngine:
    def __init__(self) -> None:
        self.rows = Histogram(BATCH_ROWS)

    def metrics(self) -> MetricsResult:
        return MetricsResult(active_sessions=2, steps=7, tokens_processed=40, passes=5, rows=40,
                             compute_seconds=0.25, fewer_thread_passes=3, rows_per_pass=self.rows.snapshot())


class FakeServicer:
    def __init__(self) -> None:
        self.stats = ServingStats()
        self.keep_warm = KeepWarm(1, 0.0)  # off: spun nothing

    def open_to_newcomers(self) -> int:
        return 3


class FakeServer:
    def __init__(self) -> None:
        self.stats = Counters(("bytes_in", "bytes_out", "connections"))

    def open_connections(self) -> int:
        return 1


class FakeNode:
    """What DhtCollector reads of a DHTNode, keys as the node counts them."""

    def __init__(self) -> None:
        self.stats = Counter({"sent_find_value": 4, "received_ping": 2, "timeouts": 1, "gossip_new": 3, "gossip_full": 6,
                              "rejected_expired": 1, "rejected_content: throughput must be finite": 1,
                              "dial_back_refused_rate_limited": 2, "reachability_refused_some free text": 1,
                              "bad_datagrams": 5, "bytes_sent_find_value": 400, "bytes_answered_gossip_pull": 900})
        self.lookup_seconds = {op: Histogram(LOOKUP_SECONDS) for op in ("find_node", "get", "put")}
        self.lookup_seconds["get"].observe(0.02)
        self.lookup_failures = Counter({"put": 1})
        self.table = [object()] * 3
        self.store = FakeStore()


class FakeStore(list):
    """What DhtCollector reads of a ValueStore: its size and its full-key counts."""

    def __init__(self) -> None:
        super().__init__([object()] * 2)
        self.full_key_refused, self.full_key_replaced = 5, 1


def all_collectors():
    engine = FakeEngine()
    for rows in (1, 2, 2, 64, 600):
        engine.rows.observe(rows)
    servicer, server = FakeServicer(), FakeServer()
    servicer.stats.sessions.add("opened", 2)
    servicer.stats.refused.add("CAPACITY")
    servicer.stats.steps.add("decode", 5)
    servicer.stats.step_seconds["compute"].observe(0.012)
    server.stats.add("bytes_in", 1000)
    client = type("FakeClient", (), {"stats": ClientStats()})()
    client.stats.generations.add("completed")
    client.stats.first_token_seconds.observe(0.3)
    requests = Counters()
    requests.add(("/v1/completions", "200"))
    relay = Relay(Identity.generate())  # a real one, not serving: its counters at rest
    return [EngineCollector(engine), DataPlaneCollector(servicer, server), DhtCollector(FakeNode()),
            RelayCollector(relay), ClientCollector(client), ApiCollector(requests)]


def test_the_families_follow_prometheus_naming():
    collectors = all_collectors()
    families = [f for c in collectors for f in c.collect()]
    assert len({f.name for f in families}) == len(families) > 40
    for f in families:
        assert f.name.startswith("meshnet_"), f.name
        assert f.type in ("counter", "gauge", "histogram"), f.name
        assert not any(unit in f.name for unit in ("_ms", "milli", "_kb", "_mb", "kbytes", "_bits")), f.name
        if "second" in f.name:
            assert f.name.endswith("_seconds"), f.name  # (a counter's _total comes after)
        if "byte" in f.name:
            assert f.name.endswith("_bytes"), f.name
        for s in f.samples:
            if f.type == "counter":
                assert s.name == f.name + "_total", s.name
            # bounded cardinality: no label names a session, a peer or an address
            assert not set(s.labels) & {"session", "session_id", "peer", "peer_id", "address", "host"}, s
    # the exposition parses with the library's own parser, into the same families
    text = generate_latest(make_registry("test", *collectors)).decode()
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert {f.name for f in families} <= set(parsed)
    assert value(parse(text), "meshnet_build_info", role="test", version=__import__("meshnet_p2p").__version__) == 1


def test_collectors_read_the_counters_they_are_given():
    s = parse(generate_latest(make_registry("test", *all_collectors())).decode())
    assert value(s, "meshnet_engine_steps_total") == 7
    assert value(s, "meshnet_engine_compute_seconds_total") == 0.25
    assert value(s, "meshnet_engine_fewer_thread_passes_total") == 3
    # batch sizes: Prometheus' cumulative buckets, "le" inclusive
    assert value(s, "meshnet_engine_batch_rows_bucket", le="1.0") == 1
    assert value(s, "meshnet_engine_batch_rows_bucket", le="2.0") == 3
    assert value(s, "meshnet_engine_batch_rows_bucket", le="512.0") == 4
    assert value(s, "meshnet_engine_batch_rows_bucket", le="+Inf") == value(s, "meshnet_engine_batch_rows_count") == 5
    assert value(s, "meshnet_engine_batch_rows_sum") == 669
    assert value(s, "meshnet_dataplane_sessions_opened_total") == 2
    assert value(s, "meshnet_dataplane_sessions_refused_total", reason="CAPACITY") == 1
    assert value(s, "meshnet_dataplane_sessions_refused_total", reason="FINGERPRINT_MISMATCH") == 0  # shown at 0
    assert value(s, "meshnet_dataplane_steps_total", kind="decode") == 5
    assert value(s, "meshnet_dataplane_step_seconds_count", phase="compute") == 1
    assert value(s, "meshnet_dataplane_step_seconds_bucket", phase="compute", le="0.025") == 1
    assert value(s, "meshnet_dataplane_step_seconds_bucket", phase="compute", le="0.01") == 0
    assert value(s, "meshnet_dataplane_received_bytes_total") == 1000
    assert value(s, "meshnet_dataplane_free_sessions") == 3
    assert value(s, "meshnet_dataplane_keep_warm_seconds_total") == 0
    assert value(s, "meshnet_dht_requests_sent_total", kind="find_value") == 4
    assert value(s, "meshnet_dht_requests_received_total", kind="ping") == 2
    assert value(s, "meshnet_dht_sent_bytes_total", kind="find_value", part="request") == 400
    assert value(s, "meshnet_dht_sent_bytes_total", kind="gossip_pull", part="answer") == 900
    assert value(s, "meshnet_dht_sent_bytes_total", kind="ping", part="answer") == 0  # shown at 0
    assert value(s, "meshnet_dht_gossip_records_total", outcome="new") == 3
    assert value(s, "meshnet_dht_gossip_records_total", outcome="full") == 6  # a full topic's refusals
    assert value(s, "meshnet_dht_gossip_records_total", outcome="rate_limited") == 0  # shown at 0
    assert value(s, "meshnet_dht_lookup_seconds_count", op="get") == 1
    assert value(s, "meshnet_dht_lookup_failures_total", op="put") == 1
    assert value(s, "meshnet_dht_dial_back_refusals_total", reason="rate_limited") == 2
    assert value(s, "meshnet_dht_reachability_answers_total", result="refused") == 1
    assert value(s, "meshnet_dht_routing_table_contacts") == 3
    assert value(s, "meshnet_dht_stored_records") == 2
    assert value(s, "meshnet_dht_full_key_stores_total", result="refused") == 5
    assert value(s, "meshnet_dht_full_key_stores_total", result="replaced") == 1
    # reasons given in free text never become label values
    rejected = {dict(k[1])["reason"] for k in s if k[0] == "meshnet_dht_records_rejected_total"}
    assert "expired" in rejected and not any(":" in r or " " in r for r in rejected)
    assert value(s, "meshnet_relay_open_circuits") == 0 and value(s, "meshnet_relay_refusals_total", reason="full") == 0
    assert value(s, "meshnet_client_generations_total", outcome="completed") == 1
    assert value(s, "meshnet_client_first_token_seconds_count") == 1
    assert value(s, "meshnet_api_requests_total", endpoint="/v1/completions", status="200") == 1
    assert value(s, "process_resident_memory_bytes") > 0  # the standard process metrics come along


def test_the_servicer_and_engine_count_what_they_serve(load_engine, model_path):
    """A real servicer in front of a real engine (the whole model, one session at most)."""
    engine = load_engine(model_path, max_sessions=1)
    servicer = ShardRuntimeServicer(engine)

    def open_(sid: str, fingerprint=servicer.fingerprint) -> pb.SessionRequest:
        return pb.SessionRequest(open=pb.SessionOpen(session_id=sid, fingerprint=fingerprint, max_tokens=16))

    def step(n: int, position: int, tokens: list[int], decode: bool) -> pb.SessionRequest:
        return pb.SessionRequest(step=pb.Step(work_id="w", idempotency_step=n, position=position, decode=decode,
                                              token_ids=tokens))

    wrong = pb.Fingerprint(model_digest="ab" * 32, recipe_digest="cd" * 32)
    assert list(servicer.Session(iter([open_("a", wrong)]), None))[0].error.code == pb.FINGERPRINT_MISMATCH
    held = servicer.Session(iter([open_("b"), step(1, 0, [1, 2, 3], False), step(2, 3, [5], True)]), None)
    try:
        assert next(held).HasField("accepted")
        assert next(held).HasField("result") and next(held).HasField("result")  # the session stays open here
        assert list(servicer.Session(iter([open_("c")]), None))[0].error.code == pb.CAPACITY  # the peer is full
    finally:
        held.close()
    s = parse(generate_latest(make_registry("test", EngineCollector(engine), DataPlaneCollector(servicer))).decode())
    assert value(s, "meshnet_dataplane_sessions_opened_total") == 1
    assert value(s, "meshnet_dataplane_sessions_refused_total", reason="FINGERPRINT_MISMATCH") == 1
    assert value(s, "meshnet_dataplane_sessions_refused_total", reason="CAPACITY") == 1
    assert value(s, "meshnet_dataplane_steps_total", kind="prefill") == value(s, "meshnet_dataplane_steps_total",
                                                                             kind="decode") == 1
    assert value(s, "meshnet_dataplane_tokens_total", kind="prefill") == 3
    assert value(s, "meshnet_dataplane_tokens_total", kind="decode") == 1
    for phase in ("queue", "compute", "reply"):
        assert value(s, "meshnet_dataplane_step_seconds_count", phase=phase) == 2
    assert value(s, "meshnet_dataplane_step_seconds_count", phase="total") == 1  # the prefill's reply was taken
    assert value(s, "meshnet_dataplane_step_seconds_sum", phase="compute") > 0
    # the engine: its own steps and the batch sizes of its passes (3 rows, then 1)
    assert value(s, "meshnet_engine_tokens_sampled_total") == 2
    assert value(s, "meshnet_engine_batch_rows_bucket", le="1.0") == 1
    assert value(s, "meshnet_engine_batch_rows_bucket", le="4.0") == value(s, "meshnet_engine_batch_rows_count") == 2
    assert value(s, "meshnet_engine_open_sessions") == 0  # released when its stream ended


def test_a_histogram_counts_a_bound_in_its_own_bucket():
    h = Histogram((1, 2))
    for v in (0.5, 1, 1.5, 2, 3):
        h.observe(v)
    snap = h.snapshot()
    assert snap.counts == (2, 2, 1) and snap.count == 5 and snap.total == 8
    assert snap.cumulative() == [(1, 2), (2, 4), (float("inf"), 5)]
    with pytest.raises(ValueError):
        Histogram((2, 1))


async def test_serve_metrics_binds_port_zero_and_serves_only_metrics():
    async with trio.open_nursery() as nursery:
        host, port = await serve_metrics(nursery, "127.0.0.1:0", "test", ApiCollector(Counters()))
        assert host == "127.0.0.1" and port > 0
        s = await trio.to_thread.run_sync(scrape, f"http://127.0.0.1:{port}/metrics")
        assert value(s, "meshnet_build_info", role="test", version=__import__("meshnet_p2p").__version__) == 1

        def other() -> int:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
            except urllib.error.HTTPError as e:
                return e.code
            return 200

        assert await trio.to_thread.run_sync(other) == 404
        with pytest.raises(MetricsError, match="cannot serve metrics on"):  # the port is taken now
            await serve_metrics(nursery, f"127.0.0.1:{port}", "test")
        nursery.cancel_scope.cancel()


# --- the flag ---------------------------------------------------------------------------------


NOBODY = "/ip4/127.0.0.1/udp/9/p2p/12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"


@pytest.mark.parametrize("command", [["bootstrap", "--listen", "127.0.0.1:0"], ["relay", "--listen", "127.0.0.1:0"],
                                     ["join", "--bootstrap", NOBODY], ["api", "--bootstrap", NOBODY]])
@pytest.mark.parametrize("bad", ["nonsense", "127.0.0.1:99999", ":9100"])
def test_a_bad_metrics_flag_is_one_clear_error(command, bad):
    r = meshnet_peer(*command, "--metrics", bad, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: --metrics") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_a_taken_metrics_port_is_one_clear_error():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = meshnet_peer("bootstrap", "--listen", "127.0.0.1:0", "--metrics", f"127.0.0.1:{port}", timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"error: cannot serve metrics on 127.0.0.1:{port}"), r.stderr
    assert r.stderr.count("\n") == 1


# --- end to end: real processes -------------------------------------------------------------------


METRICS = ("--metrics", "127.0.0.1:0")


def metrics_url(proc) -> str:
    return proc.wait_line("metrics on ").removeprefix("metrics on ")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A bootstrap peer, a relay, a direct peer on layers 0:15 and one behind the relay
    on 15:30 (so a route's traffic crosses the relay), every one with --metrics;
    the recipe certified."""
    tmp = tmp_path_factory.mktemp("metrics-swarm")
    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp)}
    key = str(tmp / "bootstrap.key")
    procs = []
    try:
        relay = Proc("relay", "--listen", "127.0.0.1:0", *METRICS)
        procs.append(relay)
        relay_addr = relay.address(60)
        s = Swarm(["0:15"], "--threads", "1", *METRICS, env=env, process=Proc, timeout=120, boot_identity=key,
                  boot_args=METRICS)
        procs[:0] = [*s.joins, s.boot]
        behind = Proc("join", "--layers", "15:30", "--bootstrap", s.addr, "--threads", "1", "--relay", relay_addr,
                      *METRICS, env=env)
        procs.insert(0, behind)
        behind.address(120)
        certify_swarm(s.addr, key)
        yield {"addr": s.addr, "env": env, "boot": s.boot, "head": s.joins[0], "tail": behind, "relay": relay}
    finally:
        codes = [p.stop() for p in procs]  # joins first, then the bootstrap and the relay
        assert codes == [0] * len(codes)


def test_a_generation_moves_every_peers_counters(swarm):
    urls = {name: metrics_url(swarm[name]) for name in ("boot", "head", "tail", "relay")}
    before = {name: scrape(url) for name, url in urls.items()}
    during = {}

    def on_token(_text: str) -> None:
        # the 8th token: the generation is under way (its thread waits for this scrape)
        on_token.n = getattr(on_token, "n", 0) + 1
        if on_token.n == 8:
            during.update({name: scrape(urls[name]) for name in ("head", "tail")})

    # The star (the client carries every hop) waits for this client at every token, so a scrape
    # from on_token sees the generation half done; the ring would run ahead of it.
    client = Client([swarm["addr"]], ring=False)
    try:
        result = client.generate(PROMPT, 24, stop_at_eog=False, on_token=on_token)
    finally:
        client.close()
    assert len(result.token_ids) == 24 and result.route[1]["peer_id"] == swarm["tail"].peer_id
    after = {name: scrape(url) for name, url in urls.items()}

    def moved(name: str, metric: str, **labels) -> tuple[float, float, float]:
        b, a = value(before[name], metric, **labels), value(after[name], metric, **labels)
        d = value(during[name], metric, **labels) if name in during else b
        assert b <= d <= a, (name, metric, labels, b, d, a)
        return b, d, a

    for peer in ("head", "tail"):
        b, d, a = moved(peer, "meshnet_dataplane_sessions_opened_total")
        assert d > b  # (its session opened before the first token)
        for metric, labels in [("meshnet_engine_steps_total", {}), ("meshnet_engine_tokens_processed_total", {}),
                               ("meshnet_dataplane_steps_total", {"kind": "decode"}),
                               ("meshnet_dataplane_tokens_total", {"kind": "decode"}),
                               ("meshnet_dataplane_step_seconds_count", {"phase": "compute"}),
                               ("meshnet_dataplane_step_seconds_count", {"phase": "total"}),
                               ("meshnet_dataplane_received_bytes_total", {}),
                               ("meshnet_dataplane_sent_bytes_total", {}),
                               ("meshnet_engine_batch_rows_count", {})]:
            b, d, a = moved(peer, metric, **labels)
            assert b < d < a, (peer, metric, labels, b, d, a)  # moving during the generation, and after
        b, _, a = moved(peer, "meshnet_dataplane_step_seconds_sum", phase="compute")
        assert a > b
    b, _, a = moved("tail", "meshnet_engine_tokens_sampled_total")
    assert a - b >= 24  # the tail samples every token
    # the client found its route through the bootstrap peer's DHT
    b, _, a = moved("boot", "meshnet_dht_requests_received_total", kind="find_value")
    assert a > b
    # and reached the tail through the relay, both ways
    for metric, labels in [("meshnet_relay_circuits_total", {}),
                           ("meshnet_relay_spliced_bytes_total", {"direction": "to_peer"}),
                           ("meshnet_relay_spliced_bytes_total", {"direction": "from_peer"})]:
        b, _, a = moved("relay", metric, **labels)
        assert a > b, (metric, labels)
    assert value(after["relay"], "meshnet_relay_active_reservations") == 1


def test_the_api_counts_requests_and_tokens(swarm):
    api = Proc("api", "--bootstrap", swarm["addr"], "--listen", "127.0.0.1:0", *METRICS, env=swarm["env"])
    try:
        url = metrics_url(api)
        base = api.wait_line("listening on ").removeprefix("listening on ")
        before = scrape(url)
        assert value(before, "meshnet_client_generations_total", outcome="completed") == 0
        with urllib.request.urlopen(f"{base}/v1/models", timeout=60) as r:
            model = json.load(r)["data"][0]["id"]
        request = urllib.request.Request(f"{base}/v1/completions", method="POST",
                                         headers={"content-type": "application/json"},
                                         data=json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                          "temperature": 0}).encode())
        with urllib.request.urlopen(request, timeout=120) as r:
            usage = json.load(r)["usage"]
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{base}/v1/no-such-thing/{os.urandom(4).hex()}", timeout=10)
        after = scrape(url)
    finally:
        assert api.stop() == 0
    assert value(after, "meshnet_api_requests_total", endpoint="/v1/completions", status="200") == 1
    assert value(after, "meshnet_api_requests_total", endpoint="/v1/models", status="200") == 1
    assert value(after, "meshnet_api_requests_total", endpoint="other", status="404") == 1  # not the path
    assert value(after, "meshnet_client_generations_total", outcome="completed") == 1
    assert value(after, "meshnet_client_tokens_total", kind="generated") == usage["completion_tokens"] > 0
    assert value(after, "meshnet_client_tokens_total", kind="prompt") == usage["prompt_tokens"]
    assert value(after, "meshnet_client_failovers_total") == 0
    assert value(after, "meshnet_client_first_token_seconds_count") == 1
