"""Relays found through the DHT (relays.py), reservations renewed by pings or
ended by silence (dataplane/relay.py), and a peer that moves to another relay
when its own dies or refuses (relay_keeper.py)."""

from __future__ import annotations

import functools
import random
from unittest import mock

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from meshnet_p2p.nat import relay as relay_mod
from meshnet_p2p.nat.relay import (
    KEEPALIVE_S, PONG_TIMEOUT_S, Relay, RelayError, RelayLimits, hold_reservation,
)
from meshnet_p2p.dataplane.transport.server import Server
from meshnet_p2p.dataplane.transport.tls import make_tls_credentials
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.nat.reachability import relay_dial_check
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.core.records import RecordVerifier, wall_ms
from meshnet_p2p.nat.keeper import RelayKeeper
from meshnet_p2p.swarm.relay_offers import (
    RELAYS_KEY, TYPES, RelayOffer, circuit_addr, one_per_network, rank_relays, relay_score, sign_relay_record,
    usable_host, valid_relay_content,
)

RELAY = Identity.from_seed(b"\x51" * 32)
PEER = Identity.from_seed(b"\x52" * 32)
LIMITS = {"max_reservations": 128, "max_connections_per_peer": 16, "bytes_per_second_per_peer": 64_000_000}
ADDR = Multiaddr.for_socket("10.0.0.1", "tcp", 4002, RELAY.peer_id)


def content(**kw) -> dict:
    record = RecordVerifier(TYPES).verify(sign_relay_record(RELAY, ADDR, LIMITS, {}, now_ms=wall_ms()), wall_ms())
    return {**record.content, **kw}


# --- the record ---------------------------------------------------------------------------------


def test_a_relay_record_verifies_and_names_its_relay():
    c = content()
    assert valid_relay_content(c) is None
    assert c["addr"] == str(ADDR) and c["load"]["reservations_now"] == 0 and c["limits"] == LIMITS


@pytest.mark.parametrize("field,value,reason", [
    ("key", "models", "key must be relays"),
    ("addr", str(Multiaddr.for_socket("10.0.0.1", "tcp", 4002, PEER.peer_id)), "addr names another peer"),
    ("addr", "/ip4/10.0.0.1/udp/4002/p2p/" + str(RELAY.peer_id), "addr must be a tcp address"),
    ("addr", "/ip4/10.0.0.1/tcp/0/p2p/" + str(RELAY.peer_id), "addr must be a tcp address"),
    ("addr", circuit_addr(ADDR, RELAY.peer_id), "addr must be a tcp address"),
    ("addr", 7, "addr is not a string"),
    ("limits", {**LIMITS, "max_reservations": -1}, "limits must hold exactly"),
    ("limits", {**LIMITS, "max_reservations": True}, "limits must hold exactly"),
    ("limits", {k: v for k, v in LIMITS.items() if k != "max_reservations"}, "limits must hold exactly"),
    ("load", {"reservations_now": 1}, "load must hold exactly"),
    ("version", "x" * 40, "version must be a short string"),
])
def test_each_malformed_field_has_its_reason(field, value, reason):
    why = valid_relay_content(content(**{field: value}))
    assert why is not None and why.startswith(reason), why


def _nest(inner):
    return st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4))


json_like = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
                                   st.binary(max_size=8)), _nest, max_leaves=12)


@given(st.dictionaries(st.sampled_from(["key", "peer_id", "addr", "limits", "load", "version", "x"]), json_like, max_size=7),
       st.booleans())
def test_any_content_gets_a_reason_or_none_and_never_raises(fields, from_valid):
    c = {**content(), **fields} if from_valid else fields
    why = valid_relay_content(c)
    assert why is None or isinstance(why, str)
    if why is None:  # what passes is what a peer may read without further checks
        RelayOffer.from_record(c, 1.0)
        Multiaddr.parse(c["addr"])


# --- ranking ------------------------------------------------------------------------------------


def offer(peer: str, rtt: float | None, now: int = 0, cap: int = 10) -> RelayOffer:
    return RelayOffer(peer, f"/ip4/10.0.0.1/tcp/1/p2p/{peer}", cap, now, rtt)


