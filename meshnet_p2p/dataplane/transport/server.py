"""A gRPC server (HTTP/2 + identity-bound TLS) that knows no application,
started and stopped from trio.

Services register a method table (``register``): a method's full path, its
kind (unary, server-streaming, bidirectional) and a handler on message bytes.
Each handler is told who calls (a ``Caller``: the peer ID the client's TLS
certificate proves, its source's host group, its connection); decoding and
who-may-do-what are the service's. What stays here is fairness between
connections and their sources: per-source connection caps and evictions, call
budgets, unary workers shared in turn (FairPool), GOAWAY, keepalive.

Our own server, not grpcio's: on this project's 2-core machines grpcio's
server spent about 0.15 ms of every hop passing each message from its poller
to a handler thread and through its event engine (docs/dataplane.md). Here a
handler that waits for its stream's next request reads the socket itself, so
a step's request reaches the thread that runs it with no hand-off. Each
connection also has a standby thread that reads while no handler waits (a
Cancel must reach a running step). It polls alongside a waiting handler but
never reads while one waits, so it never has to be asked to step aside.
Among waiting handlers one reads at a time and hands the others what is theirs.

Threads: one acceptor; one standby reader per connection; handlers on a
bounded pool (a stream holds one for its lifetime, unary calls briefly), and
background streams on a small pool of their own at the lowest CPU priority.
``stop`` ends them all: no thread or session is left behind.
"""

from __future__ import annotations

import errno
import itertools
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Mapping

import trio

from meshnet_p2p.core import trace
from meshnet_p2p.core.ratelimit import TokenBucket
from meshnet_p2p.core.stats import Counters
from . import grpc_core
from .driver import Driver
from .fair_pool import FairPool
from meshnet_p2p.core.netgroup import host_group
from .tls import TlsBindingError, TlsCredentials, handshake, peer_of_der, server_context

MAX_CALLS = 32  # concurrent calls per connection (a route opens one stream per peer, plus brief unary calls)
MAX_WAITING_CALLS = 4  # calls per connection whose first message has not come yet (they hold no worker)
FIRST_MESSAGE_TIMEOUT = 10.0  # a call that sends no first message this long is ended
SEND_TIMEOUT = 30.0  # a reply the client's flow-control window never lets out ends the call
# per host_group (an IPv4 address, an IPv6 /64); relayed ones share the relay's. Half of the
# default max_connections: a crowd behind one NAT (sixteen users, each a connection, plus a
# ring link) fits, and one source never holds every connection.
MAX_CONNECTIONS_PER_SOURCE = 32
IDLE_CONNECTION_S = 60.0  # a connection with no call for this long is closed (GOAWAY)
KEEPALIVE_S = 20.0  # a connection with calls but nothing heard for this long is sent a PING...
KEEPALIVE_TIMEOUT_S = 10.0  # ...and closed if the answer takes longer (a client that vanished)
UNARY_WORKERS = 4
# Calls one source may start per second (a burst of twice that): past it, its
# connections are read no sooner than its budget allows, so TCP holds back a
# flood of cheap calls at no CPU to us, and other sources' calls get read.
CALLS_PER_SOURCE_PER_S = 200.0
# Connections one source may open a second, after a burst of them at once: each costs a
# TLS handshake (~2 ms of CPU here), so a source reconnecting in a loop (a client the
# peer made give way, reconnecting at once) would spend the peer's CPU at will. Past it,
# a new connection's handshake waits its turn (at most another burst's worth of them: the
# rest are closed before any TLS work), as an over-budget source's calls wait to be read.
CONNECTIONS_PER_SOURCE_PER_S = 10.0
CONNECTION_BURST_PER_SOURCE = MAX_CONNECTIONS_PER_SOURCE  # at once: a crowd behind one NAT starting together
UNARY_QUEUE_PER_SOURCE = 64  # unary calls one source may have waiting for a worker
# Background streams (bulk transfers, e.g. model files) at once: past it, RESOURCE_EXHAUSTED.
BACKGROUND_WORKERS = 8
BACKGROUND_NICE = 19  # the lowest CPU priority: under contention the OS runs every other thread first


