"""A relayed peer's circuits cannot be held by one stranger (issue 24 #2):
bounded per client source, taken back for newcomers (fair share), capped in
bytes and time per circuit, and a peer leaves a relay that keeps turning its
clients away. On loopback, each 127.0.0.x address is a source of its own
(loopback and private addresses are exempt from the /24 grouping)."""

from __future__ import annotations

import ssl
from collections import Counter
from functools import partial

from unittest import mock

import pytest
import trio
import trio.testing

from meshnet_p2p.nat import relay as relay_mod
from meshnet_p2p.dataplane.stub import ShardClient, open_channel
from meshnet_p2p.dataplane.transport.connect import ConnectDialog, relay_target
from meshnet_p2p.nat.relay import Relay, RelayLimits, attach_to_relay, hold_reservation
from meshnet_p2p.dataplane.transport.server import Server
from meshnet_p2p.dataplane.servicer import ShardRuntimeServicer
from meshnet_p2p.dataplane.transport.tls import make_tls_credentials
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.route.local import LocalRoute
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.core.records import RecordVerifier, wall_ms
from meshnet_p2p.nat.keeper import RelayKeeper
from meshnet_p2p.swarm.relay_offers import TYPES, sign_relay_record

LIMITS = {"max_reservations": 128, "max_connections_per_peer": 16, "bytes_per_second_per_peer": 64_000_000}


# --- helpers -------------------------------------------------------------------------------------


async def serve_relay(nursery, limits: RelayLimits = RelayLimits()) -> Relay:
    r = Relay(Identity.generate(), limits)
    port = await nursery.start(r.serve, "127.0.0.1", 0)
    r.multiaddr = Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{port}/p2p/{r.identity.peer_id}")
    return r


async def connect(relay: Relay, peer_id, source: str = "127.0.0.1", *, tls: bool = False):
    """CONNECT to ``peer_id`` through ``relay`` from ``source``: the open stream
    (TLS done with the peer when ``tls``: the peer's certificate is public, a
    stranger can complete it) on 200, else the relay's status line."""
    s = await trio.open_tcp_stream("127.0.0.1", relay.multiaddr.port, local_address=source)
    await s.send_all(ConnectDialog(relay_target(peer_id)).request)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await s.receive_some(1024)
        if not chunk:
            break
        head += chunk
    if not head.startswith(b"HTTP/1.1 200"):
        await s.aclose()
        return head.split(b"\r\n", 1)[0]
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(["h2"])
        s = trio.SSLStream(s, ctx, server_hostname="peer")
        await s.do_handshake()
    return s


