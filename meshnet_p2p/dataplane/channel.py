"""A gRPC client channel to one peer, driven from the caller's thread.

One TCP connection (direct, or through a relay's HTTP CONNECT splice), TLS
that trusts exactly the peer's pinned certificate, and HTTP/2 from ``grpc_core.py``
on top. Calls block the thread that makes them and do their own I/O: the
thread waiting for a reply reads the socket itself, so a step's round trip
involves no other thread. Several threads may share a channel (a step on one,
an out-of-band Cancel on another): whoever waits becomes the reader while no
one else is reading, and hands each stream what arrived for it.

TLS runs through ``ssl.MemoryBIO`` so that the SSL object and the HTTP/2
state are only ever touched under one lock, and socket writes happen in the
order TLS produced them. Every wait has a deadline; a peer that stops
answering (SIGSTOP, a dead route) surfaces as ``DEADLINE_EXCEEDED`` instead
of a hang. A broken channel stays broken: callers open a new one.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from typing import Callable

from ..errors import MeshnetError
from . import grpc_core
from .tls import TlsCredentials, decrypt, handshake, load_key_pair

MAX_RELAY_RESPONSE = 8192
_POLL_IN = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


class ChannelError(MeshnetError):
    """A call failed: ``code`` names its gRPC status (UNAVAILABLE for a broken
    connection, DEADLINE_EXCEEDED for a timeout, or what the peer returned)."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")


class _Inbox:
    __slots__ = ("messages", "ended")

    def __init__(self) -> None:
        self.messages: deque[bytes] = deque()
        self.ended: grpc_core.StreamEnded | None = None


