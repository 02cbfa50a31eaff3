"""The data plane over real sockets: `meshnet-peer serve` processes with real
llama.cpp shards behind them, gRPC with identity-bound TLS, and relays."""

import threading
import time
from functools import partial

import numpy as np
import pytest
import trio
import trio.testing

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.dataplane.stub import ShardClient, ShardConnectionError, ShardError, open_channel
from meshnet_p2p.nat.relay import Relay, RelayLimits
from meshnet_p2p.dataplane.wire import crc32c
from meshnet_p2p.dataplane.transport.tls import TlsBindingError, verify_binding
from meshnet_p2p.engine.contract import HIDDEN, Tensor, TensorBundle
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.route.local import LocalRoute
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.roles.peer_process import PeerProcess
from meshnet_p2p.core.records import wall_ms

from tests.conftest import N_UBATCH


class Served:
    """A `meshnet-peer serve` process and a way to reach it."""

    def __init__(self, shard: str, *extra: str) -> None:
        self.proc = PeerProcess("serve", "--shard", shard, "--threads", "2", "--n-ubatch", str(N_UBATCH),
                                "--n-ctx", "2048", *extra)
        if "--relay" in extra:
            self.proc.wait_line("reachable via ")
        self.addr = Multiaddr.parse(self.proc.address())
        self.peer_id = self.addr.peer_id
        self.binding = bytes.fromhex(self.proc.wait_line("tls-binding ").split()[1])
        self.cert = verify_binding(self.binding, self.peer_id, wall_ms())

    def client(self, **kw) -> ShardClient:
        return ShardClient(open_channel(self.cert, address=(self.addr.host, self.addr.port)), **kw)

    def stop(self) -> int:
        return self.proc.stop()


@pytest.fixture(scope="module")
def middle(shard_dir):
    s = Served(shard_dir[(10, 20)], "--max-sessions", "3", "--max-message-bytes", str(1 << 20))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def whole(model_path):
    s = Served(model_path, "--max-sessions", "2")
    yield s
    assert s.stop() == 0


def hidden(rows: int, seed: int = 0) -> TensorBundle:
    data = (np.random.default_rng(seed).standard_normal((rows, 576)) * 0.1).astype(np.float32).tobytes()
    return TensorBundle((Tensor(HIDDEN, "f32", (rows, 576), data),))


def raw_step(stream, **fields) -> pb.SessionResponse:
    return stream.request(pb.SessionRequest(step=pb.Step(**fields)))


# --- the happy path, and identity -------------------------------------------------------------


def test_capability_and_a_step_through_a_real_shard(middle):
    c = middle.client()
    cap = c.capability()
    assert (cap.layers.start, cap.layers.end, cap.layers.total) == (10, 20, 30)
    assert cap.peer_id == str(middle.peer_id) and cap.seam_dtype == "f32"
    assert c.health().serving
    with c.session(cap.fingerprint, max_tokens=64) as s:
        r = s.step(0, hidden=hidden(5))
        assert r.position == 5 and r.hidden.tensors[0].shape == (5, 576)
        s.release()
    c.close()


def test_a_peer_attests_what_a_session_computed(middle):
    from meshnet_p2p.trust.attestation import SEAM_DOMAIN, Attestation, RowDigest

    c = middle.client()
    fp = c.capability().fingerprint
    try:
        with c.session(fp, max_tokens=64) as s:
            mine_in, mine_out = RowDigest(SEAM_DOMAIN), RowDigest(SEAM_DOMAIN)
            for position, rows in [(0, 5), (5, 1)]:
                given = hidden(rows, seed=position)
                r = s.step(position, hidden=given, decode=rows == 1)
                mine_in.hidden(position, given)
                mine_out.hidden(position, r.hidden)
            m = s.attest()
            a = Attestation(m.peer_id, m.session_id, m.model_digest, m.recipe_digest, m.start, m.end, m.steps,
                            m.input_digest, m.output_digest, m.signature)
            assert a.verifies() and a.peer_id == str(middle.peer_id) and a.session_id == s.session_id
            assert (a.start, a.end, a.steps, a.recipe_digest) == (10, 20, 2, fp.recipe_digest)
            assert (a.input_digest, a.output_digest) == (mine_in.hexdigest(), mine_out.hexdigest())
            s.step(6, hidden=hidden(1), decode=True)  # the digests go on with the session
            assert s.attest().output_digest != a.output_digest
            s.release()
    finally:
        c.close()


