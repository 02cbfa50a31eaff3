"""gRPC's wire protocol on the ``h2`` library: sans-io, client and server roles.

Bytes in, events out; calls in, bytes to send out. No sockets, no threads:
the shared driver (driver.py, under channel.py and server.py) drives it. HTTP/2 itself
(framing, HPACK, stream states, settings, flow-control accounting, header
validation) is python-hyper's ``h2``; this module adds what gRPC and a port
facing the internet need on top (docs/h2-migration.md):

- gRPC's length-prefixed messages, statuses, trailers and ``grpc-timeout``;
- flow control credited only as the application takes messages, so a peer
  can never make us hold more than our windows (h2 never credits by itself);
- an outbox per stream, sent as the peer's windows allow (h2 neither splits
  nor queues);
- per-connection budgets for what costs us work and the peer nothing
  (PING, SETTINGS, RST_STREAM, PRIORITY, WINDOW_UPDATE, empty and unknown
  frames), charged per frame as h2 parses it: over budget,
  GOAWAY(ENHANCE_YOUR_CALM) and :class:`H2ProtocolError`;
- a bound on a frame's claimed length before its bytes are buffered.

Any HTTP/2 error the peer causes surfaces as :class:`H2ProtocolError`
after the GOAWAY that tells it why has been queued; the driver sends it and
hangs up. h2 refuses everything after a GOAWAY, so a draining server sends
its GOAWAY last, once its calls are over (server.py).
"""

from __future__ import annotations

import struct
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.settings
import hyperframe.frame

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.ratelimit import TokenBucket


def _frame_repr(frame) -> str:
    return f"{type(frame).__name__}(stream_id={frame.stream_id})"


# h2 logs every frame it receives as trace("Received frame: %s", repr(frame)),
# evaluating the repr even with logging off (connection.py, _receive_frame); a
# frame's repr serializes its body and hex-dumps it: a fifth of the CPU of
# receiving a step's DATA frame. The short form keeps type and stream.
hyperframe.frame.Frame.__repr__ = _frame_repr

NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 6, 7, 8, 9, 11

# gRPC status codes (the subset this code produces or names)
GRPC_STATUS = {0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
               6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
               10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
               15: "DATA_LOSS", 16: "UNAUTHENTICATED"}
OK, CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 0, 1, 4, 8, 12, 13, 14
INVALID_ARGUMENT, NOT_FOUND = 3, 5

DEFAULT_WINDOW = 65535
MAX_FRAME = 16384  # what we accept (we never raise SETTINGS_MAX_FRAME_SIZE)
# Receive windows: the peer may have this much unread at once, per stream and per
# connection. A whole MAX_MESSAGE fits a stream's window, and the connection's
# beside another stream's partial message.
RECEIVE_WINDOW = 24 << 20
CONNECTION_WINDOW = 48 << 20
MAX_MESSAGE = 20 << 20
# Credit goes back once CREDIT_STEP bytes are consumed, so at most that much sits
# uncredited: a whole MAX_MESSAGE always fits what is left of a stream's window.
# (Ours, not h2's WindowManager: that one waits for half a window, 12 MiB, and a
# 20 MiB message behind 9 MiB of small ones would then wait for credit forever.)
CREDIT_STEP = 1 << 20
MAX_HEADER_LIST = 16 << 10  # decoded, as advertised in our SETTINGS (h2 ends the connection past it)
MAX_STREAMS = 100  # concurrent calls a server takes per connection, advertised
# Past the advertised limit h2 ends the whole connection; but a client may open
# streams before it has our SETTINGS (h2load opens 100 at once), so until it
# acknowledges them h2 allows this many, and we refuse the excess stream by stream.
PRE_SETTINGS_STREAMS = 128
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}