def _lowest_priority() -> None:
    """Run this thread (only: on Linux a thread's ID names it alone) at the lowest CPU
    priority. A thread can lower its own priority unprivileged, never raise it back, so
    only threads that serve background calls for their whole life do this."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):  # no per-thread priority here: background calls just run
        pass


# --- what a service registers, and what its handlers are given ---------------------------------

UNARY = "unary"  # handler(request: bytes, caller) -> bytes
SERVER_STREAM = "server-stream"  # handler(request: bytes, caller) -> Iterable[bytes]
# handler(requests: Iterator[bytes], caller, send) -> Iterable[bytes]: what it yields is sent in
# order; ``send(bytes)`` sends one more from any thread (a reply another call's work produced)
BIDI = "bidi"
KINDS = (UNARY, SERVER_STREAM, BIDI)


@dataclass(frozen=True)
class Method:
    kind: str  # one of KINDS
    handler: Callable
    # a stream below everything else: on threads of its own at the lowest CPU priority, holding
    # no worker a session needs (serving model files must not starve inference)
    background: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a method is one of {KINDS}, not {self.kind!r}")


@dataclass(frozen=True)
class Caller:
    """Who a call comes from, as far as the transport can prove it."""

    peer_id: str | None  # the identity its TLS client certificate proves (tls.peer_of_der); None: anonymous
    host_group: str  # core.netgroup.host_group of its source address (a relay's, for relayed clients)
    connection: int  # unique per connection: calls with the same one come from the same client connection


class Abort(Exception):
    """Raised by a handler (or the request iterator it reads) to end its call with
    a gRPC status (grpc_core.INTERNAL, ...) and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_connections = itertools.count(1)  # Caller.connection: never reused within the process


class _Call:
    __slots__ = ("sid", "method", "inbox", "ended", "done", "cancelled", "started", "created")

    def __init__(self, sid: int, method: Method) -> None:
        self.created = time.monotonic()
        self.sid = sid
        self.method = method
        self.inbox: list[bytes] = []
        self.ended = False  # no more requests: the client half-closed or reset, or the connection is gone
        self.done = False  # our side finished (trailers sent)
        self.cancelled = False  # the client reset it, or it could not be sent to: nobody reads more replies
        self.started = False  # a handler runs it