def test_a_client_pinned_to_another_identity_is_refused(middle, tmp_path):
    from meshnet_p2p.dataplane.transport.tls import make_tls_credentials

    stranger = make_tls_credentials()
    c = ShardClient(open_channel(stranger.cert_pem, address=(middle.addr.host, middle.addr.port)), timeout=10)
    with pytest.raises(ShardConnectionError):
        c.capability()
    c.close()
    with pytest.raises(TlsBindingError):  # a binding counts only from the peer it names
        verify_binding(middle.binding, Identity.generate().peer_id, wall_ms())


# --- every negative path fails closed ------------------------------------------------------------


def test_fingerprint_mismatch_names_every_axis(middle):
    c = middle.client()
    fp = pb.Fingerprint()
    fp.CopyFrom(c.capability().fingerprint)
    fp.recipe_digest = "0" * 64
    fp.recipe_axes["seam_dtype"] = "f16"
    fp.recipe_axes["n_ubatch"] = "512"
    with pytest.raises(ShardError) as e:
        c.session(fp, max_tokens=16)
    assert e.value.code_name == "FINGERPRINT_MISMATCH"
    assert any("seam_dtype" in m for m in e.value.mismatches) and any("n_ubatch" in m for m in e.value.mismatches)
    c.close()


def test_stale_epoch_expired_deadline_and_bad_payloads(middle):
    c = middle.client()
    fp = c.capability().fingerprint
    with c.session(fp, max_tokens=64, route_epoch=5) as s:
        with pytest.raises(ShardError, match="EPOCH_STALE"):
            raw_step(s, work_id="a", idempotency_step=1, route_epoch=4, position=0)
        with pytest.raises(ShardError, match="DEADLINE_EXCEEDED"):
            s.step(0, hidden=hidden(1), deadline_ms=wall_ms() - 1000)
        good = hidden(2).tensors[0].data
        gap = pb.TensorData(name=HIDDEN, dtype="f32", shape=[2, 576], total_bytes=len(good), crc32c=crc32c(good),
                            fragments=[pb.Fragment(byte_offset=0, payload=good[:100]), pb.Fragment(byte_offset=200, payload=good[200:])])
        with pytest.raises(ShardError, match="PAYLOAD_CORRUPT.*tile"):
            raw_step(s, work_id="b", idempotency_step=10, route_epoch=5, position=0, hidden=pb.TensorBundle(tensors=[gap]))
        overlap = pb.TensorData(name=HIDDEN, dtype="f32", shape=[2, 576], total_bytes=len(good), crc32c=crc32c(good),
                                fragments=[pb.Fragment(byte_offset=0, payload=good[:300]), pb.Fragment(byte_offset=200, payload=good[200:])])
        with pytest.raises(ShardError, match="PAYLOAD_CORRUPT"):
            raw_step(s, work_id="c", idempotency_step=11, route_epoch=5, position=0, hidden=pb.TensorBundle(tensors=[overlap]))
        bad_crc = pb.TensorData(name=HIDDEN, dtype="f32", shape=[2, 576], total_bytes=len(good), crc32c=crc32c(good) ^ 1,
                                fragments=[pb.Fragment(byte_offset=0, payload=good)])
        with pytest.raises(ShardError, match="PAYLOAD_CORRUPT.*CRC32C"):
            raw_step(s, work_id="d", idempotency_step=12, route_epoch=5, position=0, hidden=pb.TensorBundle(tensors=[bad_crc]))
        # malformed steps: refused before they count, so their idempotency step stays free
        with pytest.raises(ShardError, match="INVALID_ARGUMENT.*exactly one token"):
            raw_step(s, work_id="e", idempotency_step=13, route_epoch=5, position=0, decode=True, token_ids=[1, 2])
        with pytest.raises(ShardError, match="INVALID_ARGUMENT"):
            raw_step(s, work_id="f", idempotency_step=13, route_epoch=5, position=0)  # no input at all
        # none of that touched the session: it still starts at position 0
        assert s.step(0, hidden=hidden(2), idempotency_step=13).position == 2
    c.close()


