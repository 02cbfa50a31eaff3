"""Our gRPC server (dataplane/transport/server.py) on real sockets: grpcio's own client
speaks to it (the wire is plain gRPC), and clients that misbehave lose their
own connection while the server keeps serving everyone else."""

from __future__ import annotations

import os
import random
import socket
import ssl
import threading
import time

import grpc
import numpy as np
import pytest

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p._proto import shard_runtime_pb2_grpc as pb_grpc
from meshnet_p2p.dataplane.transport import grpc_core as h2
from meshnet_p2p.dataplane.transport.channel import ChannelError
from meshnet_p2p.dataplane.stub import ShardClient, open_channel
from meshnet_p2p.dataplane.transport.server import UNARY, Method, Server
from meshnet_p2p.dataplane.servicer import ShardRuntimeServicer
from meshnet_p2p.dataplane.wire import bundle_to_proto
from meshnet_p2p.dataplane.transport.tls import TLS_NAME, make_tls_credentials
from meshnet_p2p.engine.contract import HIDDEN, Tensor, TensorBundle

from tests.h2frames import PREFACE, SETTINGS, frame


@pytest.fixture
def server(shard_dir, load_engine):
    engine = load_engine(shard_dir[(10, 20)])
    creds = make_tls_credentials()
    srv = ShardRuntimeServicer(engine).register(Server(creds, handshake_timeout=1.0)).start()
    yield srv, creds, engine
    srv.stop(0)


def _hidden(rows: int) -> pb.TensorBundle:
    data = (np.random.default_rng(rows).standard_normal((rows, 576)) * 0.1).astype(np.float32).tobytes()
    return bundle_to_proto(TensorBundle((Tensor(HIDDEN, "f32", (rows, 576), data),)))


_ONE_ROW = TensorBundle((Tensor(HIDDEN, "f32", (1, 576), bytes(2304)),))  # one zero hidden row


def _ours(creds, srv) -> ShardClient:
    return ShardClient(open_channel(creds.cert_pem, address=("127.0.0.1", srv.port)), timeout=20)


def test_grpcios_own_client_is_served(server):
    srv, creds, engine = server
    channel = grpc.secure_channel(f"127.0.0.1:{srv.port}", grpc.ssl_channel_credentials(root_certificates=creds.cert_pem),
                                  options=[("grpc.ssl_target_name_override", TLS_NAME)])
    stub = pb_grpc.ShardRuntimeStub(channel)
    cap = stub.GetCapability(pb.CapabilityRequest(), timeout=20)
    assert (cap.layers.start, cap.layers.end) == (10, 20)

    def requests():
        yield pb.SessionRequest(open=pb.SessionOpen(session_id="interop", fingerprint=cap.fingerprint, max_tokens=32,
                                                    proposed=pb.FlowControl(credits=8)))
        for pos, rows in ((0, 3), (3, 1)):
            yield pb.SessionRequest(step=pb.Step(work_id=f"w{pos}", idempotency_step=pos + 1, position=pos, hidden=_hidden(rows)))
        yield pb.SessionRequest(release=pb.ReleaseSignal())

    kinds = [(r.WhichOneof("kind"), r.result.position) for r in stub.Session(requests(), timeout=60)]
    assert kinds == [("accepted", 0), ("result", 3), ("result", 4), ("released", 0)]
    with pytest.raises(grpc.RpcError) as e:  # unknown methods get UNIMPLEMENTED, as from any gRPC server
        channel.unary_unary("/meshnet.shard.v1.ShardRuntime/Nope")(b"", timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    channel.close()
    assert engine.metrics().active_sessions == 0


def _h2_tls_context(creds) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=creds.cert_pem.decode())
    ctx.set_alpn_protocols(["h2"])
    return ctx


def _tls_socket(creds, port: int) -> ssl.SSLSocket:
    return _h2_tls_context(creds).wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname=TLS_NAME)