class _Connection(Driver):
    """One client connection on the shared driver (driver.py): the calls it
    carries, their handlers, and a standby reader for when no handler waits."""

    def __init__(self, server: "Server", sock: socket.socket, handshake_after: float = 0.0) -> None:
        super().__init__()
        self.server = server
        self.sock = sock
        self.handshake_after = handshake_after  # its source's turn (Server._connection_turn)
        self.tls = server.ssl_context.wrap_bio(self.tls_in, self.tls_out, server_side=True)
        self.wire = grpc_core.server(max_streams=MAX_CALLS)
        self.calls: dict[int, _Call] = {}
        self.use_standby()
        self.thread = threading.Thread(target=self._run, name="shard-conn", daemon=True)
        # Who is asking: its peer ID is set once the TLS handshake proves it.
        self.caller = Caller(None, _source_of(sock), next(_connections))
        self.last_active = time.monotonic()  # when a call last started or ended (idle connections close)
        self.ping_sent: float | None = None  # when an unanswered keepalive PING went out

    # --- life cycle -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.handshake_after > 0:  # no TLS work before its source's turn
                with self.cond:
                    self.cond.wait_for(lambda: self.broken is not None, self.handshake_after)
                    if self.broken is not None:
                        raise _Closed()
            self._handshake(time.monotonic() + self.server.handshake_timeout)
            self._standby()
        except (OSError, ssl.SSLError, grpc_core.H2ProtocolError, TlsBindingError, _Closed):
            pass  # a client certificate that claims an identity it cannot prove ends here too
        finally:
            self.close()
            with self.cond:
                while True:
                    # Calls no handler ever took (a unary call whose request never came) end here;
                    # nothing can feed the connection any more once it is broken and nobody reads.
                    for call in [c for c in self.calls.values() if not c.started]:
                        del self.calls[call.sid]
                        self._discard_inbox(call)
                    if not self.calls and not self.reading:  # every handler has let go of the connection
                        break
                    self.cond.wait()
                self.release_locked()
            self.server._forget(self)

    def _handshake(self, deadline: float) -> None:
        handshake(self.tls, self.tls_in, self.tls_out, self.send_raw, lambda: self._recv_raw(deadline))
        client = peer_of_der(self.tls.getpeercert(binary_form=True))
        if client is not None:
            self.caller = replace(self.caller, peer_id=str(client))
        with self.lock:
            if self.broken is not None:  # closed meanwhile (the server stopping): its HTTP/2 is already shut
                raise _Closed()
            self.wire.initiate()
            # What came in the same read as the handshake's end (the client's preface,
            # SETTINGS, even a first call) is already in the TLS buffer: handle it now.
            self.feed_locked(b"")

    def close(self, why: str = "closed") -> None:
        with self.cond:
            self.break_locked(why)

    def give_way(self) -> None:
        """Closed to make room: a GOAWAY first, so a call the client sent meanwhile is
        known never processed (safe to retry), not a broken peer."""
        with self.cond:
            self.goaway_locked("gave way to a newer connection (a connection limit)")

    def on_broken_locked(self) -> None:
        for call in self.calls.values():
            call.ended = True

    def read_pause(self) -> float:
        return self.server.read_pause(self.caller.host_group)

    def _recv_raw(self, deadline: float) -> bytes:
        data = self.recv_by(deadline)
        if data is None:
            raise _Closed()
        self.server.stats.add("bytes_in", len(data))
        return data

    # What crosses this connection's socket (TLS records, the handshake's too), for metrics.
    def send_raw(self, data: bytes) -> None:
        super().send_raw(data)
        self.server.stats.add("bytes_out", len(data))

    def feed_locked(self, data: bytes) -> None:
        self.server.stats.add("bytes_in", len(data))
        super().feed_locked(data)

    def dispatch_locked(self, events: list) -> None:
        """Hand each call what arrived for it (under the lock)."""
        for ev in events:
            if isinstance(ev, grpc_core.Message):
                trace.event("srv.msg", sid=ev.stream_id, n=len(ev.data))
                call = self.calls.get(ev.stream_id)
                if call is None or call.ended:  # a refused or finished call: nobody will take it
                    self.wire.consumed(ev.stream_id, len(ev.data) + 5)
                    continue
                call.inbox.append(ev.data)
                self._launch(call)
            elif isinstance(ev, grpc_core.RequestStarted):
                self._start_call(ev)
            elif isinstance(ev, (grpc_core.RequestEnded, grpc_core.StreamReset)):
                call = self.calls.get(ev.stream_id)
                if call is not None:
                    call.ended = True
                    if isinstance(ev, grpc_core.StreamReset):  # a cancelled call's unread requests are void
                        call.cancelled = True
                        self._discard_inbox(call)
                        if not call.started:  # never took a worker: nothing runs for it (rapid reset)
                            del self.calls[call.sid]
                            continue
                    self._launch(call)
            elif isinstance(ev, grpc_core.PingAcked):
                self.ping_sent = None
        self._refuse_excess_waiting()

    def _refuse_excess_waiting(self) -> None:
        """Calls whose first message did not come in the same read as their
        headers wait, at most MAX_WAITING_CALLS per connection; newer ones are
        refused. Counted once a read is handled, so a client that sends many
        calls' headers before their messages (pipelining, as h2load does) is not
        mistaken for a silent one."""
        if len(self.calls) <= MAX_WAITING_CALLS:  # the usual case, on every read: nothing to count
            return
        waiting = sorted(c.sid for c in self.calls.values() if not c.started)
        for sid in waiting[MAX_WAITING_CALLS:]:
            call = self.calls.pop(sid)
            self._discard_inbox(call)
            self.wire.refuse(sid)

    def _discard_inbox(self, call: _Call) -> None:
        for raw in call.inbox:
            self.wire.consumed(call.sid, len(raw) + 5)
        call.inbox.clear()

    def idle(self) -> bool:
        """No call is being answered: closing it loses nothing but silent calls (handshaking
        ones too). An answered call (trailers sent) counts as over though its worker may
        still be letting go of it: its client has its answer and may connect again at once."""
        return not self.broken and not any(c.started and not c.done for c in self.calls.values())

    def _standby(self) -> None:
        """Read while no handler waits to (so Cancels reach running steps); close
        the connection once it has had no call for the idle timeout."""
        while True:
            with self.cond:
                while not self.broken and self.waiters:
                    self.cond.wait()
                if self.broken:
                    return
                now = time.monotonic()
                wake = self._end_silent_calls_locked(now)
                if self.idle():
                    if now - self.last_active >= self.server.idle_timeout:
                        self.goaway_locked("idle")
                        return
                    wake = min(wake, self.last_active + self.server.idle_timeout)
                else:  # nothing wakes this poll when the last call ends: look again by then
                    wake = min(wake, now + self.server.idle_timeout)
                pause = self.read_pause()
                if pause > 0:  # its source has started more calls than its budget: read later
                    self.cond.wait(min(wake - now, pause))
                    continue
                self.standby_polling = True  # a handler that comes to read sends this poll aside
            try:
                self.read_once(None if wake == float("inf") else wake - now, unless_waiters=True, standby=True)
            finally:
                with self.lock:
                    self.standby_polling = False

    def _end_silent_calls_locked(self, now: float) -> float:
        """End calls whose first message has not come within FIRST_MESSAGE_TIMEOUT;
        returns when the next one would be due (inf if none waits)."""
        due, ended = float("inf"), False
        for call in [c for c in self.calls.values() if not c.started]:
            if now - call.created >= FIRST_MESSAGE_TIMEOUT:
                del self.calls[call.sid]
                self._discard_inbox(call)
                self.wire.send_trailers(call.sid, grpc_core.DEADLINE_EXCEEDED, f"no request within {FIRST_MESSAGE_TIMEOUT:g} s")
                ended = True
            else:
                due = min(due, call.created + FIRST_MESSAGE_TIMEOUT)
        if ended:
            self.write_quietly()
        return due

    def next_request(self, call: _Call, timeout: float | None = None) -> bytes | None:
        """A handler's wait for its call's next message. None once the call has
        ended (or nothing came within ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            self.wait_locked(lambda: bool(call.inbox) or call.ended, deadline)
            if not call.inbox:
                return None
            raw = call.inbox.pop(0)
            self.wire.consumed(call.sid, len(raw) + 5)  # the client may send this much more
            self.write_quietly()
            return raw

    # --- calls ----------------------------------------------------------------------------------

    def _start_call(self, ev: grpc_core.RequestStarted) -> None:
        method = self.server.methods.get(ev.path)
        if method is None:
            self.wire.send_trailers(ev.stream_id, grpc_core.UNIMPLEMENTED, f"unknown method {ev.path[:128]}")
            return
        if self.broken:
            return
        if self.server.draining:
            self.wire.send_trailers(ev.stream_id, grpc_core.UNAVAILABLE, "the server is shutting down")
            return
        self.server.charge_call(self.caller.host_group)
        # (Calls past MAX_CALLS never get here: the core refuses them, REFUSED_STREAM.)
        self.calls[ev.stream_id] = _Call(ev.stream_id, method)
        # A call waits for its first message (a stream's opening one too) before it takes a
        # worker: a silent one holds none, and the standby ends it after FIRST_MESSAGE_TIMEOUT.

    def _launch(self, call: _Call) -> None:
        """Give a call its handler once its first message (or its end) has come.
        Streams hold a worker of the main pool for their lifetime; unary calls are
        brief and have a pool of their own, so a Cancel never waits behind streams;
        background streams have theirs, at the lowest CPU priority."""
        if call.started:
            return
        streaming, background = call.method.kind != UNARY, call.method.background
        if background and not self.server.background_slots.acquire(blocking=False):
            # refused, never queued: the client asks another peer or later
            return self._drop(call, grpc_core.RESOURCE_EXHAUSTED,
                              f"{BACKGROUND_WORKERS} background calls are running here")
        if streaming and not background and not self.server.take_session_slot():
            self.calls.pop(call.sid, None)  # every worker runs a session: refused, never queued
            self._discard_inbox(call)
            self.wire.refuse(call.sid)
            return
        call.started = True
        self.last_active = time.monotonic()
        try:
            if background:
                self.server.background_executor.submit(self._handle, call)
            elif streaming:
                self.server.executor.submit(self._handle, call)
            elif not self.server.unary_executor.submit(self.caller.host_group, lambda: self._handle(call)):
                call.started = False  # its source has a full queue: this call is refused, not queued
                self._drop(call, grpc_core.RESOURCE_EXHAUSTED,
                           f"over {UNARY_QUEUE_PER_SOURCE} calls from your address wait already")
        except RuntimeError:  # the pool is shut down
            self._release_worker(call)
            self._drop(call, grpc_core.UNAVAILABLE, "the server is shutting down")

    def _drop(self, call: _Call, status: int, message: str) -> None:
        """End a call no handler runs, with ``status``."""
        self.calls.pop(call.sid, None)
        self._discard_inbox(call)
        self.wire.send_trailers(call.sid, status, message)

    def _release_worker(self, call: _Call) -> None:
        """Give back the place a launched stream took (unary calls take none)."""
        if call.method.background:
            self.server.background_slots.release()
        elif call.method.kind != UNARY:
            self.server.release_session_slot()

    def _handle(self, call: _Call) -> None:
        try:
            kind = call.method.kind
            if kind == BIDI:
                self._bidi(call)
            else:
                self._single(call, kind == SERVER_STREAM)
        except Abort as e:  # the service ends its call with a status of its choosing
            self.finish(call, e.status, e.message)
        except Exception as e:  # a bug must end this call, not the connection or the peer
            self.finish(call, grpc_core.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            self._release_worker(call)
            with self.cond:
                self.calls.pop(call.sid, None)
                self.last_active = time.monotonic()
                self._discard_inbox(call)  # requests it never read: their window goes back to the client
                self.write_quietly()
                self.cond.notify_all()
            with self.server._changed:
                self.server._changed.notify_all()

    def _single(self, call: _Call, streaming: bool) -> None:
        """A call of one request: unary, or server-streaming."""
        raw = self.next_request(call, FIRST_MESSAGE_TIMEOUT)  # here already, unless it ended empty
        if raw is None:
            return self.finish(call, grpc_core.INTERNAL, "no request message")
        replies = call.method.handler(raw, self.caller)
        if not streaming:
            self.send(call, replies)
        else:
            try:
                for reply in replies:
                    if call.cancelled or self.broken:  # nobody reads the rest: stop making it
                        return
                    self.send(call, reply)
            finally:
                getattr(replies, "close", lambda: None)()  # the handler's own finally runs now
        self.finish(call, grpc_core.OK, "")

    def _bidi(self, call: _Call) -> None:
        silent = []

        def requests() -> Iterator[bytes]:
            first = True
            while True:
                # The first message must come soon; later ones may take as long as a generation.
                raw = self.next_request(call, FIRST_MESSAGE_TIMEOUT if first else None)
                if raw is None:
                    if first and not call.ended:
                        silent.append(True)
                    return
                first = False
                yield raw

        replies: Iterable[bytes] = call.method.handler(requests(), self.caller, lambda m: self.send(call, m))
        for reply in replies:
            self.send(call, reply)
        if silent:
            return self.finish(call, grpc_core.DEADLINE_EXCEEDED, f"no request within {FIRST_MESSAGE_TIMEOUT:g} s")
        self.finish(call, grpc_core.OK, "")

    def send(self, call: _Call, message: bytes) -> None:
        """Send one reply; if the client's flow-control window holds it back, wait
        (reading meanwhile) for the window rather than queue without bound."""
        with self.cond:
            if self.broken or call.done:
                return
            try:
                self.wire.send_message(call.sid, message)
            except grpc_core.H2StreamClosed:
                call.ended = call.cancelled = True
                return
            self.write_quietly()
            if trace.enabled() and self.wire.pending(call.sid):
                trace.event("srv.window", sid=call.sid)  # the client's flow-control window holds it back
            if not self.wait_locked(lambda: not self.wire.pending(call.sid),  # a reset call has nothing pending
                                     time.monotonic() + SEND_TIMEOUT):
                call.ended = call.cancelled = True
                self.wire.reset_stream(call.sid, grpc_core.CANCEL)
                self.write_quietly()

    def finish(self, call: _Call, status: int, message: str) -> None:
        with self.cond:
            if self.broken or call.done:
                return
            call.done = True
            self.last_active = time.monotonic()  # idle from now (idle())
            self.wire.send_trailers(call.sid, status, message)
            self.write_quietly()



class _Closed(Exception):
    pass


class _PerSource:
    """A budget (TokenBucket) per source, full when first used. Past ``keep`` sources,
    those whose budget is full again are forgotten: they would start full anyway."""

    def __init__(self, burst: float, rate: float, keep: int) -> None:
        self.burst, self.rate, self.keep = burst, rate, keep
        self._buckets: dict[str, TokenBucket] = {}

    def find(self, host: str) -> TokenBucket | None:
        return self._buckets.get(host)

    def get(self, host: str, now: float) -> TokenBucket:
        bucket = self._buckets.get(host)
        if bucket is None:
            if len(self._buckets) >= self.keep:
                self._buckets = {h: b for h, b in self._buckets.items() if b.level(now) < b.burst}
            bucket = self._buckets[host] = TokenBucket(self.burst, self.rate, now)
        return bucket


def _source_of(sock: socket.socket) -> str:
    try:
        return host_group(str(sock.getpeername()[0]))
    except (OSError, IndexError, TypeError):  # a socketpair in tests, or a peer already gone
        return "local"


def _longest_idle(conns: list[_Connection]) -> _Connection | None:
    idle = [c for c in conns if c.idle()]
    return min(idle, key=lambda c: c.last_active) if idle else None


class Server:
    """Serves the methods services ``register`` on one TLS listener (and on
    sockets handed to ``adopt``); an unregistered path gets UNIMPLEMENTED."""

    def __init__(self, creds: TlsCredentials, *, host: str = "127.0.0.1",
                 port: int = 0, max_workers: int = 32, max_connections: int = 64,
                 max_connections_per_source: int = MAX_CONNECTIONS_PER_SOURCE,
                 connections_per_source_per_s: float = CONNECTIONS_PER_SOURCE_PER_S,
                 connection_burst_per_source: int = CONNECTION_BURST_PER_SOURCE, handshake_timeout: float = 10.0,
                 idle_timeout: float = IDLE_CONNECTION_S, keepalive: float = KEEPALIVE_S,
                 keepalive_timeout: float = KEEPALIVE_TIMEOUT_S) -> None:
        self.methods: dict[str, Method] = {}  # full path ("/package.Service/Method") -> Method
        self._on_stop: list[Callable[[], None]] = []
        self.ssl_context = server_context(creds)
        self.executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="shard-rpc")
        self._session_slots = threading.BoundedSemaphore(max_workers)  # a stream never queues for a worker
        # Unary calls have workers of their own, shared between sources in turn: a
        # Cancel never waits behind streams, nor one source's calls behind another's flood.
        self.unary_executor = FairPool(UNARY_WORKERS, per_source=UNARY_QUEUE_PER_SOURCE, name="shard-rpc-unary")
        self.background_executor = futures.ThreadPoolExecutor(max_workers=BACKGROUND_WORKERS,
                                                              thread_name_prefix="shard-rpc-background",
                                                              initializer=_lowest_priority)
        self.background_slots = threading.BoundedSemaphore(BACKGROUND_WORKERS)
        self.max_connections = max_connections
        self.max_connections_per_source = max_connections_per_source
        # per source, under self._lock (adopt)
        self._connection_budgets = _PerSource(connection_burst_per_source, connections_per_source_per_s,
                                              4 * max_connections)
        self.idle_timeout = idle_timeout
        self.keepalive = keepalive
        self.keepalive_timeout = keepalive_timeout
        self.handshake_timeout = handshake_timeout
        self.draining = False
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._conns: set[_Connection] = set()
        # bytes read and written on client connections, connections served: read by metrics
        self.stats = Counters(("bytes_in", "bytes_out", "connections"))
        self._call_budgets = _PerSource(int(2 * CALLS_PER_SOURCE_PER_S), CALLS_PER_SOURCE_PER_S,
                                        4 * max_connections)  # per source (charge_call)
        self._budget_lock = threading.Lock()
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._stop_r, self._stop_w = os.pipe()
        self._acceptor = threading.Thread(target=self._accept, name="shard-accept", daemon=True)
        self._started = False

    def register(self, methods: Mapping[str, Method], *, on_stop: Callable[[], None] | None = None) -> "Server":
        """Serve ``methods`` (before ``start``); ``on_stop`` runs once every call has
        ended on ``stop`` (a service's own connections, say). Returns the server."""
        if self._started:
            raise RuntimeError("methods are registered before the server starts")
        taken = self.methods.keys() & methods.keys()
        if taken:
            raise ValueError(f"already registered: {sorted(taken)}")
        self.methods.update(methods)
        if on_stop is not None:
            self._on_stop.append(on_stop)
        return self

    def start(self) -> "Server":
        self._started = True
        self._acceptor.start()
        return self

    def _accept(self) -> None:
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        tick = max(1, int(min(self.keepalive, self.keepalive_timeout) * 250))  # ms: a quarter of the shorter
        while True:
            ready = dict(poller.poll(tick))
            if self._stop_r in ready:
                return
            self._keepalive()
            if self._listener.fileno() not in ready:
                continue
            try:
                sock, _ = self._listener.accept()
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    select.select([self._stop_r], [], [], 0.1)  # out of descriptors or memory: back off, don't spin
                continue
            self.adopt(sock)

    def adopt(self, sock: socket.socket) -> None:
        """Serve an already connected socket: an accepted client, or a data
        connection a relay opened for one (its TLS runs end to end through it)."""
        source = _source_of(sock)
        with self._lock:
            wait = self._connection_turn(source)
            if wait is None:
                self.stats.add("connections_over_rate")
                sock.close()
                return
            victim = None if self.draining else self._make_room(source)
            if victim is None:
                sock.close()
                return
            if victim is not True:
                victim.give_way()  # an idle connection gives way (its thread ends it; no call is lost)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT), 0))
                conn = _Connection(self, sock, handshake_after=wait)
            except OSError:  # e.g. no descriptor left for its pipe: drop this one, keep serving
                sock.close()
                return
            self._conns.add(conn)
            self.stats.add("connections")
            conn.thread.start()  # under the lock: stop() never sees a connection whose thread has not started

    def _connection_turn(self, host: str) -> float | None:
        """Under the lock: seconds a new connection from ``host`` waits before its
        handshake (a burst of them at once, then connections_per_source_per_s), or None
        if it is refused (already a burst's worth waiting)."""
        now = time.monotonic()
        budget = self._connection_budgets.get(host, now)
        if budget.level(now) - 1 < -budget.burst:
            return None
        budget.charge(now)
        return budget.debt_s(now)

    def _make_room(self, host: str):
        """Under the lock: may a new connection from ``host`` be served? True if
        there is room; an idle connection to close first (the source's own when
        it is at its cap, else one of the source holding most when the peer is
        full); None to refuse it."""
        live = [c for c in self._conns if not c.broken]  # ones already closing are on their way out
        mine = [c for c in live if c.caller.host_group == host]
        if len(mine) >= self.max_connections_per_source:
            return _longest_idle(mine)
        if len(live) < self.max_connections:
            return True
        for source, _ in Counter(c.caller.host_group for c in live).most_common():
            victim = _longest_idle([c for c in live if c.caller.host_group == source])
            if victim is not None:
                return victim
        return None

    def _keepalive(self) -> None:
        """PING connections with calls that have been silent; close those whose
        answer never came (a client that vanished without a FIN: its sessions
        would otherwise wait for it until admission reclaims them)."""
        now = time.monotonic()
        with self._lock:
            conns = [c for c in self._conns if not c.broken and c.calls]
        for c in conns:
            if not c.lock.acquire(timeout=0.05):  # busy: a handler is sending, so it is not silent
                continue
            try:
                if c.ping_sent is not None:
                    if now - c.ping_sent >= self.keepalive_timeout:
                        c.goaway_locked("no answer to keepalive")
                elif now - c.wire.last_received >= self.keepalive:
                    c.ping_sent = now
                    c.wire.ping()
                    c.write_quietly()
            finally:
                c.lock.release()

    def charge_call(self, host: str) -> None:
        """A call started by ``host``: it spends one of its source's budget, into
        debt if need be (the calls of one read all count). Called under a
        connection's lock: takes only its own lock, never the server's."""
        now = time.monotonic()
        with self._budget_lock:
            self._call_budgets.get(host, now).charge(now)

    def read_pause(self, host: str) -> float:
        """How long ``host``'s connections wait before their next read: until its
        budget is out of debt (0 if it is not in debt)."""
        with self._budget_lock:
            budget = self._call_budgets.find(host)
            return 0.0 if budget is None else budget.debt_s(time.monotonic())

    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def take_session_slot(self) -> bool:
        return self._session_slots.acquire(blocking=False)

    def release_session_slot(self) -> None:
        self._session_slots.release()

    def _forget(self, conn: _Connection) -> None:
        with self._changed:
            self._conns.discard(conn)
            self._changed.notify_all()

    def wait_no_connections(self, timeout: float) -> bool:
        """Until every connection has ended and released its sessions (tests, shutdown)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._conns, timeout)

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting, let running calls finish for ``grace`` seconds, then
        close every connection (each stream's handler then releases its
        session), and join every thread."""
        self.draining = True
        if self._started:
            os.write(self._stop_w, b"x")
            self._acceptor.join()
        self._listener.close()
        with self._changed:  # running calls get ``grace`` to finish (each call's end notifies)
            self._changed.wait_for(lambda: not any(x.started for c in self._conns for x in c.calls.values()), grace or 0)
            conns = list(self._conns)
        for c in conns:  # GOAWAY last, once calls are over (h2 takes nothing after it): who may retry what
            if c.lock.acquire(timeout=0.2):  # not behind a send blocked on a client that stopped reading
                try:
                    c.goaway_locked("the server is shutting down")
                finally:
                    c.lock.release()
        for c in conns:
            c.shutdown()  # without its lock: a send blocked on a client that stopped reading returns now
        for c in conns:
            c.close()
        self.executor.shutdown(wait=True)
        self.unary_executor.shutdown(wait=True)
        self.background_executor.shutdown(wait=True)
        for c in conns:
            c.thread.join()
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
        for on_stop in self._on_stop:
            on_stop()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled (from a trio nursery)."""
        self.start()
        try:
            task_status.started(self)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.stop, 1.0)
