"""Property tests of the reachability checks' parsers of network input: the
dial_back and dial_result bodies, the dialer's address check,
the meshnet/dialback/v1 record and what an asker believes of it (dialback.py),
and a running dialer fed any signed dial_back body.

As everywhere (tests/test_fuzz_decoders.py): only the typed error may escape,
what is accepted is well formed, and the node keeps serving. The examples are
a fixed sequence; MESHNET_FUZZ_RANDOM=1 draws fresh ones (conftest.py).
fuzz/atheris_decoders.py explores the same decoders from raw bytes
(targets dial_back and dial_result).
"""

from __future__ import annotations


import msgpack
import trio
import trio.testing
from hypothesis import event, given
from hypothesis import strategies as st

from meshnet_p2p.nat import dialback
from meshnet_p2p.dht import wire
from meshnet_p2p.dht.node import DHTNode, Request
from meshnet_p2p.nat.dialback import (DialbackRejected, dial_target, parse_dial_back, parse_dial_result, sign_dial_result,
                                      valid_content, verify_dial_result)
from meshnet_p2p.nat.dialer import serve_dial_backs
from meshnet_p2p.core.identity import Identity, PeerId
from meshnet_p2p.core.multiaddr import Multiaddr, ip_of
from meshnet_p2p.core.records import DOMAIN as RECORD_DOMAIN
from meshnet_p2p.core.records import canonical, seal
from meshnet_p2p.testing import FakeNetwork

from tests.mutations import mutate_bytes, mutate_tree

NOW = 1_700_000_000_000
ALICE = Identity.from_seed(b"\x71" * 32)  # asks
BOB = Identity.from_seed(b"\x72" * 32)  # dials
STRANGER = Identity.from_seed(b"\x73" * 32)
ASKER_IP = "10.0.0.3"  # the second endpoint of a FakeNetwork
NONCE = b"\x05" * 16


def addr(port: int, host: str = ASKER_IP, peer: PeerId = ALICE.peer_id, proto: str = "tcp") -> str:
    return f"/ip4/{host}/{proto}/{port}/p2p/{peer}"


mp_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                       st.text(max_size=24), st.binary(max_size=48))
mp_values = st.recursive(mp_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=5), st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8)), kids, max_size=4)),
    max_leaves=12)
plausible_addrs = st.sampled_from([
    addr(5000), addr(5001), addr(0), addr(5000, "10.0.0.9"), addr(5000, peer=STRANGER.peer_id), addr(5000, proto="udp"),
    f"/dns4/example.org/tcp/5000/p2p/{ALICE.peer_id}", f"/ip6/::1/tcp/5000/p2p/{ALICE.peer_id}", f"/ip4/{ASKER_IP}/tcp/5000",
    f"/ip4/{ASKER_IP}/tcp/5000/p2p/{STRANGER.peer_id}/p2p-circuit/p2p/{ALICE.peer_id}", "", "/", "x" * 513, f"/ip4/{ASKER_IP}",
    *(f"/ip4/{relay}/tcp/4002/p2p/{STRANGER.peer_id}/p2p-circuit/p2p/{ALICE.peer_id}"  # through a relay: public,
      for relay in ("151.101.1.7", "192.168.1.1", "127.0.0.1")),  # private (as the asker), loopback (not)
    f"/ip4/151.101.1.7/tcp/4002/p2p/{STRANGER.peer_id}/p2p-circuit/p2p/{STRANGER.peer_id}",
])
addr_lists = st.lists(plausible_addrs | st.text(max_size=40), max_size=6)
body_values = st.one_of(mp_values, addr_lists, st.binary(min_size=16, max_size=16), plausible_addrs)
dial_back_bodies = st.dictionaries(st.sampled_from(["addrs", "nonce", "cookie", "client"]) | st.text(max_size=6),
                                   body_values, max_size=5)
# well formed, so that the checks past the shape (refusals, dials) are reached often
dialable = st.sampled_from([addr(5000), addr(5001), addr(5002), addr(5000, "10.0.0.9"),
                            f"/ip6/::1/tcp/5000/p2p/{ALICE.peer_id}"])
well_formed = st.fixed_dictionaries({"addrs": st.lists(plausible_addrs | dialable, min_size=1, max_size=4, unique=True),
                                     "nonce": st.binary(min_size=16, max_size=16)})
