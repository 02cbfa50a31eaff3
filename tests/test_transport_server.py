"""The generic gRPC server's contract (dataplane/transport/server.py), with a toy
service over real TLS on loopback: it serves what is registered, tells each
handler who calls, and knows nothing of any application."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.netgroup import host_group
from meshnet_p2p.dataplane.transport import grpc_core
from meshnet_p2p.dataplane.transport.channel import Channel, ChannelError
from meshnet_p2p.dataplane.transport.server import BIDI, SERVER_STREAM, UNARY, Abort, Caller, Method, Server
from meshnet_p2p.dataplane.transport.tls import TLS_NAME, make_client_credentials, make_tls_credentials

SEEN: list[Caller] = []


def whoami(request: bytes, caller: Caller) -> bytes:
    SEEN.append(caller)
    return (caller.peer_id or "anonymous").encode() + b" " + request


def count(request: bytes, caller: Caller):
    yield from (str(i).encode() for i in range(int(request)))


def chat(requests, caller: Caller, send):
    """Echoes each request; ``push`` asks for one more reply, sent from another thread."""
    for raw in requests:
        if raw == b"push":
            t = threading.Thread(target=send, args=(b"pushed",))
            t.start()
            t.join()
        elif raw == b"refuse":
            raise Abort(7, "not for you")  # PERMISSION_DENIED
        else:
            yield raw


TABLE = {
    "/toy.Toy/WhoAmI": Method(UNARY, whoami),
    "/toy.Toy/Count": Method(SERVER_STREAM, count),
    "/toy.Toy/Chat": Method(BIDI, chat),
}


@pytest.fixture
def toy():
    creds = make_tls_credentials(Identity.generate())
    stopped = []
    srv = Server(creds, port=0).register(TABLE, on_stop=lambda: stopped.append(True)).start()
    SEEN.clear()
    yield srv, creds
    srv.stop(0)
    assert stopped == [True]  # a service's on_stop runs once the server has stopped


def _channel(srv, creds, client: Identity | None = None) -> Channel:
    return Channel(creds.cert_pem, TLS_NAME, address=("127.0.0.1", srv.port),
                   client_creds=None if client is None else make_client_credentials(client))


def test_a_handler_sees_the_peer_id_the_callers_certificate_proves(toy):
    srv, creds = toy
    alice = Identity.generate()
    a, anon = _channel(srv, creds, alice), _channel(srv, creds)
    try:
        assert a.unary("/toy.Toy/WhoAmI", b"hi", timeout=10) == f"{alice.peer_id} hi".encode()
        assert a.unary("/toy.Toy/WhoAmI", b"again", timeout=10).endswith(b"again")
        assert anon.unary("/toy.Toy/WhoAmI", b"hi", timeout=10) == b"anonymous hi"
    finally:
        a.close()
        anon.close()
    first, second, stranger = SEEN
    assert first == second and first.peer_id == str(alice.peer_id)  # one connection: one Caller
    assert stranger.peer_id is None and stranger.connection != first.connection
    assert first.host_group == stranger.host_group == host_group("127.0.0.1")


def test_an_unregistered_method_is_unimplemented_and_the_connection_goes_on(toy):
    srv, creds = toy
    ch = _channel(srv, creds)
    try:
        for path in ("/toy.Toy/Nope", "/other.Svc/WhoAmI", "/"):
            with pytest.raises(ChannelError) as e:
                ch.unary(path, b"", timeout=10)
            assert e.value.code == "UNIMPLEMENTED"
        assert ch.unary("/toy.Toy/WhoAmI", b"x", timeout=10) == b"anonymous x"
    finally:
        ch.close()


def test_streams_send_what_handlers_yield_and_push_and_an_abort_ends_one_call(toy):
    srv, creds = toy
    ch = _channel(srv, creds)
    try:
        call = ch.stream("/toy.Toy/Count", timeout=10, with_first_message=True)
        call.send(b"3", end=True)
        assert [call.recv(), call.recv(), call.recv(), call.recv()] == [b"0", b"1", b"2", None]
        call = ch.stream("/toy.Toy/Chat", timeout=10)
        for message, reply in [(b"one", b"one"), (b"push", b"pushed"), (b"two", b"two")]:
            call.send(message)
            assert call.recv() == reply
        call.send(b"refuse")
        with pytest.raises(ChannelError) as e:
            call.recv()
        assert (e.value.code, e.value.detail) == ("PERMISSION_DENIED", "not for you")
        assert ch.unary("/toy.Toy/WhoAmI", b"x", timeout=10) == b"anonymous x"  # only that call ended
    finally:
        ch.close()


def niceness(request: bytes, caller: Caller):
    """A stream that says at what CPU priority its handler's thread runs, then waits for ``release``."""
    import os

    yield str(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).encode()
    RELEASE.wait(10)


