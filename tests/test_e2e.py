"""The product end to end: a bootstrap peer and `meshnet-peer join` processes on
loopback, a client generating through them, and failover when a peer dies or
freezes mid-generation."""

import json
import os
import signal
import subprocess
import sys

import pytest

from meshnet_p2p import Client
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.core.multiaddr import Multiaddr

from tests.reference import reference_generate
from tests.swarm import Proc, certify_swarm, meshnet_peer, start_swarm

PROMPT = "The capital of France is"
N_UBATCH = 64  # join's default


@pytest.fixture(scope="module")
def reference(model_path):
    ids = Tokenizer(model_path).encode(PROMPT)
    return reference_generate(model_path, ids, 32, n_ubatch=N_UBATCH)[0]


def test_three_joined_peers_generate_exactly_the_whole_model(tmp_path, reference):
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "10:20", "20:30"])
    try:
        r = meshnet_peer("generate", "--bootstrap", addr, "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "32", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["token_ids"] == reference
        assert [h["layers"] for h in doc["route"]] == [[0, 10], [10, 20], [20, 30]]
        assert [h["peer_id"] for h in doc["route"]] == [j.peer_id for j in joins]
        assert doc["timing"]["ttft_ms"] > 0
        assert all(any(l.startswith("session ") for l in j.lines) for j in joins)  # a line per served session
        # the star (the client carries every hop) gives the same tokens as the ring, the default
        r = meshnet_peer("generate", "--bootstrap", addr, "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "32",
                         "--json", "--star")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["token_ids"] == reference
    finally:
        codes = [j.stop() for j in joins] + [boot.stop()]
    assert codes == [0, 0, 0, 0]  # SIGTERM: depart, drain, exit 0


CLIENT_ONLY = """
import json, sys
from meshnet_p2p.client import Client
r = Client([sys.argv[1]]).generate(sys.argv[2], 24, stop_at_eog=False)
print(json.dumps({"steps": r.steps, "engines": sorted(m for m in sys.modules if m.startswith("meshnet_p2p.engine."))}))
"""


def test_the_network_route_and_the_local_chain_run_one_loop(tmp_path, model_path, model_digest):
    """The same steps in the same order (positions, rows, tokens) through the
    swarm and through the whole model here; and a client process loads no
    llama.cpp engine: it only tokenizes."""
    from meshnet_p2p.route.local import LocalRoute

    boot, addr, joins = start_swarm(tmp_path, ["0:15", "15:30"])
    try:
        r = subprocess.run([sys.executable, "-c", CLIENT_ONLY, addr, PROMPT], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
    finally:
        for p in joins + [boot]:
            p.stop()
    assert "meshnet_p2p.engine.llama_engine" not in doc["engines"], doc["engines"]
    local = LocalRoute.from_model(model_path, [(0, 15), (15, 30)], source_sha256=model_digest, n_threads=1)
    try:
        ids = Tokenizer(model_path).encode(PROMPT)
        mine = local.generate(ids, 24, stop_at_eog=False)
    finally:
        local.close()
    assert [list(s) for s in mine.steps] == doc["steps"]
    assert len(mine.steps) == 1 + 23  # one prefill step (the prompt fits four micro-batches), then a token each


def fail_the_serving_one(twins, at: int, fault: str):
    """An on_token callback that, at token ``at``, kills or freezes whichever of
    ``twins`` serves this generation (the one with a session opened since this
    call: certifying the swarm opened sessions too); and a dict that names it then."""
    def sessions(m) -> int:
        return sum(line.startswith("session ") for line in m.lines)

    before = [sessions(m) for m in twins]
    state = {"n": 0, "victim": None}

    def on_token(_text):
        state["n"] += 1
        if state["n"] == at:
            serving = [m for m, n in zip(twins, before) if sessions(m) > n]
            assert len(serving) == 1
            state["victim"] = serving[0]
            serving[0].p.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

    return on_token, state


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_generation_survives_a_middle_peer_failing(tmp_path, reference, model_path, fault):
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "10:20", "10:20", "20:30"])
    middles = joins[1:3]
    try:
        events = []
        # the star (the ring's failover is test_the_ring_survives_any_hop_failing)
        client = Client([addr], model_path=model_path, step_timeout=3.0, on_event=events.append, ring=False)
        on_token, count = fail_the_serving_one(middles, 5, fault)
        result = client.generate(PROMPT, 32, on_token=on_token, stop_at_eog=False)
        assert result.token_ids == reference
        assert result.failovers == 1 and events
        survivor = next(m for m in middles if m is not count["victim"])
        assert result.route[1]["peer_id"] == survivor.peer_id
    finally:
        for p in joins + [boot]:
            p.stop()