def _closed_by_server(sock, timeout: float = 10) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def test_misbehaving_clients_lose_only_their_own_connection(server):
    srv, creds, engine = server
    good = _ours(creds, srv)
    fp = good.capability().fingerprint
    s = good.session(fp, max_tokens=64)
    assert s.step(0, hidden=_ONE_ROW).position == 1

    # garbage after TLS: not HTTP/2
    bad = _tls_socket(creds, srv.port)
    bad.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _closed_by_server(bad)
    # a malformed frame after a good preface: GOAWAY, then the connection ends
    bad = _tls_socket(creds, srv.port)
    bad.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x03\x04\x00\x00\x00\x00\x00abc")
    assert _closed_by_server(bad)
    # plaintext where TLS belongs
    raw = socket.create_connection(("127.0.0.1", srv.port))
    raw.sendall(b"\x16\x03\x01\x00\x05hello" + os.urandom(100))
    assert _closed_by_server(raw)
    # a client that connects and never says anything is dropped after the handshake timeout
    idle = socket.create_connection(("127.0.0.1", srv.port))
    t0 = time.monotonic()
    assert _closed_by_server(idle) and time.monotonic() - t0 < 8

    # the good session never noticed
    assert s.step(1, hidden=_ONE_ROW).position == 2
    s.release()
    good.close()
    for sock in (bad, raw, idle):
        sock.close()


def test_connections_come_and_go_without_leaking_threads_or_descriptors(server):
    srv, creds, engine = server
    _ours(creds, srv).capability()  # warm up the pool
    fds_before = len(os.listdir("/proc/self/fd"))
    threads_before = threading.active_count()
    for _ in range(20):
        c = _ours(creds, srv)
        fp = c.capability().fingerprint
        s = c.session(fp, max_tokens=8)
        c.close()  # vanish mid-session: the server must release it
        del s
    assert srv.wait_no_connections(30)  # the server noticed all twenty
    assert engine.metrics().active_sessions == 0
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2
    assert threading.active_count() <= threads_before + 2


def test_calls_per_connection_are_bounded_and_silent_calls_are_ended(server, monkeypatch):
    from meshnet_p2p.dataplane.transport import server as server_module

    srv, creds, engine = server
    monkeypatch.setattr(server_module, "FIRST_MESSAGE_TIMEOUT", 0.5)
    ch = open_channel(creds.cert_pem, address=("127.0.0.1", srv.port))
    silent = [ch.stream("/meshnet.shard.v1.ShardRuntime/Session") for _ in range(server_module.MAX_CALLS)]
    extra = ch.stream("/meshnet.shard.v1.ShardRuntime/Session")
    with pytest.raises(ChannelError) as e:
        extra.recv(deadline=time.monotonic() + 10)
    assert e.value.code == "UNAVAILABLE" and e.value.refused  # REFUSED_STREAM: never processed, safe to retry
    t0 = time.monotonic()
    for call in silent:  # none sent a SessionOpen: each is ended, freeing its worker
        with pytest.raises(ChannelError):
            call.recv(deadline=time.monotonic() + 10)
    assert time.monotonic() - t0 < 8
    c = ShardClient(ch, timeout=10)
    assert c.capability().layers.start == 10  # and the connection serves on
    c.close()