async def echo_peer(nursery, relay: Relay) -> Identity:
    """A reserved peer whose every circuit echoes what it is sent."""

    async def echo(stream):
        try:
            async for data in stream:
                await stream.send_all(data)
        except trio.BrokenResourceError:
            pass

    peer = Identity.generate()
    listeners = await nursery.start(partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
    await nursery.start(attach_to_relay, relay.multiaddr, peer, ("127.0.0.1", listeners[0].socket.getsockname()[1]))
    return peer


def circuits_of(relay: Relay, peer: Identity) -> int:
    return relay.reservations[str(peer.peer_id).lower()].connections


# --- the pure core -------------------------------------------------------------------------------


def test_circuits_are_bounded_per_source_and_taken_back_from_the_biggest_source_idle_longest():
    from meshnet_p2p.nat.circuits import (
        CIRCUIT_LIMIT, SOURCE_LIMIT, Admit, Circuit, Reclaim, Refuse, admit_circuit, circuit_source, per_source_limit,
    )

    assert per_source_limit(16) == 4 and per_source_limit(2) == 2 and per_source_limit(1) == 1
    assert circuit_source("93.184.216.7") == circuit_source("93.184.216.99") == "93.184.216.0/24"
    assert circuit_source("127.0.0.2") == "127.0.0.2" and circuit_source("10.1.2.3") == "10.1.2.3"  # exempt: alone

    def held(*spec):  # (source, idle seconds) each
        return [Circuit(f"c{i}", src, idle) for i, (src, idle) in enumerate(spec)]

    one = dict(capacity=4, per_source=2)
    assert admit_circuit(held(("a", 1)), "a", **one) == Admit()  # room, and under its share
    assert admit_circuit(held(("a", 1), ("a", 2)), "a", **one) == Refuse(SOURCE_LIMIT)  # room, but not for a
    wide = dict(capacity=16, per_source=4)  # a source over its share while more than a share stays free
    assert admit_circuit(held(*[("a", 1)] * 11), "a", **wide) == Admit()
    assert admit_circuit(held(*[("a", 1)] * 12), "a", **wide) == Refuse(SOURCE_LIMIT)
    # full: a newcomer takes back the circuit idle longest of the source holding most
    assert admit_circuit(held(("a", 5), ("a", 9), ("a", 1), ("b", 30)), "c", **one) == Reclaim("c1")
    assert admit_circuit(held(("a", 5), ("a", 9), ("b", 1), ("b", 30)), "c", **one) == Reclaim("c3")  # ties: by name
    assert admit_circuit(held(("a", 5), ("a", 9), ("b", 1), ("c", 30)), "d", **one) == Reclaim("c1")
    # a source within one of the newcomer's keeps what it has: shares never flip back and forth
    assert admit_circuit(held(("a", 5), ("b", 9), ("c", 1), ("d", 30)), "e", **one) == Refuse(CIRCUIT_LIMIT)
    assert admit_circuit(held(("a", 5), ("a", 9), ("b", 1), ("c", 30)), "b", **one) == Refuse(CIRCUIT_LIMIT)


def test_a_peer_counts_only_the_clients_its_relay_turned_away_lately():
    from meshnet_p2p.nat.keeper import turned_away_lately

    assert turned_away_lately([0]) == 0
    assert turned_away_lately([0, 0, 1, 3]) == 3
    assert turned_away_lately([0, 5, 5, 5, 5]) == 0  # long ago: not lately
    assert turned_away_lately([0, 5, 6, 7, 9]) == 4
    assert turned_away_lately([9, 2]) == 0  # a total that went down (a liar, or a restart) counts nothing


# --- the relay -----------------------------------------------------------------------------------


async def test_one_source_leaves_a_quarter_of_a_peers_circuits_to_others():
    async with trio.open_nursery() as nursery:
        relay = await serve_relay(nursery)
        peer = await echo_peer(nursery, relay)
        # over its share (4) while more than a share stays free: a crowd behind one NAT is served...
        mine = [await connect(relay, peer.peer_id, "127.0.0.2") for _ in range(12)]
        assert all(isinstance(s, trio.SocketStream) for s in mine), mine
        # ...but the last share of the peer's circuits is kept for other sources
        assert await connect(relay, peer.peer_id, "127.0.0.2") == b"HTTP/1.1 429 Too Many Requests"
        other = await connect(relay, peer.peer_id, "127.0.0.3")  # another source still gets one
        assert isinstance(other, trio.SocketStream)
        await other.send_all(b"still spliced")
        assert await other.receive_some(100) == b"still spliced"
        assert relay.refusals["source_limit"] == 1 and circuits_of(relay, peer) == 13
        # a source over its own share is its own doing: not counted as the peer turning clients away
        assert relay.reservations[str(peer.peer_id).lower()].turned_away == 0
        for s in mine + [other]:
            await s.aclose()
        nursery.cancel_scope.cancel()


async def test_a_circuit_over_its_data_cap_is_closed_and_an_idle_one_at_its_time_cap():
    async with trio.open_nursery() as nursery:
        relay = await serve_relay(nursery, RelayLimits(max_circuit_bytes=200_000, max_circuit_seconds=2.0))
        peer = await echo_peer(nursery, relay)
        busy = await connect(relay, peer.peer_id)
        sent = 1 << 20

        async def send_all() -> None:
            try:
                for _ in range(sent // 16384):
                    await busy.send_all(b"x" * 16384)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        nursery.start_soon(send_all)
        got = 0
        with trio.fail_after(10):
            try:
                while chunk := await busy.receive_some(65536):  # the relay closes it: EOF...
                    got += len(chunk)
            except trio.BrokenResourceError:
                pass  # ...or a reset: it closed the socket with our bytes still unread
        assert got < sent  # cut off once 200,000 bytes moved, both ways counted
        assert 200_000 <= sum(relay.spliced_bytes.values()) <= 200_000 + 2 * 65536  # a chunk over each way at most
        assert relay.closed["data_cap"] == 1 and relay.closed["time_cap"] == 0
        # an idle circuit is spliced until its time cap, then closed as well
        opened = trio.current_time()
        idle = await connect(relay, peer.peer_id, "127.0.0.3")
        await idle.send_all(b"?")
        assert await idle.receive_some(10) == b"?"
        with trio.fail_after(10):
            assert await idle.receive_some(10) == b""
        assert trio.current_time() - opened >= 2.0 and relay.closed["time_cap"] == 1
        with trio.fail_after(10):
            while circuits_of(relay, peer):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


# --- the attack, end to end: a stranger holding every circuit of a relayed peer ---------------------


@pytest.fixture
def whole_peer(model_path, load_engine):
    """A peer serving the whole embedded model (in process), to be relayed."""
    identity = Identity.generate()
    creds = make_tls_credentials(identity)
    server = ShardRuntimeServicer(load_engine(model_path), peer_id=str(identity.peer_id)).register(Server(creds)).start()
    yield identity, creds, server
    server.stop(0)


async def test_a_stranger_holding_every_circuit_cannot_keep_a_generation_from_a_relayed_peer(
        whole_peer, model_path, model_digest, load_engine):
    """16 TLS circuits from four stranger addresses (four each: all the peer's
    circuits, within each address's share) used to turn every other client
    away with 429. Now an honest client's generation through the relay takes
    one back, and is exact while the stranger keeps trying to take it back."""
    identity, creds, server = whole_peer
    prompt = Tokenizer(model_path).encode("The capital of France is")
    reference = LocalRoute([load_engine(model_path, source_sha256=model_digest)]).generate(
        prompt, 8, stop_at_eog=False).token_ids
    strangers = [f"127.0.0.{i}" for i in range(2, 6)]
    async with trio.open_nursery() as nursery:
        relay = await serve_relay(nursery)
        await nursery.start(hold_reservation, relay.multiaddr, identity, server.adopt)
        held = [await connect(relay, identity.peer_id, ip, tls=True) for ip in strangers for _ in range(4)]
        assert all(isinstance(s, trio.SSLStream) for s in held), held
        assert circuits_of(relay, identity) == 16  # every circuit the relay carries to this peer

        client = ShardClient(open_channel(creds.cert_pem, relay=("127.0.0.1", relay.multiaddr.port),
                                          peer_id=identity.peer_id), timeout=30)

        def generate() -> list[int]:
            fp = client.capability().fingerprint
            s = client.session(fp, max_tokens=64)
            out = [s.step(0, token_ids=prompt).token_id]
            for i in range(7):
                out.append(s.step(len(prompt) + i, token_ids=[out[-1]], decode=True).token_id)
            s.release()
            return out

        result: dict = {}

        async def run() -> None:
            result["tokens"] = await trio.to_thread.run_sync(generate)

        async with trio.open_nursery() as gen:
            gen.start_soon(run)
            # meanwhile the stranger tries to take circuits back, from its addresses and a fresh one
            refused = []
            for ip in strangers + ["127.0.0.6"] * 2:
                s = await connect(relay, identity.peer_id, ip, tls=True)
                if isinstance(s, bytes):
                    refused.append(s)
                else:
                    refused.append(None)
                    held.append(s)
        assert result["tokens"] == reference  # the whole model's tokens, through the relay, beside the attack
        # the honest client kept its one circuit all along (one channel: a circuit taken back would have
        # failed a step); the stranger took back only its own, and no address of its holds more than its share
        by_source = Counter(c.source for c in relay.reservations[str(identity.peer_id).lower()].circuits.values())
        assert by_source["127.0.0.1"] == 1 and max(by_source.values()) <= 4, by_source
        # (its retries from an address at its share are refused; the peer's own server may have closed
        # one of its idle connections meanwhile, freeing a slot, so not every retry is)
        assert b"HTTP/1.1 429 Too Many Requests" in refused and relay.closed["taken_back"] >= 1
        client.close()
        for s in held:
            await trio.aclose_forcefully(s)
        nursery.cancel_scope.cancel()


# --- the keeper leaves a relay that turns everyone away -------------------------------------------


def test_a_peer_reads_only_well_formed_load_lines_and_keeps_its_reservation():
    """LOAD is what a relay claims: anything malformed is ignored, never an error."""
    relay_id, peer = Identity.from_seed(b"\x61" * 32), Identity.from_seed(b"\x62" * 32)
    junk = [b"LOAD 1\n", b"LOAD a b\n", b"LOAD 1 2 3\n", b"LOAD -1 2\n", "LOAD \u0661 \u0662\n".encode(),
            b"LOAD 9999999999999999999999 1\n", b"LOAD \xff\xfe 1\n", b"LOAD  \n"]

    async def main():
        ours, theirs = trio.testing.memory_stream_pair()

        async def fake_relay():
            reader = relay_mod._LineReader(theirs)
            line = (await reader.line()).decode().split()
            sig = relay_id.sign(relay_mod.RELAY_DOMAIN + bytes.fromhex(line[2]) + peer.peer_id.multihash)
            await theirs.send_all(f"CHALLENGE {bytes(32).hex()} {sig.hex()}\n".encode())
            await reader.line()
            await theirs.send_all(b"OK\n" + b"".join(junk))
            ping = await reader.line()
            await theirs.send_all(ping.replace(b"PING", b"PONG") + b"\nLOAD 3 7\n")
            await trio.sleep_forever()

        async def connect_to(host, port):
            return ours

        addr = Multiaddr.for_socket("10.0.0.1", "tcp", 4002, relay_id.peer_id)
        with mock.patch.object(relay_mod.trio, "open_tcp_stream", connect_to):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fake_relay)
                held = await nursery.start(hold_reservation, addr, peer, ("127.0.0.1", 9))
                await held.next_report()
                assert held.circuits == 3 and held.turned_away == [0, 7]
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


class RecordsOnly:
    """A DHT node's read side, holding the given records (the keeper only reads)."""

    def __init__(self, records) -> None:
        self._records = records

    def records(self, key):
        return self._records

    async def get(self, key):
        return []


def _record(relay: Relay):
    addr = relay.multiaddr
    return RecordVerifier(TYPES).verify(sign_relay_record(relay.identity, addr, LIMITS, {}, now_ms=wall_ms()), wall_ms())


async def test_a_peer_leaves_a_relay_that_turns_its_clients_away(monkeypatch):
    """Sixteen addresses each hold one circuit (nobody holds more than a
    newcomer plus one: nothing to take back), so the relay turns every other
    client away. The peer hears it in the relay's LOAD lines and moves to
    another relay within a few keepalives (it used to wait for two failed
    self-dials, 60 s apart)."""
    monkeypatch.setattr(relay_mod, "KEEPALIVE_S", 0.5)  # pings (and LOAD reports) every 0.5 s
    peer = Identity.generate()
    server = Server(make_tls_credentials(peer)).start()
    try:
        async with trio.open_nursery() as nursery:
            near, far = await serve_relay(nursery), await serve_relay(nursery)
            rtts = {near.identity.peer_id: 1.0, far.identity.peer_id: 9.0}

            async def measure(addr):
                return rtts[addr.peer_id]

            moved = trio.Event()

            def on_change(held) -> None:
                if held is not None and held.relay.peer_id == far.identity.peer_id:
                    moved.set()

            lines: list[str] = []
            keeper = RelayKeeper(RecordsOnly([_record(near), _record(far)]), peer, server.adopt, on_change=on_change,
                                 print_line=lines.append, measure=measure, allow_loopback=True)
            held = await nursery.start(keeper.run)
            assert held.relay.peer_id == near.identity.peer_id
            strangers = [await connect(near, peer.peer_id, f"127.0.0.{i}", tls=True) for i in range(2, 18)]
            assert all(isinstance(s, trio.SSLStream) for s in strangers)
            for _ in range(3):  # honest clients, turned away
                assert await connect(near, peer.peer_id) == b"HTTP/1.1 429 Too Many Requests"
            with trio.fail_after(20):
                await moved.wait()
            assert any(line.startswith(f"lost relay {near.identity.peer_id}: it turned 3") for line in lines), lines
            assert keeper.set_aside[str(near.identity.peer_id)] - trio.current_time() > 60  # not back soon
            honest = await connect(far, peer.peer_id, tls=True)  # reachable again, through the other relay
            assert isinstance(honest, trio.SSLStream)
            for s in strangers + [honest]:
                await trio.aclose_forcefully(s)
            nursery.cancel_scope.cancel()
    finally:
        server.stop(0)
