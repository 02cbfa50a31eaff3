"""Opaque relays for peers behind NAT: an HTTP CONNECT splice.

A peer that cannot accept connections keeps one outbound *control*
connection to a relay, on which it proves its identity (it signs the relay's
nonce; the relay signs the peer's, so each knows who the other is). A client
dials the relay with ``CONNECT <peer id>.peer:443`` (our channel does; grpcio
does too, given the channel option ``grpc.http_proxy``); the relay asks the peer, over
its control connection, to open a *data* connection for that client, and
splices the two byte streams. TLS runs end to end, client to peer: the relay
sees ciphertext only, and any byte it changed would fail the TLS record MAC.
Both ends of CONNECT are ``dataplane/transport/connect.py`` (on h11).

Limits: reservations in total, concurrent connections (circuits) per peer and
per client source to one peer, shared fairly when they run short
(``circuits.py``: a newcomer takes back the circuit idle longest from the
source holding most), bytes and seconds per circuit, and bytes per second per
peer (a token bucket over all of the peer's connections). When the peer's
control connection ends, its reservation and every splice it carries end too;
when either side of a splice closes, the other is closed. A circuit the relay
closes (taken back, or over a cap) is just closed: TLS runs end to end, so the
client's channel sees the connection end and opens another.

Control protocol (one line each, ``\\n``-terminated):
    peer -> relay   MESHNET-RESERVE <peer id> <peer nonce hex>
    relay -> peer   CHALLENGE <relay nonce hex> <relay signature hex>
    peer -> relay   SIG <peer signature hex>
    relay -> peer   OK | ERR <reason>
    relay -> peer   OPEN <token>                  (per client)
    peer -> relay   (new connection) MESHNET-ATTACH <token>
    peer -> relay   PING <n>                      (every KEEPALIVE_S: renews the reservation)
    relay -> peer   PONG <n>
    relay -> peer   LOAD <circuits now> <clients turned away>   (after each PONG)

``LOAD`` tells the peer how many clients the relay turned away since the
reservation began because its circuits were all held (not those over their own
source's share): a peer whose relay keeps turning clients away moves to
another (relay_keeper.py). Peers of older versions ignore the line.

A reservation is a lease of ``reservation_idle_timeout``, renewed by each
ping, so it lasts while its peer keeps pinging: a relay ends one whose
control connection stayed silent for ``reservation_idle_timeout`` (a peer
that vanished without closing, or a NAT that dropped the mapping), and a
peer gives up a relay that does not answer a ping within PONG_TIMEOUT_S (a
frozen relay), so that it can reserve elsewhere.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import trio

from meshnet_p2p.core.netgroup import ip_group
from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.guard import Guard
from meshnet_p2p.core.identity import Identity, IdentityError, PeerId
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.core.ratelimit import TokenBucket
from meshnet_p2p.dataplane.transport.connect import BUSY, ESTABLISHED, ConnectError, ConnectHead, target_peer
from .circuits import CIRCUIT_LIMIT, Circuit, Reclaim, Refuse, admit_circuit, circuit_source, per_source_limit

PEER_DOMAIN = b"meshnet-relay-reserve-v1\0"
RELAY_DOMAIN = b"meshnet-relay-accept-v1\0"
log = logging.getLogger(__name__)
MAX_LINE = 8192
KEEPALIVE_S = 10.0  # a peer pings its relay this often
PONG_TIMEOUT_S = 5.0  # and gives the relay up when a ping goes unanswered this long
RESERVE_TIMEOUT_S = 10.0  # connect, challenge, signature and verdict, all told
MAX_ATTACHING = 64  # data connections a peer opens for its relay's clients at once
MAX_RESERVATIONS_PER_GROUP = 8  # reservations from one source network (IPv4 /24, IPv6 /48): identities cost nothing


class RelayError(MeshnetError):
    pass


@dataclass(frozen=True)
class RelayLimits:
    max_reservations: int = 128
    max_connections_per_peer: int = 16
    bytes_per_second_per_peer: float = 64e6
    burst_bytes: float = 16e6
    handshake_timeout: float = 10.0
    attach_timeout: float = 10.0
    reservation_idle_timeout: float = 4 * KEEPALIVE_S  # a silent peer's reservation ends
    max_circuits_per_source: int | None = None  # to one peer, from one client network; None: per_source_limit()
    # One circuit's caps (it is then closed; the client opens another). Generous: a
    # generation of a 70B-class model (hidden size 8192, f32 seams: 32 KiB a token each
    # way) with an 8k-token prompt and 8k new tokens moves ~1 GiB through a hop, and a
    # pooled channel carries several; 2 h is 4,096 tokens at one a second, twice over.
    max_circuit_bytes: int = 4 << 30
    max_circuit_seconds: float = 2 * 3600.0

    @property
    def per_source(self) -> int:
        if self.max_circuits_per_source is not None:
            return self.max_circuits_per_source
        return per_source_limit(self.max_connections_per_peer)


class _LineReader:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buf = b""

    async def line(self, limit: int = MAX_LINE) -> bytes:
        while b"\n" not in self.buf:
            if len(self.buf) > limit:
                raise RelayError("line too long")
            chunk = await self.stream.receive_some(4096)
            if not chunk:
                raise RelayError("the connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.rstrip(b"\r")


async def _take(bucket: TokenBucket, n: int) -> None:
    """Wait until ``bucket`` lets ``n`` bytes through (see TokenBucket.take), and take them."""
    while (wait := bucket.take(trio.current_time(), n)) > 0:
        await trio.sleep(wait)


@dataclass(eq=False)
class _Circuit:
    """One client's connection to a reserved peer, from CONNECT until either side closes."""
    token: str
    source: str  # circuits.circuit_source() of the client
    scope: trio.CancelScope
    last_active: float  # trio time it last moved a byte (or was opened)
    moved: int = 0
    closed_why: str | None = None  # set when the relay closes it (taken back, over a cap)

    def close(self, why: str) -> None:
        self.closed_why = self.closed_why or why
        self.scope.cancel()