RELEASE = threading.Event()


def test_background_streams_run_below_the_others_and_never_take_a_sessions_worker():
    """Serving model files must not starve inference (docs/weights.md): a background
    method's streams run on threads of their own at the lowest CPU priority, at most
    BACKGROUND_WORKERS at once (past that, RESOURCE_EXHAUSTED), holding no worker a
    session needs; the other streams run at the process's priority."""
    import os

    from meshnet_p2p.dataplane.transport.server import BACKGROUND_WORKERS

    creds = make_tls_credentials(Identity.generate())
    srv = Server(creds, port=0, max_workers=1).register({
        "/toy.Toy/Low": Method(SERVER_STREAM, niceness, background=True),
        "/toy.Toy/Normal": Method(SERVER_STREAM, niceness)}).start()
    ch = _channel(srv, creds)
    RELEASE.clear()
    try:
        low = []
        for _ in range(BACKGROUND_WORKERS):
            call = ch.stream("/toy.Toy/Low", timeout=10, with_first_message=True)
            call.send(b"", end=True)
            low.append(call)
        assert {int(c.recv()) for c in low} == {19}
        over = ch.stream("/toy.Toy/Low", timeout=10, with_first_message=True)
        over.send(b"", end=True)
        with pytest.raises(ChannelError) as e:
            over.recv()
        assert e.value.code == "RESOURCE_EXHAUSTED"
        # the only session worker is still free for a normal stream, at the process's priority
        normal = ch.stream("/toy.Toy/Normal", timeout=10, with_first_message=True)
        normal.send(b"", end=True)
        assert int(normal.recv()) == os.getpriority(os.PRIO_PROCESS, 0)
        RELEASE.set()
        assert [c.recv() for c in [*low, normal]] == [None] * (BACKGROUND_WORKERS + 1)
        # once they have ended, background streams are served again
        again = ch.stream("/toy.Toy/Low", timeout=10, with_first_message=True)
        again.send(b"", end=True)
        assert int(again.recv()) == 19 and again.recv() is None
    finally:
        RELEASE.set()
        ch.close()
        srv.stop(0)


ENDLESS_CLOSED = threading.Event()


def endless(request: bytes, caller: Caller):
    try:
        while True:
            yield b"more"
    finally:
        ENDLESS_CLOSED.set()


def test_a_stream_the_client_cancels_stops_its_handler():
    """Nobody reads the rest of a cancelled stream: its handler's generator is closed,
    not run to its end (a cancelled download would otherwise keep spending the
    shared upload rate, and its worker, on bytes sent nowhere)."""
    ENDLESS_CLOSED.clear()
    creds = make_tls_credentials(Identity.generate())
    srv = Server(creds, port=0).register({"/toy.Toy/Endless": Method(SERVER_STREAM, endless)}).start()
    ch = _channel(srv, creds)
    try:
        call = ch.stream("/toy.Toy/Endless", timeout=10, with_first_message=True)
        call.send(b"", end=True)
        assert call.recv() == b"more"
        call.cancel()
        assert ENDLESS_CLOSED.wait(10)
    finally:
        ch.close()
        srv.stop(0)


def test_a_method_table_is_checked_when_registered():
    with pytest.raises(ValueError):
        Method("client-stream", whoami)
    srv = Server(make_tls_credentials()).register(TABLE)
    try:
        with pytest.raises(ValueError, match="already registered"):
            srv.register({"/toy.Toy/Chat": Method(BIDI, chat)})
        srv.start()
        with pytest.raises(RuntimeError):
            srv.register({"/toy.Toy/Later": Method(UNARY, whoami)})
    finally:
        srv.stop(0)


# --- the ShardRuntime service's method table, on bytes from anyone --------------------------------

def test_the_servicers_unary_handlers_take_any_bytes_as_a_reply_or_an_internal_abort():
    """Requests are decoded by the service (wire.py), not the server: anything
    malformed ends its call INTERNAL through Abort, and nothing else escapes."""
    from meshnet_p2p.dataplane import wire
    from meshnet_p2p.dataplane.servicer import ShardRuntimeServicer
    from tests.test_fuzz_decoders import ROLES, FakeEngine

    table = ShardRuntimeServicer(FakeEngine(*ROLES["middle"])).methods()
    caller = Caller(None, "198.51.100.7", 1)

    @settings(max_examples=200, deadline=None)
    @given(st.sampled_from(["GetCapability", "Health", "Cancel", "Release"]), st.binary(max_size=64))
    def check(method, raw):
        handler = table[wire.method_path(method)]
        assert handler.kind == UNARY
        try:
            reply = handler.handler(raw, caller)
        except Abort as e:
            assert e.status == grpc_core.INTERNAL and "malformed" in e.message
        else:
            assert isinstance(reply, bytes)

    check()
