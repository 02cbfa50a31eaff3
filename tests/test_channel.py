"""The client channel (dataplane/channel.py) on real sockets: against a real
grpcio server (big messages both ways, deadlines, status codes, several
threads on one connection), and against listeners that misbehave."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from meshnet_p2p.dataplane.transport.channel import Channel, ChannelError
from meshnet_p2p.dataplane.transport.tls import TLS_NAME, make_tls_credentials

GRPC_OPTIONS = [("grpc.so_reuseport", 0)]  # port 0 must mean a port of our own
HOLD = threading.Event()


def _same(b: bytes) -> bytes:
    return b


@pytest.fixture(scope="module")
def grpc_server():
    release = threading.Event()

    def echo(requests, context):
        for r in requests:
            yield r

    def big(request, context):
        return bytes(range(256)) * (int(request) // 256)

    def slow(request, context):
        release.wait(10)
        return b"late"

    def fail(request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not for you: 100%")

    def hold(requests, context):  # reads nothing until HOLD is set: its window stays shut
        HOLD.wait(30)
        for r in requests:
            yield r[:1]

    handlers = {
        "Echo": grpc.stream_stream_rpc_method_handler(echo, _same, _same),
        "Big": grpc.unary_unary_rpc_method_handler(big, _same, _same),
        "Slow": grpc.unary_unary_rpc_method_handler(slow, _same, _same),
        "Fail": grpc.unary_unary_rpc_method_handler(fail, _same, _same),
        "Hold": grpc.stream_stream_rpc_method_handler(hold, _same, _same),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Svc", handlers),))
    creds = make_tls_credentials()
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(creds.key_pem, creds.cert_pem)]))
    server.start()
    yield port, creds.cert_pem, release
    release.set()
    server.stop(None).wait()


def channel(grpc_server, **kw) -> Channel:
    port, cert, _ = grpc_server
    return Channel(cert, TLS_NAME, address=("127.0.0.1", port), **kw)


def _untrusted(**kw) -> Channel:
    """A channel that pins a fresh certificate nobody serves."""
    return Channel(make_tls_credentials().cert_pem, TLS_NAME, **kw)


def test_messages_far_larger_than_the_flow_control_windows_go_both_ways(grpc_server):
    ch = channel(grpc_server)
    payload = bytes(range(256)) * 12_000  # 3 MB: dozens of the peer's windows
    call = ch.stream("/t.Svc/Echo", timeout=30)
    for _ in range(7):  # 21 MB back: past our own 16 MiB window, so it must be credited back
        call.send(payload)
        assert call.recv() == payload
    call.end()
    assert call.recv() is None  # the call ended with status OK
    assert ch.unary("/t.Svc/Big", b"5000000", timeout=30) == bytes(range(256)) * (5_000_000 // 256)
    ch.close()


def test_status_codes_and_deadlines_end_one_call_not_the_channel(grpc_server):
    ch = channel(grpc_server)
    with pytest.raises(ChannelError) as e:
        ch.unary("/t.Svc/Fail", b"", timeout=10)
    assert e.value.code == "PERMISSION_DENIED" and e.value.detail == "not for you: 100%"
    with pytest.raises(ChannelError) as e:
        ch.unary("/t.Svc/Nope", b"", timeout=10)
    assert e.value.code == "UNIMPLEMENTED"
    t0 = time.monotonic()
    with pytest.raises(ChannelError) as e:
        ch.unary("/t.Svc/Slow", b"", timeout=0.3)
    assert e.value.code == "DEADLINE_EXCEEDED" and time.monotonic() - t0 < 5
    call = ch.stream("/t.Svc/Echo")
    call.send(b"still here")
    assert call.recv(deadline=time.monotonic() + 10) == b"still here"
    call.cancel()
    ch.close()
    with pytest.raises(ChannelError, match="closed"):
        ch.unary("/t.Svc/Big", b"256", timeout=5)


def test_threads_share_a_channel_while_one_waits(grpc_server):
    """One thread blocks on a slow call; others' calls on the same connection
    still complete (whoever waits reads for everyone)."""
    port, cert, release = grpc_server
    release.clear()
    ch = channel(grpc_server)
    slow = {}
    t = threading.Thread(target=lambda: slow.setdefault("r", ch.unary("/t.Svc/Slow", b"", timeout=20)))
    t.start()
    results = []

    def echo_many(tag: bytes):
        call = ch.stream("/t.Svc/Echo", timeout=20)
        for i in range(50):
            msg = tag + str(i).encode()
            call.send(msg)
            results.append(call.recv() == msg)
        call.cancel()

    workers = [threading.Thread(target=echo_many, args=(bytes([65 + k]),)) for k in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert results == [True] * 150 and t.is_alive()
    release.set()
    t.join(30)
    assert slow["r"] == b"late"
    ch.close()


def test_the_pinned_certificate_is_the_only_one_trusted(grpc_server):
    port, _, _ = grpc_server
    ch = _untrusted(address=("127.0.0.1", port))
    with pytest.raises(ChannelError, match="TLS handshake failed"):
        ch.unary("/t.Svc/Big", b"256", timeout=10)
    ch.close()


class Listener:
    """A plain TCP listener that does one scripted thing per connection."""

    def __init__(self, behaviour) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.behaviour = behaviour
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        self.conns.append(conn)
        self.behaviour(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()
        self.thread.join(10)


def test_a_peer_that_never_answers_misses_the_connect_deadline():
    lst = Listener(lambda conn: None)  # accepts, then says nothing
    ch = _untrusted(address=("127.0.0.1", lst.port), connect_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(ChannelError) as e:
        ch.unary("/t.Svc/Big", b"", timeout=10)
    assert e.value.code == "DEADLINE_EXCEEDED" and time.monotonic() - t0 < 5
    ch.close()
    lst.close()


def test_a_peer_that_hangs_up_or_talks_nonsense_is_unavailable():
    lst = Listener(lambda conn: conn.close())
    ch = _untrusted(address=("127.0.0.1", lst.port), connect_timeout=5)
    with pytest.raises(ChannelError) as e:
        ch.unary("/t.Svc/Big", b"", timeout=5)
    assert e.value.code == "UNAVAILABLE"
    lst.close()
    lst = Listener(lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\n\r\nnot TLS at all" * 10))
    ch = _untrusted(address=("127.0.0.1", lst.port), connect_timeout=5)
    with pytest.raises(ChannelError, match="TLS handshake failed"):
        ch.unary("/t.Svc/Big", b"", timeout=5)
    lst.close()


@pytest.mark.parametrize("answer, expected", [
    (b"HTTP/1.1 404 Not Found\r\n\r\n", "refused: HTTP/1.1 404"),
    (b"HTTP/1.1 429 Too Many Requests\r\n\r\n", "refused: HTTP/1.1 429"),
    (b"garbage" * 2000, "too long"),
    (b"HTTP/1.1 20", "closed"),
])
def test_a_relay_that_refuses_is_reported(answer, expected):
    def relay(conn):
        conn.recv(4096)  # the CONNECT request
        conn.sendall(answer)
        conn.close()

    lst = Listener(relay)
    ch = _untrusted(relay=("127.0.0.1", lst.port), relay_target="x.peer:443", connect_timeout=5)
    with pytest.raises(ChannelError, match=expected) as e:
        ch.unary("/t.Svc/Big", b"", timeout=5)
    assert e.value.code == "UNAVAILABLE"
    lst.close()


def test_closing_a_channel_fails_its_open_calls(grpc_server):
    ch = channel(grpc_server)
    call = ch.stream("/t.Svc/Echo")
    call.send(b"one")
    assert call.recv() == b"one"
    ch.close()
    with pytest.raises(ChannelError) as e:  # never a clean end (None) for a call that did not end
        call.recv()
    assert e.value.code == "UNAVAILABLE"


def test_opening_a_call_on_a_connection_the_peer_dropped_is_a_channel_error(grpc_server):
    """A write that fails while opening a call breaks the channel with a typed
    ChannelError (which failover catches), never a raw OSError."""
    ch = channel(grpc_server)
    assert ch.unary("/t.Svc/Big", b"256", timeout=10)
    ch.sock.shutdown(socket.SHUT_WR)  # as if the connection died under us
    with pytest.raises(ChannelError) as e:
        ch.stream("/t.Svc/Echo")
    assert e.value.code == "UNAVAILABLE"
    ch.close()


def test_a_call_knows_its_end_without_waiting_for_its_messages(grpc_server):
    """CallStream.ended reads what has already arrived and waits for nothing: False while
    the connection lives, messages queued or not; True once it has ended, before the
    messages that came first are read (a ring's client tells a dead hop from a late one so)."""
    ch = channel(grpc_server)
    call = ch.stream("/t.Svc/Echo", timeout=30)
    call.send(b"one")
    assert call.wait_readable(10) and not call.ended()  # the echo is queued, the connection lives
    ch.sock.shutdown(socket.SHUT_RD)  # as if the peer's FIN came: its process died
    t0 = time.monotonic()
    assert call.ended() and time.monotonic() - t0 < 1
    assert call.recv() == b"one"  # what came before the end is still there
    with pytest.raises(ChannelError) as e:
        call.recv()
    assert e.value.code == "UNAVAILABLE"
    ch.close()


def test_a_send_can_leave_what_the_window_holds_back_to_a_flush(grpc_server):
    """``send(wait=False)`` writes what the peer's flow-control window admits and
    returns at once, saying whether the rest waits; ``flush`` waits for it, within
    its deadline. (A ring hop forwards so, then sends the client its copy, then
    flushes: a next hop that holds its window shut cannot hold the copy back.)"""
    ch = channel(grpc_server)
    call = ch.stream("/t.Svc/Hold", timeout=60)
    payload = b"x" * (8 << 20)
    t0 = time.monotonic()
    waiting = [call.send(payload, wait=False) for _ in range(4)]  # 32 MB: past any window grpcio grants
    assert waiting[-1] is True and time.monotonic() - t0 < 5  # returned, the rest queued
    with pytest.raises(ChannelError):  # nobody reads: the flush misses its deadline
        call.flush(deadline=time.monotonic() + 0.5)
    ch.close()
    HOLD.set()
    ch = channel(grpc_server)
    call = ch.stream("/t.Svc/Hold", timeout=60)
    assert call.send(b"small", wait=False) is False  # within the window: all written at once
    call.flush(deadline=time.monotonic() + 10)
    call.end()
    assert call.recv() == b"s"
    ch.close()


def test_a_call_opened_after_a_goaway_and_a_reset_is_refused_never_lost():
    """CI, 2026-12-05: a server that gave way had sent GOAWAY and then closed with a
    client's bytes unread, so its end answered with a reset; the next call's headers
    then failed to go out (EPIPE), and the call ended "connection lost", which a
    client takes for a dead peer. The GOAWAY still waiting to be read says the call
    was never taken: it must be refused (safe to send again), as a failed send is.
    (Here the server resets on purpose, and the client waits until the reset is in.)"""
    import select
    import struct

    from meshnet_p2p.dataplane.transport import grpc_core
    from meshnet_p2p.dataplane.transport.tls import server_context

    creds = make_tls_credentials()
    listener = socket.create_server(("127.0.0.1", 0))
    took_first = threading.Event()

    def serve() -> None:
        raw, _ = listener.accept()
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each write on the wire before the reset
        tls = server_context(creds).wrap_socket(raw, server_side=True)
        wire = grpc_core.server()
        wire.initiate()
        tls.sendall(wire.data_to_send())
        while not any(isinstance(ev, grpc_core.RequestStarted) for ev in wire.receive_data(tls.recv(65536))):
            pass
        tls.sendall(wire.data_to_send())
        wire.close(grpc_core.NO_ERROR, "gave way to a newer connection")  # GOAWAY: the first call was taken
        tls.sendall(wire.data_to_send())
        took_first.set()
        tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        tls.close()  # a reset, not a FIN: as a close with the client's bytes unread sends

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ch = Channel(creds.cert_pem, TLS_NAME, address=("127.0.0.1", listener.getsockname()[1]))
    try:
        first = ch.stream("/t.Svc/Echo", timeout=10)
        assert took_first.wait(10)
        t.join(10)
        poller = select.poll()
        poller.register(ch.sock, select.POLLERR)
        assert poller.poll(10_000)  # the reset is in; the GOAWAY before it is still unread
        with pytest.raises(ChannelError) as e:
            ch.stream("/t.Svc/Echo", timeout=10)
        assert e.value.refused and "gave way" in e.value.detail, e.value
        with pytest.raises(ChannelError) as e:
            first.recv(deadline=time.monotonic() + 10)
        assert not e.value.refused  # taken before the GOAWAY: its fate is unknown, never "refused"
    finally:
        ch.close()
        listener.close()


def test_what_comes_with_the_peers_close_notify_is_read_not_dropped():
    """Found beside the test above: bytes decrypted from the same read as the peer's
    TLS close_notify (a GOAWAY, then the close, as a peer that shuts down cleanly sends
    them) were dropped with it, so a call the GOAWAY refused looked lost."""
    import ssl

    from meshnet_p2p.dataplane.transport.tls import client_context, decrypt, server_context

    creds = make_tls_credentials()
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_context(creds.cert_pem).wrap_bio(c_in, c_out, server_hostname=TLS_NAME)
    server = server_context(creds).wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):  # the handshake, record by record in memory
        for side in (client, server):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if client.version() and server.version():
            break
    assert decrypt(client, c_in, b"") == (b"", False)  # the server's session tickets: nothing to read yet
    server.write(b"GOAWAY: this call was never taken")
    try:
        server.unwrap()  # close_notify; it would wait for the client's
    except ssl.SSLWantReadError:
        pass
    assert decrypt(client, c_in, s_out.read()) == (b"GOAWAY: this call was never taken", True)