def test_no_route_names_the_missing_layers(tmp_path, model_path):
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "20:30"], certify=False)
    try:
        r = meshnet_peer("generate", "--bootstrap", addr, "--prompt", "hi", "--json")
        assert r.returncode == 2
        assert "layers 10-19" in r.stderr and "Traceback" not in r.stderr
    finally:
        for p in joins + [boot]:
            p.stop()


def test_the_demo_splits_any_model_in_thirds():
    from meshnet_p2p.roles.demo import thirds

    assert thirds(30) == ("0:10", "10:20", "20:30")
    assert thirds(32) == ("0:11", "11:21", "21:32") and thirds(3) == ("0:1", "1:2", "2:3")
    with pytest.raises(ValueError, match="2 layers"):
        thirds(2)


def test_demo_runs_a_swarm_and_cleans_up(tmp_path):
    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)}
    r = meshnet_peer("demo", "--prompt", "Say hi.", "--max-tokens", "8", "--json", timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["token_ids"]) >= 1 and doc["text"]
    assert [h["layers"] for h in doc["route"]] == [[0, 10], [10, 20], [20, 30]]
    assert "shutting the swarm down" in r.stderr
    # every process the demo started is gone: its own are those with this test's cache dir in their
    # environment (other swarms may run on this machine meanwhile)
    pids = subprocess.run(["pgrep", "-f", "meshnet_p2p (join|bootstrap)"], capture_output=True, text=True).stdout.split()
    mark = f"MESHNET_CACHE_DIR={tmp_path}".encode()

    def ours(pid: str) -> bool:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return mark in f.read().split(b"\0")
        except OSError:  # gone meanwhile
            return False

    assert [p for p in pids if ours(p)] == []


def test_auto_layers_cover_what_is_missing(tmp_path, reference):
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "20:30"], certify=False)
    auto = Proc("join", "--layers", "auto", "--num-layers", "10", "--bootstrap", addr, "--threads", "1")
    try:
        auto.wait_line("listening on ")
        certify_swarm(addr, boot.identity_path)
        r = meshnet_peer("generate", "--bootstrap", addr, "--prompt", PROMPT, "--max-tokens", "32", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["route"][1] == {"peer_id": auto.peer_id, "layers": [10, 20]}
        assert doc["token_ids"] == reference
    finally:
        for p in [auto] + joins + [boot]:
            p.stop()


async def test_the_client_works_from_trio(tmp_path, reference, model_path):
    import trio

    boot, addr, joins = await trio.to_thread.run_sync(start_swarm, tmp_path, ["0:15", "15:30"])
    try:
        client = Client([addr], model_path=model_path)
        tokens = []
        result = await client.agenerate(PROMPT, 32, stop_at_eog=False, on_token=tokens.append)
        assert result.token_ids == reference
        assert "".join(tokens) == result.text
        assert [h["layers"] for h in result.route] == [[0, 15], [15, 30]]
    finally:
        for p in joins + [boot]:
            await trio.to_thread.run_sync(p.stop)


def test_a_peer_behind_a_relay_serves_through_it(tmp_path, reference):
    relay = Proc("relay", "--listen", "127.0.0.1:0")
    relay_addr = relay.wait_line("listening on ").removeprefix("listening on ")
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "20:30"], certify=False)
    nat = Proc("join", "--layers", "10:20", "--bootstrap", addr, "--threads", "1", "--relay", relay_addr)
    try:
        nat.wait_line("listening on ")
        certify_swarm(addr, boot.identity_path)
        r = meshnet_peer("generate", "--bootstrap", addr, "--prompt", PROMPT, "--max-tokens", "32", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["token_ids"] == reference
        assert doc["route"][1]["peer_id"] == nat.peer_id
        # it really went through the relay, which says so in one line per splice
        assert relay.wait_line("splice to ").startswith(f"splice to {nat.peer_id} closed: ")
    finally:
        codes = [p.stop() for p in [nat] + joins + [boot, relay]]
    assert codes == [0] * len(codes)


def test_a_peer_is_reached_at_the_address_it_announces(tmp_path, reference):
    """Behind port forwarding (here a forwarder on another port), a peer's report
    carries its --announce address, and routes reach it there."""
    from tests.forwarder import Forwarder

    forwarder = Forwarder()
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "20:30"], certify=False)
    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)}
    behind = Proc("join", "--layers", "10:20", "--bootstrap", addr, "--threads", "1",
                  "--announce", f"/ip4/127.0.0.1/tcp/{forwarder.port}", env=env)
    try:
        # like port forwarding set up for its port: the peer checks it is reachable there before announcing
        listening = Multiaddr.parse(behind.wait_line("serving on ").removeprefix("serving on "))
        forwarder.target = (listening.host, listening.port)
        assert behind.wait_line("reachability: ").startswith("reachability: reachable")
        announced = behind.wait_line("announcing ").removeprefix("announcing ")
        assert announced == f"/ip4/127.0.0.1/tcp/{forwarder.port}/p2p/{listening.peer_id}"
        certify_swarm(addr, boot.identity_path)
        r = meshnet_peer("generate", "--bootstrap", addr, "--prompt", PROMPT, "--max-tokens", "32", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["token_ids"] == reference and doc["route"][1]["peer_id"] == str(listening.peer_id)
        assert forwarder.carried >= 1  # the route went through the announced address
    finally:
        codes = [p.stop() for p in [behind] + joins + [boot]]
        forwarder.close()
    assert codes == [0] * len(codes)


@pytest.mark.parametrize("announce", ["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/udp/4000", "/tcp/4000",
                                      "/ip4/127.0.0.1/tcp/4000/p2p/12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"])
def test_a_bad_announce_address_is_one_clear_error(announce):
    for command in (["join", "--layers", "0:10", "--bootstrap", "/ip4/127.0.0.1/udp/9/p2p/"
                     "12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"], ["relay", "--listen", "127.0.0.1:0"]):
        r = meshnet_peer(*command, "--announce", announce, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr
        assert "announce" in r.stderr or "another peer" in r.stderr, r.stderr


@pytest.mark.parametrize("command", [["join", "--layers", "0:10"], ["generate", "--prompt", "hi"]])
def test_unreachable_bootstrap_is_one_clear_error(command):
    from meshnet_p2p.core.identity import Identity

    nobody = f"/ip4/127.0.0.1/udp/9/p2p/{Identity.generate().peer_id}"
    r = meshnet_peer(*command, "--bootstrap", nobody, timeout=120)
    assert r.returncode == 2
    assert "bootstrap peers answered" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", [["bootstrap", "--listen", "10.255.255.1:0"],
                                     ["serve", "--layers", "0:10", "--relay", "/ip4/127.0.0.1/tcp/9/p2p/"
                                      "12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"]])