def test_exhausted_credit_fails_closed_until_topped_up(middle):
    c = middle.client()
    fp = c.capability().fingerprint
    with c.session(fp, max_tokens=64, credits=2) as s:
        from meshnet_p2p.dataplane.wire import bundle_to_proto

        def step(n, pos):
            return raw_step(s, work_id=f"w{n}", idempotency_step=n, position=pos, hidden=bundle_to_proto(hidden(1, n)))

        step(1, 0)
        step(2, 1)
        with pytest.raises(ShardError) as e:
            step(3, 2)
        assert e.value.code_name == "FLOW_CONTROL" and e.value.retryable
        assert (e.value.work_id, e.value.idempotency_step) == ("w3", 3)  # which step was refused
        s.send(pb.SessionRequest(credit=pb.CreditTopUp(credits=2)))
        assert step(3, 2).result.position == 3
    c.close()


def test_duplicate_step_is_acknowledged_not_applied_twice(middle):
    c = middle.client()
    with c.session(c.capability().fingerprint, max_tokens=64) as s:
        first = s.step(0, hidden=hidden(3), idempotency_step=1)
        again = s.step(0, hidden=hidden(3), idempotency_step=1)
        assert first.position == 3
        assert again.raw.WhichOneof("kind") == "ack" and again.raw.ack.duplicate
        assert s.step(3, hidden=hidden(1), decode=True, idempotency_step=2).position == 4  # applied once: still at 3
    c.close()


def test_oversized_messages_and_prefills_are_refused(middle):
    c = middle.client()
    with c.session(c.capability().fingerprint, max_tokens=2048) as s:
        with pytest.raises(ShardError, match="OVERSIZED"):
            s.step(0, hidden=hidden(500))  # 1.15 MB > the 1 MB limit this peer was started with
        assert s.step(0, hidden=hidden(4)).position == 4
    c.close()


def test_sessions_beyond_capacity_are_refused_and_released_ones_reusable(middle):
    c = middle.client()
    fp = c.capability().fingerprint
    streams = [c.session(fp, max_tokens=16) for _ in range(3)]
    with pytest.raises(ShardError) as e:
        c.session(fp, max_tokens=16)
    assert e.value.code_name == "CAPACITY"
    streams[0].release()
    streams.append(c.session(fp, max_tokens=16))
    # a client that vanishes without releasing frees its session too. Its reset reaches
    # the peer in its own time; the engine's count drops only once admission has let the
    # session go. (Not free_sessions: it counts what a newcomer could reclaim from this
    # client, so it is 1 before the peer has seen the reset.)
    streams[1].close()
    deadline = time.monotonic() + 30
    while c.health().active_sessions > 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # another process's state: nothing to wait on but its answers
    fourth = c.session(fp, max_tokens=16)
    for s in streams[2:] + [fourth]:
        s.release()
    assert c.capability().free_sessions == 3
    c.close()


def test_cancels_in_band_and_out_of_band(middle):
    c = middle.client()
    fp = c.capability().fingerprint
    # a work item cancelled in-band: its later steps fail closed, the session goes on
    with c.session(fp, max_tokens=64) as s:
        s.send(pb.SessionRequest(cancel=pb.CancelSignal(work_id="job-1")))
        with pytest.raises(ShardError, match="CANCELLED"):
            s.receive()
        with pytest.raises(ShardError, match="CANCELLED"):
            s.step(0, hidden=hidden(1), work_id="job-1")
        assert s.step(0, hidden=hidden(1), work_id="job-2").position == 1
        # the whole session, in-band: terminal
        s.cancel()
        with pytest.raises(ShardError) as e:
            s.receive()
        assert e.value.terminal
    # out of band, before the session even opens
    assert c.cancel("early-session")
    with pytest.raises(ShardError, match="CANCELLED"):
        c.session(fp, max_tokens=16, session_id="early-session")
    # out of band, for an open session
    s = c.session(fp, max_tokens=64, session_id="late")
    assert c.cancel("late")
    with pytest.raises(ShardError, match="CANCELLED"):
        s.step(0, hidden=hidden(1))
    s.close()
    # the unary Release frees a session; its stream then fails closed
    s = c.session(fp, max_tokens=64, session_id="released")
    assert s.step(0, hidden=hidden(1)).position == 1
    assert c.release("released")
    assert not c.release("released")
    with pytest.raises(ShardError, match="UNKNOWN_SESSION"):
        s.step(1, hidden=hidden(1))
    s.close()
    c.close()