to_dial = st.fixed_dictionaries({"addrs": st.lists(dialable, min_size=1, max_size=4, unique=True),
                                 "nonce": st.binary(min_size=16, max_size=16)})


# --- wire bodies ------------------------------------------------------------------------------


@given(dial_back_bodies | well_formed)
def test_dial_back_bodies_parse_to_bounded_values_or_raise_bad_datagram(body):
    try:
        addrs, nonce = parse_dial_back(body)
    except wire.BadDatagram:
        return
    assert 1 <= len(addrs) <= 4 and len(set(addrs)) == len(addrs)
    assert all(isinstance(a, str) and len(a) <= 512 for a in addrs)
    assert isinstance(nonce, bytes) and len(nonce) == 16


@given(st.dictionaries(st.sampled_from(["result", "refused"]) | st.text(max_size=6),
                       st.one_of(mp_values, st.binary(max_size=5000), st.text(max_size=80)), max_size=3))
def test_dial_result_bodies_parse_to_one_bounded_value_or_raise_bad_datagram(body):
    try:
        record, refused = parse_dial_result(body)
    except wire.BadDatagram:
        return
    assert (record is None) != (refused is None)
    assert record is None or (isinstance(record, bytes) and len(record) <= dialback.MAX_RESULT_BYTES)
    assert refused is None or (isinstance(refused, str) and len(refused) <= 64)


@given(plausible_addrs | st.text(max_size=120) | st.text(alphabet="/ip46tcudp0123456789.:abcdefx", max_size=60))
def test_the_dialers_address_check_never_raises_and_what_it_accepts_is_dialable(text):
    target, why = dial_target(text, ALICE.peer_id)
    assert (target is None) != (why is None)
    if target is not None:
        assert target.transport == "tcp" and target.port and target.peer_id == ALICE.peer_id
        assert target.host is not None and ip_of(target.host) is not None


# --- the record --------------------------------------------------------------------------------

RESULTS = [(addr(5000), True, "ok"), (addr(5001), False, "refused")]
VALID = sign_dial_result(BOB, ALICE.peer_id, NONCE, RESULTS, ASKER_IP, now_ms=NOW)
CONTENT = {"subject": str(ALICE.peer_id), "nonce": NONCE, "observed": ASKER_IP,
           "results": [list(r) for r in RESULTS]}


def believe(record: bytes):
    return verify_dial_result(record, dialer=BOB.peer_id, subject=ALICE.peer_id, nonce=NONCE,
                              addrs=[a for a, _, _ in RESULTS], now_ms=NOW)


def test_the_valid_record_here_is_believed():
    assert believe(VALID).results == tuple(RESULTS)


@given(st.data())
def test_damaged_records_are_discarded_or_unchanged(data):
    try:
        got = believe(mutate_bytes(data, VALID))
    except DialbackRejected:
        return
    assert got.results == tuple(RESULTS) and got.dialer == BOB.peer_id


record_values = st.one_of(
    st.sampled_from([str(ALICE.peer_id), str(BOB.peer_id), NONCE, b"\0" * 15, ASKER_IP, "::1", "x", "", True, False,
                     None, 0, -1, 2**64 - 1, 1.5, [], {}, addr(5000), addr(5002), "r" * 65, [addr(5000), True, "ok"]]),
    st.recursive(mp_scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                    st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                 max_leaves=8),
)


@given(st.data(), st.integers(0, 3), st.sampled_from([BOB, BOB, BOB, STRANGER]),
       st.sampled_from([60_000, 60_000, 1, 6 * 60_000]))
def test_re_signed_edits_are_believed_only_if_valid_and_matching(data, edits, signer, ttl):
    """A dialer can sign any content: the validator and the asker's checks refuse
    what is wrong with DialbackRejected, never an exception."""
    content = mutate_tree(data, CONTENT, edits, record_values)
    try:
        payload = canonical(content)  # what sign_record signs
    except TypeError:  # a map with keys that are not str: signed raw, as a hostile dialer would
        payload = msgpack.packb(content, use_bin_type=True)
    record = seal(signer, RECORD_DOMAIN, [dialback.DIALBACK, payload, 1, NOW, NOW + ttl, signer.peer_id.multihash])
    assert isinstance(valid_content(content), (str, type(None)))
    try:
        got = believe(record)
    except DialbackRejected:
        return
    assert signer == BOB and ttl <= dialback.MAX_DIALBACK_LIFETIME_MS and valid_content(content) is None
    assert content["subject"] == str(ALICE.peer_id) and content["nonce"] == NONCE
    assert [r[0] for r in got.results] == [a for a, _, _ in RESULTS]


