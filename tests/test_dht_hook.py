"""The DHT's request hook (DHTNode.serve_requests): a role's request kind, on
in-memory nodes. The node does the envelope (signature, replay, size, the
amplification bound, counted drops); the handler answers now or from a task."""

from __future__ import annotations

import pytest
import trio

from meshnet_p2p.dht import wire
from meshnet_p2p.dht.node import Request
from meshnet_p2p.swarm.node import TYPES
from meshnet_p2p.testing import start_swarm


async def test_a_served_kind_is_answered_now_or_later_and_an_unserved_one_is_dropped(autojump_clock):
    seen: list[Request] = []

    def echo(request: Request):
        seen.append(request)
        return "echoed", {"said": wire.field(request.msg.body, "say", str, max_len=16)}

    async with trio.open_nursery() as nursery:
        _, (a, b) = await start_swarm(nursery, 2, TYPES)

        def later(request: Request):  # answered by a task in the node's nursery, after a while
            async def job() -> None:
                await trio.sleep(1)
                await b.answer(request, "done", {"n": request.msg.body.get("n")})

            b.start_soon(job)
            return None

        b.serve_requests("echo", echo)
        b.serve_requests("slow", later)
        reply = await a.request(b.contact(), "echo", {"say": "hi"})
        assert (reply.kind, reply.body) == ("echoed", {"said": "hi"})
        assert seen[0].msg.sender == a.peer_id and seen[0].addr == a.addr and seen[0].proven
        assert b.stats["received_echo"] == 1
        reply = await a.request(b.contact(), "slow", {"n": 7}, timeout=5)
        assert (reply.kind, reply.body) == ("done", {"n": 7})
        # a malformed request: the handler's BadDatagram, counted, no answer
        before = b.stats["bad_requests"]
        assert await a.request(b.contact(), "echo", {"say": 7}) is None
        assert b.stats["bad_requests"] == before + 1
        # a kind nobody serves (here, a), as any unknown kind: dropped, counted, unanswered
        before = a.stats["bad_datagrams"]
        assert await b.request(a.contact(), "echo", {"say": "hi"}) is None
        assert a.stats["bad_datagrams"] == before + 1 and a.stats["received_echo"] == 0
        nursery.cancel_scope.cancel()


async def test_a_handler_that_raises_costs_its_request_never_the_node(autojump_clock):
    def broken(request: Request):
        raise RuntimeError("a bug in a role's handler")

    async with trio.open_nursery() as nursery:
        _, (a, b) = await start_swarm(nursery, 2, TYPES)
        b.serve_requests("broken", broken)
        for _ in range(3):
            assert await a.request(b.contact(), "broken", {}) is None
        assert b.stats["loop_errors_receive"] == 3
        assert (await a.ping(b.contact())).kind == "pong"  # and it goes on serving
        nursery.cancel_scope.cancel()


async def test_an_answer_to_an_unproven_source_stays_within_the_amplification_bound(autojump_clock):
    async with trio.open_nursery() as nursery:
        network, (a, b) = await start_swarm(nursery, 2, TYPES)
        b.serve_requests("big", lambda request: ("blob", {"blob": bytes(4000)}))
        spoofer = network.endpoint()  # a's signed request, sent from an address that never answered b
        request = wire.encode(a.identity, "big", wire.new_rpc_id(), {}, wall := a.now_ms(), to=b.peer_id)
        await spoofer.send(request, b.addr)
        with trio.fail_after(5):
            data, _ = await spoofer.receive()
        assert wire.decode(data, wall).kind == "cookie" and len(data) <= 3 * len(request)
        # a itself (a round trip proven) gets the answer, a cookie round trip included if need be
        assert (await a.request(b.contact(), "big", {})).body == {"blob": bytes(4000)}
        nursery.cancel_scope.cancel()


def test_the_dht_s_own_kinds_and_bad_names_cannot_be_served():
    from meshnet_p2p.dht.node import DHTNode
    from meshnet_p2p.testing import FakeNetwork, swarm_identity

    node = DHTNode(swarm_identity(1), FakeNetwork().endpoint(), TYPES)
    for kind in ("ping", "store", "cookie", "pong", "", "x" * (wire.MAX_KIND_CHARS + 1)):
        with pytest.raises(ValueError):
            node.serve_requests(kind, lambda request: None)