# What a peer may send that costs us work and it nothing: (burst, per second).
# Honest clients stay far below (grpcio's BDP probes are a few PINGs a second
# while data flows; a client resets a stream per cancelled call). A flood is
# ended after the burst, so its cost is bounded per connection.
BUDGETS = {
    "ping": (100, 10.0),
    "settings": (20, 1.0),
    "reset": (200, 20.0),  # RST_STREAM of an open stream, or calls we refused (rapid reset, CVE-2023-44487)
    "late": (10_000, 1_000.0),  # RST_STREAM of a closed stream: h2 answers each DATA frame in flight with one
    "priority": (100, 10.0),
    "empty": (100, 10.0),  # DATA frames with no data and no END_STREAM, unknown frame types, ALTSVC
    "window": (10_000, 1_000.0),  # WINDOW_UPDATE: honest peers send one per some data consumed
}
# Charged per frame as h2 parses it (_MeteredFrames), so frames h2 answers or drops
# without an event (on closed streams, say) are counted too.
_METERED = {
    hyperframe.frame.PingFrame: "ping",
    hyperframe.frame.SettingsFrame: "settings",
    hyperframe.frame.RstStreamFrame: "reset",
    hyperframe.frame.PriorityFrame: "priority",
    hyperframe.frame.DataFrame: "empty",
    hyperframe.frame.ExtensionFrame: "empty",
    hyperframe.frame.AltSvcFrame: "empty",
    hyperframe.frame.WindowUpdateFrame: "window",
}


class H2ProtocolError(MeshnetError):
    """The peer broke HTTP/2 or gRPC framing, or spent its budget; the connection cannot go on."""

    def __init__(self, code: int, detail: str) -> None:
        self.code = code
        super().__init__(detail)


class H2StreamClosed(MeshnetError):
    """A send on a stream this side already ended or reset, or on a closed connection."""


# --- events -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    stream_id: int
    data: bytes


@dataclass(frozen=True)
class StreamEnded:
    """Client side: the call is over; ``status`` 0 is success, otherwise a gRPC status code."""

    stream_id: int
    status: int
    message: str
    refused: bool = False  # the peer refused the call before any work (REFUSED_STREAM): not its fault


@dataclass(frozen=True)
class ConnectionEnded:
    """GOAWAY: streams above ``last_stream_id`` were never processed."""

    error_code: int
    last_stream_id: int
    detail: str


@dataclass(frozen=True)
class RequestStarted:
    """Server side: a client opened a call."""

    stream_id: int
    path: str
    timeout: float | None  # from grpc-timeout, if the client sent one


@dataclass(frozen=True)
class RequestEnded:
    """Server side: the client half-closed (no more messages on this call)."""

    stream_id: int


@dataclass(frozen=True)
class StreamReset:
    """Server side: the client cancelled the call (or its upload was refused)."""

    stream_id: int
    error_code: int


@dataclass(frozen=True)
class PingAcked:
    """The peer answered one of our PINGs (keepalive)."""


Event = Message | StreamEnded | ConnectionEnded | RequestStarted | RequestEnded | StreamReset | PingAcked


_DataFrame = hyperframe.frame.DataFrame


class _MeteredFrames(h2.frame_buffer.FrameBuffer):
    """h2's frame buffer, charging each frame that costs us work and the peer
    nothing to its budget as it is parsed. Over budget: DenialOfServiceError,
    which h2 answers with GOAWAY(ENHANCE_YOUR_CALM)."""

    def __init__(self, *, server: bool, spend, is_open) -> None:
        super().__init__(server=server)
        self._spend = spend
        self._is_open = is_open
        self._last = None

    def __next__(self):
        f = super().__next__()  # (which may call this method again for the frame it returns)
        if type(f) is _DataFrame and f.data:  # the common frame, and never metered: return it at once
            return f
        if f is not self._last:
            self._last = f
            what = _METERED.get(type(f))
            if what == "empty" and isinstance(f, hyperframe.frame.DataFrame) and (f.data or "END_STREAM" in f.flags):
                what = None
            elif what in ("ping", "settings") and "ACK" in f.flags:
                what = None  # an answer to ours
            elif what == "reset" and not self._is_open(f.stream_id):
                what = "late"
            if what is not None and not self._spend(what):
                raise h2.exceptions.DenialOfServiceError(_too_many(what))
        return f


def _too_many(what: str) -> str:
    burst, rate = BUDGETS[what]
    return f"too many {what} frames (more than {burst}, then {rate:g}/s)"


