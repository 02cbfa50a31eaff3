"""Sans-io HTTP/2 connections, client and server, with just what gRPC needs.

Bytes in, events out; calls in, bytes to send out. No sockets, no threads:
``channel.py`` (client) and ``server.py`` (server) drive them. Why our own
instead of grpcio's: grpcio hands every message between several threads
(caller, request consumer and poller on the client; poller and handler on
the server, plus its event engine's own), and on this project's 2-core
machines those hand-offs cost most of a hop's overhead (docs/dataplane.md);
connections driven from the thread that waits pay none of them. The wire is
plain gRPC: grpcio clients and servers interoperate with these (tested).

Scope: gRPC length-prefixed messages; flow control both ways; SETTINGS,
PING, WINDOW_UPDATE, RST_STREAM, GOAWAY; HEADERS with CONTINUATION and
padding, coded with HPACK (the ``hpack`` package, which h2 and hypercorn
use). Server push is disabled, priorities are ignored, compressed messages
are refused. Everything a peer sends is bounded: frame sizes, header blocks,
buffered bytes per stream, concurrent streams; a malformed frame ends the
connection with :class:`H2ProtocolError` instead of anything else.
"""

from __future__ import annotations

import struct
import urllib.parse
from collections import deque
from dataclasses import dataclass, field

import hpack

from ..errors import MeshnetError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

SETTINGS_HEADER_TABLE_SIZE = 1
SETTINGS_ENABLE_PUSH = 2
SETTINGS_INITIAL_WINDOW_SIZE = 4
SETTINGS_MAX_FRAME_SIZE = 5
SETTINGS_MAX_HEADER_LIST_SIZE = 6

NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
FRAME_SIZE_ERROR, CANCEL, COMPRESSION_ERROR = 6, 8, 9

# gRPC status codes (the subset this client produces or names)
GRPC_STATUS = {0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
               6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
               10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
               15: "DATA_LOSS", 16: "UNAUTHENTICATED"}
OK, CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 0, 1, 4, 8, 12, 13, 14

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384  # what we accept (we never raise SETTINGS_MAX_FRAME_SIZE)
# Receive windows, credited back only as the application takes messages
# (``consumed``), so a peer can never make us hold more than CONNECTION_WINDOW
# per connection. Credit goes back once CREDIT_STEP bytes are consumed, so at
# most that much sits uncredited: a whole MAX_MESSAGE always fits what is left
# of a stream's window, and of the connection's beside one other stream's
# partial message.
RECEIVE_WINDOW = 24 << 20  # per stream
CONNECTION_WINDOW = 48 << 20
MAX_MESSAGE = 20 << 20
CREDIT_STEP = 1 << 20
MAX_HEADER_BLOCK = 64 << 10  # a HEADERS frame and its CONTINUATIONs, encoded
MAX_HEADER_LIST = 16 << 10  # decoded, as advertised in our SETTINGS
MAX_STREAMS = 100  # concurrent calls a server takes per connection
SETTINGS_MAX_CONCURRENT_STREAMS = 3
REFUSED_STREAM = 7
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_HEAD = struct.Struct(">BHBBI")  # length (24 bits as 8 + 16), type, flags, stream id


class H2ProtocolError(MeshnetError):
    """The peer broke HTTP/2 or gRPC framing; the connection cannot go on."""

    def __init__(self, code: int, detail: str) -> None:
        self.code = code
        super().__init__(detail)


class H2StreamClosed(MeshnetError):
    """A send on a stream this side already ended or reset."""


# --- events -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    stream_id: int
    data: bytes


@dataclass(frozen=True)
class StreamEnded:
    """The call is over: ``status`` 0 is success; otherwise a gRPC status code."""

    stream_id: int
    status: int
    message: str


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
    """Server side: the client cancelled the call."""

    stream_id: int
    error_code: int


Event = Message | StreamEnded | ConnectionEnded | RequestStarted | RequestEnded | StreamReset


def frame(ftype: int, flags: int, stream_id: int, payload: bytes | memoryview = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 16, n & 0xFFFF, ftype, flags, stream_id) + bytes(payload)