def test_refused_calls_return_their_window(server):
    """Bytes sent on calls the server refuses are credited back, or the
    connection would stall after one window's worth. Each call here (HEADERS and
    its whole request) goes in one TLS record, so the server reads both at once."""
    srv, creds, engine = server
    sock = _tls_socket(creds, srv.port)
    sock.settimeout(10)
    c = h2.client(authority=TLS_NAME)
    c.initiate()
    sock.sendall(c.data_to_send())

    def drain(block: bool) -> None:
        sock.setblocking(block)
        try:
            while True:
                data = sock.recv(1 << 18)
                if not data:
                    raise AssertionError("the server hung up")
                c.receive_data(data)
                sock.sendall(c.data_to_send())
                if block:
                    return
        except (BlockingIOError, ssl.SSLWantReadError):
            pass
        finally:
            sock.settimeout(10)

    drain(True)  # the server's SETTINGS and its connection window
    body = bytes(16000)
    for _ in range(h2.CONNECTION_WINDOW // len(body) + 200):  # more than the connection's window in all
        for _ in range(100):  # h2 keeps to the server's stream limit: wait for answers to free one
            try:
                sid = c.open_stream("/meshnet.shard.v1.ShardRuntime/NoSuchMethod")
                break
            except h2.H2StreamClosed:
                drain(True)
        c.send_message(sid, body, end_stream=True)
        assert not c.pending(sid), "the server stopped crediting: refused calls leaked its window"
        sock.sendall(c.data_to_send())
        drain(False)
    sock.close()


def test_silent_unary_calls_hold_no_worker_and_end_with_their_connection(server):
    """Unary calls that never send their request take no worker (another
    client's Health answers at once), are capped per connection (refused, not
    queued), and do not outlive their connection (its thread and descriptors
    go, and stop() does not wait on them)."""
    srv, creds, engine = server
    ch = open_channel(creds.cert_pem, address=("127.0.0.1", srv.port))
    silent = [ch.stream("/meshnet.shard.v1.ShardRuntime/Health") for _ in range(4)]
    other = _ours(creds, srv)
    t0 = time.monotonic()
    assert other.health().serving and time.monotonic() - t0 < 3
    fifth = ch.stream("/meshnet.shard.v1.ShardRuntime/Health")
    with pytest.raises(ChannelError) as e:  # a fifth waiting one on that connection is refused at once
        fifth.recv(deadline=time.monotonic() + 5)
    assert e.value.code == "UNAVAILABLE" and e.value.refused and time.monotonic() - t0 < 5
    # a call whose request comes is no silent one: served on that connection still
    assert pb.HealthReport.FromString(
        ch.unary("/meshnet.shard.v1.ShardRuntime/Health", pb.HealthRequest().SerializeToString(), timeout=5)).serving
    assert len(silent) == 4
    ch.close()  # the connection goes with its four silent calls
    other.close()
    assert srv.wait_no_connections(10)


def test_sessions_beyond_the_workers_are_refused_not_queued(shard_dir, load_engine):
    engine = load_engine(shard_dir[(10, 20)])
    creds = make_tls_credentials()
    srv = ShardRuntimeServicer(engine).register(Server(creds, max_workers=2)).start()
    try:
        ch = open_channel(creds.cert_pem, address=("127.0.0.1", srv.port))
        client = ShardClient(ch, timeout=20)
        fp = client.capability().fingerprint
        held = [client.session(fp, max_tokens=8, timeout=None) for _ in range(2)]  # each opened: holds a worker
        third = ch.stream("/meshnet.shard.v1.ShardRuntime/Session")
        silent = ch.stream("/meshnet.shard.v1.ShardRuntime/Session")  # no SessionOpen yet: holds no worker
        t0 = time.monotonic()
        third.send(pb.SessionRequest(open=pb.SessionOpen(session_id="third", fingerprint=fp, max_tokens=8))
                   .SerializeToString())
        with pytest.raises(ChannelError) as e:
            third.recv(deadline=time.monotonic() + 5)
        assert e.value.code == "UNAVAILABLE" and time.monotonic() - t0 < 3  # refused, so the client can go elsewhere
        for stream in held:
            stream.close()
        silent.cancel()
        ch.close()
    finally:
        srv.stop(0)


def test_sessions_sharing_a_connection_each_get_their_own_requests(server):
    """Whichever waiting handler reads a request hands it to the session it is
    for: steps on several sessions of one connection, in any order, all answer."""
    srv, creds, engine = server
    c = _ours(creds, srv)
    fp = c.capability().fingerprint
    sessions = [c.session(fp, max_tokens=64) for _ in range(3)]
    positions = [0, 0, 0]
    rng = random.Random(5)
    for _ in range(40):
        k = rng.randrange(3)
        reply = sessions[k].step(positions[k], hidden=_ONE_ROW, timeout=10)
        positions[k] += 1
        assert reply.position == positions[k]
    for s in sessions:
        s.release()
    c.close()


def test_a_call_sent_with_the_handshakes_last_message_is_answered(server):
    """Bytes that arrive in the same read as the end of the TLS handshake (here
    the preface, SETTINGS and a whole Health call) are handled at once, not left
    waiting for the client to write again."""
    srv, creds, engine = server
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = _h2_tls_context(creds).wrap_bio(incoming, outgoing, server_hostname=TLS_NAME)
    raw = socket.create_connection(("127.0.0.1", srv.port))
    raw.settimeout(5)  # a hang fails the test as a timeout
    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            if outgoing.pending:
                raw.sendall(outgoing.read())
            incoming.write(raw.recv(65536))
    c = h2.client(authority=TLS_NAME)
    c.initiate()
    sid = c.open_stream("/meshnet.shard.v1.ShardRuntime/Health")
    c.send_message(sid, pb.HealthRequest().SerializeToString(), end_stream=True)
    tls.write(c.data_to_send())
    raw.sendall(outgoing.read())  # Finished and the whole call in one write; nothing more is sent
    replies = []
    while not replies:
        incoming.write(raw.recv(65536))
        try:
            while True:
                replies += [e for e in c.receive_data(tls.read(65536)) if isinstance(e, h2.Message)]
        except ssl.SSLWantReadError:
            pass
    assert pb.HealthReport.FromString(replies[0].data).serving
    raw.close()


def test_a_connection_without_calls_is_closed_after_the_idle_timeout(shard_dir, load_engine):
    """Issue 12 #2: after the handshake nothing timed out, so silent connections
    held their slot for ever. Now one with no call for the idle timeout gets a
    GOAWAY and is closed; one with a call open is not."""
    engine = load_engine(shard_dir[(10, 20)])
    creds = make_tls_credentials()
    srv = ShardRuntimeServicer(engine).register(Server(creds, idle_timeout=0.5)).start()
    try:
        silent = _tls_socket(creds, srv.port)
        silent.sendall(PREFACE + frame(SETTINGS, 0, 0, b""))
        busy = _ours(creds, srv)
        stream = busy.session(busy.capability().fingerprint, max_tokens=8, timeout=None)
        assert _closed_by_server(silent, timeout=10)
        assert busy.health().serving  # the connection with a session open was kept
        stream.close()
    finally:
        srv.stop(0)


def test_one_source_holds_a_bounded_share_of_connections_and_idle_ones_give_way(shard_dir, load_engine):
    """Issue 12 #2: 64 connections from one source locked everyone out. One source
    now holds at most max_connections_per_source (its own idle one gives way to
    its next), and a full server closes an idle connection of the source holding
    most to let another source in."""
    engine = load_engine(shard_dir[(10, 20)])
    creds = make_tls_credentials()
    srv = ShardRuntimeServicer(engine).register(Server(creds, max_connections=3, max_connections_per_source=3)).start()
    try:
        def from_(source: str) -> ssl.SSLSocket:
            raw = socket.create_connection(("127.0.0.1", srv.port), source_address=(source, 0))
            return _h2_tls_context(creds).wrap_socket(raw, server_hostname=TLS_NAME)

        first = [from_("127.0.0.2") for _ in range(3)]
        fourth = from_("127.0.0.2")  # over its cap: its own longest-idle connection gives way
        assert _closed_by_server(first[0])
        other = _ours(creds, srv)  # 127.0.0.1, the peer full: an idle one of 127.0.0.2 gives way
        assert other.health().serving
        assert _closed_by_server(first[1])
        for s in first[2:] + [fourth]:
            s.close()
    finally:
        srv.stop(0)


def test_a_source_reconnecting_faster_than_its_budget_is_refused_before_the_handshake():
    """h2load in tests/test_floods.py reconnects every client the peer makes give way,
    for as long as the peer lets it; a TLS handshake costs the peer ~2 ms of CPU
    (300 connections from one process, 2026-12-03: 2.1 ms each, 220 a second from a
    single Python client), and nothing bounded how fast one source opened them, so a
    reconnect loop spent the peer's CPU at will. A source may now open a burst of
    connections at once, then so many a second: past that a new one's handshake waits
    its turn (no TLS work meanwhile), and once a burst's worth wait, the next are closed
    before any. Another source's are served at once."""
    creds = make_tls_credentials()
    srv = Server(creds, max_connections_per_source=3, connection_burst_per_source=3,
                 connections_per_source_per_s=2.0).start()

    def connect(source: str) -> socket.socket:
        return socket.create_connection(("127.0.0.1", srv.port), source_address=(source, 0), timeout=10)

    def handshake_s(raw: socket.socket) -> float | None:
        t0 = time.monotonic()
        try:
            _h2_tls_context(creds).wrap_socket(raw, server_hostname=TLS_NAME).close()
            return time.monotonic() - t0
        except (ssl.SSLError, OSError):  # closed before the handshake
            return None
        finally:
            raw.close()

    try:
        first = [handshake_s(connect("127.0.0.2")) for _ in range(3)]  # its burst at once
        assert all(t is not None and t < 0.5 for t in first), first
        raws = [connect("127.0.0.2") for _ in range(5)]  # at once (TCP only): 3 wait their turn, 2 refused
        other = handshake_s(connect("127.0.0.3"))  # another source: at once
        took = [handshake_s(r) for r in raws]
        assert [t is None for t in took] == [False] * 3 + [True] * 2, took
        assert took[0] >= 0.4, took  # its turn: 0.5 s a connection at 2 a second
        assert sum(took[:3]) >= 1.2, took  # (read one after another: each waited what the one before did not)
        assert other is not None and other < 0.5
        assert srv.stats.snapshot().get("connections_over_rate", 0) == 2
    finally:
        srv.stop(0)


@pytest.mark.parametrize("WRITES", [100, 0])
def test_a_call_written_after_the_server_gave_way_is_refused_never_lost(shard_dir, load_engine, WRITES):
    """The keep-alive race (bench/wan.py, 2026-12-03): a pooled idle connection the
    server closed to make room (GOAWAY, then its end shut) was written to before the
    GOAWAY was read. The second write failed (EPIPE) and the call ended "connection
    lost: Broken pipe", which a client takes for a dead peer and bans. What arrived
    before the failure is read first, so the call is known never processed: refused,
    safe to send again on a new connection. (CI, 2026-12-03: under load the server closed
    its end after the hundred writes went out, none failed; the call must then be refused
    by what it reads. With no writes but the headers, that order is the usual one.)"""
    import select

    from meshnet_p2p.dataplane.stub import method_path

    engine = load_engine(shard_dir[(10, 20)])
    creds = make_tls_credentials()
    srv = ShardRuntimeServicer(engine).register(Server(creds, max_connections_per_source=1)).start()
    try:
        idle = _ours(creds, srv)
        assert idle.health().serving  # connected, then idle: the one that gives way
        newer = socket.create_connection(("127.0.0.1", srv.port))  # the same source, over its cap
        assert select.select([idle.channel.sock], [], [], 10)[0]  # its GOAWAY is here, unread
        with pytest.raises(ChannelError) as e:
            call = idle.channel.stream(method_path("Health"), timeout=10)  # the headers: a write
            for _ in range(WRITES):  # once the server's end is closed it answers data with a reset:
                call.send(b"x", end=False)  # a write fails soon...
            call.recv(deadline=time.monotonic() + 10)  # ...unless its close came later: then the GOAWAY says it
        assert e.value.refused and "gave way" in e.value.detail, e.value
        assert _ours(creds, srv).health().serving  # a new connection is served
        newer.close()
    finally:
        srv.stop(0)


def test_a_connection_whose_calls_all_answered_gives_way_though_their_workers_still_tidy_up(monkeypatch):
    """CI, 2026-12-05 (the test above failed once in 1,460): the client had its answer
    (trailers sent) while the call's worker was still letting go of it, and a newer
    connection of the same source, over its cap, found no idle one to replace: it was
    refused, and the one it should have replaced stayed. An answered call loses nothing
    when its connection closes. (The worker is held here where it was then.)"""
    from meshnet_p2p.dataplane.transport import server as server_mod

    tidying, go_on = threading.Event(), threading.Event()
    release = server_mod._Connection._release_worker

    def held(self, call):
        tidying.set()
        go_on.wait(20)
        release(self, call)

    monkeypatch.setattr(server_mod._Connection, "_release_worker", held)
    health = pb.HealthReport(serving=True).SerializeToString()
    creds = make_tls_credentials()
    srv = Server(creds, max_connections_per_source=1).register(
        {"/meshnet.shard.v1.ShardRuntime/Health": Method(UNARY, lambda request, caller: health)}).start()
    try:
        first = open_channel(creds.cert_pem, address=("127.0.0.1", srv.port))
        assert pb.HealthReport.FromString(first.unary("/meshnet.shard.v1.ShardRuntime/Health",
                                                      pb.HealthRequest().SerializeToString(), timeout=10)).serving
        assert tidying.wait(10)  # answered; its worker has not let go yet
        newer = _tls_socket(creds, srv.port)  # the same source, over its cap of one
        assert _closed_by_server(first.sock)  # the answered one gave way...
        go_on.set()
        newer.settimeout(10)
        newer.sendall(PREFACE + frame(SETTINGS, 0, 0))
        assert newer.recv(65536)  # ...and the newer one is served
        newer.close()
        first.close()
    finally:
        go_on.set()
        srv.stop(0)


def _frames_until_closed(sock, timeout: float = 10, answer_pings: bool = False) -> tuple[list, bool]:
    """Read a raw connection's frames until the server closes it (True) or
    ``timeout`` passes (False); optionally acking each PING as a live client does."""
    from tests.h2frames import ACK, PING, frames

    deadline, data, seen = time.monotonic() + timeout, b"", 0
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except (ConnectionError, ssl.SSLError):
            return frames(data), True
        if not chunk:
            return frames(data), True
        data += chunk
        got = frames(data)
        if answer_pings:
            for ftype, flags, _, payload in got[seen:]:
                if ftype == PING and not flags & ACK:
                    sock.sendall(frame(PING, ACK, 0, payload))
        seen = len(got)
    return frames(data), False


def test_keepalive_pings_close_a_connection_whose_client_vanished(shard_dir, load_engine):
    """Issue 12 #2: a client that vanished without a FIN (power loss, a dead
    route) kept its connection and its calls for ever. A connection with calls
    that has been silent is now sent a PING, and closed if no answer comes; one
    whose client answers is kept."""
    from tests.h2frames import END_HEADERS, GOAWAY, HEADERS, PING, request_headers

    engine = load_engine(shard_dir[(10, 20)])
    creds = make_tls_credentials()
    srv = ShardRuntimeServicer(engine).register(Server(creds, keepalive=0.2, keepalive_timeout=0.5)).start()
    try:
        def with_a_call() -> ssl.SSLSocket:
            import hpack

            sock = _tls_socket(creds, srv.port)
            block = request_headers(hpack.Encoder(), "/meshnet.shard.v1.ShardRuntime/Session", authority=TLS_NAME)
            sock.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, block))
            return sock

        vanished, alive = with_a_call(), with_a_call()
        answered: list = []
        t = threading.Thread(target=lambda: answered.append(_frames_until_closed(alive, timeout=3.0, answer_pings=True)))
        t.start()
        got, closed = _frames_until_closed(vanished, answer_pings=False)
        assert closed and [f[0] for f in got if f[0] in (PING, GOAWAY)][-2:] == [PING, GOAWAY]
        t.join(10)
        got, closed = answered[0]
        assert not closed and sum(1 for f in got if f[0] == PING) >= 2  # pinged, answered, kept
        vanished.close()
        alive.close()
    finally:
        srv.stop(0)


