"""A DHT node on trio: Kademlia over signed UDP datagrams, plus push-pull gossip.

The node is thin I/O around pure parts: :mod:`routing` (the table),
:mod:`lookup` (the traversal), :mod:`storage` (values), :mod:`wire`
(datagrams), :mod:`gossip` (what to forward) and :mod:`topics` (which topics
it gossips, and who follows them). Everything runs in one
nursery owned by :meth:`DHTNode.run`.

A node in *client mode* (behind NAT, unreachable from outside) asks and
stores but says so in every request, so nobody adds it to a routing table.

A role serves request kinds of its own through :meth:`DHTNode.serve_requests`
(the dialer side of NAT reachability checks, ``dial_back``, is one:
:mod:`meshnet_p2p.nat.dialer`). The node does for those what it does for every
request (signature, freshness, replay, size, the sender's table entry, the
amplification bound on the answer, a counted drop of a malformed one); the
handler owns what the request means, and answers at once or later from a task.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import trio

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.guard import Guard
from meshnet_p2p.core.identity import Identity, PeerId
from meshnet_p2p.core.records import MAX_RECORD_BYTES, PayloadType, Record, RecordRejected, RecordVerifier, keep_newest, peek, peek_unpacked, wall_ms
from meshnet_p2p.core.stats import LOOKUP_SECONDS, Histogram
from . import paging, refresh, wire
from .gossip import GossipState
from .topics import Follows
from .lookup import iterative_lookup
from .pending import Pending
from .tagged import unnamed
from meshnet_p2p.core.ratelimit import SourceRates
from .routing import Contact, RoutingTable, key_id, node_id_of
from meshnet_p2p.core.netgroup import network_of, networks
from .storage import MAX_KNOWN_TAGS, TAG_BYTES, ValueStore, tag
from .transport import Addr, DatagramTransport

log = logging.getLogger(__name__)


class DHTError(MeshnetError):
    pass


MAX_KEY_CHARS = 512
AMPLIFICATION = 3  # an unproven address gets replies at most this many times what it sent
COOKIE_BYTES = 16
COOKIE_SECRET_S = 120.0
# A request that asks for contacts (k of them: ~1.3 KB with IPv4 addresses) to an address
# we hold no cookie for is padded by this much (~230 B bare, ~490 B padded), so that the
# answer fits AMPLIFICATION times it and comes at once, not after a cookie round trip
# (QUIC pads its first flight for the same reason). Answers with values are larger: those
# still go through the cookie.
PAD_BYTES = 260
PADDED_KINDS = frozenset({"find_node", "find_value"})
MAX_ADDRESSES = 16_384  # proven addresses and cookies kept
MAX_SEEN_DATAGRAMS = 65_536
MAX_VERIFYING = 64  # new (peer, address) pairs pinged at once
MAX_PUSHES_IN_FLIGHT = 256  # gossip push tasks at once, whatever arrives
PULL_HOMES = 3  # a topic's pull asks a follower or one of the table's this many nodes closest to its key
# Which signers of a topic's records are table members, found again for a pull after this long:
# a node pulls about once a second, and finding them walks every record of the topic (256 at
# 10,000 simulated peers), most of a node's pull (bench/sim.py, docs/scale.md)
SIGNERS_SEEN_S = 30.0
# A put stores again where the last lookup of its key found homes, within this long, without a
# lookup: a volunteer re-announces every 30 s, and each announce's lookup (~70 requests) was
# more than half of what a node sent (bench/sim.py, docs/scale.md); the homes move slower
HOMES_REUSE_S = 120.0
MAX_HOMES_KEPT = 64  # keys whose homes a node remembers (its own records' keys)
MAX_SEEDS = 16  # bootstrap contacts kept for rejoining
REJOIN_BELOW = 4  # a table this small (a partition emptied it) looks for its seeds again
REJOIN_MAX_BACKOFF_S = 300.0
REPLY_BUDGET_BYTES = 40_000  # records per reply, so a reply stays one datagram (wire.MAX_DATAGRAM)
# stores per source network (netgroup.ip_group; a loopback or private address counts alone): an
# office of 16 volunteers stores ~2 records each per announce (30 s), 32 at once: 8x that at once, 16x on average
STORE_BURST = 256
STORE_RATE_PER_S = 32.0

Answer = tuple[str, dict[str, Any]]  # a reply's kind and body
# lifetime_cap(key, holds) -> the longest (ms) a value stored under ``key`` by another node may
# live here, or None; ``holds(key)`` says whether this node holds a live value under a key (in
# its store or gossip). The swarm's policy (swarm.node.lifetime_cap): the DHT knows no key names.
LifetimeCap = Callable[[str, Callable[[str], bool]], "int | None"]
# source_cap(key) -> how many values of ``key`` one source network may store here, when the role's
# policy bounds it tighter than the store's default (swarm.node.source_cap: fraud reports), or None
SourceCap = Callable[[str], "int | None"]
LOOKUP_OPS = ("find_node", "get", "put")


def phased(now: float, period: float) -> float:
    """When periodic work was "last done" by a node that starts it ``now``: a random
    point up to one ``period`` back, so that its first run falls at a random point of
    its first period, and every later one a period after. Nodes that start together (a
    swarm whose bootstrap peers restarted, the simulator's starting swarm) would
    otherwise do it together for ever: bursts of load, and a window shorter than the
    period sees all of it or none (docs/scale.md)."""
    return now - period * random.random()


@dataclass
class DHTConfig:
    k: int = 20
    alpha: int = 3
    request_timeout: float = 0.5
    client_mode: bool = False
    refresh_interval: float = 60.0
    republish_interval: float = 300.0
    gossip_fanout: int = 6
    gossip_pull_interval: float = 1.0
    # True: gossip every topic there is (a bootstrap peer, a monitor). False: only the topics
    # this node follows (DHTNode.follow: those it publishes, reads or subscribes to)
    follow_all: bool = True
    # a get's lookup path stops once this many of its closest nodes answered with values; keys
    # hold many values (one per signer) spread unevenly, so by default ask all k closest
    get_quorum: int = 20
    max_pages: int = 16
    # disjoint lookup paths (S/Kademlia): one colluding group captures at most the paths it meets
    lookup_paths: int = 3
    # the table's random-ID refresh walks this many: it only meets live nodes (and is met by
    # them), it reads and stores nothing a group could hide, and it was ~40 % of a node's requests
    refresh_paths: int = 1


@dataclass(frozen=True)
class Request:
    """A request of a kind a role serves (:meth:`DHTNode.serve_requests`), as the
    node took it in: signed by ``msg.sender`` and fresh, not a replay, within the
    datagram bound; its sender already noted (routing-table rules)."""

    msg: wire.Message
    addr: Addr  # the address it came from
    size: int  # its datagram's bytes: an answer to an unproven address stays within AMPLIFICATION times this
    proven: bool  # has ``addr`` shown it receives (an answer to us, or our cookie)? Else it may be spoofed


# A role's request handler: the answer to send now, or None when a task it started
# (DHTNode.start_soon) answers later (DHTNode.answer), or never. wire.BadDatagram: the
# request is malformed (dropped, counted bad_requests); any other exception is a bug
# that costs that one request (counted loop_errors_receive), never the node.
Handler = Callable[[Request], "Answer | None"]


class Stored(int):
    """How many remote nodes took a put (the int, as before), and in how many
    distinct networks they are (:func:`routing.networks`): nodes one operator
    runs count once, however many said "stored"."""

    networks: int

    def __new__(cls, nodes: int, networks: int) -> "Stored":
        self = super().__new__(cls, nodes)
        self.networks = networks
        return self

    @property
    def nodes(self) -> int:
        return int(self)


class DHTNode:
    def __init__(
        self,
        identity: Identity,
        transport: DatagramTransport,
        types: Mapping[str, PayloadType],
        config: DHTConfig | None = None,
        *,
        now_ms: Callable[[], int] = wall_ms,
        lifetime_cap: LifetimeCap | None = None,
        source_cap: SourceCap | None = None,
    ) -> None:
        self.identity = identity
        self.peer_id = identity.peer_id
        self.node_id = node_id_of(self.peer_id)
        self.transport = transport
        self.config = config or DHTConfig()
        self.now_ms = now_ms
        self.table = RoutingTable(self.node_id, self.config.k)
        self.store = ValueStore()
        self.store_rates = SourceRates(STORE_RATE_PER_S, STORE_BURST)
        self.lifetime_cap = lifetime_cap
        self.source_cap = source_cap
        self.verifier = RecordVerifier(types)
        self.gossip = GossipState()
        self.stats: Counter[str] = Counter()
        # lookups by operation: how long they took, and those no remote node answered (metrics.py reads them)
        self.lookup_seconds = {op: Histogram(LOOKUP_SECONDS) for op in LOOKUP_OPS}
        self.lookup_failures: Counter[str] = Counter()
        self._pending: dict[bytes, tuple[PeerId | None, Pending[wire.Message], Addr]] = {}
        self._checking_stores = 0  # stores held while their sender is checked (bounded by MAX_VERIFYING)
        self._seen: OrderedDict[tuple, int] = OrderedDict()  # datagrams seen, for replays
        self._seen_pruned_ms = 0  # when _seen last forgot what fell out of the clock window
        self._verifying: set[tuple] = set()  # (peer, address) pairs being pinged before they enter the table
        self._proven_addrs: OrderedDict[Addr, None] = OrderedDict()  # addresses shown to receive
        self._cookies: OrderedDict[Addr, bytes] = OrderedDict()  # cookies others gave us
        self._secrets = [os.urandom(32), os.urandom(32)]  # current and previous cookie secret
        self._pinging: set[int] = set()
        self._subscribers: dict[str, list[trio.MemorySendChannel]] = {}
        self._pushing = 0  # gossip pushes in flight (bounded: pulls spread what pushes skip)
        self.following = Follows(self.config.follow_all)  # the topics this node gossips (topics.py)
        self._homes: OrderedDict[str, tuple[float, list[Contact]]] = OrderedDict()  # key -> (found at, homes)
        self._nursery: trio.Nursery | None = None
        self._seeds: list[Contact] = []  # the bootstrap contacts, to find the swarm again through
        self._seed_retry: dict[Addr, tuple[float, float]] = {}  # seed address -> (next try, last wait)
        self._handlers: dict[str, Handler] = {}  # request kinds roles serve (serve_requests)

    @property
    def addr(self) -> Addr:
        return self.transport.local_addr

    def contact(self) -> Contact:
        host, port = self.addr
        return Contact(self.node_id, self.peer_id, host, port)

    # --- lifecycle -------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._receive_loop)
                nursery.start_soon(self._maintenance_loop)
                nursery.start_soon(self._gossip_pull_loop)
                task_status.started(self)
        finally:  # ended: not running, and nothing starts a task in the closed nursery
            self._nursery = None

    def stop(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # --- request kinds a role serves -------------------------------------------------------

    def serve_requests(self, kind: str, handler: Handler) -> None:
        """Answer requests of ``kind`` (one the DHT does not serve itself) with
        ``handler``; see :class:`Request` and :data:`Handler`. Without one, such
        a request is dropped (counted bad_datagrams), as any unknown kind."""
        if kind in wire.REQUESTS or kind in wire.RESPONSES or not 0 < len(kind) <= wire.MAX_KIND_CHARS:
            raise ValueError(f"cannot serve {kind!r}: the DHT's own kind, or not a kind name")
        self._handlers[kind] = handler

    @property
    def running(self) -> bool:
        """Inside :meth:`run` (it starts tasks): what :meth:`start_soon` needs."""
        return self._nursery is not None

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the node's nursery (a handler's slow answer); the
        node must be :attr:`running`. The task guards itself: what escapes it ends the node."""
        if self._nursery is None:
            raise RuntimeError("the node is not running")
        self._nursery.start_soon(fn, *args)

    async def answer(self, request: Request, kind: str, body: dict[str, Any]) -> None:
        """Answer ``request`` later (from a handler's task), under the same rules
        as an answer returned at once."""
        await self._reply(request.msg, request.addr, kind, body, request.size, request.proven)

    def cookie_answer(self, request: Request) -> Answer:
        """The answer that asks ``request``'s source to prove it receives there
        (ask again with this cookie) before a handler acts on it."""
        return "cookie", {"cookie": self._cookie(request.addr)}

    # --- requests out --------------------------------------------------------------------

    async def request(self, contact: Contact | Addr, kind: str, body: dict[str, Any], *,
                      timeout: float | None = None) -> wire.Message | None:
        """Send a request and wait (bounded by ``timeout``, by default the request
        timeout) for its answer. A contact's answer must come from that contact's
        key and address; None on timeout. A node that asks us to prove we receive
        at our address (a cookie) is asked again, once, with it."""
        if isinstance(contact, Contact):
            addr, expect = contact.addr, contact.peer_id
        else:
            addr, expect = contact, None
        if self.config.client_mode:
            body = {**body, "client": True}
        for _ in range(2):
            cookie = self._cookies.get(addr)
            if cookie:
                sent = {**body, "cookie": cookie}
            else:
                sent = {**body, "pad": bytes(PAD_BYTES)} if kind in PADDED_KINDS else body
            reply = await self._request_once(addr, expect, kind, sent, timeout=timeout)
            if reply is None or reply.kind != "cookie":
                return reply
            got = reply.body.get("cookie")
            if not (isinstance(got, bytes) and len(got) == COOKIE_BYTES):
                return None
            self._cookies[addr] = got
            self._cookies.move_to_end(addr)
            while len(self._cookies) > MAX_ADDRESSES:
                self._cookies.popitem(last=False)
        return None

    async def _request_once(self, addr: Addr, expect: PeerId | None, kind: str, body: dict[str, Any], *,
                            timeout: float | None = None) -> wire.Message | None:
        rpc_id = wire.new_rpc_id()
        answer: Pending[wire.Message] = Pending()
        self._pending[rpc_id] = (expect, answer, addr)
        try:
            data = self._encode(kind, rpc_id, body, expect)
            if data is None:
                return None  # (counted) as if unanswered: nothing of ours goes out malformed
            self.stats["sent_" + kind] += 1
            self.stats["bytes_sent_" + kind] += len(data)
            await self.transport.send(data, addr)
            with trio.move_on_after(self.config.request_timeout if timeout is None else timeout):
                return await answer.wait()
            self.stats["timeouts"] += 1
            return None
        finally:
            del self._pending[rpc_id]

    def _encode(self, kind: str, rpc_id: bytes, body: dict[str, Any], to: PeerId | None) -> bytes | None:
        """A datagram, or None (counted, logged) if it cannot be one (too big for
        a datagram): a failure to send one message, never the node's end."""
        try:
            return wire.encode(self.identity, kind, rpc_id, body, self.now_ms(), to=to)
        except (ValueError, TypeError) as e:
            self.stats["unsendable_" + kind] += 1
            log.warning("dropped an outgoing %s: %s", kind, e)
            return None

    async def ping(self, contact: Contact | Addr, *, timeout: float | None = None) -> wire.Message | None:
        return await self.request(contact, "ping", {}, timeout=timeout)

    # --- requests in -----------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        guard = Guard("receive", self.stats, backoff=False)  # a bug costs one datagram: no pause for the others
        while True:
            data, addr = await self.transport.receive()
            try:  # (the guard's rule written out: entering it for every datagram was ~2 % of a big simulation)
                await self._datagram_in(data, addr)
            except Exception as e:
                await guard.failed(e)
            else:
                guard.errors = 0

    async def _datagram_in(self, data: bytes, addr: Addr) -> None:
        now = self.now_ms()
        try:
            msg = wire.decode(data, now, self.peer_id)
        except wire.BadDatagram as e:
            self.stats["bad_datagrams"] += 1
            log.debug("dropped datagram from %s: %s", addr, e)
            return
        except Exception as e:  # a decoder bug must cost one datagram, never the node
            self.stats["bad_datagrams"] += 1
            log.warning("datagram from %s broke the decoder: %r", addr, e)
            return
        if msg.sender == self.peer_id:
            return
        if self._replayed(msg, now):
            self.stats["replayed_datagrams"] += 1
            return
        handler = self._handlers.get(msg.kind)
        if msg.kind not in wire.REQUESTS and handler is None:
            # an answer: to one of ours by its rpc id, whatever its kind (a role's
            # requests get answers of the role's kinds); else an unknown kind
            pending = self._pending.get(msg.rpc_id)
            if pending is None and msg.kind not in wire.RESPONSES:
                self.stats["bad_datagrams"] += 1
                log.debug("dropped a %r from %s: no such request, nor an answer we wait for", msg.kind[:32], addr)
                return
            if pending is None or (pending[0] is not None and pending[0] != msg.sender) or pending[2] != addr:
                self.stats["unexpected_responses"] += 1
                return
            # an answer from where we asked: a round trip to that address
            self._proven(addr)
            self.stats["responses"] += 1  # (a survey that got none was cut off, not empty)
            if msg.kind != "cookie":
                self._heard_from(msg.sender, addr, client=False, round_trip=True)
            pending[1].set(msg)  # (a second answer to one request is dropped)
            return
        self.stats["received_" + msg.kind] += 1  # a request (wire.REQUESTS or a served kind: a fixed set)
        proven = self._receives(addr, msg.body.get("cookie"))
        self._heard_from(msg.sender, addr, client=bool(msg.body.get("client")))
        try:
            if handler is not None:  # a role's kind: answered now, or by the handler's task
                answer = handler(Request(msg, addr, len(data), proven))
                if answer is None:
                    return
                kind, body = answer
            else:
                kind, body = self._handle(msg, addr)
                if kind == "stored" and self._check_sender_first(msg, addr, body):
                    self._checking_stores += 1
                    self._nursery.start_soon(self._store_once_checked, msg, addr, len(data), proven)
                    return
        except wire.BadDatagram as e:
            self.stats["bad_requests"] += 1
            log.debug("bad %s from %s: %s", msg.kind, msg.sender, e)
            return
        await self._reply(msg, addr, kind, body, len(data), proven)

    def _check_sender_first(self, msg: wire.Message, addr: Addr, answer: dict[str, Any]) -> bool:
        """Was this store refused only because its key is full of values from unknown
        signers, while it is the sender's own record and the sender is not yet known
        live? A volunteer that just joined stores before our background check of it
        (a ping) is back: check it first (bounded), then decide."""
        if answer.get("ok") is not False or not str(answer.get("reason", "")).startswith("key holds the maximum"):
            return False
        if msg.body.get("client") or self._nursery is None or self._checking_stores >= MAX_VERIFYING:
            return False
        head = peek(msg.body.get("record", b"")) if isinstance(msg.body.get("record"), bytes) else None
        return head is not None and head[0] == msg.sender.multihash and self.table.get(node_id_of(msg.sender)) is None

    async def _store_once_checked(self, msg: wire.Message, addr: Addr, request_bytes: int, proven: bool) -> None:
        """Ping the sender (its answer puts it in the table, diversity permitting: what
        makes a signer live), then take or refuse its record, and answer the store."""
        try:
            async with Guard("store_check", self.stats, backoff=False):
                await self.ping(Contact.of(msg.sender, addr[0], addr[1]))
                ok, reason = self._accept(msg.body["key"], msg.body["record"], source=network_of(addr[0]))
                self.stats["stores_checked_first"] += 1
                await self._reply(msg, addr, "stored", {"ok": ok, "reason": reason}, request_bytes, proven)
        finally:
            self._checking_stores -= 1

    async def _reply(self, msg: wire.Message, addr: Addr, kind: str, body: dict[str, Any], request_bytes: int,
                     proven: bool) -> None:
        reply = self._encode(kind, msg.rpc_id, body, msg.sender)
        if reply is None:
            return  # (counted) the asker times out, as if the datagram were lost
        if not proven and len(reply) > AMPLIFICATION * request_bytes:
            # not yet shown to receive here (a spoofed source?): a small cookie, not the answer
            self.stats["cookies_sent"] += 1
            reply = self._encode("cookie", msg.rpc_id, {"cookie": self._cookie(addr)}, msg.sender)
            if reply is None:
                return
        self.stats["bytes_answered_" + msg.kind] += len(reply)  # by what it answers: what the traffic is for
        await self.transport.send(reply, addr)

    # --- who may enter the table, and who has proved it receives ---------------------------

    def _heard_from(self, peer: PeerId, addr: Addr, *, client: bool, round_trip: bool = False) -> None:
        """A peer enters the routing table, or changes its address there, only after
        a round trip to that address (its signed answer to our request): a
        datagram replayed from elsewhere can refresh nothing."""
        if client:
            return
        node_id, now = node_id_of(peer), trio.current_time()
        known = self.table.get(node_id)
        if not round_trip and (known is None or known.addr != addr):
            # a newcomer whose bucket is full of members heard from lately could not enter: not worth a ping
            if known is not None or self.table.has_room(node_id, now):
                self._verify_later(peer, addr)
            return
        stale = self.table.add(Contact.of(peer, addr[0], addr[1]), now)
        if stale is not None:
            self._check_later(stale)

    def _verify_later(self, peer: PeerId, addr: Addr) -> None:
        key = (peer.multihash, addr)
        if key in self._verifying or len(self._verifying) >= MAX_VERIFYING or self._nursery is None:
            return
        self._verifying.add(key)
        self._nursery.start_soon(self._verify_contact, peer, addr, key)

    async def _verify_contact(self, peer: PeerId, addr: Addr, key) -> None:
        try:
            async with Guard("verify_contact", self.stats, backoff=False):
                await self.ping(Contact.of(peer, addr[0], addr[1]))  # its answer adds it (round_trip)
        finally:
            self._verifying.discard(key)

    def _replayed(self, msg: wire.Message, now: int) -> bool:
        """A datagram already seen (its sender, rpc id and kind) within the clock window."""
        if now >= self._seen_pruned_ms + 1000:  # (once a second: entries a second past the window do no harm)
            self._seen_pruned_ms = now
            while self._seen and next(iter(self._seen.values())) < now - 2 * wire.MAX_CLOCK_SKEW_MS:
                self._seen.popitem(last=False)
        key = (msg.sender.multihash, msg.rpc_id, msg.kind)
        if key in self._seen:
            return True
        self._seen[key] = now
        if len(self._seen) > MAX_SEEN_DATAGRAMS:
            self._seen.popitem(last=False)
        return False

    def _cookie(self, addr: Addr, secret: bytes | None = None) -> bytes:
        msg = f"{addr[0]}|{addr[1]}".encode()
        return hmac.new(secret or self._secrets[0], msg, hashlib.sha256).digest()[:COOKIE_BYTES]

    def _receives(self, addr: Addr, cookie: Any) -> bool:
        """Has ``addr`` shown it receives what we send there (an answer to us, or a
        cookie we gave it, under this or the last secret)?"""
        if addr in self._proven_addrs:
            return True
        if isinstance(cookie, bytes) and any(hmac.compare_digest(cookie, self._cookie(addr, s)) for s in self._secrets):
            self._proven(addr)
            return True
        return False

    def _proven(self, addr: Addr) -> None:
        self._proven_addrs[addr] = None
        self._proven_addrs.move_to_end(addr)
        while len(self._proven_addrs) > MAX_ADDRESSES:
            self._proven_addrs.popitem(last=False)

    def _check_later(self, c: Contact) -> None:
        """Ping ``c`` in the background (once at a time) and evict it if silent."""
        if c.node_id not in self._pinging and self._nursery is not None:
            self._pinging.add(c.node_id)
            self._nursery.start_soon(self._check_stale, c)

    async def _check_stale(self, stale: Contact) -> None:
        try:
            async with Guard("check_stale", self.stats, backoff=False):
                if await self.ping(stale) is None and self._at_address(stale):
                    self.table.evict(stale.node_id)
                    self.stats["evicted"] += 1
        finally:
            self._pinging.discard(stale.node_id)

    def _handle(self, msg: wire.Message, addr: Addr) -> tuple[str, dict[str, Any]]:
        body, k = msg.body, self.config.k
        exclude = {node_id_of(msg.sender)}
        if msg.kind == "ping":
            return "pong", {"observed": [addr[0], addr[1]]}
        if msg.kind == "find_node":
            target = wire.field(body, "target", bytes, max_len=32)
            nearest = self.table.nearest(int.from_bytes(target, "big"), k, exclude)
            return "nodes", {"nodes": wire.encode_contacts(nearest)}
        if msg.kind == "find_value":
            key = wire.field(body, "key", str, max_len=MAX_KEY_CHARS)
            after, upto, have = body.get("after", b""), body.get("upto"), body.get("have", b"")
            if not isinstance(after, bytes) or len(after) > 64 or not (upto is None or isinstance(upto, bytes)
                                                                        and len(upto) <= 64):
                raise wire.BadDatagram("bad cursor")
            if not isinstance(have, bytes) or len(have) % TAG_BYTES or len(have) > TAG_BYTES * MAX_KNOWN_TAGS:
                raise wire.BadDatagram("bad tags of records held")
            known = {have[i:i + TAG_BYTES] for i in range(0, len(have), TAG_BYTES)}
            records, more, skipped = self.store.get(key, self.now_ms(), after=after, upto=upto,
                                                    budget=REPLY_BUDGET_BYTES, known=known)
            nearest = self.table.nearest(key_id(key.encode()), k, exclude) if not after else []
            return "values", {"values": [r.wire for r in records], "more": more, "known": skipped,
                              "nodes": wire.encode_contacts(nearest)}
        if msg.kind == "store":
            key = wire.field(body, "key", str, max_len=MAX_KEY_CHARS)
            record = wire.field(body, "record", bytes, max_len=MAX_RECORD_BYTES)
            # bounded per source network (one host's identities are one source), before any signature check
            source = network_of(addr[0])
            if not self.store_rates.allow(source, self.now_ms()):
                self.stats["store_rate_limited"] += 1
                return "stored", {"ok": False, "reason": "too many stores from this network; try again later"}
            ok, reason = self._accept(key, record, source=source)
            return "stored", {"ok": ok, "reason": reason}
        if msg.kind == "gossip_push":
            records = wire.field(body, "records", list, max_len=32)
            accepted = sum(self._gossip_in(r, from_peer=msg.sender) for r in records if isinstance(r, bytes))
            return "gossip_ack", {"accepted": accepted}
        if msg.kind == "gossip_pull":
            have = self.gossip.parse_digest(body.get("have"))
            if body.get("only") is True:  # the asker follows these topics, and only these
                for topic in have:
                    self._heard_follower(topic, msg.sender)
                full = body.get("full") is True  # it could hold no new signer: only newer of those it names
                missing = self.gossip.missing_among(have, lambda topic: self._unnamed(topic, have[topic], full),
                                                    budget=REPLY_BUDGET_BYTES,
                                                    stands=self._copy_stands, new_signers=not full)
            else:
                after, upto = self.gossip.parse_bound(body.get("after")), self.gossip.parse_bound(body.get("upto"))
                missing = self.gossip.missing_from(have, budget=REPLY_BUDGET_BYTES, now_ms=self.now_ms(),
                                                   after=after, upto=upto)
            return "gossip_records", {"records": [r.wire for r in missing]}
        raise wire.BadDatagram(f"no handler for {msg.kind}")

    def _verify(self, wire_record: bytes, *, unpacked: tuple | None = None) -> Record | None:
        try:
            return self.verifier.verify(wire_record, self.now_ms(), remember=False, unpacked=unpacked)
        except RecordRejected as e:
            self.stats["rejected_" + e.reason.value] += 1
            why = getattr(e, "content_reason", None)
            if why:  # e.g. "rejected_content: throughput must be finite ..."
                self.stats["rejected_content: " + why] += 1
            return None

    def _accept(self, key: str, wire_record: bytes, source: Any = None) -> tuple[bool, str]:
        record = self._verify(wire_record)
        if record is None:
            return False, "record rejected"
        own = record.signer == self.peer_id
        cap = self.lifetime_cap(key, self._holds) if self.lifetime_cap is not None and not own else None
        news = self.store.expires_at(key, record.signer.multihash) is None  # a signer new here
        per_source = self.source_cap(key) if self.source_cap is not None and not own else None
        ok, reason = self.store.put(key, record, self.now_ms(), source=source, own=own, live=self._known_live,
                                    lifetime_cap_ms=cap, volatile=self._volatile(record), per_source=per_source)
        if ok and reason != "unchanged":
            if self.follows(key):
                self._gossip_in(wire_record, from_peer=None, record=record)
            elif news:  # a home that does not follow the key still tells its followers of a newcomer
                self._push_to(self._follower_contacts(key, exclude={record.signer}), record.wire)
        return ok, reason

    def _unnamed(self, topic: str, theirs: dict[bytes, int], named_only: bool) -> list[Record]:
        """What this node holds of a topic, gossiped or stored (newest a signer), that a
        pull's digest of it does not name at its seq (tagged.py): what it may lack
        (with ``named_only``, only of the signers it names)."""
        return unnamed(theirs, self.gossip.tagged(topic), self.store.tagged(topic, self.now_ms()),
                       named_only=named_only)

    def _volatile(self, record: Record) -> frozenset[str]:
        """Its payload type's load fields: what a refresh of it may change."""
        kind = self.verifier.types.get(record.payload_type)
        return kind.volatile_fields if kind is not None else frozenset()

    def _copy_stands(self, topic: str, record: Record, theirs: int) -> bool:
        """Whether a puller's copy at seq ``theirs`` stands for ``record`` (refresh.py),
        by what gossip or the store here knows of its signer's records."""
        since = self.gossip.since_of(topic, record)
        if since is None:
            since = self.store.since_of(topic, record)
        return refresh.stands(since, record, theirs, self.now_ms())

    def _holds(self, key: str) -> bool:
        """Does this node hold a live value under ``key``, stored or gossiped, signed
        by a peer it knows is live (itself, or a routing-table member: it answered a
        round trip)? A record from an identity that runs no node costs nothing."""
        stored = self.store.live(key, self.now_ms()).values()
        return any(self._known_live(r) for r in [*stored, *self._gossiped(key)])

    def _known_live(self, record: Record) -> bool:
        """Signed by this node, or by a routing-table member (it entered after a round trip)."""
        return record.signer == self.peer_id or self.table.get(node_id_of(record.signer)) is not None

    # --- public API: DHT --------------------------------------------------------------------

    async def bootstrap(self, seeds: list[Contact], *, timeout: float | None = None) -> int:
        """Join through ``seeds`` (whose peer IDs are checked); returns how many answered.
        The seeds are kept: a node cut off from them (a partition, their restart)
        finds its way back through them (:meth:`rejoin`)."""
        self._seeds = list(seeds)[:MAX_SEEDS]
        answered = 0
        async with trio.open_nursery() as nursery:

            async def one(c: Contact) -> None:
                nonlocal answered
                reply = await self.ping(c, timeout=timeout)
                if reply is not None:
                    answered += 1

            for c in seeds:
                nursery.start_soon(one, c)
        if self.config.client_mode:
            for c in seeds:  # a client is in nobody's table, so it keeps its seeds in its own
                self.table.add(c, trio.current_time())
        await self.find_node(self.node_id)
        return answered

    async def rejoin(self) -> int:
        """Ping the seeds missing from the table (evicted while unreachable, e.g.
        during a partition), which puts those that answer back; if the table had
        emptied, look itself up again through them. Without this a node that lost
        every contact would never find the swarm again. Returns how many answered."""
        if len(self.table) >= REJOIN_BELOW:
            return 0  # connected: a seed missing from a full bucket (or refused for diversity) is no loss
        now = trio.current_time()
        missing = [c for c in self._seeds if not self._at_address(c) and self._seed_retry.get(c.addr, (0.0, 0))[0] <= now]
        if not missing:
            return 0
        was_empty = len(self.table) == 0
        answered = 0
        async with trio.open_nursery() as nursery:
            async def one(c: Contact) -> None:
                nonlocal answered
                if await self.ping(c) is not None:
                    answered += 1
                    self._seed_retry.pop(c.addr, None)
                    if self.config.client_mode:
                        self.table.add(c, trio.current_time())
                else:  # a dead seed is asked less and less often (15 s doubling to 5 min)
                    wait = min(REJOIN_MAX_BACKOFF_S, max(15.0, 2 * self._seed_retry.get(c.addr, (0.0, 7.5))[1]))
                    self._seed_retry[c.addr] = (trio.current_time() + wait, wait)

            for c in missing:
                nursery.start_soon(one, c)
        if answered:
            self.stats["rejoined"] += 1
            if was_empty:
                await self.find_node(self.node_id)
        return answered

    async def find_node(self, target: int) -> list[Contact]:
        return (await self._find_node(target)).closest

    async def _find_node(self, target: int, *, paths: int | None = None):
        async def call(c: Contact):
            reply = await self.request(c, "find_node", {"target": target.to_bytes(32, "big")})
            if reply is None or reply.kind != "nodes":
                return None
            return None, self._contacts(reply.body.get("nodes"))

        t0 = trio.current_time()
        result = await self._lookup(target, call, paths=paths)
        self._lookup_done("find_node", t0, bool(result.closest))
        return result

    def _lookup_done(self, op: str, started: float, answered: bool) -> None:
        self.lookup_seconds[op].observe(trio.current_time() - started)
        if not answered:  # no remote node answered (or, for a put, took the record)
            self.lookup_failures[op] += 1

    async def put(self, key: str, record_wire: bytes, *, also: list[Contact] = ()) -> Stored:
        """Store a record under ``key`` on the k nodes closest to it along every
        lookup path, on ``also`` (e.g. :meth:`homes_of` its signer), and here.
        Within ``HOMES_REUSE_S`` of a lookup of ``key`` it stores again at the
        homes that took the record then, without a lookup (until half of them
        stop taking it). Returns how many remote nodes accepted it, and in how many networks.
        Raises :class:`RecordRejected` or :class:`DHTError` if this node itself
        would not accept it."""
        record = self.verifier.verify(record_wire, self.now_ms(), remember=False)
        ok, reason = self.store.put(key, record, self.now_ms(), own=True,  # others' records never crowd ours out
                                    volatile=self._volatile(record))
        self.follow(key)
        if not ok:
            raise DHTError(f"cannot store under {key!r}: {reason}")
        self._gossip_in(record_wire, from_peer=None, record=record)
        t0 = trio.current_time()
        found_at, homes = self._homes.get(key, (None, []))
        looked_up = found_at is None or t0 - found_at >= HOMES_REUSE_S
        if looked_up:
            homes = (await self._find_node(key_id(key.encode()))).reached
        targets = {c.node_id: c for c in homes}
        targets.update((c.node_id, c) for c in also if c.node_id != self.node_id)
        holders: list[Contact] = []
        async with trio.open_nursery() as nursery:

            async def one(c: Contact) -> None:
                reply = await self.request(c, "store", {"key": key, "record": record_wire})
                if reply is not None and reply.kind == "stored" and reply.body.get("ok") is True:
                    holders.append(c)

            for c in targets.values():
                nursery.start_soon(one, c)
        self._lookup_done("put", t0, bool(holders))
        home_ids = {h.node_id for h in homes}
        took = [c for c in holders if c.node_id in home_ids]
        if looked_up and took:
            # a key's first homes are reused for a random part of the period, later ones for all of it
            self._homes[key] = (t0 if found_at is not None else phased(t0, HOMES_REUSE_S), took)
            self._homes.move_to_end(key)
            while len(self._homes) > MAX_HOMES_KEPT:
                self._homes.popitem(last=False)
        elif not looked_up and 2 * len(took) < len(homes):
            self._homes.pop(key, None)  # half the homes gone or refusing: the next put looks again
        return Stored(len(holders), networks(holders))

    async def get(self, key: str, *, also_ask: list[Contact] = ()) -> list[Record]:
        """Every live record under ``key`` that the closest nodes along every
        lookup path hold, and ``also_ask`` (e.g. :meth:`homes_of` the signer
        wanted) hold, asked directly (newest per signer)."""
        target = key_id(key.encode())
        found = self.store.live(key, self.now_ms())
        # what this get holds, by tag: homes leave those out of their answers (most homes
        # of a key hold the same records; each sent all of them)
        held = dict.fromkeys(tag(r) for r in found.values())
        verified: dict[bytes, Record | None] = {}  # the k nodes mostly answer with the same records

        def check(w: bytes) -> Record | None:
            if w not in verified:
                verified[w] = self._verify(w)
            return verified[w]

        async def page(c: Contact, after: bytes, upto: bytes | None):
            """One page of ``c``'s records of ``key`` in (after, upto], but those held,
            each kept in ``found`` as it is checked: (how many it brought, more, the
            last signer it named, how many it left out as held, the reply), or None if
            it did not answer."""
            body = {"key": key, "after": after}
            if upto is not None:
                body["upto"] = upto
            if held:
                body["have"] = b"".join(list(held)[-MAX_KNOWN_TAGS:])
            reply = await self.request(c, "find_value", body)
            if reply is None or reply.kind != "values" or not isinstance(reply.body.get("values"), list):
                return None
            brought, last, more = 0, None, bool(reply.body.get("more"))
            for w in reply.body["values"][:256]:
                rec = check(w) if isinstance(w, bytes) else None
                if rec is None or rec.content.get("key") != key:
                    continue
                signer = rec.signer.multihash
                if signer <= after or (upto is not None and signer > upto):
                    more = False  # out of the range asked: a home that does not page by range; the others cover it
                    continue
                brought += 1
                # kept at once, whether or not the lookup waits for this answer: what is named
                # as held to the next homes must be in what this get returns
                keep_newest(found, [rec])
                held[tag(rec)] = None
                last = signer if last is None or signer > last else last
            known = reply.body.get("known")
            known = min(known, 256) if isinstance(known, int) and not isinstance(known, bool) and known > 0 else 0
            return brought, more and last is not None, last, known, reply

        async def rest(c: Contact, after: bytes, upto: bytes | None, pages: list[int], until: float) -> None:
            # a home's ranges share one lookup request's time from its first page (``until``):
            # a home that drips its pages holds the read no longer than one that never answered
            with trio.move_on_at(until):
                while pages[0] > 0:
                    pages[0] -= 1
                    got = await page(c, after, upto)
                    if got is None or not got[1]:
                        return
                    after = got[2]

        async def call(c: Contact, rests: trio.Nursery):
            got = await page(c, b"", None)
            if got is None:
                return None
            brought, more, last, known, reply = got
            if more:  # the rest at once, in ranges that each fit a page (paging.py)
                pages, until = [self.config.max_pages - 1], trio.current_time() + self.config.request_timeout * 2
                for after, upto in paging.split_rest(last, brought + known, pages[0]):
                    rests.start_soon(rest, c, after, upto, pages, until)
            # the answer: does it hold the key (one that held only what this get had does;
            # the first page tells: the rest is asked for only when it brought some)
            return brought > 0 or known > 0, self._contacts(reply.body.get("nodes"))

        def enough(responses: dict[int, bool]) -> bool:
            return sum(responses.values()) >= self.config.get_quorum

        t0 = trio.current_time()
        # A home's rest is read outside the lookup's request: its first page answers the
        # lookup (one round trip, like every other answer it times), and the rest, a second
        # round trip, is no reason to count the home slow and cut it off with the lookup's
        # end (records only a far home held were lost so). A home's rest is bounded like a
        # request of the lookup, and its pages by max_pages.
        also = [c for c in also_ask if c.node_id != self.node_id]
        async with trio.open_nursery() as rests:
            result = await self._lookup(target, functools.partial(call, rests=rests), done=enough, also=also)
        self._lookup_done("get", t0, bool(result.responses))
        now = self.now_ms()
        return sorted((r for r in found.values() if r.expires_at_ms > now), key=lambda r: r.signer.multihash)

    async def _lookup(self, target: int, call, *, paths: int | None = None, **kw):
        # k seeds a path (dealt nearest-first): with only k in all, a path can start from one
        # silent node and find nothing; a table that timeouts emptied (a loaded host answers
        # late) still has its bootstrap seeds to start from
        paths = paths or self.config.lookup_paths
        seeds = self.table.nearest(target, self.config.k * paths) or list(self._seeds)
        return await iterative_lookup(
            target, seeds, call, k=self.config.k, alpha=self.config.alpha,
            timeout=self.config.request_timeout * 2, on_fail=self._lookup_failed, on_abandon=self._suspect,
            paths=paths, **kw,
        )

    @property
    def seeds(self) -> list[Contact]:
        """The bootstrap contacts this node joined through."""
        return list(self._seeds)

    def homes_of(self, signer: PeerId) -> list[Contact]:
        """Where a signer's records are kept whatever nodes are closest to their
        key: the bootstrap peers this node joined through (certify stores there
        too) and the signer's own node, if this node knows it (a node keeps and
        republishes what it signed). A group ground close to a key hides nothing
        these hold."""
        homes = {c.node_id: c for c in self._seeds}
        own = self.table.get(node_id_of(signer))
        if own is not None:
            homes[own.node_id] = own
        return list(homes.values())

    def _contacts(self, raw: Any) -> list[Contact]:
        try:
            return [Contact.of(p, h, port) for p, h, port in wire.decode_contacts(raw, self.config.k * 2)]
        except wire.BadDatagram:
            self.stats["bad_contacts"] += 1
            return []

    def _at_address(self, c: Contact) -> bool:
        """Is ``c`` the table's entry, address included? A contact list may pair an
        honest ID with a bogus address: its silence says nothing of the honest entry."""
        entry = self.table.get(c.node_id)
        return entry is not None and entry.addr == c.addr

    def _suspect(self, c: Contact) -> None:
        """A lookup gave up waiting on ``c``: ping it in the background, evict it if silent."""
        if self._at_address(c):
            self._check_later(c)

    def _lookup_failed(self, c: Contact) -> None:
        if self._at_address(c) and self.table.fail(c.node_id):
            self.stats["evicted"] += 1

    # --- public API: gossip ------------------------------------------------------------------

    def follows(self, topic: str) -> bool:
        """Does this node gossip ``topic`` (keep its records, pull and push them)?"""
        return topic in self.following

    def follow(self, topic: str) -> None:
        """Gossip ``topic`` from now on (done by :meth:`put`, :meth:`records` and
        :meth:`subscribe`). Past ``topics.MAX_FOLLOWED`` topics the one least
        recently used is forgotten, with what this node held of it."""
        for old in self.following.follow(topic):
            self.gossip.drop(old)

    def subscribe(self, topic: str, max_buffer: int = 1024) -> trio.MemoryReceiveChannel:
        """New records on ``topic`` (a DHT key) as they arrive, gossip or store."""
        self.follow(topic)
        send, recv = trio.open_memory_channel[Record](max_buffer)
        self._subscribers.setdefault(topic, []).append(send)
        for rec in self.gossip.records(topic):
            try:
                send.send_nowait(rec)
            except trio.WouldBlock:
                break
        return recv

    def records(self, topic: str) -> list[Record]:
        """What gossip brought of ``topic`` (followed from now on)."""
        self.follow(topic)
        return self._gossiped(topic)

    def _gossiped(self, topic: str) -> list[Record]:
        now = self.now_ms()
        return [r for r in self.gossip.records(topic) if r.expires_at_ms > now]

    async def publish(self, key: str, record_wire: bytes, *, also: list[Contact] = ()) -> Stored:
        """Announce a record: gossip it at once and store it in the DHT."""
        return await self.put(key, record_wire, also=also)

    def _gossip_in(self, record_wire: bytes, *, from_peer: PeerId | None, record: Record | None = None,
                   pulled: bool = False) -> bool:
        if record is None:
            peeked = peek_unpacked(record_wire)
            head = None if peeked is None else peeked[0]
            if head is not None and not (isinstance(head[2], str) and self.follows(head[2])):
                self.stats["gossip_unfollowed"] += 1
                return False  # a topic this node does not follow: not worth a signature check
            if head is not None and self.gossip.known(head[2], head[0], head[1]):
                self.stats["gossip_duplicate"] += 1
                return False  # already held: not worth a signature check
            if head is not None and self.gossip.full(head[2]) and not self.gossip.holds(head[2], head[0]):
                self.stats["gossip_full"] += 1
                return False  # a signer new to a full topic would be refused: not worth a signature check
            record = self._verify(record_wire, unpacked=None if peeked is None else peeked[1:])
        if record is None:
            return False
        topic = record.content.get("key")
        if not isinstance(topic, str) or not self.follows(topic):
            return False
        # a topic the role's policy keeps short (e.g. evidence for a model nobody announces) gets a bounded share
        short = (topic not in self.gossip.topics and self.lifetime_cap is not None
                 and record.signer != self.peer_id and self.lifetime_cap(topic, self._holds) is not None)
        verdict = self.gossip.offer(topic, record, self.now_ms(), short=short, volatile=self._volatile(record))
        if verdict not in ("new", "refresh"):
            if verdict == "rate-limited":
                self.stats["gossip_rate_limited"] += 1
            elif verdict == "full":
                self.stats["gossip_full"] += 1  # (a full follower tells whom it pulls from: _gossip_pull)
            return False
        self.stats["gossip_" + verdict] += 1
        self.following.signed(topic, node_id_of(record.signer))
        for chan in self._subscribers.get(topic, []):
            try:
                chan.send_nowait(record)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        # A refresh travels by pull (gossip.py); so does what was pulled: the neighbour it came
        # from had it, and so does the swarm (a node that joins pulls everything there is)
        if verdict == "new" and not pulled:
            exclude = {from_peer, record.signer}
            targets = self._follower_contacts(topic, exclude)
            if self.config.follow_all and len(targets) < self.config.gossip_fanout:
                # a node that holds every topic cannot tell who follows one: anyone may
                taken = {c.node_id for c in targets}
                others = [c for c in self.table.contacts() if c.peer_id not in exclude and c.node_id not in taken]
                targets += random.sample(others, min(len(others), self.config.gossip_fanout - len(targets)))
            self._push_to(targets, record.wire)
        return True

    def _heard_follower(self, topic: str, peer: PeerId) -> None:
        """``peer`` asked us for ``topic`` alone: it follows it (kept for topics we have any of)."""
        if self.follows(topic) or self.store.holds(topic, self.now_ms()):
            self.following.heard(topic, peer)

    def _follower_contacts(self, topic: str, exclude: set) -> list[Contact]:
        """Table members known to follow ``topic``: they pulled it from us, or they
        signed records of it (a volunteer follows its own model's key), as found
        within SIGNERS_SEEN_S (:meth:`_signer_members`)."""
        out = {c.node_id: c for c in self._table_members(p for p in self.following.followers(topic) if p not in exclude)}
        for c in self._signer_members(topic):
            if c.peer_id not in exclude:
                out.setdefault(c.node_id, c)
        return list(out.values())

    def _signer_members(self, topic: str) -> list[Contact]:
        """The signers of ``topic``'s records that are table members, found among them
        at most SIGNERS_SEEN_S ago (a topic holds up to 256 records, and walking them
        for every push and pull was the largest cost that grew with the swarm), each
        checked to be a member still (a signer added since is kept at once: Follows.signed)."""
        now = trio.current_time()
        seen = self.following.signers(topic, now, SIGNERS_SEEN_S)
        if seen is None:
            seen = [c.node_id for c in self._table_members({r.signer for r in self.gossip.records(topic)})]
            self.following.found_signers(topic, now, seen)
        return [c for node_id in seen if (c := self.table.get(node_id)) is not None]

    def _pull_partner(self, topic: str) -> Contact | None:
        """Whom a scoped pull of ``topic`` asks: at random among its known followers in
        the table (those that pulled it from us, and its signers, as found within
        SIGNERS_SEEN_S) and the table's PULL_HOMES nodes closest to its key."""
        candidates = {c.node_id: c for c in self._table_members(self.following.followers(topic))}
        candidates.update((c.node_id, c) for c in self._signer_members(topic))
        candidates.update((c.node_id, c) for c in self.table.nearest(key_id(topic.encode()), PULL_HOMES))
        return random.choice(list(candidates.values())) if candidates else None

    def _table_members(self, peers) -> list[Contact]:
        return [c for p in peers if (c := self.table.get(node_id_of(p))) is not None]

    def _push_to(self, targets: list[Contact], record_wire: bytes) -> None:
        if self._nursery is None:
            return
        for c in random.sample(targets, min(len(targets), self.config.gossip_fanout)):
            if self._pushing >= MAX_PUSHES_IN_FLIGHT:
                self.stats["gossip_push_skipped"] += 1
                break
            self._pushing += 1
            self._nursery.start_soon(self._push, c, record_wire)

    async def _push(self, contact: Contact, record_wire: bytes) -> None:
        try:
            async with Guard("push", self.stats, backoff=False):
                await self.request(contact, "gossip_push", {"records": [record_wire]})
        finally:
            self._pushing -= 1

    async def _gossip_pull_loop(self) -> None:
        guard = Guard("gossip_pull", self.stats)
        while True:
            await trio.sleep(self.config.gossip_pull_interval * (0.5 + random.random()))
            async with guard:
                await self._gossip_pull()

    async def _gossip_pull(self) -> None:
        """Ask one random neighbour for what it holds that we lack, among the
        topics of this pull's page of our digest (pages rotate: gossip.digest);
        a node that follows some topics asks about one of them at a time, in
        turn, from a follower of it or one of its key's homes."""
        if self.config.follow_all:
            contacts = self.table.contacts()
            if not contacts:
                return
            peer = random.choice(contacts)
            have, after, upto = self.gossip.digest()
            body: dict[str, Any] = {"have": have}
            if after is not None:
                body["after"] = after
            if upto is not None:
                body["upto"] = upto
        else:
            topic = self.following.next_pull()
            if topic is None:
                return
            peer = self._pull_partner(topic)
            if peer is None:
                return
            body = {"have": self.gossip.digest_of(topic), "only": True}
            if self.gossip.full(topic):  # it could not hold a signer it lacks: sending one is waste
                body["full"] = True
        reply = await self.request(peer, "gossip_pull", body)
        if reply is None or reply.kind != "gossip_records":
            return
        records = reply.body.get("records")
        if isinstance(records, list):
            for w in records[:64]:
                if isinstance(w, bytes):
                    self._gossip_in(w, from_peer=peer.peer_id, pulled=True)

    # --- maintenance -------------------------------------------------------------------------

    async def _maintenance_loop(self) -> None:
        now = trio.current_time()
        last = {"refresh": phased(now, self.config.refresh_interval),
                "republish": phased(now, self.config.republish_interval), "secret": now}
        guard = Guard("maintenance", self.stats)
        while True:
            await trio.sleep(min(self.config.refresh_interval, self.config.republish_interval) / 4)
            async with guard:
                await self._maintain(last)

    def _due(self, last: dict[str, float], what: str, period: float) -> bool:
        """Is ``what`` due? Marked done at once, so a step that fails waits for its next period."""
        now = trio.current_time()
        if now - last[what] < period:
            return False
        last[what] = now
        return True

    async def _maintain(self, last: dict[str, float]) -> None:
        if self._due(last, "secret", COOKIE_SECRET_S):  # a cookie is good for one to two periods
            self._secrets = [os.urandom(32), self._secrets[0]]
        self.store.expire(self.now_ms())
        self.gossip.expire(self.now_ms())
        await self.rejoin()
        if self._due(last, "refresh", self.config.refresh_interval):
            await self._find_node(random.getrandbits(256), paths=self.config.refresh_paths)
        if self._due(last, "republish", self.config.republish_interval):
            for key, rec in self.store.items():
                if rec.signer == self.peer_id:
                    try:
                        await self.put(key, rec.wire)
                    except MeshnetError:  # (expired meanwhile, say): one record's, not the others'
                        self.stats["republish_failed"] += 1