def test_socket_errors_are_one_clear_line(command):
    # binding an address that is not this machine's, and a relay that refuses: no traceback
    r = meshnet_peer(*command, timeout=120)
    lines = r.stderr.splitlines()  # (progress lines of what it did before may come first)
    assert r.returncode == 2 and lines[-1].startswith("error:") and "Traceback" not in r.stderr
    assert [line for line in lines if line.startswith("error:")] == lines[-1:]


RING_FAULTS = {  # spans of the swarm, and which span's serving peer fails (two peers serve it)
    "head": (["0:10", "0:10", "10:20", "20:30"], "0:10"),
    "middle": (["0:10", "10:20", "10:20", "20:30"], "10:20"),
    "tail": (["0:10", "10:20", "20:30", "20:30"], "20:30"),
}


@pytest.mark.parametrize("fault", ["kill", "freeze"])
@pytest.mark.parametrize("where", sorted(RING_FAULTS))
def test_the_ring_survives_any_hop_failing(tmp_path, reference, model_path, where, fault):
    """Peers forward to each other; one of the route's hops is killed or frozen
    mid-generation: the client replaces it, rolls the others back, links the
    ring again, and the tokens are the whole model's."""
    spans, victim_span = RING_FAULTS[where]
    boot, addr, joins = start_swarm(tmp_path, spans)
    twins = [j for j, s in zip(joins, spans) if s == victim_span]
    try:
        events = []
        client = Client([addr], model_path=model_path, step_timeout=3.0, on_event=events.append, ring=True)
        on_token, count = fail_the_serving_one(twins, 3, fault)
        try:
            result = client.generate(PROMPT, 32, on_token=on_token, stop_at_eog=False)
        except Exception as e:  # what the client saw on the way: who it blamed, and why
            raise AssertionError(f"{e}\nevents: {events}") from e
        assert result.token_ids == reference
        assert result.failovers == 1, events
        survivor = next(m for m in twins if m is not count["victim"])
        assert survivor.peer_id in [h["peer_id"] for h in result.route]
        assert any("rerouting the ring" in e for e in events)
    finally:
        for p in joins + [boot]:
            p.stop()


def test_a_ring_of_one_peer_feeds_itself(tmp_path, reference, model_path):
    """One peer serving every layer: the tail is the head, so it links to its own
    session (through its own address) and generates the whole model's tokens."""
    boot, addr, joins = start_swarm(tmp_path, ["0:15", "15:30", "0:30"])  # certification needs two peers...
    try:
        for j in joins[:2]:  # ...then only the whole-model peer is left
            assert j.stop() == 0
        events = []
        result = Client([addr], model_path=model_path, on_event=events.append).generate(PROMPT, 32, stop_at_eog=False)
        assert result.token_ids == reference
        assert len(result.route) == 1 and result.failovers == 0, events
    finally:
        for p in joins + [boot]:
            p.stop()
