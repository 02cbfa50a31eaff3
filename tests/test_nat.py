"""Scenarios on simulated hosts (tests/hosts.py: network namespaces, one address
each, home NATs that masquerade): real `meshnet-peer` processes, a client in
its own host, the whole model's tokens as the reference.

- a volunteer behind NAT joins with no relay flag, finds a relay in the DHT,
  and a generation through it gives the whole model's tokens;
- its relay is killed mid-generation: the client fails over with identical
  output, and the volunteer re-reserves elsewhere with no operator action;
- a partition between two groups of hosts heals and the DHT converges again;
- churn: peers join and leave every few seconds while clients generate.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading

import pytest

from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.roles.peer_process import OutputLines

from tests.hosts import IP, Host, Net, require_hosts
from tests.reference import reference_generate
from tests.swarm import Proc

PROMPT = "The capital of France is"
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def reference(model_path):
    ids = Tokenizer(model_path).encode(PROMPT)
    return reference_generate(model_path, ids, 40, n_ubatch=64)[0]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nat-shards"))  # shards cut once for every scenario here


class World:
    """A Net with a bootstrap peer, and helpers to start roles on its hosts."""

    def __init__(self, net: Net, cache_dir: str, tmp_path) -> None:
        self.net = net
        self.env = {**os.environ, "MESHNET_CACHE_DIR": cache_dir}
        self.key = str(tmp_path / "bootstrap.key")
        self.boot_host = net.public_host("boot")
        self.boot = self.start(self.boot_host, "bootstrap", "--listen", f"{self.boot_host.ip}:4001", "--identity", self.key)
        self.addr = self.boot.address(60)
        self.client_host = net.public_host("client")

    def start(self, host: Host, *args: str) -> Proc:
        p = Proc(*args, env=self.env, prefix=(IP, "netns", "exec", host.ns))
        self.net.procs.append(p.p)  # SIGTERM, then SIGKILL, and reaped when the Net closes
        return p

    def relay(self, name: str) -> Proc:
        host = self.net.public_host(name)
        p = self.start(host, "relay", "--listen", f"{host.ip}:4002", "--bootstrap", self.addr)
        p.address(60)
        return p

    def join(self, host: Host, layers: str, *extra: str, listen: bool = True) -> Proc:
        where = ("--listen", f"{host.ip}:0") if listen else ()  # without: every address, the default
        return self.start(host, "join", "--layers", layers, *where, "--bootstrap", self.addr, "--threads", "1", *extra)

    def ends(self) -> tuple[Proc, Proc]:
        """The head (0:10) and the tail (20:30), each on a public host of its own, starting."""
        return self.join(self.net.public_host("a"), "0:10"), self.join(self.net.public_host("c"), "20:30")

    def command(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """A `meshnet-peer` command run to completion on the client's host."""
        return self.client_host.run([sys.executable, "-m", "meshnet_p2p", *args], capture_output=True, text=True,
                                    env=self.env, timeout=timeout)

    def certify(self) -> None:
        r = self.command("certify", "--bootstrap", self.addr, "--identity", self.key, "--json")
        assert r.returncode == 0, r.stderr

    def generate(self, tokens: int = 40) -> dict:
        r = self.command("generate", "--bootstrap", self.addr, "--prompt", PROMPT, "--max-tokens", str(tokens), "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def client(self, tokens: int, pause_at: int | None = None, *, star: bool = False) -> "Lines":
        argv = [sys.executable, os.path.join(HERE, "host_client.py"), self.addr, PROMPT, str(tokens)]
        argv += [str(pause_at or 0)] + (["star"] if star else [])
        p = self.client_host.popen(argv, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)
        return Lines(p)


class Lines(OutputLines):
    """The host client's output (tests/host_client.py): its ``result`` line, parsed."""

    def result(self, timeout: float = 300) -> dict:
        return json.loads(self.wait_line("result ", timeout).removeprefix("result "))

    def missing(self, prefix: str) -> str:
        return f"{super().missing(prefix)}; stderr: {self.p.stderr.read()[-2000:] if self.ended else ''}"


def test_a_volunteer_behind_nat_joins_with_no_flags_and_serves_through_a_relay_it_found(tmp_path, cache_dir, reference):
    require_hosts()
    with Net() as net:
        w = World(net, cache_dir, tmp_path)
        relay = w.relay("relay")
        head, tail = w.ends()
        home = net.nat_host("home")
        vol = w.join(home, "10:20", listen=False)  # nothing but where the swarm is: no --listen, --relay, --announce
        head.address(), tail.address()
        # several peers dialled its address back: it came from another (its router's) address
        assert vol.wait_line("reachability: ").startswith("reachability: unreachable")
        via = vol.wait_line("reachable via ").removeprefix("reachable via ")
        vol_id = vol.peer_id
        assert via == f"{relay.address()}/p2p-circuit/p2p/{vol_id}"  # libp2p's circuit address, through the relay it found
        # the public peers were found reachable and announce their own addresses
        assert head.wait_line("reachability: ").startswith("reachability: reachable")
        w.certify()
        doc = w.generate()
        assert doc["token_ids"] == reference
        assert doc["route"][1]["peer_id"] == vol_id
        assert relay.wait_line("splice to ").startswith(f"splice to {vol_id} closed: ")  # it went through the relay
        # `status` shows the relay and its load, and the volunteer as relayed
        r = w.command("status", "--bootstrap", w.addr, "--json", "--no-probe")
        assert r.returncode == 0, r.stderr
        status = json.loads(r.stdout)
        assert [x["peer_id"] for x in status["relays"]] == [relay.peer_id]
        assert status["relays"][0]["limits"]["max_reservations"] == 128
        peers = {p["peer_id"]: p for m in status["models"] for rec in m["recipes"] for p in rec["peers"]}
        assert peers[vol_id]["reachability"] == f"relay {relay.address()}"


def test_dialers_really_dial_a_volunteer_behind_nat_port_forwarded_or_not(tmp_path, cache_dir, reference):
    """Two volunteers behind NAT both announce their router's public address
    (--announce), which is where their packets come from, so the dialers do
    dial: through the one router that forwards the port they reach the peer
    (reachable: it is announced directly and serves so); the other router
    drops them (unreachable: that one goes relayed)."""
    require_hosts()
    with Net() as net:
        w = World(net, cache_dir, tmp_path)
        relay = w.relay("relay")
        head, tail = w.ends()
        head.address(), tail.address()
        forwarded, closed = net.nat_host("fwd"), net.nat_host("closed")
        net.forward_port(forwarded, 5000)
        good, bad = (w.join(h, "10:20", "--listen", "0.0.0.0:5000", "--announce", f"/ip4/{h.public_ip}/tcp/5000",
                            listen=False) for h in (forwarded, closed))
        assert good.wait_line("reachability: ").startswith("reachability: reachable")
        assert good.wait_line("announcing ") == f"announcing /ip4/{forwarded.public_ip}/tcp/5000/p2p/{good.peer_id}"
        assert bad.wait_line("reachability: ").startswith("reachability: unreachable")
        assert bad.wait_line("reachable via ").startswith(f"reachable via {relay.address()}/p2p-circuit")
        assert bad.wait_line("listening on ")
        w.certify()
        bad.stop()  # the forwarded one must carry the route
        doc = w.generate()
        assert doc["token_ids"] == reference and doc["route"][1]["peer_id"] == good.peer_id


def test_a_volunteers_relay_dies_mid_generation_and_everyone_carries_on(tmp_path, cache_dir, reference):
    """The client fails over with the same tokens; the volunteer reserves on the
    other relay by itself, and the next generation goes through it there. (The
    client drives a star here: a ring's peers compute ahead of a client that
    stops reading, so only a star is mid-generation for sure when the relay dies.)"""
    require_hosts()
    with Net() as net:
        w = World(net, cache_dir, tmp_path)
        relays = {p.peer_id: p for p in (w.relay("relay1"), w.relay("relay2"))}
        head, tail = w.ends()
        vol = w.join(net.nat_host("home"), "10:20")
        head.address(), tail.address()
        vol_id = vol.peer_id
        first = vol.wait_line("reachable via ").removeprefix("reachable via ").split("/p2p-circuit")[0]
        used = relays[first.rsplit("/", 1)[1]]
        other = next(p for p in relays.values() if p is not used)
        w.certify()
        client = w.client(40, pause_at=4, star=True)
        client.wait_line("paused", 300)
        # a second peer for the volunteer's layers, reachable directly, joins while the client waits
        backup = w.join(net.public_host("b"), "10:20")
        backup.address()
        seen = len(vol.lines)
        used.p.send_signal(signal.SIGKILL)  # the volunteer's relay dies
        assert vol.wait_line("lost relay ", after=seen).startswith(f"lost relay {used.peer_id}")
        assert vol.wait_line("reachable via ", after=seen) == f"reachable via {other.address()}/p2p-circuit/p2p/{vol_id}"
        client.p.stdin.write("go\n")
        client.p.stdin.flush()
        result = client.result()
        assert result["token_ids"] == reference  # identical output, failover and all
        assert result["failovers"] >= 1
        assert result["route"][1]["peer_id"] in (vol_id, backup.peer_id)
        # the backup leaves: the volunteer, through its new relay, serves the next generation
        assert backup.stop() == 0
        doc = w.generate()
        assert doc["token_ids"] == reference and doc["route"][1]["peer_id"] == vol_id
        assert other.wait_line("splice to ").startswith(f"splice to {vol_id} closed: ")


def test_a_partition_heals_and_the_dht_converges_again(tmp_path, cache_dir, reference):
    """One peer is cut off from every other host: its announces reach nobody and
    no route can use it; once the partition heals it finds the swarm again (its
    DHT node rejoins through the bootstrap peer), its announces are stored again,
    and generations use it."""
    require_hosts()
    with Net() as net:
        w = World(net, cache_dir, tmp_path)
        a_host, b_host = net.public_host("a"), net.public_host("b")
        a, b = w.join(a_host, "0:15"), w.join(b_host, "15:30")
        a.address(), b.address()
        w.certify()
        assert w.generate()["token_ids"] == reference
        seen = len(b.lines)
        net.partition([b_host], [w.boot_host, a_host, w.client_host])
        b.wait_line("announce reached no peer", after=seen)  # its next announce (within 30 s) reaches nobody
        r = w.command("generate", "--bootstrap", w.addr, "--prompt", PROMPT, "--max-tokens", "8", "--json")
        assert r.returncode != 0 and "layers 15-29" in r.stderr, r.stderr  # no route: they are out of reach
        seen = len(b.lines)
        net.heal()
        b.wait_line("announce reaching peers again", after=seen)
        assert w.generate()["token_ids"] == reference


def test_peers_join_and_leave_every_few_seconds_while_clients_generate(tmp_path, cache_dir, reference):
    """Churn: the head and tail peers stay; layers 10-19 are served only by peers
    that come and go: every few seconds one joins and then the oldest leaves,
    by SIGTERM (it says goodbye and drains) or SIGKILL (no goodbye, mid-step
    maybe). Two clients generate all the while; every generation gives the
    whole model's tokens, and their routes follow the churn."""
    require_hosts()
    rng = random.Random(7)
    with Net() as net:
        w = World(net, cache_dir, tmp_path)
        steady = [w.join(net.public_host("s0"), "0:10"), w.join(net.public_host("s2"), "20:30")]
        hosts = [net.public_host(f"x{i}") for i in range(3)]
        up = [w.join(hosts[0], "10:20")]
        for p in steady + up:
            p.address()
        w.certify()
        done = threading.Event()
        log: list[str] = []

        def churn() -> None:
            try:
                for turn in range(1, 7):
                    fresh = w.join(hosts[turn % len(hosts)], "10:20")
                    fresh.address(120)
                    up.append(fresh)
                    log.append("joined")
                    old = up.pop(0)
                    if turn % 2:
                        old.p.send_signal(signal.SIGKILL)
                        old.p.wait(timeout=30)
                        log.append("killed")
                    else:
                        assert old.stop() == 0
                        log.append("left")
                    done.wait(rng.uniform(1.0, 3.0))  # the pace of churn, not a wait for an event
            finally:
                done.set()

        churner = threading.Thread(target=churn, daemon=True)
        churner.start()
        results = []
        try:
            for _ in range(30):  # bounded; normally it ends with the churn
                clients = [w.client(40) for _ in range(2)]
                results += [c.result(300) for c in clients]
                if done.is_set():
                    break
        finally:
            churner.join(timeout=600)
        assert done.is_set() and log.count("joined") == 6 and log.count("killed") == 3, log
        assert [r["token_ids"] == reference for r in results] == [True] * len(results)
        middles = {r["route"][1]["peer_id"] for r in results}
        assert len(middles) >= 2, middles  # the routes moved with the churn
