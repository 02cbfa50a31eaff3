"""The client is off the ring's token path (issue 27; docs/ring.md, "What it promises"):
only the client's own connections go through a 20 ms link (bench/_delay_forwarder.py,
a process), the peers reach each other directly, and the ring decodes as fast as it
does for a client with no delay. A ring step that waited on the client (a copy held
back for its window, a credit, an acknowledgement) would cost a token at least one
crossing of that link, 20 ms, on top of ~10 ms of compute: this asserts the delayed
client's best time a token is within half of that of the direct client's (issue 27
asks 0.9x the rate: on a quiet host that is the same test; under load, one generation
of a side can lose several ms a token to the other processes, so the bound is set by
what it must catch, not by the noise). Best of four interleaved generations a side."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import trio

from meshnet_p2p.client import Client
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.dataplane.transport.pool import ChannelPool
from meshnet_p2p.engine.contract import SamplingParams
from tests.swarm import start_swarm

DELAY_MS = 20
TOKENS = 24
PROMPT = "The capital of France is"
FORWARDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "_delay_forwarder.py")


class DelayedPool(ChannelPool):
    """A client's pool whose connections to each peer go through that peer's delayed port."""

    def __init__(self, ports: dict[tuple[str, int], int]) -> None:
        super().__init__()
        self.ports = ports
        self.delayed = 0  # leases that went through a link

    def lease(self, key, make):
        address = make.keywords.get("address")
        if address in self.ports:
            make = functools.partial(make.func, *make.args, **{**make.keywords, "address": ("127.0.0.1", self.ports[address])})
            key = (*key[:2], ("127.0.0.1", self.ports[address]), *key[3:])
            self.delayed += 1
        return super().lease(key, make)


@pytest.fixture
def links():
    p = subprocess.Popen([sys.executable, FORWARDER, str(DELAY_MS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)

    def ask(line: str) -> str:
        p.stdin.write(line + "\n")
        p.stdin.flush()
        return p.stdout.readline().strip()

    try:
        yield ask
    finally:
        p.stdin.close()
        p.terminate()
        p.wait(timeout=30)


def test_a_ring_decodes_as_fast_for_a_client_behind_a_slow_link(tmp_path, links, model_path):
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "10:20", "20:30"])
    clients = []
    try:
        direct = Client([addr], model_path=model_path, ring=True, verify="off")
        delayed = Client([addr], model_path=model_path, ring=True, verify="off")
        clients += [direct, delayed]
        ports = {}
        for s in trio.run(direct.spans):  # each peer's data-plane address, as its report names it
            a = Multiaddr.parse(s.record.content["addrs"][0])
            port = int(links("listen"))
            assert links(f"target {port} {a.host}:{a.port}") == "ok"
            ports[(a.host, a.port)] = port
        delayed.pool = DelayedPool(ports)
        for c in clients:
            c.auditor.submit = lambda items, peers=(): None  # no replays competing with the timed runs
        greedy = SamplingParams()
        runs = {"direct": [], "delayed": []}
        for _ in range(5):  # the first of each is a warm-up
            for name, c in (("direct", direct), ("delayed", delayed)):
                runs[name].append(c.generate(PROMPT, TOKENS, greedy, stop_at_eog=False))
        assert delayed.pool.delayed >= 3, "the delayed client did not reach its peers through the links"
    finally:
        for c in clients:
            c.close()
        for p in [*joins, boot]:
            p.stop()
    assert runs["delayed"][-1].token_ids == runs["direct"][-1].token_ids
    ms = {name: 1000 / max(r.decode_tokens_per_s for r in rs[1:]) for name, rs in runs.items()}
    assert ms["delayed"] - ms["direct"] < DELAY_MS / 2, ms  # waiting on the client costs >= DELAY_MS a token
