"""Reachability checks (AutoNAT-style dial-backs): real DHT nodes on loopback UDP,
real TLS data-plane listeners (our data-plane Server; a handshake needs no model),
and the pure parts (record checks, the decision, the choice of dialers).

127.0.0.2 stands in for "another IP": Linux routes all of 127.0.0.0/8 to lo.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import socket
import ssl

import pytest
import trio

from meshnet_p2p.nat import dialback
from meshnet_p2p.dataplane.transport.server import Server
from meshnet_p2p.dataplane.transport.tls import load_key_pair, make_tls_credentials
from meshnet_p2p.dht import wire
from meshnet_p2p.dht.node import DHTNode
from meshnet_p2p.dht.routing import Contact
from meshnet_p2p.nat.dialback import (
    NOT_FROM_SOURCE,
    REACHABLE,
    UNKNOWN,
    UNREACHABLE,
    DialbackRejected,
    DialReport,
    decide,
    dial_target,
    parse_dial_result,
    sign_dial_result,
    verify_dial_result,
)
from meshnet_p2p.core.identity import Identity, PeerId
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.swarm.node import node_multiaddr, start_node
from meshnet_p2p.nat.dialer import serve_dial_backs
from meshnet_p2p.nat.reachability import ReachabilityError, check_reachability, choose_dialers, relay_check, \
    relay_dial_check, tls_dial_check
from meshnet_p2p.nat.relay import Relay, hold_reservation
from meshnet_p2p.core.records import RecordVerifier, sign_record, wall_ms

_seeds = itertools.count(1)


def ident() -> Identity:
    return Identity.from_seed(next(_seeds).to_bytes(4, "big") * 8)


def tcp(peer: PeerId, port: int, host: str = "127.0.0.1") -> str:
    return str(Multiaddr.for_socket(host, "tcp", port, peer))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def data_plane(identity: Identity | None, host: str = "127.0.0.1"):
    """A real TLS data-plane listener whose certificate is bound to ``identity``
    (None: a certificate bound to nobody). A dial-back only handshakes."""
    srv = Server(make_tls_credentials(identity), host=host).start()
    try:
        yield srv.port
    finally:
        srv.stop(0)


server_of: dict = {}  # node -> its dial-back server (nat/dialer.py)


async def node(nursery, *, host: str = "127.0.0.1", dial=tls_dial_check, boot: DHTNode | None = None,
               client_mode: bool = False) -> DHTNode:
    def serve(n: DHTNode) -> None:  # as a role does (reachability.dial_checks); None: it refuses, "not a dialer"
        server_of[n] = serve_dial_backs(n, dial)

    return await start_node(nursery, ident(), listen=f"{host}:0", client_mode=client_mode, serve=serve,
                            bootstrap=[node_multiaddr(boot)] if boot is not None else ())


async def swarm(nursery, dials, *, host: str = "127.0.0.1") -> tuple[DHTNode, list[DHTNode]]:
    """Dialers (one per dial function) and an asker whose routing table holds them all."""
    dialers = []
    for d in dials:
        dialers.append(await node(nursery, dial=d, boot=dialers[0] if dialers else None))
    asker = await node(nursery, host=host, dial=None, boot=dialers[0])
    for d in dialers:  # a round trip: each is in the asker's table, whatever the lookup found
        assert await asker.ping(d.contact()) is not None
    return asker, dialers


def body(*addrs: str) -> dict:
    return {"addrs": list(addrs), "nonce": os.urandom(16)}


# --- (a)-(d): the decision on real dials ---------------------------------------------------------


async def test_a_listening_peer_is_found_reachable_by_three_dialers_not_only_its_bootstrap_peer(nursery):
    asker, dialers = await swarm(nursery, [tls_dial_check] * 4)
    boot = dialers[0]
    with data_plane(asker.identity) as port:
        found = await check_reachability(asker, [tcp(asker.peer_id, port)], avoid=[boot.peer_id])
    assert found.status == REACHABLE and found.reachable == (tcp(asker.peer_id, port),), found.reason
    assert {r.dialer for r in found.evidence} == {d.peer_id for d in dialers[1:]}  # the bootstrap peer was avoided
    assert all(r.results == ((tcp(asker.peer_id, port), True, "ok"),) for r in found.evidence)
    assert found.observed == "127.0.0.1" and found.asked == 3
    for r in found.evidence:  # evidence anyone can check again: signed by its dialer, about the asker
        rec = RecordVerifier(dialback.TYPES).verify(r.record, wall_ms())
        assert rec.signer == r.dialer and rec.content["subject"] == str(asker.peer_id)
    assert asker.stats["reachability_answered"] == 3
    assert sum(d.stats["dial_back_ok"] for d in dialers) == 3


async def test_an_address_nobody_listens_on_is_unreachable(nursery):
    asker, _ = await swarm(nursery, [tls_dial_check] * 3)
    found = await check_reachability(asker, [tcp(asker.peer_id, free_port())])
    assert found.status == UNREACHABLE and found.reachable == () and "refused" in found.reason
    assert [r.results[0][1:] for r in found.evidence] == [(False, "refused")] * 3


async def test_an_address_served_with_another_peers_certificate_is_unreachable(nursery):
    asker, _ = await swarm(nursery, [tls_dial_check] * 3)
    with data_plane(Identity.generate()) as port:
        found = await check_reachability(asker, [tcp(asker.peer_id, port)])
    assert found.status == UNREACHABLE and "another peer's certificate" in found.reason
    with data_plane(None) as port:  # a certificate bound to nobody proves nothing either
        found = await check_reachability(asker, [tcp(asker.peer_id, port)])
    assert found.status == UNREACHABLE and "no peer identity" in found.reason


async def test_an_address_at_another_ip_than_the_requests_source_is_never_dialled(nursery):
    asker, dialers = await swarm(nursery, [tls_dial_check] * 3, host="127.0.0.2")  # asks from 127.0.0.2
    with data_plane(asker.identity, "127.0.0.1") as elsewhere, data_plane(asker.identity, "127.0.0.2") as here:
        private = tcp(asker.peer_id, elsewhere, "127.0.0.1")  # its listener is up: a dial would succeed
        found = await check_reachability(asker, [private])
        assert found.status == UNREACHABLE and NOT_FROM_SOURCE in found.reason
        assert all(r.results == ((private, False, NOT_FROM_SOURCE),) and r.observed == "127.0.0.2"
                   for r in found.evidence)
        assert sum(d.stats["dial_back_dials"] for d in dialers) == 0
        # beside an address at its source IP, only that one is dialled
        public = tcp(asker.peer_id, here, "127.0.0.2")
        found = await check_reachability(asker, [private, public])
    assert found.status == REACHABLE and found.reachable == (public,) and found.observed == "127.0.0.2"
    assert all(r.results == ((private, False, NOT_FROM_SOURCE), (public, True, "ok")) for r in found.evidence)
    assert sum(d.stats["dial_back_dials"] for d in dialers) == 3


# --- (e): bounds ---------------------------------------------------------------------------------


async def test_in_flight_and_per_source_bounds_refuse_and_the_node_keeps_serving(nursery):
    started, all_started, release = [], trio.Event(), trio.Event()

    async def slow_dial(peer: PeerId, addr: str) -> tuple[bool, str]:
        started.append(addr)
        if len(started) == 8:
            all_started.set()
        await release.wait()
        return True, "ok"

    asker, (dialer,) = await swarm(nursery, [slow_dial])
    me, to = asker.peer_id, dialer.contact()
    answers = []

    async def ask(b: dict) -> None:
        answers.append(await asker.request(to, "dial_back", b, timeout=10))

    async with trio.open_nursery() as waiting:
        waiting.start_soon(ask, body(*(tcp(me, 1000 + i) for i in range(4))))
        waiting.start_soon(ask, body(*(tcp(me, 2000 + i) for i in range(4))))
        with trio.fail_after(5):
            await all_started.wait()
        assert server_of[dialer].dials_in_flight == 8
        busy = await asker.request(to, "dial_back", body(tcp(me, 3000)))
        assert busy.kind == "dial_result" and busy.body == {"refused": "busy"}
        assert (await asker.ping(to)).kind == "pong"  # the node serves everything else meanwhile
        assert (await asker.request(to, "find_node", {"target": bytes(32)})).kind == "nodes"
        release.set()
    assert [parse_dial_result(a.body)[1] for a in answers] == [None, None]
    assert server_of[dialer].dials_in_flight == 0
    # this source had 2 requests served this minute (the one refused busy got nothing and does
    # not count): a 3rd and 4th are served, a 5th refused
    for port in (4000, 4500):
        served = await asker.request(to, "dial_back", body(tcp(me, port)), timeout=5)
        assert parse_dial_result(served.body)[0] is not None
    fifth = await asker.request(to, "dial_back", body(tcp(me, 5000)))
    assert fifth.body == {"refused": "rate limited"}
    # another source IP is still served
    other = await node(nursery, host="127.0.0.2", dial=None, boot=dialer)
    reply = await other.request(to, "dial_back", body(tcp(other.peer_id, 6000, "127.0.0.2")), timeout=5)
    assert parse_dial_result(reply.body)[0] is not None
    assert dialer.stats["dial_back_refused_busy"] == 1 and dialer.stats["dial_back_refused_rate_limited"] == 1
    assert dialer.stats["dial_back_served"] == 5


async def test_dialers_refuse_what_they_must_not_dial_and_drop_malformed_requests(nursery):
    asker, (dialer, plain) = await swarm(nursery, [tls_dial_check, None])
    me, to = asker.peer_id, dialer.contact()
    other = Identity.generate().peer_id
    for addr, why in [(f"/dns4/localhost/tcp/5000/p2p/{me}", dialback.DNS_NAME),
                      (f"/ip4/127.0.0.1/udp/5000/p2p/{me}", dialback.NOT_TCP),
                      (f"/ip4/127.0.0.1/udp/5000/p2p/{other}/p2p-circuit/p2p/{me}", dialback.NOT_TCP),
                      (f"/ip4/127.0.0.1/tcp/5000/p2p-circuit/p2p/{me}", dialback.NOT_TCP),
                      (f"/ip4/127.0.0.1/tcp/5000/p2p/{other}/p2p-circuit/p2p/{other}", dialback.ANOTHER_PEER),
                      (f"/ip4/127.0.0.1/tcp/0/p2p/{other}/p2p-circuit/p2p/{me}", dialback.PORT_ZERO),
                      (f"/ip4/127.0.0.1/tcp/0/p2p/{me}", dialback.PORT_ZERO),
                      (f"/ip4/127.0.0.1/tcp/5000/p2p/{other}", dialback.ANOTHER_PEER),
                      ("/ip4/127.0.0.1/tcp/5000", dialback.ANOTHER_PEER)]:
        reply = await asker.request(to, "dial_back", body(addr))
        assert reply.body == {"refused": why}, addr
    # a node without a dial function, or in client mode, is not a dialer
    assert (await asker.request(plain.contact(), "dial_back", body(tcp(me, 1)))).body == {"refused": "not a dialer"}
    client = await node(nursery, client_mode=True, boot=dialer)
    client_contact = Contact.of(client.peer_id, *client.addr)
    assert (await asker.request(client_contact, "dial_back", body(tcp(me, 1)))).body == {"refused": "not a dialer"}
    # malformed bodies are dropped (counted); the node goes on answering
    before = dialer.stats["bad_requests"]
    for bad in [{"addrs": [], "nonce": bytes(16)}, {"addrs": [tcp(me, 1)] * 2, "nonce": bytes(16)},
                {"addrs": [tcp(me, i) for i in range(1, 6)], "nonce": bytes(16)}, {"addrs": [tcp(me, 1)]},
                {"addrs": [tcp(me, 1)], "nonce": bytes(15)}, {"addrs": ["/not/a/multiaddr"], "nonce": bytes(16)},
                {"addrs": ["x" * 513], "nonce": bytes(16)}, {"addrs": [7], "nonce": bytes(16)}]:
        await asker.transport.send(wire.encode(asker.identity, "dial_back", wire.new_rpc_id(), bad, wall_ms(),
                                               to=dialer.peer_id), dialer.addr)
    assert (await asker.ping(to)).kind == "pong"  # answered after those (one socket, in order): all dropped
    assert dialer.stats["bad_requests"] == before + 8
    with pytest.raises(ReachabilityError, match="dns name"):
        await check_reachability(asker, [f"/dns4/example.org/tcp/5000/p2p/{me}"])
    with pytest.raises(ReachabilityError, match="1 to 4"):
        await check_reachability(asker, [tcp(me, p) for p in range(1, 6)])


def test_a_dialer_dials_a_relay_for_whoever_asks_but_never_into_a_network_the_asker_is_not_in():
    me, relay = Identity.generate().peer_id, Identity.generate().peer_id

    def verdict(host: str, source: str) -> tuple[bool, str]:
        target, why = dial_target(f"/ip4/{host}/tcp/4002/p2p/{relay}/p2p-circuit/p2p/{me}", me)
        assert why is None
        return dialback.may_dial(target, source)

    assert verdict("151.101.1.7", "93.184.216.34") == (True, dialback.OK)  # a public relay: the target is the relay
    for host, source in [("192.168.1.10", "93.184.216.34"), ("127.0.0.1", "93.184.216.34"), ("127.0.0.1", "10.0.0.3"),
                         ("169.254.1.1", "169.254.1.2"), ("0.0.0.0", "127.0.0.1")]:
        assert verdict(host, source) == (False, dialback.NOT_A_RELAY_TO_DIAL), (host, source)
    assert verdict("192.168.1.10", "192.168.1.20")[0] and verdict("127.0.0.1", "127.0.0.2")[0]  # a LAN, a test swarm
    direct, _ = dial_target(tcp(me, 5000, "151.101.1.7"), me)  # a direct address: only at the asker's own IP
    assert dialback.may_dial(direct, "151.101.1.7") == (True, dialback.OK)
    assert dialback.may_dial(direct, "93.184.216.34") == (False, NOT_FROM_SOURCE)


class OwnDialsOnly(Relay):
    """Carries a client only if it comes from the address the reserved peers came from:
    a peer dialling itself through it gets through, nobody else does."""

    owner = "127.0.0.1"

    async def _client(self, stream, reader, first) -> None:
        if stream.socket.getpeername()[0] != self.owner:
            await trio.sleep_forever()
        await super()._client(stream, reader, first)


@pytest.mark.parametrize("relay_kind", [Relay, OwnDialsOnly])
async def test_a_relayed_peer_learns_from_others_whether_its_relay_carries_them(nursery, relay_kind):
    """relay_check, the keeper's verify: three dialers (dialling from 127.0.0.9, another
    host on loopback) dial the asker's circuit address through its relay. Through an
    honest relay they reach it; through one that carries only the peer's own dials
    they do not, though the peer's dial of itself passes (what the keeper trusted)."""
    away = functools.partial(tls_dial_check, local_address="127.0.0.9")
    asker, dialers = await swarm(nursery, [away] * 3)
    relay_id = Identity.generate()
    relay = relay_kind(relay_id)
    port = await nursery.start(relay.serve, "127.0.0.1", 0)
    relay_addr = Multiaddr.for_socket("127.0.0.1", "tcp", port, relay_id.peer_id)
    srv = Server(make_tls_credentials(asker.identity)).start()
    try:
        await nursery.start(hold_reservation, relay_addr, asker.identity, srv.adopt)
        assert await relay_dial_check(asker.peer_id, relay_addr) == (True, "ok")  # its own dial passes either way
        fallback_used = []

        async def fallback(peer_id, relay):
            fallback_used.append(relay)
            return True, "ok"

        ok, why = await relay_check(asker, fallback=fallback)(asker.peer_id, relay_addr)
        assert not fallback_used  # three dialers answered: their word decides
        if relay_kind is Relay:
            assert (ok, why) == (True, "ok")
            assert sum(d.stats["dial_back_ok"] for d in dialers) == 3
        else:
            assert not ok and why.startswith("others could not reach this peer through it"), why
    finally:
        srv.stop(0)