def test_relays_rank_by_measured_round_trip_then_claimed_load():
    ranked = rank_relays([offer("slow", 30.0), offer("fast", 2.0), offer("busy-fast", 2.0, now=9),
                          offer("unreachable", None), offer("full", 1.0, now=10), offer("me", 0.5),
                          offer("failed", 0.5)], me="me", avoid={"failed"})
    # set aside ("failed" lately) ranks after every other, not out: a peer's only relay may have blinked
    assert [o.peer_id for o in ranked] == ["fast", "busy-fast", "slow", "failed"]
    # a load claim tips close calls only: an idle relay 25 ms farther loses to a busy near one
    assert relay_score(offer("a", 2.0, now=9)) < relay_score(offer("b", 27.0, now=0))


def test_records_cannot_aim_a_peer_at_its_own_machine_or_outnumber_others_from_one_network():
    assert not usable_host("0.0.0.0") and not usable_host("::") and not usable_host("169.254.1.1")
    assert not usable_host("127.0.0.1") and usable_host("127.0.0.1", allow_loopback=True)
    assert usable_host("203.0.113.7") and usable_host("10.0.0.3") and usable_host("relay.example.org")
    sybils = [{"addr": f"/ip4/1.2.3.{i}/tcp/4002/p2p/{RELAY.peer_id}"} for i in range(1, 200)]
    honest = [{"addr": f"/ip4/9.9.9.9/tcp/4002/p2p/{PEER.peer_id}"}]
    lan = [{"addr": f"/ip4/10.0.0.{i}/tcp/4002/p2p/{PEER.peer_id}"} for i in range(2, 5)]
    picked = one_per_network(sybils + honest + lan, random.Random(1))
    assert len(picked) == 1 + 1 + 3  # one of 199 from 1.2.3.0/24, the honest one, the LAN's (exempt)
    assert honest[0] in picked


# --- reservations: pings renew, silence ends ------------------------------------------------------


def _run(main):
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def _reserve_raw(stream, reader, who: Identity = PEER) -> None:
    await stream.send_all(f"MESHNET-RESERVE {who.peer_id} {'11' * 32}\n".encode())
    challenge = (await reader.line()).decode().split()
    sig = who.sign(relay_mod.PEER_DOMAIN + bytes.fromhex(challenge[1]) + RELAY.peer_id.multihash)
    await stream.send_all(f"SIG {sig.hex()}\n".encode())
    assert await reader.line() == b"OK"


def test_a_silent_reservation_ends_and_a_pinging_one_lasts():
    async def main():
        relay = Relay(RELAY, RelayLimits(reservation_idle_timeout=30.0))
        async with trio.open_nursery() as nursery:
            silent, end = trio.testing.memory_stream_pair()
            nursery.start_soon(relay._handle, end)
            await _reserve_raw(silent, relay_mod._LineReader(silent))
            pinging, end2 = trio.testing.memory_stream_pair()
            nursery.start_soon(relay._handle, end2)
            reader = relay_mod._LineReader(pinging)
            await _reserve_raw(pinging, reader, Identity.from_seed(b"\x53" * 32))
            assert len(relay.reservations) == 2
            for n in range(1, 6):  # 5 pings 20 s apart: 100 s, past the 30 s idle bound
                await trio.sleep(20)
                await pinging.send_all(f"PING {n}\n".encode())
                assert await reader.line() == f"PONG {n}".encode()
                assert await reader.line() == b"LOAD 0 0"  # its circuits now, clients turned away: none
            assert len(relay.reservations) == 1 and relay.stats["expired"] == 1  # the silent one ended
            await trio.sleep(31)  # now silent too
            assert relay.reservations == {} and relay.stats["expired"] == 2
            nursery.cancel_scope.cancel()

    _run(main)