class Channel:
    def __init__(self, cert_pem: bytes, server_name: str, *, address: tuple[str, int] | None = None,
                 relay: tuple[str, int] | None = None, relay_target: str | None = None,
                 connect_timeout: float = 10.0, send_timeout: float = 30.0, max_message_bytes: int = grpc_core.MAX_MESSAGE,
                 client_creds: TlsCredentials | None = None, source_address: tuple[str, int] | None = None) -> None:
        if relay is not None:
            if not relay_target:
                raise ValueError("a relayed channel needs the CONNECT target")
        elif address is None:
            raise ValueError("a direct channel needs an address")
        self._cert = cert_pem
        self._client_creds = client_creds  # our identity-bound certificate (mutual TLS); None: anonymous
        self._source = source_address  # the local address to connect from (multi-homed hosts, tests)
        self._name = server_name
        self._address = address
        self._relay = relay
        self._relay_target = relay_target
        self.connect_timeout = connect_timeout
        self._send_timeout = send_timeout
        self._max_message = max_message_bytes
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._connect_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._tls: ssl.SSLObject | None = None
        self._tls_in = ssl.MemoryBIO()
        self._tls_out = ssl.MemoryBIO()
        self._wire: grpc_core.GrpcConnection | None = None
        self._poll: select.poll | None = None
        self._reading = False
        self._close_after_read = False  # close() came while a reader may be inside poll(): it closes the fd
        self._broken: str | None = None
        self._inboxes: dict[int, _Inbox] = {}

    # --- calls ----------------------------------------------------------------------------------

    def unary(self, path: str, request: bytes, *, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        stream = self.stream(path, timeout=timeout)
        try:
            stream.send(request, end=True)
            reply = stream.recv(deadline=deadline)
            if reply is None:
                raise ChannelError("INTERNAL", "the peer answered a unary call with no message")
            if stream.recv(deadline=deadline) is not None:
                raise ChannelError("INTERNAL", "the peer answered a unary call with more than one message")
            return reply
        finally:
            stream.cancel()

    def stream(self, path: str, *, timeout: float | None = None) -> "CallStream":
        """Open a call. ``timeout`` bounds the whole call (sent as grpc-timeout too)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._connect(deadline)
        with self._lock:
            self._check()
            try:
                sid = self._wire.open_stream(path, timeout=timeout)
            except grpc_core.H2StreamClosed as e:
                raise ChannelError("UNAVAILABLE", str(e)) from None
            self._inboxes[sid] = _Inbox()
            self._write_quietly()
            self._check()  # the write broke the channel: say so as every other call does
        return CallStream(self, sid, deadline)

    def close(self) -> None:
        with self._connect_lock, self._lock:  # not while a connection is being set up
            if self._broken is None:
                if self._wire is not None:
                    self._wire.close()
                    self._write_quietly()
                self._fail("the channel was closed")  # every open call ends UNAVAILABLE, never as a clean end
            sock = self._sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in poll
                except OSError:
                    pass
                if self._reading:
                    self._close_after_read = True  # its descriptor must not be reused under that reader
                else:
                    sock.close()

    # --- connection -----------------------------------------------------------------------------

    def _connect(self, deadline: float | None) -> None:
        if self._wire is not None:
            return
        with self._connect_lock:
            if self._wire is not None:
                return
            if self._broken is not None:
                raise ChannelError("UNAVAILABLE", self._broken)
            limit = time.monotonic() + self.connect_timeout
            deadline = limit if deadline is None else min(deadline, limit)
            try:
                self._handshake(deadline)
            except (ChannelError, OSError, ssl.SSLError) as e:
                error = e if isinstance(e, ChannelError) else ChannelError("UNAVAILABLE", f"cannot connect: {e}")
                with self._lock:
                    self._fail(error.detail)
                raise error from None

    def _handshake(self, deadline: float) -> None:
        target = self._relay if self._relay is not None else self._address
        sock = socket.create_connection(target, timeout=max(0.001, deadline - time.monotonic()),
                                        source_address=self._source)
        self._sock = sock
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Reads wait in poll() with each call's deadline; a write to a peer that
        # stopped reading gives up after send_timeout instead of blocking forever.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(self._send_timeout), 0))
        self._poll = select.poll()
        self._poll.register(sock, _POLL_IN)
        early = b""
        if self._relay is not None:
            early = self._connect_through_relay(deadline)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the name
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(cadata=self._cert.decode("ascii"))  # the pinned certificate is the only root
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # as Python 3.13 does by default: the same checks everywhere
        ctx.set_alpn_protocols(["h2"])
        if self._client_creds is not None:
            load_key_pair(ctx, self._client_creds)
        tls = ctx.wrap_bio(self._tls_in, self._tls_out, server_hostname=self._name)
        if early:
            self._tls_in.write(early)
        try:
            handshake(tls, self._tls_in, self._tls_out, self._send_raw, lambda: self._recv_raw(deadline))
        except ssl.SSLError as e:
            raise ChannelError("UNAVAILABLE", f"TLS handshake failed: {e.reason or e}") from None
        except ConnectionError as e:
            raise ChannelError("UNAVAILABLE", str(e)) from None
        conn = grpc_core.client(authority=self._name, max_message_bytes=self._max_message)
        conn.initiate()
        with self._lock:
            self._tls = tls
            self._wire = conn
            self._write_locked()

    def _connect_through_relay(self, deadline: float) -> bytes:
        self._send_raw(f"CONNECT {self._relay_target} HTTP/1.1\r\nHost: {self._relay_target}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            if len(head) > MAX_RELAY_RESPONSE:
                raise ChannelError("UNAVAILABLE", "the relay's answer to CONNECT is too long")
            data = self._recv_raw(deadline)
            if not data:
                raise ChannelError("UNAVAILABLE", "the relay closed the connection")
            head += data
        head, _, rest = head.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = status.split()
        if len(parts) < 2 or parts[1] != "200":
            raise ChannelError("UNAVAILABLE", f"the relay refused: {status[:80]}")
        return rest

    def _send_raw(self, data: bytes) -> None:
        if data:
            try:
                self._sock.sendall(data)
            except (BlockingIOError, TimeoutError):
                raise ChannelError("UNAVAILABLE", f"the peer took no data for {self._send_timeout:g} s") from None

    def _recv_raw(self, deadline: float | None) -> bytes:
        while True:
            wait = -1 if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000 + 0.999)
            if self._poll.poll(wait):
                return self._sock.recv(1 << 18)
            if deadline is not None and time.monotonic() >= deadline:
                raise ChannelError("DEADLINE_EXCEEDED", "no answer before the deadline")

    # --- the shared reader ------------------------------------------------------------------------

    def _check(self) -> None:
        if self._broken is not None:
            raise ChannelError("UNAVAILABLE", self._broken)

    def _fail(self, why: str) -> None:
        """Break the channel (under the lock): every waiter gets the reason."""
        self._broken = self._broken or why
        for inbox in self._inboxes.values():
            if inbox.ended is None:
                inbox.ended = grpc_core.StreamEnded(0, grpc_core.UNAVAILABLE, self._broken)
        self._cond.notify_all()

    def _write_quietly(self) -> None:
        """Send what HTTP/2 has queued; a failure breaks the channel (and every call learns why)."""
        if self._broken is not None:
            return
        try:
            self._write_locked()
        except ChannelError as e:
            self._fail(e.detail)
        except (OSError, ssl.SSLError) as e:
            self._fail(f"connection lost: {e}")

    def _write_locked(self) -> None:
        data = self._wire.data_to_send()
        if data:
            self._tls.write(data)
            self._send_raw(self._tls_out.read())

    def _wait(self, ready: Callable[[], bool], deadline: float | None) -> None:
        """Return once ``ready()`` (checked under the lock); read the socket
        meanwhile unless another thread already is."""
        while True:
            with self._cond:
                while True:
                    if ready():
                        return
                    if self._broken is not None:
                        return  # the inbox now carries the failure
                    if not self._reading:
                        self._reading = True
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise ChannelError("DEADLINE_EXCEEDED", "no answer before the deadline")
                    self._cond.wait(remaining)
            try:
                data = self._recv_raw(deadline)
            except BaseException as e:
                with self._cond:
                    self._done_reading()
                    if isinstance(e, OSError):
                        self._fail(f"connection lost: {e}")
                if isinstance(e, OSError):
                    continue
                raise
            with self._cond:
                try:
                    if self._broken is None:
                        self._feed(data)
                finally:
                    self._done_reading()

    def _done_reading(self) -> None:
        self._reading = False
        if self._close_after_read:
            self._sock.close()
        self._cond.notify_all()

    def _feed(self, data: bytes) -> None:
        if not data:
            return self._fail("the peer closed the connection")
        try:
            plain = decrypt(self._tls, self._tls_in, data)
            if plain is None:
                return self._fail("the peer closed the TLS session")
            events = self._wire.receive_data(plain) if plain else []
            for ev in events:
                if isinstance(ev, grpc_core.Message):
                    inbox = self._inboxes.get(ev.stream_id)
                    if inbox is not None:
                        inbox.messages.append(ev.data)
                elif isinstance(ev, grpc_core.StreamEnded):
                    inbox = self._inboxes.get(ev.stream_id)
                    if inbox is not None and inbox.ended is None:
                        inbox.ended = ev
        except ssl.SSLError as e:  # a record that fails its MAC: someone changed bytes in flight
            return self._fail(f"TLS failure (data altered or corrupt): {e.reason or e}")
        except grpc_core.H2ProtocolError as e:
            return self._fail(f"HTTP/2 protocol error from the peer: {e}")
        self._write_quietly()  # acks, window updates, and data the peer's window now lets out


class CallStream:
    """One call on a channel. Not for concurrent use by several threads; the
    channel it lives on is."""

    def __init__(self, channel: Channel, stream_id: int, deadline: float | None) -> None:
        self._ch = channel
        self.id = stream_id
        self._deadline = deadline
        self._inbox = channel._inboxes[stream_id]

    def _limit(self, deadline: float | None) -> float | None:
        if self._deadline is None:
            return deadline
        return self._deadline if deadline is None else min(deadline, self._deadline)

    def send(self, message: bytes, *, end: bool = False, deadline: float | None = None) -> None:
        ch = self._ch
        with ch._lock:
            self._raise_if_ended()
            try:
                ch._wire.send_message(self.id, message, end_stream=end)
            except grpc_core.H2StreamClosed:
                self._raise_if_ended()
                raise ChannelError("INTERNAL", "the call is closed for sending") from None
            ch._write_quietly()
            self._raise_if_ended()  # the write broke the channel
            waiting = ch._wire.pending(self.id)
        if waiting:  # more than the peer's flow-control window: read until it grants more
            ch._wait(lambda: not ch._wire.pending(self.id) or self._inbox.ended is not None, self._limit(deadline))
            with ch._lock:
                self._raise_if_ended()

    def recv(self, *, deadline: float | None = None) -> bytes | None:
        """The next message; None once the call ended with status OK. Raises
        :class:`ChannelError` for any other end, a broken channel or the deadline
        (after which the call is cancelled)."""
        inbox = self._inbox
        if not inbox.messages and inbox.ended is None:
            try:
                self._ch._wait(lambda: bool(inbox.messages) or inbox.ended is not None, self._limit(deadline))
            except ChannelError:
                self.cancel()
                raise
        ch = self._ch
        with ch._lock:
            if inbox.messages:
                message = inbox.messages.popleft()
                if ch._broken is None:
                    ch._wire.consumed(self.id, len(message) + 5)
                    ch._write_quietly()
                return message
            self._raise_if_ended()
            return None

    def _raise_if_ended(self) -> None:
        ended = self._inbox.ended
        if ended is not None and ended.status != 0:
            raise ChannelError(grpc_core.GRPC_STATUS.get(ended.status, f"STATUS_{ended.status}"), ended.message)

    def end(self) -> None:
        """Half-close: no more requests on this call."""
        ch = self._ch
        with ch._lock:
            if ch._broken is None:
                ch._wire.end_stream(self.id)
                ch._write_quietly()

    def cancel(self) -> None:
        """Reset the call if it is still open; forget it either way."""
        ch = self._ch
        with ch._lock:
            inbox = ch._inboxes.pop(self.id, None)
            if inbox is None:
                return
            if ch._broken is None:
                for message in inbox.messages:
                    ch._wire.consumed(self.id, len(message) + 5)  # unread, but the window is ours again
                ch._wire.reset_stream(self.id)
                ch._write_quietly()
            inbox.messages.clear()  # credited once: a later recv must not credit them again