def test_a_stopping_server_says_goaway_last(shard_dir, load_engine):
    """Issue 12 #1 (GOAWAY on drain): h2 takes nothing after a GOAWAY, so the
    server refuses new calls while draining, lets running ones finish, and
    sends GOAWAY(NO_ERROR) as each connection's last frame."""
    from tests.h2frames import GOAWAY

    engine = load_engine(shard_dir[(10, 20)])
    creds = make_tls_credentials()
    srv = ShardRuntimeServicer(engine).register(Server(creds)).start()
    sock = _tls_socket(creds, srv.port)
    sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
    assert _ours(creds, srv).health().serving  # the server is up and has read our preface by now
    srv.stop(0)
    got, closed = _frames_until_closed(sock)
    sock.close()
    assert closed and got[-1][0] == GOAWAY and got[-1][3][4:8] == b"\x00\x00\x00\x00"


def test_a_connection_is_closed_for_idleness_after_its_last_call_too():
    """Found in review: while a call ran, the standby reader polled with no
    timeout, and nothing woke it when the call ended, so a client that went
    quiet after one call kept its connection for ever. (The handler here works
    without waiting on the socket, as a step does.)"""
    done = threading.Event()

    def slow_health(request: bytes, caller) -> bytes:
        done.wait(0.3)  # busy for a while, reading nothing
        return pb.HealthReport(serving=True).SerializeToString()

    creds = make_tls_credentials()
    srv = Server(creds, idle_timeout=0.5).register(
        {"/meshnet.shard.v1.ShardRuntime/Health": Method(UNARY, slow_health)}).start()
    try:
        ch = open_channel(creds.cert_pem, address=("127.0.0.1", srv.port))
        assert pb.HealthReport.FromString(ch.unary("/meshnet.shard.v1.ShardRuntime/Health",
                                                   pb.HealthRequest().SerializeToString(), timeout=10)).serving
        assert srv.wait_no_connections(5)  # closed by the server: the client never closed it
        ch.close()
    finally:
        srv.stop(0)