@pytest.mark.parametrize("second", [REACHABLE, UNREACHABLE, UNKNOWN])
async def test_an_undecided_relay_check_asks_others_again_before_it_dials_itself(monkeypatch, second):
    """Found by the simulator (docs/scale.md): of the dialers asked, one answered (it could
    not reach the peer through its relay) and the rest had left; undecided, the keeper
    dialled itself, which a relay carrying only its peer's own dials passes, and the peer
    sat on that relay for a minute. Now another sample of dialers is asked first; only
    when that is undecided too does the self-dial decide."""
    from meshnet_p2p.nat import reachability

    peer, relay = Identity.generate().peer_id, Multiaddr.for_socket("192.0.2.7", "tcp", 4002, Identity.generate().peer_id)
    answers = iter([dialback.Reachability(UNKNOWN, "the 1 dialers that answered do not agree", (), (), None, 3),
                    dialback.Reachability(second, "decided", (), (), None, 3)])
    asked, fallback_used = [], []

    async def check(node, addrs, **kw):
        asked.append(addrs)
        return next(answers)

    async def fallback(peer_id, relay):
        fallback_used.append(relay)
        return True, "ok"

    monkeypatch.setattr(reachability, "check_reachability", check)
    ok, why = await relay_check(None, fallback=fallback)(peer, relay)
    assert len(asked) == 2
    assert ok == {REACHABLE: True, UNREACHABLE: False, UNKNOWN: True}[second], why
    assert fallback_used == ([relay] if second == UNKNOWN else [])


