"""Relays found through the DHT (relays.py), reservations renewed by pings or
ended by silence (dataplane/relay.py), and a peer that moves to another relay
when its own dies or refuses (relay_keeper.py)."""

from __future__ import annotations

from unittest import mock

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from meshnet_p2p.dataplane import relay as relay_mod
from meshnet_p2p.dataplane.relay import (
    KEEPALIVE_S, PONG_TIMEOUT_S, Relay, RelayError, RelayLimits, hold_reservation,
)
from meshnet_p2p.identity import Identity
from meshnet_p2p.multiaddr import Multiaddr
from meshnet_p2p.records import RecordVerifier, wall_ms
from meshnet_p2p.relay_keeper import RelayKeeper
from meshnet_p2p.relays import (
    RELAYS_KEY, TYPES, RelayOffer, circuit_addr, rank_relays, relay_score, sign_relay_record, valid_relay_content,
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


json_like = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | st.binary(max_size=8),
                         lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                         max_leaves=12)


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
    assert [o.peer_id for o in ranked] == ["fast", "busy-fast", "slow"]
    # a load claim tips close calls only: an idle relay 25 ms farther loses to a busy near one
    assert relay_score(offer("a", 2.0, now=9)) < relay_score(offer("b", 27.0, now=0))


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
                assert 2 * KEEPALIVE_S <= elapsed <= 2 * KEEPALIVE_S + PONG_TIMEOUT_S + 1
                nursery.cancel_scope.cancel()

    _run(main)


# --- the keeper: find, reserve, move on --------------------------------------------------------------


class RecordsOnly:
    """A DHT node's read side, holding the given records (the keeper only reads)."""

    def __init__(self, records) -> None:
        self._records = records

    def records(self, key):
        return self._records if key == RELAYS_KEY else []

    async def get(self, key):
        return []


async def test_the_keeper_reserves_on_the_nearest_relay_and_moves_when_it_dies():
    near_id, far_id = Identity.generate(), Identity.generate()
    peer = Identity.generate()
    changes: list = []
    changed = trio.Event()
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as near_nursery:
            near = Relay(near_id)
            near_port = await near_nursery.start(near.serve, "127.0.0.1", 0)
            far = Relay(far_id)
            far_port = await outer.start(far.serve, "127.0.0.1", 0)
            records = []
            for ident, port in ((near_id, near_port), (far_id, far_port)):
                addr = Multiaddr.for_socket("127.0.0.1", "tcp", port, ident.peer_id)
                records.append(RecordVerifier(TYPES).verify(
                    sign_relay_record(ident, addr, LIMITS, {}, now_ms=wall_ms()), wall_ms()))
            rtts = {str(near_id.peer_id): 1.0, str(far_id.peer_id): 9.0}

            async def measure(addr):
                return rtts[str(addr.peer_id)]

            def on_change(held):
                nonlocal changed
                changes.append(None if held is None else str(held.relay.peer_id))
                changed.set()
                changed = trio.Event()

            keeper = RelayKeeper(RecordsOnly(records), peer, ("127.0.0.1", 9), on_change=on_change,
                                 print_line=lambda line: None, measure=measure)
            held = await outer.start(keeper.run)
            assert str(held.relay.peer_id) == str(near_id.peer_id)
            assert list(near.reservations) == [str(peer.peer_id).lower()]
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


async def test_the_keeper_passes_over_a_relay_that_refuses():
    full_id, open_id = Identity.generate(), Identity.generate()
    peer = Identity.generate()
    async with trio.open_nursery() as nursery:
        full = Relay(full_id, RelayLimits(max_reservations=1))
        full.reservations["someone"] = object()  # full already
        full_port = await nursery.start(full.serve, "127.0.0.1", 0)
        other = Relay(open_id)
        open_port = await nursery.start(other.serve, "127.0.0.1", 0)
        records = [RecordVerifier(TYPES).verify(sign_relay_record(
            ident, Multiaddr.for_socket("127.0.0.1", "tcp", port, ident.peer_id), LIMITS, {}, now_ms=wall_ms()), wall_ms())
            for ident, port in ((full_id, full_port), (open_id, open_port))]
        lines: list[str] = []

        async def measure(addr):  # the full one looks nearer: it is tried first
            return 1.0 if addr.peer_id == full_id.peer_id else 5.0

        keeper = RelayKeeper(RecordsOnly(records), peer, ("127.0.0.1", 9), on_change=lambda held: None,
                             print_line=lines.append, measure=measure)
        with trio.fail_after(30):
            held = await nursery.start(keeper.run)
        assert held.relay.peer_id == open_id.peer_id
        assert any(line.startswith(f"relay {full_id.peer_id} refused") and "relay full" in line for line in lines)
        nursery.cancel_scope.cancel()