@dataclass
class _Reservation:
    peer_id: PeerId
    control: trio.abc.Stream
    bucket: TokenBucket  # bytes a second over all of the peer's circuits
    group: str | None = None  # the network it reserved from
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    pending: dict[str, trio.MemorySendChannel] = field(default_factory=dict)
    circuits: dict[str, _Circuit] = field(default_factory=dict)  # by token: one per client connection
    turned_away: int = 0  # clients refused because every circuit was held (reported in LOAD)

    @property
    def connections(self) -> int:
        return len(self.circuits)


def _peer_host(stream) -> str | None:
    try:
        return stream.socket.getpeername()[0]
    except (AttributeError, OSError, IndexError):
        return None


def _source_group(stream) -> str | None:
    """The network (IPv4 /24, IPv6 /48) a connection comes from; None off a socket (tests)."""
    host = _peer_host(stream)
    return None if host is None else ip_group(host)


def _client_source(stream) -> str:
    """A client's source for the per-source circuit bound ("local" off a socket: tests)."""
    host = _peer_host(stream)
    return "local" if host is None else circuit_source(host)


async def _splice(a: trio.abc.Stream, b: trio.abc.Stream, bucket: TokenBucket | None,
                  transform: Callable[[bytes, str], bytes] | None = None, first: tuple[bytes, bytes] = (b"", b""),
                  count: Callable[[str, int], None] | None = None) -> int:
    """Copy bytes both ways until either side closes; returns bytes moved.
    ``count(direction, n)`` is told of each chunk as it goes (for metrics)."""
    moved = 0

    async def pump(src, dst, leftover: bytes, direction: str, nursery: trio.Nursery) -> None:
        nonlocal moved
        try:
            if leftover:
                await dst.send_all(transform(leftover, direction) if transform else leftover)
            while True:
                data = await src.receive_some(65536)
                if not data:
                    break
                if bucket is not None:
                    await _take(bucket, len(data))
                await dst.send_all(transform(data, direction) if transform else data)
                moved += len(data)
                if count is not None:
                    count(direction, len(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        nursery.cancel_scope.cancel()  # one side ended: end the splice

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, a, b, first[0], "a->b", nursery)
        nursery.start_soon(pump, b, a, first[1], "b->a", nursery)
    return moved


class Relay:
    def __init__(self, identity: Identity, limits: RelayLimits = RelayLimits(),
                 on_splice: Callable[[PeerId, int, float], None] | None = None) -> None:
        self.identity = identity
        self.on_splice = on_splice  # told of each splice when it ends: (peer, bytes moved, seconds)
        self.limits = limits
        self.reservations: dict[str, _Reservation] = {}  # lowercased peer id -> reservation
        self._tokens: dict[str, _Reservation] = {}
        self.transform: Callable[[bytes, str], bytes] | None = None  # what a dishonest operator could do
        # counters since start: reservations made, refusals (full, unproven, over a limit),
        # splices made, reservations ended for silence
        self.stats = {"reservations": 0, "refused": 0, "spliced": 0, "expired": 0}
        # refusals by reason (a fixed set, see _refuse), and bytes as they are spliced, a->b
        # being client to peer
        self.refusals: Counter[str] = Counter()
        self.spliced_bytes = {"a->b": 0, "b->a": 0}
        # circuits the relay closed itself, by why: "taken_back" (a newcomer's fair share),
        # "data_cap", "time_cap" (kept out of stats: a relay record's load holds exactly its fields)
        self.closed: Counter[str] = Counter()

    def load(self) -> dict[str, int]:
        """What this relay carries now, and its counters: for its record and ``status``."""
        return {"reservations_now": len(self.reservations),
                "circuits_now": sum(r.connections for r in self.reservations.values()),
                "bytes": sum(self.spliced_bytes.values()), **self.stats}

    def _refuse(self, reason: str) -> None:
        self.stats["refused"] += 1
        self.refusals[reason] += 1

    def _count_bytes(self, direction: str, n: int) -> None:
        self.spliced_bytes[direction] += n

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        reader = _LineReader(stream)
        try:
            with trio.fail_after(self.limits.handshake_timeout):
                first = await reader.line()
            if first.startswith(b"CONNECT "):
                await self._client(stream, reader, first)
            elif first.startswith(b"MESHNET-RESERVE "):
                await self._reserve(stream, reader, first)
            elif first.startswith(b"MESHNET-ATTACH "):
                await self._attach(stream, reader, first)
        except (RelayError, ConnectError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                trio.BusyResourceError, IdentityError, ValueError):
            pass
        except Exception as e:  # one connection's bug or bytes must never end the relay
            log.warning("relay connection ended by %r", e)
        finally:
            await trio.aclose_forcefully(stream)

    async def _reserve(self, stream, reader: _LineReader, first: bytes) -> None:
        parts = first.decode(errors="replace").split()
        if len(parts) != 3:
            raise RelayError("bad reserve line")
        peer = PeerId.from_string(parts[1])
        peer_nonce = bytes.fromhex(parts[2])
        if len(peer_nonce) != 32:
            raise RelayError("bad nonce")
        nonce = os.urandom(32)
        sig = self.identity.sign(RELAY_DOMAIN + peer_nonce + peer.multihash)
        await stream.send_all(f"CHALLENGE {nonce.hex()} {sig.hex()}\n".encode())
        with trio.fail_after(self.limits.handshake_timeout):
            reply = (await reader.line()).decode(errors="replace").split()
        if len(reply) != 2 or reply[0] != "SIG" or not peer.verify(bytes.fromhex(reply[1]), PEER_DOMAIN + nonce + self.identity.peer_id.multihash):
            await stream.send_all(b"ERR identity not proven\n")
            self._refuse("unproven")
            return
        key = str(peer).lower()
        old = self.reservations.get(key)
        if old is None and len(self.reservations) >= self.limits.max_reservations:
            await stream.send_all(b"ERR relay full\n")
            self._refuse("full")
            return
        group = _source_group(stream)
        if old is None and group is not None and sum(
                r.group == group for r in self.reservations.values()) >= MAX_RESERVATIONS_PER_GROUP:
            await stream.send_all(b"ERR too many reservations from your network\n")
            self._refuse("network_limit")
            return
        if old is not None:
            await trio.aclose_forcefully(old.control)  # the newest control connection wins
        bucket = TokenBucket(self.limits.burst_bytes, self.limits.bytes_per_second_per_peer, trio.current_time())
        res = _Reservation(peer, stream, bucket, group=group)
        self.reservations[key] = res
        self.stats["reservations"] += 1
        async with res.send_lock:  # a client's OPEN may be sent on this stream from now on
            await stream.send_all(b"OK\n")
        try:
            while True:  # pings renew the reservation; silence or EOF ends it
                line = None
                with trio.move_on_after(self.limits.reservation_idle_timeout):
                    line = await reader.line()
                if line is None:
                    self.stats["expired"] += 1
                    break
                parts = line.split()
                if len(parts) == 2 and parts[0] == b"PING" and len(parts[1]) <= 20:
                    async with res.send_lock:
                        await stream.send_all(b"PONG " + parts[1] + b"\n"
                                              + f"LOAD {res.connections} {res.turned_away}\n".encode())
                # anything else is ignored: the control connection carries nothing more
        finally:
            if self.reservations.get(key) is res:
                del self.reservations[key]
            for circuit in list(res.circuits.values()):
                circuit.close("the reservation ended")
            for token in list(res.pending):
                self._tokens.pop(token, None)

    async def _client(self, stream, reader: _LineReader, first: bytes) -> None:
        head = ConnectHead()  # a malformed or oversized head: ConnectError, closed unanswered
        with trio.fail_after(self.limits.handshake_timeout):
            # the request line was read to tell CONNECT from the control lines: hand it back
            target = head.receive(first + b"\r\n" + reader.buf)
            while target is None:
                target = head.receive(await stream.receive_some(4096))
        peer = target_peer(target)
        if peer is None:
            await stream.send_all(head.answer(400))
            self.refusals["bad_target"] += 1  # (a client's mistake: not among stats["refused"])
            return
        res = self.reservations.get(peer)
        if res is None:
            await stream.send_all(head.answer(404))
            self.refusals["no_reservation"] += 1
            return
        source = _client_source(stream)
        now = trio.current_time()
        decision = admit_circuit([Circuit(c.token, c.source, now - c.last_active) for c in res.circuits.values()],
                                 source, capacity=self.limits.max_connections_per_peer, per_source=self.limits.per_source)
        if isinstance(decision, Refuse):
            await stream.send_all(head.answer(BUSY))
            self._refuse(decision.reason)
            if decision.reason == CIRCUIT_LIMIT:
                res.turned_away += 1
            return
        if isinstance(decision, Reclaim):  # the newcomer's fair share: the circuit idle longest of the biggest source
            self._close_circuit(res, res.circuits[decision.session_id], "taken_back")
        token = secrets.token_hex(16)
        send, recv = trio.open_memory_channel(1)
        # registered before any await: concurrent CONNECTs see it; the deadline is its time cap
        circuit = _Circuit(token, source, trio.CancelScope(deadline=now + self.limits.max_circuit_seconds), now)
        res.circuits[token] = circuit
        res.pending[token] = send
        self._tokens[token] = res
        try:
            with circuit.scope:
                async with res.send_lock:
                    await res.control.send_all(f"OPEN {token}\n".encode())
                with trio.fail_after(self.limits.attach_timeout):
                    data_stream, data_reader, attached = await recv.receive()
                started = trio.current_time()
                try:
                    await stream.send_all(head.answer(ESTABLISHED))
                    self.stats["spliced"] += 1
                    await _splice(stream, data_stream, res.bucket, self.transform, first=(head.early, data_reader.buf),
                                  count=lambda direction, n: self._count_circuit(res, circuit, direction, n))
                finally:
                    attached.set()
                    if self.on_splice is not None:
                        self.on_splice(res.peer_id, circuit.moved, trio.current_time() - started)
            if circuit.scope.cancelled_caught and circuit.closed_why is None:  # its deadline passed
                self._close_circuit(res, circuit, "time_cap")
        finally:
            if res.circuits.get(token) is circuit:
                del res.circuits[token]
            res.pending.pop(token, None)
            self._tokens.pop(token, None)

    def _close_circuit(self, res: _Reservation, circuit: _Circuit, why: str) -> None:
        """Close one circuit now (both its connections end) and stop counting it."""
        if res.circuits.get(circuit.token) is circuit:
            del res.circuits[circuit.token]
        if circuit.closed_why is None:
            self.closed[why] += 1
        circuit.close(why)

    def _count_circuit(self, res: _Reservation, circuit: _Circuit, direction: str, n: int) -> None:
        self._count_bytes(direction, n)
        circuit.moved += n
        circuit.last_active = trio.current_time()
        if circuit.moved >= self.limits.max_circuit_bytes:
            self._close_circuit(res, circuit, "data_cap")

    async def _attach(self, stream, reader: _LineReader, first: bytes) -> None:
        parts = first.decode(errors="replace").split()
        token = parts[1] if len(parts) == 2 else ""
        res = self._tokens.pop(token, None)
        if res is None:
            return
        chan = res.pending.pop(token, None)
        if chan is None:
            return
        attached = trio.Event()
        try:
            chan.send_nowait((stream, reader, attached))
        except (trio.WouldBlock, trio.BrokenResourceError):
            return
        await attached.wait()  # the client's handler owns the splice; keep this stream open until it ends


async def reserve(relay: Multiaddr, identity: Identity) -> tuple[trio.abc.Stream, _LineReader]:
    """Open a control connection to ``relay`` and reserve a slot, each side
    proving its identity. Raises :class:`RelayError` if the relay is not the
    peer its multiaddr names, or refuses."""
    relay_peer = relay.peer_id
    if relay_peer is None or relay.transport != "tcp":
        raise RelayError(f"relay address {relay} must be /ip4/<host>/tcp/<port>/p2p/<relay peer id>")
    try:  # bounded: an address that accepts and then says nothing must not hold the peer for ever
        with trio.fail_after(RESERVE_TIMEOUT_S):
            return await _reserve_on(relay, relay_peer, identity)
    except trio.TooSlowError:
        raise RelayError(f"the relay at {relay.host}:{relay.port} did not complete a reservation "
                         f"within {RESERVE_TIMEOUT_S:g} s") from None


async def _reserve_on(relay: Multiaddr, relay_peer: PeerId, identity: Identity) -> tuple[trio.abc.Stream, _LineReader]:
    control = await trio.open_tcp_stream(relay.host, relay.port)
    try:
        reader = _LineReader(control)
        my_nonce = os.urandom(32)
        await control.send_all(f"MESHNET-RESERVE {identity.peer_id} {my_nonce.hex()}\n".encode())
        parts = (await reader.line()).decode(errors="replace").split()
        if len(parts) != 3 or parts[0] != "CHALLENGE":
            raise RelayError("relay did not answer the reservation")
        if not relay_peer.verify(bytes.fromhex(parts[2]), RELAY_DOMAIN + my_nonce + identity.peer_id.multihash):
            raise RelayError(f"the relay at {relay.host}:{relay.port} is not {relay_peer}")
        sig = identity.sign(PEER_DOMAIN + bytes.fromhex(parts[1]) + relay_peer.multihash)
        await control.send_all(f"SIG {sig.hex()}\n".encode())
        verdict = await reader.line()
        if verdict != b"OK":
            raise RelayError(f"relay refused the reservation: {verdict.decode(errors='replace')}")
        return control, reader
    except BaseException:
        await trio.aclose_forcefully(control)
        raise


LOAD_HISTORY = 8  # the relay's last LOAD reports a peer keeps


class Reservation:
    """A reservation this peer holds on a relay (see :func:`hold_reservation`)."""

    def __init__(self, relay: Multiaddr) -> None:
        self.relay = relay
        self.rtt_ms: float | None = None  # the last ping's round trip
        self.opened = 0  # clients the relay handed over
        self.circuits = 0  # circuits to this peer now, as the relay's last LOAD said
        # clients the relay says it turned away since the reservation began: one total per
        # LOAD, oldest first (0 before any); a relay that never sends LOAD adds none
        self.turned_away: list[int] = [0]
        self._reported = trio.Event()

    def loaded(self, circuits: int, turned_away: int) -> None:
        """The relay's LOAD line: keep it, and wake whoever waits for the next."""
        self.circuits = circuits
        self.turned_away = (self.turned_away + [turned_away])[-LOAD_HISTORY:]
        reported, self._reported = self._reported, trio.Event()
        reported.set()

    async def next_report(self) -> None:
        await self._reported.wait()


async def hold_reservation(relay: Multiaddr, identity: Identity, local: tuple[str, int] | Callable[[socket.socket], None],
                           *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Reserve a slot on ``relay`` (started with the :class:`Reservation`, once
    the relay said OK) and serve each client it announces over a fresh
    connection to the relay: handed to ``local`` if it is a callable that adopts
    connected sockets (this peer's own server: no splice, no loopback hop), or
    spliced to ``local`` if it is an address. Pings the relay every KEEPALIVE_S,
    which renews the reservation, and keeps what the relay's LOAD lines say on
    the :class:`Reservation`. Returns only by raising :class:`RelayError`:
    refused, the relay closed, or a ping went unanswered."""
    control, reader = await reserve(relay, identity)
    held = Reservation(relay)
    pong = {"n": 0, "event": trio.Event()}
    sent = {"n": 0}  # the last ping sent: a pong for a later one is a lie
    send_lock = trio.Lock()
    attaching = trio.CapacityLimiter(MAX_ATTACHING)

    async def pinger() -> None:
        for n in itertools.count(1):
            await trio.sleep(KEEPALIVE_S)
            pong["event"] = trio.Event()
            t0 = trio.current_time()
            sent["n"] = n
            async with send_lock:
                await control.send_all(f"PING {n}\n".encode())
            with trio.move_on_after(PONG_TIMEOUT_S):
                while pong["n"] < n:
                    await pong["event"].wait()
                    pong["event"] = trio.Event()
                held.rtt_ms = (trio.current_time() - t0) * 1000
                continue
            raise RelayError(f"the relay {relay.peer_id} did not answer a ping within {PONG_TIMEOUT_S:g} s")

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pinger)
            task_status.started(held)
            while True:
                line = (await reader.line()).decode(errors="replace").split()
                if len(line) == 2 and line[0] == "OPEN":
                    if attaching.statistics().borrowed_tokens >= MAX_ATTACHING:
                        continue  # a relay asking for more at once than any client needs: dropped
                    held.opened += 1
                    nursery.start_soon(_serve_one, relay, line[1], local, attaching)
                elif len(line) == 2 and line[0] == "PONG" and line[1].isascii() and line[1].isdigit() \
                        and len(line[1]) <= 20 and int(line[1]) <= sent["n"]:
                    pong["n"] = max(pong["n"], int(line[1]))
                    pong["event"].set()
                elif len(line) == 3 and line[0] == "LOAD" and all(_count(x) for x in line[1:]):
                    held.loaded(int(line[1]), int(line[2]))
    except BaseExceptionGroup as group:  # one reason, not a tree: why the reservation ended
        if group.subgroup(trio.Cancelled) is not None:
            raise  # being cancelled is not losing the relay
        leaf = first_error(group)
        if isinstance(leaf, RelayError):
            raise leaf from None
        if isinstance(leaf, (OSError, trio.BrokenResourceError, trio.ClosedResourceError)):
            raise RelayError(f"lost the relay {relay.peer_id}: {type(leaf).__name__}") from None
        raise
    finally:
        await trio.aclose_forcefully(control)


async def attach_to_relay(relay: Multiaddr, identity: Identity, local: tuple[str, int] | Callable[[socket.socket], None],
                          *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Hold a reservation on this one relay for good (``--relay`` pins it): the
    first must succeed; a lost one is reserved again, with backoff."""
    backoff = 0.5
    first = True
    guard = Guard("relay_attach")
    while True:
        since = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(hold_reservation, relay, identity, local)
                if first:
                    task_status.started()
                    first = False
        except* (OSError, RelayError, trio.BrokenResourceError, ValueError) as group:
            if first:  # the first reservation must succeed: say why it did not
                raise first_error(group) from None
        except* Exception as group:  # a bug: counted and logged, and the reservation taken again
            if first:
                raise first_error(group) from None
            await guard.failed(first_error(group))
        if trio.current_time() - since > 4 * KEEPALIVE_S:
            backoff = 0.5  # it held a while: try again soon; one that drops at once waits longer each time
        await trio.sleep(backoff)
        backoff = min(backoff * 2, 30.0)


def _count(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 15


def first_error(group: BaseException) -> BaseException:
    """The first leaf of an exception group (an exception that is no group: itself)."""
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


async def _serve_one(relay: Multiaddr, token: str, local: tuple[str, int] | Callable[[socket.socket], None],
                     limiter: trio.CapacityLimiter | None = None) -> None:
    """One client's data connection: its failure is that client's, never the reservation's."""
    if limiter is None:
        limiter = trio.CapacityLimiter(1)
    async with limiter:
        try:
            await _attach_one(relay, token, local)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as e:  # e.g. the server could not take the socket: this client is lost, not the relay
            log.warning("relayed connection for %s failed: %r", relay.peer_id, e)


async def _attach_one(relay: Multiaddr, token: str, local: tuple[str, int] | Callable[[socket.socket], None]) -> None:
    try:
        data = await trio.open_tcp_stream(relay.host, relay.port)
        await data.send_all(f"MESHNET-ATTACH {token}\n".encode())
        if callable(local):  # the server takes the connection itself; nothing was read from it here
            sock = socket.socket(fileno=data.socket.detach())
            sock.setblocking(True)
            local(sock)
            return
        inner = await trio.open_tcp_stream(*local)
        try:
            await _splice(data, inner, None)
        finally:
            await trio.aclose_forcefully(inner)
            await trio.aclose_forcefully(data)
    except OSError:
        pass
