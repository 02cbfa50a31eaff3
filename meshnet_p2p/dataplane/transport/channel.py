"""A gRPC client channel to one peer, driven from the caller's thread.

One TCP connection (direct, or through a relay's HTTP CONNECT splice), TLS
that trusts exactly the peer's pinned certificate, and gRPC on the shared
driver (driver.py: TLS through MemoryBIOs, the h2-based core, the reader
role). Calls block the thread that makes them and do their own I/O: the
thread waiting for a reply reads the socket itself, so a step's round trip
involves no other thread. Several threads may share a channel (a step on one,
an out-of-band Cancel on another): whoever waits reads for everyone.

Every wait has a deadline; a peer that stops answering (SIGSTOP, a dead
route) surfaces as ``DEADLINE_EXCEEDED`` instead of a hang. A broken channel
stays broken: callers open a new one.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from collections import deque
from typing import Callable

from meshnet_p2p.core import trace
from meshnet_p2p.core.errors import MeshnetError
from . import grpc_core
from .connect import ConnectDialog, ConnectError
from .driver import Driver
from .tls import TlsCredentials, client_context, handshake

ENDED_READS = 16  # reads CallStream.ended makes of what already arrived, looking for the call's end


class ChannelError(MeshnetError):
    """A call failed: ``code`` names its gRPC status (UNAVAILABLE for a broken
    connection, DEADLINE_EXCEEDED for a timeout, or what the peer returned)."""

    def __init__(self, code: str, detail: str, *, refused: bool = False) -> None:
        self.code = code
        self.detail = detail
        # The peer turned the call away before any work (REFUSED_STREAM; RESOURCE_EXHAUSTED,
        # a source over its share): the caller's load, not the peer's fault.
        self.refused = refused or code == "RESOURCE_EXHAUSTED"
        super().__init__(f"{code}: {detail}")


class _Inbox:
    __slots__ = ("messages", "ended")

    def __init__(self) -> None:
        self.messages: deque[bytes] = deque()
        self.ended: grpc_core.StreamEnded | None = None


class Channel(Driver):
    def __init__(self, cert_pem: bytes, server_name: str, *, address: tuple[str, int] | None = None,
                 relay: tuple[str, int] | None = None, relay_target: str | None = None,
                 connect_timeout: float = 10.0, send_timeout: float = 30.0, max_message_bytes: int = grpc_core.MAX_MESSAGE,
                 client_creds: TlsCredentials | None = None, source_address: tuple[str, int] | None = None) -> None:
        if relay is not None:
            if not relay_target:
                raise ValueError("a relayed channel needs the CONNECT target")
        elif address is None:
            raise ValueError("a direct channel needs an address")
        super().__init__()
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
        self._connect_lock = threading.Lock()
        self._inboxes: dict[int, _Inbox] = {}

    # --- calls ----------------------------------------------------------------------------------

    def unary(self, path: str, request: bytes, *, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        stream = self.stream(path, timeout=timeout, with_first_message=True)
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

    def stream(self, path: str, *, timeout: float | None = None, with_first_message: bool = False) -> "CallStream":
        """Open a call. ``timeout`` bounds the whole call (sent as grpc-timeout too).
        With ``with_first_message`` the headers go out with the first message, in
        one write: a server reads them together, and does not count the call as
        one that waits silent for its first message."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._connect(deadline)
        with self.lock:
            self._check()
            try:
                sid = self.wire.open_stream(path, timeout=timeout)
            except grpc_core.H2StreamClosed as e:
                raise ChannelError("UNAVAILABLE", str(e)) from None
            self._inboxes[sid] = _Inbox()
            call = CallStream(self, sid, deadline)
            if not with_first_message:
                self.write_quietly()
                # The write broke the channel: what was read before (a GOAWAY: never taken,
                # refused) says how this call ended, as for a failed send; else why it broke.
                call._raise_if_ended()
                self._check()
        return call

    def close(self) -> None:
        with self._connect_lock, self.lock:  # not while a connection is being set up
            # every open call ends UNAVAILABLE, never as a clean end
            self.goaway_locked("the channel was closed")
            self.release_locked()  # now, or when a reader still in poll returns

    # --- connection -----------------------------------------------------------------------------

    def _connect(self, deadline: float | None) -> None:
        if self.wire is not None:
            return
        with self._connect_lock:
            if self.wire is not None:
                return
            if self.broken is not None:
                raise ChannelError("UNAVAILABLE", self.broken)
            limit = time.monotonic() + self.connect_timeout
            deadline = limit if deadline is None else min(deadline, limit)
            try:
                self._handshake(deadline)
            except (ChannelError, OSError, ssl.SSLError) as e:
                error = e if isinstance(e, ChannelError) else ChannelError("UNAVAILABLE", f"cannot connect: {e}")
                with self.lock:
                    self.break_locked(error.detail)
                raise error from None

    def _handshake(self, deadline: float) -> None:
        target = self._relay if self._relay is not None else self._address
        sock = socket.create_connection(target, timeout=max(0.001, deadline - time.monotonic()),
                                        source_address=self._source)
        self.sock = sock
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Reads wait in poll() with each call's deadline; a write to a peer that
        # stopped reading gives up after send_timeout instead of blocking forever.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(self._send_timeout), 0))
        early = b""
        if self._relay is not None:
            early = self._connect_through_relay(deadline)
        ctx = client_context(self._cert, self._client_creds)  # the pinned certificate is the only root
        tls = ctx.wrap_bio(self.tls_in, self.tls_out, server_hostname=self._name)
        if early:
            self.tls_in.write(early)
        try:
            handshake(tls, self.tls_in, self.tls_out, self.send_raw, lambda: self._recv_raw(deadline))
        except ssl.SSLError as e:
            raise ChannelError("UNAVAILABLE", f"TLS handshake failed: {e.reason or e}") from None
        except ConnectionError as e:
            raise ChannelError("UNAVAILABLE", str(e)) from None
        conn = grpc_core.client(authority=self._name, max_message_bytes=self._max_message)
        conn.initiate()
        with self.lock:
            self.tls = tls
            self.wire = conn
            self.write_locked()

    def _connect_through_relay(self, deadline: float) -> bytes:
        dialog = ConnectDialog(self._relay_target)
        self.send_raw(dialog.request)
        while True:
            try:
                early = dialog.receive(self._recv_raw(deadline))
            except ConnectError as e:
                # busy (429): the peer's circuits are all held now, a limit (wait and ask again), not a fault
                raise ChannelError("UNAVAILABLE", str(e), refused=e.busy) from None
            if early is not None:
                return early

    def _recv_raw(self, deadline: float | None) -> bytes:
        data = self.recv_by(deadline)
        if data is None:
            raise ChannelError("DEADLINE_EXCEEDED", "no answer before the deadline")
        return data

    # --- the shared reader (driver.py) ------------------------------------------------------------

    def _check(self) -> None:
        if self.broken is not None:
            raise ChannelError("UNAVAILABLE", self.broken)

    def on_broken_locked(self) -> None:
        for inbox in self._inboxes.values():  # every waiter gets the reason
            if inbox.ended is None:
                inbox.ended = grpc_core.StreamEnded(0, grpc_core.UNAVAILABLE, self.broken)

    def dispatch_locked(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, grpc_core.Message):
                inbox = self._inboxes.get(ev.stream_id)
                if inbox is not None:
                    inbox.messages.append(ev.data)
            elif isinstance(ev, grpc_core.StreamEnded):
                inbox = self._inboxes.get(ev.stream_id)
                if inbox is not None and inbox.ended is None:
                    inbox.ended = ev

    def _wait(self, ready: Callable[[], bool], deadline: float | None) -> None:
        """Return once ``ready()`` (checked under the lock) or the channel broke
        (the inbox then carries why); read the socket meanwhile unless another
        thread already is."""
        with self.cond:
            if not self.wait_locked(ready, deadline):
                raise ChannelError("DEADLINE_EXCEEDED", "no answer before the deadline")


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

    def send(self, message: bytes, *, end: bool = False, deadline: float | None = None, wait: bool = True) -> bool:
        """Send ``message``: what the peer's flow-control window admits is written now.
        With ``wait`` (the default) the rest too, reading until the window grants it,
        and True; without, the rest stays queued and the answer is whether any does
        (then :meth:`flush` waits for it)."""
        ch = self._ch
        with ch.lock:
            self._raise_if_ended()
            try:
                ch.wire.send_message(self.id, message, end_stream=end)
            except grpc_core.H2StreamClosed:
                self._raise_if_ended()
                raise ChannelError("INTERNAL", "the call is closed for sending") from None
            ch.write_quietly()
            self._raise_if_ended()  # the write broke the channel
            waiting = ch.wire.pending(self.id)
        if not wait:
            return bool(waiting)
        if waiting:
            self.flush(deadline=deadline)
        return True

    def flush(self, *, deadline: float | None = None) -> None:
        """Wait until what was sent is all written: more than the peer's flow-control
        window holds the rest back, so read until it grants more."""
        ch = self._ch
        with ch.lock:
            waiting = ch.wire.pending(self.id)
        if waiting:
            trace.event("ch.window", sid=self.id)
            ch._wait(lambda: not ch.wire.pending(self.id) or self._inbox.ended is not None, self._limit(deadline))
            with ch.lock:
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
        with ch.lock:
            if inbox.messages:
                message = inbox.messages.popleft()
                if ch.broken is None:
                    ch.wire.consumed(self.id, len(message) + 5)
                    ch.write_quietly()
                return message
            self._raise_if_ended()
            return None

    def wait_readable(self, timeout: float) -> bool:
        """Whether :meth:`recv` would return now (a message, or the call's end),
        waiting up to ``timeout`` and reading the socket meanwhile. Unlike recv's
        deadline, running out cancels nothing: a thread that only watches a call
        (the ring's link) wakes this often to see whether it still should."""
        inbox = self._inbox
        try:
            self._ch._wait(lambda: bool(inbox.messages) or inbox.ended is not None, time.monotonic() + timeout)
        except ChannelError:
            return False
        return True

    def ended(self) -> bool:
        """Whether the call has ended or its channel broke, after reading what has already
        arrived (without waiting for more, and leaving it to a thread that waits on the
        channel, if any); messages may still be queued before the end."""
        for _ in range(ENDED_READS):  # a backlog of messages may come before the end
            if self._inbox.ended is not None or self._ch.broken is not None:
                return True
            if not self._ch.poll(0):
                return False
            self._ch.read_once(0, unless_waiters=True)
        return self._inbox.ended is not None or self._ch.broken is not None

    def _raise_if_ended(self) -> None:
        ended = self._inbox.ended
        if ended is not None and ended.status != 0:
            raise ChannelError(grpc_core.GRPC_STATUS.get(ended.status, f"STATUS_{ended.status}"), ended.message,
                               refused=ended.refused)

    def end(self) -> None:
        """Half-close: no more requests on this call."""
        ch = self._ch
        with ch.lock:
            if ch.broken is None:
                ch.wire.end_stream(self.id)
                ch.write_quietly()

    def cancel(self) -> None:
        """Reset the call if it is still open; forget it either way."""
        ch = self._ch
        with ch.lock:
            inbox = ch._inboxes.pop(self.id, None)
            if inbox is None:
                return
            if ch.broken is None:
                for message in inbox.messages:
                    ch.wire.consumed(self.id, len(message) + 5)  # unread, but the window is ours again
                ch.wire.reset_stream(self.id)
                ch.write_quietly()
            inbox.messages.clear()  # credited once: a later recv must not credit them again
            if inbox.ended is None:  # a thread still waiting in recv wakes, and finds the call over
                inbox.ended = grpc_core.StreamEnded(self.id, grpc_core.CANCELLED, "the call was cancelled")
                ch.cond.notify_all()