async def test_a_relay_check_with_nobody_to_ask_dials_itself_at_once(monkeypatch):
    from meshnet_p2p.nat import reachability

    peer, relay = Identity.generate().peer_id, Multiaddr.for_socket("192.0.2.7", "tcp", 4002, Identity.generate().peer_id)
    asked = []

    async def check(node, addrs, **kw):
        asked.append(addrs)
        return dialback.Reachability(UNKNOWN, "nobody to ask", (), (), None, 0)

    async def fallback(peer_id, relay):
        return False, "timeout"

    monkeypatch.setattr(reachability, "check_reachability", check)
    assert await relay_check(None, fallback=fallback)(peer, relay) == (False, "timeout")
    assert len(asked) == 1


async def test_a_spoofed_source_gets_a_cookie_and_nothing_is_dialled(nursery):
    dials = []

    async def dial(peer, addr):
        dials.append(addr)
        return True, "ok"

    asker, (dialer,) = await swarm(nursery, [dial])
    # the asker's signed request, sent from an address that never asked anything (a spoofed source)
    with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as victim:
        await victim.bind(("127.0.0.1", 0))
        request = wire.encode(asker.identity, "dial_back", wire.new_rpc_id(), body(tcp(asker.peer_id, 80)),
                              wall_ms(), to=dialer.peer_id)
        await victim.sendto(request, dialer.addr)
        with trio.fail_after(5):
            reply, _ = await victim.recvfrom(65536)
    assert wire.decode(reply, wall_ms()).kind == "cookie" and len(reply) <= 3 * len(request)
    assert dials == [] and dialer.stats["dial_back_cookies"] == 1