@dataclass
class _Stream:
    id: int
    outbox: deque = field(default_factory=deque)  # framed gRPC messages (bytes or memoryviews) not yet sent
    end_after_outbox: bool = False  # then END_STREAM (client) or the trailers (server)
    local_done: bool = False  # END_STREAM sent (or the stream reset)
    remote_done: bool = False  # the peer sent END_STREAM
    sent_headers: bool = False  # server: response headers out
    trailers: tuple[int, str] | None = None  # server: (grpc status, message) to end with
    status: tuple[int, str] | None = None  # client: what the response's headers or trailers said
    buf: bytearray = field(default_factory=bytearray)  # gRPC bytes received, not yet a whole message
    credit: int = 0  # bytes consumed since this stream's last WINDOW_UPDATE


def _fields(headers) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in headers:
        out.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return out


class GrpcConnection:
    """One HTTP/2 connection carrying gRPC calls, either role."""

    def __init__(self, *, client_side: bool, max_message_bytes: int = MAX_MESSAGE, max_streams: int = MAX_STREAMS,
                 authority: str = "", user_agent: str = "meshnet-p2p", clock=time.monotonic) -> None:
        if not 0 < max_message_bytes <= MAX_MESSAGE:
            raise ValueError(f"max_message_bytes must be in 1..{MAX_MESSAGE}: a whole message must fit the receive window")
        self.client_side = client_side
        self.max_message_bytes = max_message_bytes
        self.max_streams = max_streams
        self.authority = authority
        self.user_agent = user_agent
        self._clock = clock
        config = h2.config.H2Configuration(client_side=client_side, header_encoding=None)
        self._h2 = conn = h2.connection.H2Connection(config)
        # In force from the start (we accept more than the peer may send before it has our SETTINGS).
        # (A client keeps h2's default stream limit: h2 counts a late HEADERS on a stream
        # it already forgot against it, and push is off anyway.)
        conn.local_settings = h2.settings.Settings(client=client_side, initial_values={
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS if client_side else
            max(max_streams, PRE_SETTINGS_STREAMS),
        })
        conn.decoder.max_header_list_size = MAX_HEADER_LIST
        conn.incoming_buffer = _MeteredFrames(server=not client_side, spend=self._within_budget, is_open=self._h2_open)
        self._streams: dict[int, _Stream] = {}
        self._credit = 0  # bytes consumed since the last connection WINDOW_UPDATE
        now = clock()
        self._budgets = {name: TokenBucket(burst, rate, now) for name, (burst, rate) in BUDGETS.items()}
        self.goaway: ConnectionEnded | None = None  # what the peer's GOAWAY said
        self.closed = False  # we sent GOAWAY (or a protocol error did): h2 takes nothing more
        self.last_received = now  # when the peer last sent anything (keepalive)

    # --- calls -> bytes -------------------------------------------------------------------------

    def initiate(self) -> None:
        self._h2.initiate_connection()
        if not self.client_side and self.max_streams < PRE_SETTINGS_STREAMS:  # in force once acknowledged
            self._h2.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams})
        self._h2.increment_flow_control_window(CONNECTION_WINDOW - DEFAULT_WINDOW)

    def data_to_send(self) -> bytes:
        return self._h2.data_to_send()

    def open_stream(self, path: str, *, timeout: float | None = None) -> int:
        """Client: send a call's request headers; returns its stream id."""
        if self.goaway is not None or self.closed:
            raise H2StreamClosed(f"the peer is going away ({self.goaway.detail if self.goaway else 'closed'})")
        sid = self._h2.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "https"), (":path", path), (":authority", self.authority),
                   ("content-type", "application/grpc"), ("te", "trailers"), ("user-agent", self.user_agent)]
        if timeout is not None:
            headers.append(("grpc-timeout", f"{max(1, int(timeout * 1000))}m"))
        try:
            self._h2.send_headers(sid, headers)
        except h2.exceptions.TooManyStreamsError:
            raise H2StreamClosed("the peer takes no more concurrent calls on this connection") from None
        self._streams[sid] = _Stream(sid)
        return sid

    def send_message(self, stream_id: int, message: bytes, *, end_stream: bool = False) -> None:
        """Queue one gRPC message; it goes out as far as flow control allows now,
        the rest as the peer grants window (see :meth:`pending`)."""
        st = self._streams.get(stream_id)
        if st is None or st.local_done or st.end_after_outbox or self.closed:
            raise H2StreamClosed(f"stream {stream_id} is closed for sending")
        if not self.client_side and not st.sent_headers:
            st.sent_headers = True
            try:
                self._h2.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                raise H2StreamClosed(f"stream {stream_id} is closed for sending") from None
        st.outbox.append(struct.pack(">BI", 0, len(message)) + message)
        st.end_after_outbox = end_stream
        self._flush(st)

    def end_stream(self, stream_id: int) -> None:
        """Client: half-close, after any messages still queued."""
        st = self._streams.get(stream_id)
        if st is not None and not st.local_done and not st.end_after_outbox and not self.closed:
            st.end_after_outbox = True
            self._flush(st)

    def send_trailers(self, stream_id: int, status: int = 0, message: str = "") -> None:
        """Server: end the call with a gRPC status, after any messages still queued."""
        st = self._streams.get(stream_id)
        if st is None or st.local_done or st.end_after_outbox or self.closed:
            return
        st.trailers = (status, message[:1024])
        st.end_after_outbox = True
        self._flush(st)

    def refuse(self, stream_id: int) -> None:
        """Server: refuse a call before any work (REFUSED_STREAM: safe to retry).
        Refusals spend the peer's reset budget: opening calls only to have them
        refused is a rapid reset too. Over budget, :class:`H2ProtocolError`."""
        self.reset_stream(stream_id, REFUSED_STREAM)
        if not self._within_budget("reset"):
            self._fail(ENHANCE_YOUR_CALM, _too_many("reset"))

    def reset_stream(self, stream_id: int, code: int = CANCEL) -> None:
        if self._drop(stream_id) is not None and not self.closed:
            self._reset(stream_id, code)

    def consumed(self, stream_id: int, nbytes: int) -> None:
        """The application took ``nbytes`` of a stream's messages (5 + length
        each, or what it discarded unread): the peer may send that much more."""
        if not nbytes or self.closed:
            return
        self._credit += nbytes
        if self._credit >= CREDIT_STEP:
            try:
                self._h2.increment_flow_control_window(self._credit)
            except h2.exceptions.ProtocolError:
                return  # a GOAWAY later in this same read closed the connection
            self._credit = 0
        st = self._streams.get(stream_id)
        if st is not None:
            st.credit += nbytes
            if st.credit >= CREDIT_STEP:
                try:
                    self._h2.increment_flow_control_window(st.credit, stream_id)
                except (h2.exceptions.StreamClosedError, KeyError):
                    pass  # h2 has closed or forgotten it: the peer sends no more on it anyway
                st.credit = 0

    def pending(self, stream_id: int) -> bool:
        """Whether the stream still has bytes waiting for flow-control window."""
        st = self._streams.get(stream_id)
        return st is not None and bool(st.outbox)

    def open_calls(self) -> int:
        return sum(1 for st in self._streams.values() if not st.local_done)

    def ping(self) -> None:
        """A keepalive PING; its answer comes as :class:`PingAcked`."""
        if not self.closed:
            self._h2.ping(struct.pack(">Q", int(self._clock() * 1e6) & (2**64 - 1)))

    def close(self, code: int = NO_ERROR, detail: str = "") -> None:
        """GOAWAY, naming the last call taken (so a client knows which calls it may
        safely retry elsewhere). The last thing this connection sends."""
        if not self.closed:
            self.closed = True
            self._h2.close_connection(code, detail.encode()[:256])

    def _reset(self, stream_id: int, code: int) -> None:
        try:
            self._h2.reset_stream(stream_id, code)
        except h2.exceptions.ProtocolError:  # StreamClosedError included
            pass  # h2 already has it (or the connection) closed: nothing to reset

    def _drop(self, stream_id: int) -> _Stream | None:
        """Forget a stream; bytes of a message it never completed go back to the connection."""
        st = self._streams.pop(stream_id, None)
        if st is not None and st.buf:
            self.consumed(stream_id, len(st.buf))
            st.buf.clear()
        return st

    def _flush(self, st: _Stream) -> None:
        # h2 applies a whole read before we see its events, so a send made for an
        # early event (a WINDOW_UPDATE) may find the stream or the connection
        # already closed by a later frame of the same read (RST_STREAM, GOAWAY):
        # then nothing more goes out on it, and the event that says why follows.
        try:
            self._send_what_fits(st)
        except (h2.exceptions.StreamClosedError, KeyError, h2.exceptions.ProtocolError):
            st.outbox.clear()
            st.local_done = True

    def _send_what_fits(self, st: _Stream) -> None:
        conn = self._h2
        while st.outbox:
            chunk = st.outbox[0]
            n = min(len(chunk), conn.local_flow_control_window(st.id), conn.max_outbound_frame_size)
            if n <= 0:
                return
            if n == len(chunk):
                st.outbox.popleft()
            else:
                chunk = memoryview(chunk)
                st.outbox[0] = chunk[n:]
                chunk = chunk[:n]
            end = st.end_after_outbox and not st.outbox and st.trailers is None
            conn.send_data(st.id, chunk, end_stream=end)
            if end:
                self._local_done(st)
        if st.end_after_outbox and not st.local_done:
            if st.trailers is not None:
                status, message = st.trailers
                fields = [("grpc-status", str(status))]
                if message:
                    fields.append(("grpc-message", urllib.parse.quote(message, safe=" !#$&'()*+,/:;=?@[]~")))
                if not st.sent_headers:  # trailers-only
                    fields = [(":status", "200"), ("content-type", "application/grpc")] + fields
                    st.sent_headers = True
                conn.send_headers(st.id, fields, end_stream=True)
            else:
                conn.end_stream(st.id)
            self._local_done(st)

    def _local_done(self, st: _Stream) -> None:
        st.local_done = True
        if not self.client_side:
            self._drop(st.id)
            if not st.remote_done:  # the call is over: tell the client to stop sending (as grpc servers do)
                self._reset(st.id, NO_ERROR)

    # --- bytes -> events ------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """Raises :class:`H2ProtocolError` when the peer broke the protocol or its
        budget; the GOAWAY saying so is then queued in :meth:`data_to_send`."""
        if self.closed:
            return []
        self.last_received = self._clock()
        try:
            raw = self._h2.receive_data(data)
            self._credit_dropped_data()
        except h2.exceptions.ProtocolError as e:  # h2 has queued the GOAWAY that says why
            self.closed = True
            raise H2ProtocolError(int(getattr(e, "error_code", 0) or PROTOCOL_ERROR), f"{type(e).__name__}: {e}") from None
        except (ValueError, UnicodeDecodeError) as e:  # anything else from a peer's bytes ends the connection, typed
            self._fail(PROTOCOL_ERROR, f"{type(e).__name__}: {e}")
        # h2 buffers a frame whole before it checks the length the frame claims:
        # a claim of 16 MiB would cost that much per connection. Check it first.
        pending = self._h2.incoming_buffer._data
        if len(pending) >= 9 and (claimed := int.from_bytes(pending[:3], "big")) > MAX_FRAME:
            self._fail(FRAME_SIZE_ERROR, f"a {claimed}-byte frame exceeds our {MAX_FRAME}")
        events: list[Event] = []
        for ev in raw:
            self._event(ev, events)
        return events

    def _credit_dropped_data(self) -> None:
        """DATA on streams h2 had already closed never becomes an event: h2 counts it
        in its own window manager, which gives credit back only after half the
        connection window (24 MiB) has piled up, so up to that much would be lost to
        a whole message meanwhile. Those bytes are credited as ours are."""
        manager = self._h2._inbound_flow_control_window_manager
        dropped, manager._bytes_processed = manager._bytes_processed, 0
        if dropped:
            self.consumed(0, dropped)

    def _fail(self, code: int, detail: str):
        if not self.closed:
            self.closed = True
            try:
                self._h2.close_connection(code, detail.encode()[:256])
            except h2.exceptions.ProtocolError:
                pass
        raise H2ProtocolError(code, detail)

    def _h2_open(self, stream_id: int) -> bool:
        st = self._h2.streams.get(stream_id)
        return st is not None and not st.closed

    def _within_budget(self, what: str) -> bool:
        return self._budgets[what].spend(self._clock())

    def _event(self, ev, events: list[Event]) -> None:
        E = h2.events
        if isinstance(ev, E.DataReceived):
            return self._data(ev, events)
        if isinstance(ev, (E.RequestReceived, E.ResponseReceived, E.TrailersReceived)):
            return self._headers(ev, events)
        if isinstance(ev, E.StreamEnded):
            return self._remote_end(ev.stream_id, events)
        if isinstance(ev, E.StreamReset):
            return self._peer_reset(ev, events)
        if isinstance(ev, E.WindowUpdated):
            streams = [self._streams.get(ev.stream_id)] if ev.stream_id else list(self._streams.values())
            for st in streams:
                if st is not None and st.outbox:
                    self._flush(st)
            return
        if isinstance(ev, E.RemoteSettingsChanged):
            for st in list(self._streams.values()):
                if st.outbox:
                    self._flush(st)
            return
        if isinstance(ev, E.PingAckReceived):
            events.append(PingAcked())
            return
        if isinstance(ev, E.ConnectionTerminated):
            detail = (ev.additional_data or b"").decode("utf-8", "replace")[:256]
            self.goaway = ConnectionEnded(int(ev.error_code or 0), int(ev.last_stream_id or 0),
                                          detail or f"HTTP/2 error {int(ev.error_code or 0)}")
            self.closed = True  # h2 takes nothing after a GOAWAY
            events.append(self.goaway)
            for st in list(self._streams.values()):
                self._drop(st.id)
                if self.client_side:
                    # above last_stream_id: never processed, so safe to retry elsewhere or later (as gRPC's)
                    untaken = st.id > self.goaway.last_stream_id
                    why = f"the peer went away before taking this call ({self.goaway.detail})" if untaken \
                        else f"the peer closed the connection ({self.goaway.detail})"
                    events.append(StreamEnded(st.id, UNAVAILABLE, why, refused=untaken))
                else:
                    events.append(StreamReset(st.id, CANCEL))
            return
        # PingReceived (h2 has queued the answer), PriorityUpdated, UnknownFrameReceived, SettingsAcknowledged,
        # InformationalResponseReceived, AlternativeServiceAvailable: nothing to do (budgets: _MeteredFrames)

    def _data(self, ev, events: list[Event]) -> None:
        sid, data, n = ev.stream_id, ev.data, ev.flow_controlled_length
        st = self._streams.get(sid)
        if st is None or st.remote_done:
            return self.consumed(sid, n)  # a stream already over: its late bytes are dropped, and credited
        if len(data) != n:
            self.consumed(sid, n - len(data))  # padding is nobody's to consume
        buf = st.buf
        if not buf and len(data) >= 5 and data[0] == 0 and int.from_bytes(data[1:5], "big") == len(data) - 5 \
                and len(data) - 5 <= self.max_message_bytes:
            events.append(Message(sid, data[5:]))  # one whole message in one frame (every step): one copy
            return
        buf += data
        # Whole messages leave the buffer at once, so it holds at most one partial
        # message, and a message's size is checked before its bytes are awaited.
        while len(buf) >= 5:
            if buf[0] != 0:
                return self._bad_message(st, INTERNAL, "a compressed message, which was never negotiated", events)
            size = int.from_bytes(buf[1:5], "big")
            if size > self.max_message_bytes:
                return self._bad_message(st, RESOURCE_EXHAUSTED, f"a {size}-byte message exceeds {self.max_message_bytes}", events)
            if len(buf) < 5 + size:
                break
            events.append(Message(sid, bytes(buf[5 : 5 + size])))
            del buf[: 5 + size]

    def _headers(self, ev, events: list[Event]) -> None:
        sid = ev.stream_id
        fields = _fields(ev.headers)
        if self.client_side:
            return self._response_headers(ev, fields, events)
        if isinstance(ev, h2.events.TrailersReceived):  # gRPC requests have none: they just end the request
            return
        st = self._streams[sid] = _Stream(sid)
        if self.open_calls() > self.max_streams:  # the per-connection limit; before the client has our
            return self.refuse(sid)  # SETTINGS it may not know it, and h2 allows PRE_SETTINGS_STREAMS
        path = fields.get(":path", "")
        if fields.get(":method") != "POST" or not path.startswith("/") or \
                not fields.get("content-type", "").startswith("application/grpc"):
            st.remote_done = ev.stream_ended is not None
            return self.send_trailers(sid, UNIMPLEMENTED, "not a gRPC request")
        events.append(RequestStarted(sid, path, _parse_timeout(fields.get("grpc-timeout"))))

    def _response_headers(self, ev, fields: dict[str, str], events: list[Event]) -> None:
        st = self._streams.get(ev.stream_id)
        if st is None:
            return
        if isinstance(ev, h2.events.ResponseReceived):
            status = fields.get(":status")
            if status != "200":
                return self._end(st, UNAVAILABLE, f"HTTP status {status} instead of a gRPC response", events,
                                 reset=ev.stream_ended is None)
            if ev.stream_ended is None:
                if not fields.get("content-type", "").startswith("application/grpc"):
                    return self._end(st, INTERNAL, f"content-type {fields.get('content-type')!r} is not gRPC", events, reset=True)
                return
            # a trailers-only response: the status is in these same headers
        raw = fields.get("grpc-status", "")
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 3):
            st.status = (INTERNAL, f"trailers without a valid grpc-status ({raw[:16]!r})")
        else:
            st.status = (int(raw), urllib.parse.unquote(fields.get("grpc-message", ""))[:1024])

    def _remote_end(self, sid: int, events: list[Event]) -> None:
        st = self._streams.get(sid)
        if st is None:
            return
        st.remote_done = True
        if self.client_side:
            if st.buf:
                return self._end(st, INTERNAL, "the stream ended inside a message", events, reset=False)
            status, message = st.status or (INTERNAL, "the stream ended without a status")
            return self._end(st, status, message, events, reset=False)
        if st.buf:  # the request ended inside a message
            self.reset_stream(sid, CANCEL)
            events.append(StreamReset(sid, PROTOCOL_ERROR))
            return
        events.append(RequestEnded(sid))

    def _peer_reset(self, ev, events: list[Event]) -> None:
        # remote_reset False: h2 reset the stream itself (a stream error the peer caused)
        st = self._drop(ev.stream_id)
        if st is None:
            return
        code = int(ev.error_code or 0)
        if self.client_side:
            # As gRPC maps them: a refused stream was never processed (safe to retry), a cancel is CANCELLED.
            status = {CANCEL: CANCELLED, REFUSED_STREAM: UNAVAILABLE}.get(code, INTERNAL)
            if code == NO_ERROR and st.status is not None:  # trailers came, then "stop sending": the call is over
                status = st.status[0]
            events.append(StreamEnded(st.id, status, st.status[1] if code == NO_ERROR and st.status else
                                      f"the peer reset the stream (HTTP/2 error {code})", refused=code == REFUSED_STREAM))
        else:
            events.append(StreamReset(st.id, code))

    def _bad_message(self, st: _Stream, status: int, detail: str, events: list[Event]) -> None:
        if self.client_side:
            return self._end(st, status, detail, events, reset=True)
        # The call ends with that status, then RST_STREAM stops the client's upload;
        # the handler learns of it as a reset. (Dropping the stream credits its partial message.)
        st.outbox.clear()
        st.end_after_outbox = st.local_done = False
        self.send_trailers(st.id, status, detail)
        events.append(StreamReset(st.id, CANCEL))

    def _end(self, st: _Stream, status: int, detail: str, events: list[Event], *, reset: bool) -> None:
        if reset:
            self.reset_stream(st.id)
        else:
            self._drop(st.id)
        events.append(StreamEnded(st.id, status, detail))


def client(*, authority: str, max_message_bytes: int = MAX_MESSAGE, user_agent: str = "meshnet-p2p") -> GrpcConnection:
    return GrpcConnection(client_side=True, authority=authority, max_message_bytes=max_message_bytes, user_agent=user_agent)


def server(*, max_message_bytes: int = MAX_MESSAGE, max_streams: int = MAX_STREAMS) -> GrpcConnection:
    return GrpcConnection(client_side=False, max_message_bytes=max_message_bytes, max_streams=max_streams)


def _parse_timeout(value: str | None) -> float | None:
    digits = (value or "")[:-1]
    if not value or len(value) > 9 or value[-1] not in _TIMEOUT_UNITS or not (digits.isascii() and digits.isdigit()):
        return None
    return int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]