def test_a_peer_gives_up_a_relay_that_stops_answering_pings():
    """A frozen relay (it reserved, then went silent) costs the peer at most
    KEEPALIVE_S + PONG_TIMEOUT_S before it looks elsewhere."""

    async def main():
        ours, theirs = trio.testing.memory_stream_pair()
        answered = []

        async def frozen_relay():
            reader = relay_mod._LineReader(theirs)
            line = (await reader.line()).decode().split()
            nonce = bytes(32)
            sig = RELAY.sign(relay_mod.RELAY_DOMAIN + bytes.fromhex(line[2]) + PEER.peer_id.multihash)
            await theirs.send_all(f"CHALLENGE {nonce.hex()} {sig.hex()}\n".encode())
            await reader.line()
            await theirs.send_all(b"OK\n")
            line = await reader.line()  # the first ping: answered
            answered.append(line)
            await theirs.send_all(line.replace(b"PING", b"PONG") + b"\n")
            await trio.sleep_forever()  # then frozen

        async def connect(host, port):
            return ours

        addr = Multiaddr.for_socket("10.0.0.1", "tcp", 4002, RELAY.peer_id)
        with mock.patch.object(relay_mod.trio, "open_tcp_stream", connect):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(frozen_relay)
                t0 = trio.current_time()
                caught = []
                try:
                    async with trio.open_nursery() as inner:
                        held = await inner.start(hold_reservation, addr, PEER, ("127.0.0.1", 9))
                except* RelayError as group:
                    caught.extend(group.exceptions)
                elapsed = trio.current_time() - t0
                assert len(caught) == 1 and "did not answer a ping" in str(caught[0])
                assert answered == [b"PING 1"] and held.rtt_ms is not None
                assert elapsed == 2 * KEEPALIVE_S + PONG_TIMEOUT_S  # the virtual clock is exact
                nursery.cancel_scope.cancel()

    _run(main)


def test_a_relay_address_that_accepts_and_says_nothing_costs_a_bounded_wait():
    """A record can point anywhere for free: a host that accepts the connection
    and never answers must not hold a peer for ever (it then tries the next)."""

    async def main():
        ours, theirs = trio.testing.memory_stream_pair()

        async def connect(host, port):
            return ours

        addr = Multiaddr.for_socket("10.0.0.1", "tcp", 4002, RELAY.peer_id)
        with mock.patch.object(relay_mod.trio, "open_tcp_stream", connect):
            t0 = trio.current_time()
            with pytest.raises(RelayError, match="did not complete a reservation"):
                await relay_mod.reserve(addr, PEER)  # nobody ever answers on `theirs`
            assert trio.current_time() - t0 == relay_mod.RESERVE_TIMEOUT_S

    _run(main)


async def test_one_connection_that_breaks_the_handler_never_ends_the_relay(monkeypatch):
    relay = Relay(RELAY)

    async def broken(*args):
        raise RuntimeError("a bug, or bytes nobody foresaw")

    monkeypatch.setattr(relay, "_client", broken)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(relay.serve, "127.0.0.1", 0)
        for _ in range(3):
            s = await trio.open_tcp_stream("127.0.0.1", port)
            await s.send_all(b"CONNECT x.peer:443 HTTP/1.1\r\n\r\n")
            assert await s.receive_some(100) == b""  # that connection ends...
            await s.aclose()
        s = await trio.open_tcp_stream("127.0.0.1", port)  # ...and the relay still serves
        await s.send_all(f"MESHNET-RESERVE {PEER.peer_id} {'11' * 32}\n".encode())
        assert (await s.receive_some(1000)).startswith(b"CHALLENGE")
        await s.aclose()
        nursery.cancel_scope.cancel()


# --- the keeper: find, reserve, move on --------------------------------------------------------------


class RecordsOnly:
    """A DHT node's read side, holding the given records (the keeper only reads)."""

    def __init__(self, records) -> None:
        self._records = records

    def records(self, key):
        return self._records if key == RELAYS_KEY else []

    async def get(self, key):
        return []


@pytest.fixture
def peer_server():
    """A peer's real data-plane TLS listener (no engine: a dial only handshakes);
    its adopt() is what a relayed connection is handed to."""
    peer = Identity.generate()
    server = Server(make_tls_credentials(peer)).start()
    yield peer, server
    server.stop(0)