def test_a_stranger_cannot_cancel_or_release_another_clients_session(middle):
    owner, stranger = middle.client(), middle.client()  # two connections, as two clients have
    fp = owner.capability().fingerprint
    try:
        s = owner.session(fp, max_tokens=64, session_id="mine")
        assert s.step(0, hidden=hidden(1)).position == 1
        assert not stranger.cancel("mine") and not stranger.release("mine")
        assert s.step(1, hidden=hidden(1), decode=True).position == 2  # untouched
        # a stranger's cancel sent before the session opens does not doom it either
        assert stranger.cancel("not-yet")
        t = owner.session(fp, max_tokens=16, session_id="not-yet")
        assert t.step(0, hidden=hidden(1)).position == 1
        t.release()
        assert owner.release("mine")
        s.close()
    finally:
        owner.close()
        stranger.close()


def test_cancel_mid_prefill_spares_a_concurrent_session(whole, model_path, model_digest, load_engine):
    tok = Tokenizer(model_path)
    prompt = tok.encode("Three things every gardener should know:")
    reference = LocalRoute([load_engine(model_path, source_sha256=model_digest)]).generate(prompt, 8, stop_at_eog=False).token_ids
    c = whole.client()
    fp = c.capability().fingerprint
    victim = c.session(fp, max_tokens=2048, session_id="victim")
    survivor = c.session(fp, max_tokens=64, session_id="survivor")
    long_prompt = (prompt * 200)[:1800]
    outcome = {}

    def run_victim():
        try:
            victim.step(0, token_ids=long_prompt)
            outcome["victim"] = "finished"
        except ShardError as e:
            outcome["victim"] = e.code_name

    t = threading.Thread(target=run_victim)
    t.start()
    # wait until the prefill is running on the peer (its session holds the engine), then cancel it
    for _ in range(500):
        if c.health().active_sessions == 2:
            break
        time.sleep(0.005)
    time.sleep(0.05)
    assert c.cancel("victim")
    t.join(timeout=60)
    assert outcome["victim"] == "CANCELLED"
    out = [survivor.step(0, token_ids=prompt).token_id]
    for i in range(7):
        out.append(survivor.step(len(prompt) + i, token_ids=[out[-1]], decode=True).token_id)
    assert out == reference
    survivor.release()
    victim.close()
    c.close()


# --- relays ------------------------------------------------------------------------------------


@pytest.fixture
async def relay():
    r = Relay(Identity.generate(), RelayLimits(max_connections_per_peer=2))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(r.serve, "127.0.0.1", 0)
        r.multiaddr = Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{port}/p2p/{r.identity.peer_id}")
        yield r
        nursery.cancel_scope.cancel()


def run_session(client: ShardClient, fp, prompt, sid: str) -> list[bytes]:
    s = client.session(fp, max_tokens=64, session_id=sid, record=True)
    out = [s.step(0, token_ids=prompt).token_id]
    for i in range(5):
        out.append(s.step(len(prompt) + i, token_ids=[out[-1]], decode=True).token_id)
    s.release()
    return s.responses


async def test_relay_is_byte_identical_to_direct_and_detects_tampering(relay, model_path):
    served = await trio.to_thread.run_sync(lambda: Served(model_path, "--relay", str(relay.multiaddr)))
    try:
        prompt = Tokenizer(model_path).encode("The moon is")
        direct = served.client()
        via = ShardClient(open_channel(served.cert, relay=("127.0.0.1", relay.multiaddr.port), peer_id=served.peer_id), timeout=20)
        fp = await trio.to_thread.run_sync(lambda: direct.capability().fingerprint)
        a = await trio.to_thread.run_sync(run_session, direct, fp, prompt, "same-session")
        b = await trio.to_thread.run_sync(run_session, via, fp, prompt, "same-session")
        assert a == b and len(a) == 8  # accepted, 6 results, released: byte for byte
        assert relay.stats["spliced"] >= 1  # it really went through the relay
        via.close()

        # a dishonest relay flips one byte of what the peer sends, once the TLS
        # handshake and HTTP/2 settings have passed (its first three chunks): the client notices
        seen = {"chunks": 0, "flipped": 0}

        def flip(data: bytes, direction: str) -> bytes:
            if direction == "b->a":
                seen["chunks"] += 1
                if seen["chunks"] > 3:
                    seen["flipped"] += 1
                    return data[:-1] + bytes([data[-1] ^ 1])
            return data

        relay.transform = flip
        tampered = ShardClient(open_channel(served.cert, relay=("127.0.0.1", relay.multiaddr.port), peer_id=served.peer_id), timeout=20)
        with pytest.raises(ShardConnectionError, match="TLS"):
            await trio.to_thread.run_sync(run_session, tampered, fp, prompt, "tampered")
        assert seen["flipped"] >= 1
        tampered.close()
        relay.transform = None
        direct.close()
    finally:
        assert await trio.to_thread.run_sync(served.stop) == 0
    # the peer went away: its reservation went with it
    with trio.fail_after(10):
        while relay.reservations:
            await trio.sleep(0.01)


