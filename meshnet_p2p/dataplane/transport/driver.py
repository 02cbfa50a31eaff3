"""The driver both ends of a gRPC connection share: a socket, TLS through
MemoryBIOs, the sans-io gRPC core (grpc_core.py), and the threads that use them.

Why a driver of our own (docs/dataplane.md): grpcio hands every message
between several threads, and on this project's 2-core machines those
hand-offs were most of a hop's overhead. Here the thread that waits for
something (a reply, a request, flow-control window) reads the socket itself:
while one thread reads, the others wait to be handed what is theirs
(``dispatch_locked``), so a message wakes no thread but the one it is for.

Under ``lock``: the SSL object and the core (so socket writes go out in the
order TLS produced them), and whatever the subclass keeps per stream. Without
it: waiting in poll. A broken connection stays broken, with the reason every
waiter is given. The descriptor is closed only once no thread can still poll
or send on it, so its number is never reused under a thread that holds it.

``channel.py`` (the client) and ``server.py`` (a server's connection) subclass
it with what each role keeps per stream and how it ends.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import threading
import time
from typing import Callable

from meshnet_p2p.core import trace
from . import grpc_core
from .tls import decrypt

POLL_IN = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
READ_SIZE = 1 << 18
SALVAGE_READS = 4  # reads of what came before a failed write (a GOAWAY is one frame)


class Driver:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.sock: socket.socket | None = None
        self.tls_in, self.tls_out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls: ssl.SSLObject | None = None
        self.wire: grpc_core.GrpcConnection | None = None
        self.broken: str | None = None  # why the connection ended; None while it serves
        self.waiters = 0  # threads in wait_locked
        self.reading = False  # one of them reads for the others
        self._fd_lock = threading.Lock()  # descriptor lifetime only: never held across I/O or with ``lock`` wanted
        self._pollers = 0
        self._closing = False
        self._fd_closed = False
        # A standby poller (a server's reader for when no handler waits) polls this too,
        # so a thread that comes to read for itself can send it away first: otherwise
        # both wake for the same bytes, at the moment a step's latency is made.
        self._aside: int | None = None
        self.standby_polling = False  # under lock: the standby is in (or about to enter) poll

    # --- what a role adds -----------------------------------------------------------------------

    def dispatch_locked(self, events: list) -> None:
        """Hand what arrived to the streams it is for (under the lock)."""
        raise NotImplementedError

    def on_broken_locked(self) -> None:
        """The connection ended (``self.broken`` says why): end every stream."""

    def read_pause(self) -> float:
        """Seconds to wait before the next read (a server throttles a source over its budget)."""
        return 0.0

    # --- sending --------------------------------------------------------------------------------

    def send_raw(self, data: bytes) -> None:
        if data:
            self.sock.sendall(data)  # SO_SNDTIMEO bounds a peer that stopped reading

    def write_locked(self) -> None:
        """Send what the core has queued. Raises OSError or ssl.SSLError."""
        data = self.wire.data_to_send()
        if data and self.broken is None:
            self.tls.write(data)
            self.send_raw(self.tls_out.read())

    def write_quietly(self) -> None:
        """Send what the core has queued; a failure breaks the connection."""
        if self.broken is not None:
            return
        try:
            self.write_locked()
        except (BlockingIOError, TimeoutError):
            self.break_locked("the peer took no data for the send timeout")
        except (OSError, ssl.SSLError) as e:
            self._salvage_locked()
            self.break_locked(f"connection lost: {e}")

    def _salvage_locked(self) -> None:
        """A write failed: read what the peer sent before it hung up. A server that
        closes a connection says so first (GOAWAY: which calls it never processed),
        and a reset makes writes fail while those bytes still wait to be read; lost,
        a call it never saw would look like a dead peer's (the keep-alive race of a
        pooled connection)."""
        for _ in range(SALVAGE_READS):
            try:
                data = self.sock.recv(READ_SIZE, socket.MSG_DONTWAIT)
                if not data or not self._take_locked(data):
                    return
            except Exception:  # whatever else is wrong with it, the connection is ending anyway
                return

    # --- receiving ------------------------------------------------------------------------------

    def feed_locked(self, data: bytes) -> None:
        """Decrypt, parse, dispatch, and send what the core answers (acks, window).
        Raises ``grpc_core.H2ProtocolError``, ``ssl.SSLError``, ``ConnectionError``."""
        if not self._take_locked(data):
            raise ConnectionError("the peer closed the TLS session")
        self.write_locked()

    def _take_locked(self, data: bytes) -> bool:
        """Decrypt and parse ``data`` and dispatch what it completes; False once the
        peer closed the TLS session."""
        plain, closed = decrypt(self.tls, self.tls_in, data)
        if plain:
            self.dispatch_locked(self.wire.receive_data(plain))
        return not closed

    def poll(self, timeout: float | None, *, standby: bool = False) -> bool:
        """Without the lock: wait until the socket is readable (True) or ``timeout``;
        a ``standby`` poll also returns (False) when a thread sent it aside."""
        with self._fd_lock:
            if self._fd_closed:
                return True  # the caller finds the connection broken
            self._pollers += 1
        try:
            poller = select.poll()  # one per wait: a poll object is not for concurrent use
            poller.register(self.sock, POLL_IN)
            aside = self._aside if standby else None
            if aside is not None:
                poller.register(aside, select.POLLIN)
            ready = poller.poll(-1 if timeout is None else max(0, int(timeout * 1000 + 0.999)))
            if aside is None:
                return bool(ready)
            readable = False
            for fd, _ in ready:
                if fd == aside:
                    try:
                        os.eventfd_read(aside)
                    except BlockingIOError:
                        pass
                else:
                    readable = True
            return readable
        finally:
            with self._fd_lock:
                self._pollers -= 1
                if self._closing and not self._pollers and not self._fd_closed:
                    self._close_fds()

    def use_standby(self) -> None:
        """Give this connection the means to send a standby poller aside (before it runs)."""
        self._aside = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def _close_fds(self) -> None:
        self._fd_closed = True
        self.sock.close()
        if self._aside is not None:
            os.close(self._aside)

    def recv_by(self, deadline: float | None) -> bytes | None:
        """One thread, while connecting (TLS handshake, a relay's answer): the next
        bytes, or None once ``deadline`` has passed."""
        while not self.poll(None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                return None
        return self.sock.recv(READ_SIZE)

    def read_once(self, timeout: float | None, *, unless_waiters: bool = False, standby: bool = False) -> None:
        """Without the lock: wait for bytes (or ``timeout``), then read what is
        there and dispatch it under the lock (a non-blocking read: if another
        thread read them first, nothing). With ``unless_waiters`` (a server's
        standby reader) bytes are left to a waiting thread, so a step's request
        is read by the thread that runs it."""
        if not self.poll(timeout, standby=standby):
            return
        with self.cond:
            if self.broken is not None or (unless_waiters and self.waiters):
                return
            try:
                data = self.sock.recv(READ_SIZE, socket.MSG_DONTWAIT)
                if not data:
                    raise ConnectionError("the peer closed the connection")
                trace.event("rd", n=len(data))  # bytes off the socket, before TLS and HTTP/2
                self.feed_locked(data)
            except BlockingIOError:
                return
            except grpc_core.H2ProtocolError as e:  # the core queued a GOAWAY saying why: send it, hang up
                try:
                    self.write_locked()
                except (OSError, ssl.SSLError):
                    pass
                self.break_locked(f"HTTP/2 protocol error: {e}")
            except ssl.SSLError as e:  # a record that fails its MAC: someone changed bytes in flight
                self.break_locked(f"TLS failure (data altered or corrupt): {e.reason or e}")
            except OSError as e:  # ConnectionError included
                self.break_locked(str(e) or f"connection lost: {type(e).__name__}")
            except Exception as e:  # a bug in handling this peer's input: the connection ends, never the thread
                self.break_locked(f"{type(e).__name__}: {e}")
            finally:
                self.cond.notify_all()

    def wait_locked(self, ready: Callable[[], bool], deadline: float | None) -> bool:
        """Under the lock: until ``ready()`` (True), the connection breaks (True:
        the caller looks), or the deadline (False). Reads the socket itself when
        no other waiting thread is; otherwise is handed what arrives."""
        self.waiters += 1
        try:
            while True:
                if ready() or self.broken is not None:
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                if self.reading:
                    self.cond.wait(remaining)
                    continue
                pause = self.read_pause()
                if pause > 0:
                    self.cond.wait(pause if remaining is None else min(pause, remaining))
                    continue
                if self.standby_polling:  # this thread reads for itself: the standby steps aside
                    self.standby_polling = False
                    os.eventfd_write(self._aside, 1)
                self.reading = True
                self.lock.release()
                try:
                    self.read_once(remaining)
                finally:
                    self.lock.acquire()
                    self.reading = False
                    self.cond.notify_all()
        finally:
            self.waiters -= 1
            if not self.waiters:
                self.cond.notify_all()  # a server's standby reads again

    # --- ending ---------------------------------------------------------------------------------

    def break_locked(self, why: str) -> None:
        """End the connection: every stream ends with ``why``, and whoever polls is woken."""
        if self.broken is not None:
            return
        self.broken = why
        self.on_broken_locked()
        self.cond.notify_all()
        self.shutdown()

    def goaway_locked(self, why: str, code: int = grpc_core.NO_ERROR) -> None:
        """End the connection saying why: GOAWAY (h2 takes nothing after it), then break."""
        if self.broken is None and self.wire is not None:
            self.wire.close(code, why)
            self.write_quietly()
        self.break_locked(why)

    def shutdown(self) -> None:
        """Wake whoever polls or sends on the socket (any thread, lock or not)."""
        with self._fd_lock:
            if self.sock is not None and not self._fd_closed:
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def release_locked(self) -> None:
        """Under the lock, once broken: close the descriptor now, or when the last
        thread polling it returns. (Sends happen under the lock and never once
        broken, so none can be using it.)"""
        with self._fd_lock:
            if self.sock is None or self._fd_closed:
                return
            self._closing = True
            if not self._pollers:
                self._close_fds()
