"""Dialing a peer through a relay: HTTP CONNECT, both ends, on the ``h11`` library.

A client reaches a peer behind NAT by asking its relay for ``CONNECT <peer
id>.peer:443`` (:func:`relay_target`); once the relay answers ``200`` the
connection carries TLS end to end. Both ends here are sans-io (bytes in,
decisions out; the caller owns the socket), bounded, and typed:

- :class:`ConnectDialog`, the client's: the request to send, then the relay's
  answer fed in until it says established (the bytes after it are the peer's
  first TLS bytes) or raises :class:`ConnectError` (refused, closed, not HTTP,
  too long). A ``429`` is ``busy``: the peer's circuits are all held, a limit,
  not a fault.
- :class:`ConnectHead`, the relay's: the client's request head fed in until it
  gives the target, then the answer to send.

h11 (python-hyper's sans-io HTTP/1.1, well kept and fuzzed upstream) does the
parsing, as h2 does for the data plane, instead of a parser of our own.
"""

from __future__ import annotations

from http import HTTPStatus

import h11

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import PeerId

PEER_HOST_SUFFIX = ".peer"  # a CONNECT target is <lowercase peer id>.peer:443
MAX_ANSWER = 8192  # a relay's answer to CONNECT, head and all
MAX_HEAD = 8192  # a client's CONNECT request head, request line and headers together
MAX_HEADERS = 64
ESTABLISHED = 200
BUSY = 429  # the relay's answer when the peer's circuits are all held


class ConnectError(MeshnetError):
    """CONNECT through a relay failed. A client's: ``status`` is the relay's refusal
    (404, 429, ...) when it answered one, else None (it closed, or did not speak
    HTTP). The relay's: the client's head is none it accepts (``status`` None)."""

    def __init__(self, message: str, status: int | None = None, answer: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.answer = answer  # the relay's status line, for a refusal

    @property
    def busy(self) -> bool:
        return self.status == BUSY


def relay_target(peer_id: PeerId) -> str:
    """What a client CONNECTs to on a relay to reach ``peer_id`` (sent unresolved)."""
    return f"{str(peer_id).lower()}{PEER_HOST_SUFFIX}:443"


def target_peer(target: str) -> str | None:
    """The lowercase peer id a CONNECT target names (the inverse of :func:`relay_target`,
    any port), or None for a target that names no peer."""
    host = target.rsplit(":", 1)[0].lower()
    return host[: -len(PEER_HOST_SUFFIX)] if host.endswith(PEER_HOST_SUFFIX) else None


def _events(conn: h11.Connection, what: str):
    """h11's events until it needs more bytes or pauses; its errors as ConnectError
    ("<what> is too long", "<what> is not HTTP (...)")."""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as e:
            if e.error_status_hint == 431:  # h11's word for a buffer that outgrew the bound
                raise ConnectError(f"{what} is too long") from None
            raise ConnectError(f"{what} is not HTTP ({str(e)[:80]})") from None
        if event is h11.NEED_DATA or event is h11.PAUSED:
            return
        yield event


class ConnectDialog:
    """The client's side of one CONNECT: send :attr:`request`, then feed the relay's
    bytes to :meth:`receive` until it returns the bytes that followed the relay's
    ``200`` (the peer's first TLS bytes, often none)."""

    def __init__(self, target: str, *, max_answer: int = MAX_ANSWER) -> None:
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_answer)
        request = h11.Request(method="CONNECT", target=target, headers=[("Host", target)])
        self.request = self._conn.send(request) + self._conn.send(h11.EndOfMessage())

    def receive(self, data: bytes) -> bytes | None:
        """``data`` from the relay (b"" when it closed): None while its answer is
        incomplete, then the bytes after it; ConnectError if it refused or broke."""
        if not data:
            raise ConnectError("the relay closed the connection")
        self._conn.receive_data(data)
        for event in _events(self._conn, "the relay's answer to CONNECT"):
            if isinstance(event, h11.InformationalResponse):
                continue  # 1xx: the answer is still to come
            if isinstance(event, h11.Response):
                if event.http_version not in (b"1.0", b"1.1"):  # h11 reads any HTTP/d.d: no relay speaks 0.0 or 2.0 here
                    raise ConnectError(f"the relay answered in HTTP/{event.http_version.decode()[:8]}, not HTTP/1.x")
                if event.status_code == ESTABLISHED:
                    return self._conn.trailing_data[0]
                line = f"HTTP/{event.http_version.decode()} {event.status_code} {event.reason.decode('latin-1')}"
                raise ConnectError(f"the relay refused: {line[:80]}", event.status_code, line)
        return None


class ConnectHead:
    """The relay's side of one CONNECT: feed the client's bytes to :meth:`receive`
    until it returns the request's target, then send :meth:`answer`. The head
    (request line and headers) is bounded by ``max_head`` bytes and ``max_headers``
    fields, and must carry no body; anything else raises ConnectError."""

    def __init__(self, *, max_head: int = MAX_HEAD, max_headers: int = MAX_HEADERS) -> None:
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head)
        self._max_headers = max_headers
        self._target: str | None = None

    def receive(self, data: bytes) -> str | None:
        """``data`` from the client (b"" when it closed): None while the head is
        incomplete, then the target it CONNECTs to."""
        self._conn.receive_data(data)
        for event in _events(self._conn, "the CONNECT request"):
            if isinstance(event, h11.Request):
                if event.method != b"CONNECT":
                    raise ConnectError(f"not a CONNECT request ({event.method[:16]!r})")
                if len(event.headers) > self._max_headers:
                    raise ConnectError(f"the CONNECT request has more than {self._max_headers} headers")
                self._target = event.target.decode("latin-1")
            elif isinstance(event, h11.EndOfMessage):
                return self._target
            elif isinstance(event, h11.ConnectionClosed):
                break  # said below, as a close before the head ended
            else:  # Data: a CONNECT carries no body
                raise ConnectError("the CONNECT request has a body")
        if data == b"":
            raise ConnectError("the client closed before its CONNECT request ended")
        return None

    @property
    def early(self) -> bytes:
        """What the client sent after its head (its first TLS bytes, if it did not wait)."""
        return self._conn.trailing_data[0]

    def answer(self, status: int) -> bytes:
        """The answer to send: ``200 Connection established`` (the bytes that follow
        are the splice), or a refusal the relay closes after."""
        if status == ESTABLISHED:
            return self._conn.send(h11.Response(status_code=status, headers=[], reason=b"Connection established"))
        return self._conn.send(h11.Response(status_code=status, reason=HTTPStatus(status).phrase.encode(),
                                            headers=[("Content-Length", "0"), ("Connection", "close")]))