def test_a_call_the_peer_turned_away_before_any_work_bans_no_peer():
    """A call refused for the caller's own load (REFUSED_STREAM past a
    connection's limits, RESOURCE_EXHAUSTED past its source's unary queue) is
    the request's error: the route search sets that peer aside, as a full one,
    and does not ban it. Anything else from the transport still counts as the
    peer's fault."""
    from meshnet_p2p.route.errors import is_full
    from meshnet_p2p.dataplane.stub import ShardConnectionError

    refused = ChannelError("UNAVAILABLE", "the peer reset the stream (HTTP/2 error 7)", refused=True)
    queued_out = ChannelError("RESOURCE_EXHAUSTED", "over 64 calls from your address wait already")
    lost = ChannelError("UNAVAILABLE", "connection lost")
    assert refused.refused and queued_out.refused and not lost.refused
    assert is_full(ShardConnectionError.of(refused)) and is_full(ShardConnectionError.of(queued_out))
    assert not is_full(ShardConnectionError.of(lost))


def test_a_thread_that_reads_for_itself_sends_the_standby_poller_aside():
    """Else the standby and the thread waiting for its request both wake for the
    same bytes, each step, at the moment the step's latency is made."""
    from meshnet_p2p.dataplane.transport.driver import Driver

    a, b = socket.socketpair()
    d = Driver()
    d.sock = a
    d.use_standby()
    try:
        with d.lock:
            d.standby_polling = True
        outcome = []
        standby = threading.Thread(target=lambda: outcome.append(d.poll(None, standby=True)))
        standby.start()
        with d.cond:  # no bytes come: this thread polls for itself until its deadline
            assert d.wait_locked(lambda: False, time.monotonic() + 0.05) is False
        standby.join(timeout=10)
        assert outcome == [False] and not d.standby_polling  # sent aside, not woken by data
        b.send(b"x")
        assert d.poll(10, standby=True) is True  # the signal was consumed: data still wakes it
    finally:
        with d.lock:
            d.broken = "test over"
            d.release_locked()
        b.close()