@dataclass
class _Stream:
    id: int
    send_window: int
    outbox: deque = field(default_factory=deque)  # memoryviews of framed gRPC messages not yet sent
    end_after_outbox: bool = False  # then END_STREAM (client) or the trailers (server)
    local_done: bool = False  # END_STREAM sent (or the stream reset)
    remote_done: bool = False  # the peer sent END_STREAM
    got_headers: bool = False
    sent_headers: bool = False  # server: response headers out
    trailers: tuple[int, str] | None = None  # server: (grpc status, message) to end with
    recv_window: int = 0  # what the peer may still send on this stream
    recv_credit: int = 0  # bytes consumed since this stream's last WINDOW_UPDATE
    buf: bytearray = field(default_factory=bytearray)  # gRPC bytes received, not yet a whole message


class _H2Connection:
    """What both roles share: framing, settings, flow control, the gRPC message
    layer. Subclasses decide who opens streams and what header blocks mean."""

    def __init__(self, *, max_message_bytes: int) -> None:
        if not 0 < max_message_bytes <= MAX_MESSAGE:
            raise ValueError(f"max_message_bytes must be in 1..{MAX_MESSAGE}: a whole message must fit the receive window")
        self.max_message_bytes = max_message_bytes
        self._out = bytearray()
        self._in = bytearray()
        self._enc = hpack.Encoder()
        self._dec = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        self._streams: dict[int, _Stream] = {}
        self._peer_window = DEFAULT_WINDOW  # connection-level send window
        self._peer_initial = DEFAULT_WINDOW  # initial send window of new streams
        self._peer_frame = DEFAULT_FRAME
        self._recv_window = DEFAULT_WINDOW  # connection-level, what the peer may still send
        self._recv_credit = 0  # bytes consumed since the last connection WINDOW_UPDATE
        self._headers: tuple[int, int, bytearray] | None = None  # (stream, flags, block) awaiting CONTINUATION
        self.goaway: ConnectionEnded | None = None

    # --- calls -> bytes -------------------------------------------------------------------------

    def _send_settings(self, extra: bytes = b"") -> None:
        settings = struct.pack(">HIHIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, RECEIVE_WINDOW,
                               SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST) + extra
        self._out += frame(SETTINGS, 0, 0, settings)
        self._out += frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", CONNECTION_WINDOW - DEFAULT_WINDOW))
        self._recv_window = CONNECTION_WINDOW

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def _new_stream(self, sid: int) -> _Stream:
        st = self._streams[sid] = _Stream(sid, self._peer_initial, recv_window=RECEIVE_WINDOW)
        return st

    def send_message(self, stream_id: int, message: bytes, *, end_stream: bool = False) -> None:
        """Queue one gRPC message; it goes out as far as flow control allows now,
        the rest as the peer grants window (see :meth:`pending`)."""
        st = self._streams.get(stream_id)
        if st is None or st.local_done or st.end_after_outbox:
            raise H2StreamClosed(f"stream {stream_id} is closed for sending")
        self._before_message(st)
        st.outbox.append(memoryview(struct.pack(">BI", 0, len(message)) + message))
        st.end_after_outbox = end_stream
        self._flush(st)

    def _before_message(self, st: _Stream) -> None:
        pass

    def reset_stream(self, stream_id: int, code: int = CANCEL) -> None:
        if self._drop(stream_id) is not None:
            self._out += frame(RST_STREAM, 0, stream_id, struct.pack(">I", code))

    def consumed(self, stream_id: int, nbytes: int) -> None:
        """The application took ``nbytes`` of a stream's messages (5 + length
        each, or what it discarded unread): the peer may send that much more."""
        self._recv_credit += nbytes
        if self._recv_credit >= CREDIT_STEP:  # credited in steps: one WINDOW_UPDATE per ~400 decode messages
            self._out += frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._recv_credit))
            self._recv_window += self._recv_credit
            self._recv_credit = 0
        st = self._streams.get(stream_id)
        if st is not None:
            st.recv_credit += nbytes
            if st.recv_credit >= CREDIT_STEP:
                self._out += frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", st.recv_credit))
                st.recv_window += st.recv_credit
                st.recv_credit = 0

    def _drop(self, stream_id: int) -> _Stream | None:
        """Forget a stream; bytes of a message it never completed go back to the connection."""
        st = self._streams.pop(stream_id, None)
        if st is not None and st.buf:
            self.consumed(0, len(st.buf))
            st.buf.clear()
        return st

    def pending(self, stream_id: int) -> bool:
        """Whether the stream still has bytes waiting for flow-control window."""
        st = self._streams.get(stream_id)
        return st is not None and bool(st.outbox)

    def close(self, code: int = NO_ERROR, detail: str = "") -> None:
        """GOAWAY: a server names the last call it took, so a client knows which
        calls it may safely retry elsewhere."""
        self._out += frame(GOAWAY, 0, 0, struct.pack(">II", self._last_taken(), code) + detail.encode()[:256])

    def _last_taken(self) -> int:
        return 0

    def _flush(self, st: _Stream) -> None:
        out = self._out
        while st.outbox:
            chunk = st.outbox[0]
            n = min(len(chunk), st.send_window, self._peer_window, self._peer_frame)
            if n <= 0:
                return
            if n == len(chunk):
                st.outbox.popleft()
            else:
                st.outbox[0] = chunk[n:]
            end = END_STREAM if (st.end_after_outbox and not st.outbox and st.trailers is None) else 0
            out += _HEAD.pack(n >> 16, n & 0xFFFF, DATA, end, st.id)
            out += chunk[:n]
            st.send_window -= n
            self._peer_window -= n
            if end:
                self._local_done(st)
        if st.end_after_outbox and not st.local_done:
            if st.trailers is not None:  # encoded now, in send order, so HPACK tables stay in step
                status, message = st.trailers
                fields = [("grpc-status", str(status))]
                if message:
                    fields.append(("grpc-message", urllib.parse.quote(message, safe=" !#$&'()*+,/:;=?@[]~")))
                if not st.sent_headers:  # trailers-only
                    fields = [(":status", "200"), ("content-type", "application/grpc")] + fields
                    st.sent_headers = True
                out += frame(HEADERS, END_HEADERS | END_STREAM, st.id, self._enc.encode(fields))
            else:
                out += frame(DATA, END_STREAM, st.id)
            self._local_done(st)

    def _local_done(self, st: _Stream) -> None:
        st.local_done = True

    # --- bytes -> events ------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        self._in += data
        events: list[Event] = []
        buf = self._in
        if not self._preface_seen(buf):
            return events
        pos, end = 0, len(buf)
        try:  # frames are read at an offset and the buffer trimmed once: linear in what arrived
            while end - pos >= 9:
                hi, lo, ftype, flags, sid = _HEAD.unpack_from(buf, pos)
                n = (hi << 16) | lo
                if n > DEFAULT_FRAME:
                    raise H2ProtocolError(FRAME_SIZE_ERROR, f"a {n}-byte frame exceeds our {DEFAULT_FRAME}")
                if end - pos < 9 + n:
                    break
                payload = bytes(buf[pos + 9 : pos + 9 + n])
                pos += 9 + n
                self._frame(ftype, flags, sid & 0x7FFFFFFF, payload, events)
        finally:
            del buf[:pos]
        return events

    def _preface_seen(self, buf: bytearray) -> bool:
        return True

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        if self._headers is not None and ftype != CONTINUATION:
            raise H2ProtocolError(PROTOCOL_ERROR, "a header block was interrupted by another frame")
        if ftype == DATA:
            self._data(flags, sid, payload, events)
        elif ftype == HEADERS:
            self._check_headers_stream(sid)
            payload = self._unpad(flags, payload)
            if flags & PRIORITY_FLAG:
                if len(payload) < 5:
                    raise H2ProtocolError(FRAME_SIZE_ERROR, "HEADERS too short for its priority fields")
                payload = payload[5:]
            self._headers = (sid, flags, bytearray(payload))
            if flags & END_HEADERS:
                self._header_block(events)
        elif ftype == CONTINUATION:
            if self._headers is None or self._headers[0] != sid:
                raise H2ProtocolError(PROTOCOL_ERROR, "CONTINUATION without the HEADERS it continues")
            block = self._headers[2]
            block += payload
            if len(block) > MAX_HEADER_BLOCK:
                raise H2ProtocolError(PROTOCOL_ERROR, f"a header block over {MAX_HEADER_BLOCK} bytes")
            if flags & END_HEADERS:
                self._header_block(events)
        elif ftype == SETTINGS:
            self._settings(flags, sid, payload)
        elif ftype == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif ftype == PING:
            if sid != 0 or len(payload) != 8:
                raise H2ProtocolError(FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR, "malformed PING")
            if not flags & ACK:
                self._out += frame(PING, ACK, 0, payload)
        elif ftype == RST_STREAM:
            if sid == 0 or len(payload) != 4:
                raise H2ProtocolError(PROTOCOL_ERROR if sid == 0 else FRAME_SIZE_ERROR, "malformed RST_STREAM")
            self._check_stream_id(sid)
            st = self._drop(sid)
            if st is not None:
                self._on_reset(st, struct.unpack(">I", payload)[0], events)
        elif ftype == GOAWAY:
            if sid != 0 or len(payload) < 8:
                raise H2ProtocolError(PROTOCOL_ERROR, "malformed GOAWAY")
            last, code = struct.unpack_from(">II", payload)
            detail = payload[8:264].decode("utf-8", "replace")
            self.goaway = ConnectionEnded(code, last & 0x7FFFFFFF, detail or f"HTTP/2 error {code}")
            events.append(self.goaway)
            self._on_goaway(self.goaway, events)
        elif ftype == PRIORITY:
            if sid == 0 or len(payload) != 5:
                raise H2ProtocolError(PROTOCOL_ERROR if sid == 0 else FRAME_SIZE_ERROR, "malformed PRIORITY")
        elif ftype == PUSH_PROMISE:
            raise H2ProtocolError(PROTOCOL_ERROR, "server push is not used here")
        # unknown frame types are ignored, as RFC 9113 requires

    def _check_headers_stream(self, sid: int) -> None:
        self._check_stream_id(sid)

    def _check_stream_id(self, sid: int) -> None:
        raise NotImplementedError

    def _on_reset(self, st: _Stream, code: int, events: list[Event]) -> None:
        raise NotImplementedError

    def _on_goaway(self, goaway: ConnectionEnded, events: list[Event]) -> None:
        pass

    def _on_headers(self, st: _Stream, flags: int, fields: dict[str, str], events: list[Event]) -> None:
        raise NotImplementedError

    def _on_remote_end(self, st: _Stream, events: list[Event]) -> None:
        raise NotImplementedError

    def _on_bad_message(self, st: _Stream, status: int, detail: str, events: list[Event]) -> None:
        raise NotImplementedError

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise H2ProtocolError(PROTOCOL_ERROR, "padding longer than its frame")
        return payload[1 : len(payload) - payload[0]]

    def _data(self, flags: int, sid: int, payload: bytes, events: list[Event]) -> None:
        self._check_stream_id(sid)
        n = len(payload)
        if n > self._recv_window:
            raise H2ProtocolError(FLOW_CONTROL_ERROR, "the peer sent past the connection's window")
        self._recv_window -= n
        st = self._streams.get(sid)
        if st is None or st.remote_done:
            return self.consumed(0, n)  # a stream already over: its late bytes are dropped, and credited
        if n > st.recv_window:
            raise H2ProtocolError(FLOW_CONTROL_ERROR, f"the peer sent past stream {sid}'s window")
        st.recv_window -= n
        if not st.got_headers:
            raise H2ProtocolError(PROTOCOL_ERROR, f"DATA before headers on stream {sid}")
        body = self._unpad(flags, payload)
        if len(body) != n:
            self.consumed(sid, n - len(body))  # padding is nobody's to consume
        buf = st.buf
        buf += body
        # Whole messages leave the buffer at once, so it holds at most one partial
        # message, and a message's size is checked before its bytes are awaited.
        while len(buf) >= 5:
            if buf[0] != 0:
                return self._on_bad_message(st, INTERNAL, "a compressed message, which was never negotiated", events)
            size = int.from_bytes(buf[1:5], "big")
            if size > self.max_message_bytes:
                return self._on_bad_message(st, RESOURCE_EXHAUSTED, f"a {size}-byte message exceeds {self.max_message_bytes}", events)
            if len(buf) < 5 + size:
                break
            events.append(Message(sid, bytes(buf[5 : 5 + size])))
            del buf[: 5 + size]
        if flags & END_STREAM:
            st.remote_done = True
            self._on_remote_end(st, events)

    def _header_block(self, events: list[Event]) -> None:
        assert self._headers is not None
        sid, flags, block = self._headers
        self._headers = None
        try:  # decoded even for streams we dropped: HPACK's table must stay in step with the peer's
            headers = self._dec.decode(bytes(block))
        except (hpack.HPACKError, UnicodeDecodeError, ValueError) as e:
            raise H2ProtocolError(COMPRESSION_ERROR, f"undecodable header block: {type(e).__name__}") from None
        st = self._streams.get(sid)
        if st is None:
            st = self._opened_by_peer(sid)
            if st is None:
                return
        fields: dict[str, str] = {}
        for name, value in headers:
            fields.setdefault(name, value)
        self._on_headers(st, flags, fields, events)

    def _opened_by_peer(self, sid: int) -> _Stream | None:
        return None

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise H2ProtocolError(FRAME_SIZE_ERROR, "a SETTINGS ack with a payload")
            return
        if len(payload) % 6:
            raise H2ProtocolError(FRAME_SIZE_ERROR, "SETTINGS payload is not a whole number of entries")
        for off in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, off)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2ProtocolError(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                delta = value - self._peer_initial
                self._peer_initial = value
                for st in self._streams.values():
                    st.send_window += delta
                    if st.send_window > MAX_WINDOW:
                        raise H2ProtocolError(FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 2**24 - 1:
                    raise H2ProtocolError(PROTOCOL_ERROR, f"max frame size {value} out of range")
                self._peer_frame = value
            elif key == SETTINGS_HEADER_TABLE_SIZE:
                self._enc.header_table_size = min(value, 1 << 16)
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                raise H2ProtocolError(PROTOCOL_ERROR, "ENABLE_PUSH must be 0 or 1")
        self._out += frame(SETTINGS, ACK, 0)
        for st in list(self._streams.values()):
            self._flush(st)

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2ProtocolError(FRAME_SIZE_ERROR, "malformed WINDOW_UPDATE")
        inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
        if inc == 0:
            raise H2ProtocolError(PROTOCOL_ERROR, "a WINDOW_UPDATE of zero")
        if sid == 0:
            self._peer_window += inc
            if self._peer_window > MAX_WINDOW:
                raise H2ProtocolError(FLOW_CONTROL_ERROR, "the connection window over 2^31-1")
            for st in list(self._streams.values()):
                if st.outbox:
                    self._flush(st)
            return
        self._check_stream_id(sid)
        st = self._streams.get(sid)
        if st is None:
            return
        st.send_window += inc
        if st.send_window > MAX_WINDOW:
            raise H2ProtocolError(FLOW_CONTROL_ERROR, f"stream {sid}'s window over 2^31-1")
        self._flush(st)

    def _end(self, st: _Stream, status: int, detail: str, events: list[Event], *, reset: bool) -> None:
        if reset:
            self.reset_stream(st.id)
        else:
            self._drop(st.id)
        events.append(StreamEnded(st.id, status, detail))


class H2ClientConnection(_H2Connection):
    def __init__(self, *, authority: str, max_message_bytes: int = MAX_MESSAGE, user_agent: str = "meshnet-p2p") -> None:
        super().__init__(max_message_bytes=max_message_bytes)
        self.authority = authority
        self.user_agent = user_agent
        self._next_id = 1

    def initiate(self) -> None:
        self._out += PREFACE
        self._send_settings()

    def open_stream(self, path: str, *, timeout: float | None = None) -> int:
        """Send a call's request headers; returns its stream id."""
        if self.goaway is not None:
            raise H2StreamClosed(f"the peer is going away ({self.goaway.detail})")
        sid = self._next_id
        self._next_id += 2
        headers = [(":method", "POST"), (":scheme", "https"), (":path", path), (":authority", self.authority),
                   ("content-type", "application/grpc"), ("te", "trailers"), ("user-agent", self.user_agent)]
        if timeout is not None:
            headers.append(("grpc-timeout", f"{max(1, int(timeout * 1000))}m"))
        self._out += frame(HEADERS, END_HEADERS, sid, self._enc.encode(headers))
        self._new_stream(sid)
        return sid

    def end_stream(self, stream_id: int) -> None:
        st = self._streams.get(stream_id)
        if st is not None and not st.local_done and not st.end_after_outbox:
            st.end_after_outbox = True
            self._flush(st)

    def _check_stream_id(self, sid: int) -> None:
        if sid == 0 or sid % 2 == 0 or sid >= self._next_id:
            raise H2ProtocolError(PROTOCOL_ERROR, f"a frame for stream {sid}, which this client never opened")

    def _on_reset(self, st: _Stream, code: int, events: list[Event]) -> None:
        # As gRPC maps them: a refused stream was never processed (safe to retry), a cancel is CANCELLED.
        status = {CANCEL: CANCELLED, REFUSED_STREAM: UNAVAILABLE}.get(code, INTERNAL)
        events.append(StreamEnded(st.id, status, f"the peer reset the stream (HTTP/2 error {code})"))

    def _on_goaway(self, goaway: ConnectionEnded, events: list[Event]) -> None:
        for st in [st for st in self._streams.values() if st.id > goaway.last_stream_id]:  # never processed: retry elsewhere
            self._end(st, UNAVAILABLE, "the peer went away before taking this call", events, reset=False)

    def _on_remote_end(self, st: _Stream, events: list[Event]) -> None:
        self._end(st, INTERNAL, "the stream ended without a status", events, reset=False)

    def _on_bad_message(self, st: _Stream, status: int, detail: str, events: list[Event]) -> None:
        self._end(st, status, detail, events, reset=True)

    def _on_headers(self, st: _Stream, flags: int, fields: dict[str, str], events: list[Event]) -> None:
        sid = st.id
        end = bool(flags & END_STREAM)
        if not st.got_headers:
            st.got_headers = True
            status = fields.get(":status")
            if status != "200":
                return self._end(st, UNAVAILABLE, f"HTTP status {status} instead of a gRPC response", events, reset=not end)
            if not end:
                if not fields.get("content-type", "").startswith("application/grpc"):
                    return self._end(st, INTERNAL, f"content-type {fields.get('content-type')!r} is not gRPC", events, reset=True)
                return
            # a trailers-only response: the status follows in these same headers
        elif not end:
            raise H2ProtocolError(PROTOCOL_ERROR, f"a second header block on stream {sid} that does not end it")
        if st.buf:
            return self._end(st, INTERNAL, "the stream ended inside a message", events, reset=False)
        raw = fields.get("grpc-status", "")
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 3):
            return self._end(st, INTERNAL, f"trailers without a valid grpc-status ({raw[:16]!r})", events, reset=False)
        self._end(st, int(raw), urllib.parse.unquote(fields.get("grpc-message", ""))[:1024], events, reset=False)


class H2ServerConnection(_H2Connection):
    """The server role: the client opens calls (odd stream ids, increasing); the
    server answers each with headers, messages and trailers carrying a gRPC status."""

    def __init__(self, *, max_message_bytes: int = MAX_MESSAGE, max_streams: int = MAX_STREAMS) -> None:
        super().__init__(max_message_bytes=max_message_bytes)
        self.max_streams = max_streams
        self._preface = False
        self._last_id = 0
        self._opening: int | None = None  # a new call whose header block is being read

    def initiate(self) -> None:
        self._send_settings(struct.pack(">HI", SETTINGS_MAX_CONCURRENT_STREAMS, self.max_streams))

    def _last_taken(self) -> int:
        return self._last_id

    def _preface_seen(self, buf: bytearray) -> bool:
        if self._preface:
            return True
        if len(buf) < len(PREFACE):
            if not PREFACE.startswith(bytes(buf)):
                raise H2ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 client")
            return False
        if bytes(buf[: len(PREFACE)]) != PREFACE:
            raise H2ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 client")
        del buf[: len(PREFACE)]
        self._preface = True
        return True

    def send_trailers(self, stream_id: int, status: int = 0, message: str = "") -> None:
        """End the call with a gRPC status, after any messages still queued."""
        st = self._streams.get(stream_id)
        if st is None or st.local_done or st.end_after_outbox:
            return
        st.trailers = (status, message[:1024])
        st.end_after_outbox = True
        self._flush(st)

    def _before_message(self, st: _Stream) -> None:
        if not st.sent_headers:
            st.sent_headers = True
            self._out += frame(HEADERS, END_HEADERS, st.id,
                               self._enc.encode([(":status", "200"), ("content-type", "application/grpc")]))

    def _local_done(self, st: _Stream) -> None:
        st.local_done = True
        self._drop(st.id)
        if not st.remote_done:  # the call is over: tell the client to stop sending (as grpc servers do)
            self._out += frame(RST_STREAM, 0, st.id, struct.pack(">I", NO_ERROR))

    def _check_stream_id(self, sid: int) -> None:
        if sid == 0 or sid % 2 == 0 or sid > self._last_id:
            raise H2ProtocolError(PROTOCOL_ERROR, f"a frame for stream {sid}, which the client never opened")

    def _check_headers_stream(self, sid: int) -> None:
        if sid == 0 or sid % 2 == 0:
            raise H2ProtocolError(PROTOCOL_ERROR, f"HEADERS on stream {sid}, which a client cannot open")
        if sid > self._last_id:
            self._last_id = sid  # a new call, opened in _opened_by_peer once its block is decoded
            self._opening = sid
        # HEADERS on a stream already over: decoded (HPACK stays in step) and dropped, as RFC 9113 5.1 allows

    def _opened_by_peer(self, sid: int) -> _Stream | None:
        if self._opening != sid:
            return None
        self._opening = None
        return self._new_stream(sid)

    def _on_headers(self, st: _Stream, flags: int, fields: dict[str, str], events: list[Event]) -> None:
        end = bool(flags & END_STREAM)
        if st.got_headers:  # trailers from a client: gRPC has none, but they end the request
            if not end:
                raise H2ProtocolError(PROTOCOL_ERROR, f"a second header block on stream {st.id} that does not end it")
            st.remote_done = True
            events.append(RequestEnded(st.id))
            return
        st.got_headers = True
        if sum(1 for s in self._streams.values() if not s.local_done) > self.max_streams:
            self.reset_stream(st.id, REFUSED_STREAM)
            return
        path = fields.get(":path", "")
        if fields.get(":method") != "POST" or not path.startswith("/") or \
                not fields.get("content-type", "").startswith("application/grpc"):
            st.remote_done = end
            self.send_trailers(st.id, UNIMPLEMENTED, "not a gRPC request")
            return
        events.append(RequestStarted(st.id, path, _parse_timeout(fields.get("grpc-timeout"))))
        if end:
            st.remote_done = True
            events.append(RequestEnded(st.id))

    def _on_reset(self, st: _Stream, code: int, events: list[Event]) -> None:
        events.append(StreamReset(st.id, code))

    def _on_remote_end(self, st: _Stream, events: list[Event]) -> None:
        if st.buf:
            self.reset_stream(st.id, CANCEL)
            events.append(StreamReset(st.id, PROTOCOL_ERROR))
            return
        events.append(RequestEnded(st.id))

    def _on_bad_message(self, st: _Stream, status: int, detail: str, events: list[Event]) -> None:
        # The call ends with that status, then RST_STREAM stops the client's upload;
        # the handler learns of it as a reset. (Dropping the stream credits its partial message.)
        st.outbox.clear()
        st.end_after_outbox = st.local_done = False
        self.send_trailers(st.id, status, detail)
        events.append(StreamReset(st.id, CANCEL))


def _parse_timeout(value: str | None) -> float | None:
    digits = (value or "")[:-1]
    if not value or len(value) > 9 or value[-1] not in _TIMEOUT_UNITS or not (digits.isascii() and digits.isdigit()):
        return None
    return int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]