@given(mp_values)
def test_the_record_validator_never_raises_on_any_content(content):
    assert isinstance(valid_content(content), (str, type(None)))


# --- a running dialer ----------------------------------------------------------------------------


@given(dial_back_bodies | well_formed | to_dial, st.booleans(), st.booleans())
def test_a_dialer_answers_any_signed_dial_back_body_or_drops_it_and_keeps_serving(body, proven, slow):
    """What the receive loop runs for a verified dial_back (BadDatagram, an answer
    now, or a task that answers with a result the asker believes), then the same
    body through the network: the node still answers a ping."""

    async def dial(peer: PeerId, text: str) -> tuple[bool, str]:
        if slow:
            await trio.sleep(10)  # past the dialer's bound: a timeout result
        return True, "ok"

    async def main() -> None:
        net = FakeNetwork()
        node = DHTNode(BOB, net.endpoint(), {}, now_ms=lambda: NOW)
        server = serve_dial_backs(node, dial)
        asker = net.endpoint()
        assert asker.local_addr[0] == ASKER_IP
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            datagram = wire.encode(ALICE, "dial_back", b"abcdefgh", body, NOW, to=BOB.peer_id)
            msg = wire.decode(datagram, NOW, BOB.peer_id)
            try:
                answer = server(Request(msg, asker.local_addr, len(datagram), proven))
            except wire.BadDatagram:
                answer = "dropped"
            event("dropped" if answer == "dropped" else "dials" if answer is None else
                  f"answered now: {answer[0]} {next(iter(answer[1]))}")
            if isinstance(answer, tuple):
                kind, reply = answer
                assert kind in {"cookie", dialback.DIAL_RESULT}
                wire.encode(BOB, kind, msg.rpc_id, reply, NOW, to=ALICE.peer_id)
                if kind == "dial_result" and "result" in reply:
                    addrs, nonce = parse_dial_back(body)
                    got = verify_dial_result(reply["result"], dialer=BOB.peer_id, subject=ALICE.peer_id, nonce=nonce,
                                             addrs=addrs, now_ms=NOW)
                    assert not any(ok for _, ok, _ in got.results)  # nothing was dialled
            elif answer is None:  # a task dials, then answers the asker
                addrs, nonce = parse_dial_back(body)
                with trio.fail_after(30):
                    data, _ = await asker.receive()
                reply = wire.decode(data, NOW, ALICE.peer_id)
                assert reply.kind == "dial_result" and reply.rpc_id == b"abcdefgh"
                record, _ = parse_dial_result(reply.body)
                got = verify_dial_result(record, dialer=BOB.peer_id, subject=ALICE.peer_id, nonce=nonce, addrs=addrs,
                                         now_ms=NOW)
                for text, ok, why in got.results:
                    dialled, reason = dialback.may_dial(Multiaddr.parse(text), ASKER_IP)  # only the asker's IP,
                    if not dialled:  # or a relay outside networks the asker is not in
                        assert (ok, why) == (False, reason)
                    else:
                        assert (ok, why) == ((False, "timeout") if slow else (True, "ok"))
                assert server.dials_in_flight == 0
            # the same body through the receive loop, then a ping: answered
            await asker.send(wire.encode(ALICE, "dial_back", b"ijklmnop", body, NOW, to=BOB.peer_id), node.addr)
            await asker.send(wire.encode(ALICE, "ping", b"qrstuvwx", {}, NOW, to=BOB.peer_id), node.addr)
            with trio.fail_after(30):
                for _ in range(16):  # (a dial_result, a cookie, the node's own ping may come first)
                    data, _ = await asker.receive()
                    got_msg = wire.decode(data, NOW, ALICE.peer_id)
                    if got_msg.kind == "pong" and got_msg.rpc_id == b"qrstuvwx":
                        break
                else:
                    raise AssertionError("no pong")
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