def _record(ident: Identity, port: int):
    addr = Multiaddr.for_socket("127.0.0.1", "tcp", port, ident.peer_id)
    return RecordVerifier(TYPES).verify(sign_relay_record(ident, addr, LIMITS, {}, now_ms=wall_ms()), wall_ms())


async def test_the_keeper_reserves_on_the_nearest_relay_and_moves_when_it_dies(peer_server):
    near_id, far_id = Identity.generate(), Identity.generate()
    peer, server = peer_server
    changes: list = []
    changed = trio.Event()
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as near_nursery:
            near = Relay(near_id)
            near_port = await near_nursery.start(near.serve, "127.0.0.1", 0)
            far = Relay(far_id)
            far_port = await outer.start(far.serve, "127.0.0.1", 0)
            records = [_record(near_id, near_port), _record(far_id, far_port)]
            rtts = {str(near_id.peer_id): 1.0, str(far_id.peer_id): 9.0}

            async def measure(addr):
                return rtts[str(addr.peer_id)]

            def on_change(held):
                nonlocal changed
                changes.append(None if held is None else str(held.relay.peer_id))
                changed.set()
                changed = trio.Event()

            keeper = RelayKeeper(RecordsOnly(records), peer, server.adopt, on_change=on_change,
                                 print_line=lambda line: None, measure=measure, allow_loopback=True)
            held = await outer.start(keeper.run)
            assert str(held.relay.peer_id) == str(near_id.peer_id)
            assert list(near.reservations) == [str(peer.peer_id).lower()]
            assert near.stats["spliced"] == 1  # it dialled itself through the relay before saying so
            waiting = changed
            near_nursery.cancel_scope.cancel()  # the near relay dies
        with trio.fail_after(30):
            while len(changes) < 3:
                await waiting.wait()
                waiting = changed
        assert changes == [str(near_id.peer_id), None, str(far_id.peer_id)]
        assert list(far.reservations) == [str(peer.peer_id).lower()]
        assert str(near_id.peer_id) in keeper.set_aside  # not tried again soon
        outer.cancel_scope.cancel()


class BlackHole(Relay):
    """Takes reservations, then carries nothing: a client's CONNECT is held, never spliced."""

    async def _client(self, stream, reader, first) -> None:
        await trio.sleep_forever()


async def test_the_keeper_passes_over_a_relay_that_refuses_or_carries_nothing(peer_server):
    full_id, hole_id, open_id = Identity.generate(), Identity.generate(), Identity.generate()
    peer, server = peer_server
    async with trio.open_nursery() as nursery:
        full = Relay(full_id, RelayLimits(max_reservations=1))
        full.reservations["someone"] = object()  # full already
        hole = BlackHole(hole_id)
        other = Relay(open_id)
        ports = [await nursery.start(r.serve, "127.0.0.1", 0) for r in (full, hole, other)]
        records = [_record(i, p) for i, p in zip((full_id, hole_id, open_id), ports)]
        lines: list[str] = []
        order = {full_id.peer_id: 1.0, hole_id.peer_id: 2.0, open_id.peer_id: 5.0}

        async def measure(addr):  # the full one looks nearest, then the black hole: both are tried first
            return order[addr.peer_id]

        keeper = RelayKeeper(RecordsOnly(records), peer, server.adopt, on_change=lambda held: None,
                             print_line=lines.append, measure=measure, allow_loopback=True,
                             verify=functools.partial(relay_dial_check, timeout=1.0))
        with trio.fail_after(30):
            held = await nursery.start(keeper.run)
        assert held.relay.peer_id == open_id.peer_id
        assert any(line.startswith(f"relay {full_id.peer_id} refused") and "relay full" in line for line in lines)
        assert any(line.startswith(f"relay {hole_id.peer_id} refused") and "did not reach this peer" in line
                   for line in lines), lines
        assert not hole.reservations  # it let go of the black hole
        nursery.cancel_scope.cancel()