def test_a_dial_result_fits_the_amplification_bound_whatever_was_asked():
    asker, dialer = ident(), ident()
    cases = [[tcp(asker.peer_id, 1)],
             [f"/ip6/ffff:ffff:ffff:ffff:ffff:ffff:ffff:fff{i}/tcp/65535/p2p/{asker.peer_id}" for i in range(4)]]
    for addrs in cases:
        now, nonce = wall_ms(), os.urandom(16)
        request = wire.encode(asker, "dial_back", wire.new_rpc_id(), {"addrs": addrs, "nonce": nonce}, now,
                              to=dialer.peer_id)
        results = [(a, False, "x" * 64) for a in addrs]
        record = sign_dial_result(dialer, asker.peer_id, nonce, results, "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                                  now_ms=now)
        reply = wire.encode(dialer, "dial_result", wire.new_rpc_id(), {"result": record}, now, to=asker.peer_id)
        assert len(reply) <= 3 * len(request) and len(record) <= dialback.MAX_RESULT_BYTES


# --- (f), (g): answers not to believe, and a liar among honest dialers -------------------------------


async def test_forged_replayed_and_mismatched_results_are_discarded(nursery):
    async def says_ok(peer, addr):
        return True, "ok"

    asker, dialers = await swarm(nursery, [says_ok] * 5)
    wrong_nonce, wrong_subject, other_signer, extra_addr, replayer = dialers
    stranger = Identity.generate()

    def forge(d: DHTNode, **change):
        def make(subject, nonce, results, observed):
            args = {"identity": d.identity, "subject": subject, "nonce": nonce, "results": results} | change
            return sign_dial_result(args["identity"], args["subject"], args["nonce"], args["results"], observed,
                                    now_ms=wall_ms())
        server_of[d]._result_record = make

    forge(wrong_nonce, nonce=os.urandom(16))
    forge(wrong_subject, subject=stranger.peer_id)
    forge(other_signer, identity=stranger)
    forge(extra_addr, results=[(tcp(asker.peer_id, 1), True, "ok"), (tcp(asker.peer_id, 2), True, "ok")])
    first = []
    genuine = server_of[replayer]._result_record

    def replay(subject, nonce, results, observed):
        if not first:
            first.append(genuine(subject, nonce, results, observed))
        return first[0]

    server_of[replayer]._result_record = replay
    addr = tcp(asker.peer_id, free_port())
    found = await check_reachability(asker, [addr], want=5)
    assert [r.dialer for r in found.evidence] == [replayer.peer_id]  # the only honest answer (so far)
    assert found.status == UNKNOWN  # one answer of five asked decides nothing
    found = await check_reachability(asker, [addr], want=5)  # now the replayer replays its first answer
    assert found.status == UNKNOWN and found.evidence == ()
    s = asker.stats
    assert (s["reachability_discarded_another_nonce"], s["reachability_discarded_another_subject"],
            s["reachability_discarded_signed_by_another_peer"], s["reachability_discarded_other_addresses"]) == (3, 2, 2, 2)


async def test_one_lying_dialer_among_three_honest_ones_changes_nothing(nursery):
    async def liar(peer, addr):
        ok, _ = await tls_dial_check(peer, addr)
        return (not ok), ("ok" if not ok else "refused")

    asker, dialers = await swarm(nursery, [tls_dial_check] * 3 + [liar])
    with data_plane(asker.identity) as port:  # reachable: the liar says it is not
        found = await check_reachability(asker, [tcp(asker.peer_id, port)], want=4)
    assert found.status == REACHABLE and sorted(r.results[0][1] for r in found.evidence) == [False, True, True, True]
    found = await check_reachability(asker, [tcp(asker.peer_id, free_port())], want=4)  # behind NAT: the liar says yes
    assert found.status == UNREACHABLE and sorted(r.results[0][1] for r in found.evidence) == [False, False, False, True]
    # and with one honest dialer fewer (2 honest + the liar), still
    found = await check_reachability(asker, [tcp(asker.peer_id, free_port())], want=3, avoid=[dialers[0].peer_id])
    assert found.status == UNREACHABLE


# --- tls_dial_check ----------------------------------------------------------------------------


async def test_tls_dial_check_names_what_went_wrong():
    me = Identity.generate()
    with data_plane(me) as port:
        assert await tls_dial_check(me.peer_id, tcp(me.peer_id, port)) == (True, "ok")
    assert await tls_dial_check(me.peer_id, tcp(me.peer_id, free_port())) == (False, "refused")
    assert await tls_dial_check(me.peer_id, f"/dns4/localhost/tcp/1/p2p/{me.peer_id}") == (False, "bad address")

    async def serve(stream: trio.SocketStream) -> None:  # accepts, says something that is not TLS, hangs up
        await stream.send_all(b"HTTP/1.1 400 no\r\n\r\n")
        await stream.aclose()

    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    no_h2 = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # the right certificate, but no HTTP/2 offered
    load_key_pair(no_h2, make_tls_credentials(me))

    async def handshake_only(stream: trio.SSLStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.do_handshake()
            await stream.receive_some(1)

    async with trio.open_nursery() as n:
        (junk,) = await n.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        (mute,) = await n.start(functools.partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
        (tls,) = await n.start(functools.partial(trio.serve_ssl_over_tcp, handshake_only, 0, no_h2, host="127.0.0.1"))
        port_of = lambda listener: listener.transport_listener.socket.getsockname()[1] \
            if hasattr(listener, "transport_listener") else listener.socket.getsockname()[1]
        assert await tls_dial_check(me.peer_id, tcp(me.peer_id, port_of(junk))) == (False, "tls failed")
        assert await tls_dial_check(me.peer_id, tcp(me.peer_id, port_of(mute)), timeout=0.2) == (False, "timeout")
        assert await tls_dial_check(me.peer_id, tcp(me.peer_id, port_of(tls))) == (False, "not h2")
        n.cancel_scope.cancel()


# --- the pure parts ------------------------------------------------------------------------------

NOW = 1_700_000_000_000
ASKER, D1, D2, D3, OTHER = (Identity.from_seed(bytes([0x40 + i]) * 32) for i in range(5))
ADDR = f"/ip4/203.0.113.7/tcp/5000/p2p/{ASKER.peer_id}"
NONCE = b"n" * 16


def _record(signer=D1, subject=None, nonce=NONCE, results=None, observed="203.0.113.7", now=NOW, ttl=60_000):
    return sign_dial_result(signer, subject or ASKER.peer_id, nonce, results or [(ADDR, True, "ok")], observed,
                            now_ms=now, ttl_ms=ttl)


def _verify(wire_bytes, dialer=D1, addrs=(ADDR,)):
    return verify_dial_result(wire_bytes, dialer=dialer.peer_id, subject=ASKER.peer_id, nonce=NONCE, addrs=list(addrs),
                              now_ms=NOW)


def test_a_verified_result_is_exactly_what_the_dialer_signed():
    got = _verify(_record())
    assert got == DialReport(D1.peer_id, ((ADDR, True, "ok"),), "203.0.113.7", _record())


@pytest.mark.parametrize("make, reason", [
    (lambda: _record(nonce=b"m" * 16), "another nonce"),
    (lambda: _record(subject=OTHER.peer_id), "another subject"),
    (lambda: _record(signer=OTHER), "signed by another peer"),
    (lambda: _record(results=[(ADDR, True, "ok"), (ADDR.replace("5000", "5001"), True, "ok")]), "other addresses"),
    (lambda: _record(results=[(ADDR.replace("5000", "5001"), True, "ok")]), "other addresses"),
    (lambda: _record(now=NOW - 61_000), "record expired"),
    (lambda: _record(ttl=6 * 60_000), "record malformed"),  # lives longer than a dial-back may
    (lambda: _record(observed="not an ip"), "record malformed"),
    (lambda: _record()[:-1] + b"\0", "record bad-signature"),
    (lambda: sign_record(D1, "meshnet/capability/v1", {"x": 1}, seq=1, now_ms=NOW, ttl_ms=1000),
     "record unknown-type"),
])
def test_results_not_to_believe_are_discarded_with_a_reason(make, reason):
    with pytest.raises(DialbackRejected) as e:
        _verify(make())
    assert e.value.reason == reason


def test_the_record_validator_names_what_is_wrong_and_never_raises():
    good = {"subject": str(ASKER.peer_id), "nonce": NONCE, "results": [[ADDR, True, "ok"]], "observed": "::1"}
    assert dialback.valid_content(good) is None
    for bad in [good | {"extra": 1}, good | {"subject": "nope"}, good | {"nonce": b"x"}, good | {"results": []},
                good | {"results": [[ADDR, 1, "ok"]]}, good | {"results": [[ADDR, True, "x" * 65]]},
                good | {"results": [[ADDR, True, "ok"]] * 2}, good | {"results": [[ADDR, True, "ok"]] * 5},
                good | {"observed": "x"}, [], None, {1: 2}, good | {"results": [[ADDR, True]]}]:
        assert isinstance(dialback.valid_content(bad), str), bad


def _report(dialer: Identity, *oks: bool, observed="203.0.113.7") -> DialReport:
    addrs = [ADDR.replace("5000", str(5000 + i)) for i in range(len(oks))]
    return DialReport(dialer.peer_id, tuple((a, ok, "ok" if ok else "refused") for a, ok in zip(addrs, oks)),
                      observed, b"")


def _addrs(n: int) -> list[str]:
    return [ADDR.replace("5000", str(5000 + i)) for i in range(n)]


def test_one_liar_never_turns_a_decision_once_three_answered():
    for n in range(3, 8):
        dialers = [Identity.from_seed(bytes([0x50 + i]) * 32) for i in range(n)]
        for truth in (True, False):
            for liar in range(n):
                reports = [_report(d, truth != (i == liar)) for i, d in enumerate(dialers)]
                got = decide(reports, _addrs(1), asked=n)
                assert got.status == (REACHABLE if truth else UNREACHABLE), (n, truth, liar)


def test_the_decision_on_few_or_conflicting_answers():
    one, two = _report(D1, True), _report(D2, False)
    assert decide([], _addrs(1), asked=0).status == UNKNOWN
    assert decide([], _addrs(1), asked=3, refused=[(D1.peer_id, "busy")]).reason.endswith("busy)")
    assert decide([one], _addrs(1), asked=1).status == REACHABLE  # only one could be asked: it decides
    assert decide([two], _addrs(1), asked=1).status == UNREACHABLE
    assert decide([one], _addrs(1), asked=3).status == UNKNOWN  # one of three answering decides nothing
    assert decide([one, two], _addrs(1), asked=2).status == UNKNOWN  # a liar among two: unknown, never wrong
    assert decide([one, _report(D2, True)], _addrs(1), asked=3).status == REACHABLE
    assert decide([two, _report(D1, False)], _addrs(1), asked=3).status == UNREACHABLE
    assert decide([one, one, one], _addrs(1), asked=3).status == UNKNOWN  # one dialer counts once
    # several addresses: reachable if one is; the others are listed only if they are too
    mixed = [_report(d, False, True) for d in (D1, D2, D3)]
    got = decide(mixed, _addrs(2), asked=3)
    assert got.status == REACHABLE and got.reachable == (_addrs(2)[1],)
    assert decide([_report(d, False, False) for d in (D1, D2, D3)], _addrs(2), asked=3).status == UNREACHABLE
    half = [_report(D1, False, True), _report(D2, False, False), _report(D3, False, False)]
    assert decide(half, _addrs(2), asked=3).status == UNREACHABLE
    # a report about other addresses is no evidence
    assert decide([_report(D1, True)], _addrs(2), asked=1).status == UNKNOWN
    # the observed IP: what most agree on
    obs = [_report(D1, True, observed="1.1.1.1"), _report(D2, True, observed="1.1.1.1"),
           _report(D3, True, observed="9.9.9.9")]
    assert decide(obs, _addrs(1), asked=3).observed == "1.1.1.1"
    assert decide(obs[1:], _addrs(1), asked=3).observed is None


def _contact(i: int, host: str) -> Contact:
    return Contact.of(Identity.from_seed(bytes([0x60 + i]) * 32).peer_id, host, 4000 + i)


def test_dialers_are_chosen_from_distinct_networks_and_bootstrap_peers_last():
    same = [_contact(i, "198.51.100.1") for i in range(4)]  # one /24
    spread = [_contact(10, "93.184.216.34"), _contact(11, "192.0.2.1")]
    for seed in range(20):
        got = choose_dialers(same + spread, 3, rng=random.Random(seed))
        assert len(got) == 3 and set(spread) <= set(got)
    boot = [_contact(20, "192.0.2.50"), _contact(21, "100.64.0.1")]
    got = choose_dialers(same[:1] + boot, 3, avoid=[c.peer_id for c in boot], rng=random.Random(1))
    assert got[0] == same[0] and set(got[1:]) == set(boot)  # too few others: bootstrap peers fill in
    got = choose_dialers(same + boot, 3, avoid=[c.peer_id for c in boot], rng=random.Random(1))
    assert not set(got) & set(boot)  # enough others: the bootstrap peers are not asked
    assert choose_dialers([], 3) == [] and len(choose_dialers(same + same, 9)) == 4


def test_dial_target_accepts_only_an_ip_a_tcp_port_and_the_askers_id():
    me = ASKER.peer_id
    assert dial_target(ADDR, me)[1] is None
    assert dial_target(f"/ip6/::1/tcp/1/p2p/{me}", me)[1] is None
    assert dial_target("junk", me) == (None, dialback.NOT_A_MULTIADDR)
    assert dial_target(f"/dns/x.org/tcp/1/p2p/{me}", me) == (None, dialback.DNS_NAME)
    assert dial_target(f"/ip4/1.2.3.4/tcp/1/p2p/{OTHER.peer_id}", me) == (None, dialback.ANOTHER_PEER)


async def test_placement_counts_a_report_only_where_its_signer_answers():
    """join --layers auto's dial (roles.volunteer.dial_report): the report's address must
    complete a TLS handshake bound to the report's signer; the host it answered at is
    what placement groups by. Another peer's certificate there, nobody there, or an
    address that does not parse: not answered."""
    from types import SimpleNamespace

    from meshnet_p2p.roles.volunteer import dial_report
    from meshnet_p2p.swarm.placement import Span

    me, other = Identity.generate(), Identity.generate()

    def span(addrs, relay=None):
        return Span(str(me.peer_id), 0, 10, 10.0, record=SimpleNamespace(content={"addrs": addrs, "relay": relay}))

    with data_plane(me) as port, data_plane(other) as other_port:
        assert await dial_report(span([tcp(me.peer_id, port)])) == "127.0.0.1"
        assert await dial_report(span([tcp(me.peer_id, other_port)])) is None  # another's certificate
        assert await dial_report(span([tcp(me.peer_id, free_port())])) is None
        assert await dial_report(span(["/ip4/127.0.0.1/tcp/nope"])) is None
        # the second address is tried when the first does not answer
        assert await dial_report(span([tcp(me.peer_id, free_port()), tcp(me.peer_id, port)])) == "127.0.0.1"