async def test_relay_refuses_unknown_peers_and_unproven_identities(relay):
    from meshnet_p2p.nat.relay import RelayError, reserve

    stranger = Identity.generate()
    # nobody reserved: a CONNECT for them is refused
    stream = await trio.open_tcp_stream("127.0.0.1", relay.multiaddr.port)
    target = f"{str(stranger.peer_id).lower()}.peer:443"
    await stream.send_all(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    assert (await stream.receive_some(100)).startswith(b"HTTP/1.1 404")
    await stream.aclose()
    # claiming an identity without its key
    stream = await trio.open_tcp_stream("127.0.0.1", relay.multiaddr.port)
    await stream.send_all(f"MESHNET-RESERVE {stranger.peer_id} {'00' * 32}\n".encode())
    assert (await stream.receive_some(1000)).startswith(b"CHALLENGE")
    await stream.send_all(b"SIG " + b"00" * 64 + b"\n")
    assert (await stream.receive_some(100)).startswith(b"ERR")
    await stream.aclose()
    assert not relay.reservations
    # a relay address naming another relay identity is refused by the peer
    wrong = Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{relay.multiaddr.port}/p2p/{Identity.generate().peer_id}")
    with pytest.raises(RelayError, match="is not"):
        await reserve(wrong, stranger)


async def test_server_shutdown_from_trio_leaves_no_thread_or_session(shard_dir, load_engine):
    from meshnet_p2p.dataplane.transport.server import Server
    from meshnet_p2p.dataplane.servicer import ShardRuntimeServicer
    from meshnet_p2p.dataplane.transport.tls import make_tls_credentials

    engine = load_engine(shard_dir[(10, 20)])
    before = {t.name for t in threading.enumerate()}
    creds = make_tls_credentials()
    server = ShardRuntimeServicer(engine).register(Server(creds))
    client = ShardClient(open_channel(creds.cert_pem, address=("127.0.0.1", server.port)))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        fp = await trio.to_thread.run_sync(lambda: client.capability().fingerprint)
        stream = await trio.to_thread.run_sync(lambda: client.session(fp, max_tokens=32))
        await trio.to_thread.run_sync(lambda: stream.step(0, hidden=hidden(2)))
        assert engine.metrics().active_sessions == 1
        nursery.cancel_scope.cancel()  # shut the server down with a session still open
    assert engine.metrics().active_sessions == 0
    leftover = {t.name for t in threading.enumerate() if t.name.startswith("shard-")} - before
    assert not leftover
    stream.close()
    client.close()


async def test_relay_limits_connections_per_peer_and_splices_bytes(relay):
    from meshnet_p2p.nat.relay import attach_to_relay

    async def echo(stream):
        async for data in stream:
            await stream.send_all(data)

    peer = Identity.generate()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
        local_port = listeners[0].socket.getsockname()[1]
        await nursery.start(attach_to_relay, relay.multiaddr, peer, ("127.0.0.1", local_port))
        target = f"CONNECT {str(peer.peer_id).lower()}.peer:443 HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        conns = []
        for _ in range(2):  # the fixture allows two per peer
            s = await trio.open_tcp_stream("127.0.0.1", relay.multiaddr.port)
            await s.send_all(target)
            assert (await s.receive_some(100)).startswith(b"HTTP/1.1 200")
            conns.append(s)
        await conns[0].send_all(b"ping through the splice")
        got = b""
        while len(got) < 23:
            got += await conns[0].receive_some(100)
        assert got == b"ping through the splice"
        third = await trio.open_tcp_stream("127.0.0.1", relay.multiaddr.port)
        await third.send_all(target)
        assert (await third.receive_some(100)).startswith(b"HTTP/1.1 429")
        await third.aclose()
        # a closed client frees its slot
        await conns.pop().aclose()
        with trio.fail_after(10):
            while relay.reservations[str(peer.peer_id).lower()].connections >= 2:
                await trio.sleep(0.01)
        s = await trio.open_tcp_stream("127.0.0.1", relay.multiaddr.port)
        await s.send_all(target)
        assert (await s.receive_some(100)).startswith(b"HTTP/1.1 200")
        for c in conns + [s]:
            await c.aclose()
        nursery.cancel_scope.cancel()


def test_relay_bandwidth_bucket_bounds_bytes_per_second():
    from meshnet_p2p.core.ratelimit import TokenBucket
    from meshnet_p2p.nat.relay import _take

    async def main():
        bucket = TokenBucket(burst=500.0, rate=1000.0, now=trio.current_time())
        start = trio.current_time()
        for _ in range(10):
            await _take(bucket, 250)  # 2,500 bytes: 500 of burst, then 2,000 at 1,000/s
        return trio.current_time() - start

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert 1.9 <= elapsed <= 2.1


def test_a_certificate_names_its_owner_and_cannot_be_claimed_by_another(middle):
    from meshnet_p2p.dataplane.transport.tls import TlsCredentials, cert_identity, make_tls_credentials, sign_binding

    assert cert_identity(middle.cert) == middle.peer_id
    mallory = Identity.generate()
    # Mallory copies the middle peer's (public) certificate into a binding she signs
    stolen = TlsCredentials(b"", middle.cert)
    with pytest.raises(TlsBindingError, match="belongs to"):
        verify_binding(sign_binding(mallory, stolen, now_ms=wall_ms()), mallory.peer_id, wall_ms())
    with pytest.raises(TlsBindingError, match="no peer identity"):
        cert_identity(make_tls_credentials().cert_pem)  # a certificate without the extension
    # an identity extension whose signature covers another key
    other = make_tls_credentials(mallory)
    assert cert_identity(other.cert_pem) == mallory.peer_id


def test_rollback_rewinds_the_cache_and_fails_closed_on_a_stale_route(middle):
    c = middle.client()
    fp = c.capability().fingerprint
    with pytest.raises(ShardError, match="INVALID_ARGUMENT.*max_tokens"):  # zero KV positions is refused, not rounded up
        c.session(fp, max_tokens=0)
    with c.session(fp, max_tokens=64, route_epoch=1) as s:
        first = s.step(0, hidden=hidden(3)).hidden.tensors[0].data
        assert s.request(pb.SessionRequest(rollback=pb.RollbackSignal(position=1, route_epoch=1))).WhichOneof("kind") == "ack"
        # positions 1 and 2 replayed: the same rows come out as the first time
        again = s.step(1, hidden=TensorBundle((Tensor(HIDDEN, "f32", (2, 576), hidden(3).tensors[0].data[2304:]),)))
        assert again.position == 3 and again.hidden.tensors[0].data == first[2304:]
        with pytest.raises(ShardError, match="POSITION_MISMATCH"):  # beyond what the cache holds
            s.request(pb.SessionRequest(rollback=pb.RollbackSignal(position=9, route_epoch=1)))
        with pytest.raises(ShardError, match="EPOCH_STALE.*rollback refused"):  # from a route already replaced
            s.request(pb.SessionRequest(rollback=pb.RollbackSignal(position=0, route_epoch=0)))
        assert s.step(3, hidden=hidden(1)).position == 4  # the refused rollback changed nothing
    c.close()


def test_a_peer_full_of_idle_sessions_frees_them(shard_dir):
    """Issue 11 #1: sessions opened and never stepped no longer hold a peer full."""
    served = Served(shard_dir[(10, 20)], "--max-sessions", "1", "--idle-timeout", "0.5")
    c = served.client(timeout=10)
    try:
        fp = c.capability().fingerprint
        idle = c.session(fp, max_tokens=16)  # the only session, never stepped
        with pytest.raises(ShardError, match="CAPACITY"):
            c.session(fp, max_tokens=16)
        deadline = time.monotonic() + 20
        while c.health().active_sessions and time.monotonic() < deadline:
            time.sleep(0.05)  # the peer's reaper runs every 0.125 s here
        with c.session(fp, max_tokens=16) as s:
            assert s.step(0, hidden=hidden(1)).position == 1
            s.release()
        with pytest.raises(ShardError, match="idle"):
            idle.step(0, hidden=hidden(1))
        idle.close()
    finally:
        c.close()
        assert served.stop() == 0
