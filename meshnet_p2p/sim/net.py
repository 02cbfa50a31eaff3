"""Datagrams between simulated hosts, in virtual time.

A host sits in a region; a datagram from a to b arrives after the two regions'
one-way delay plus both hosts' access delay (fixed per host, log-normal), or is
lost with probability ``loss``. With ``uplink_mbps`` set, each host also has an
uplink (fixed per host, log-normal): a datagram leaves only once those sent
before it have, and takes its size over the link's rate to (a FIFO queue at the
sender, where a home's traffic waits, dropping what would wait over
``uplink_queue_s``; downlinks, several times wider on home lines, are not
modelled). A host behind NAT takes a datagram only from an
address it sent to within ``nat_window_s`` (address-dependent filtering, what most
home routers do): nobody reaches it unasked; or, with ``nat_filtering="endpoint"``
(a "full cone"), from anyone while its mapping is open (it sent within the window). Every datagram sent is counted, in
messages and bytes, and every one lost. While ``cut`` names regions, no
datagram crosses between them and the rest (a partition: a cable cut, a
national firewall).

One task delivers them all, from a heap ordered by arrival time; under trio's
``MockClock(autojump_threshold=0)`` time jumps to the next arrival whenever every
node waits, so a simulated hour of a thousand nodes costs only their CPU work.
Implements ``dht.transport.DatagramTransport``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

import outcome
import trio

from meshnet_p2p.dht.pending import Parked
from meshnet_p2p.dht.transport import Addr

# Regions, their share of hosts, and round-trip times between them (ms). Rounded from
# public inter-city ping tables (e.g. wondernetwork.com/pings, 2024): an assumption,
# order of magnitude only; docs/scale.md says so.
REGIONS = ("na", "eu", "as", "sa", "oc", "af")
REGION_SHARE = (0.30, 0.30, 0.25, 0.07, 0.04, 0.04)
_RTT = {
    ("na", "na"): 40, ("eu", "eu"): 30, ("as", "as"): 70, ("sa", "sa"): 50, ("oc", "oc"): 30, ("af", "af"): 90,
    ("na", "eu"): 90, ("na", "as"): 170, ("na", "sa"): 130, ("na", "oc"): 160, ("na", "af"): 200,
    ("eu", "as"): 180, ("eu", "sa"): 200, ("eu", "oc"): 280, ("eu", "af"): 120,
    ("as", "sa"): 300, ("as", "oc"): 120, ("as", "af"): 250, ("sa", "oc"): 300, ("sa", "af"): 300,
    ("oc", "af"): 350,
}
RTT_MS = {**_RTT, **{(b, a): v for (a, b), v in _RTT.items()}}


@dataclass
class NetModel:
    loss: float = 0.01  # each datagram lost with this probability
    access_ms_median: float = 10.0  # a host's own one-way delay to its region's core (log-normal)
    access_sigma: float = 0.7
    nat_share: float = 0.0  # hosts behind NAT (assigned by the caller: ``endpoint(natted=...)``)
    nat_window_s: float = 60.0  # how long a NAT keeps an outbound mapping open for answers
    # what a NAT lets in (RFC 4787's filtering): "address", only from addresses its host
    # sent to (each simulated host has one port: address-and-port-dependent alike; most
    # home routers); "endpoint", from anyone while its host's mapping is open ("full cone")
    nat_filtering: str = "address"
    # Arrival times are rounded up to a whole tick, so the datagrams due within one tick
    # are delivered together: one wake-up of the deliverer and one jump of the clock for
    # all of them, and their handlers run in one batch of the scheduler (3,000 peers: 15 %
    # less wall time, docs/scale.md). A millisecond is far below any one-way delay drawn
    # here (15 ms and up). 0: exact times.
    tick_s: float = 0.001
    # a host's uplink, megabits a second (log-normal: median, sigma); 0: unlimited (as
    # before 2026-12-07; drawing none keeps a seed's hosts as they were)
    uplink_mbps: float = 0.0
    uplink_sigma: float = 1.0
    # what an uplink's queue holds, in seconds of sending: a datagram that would wait
    # longer is dropped (a home router's buffer; bufferbloat is of this order)
    uplink_queue_s: float = 1.0

    def __post_init__(self) -> None:
        if self.nat_filtering not in ("address", "endpoint"):
            raise ValueError(f"nat_filtering: 'address' or 'endpoint', not {self.nat_filtering!r}")


@dataclass
class Host:
    addr: Addr
    region: str
    access_s: float
    natted: bool
    sent_to: dict[Addr, float] = field(default_factory=dict)  # NAT mappings: destination -> last send
    last_sent: float = -math.inf  # its NAT's mapping, for endpoint-independent filtering
    uplink_bps: float = 0.0  # bits a second its uplink carries (0: unlimited)
    uplink_free: float = 0.0  # when what it has sent so far has left


def _public_ip(rng: random.Random, used: set[str]) -> str:
    """A distinct address outside private, loopback and shared ranges: each host its own
    network (/24), as homes on the internet are; the DHT's diversity rules apply."""
    while True:
        a = rng.choice([*range(11, 100), *range(101, 126), *range(128, 169), *range(170, 172), *range(173, 192),
                        *range(193, 223)])
        ip = f"{a}.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
        prefix = ip.rsplit(".", 1)[0]
        if prefix not in used:
            used.add(prefix)
            return ip


class SimNetwork:
    def __init__(self, rng: random.Random, model: NetModel | None = None) -> None:
        self.rng = rng
        self.model = model or NetModel()
        self.hosts: dict[Addr, Host] = {}
        self.inboxes: dict[Addr, Inbox] = {}  # attached endpoints
        self.sent_total = self.sent_bytes_total = 0  # datagrams and their bytes
        self.lost = 0
        self.queue_dropped = 0  # of them, dropped by a full uplink queue
        self.cut: frozenset[str] = frozenset()  # regions cut off from the others (a partition), while set
        self.partitioned = 0  # datagrams the partition dropped
        self._prefixes: set[str] = set()
        self._heap: list[tuple[float, int, Addr, bytes, Addr]] = []
        self._seq = 0
        self._changed = trio.Event()
        # a run split over two processes (split.py): which process runs each host (this one
        # when unnamed), this one's number, and the link datagrams to the other's hosts take
        self.owner: dict[Addr, int] = {}
        self.me = 0
        self.partner = None
        self.port = 4001  # new hosts' port (split.py: each process its own, so addresses never clash)

    def host(self, *, natted: bool = False, region: str | None = None, ip: str | None = None) -> Host:
        """A new host (an address that keeps its region and access delay across restarts)."""
        region = region or self.rng.choices(REGIONS, REGION_SHARE)[0]
        access = self.model.access_ms_median * math.exp(self.rng.gauss(0, self.model.access_sigma)) / 1000
        addr = (ip or _public_ip(self.rng, self._prefixes), self.port)
        h = Host(addr, region, access, natted)
        if self.model.uplink_mbps:
            h.uplink_bps = self.model.uplink_mbps * 1e6 * math.exp(self.rng.gauss(0, self.model.uplink_sigma))
        self.hosts[addr] = h
        if self.partner is not None:  # the other process learns of it before any datagram from it
            self.partner.hosts.append([addr[0], addr[1], region, access, natted])
        return h

    def add_remote_host(self, addr: Addr, region: str, access_s: float, natted: bool, *, owner: int) -> None:
        """A host the other process made (split.py)."""
        self.hosts[addr] = Host(addr, region, access_s, natted)
        self.owner[addr] = owner

    def network(self) -> str:
        """A fresh public /24 (its first three octets), for hosts that share one network."""
        return _public_ip(self.rng, self._prefixes).rsplit(".", 1)[0]

    def side(self, host: Host) -> bool:
        """Which side of the partition ``host`` is on (all on one side when there is none)."""
        return host.region in self.cut

    def one_way_s(self, a: Host, b: Host) -> float:
        return RTT_MS[a.region, b.region] / 2000 + a.access_s + b.access_s

    def attach(self, host: Host) -> "SimTransport":
        """The host's socket, open until closed (a node's process that stops)."""
        inbox = self.inboxes[host.addr] = Inbox()
        return SimTransport(self, host, inbox)

    def _send(self, src: Host, data: bytes, dst: Addr) -> None:
        self.sent_total += 1
        self.sent_bytes_total += len(data)
        now = trio.current_time()
        if src.natted:
            src.sent_to[dst] = src.last_sent = now
        gone = now
        if src.uplink_bps:  # it leaves after what was sent before it, at the uplink's rate
            start = max(now, src.uplink_free)
            if start - now > self.model.uplink_queue_s:  # the router's queue is full: dropped
                self.lost += 1
                self.queue_dropped += 1
                return
            gone = src.uplink_free = start + len(data) * 8 / src.uplink_bps
        target = self.hosts.get(dst)
        if target is None or self.rng.random() < self.model.loss:
            self.lost += 1
            return
        if self.cut and (src.region in self.cut) != (target.region in self.cut):
            self.partitioned += 1
            return
        due = gone + self.one_way_s(src, target)
        if tick := self.model.tick_s:
            due = math.ceil(due / tick) * tick
        if self.partner is not None and self.owner.get(dst, self.me) != self.me:
            if due < now + self.partner.lookahead_s:  # (it would arrive before the point that hands it over)
                raise RuntimeError(f"a datagram due in {due - now:.4f} s, under the split run's lookahead")
            self.partner.datagrams.append([due, dst[0], dst[1], bytes(data), src.addr[0], src.addr[1]])
            return
        self.arrive(due, dst, bytes(data), src.addr)

    def arrive(self, due: float, dst: Addr, data: bytes, src: Addr) -> None:
        """``data`` is due at ``dst`` at ``due`` (sent here, or by the other process: split.py)."""
        self._seq += 1
        heapq.heappush(self._heap, (due, self._seq, dst, data, src))
        if self._heap[0][1] == self._seq:  # a new earliest arrival: the deliverer waits for it instead
            self._changed.set()

    def _deliver(self, dst: Addr, data: bytes, src: Addr) -> None:
        host, inbox = self.hosts.get(dst), self.inboxes.get(dst)
        if inbox is None or host is None:
            self.lost += 1  # nobody listens there now (the node left)
            return
        if host.natted:
            opened = host.last_sent if self.model.nat_filtering == "endpoint" else host.sent_to.get(src, -math.inf)
            if trio.current_time() - opened > self.model.nat_window_s:
                self.lost += 1  # unsolicited: the NAT drops it
                return
        inbox.put((data, src))

    async def run(self) -> None:
        """Deliver every datagram at its arrival time, for ever (cancel to stop)."""
        while True:
            if self._heap:
                with trio.move_on_at(self._heap[0][0]):
                    await self._changed.wait()
            else:
                await self._changed.wait()
            self._changed = trio.Event()
            now = trio.current_time()
            while self._heap and self._heap[0][0] <= now:
                _, _, dst, data, src = heapq.heappop(self._heap)
                self._deliver(dst, data, src)


class Inbox(Parked):
    """A host's socket buffer: datagrams in order of arrival, and the one task that
    waits on it (a node's receive loop). Neither taking a datagram that is there nor
    handing one to the waiting task yields to the scheduler: a trio memory channel
    does both through a checkpoint, a task switch per datagram (trio's channel code
    was ~9 % of a 1,000-peer run's CPU, this and each request's wait, docs/scale.md).
    A node takes what arrived together in one step, as a socket's reader drains its
    buffer."""

    __slots__ = ("items", "closed")

    def __init__(self) -> None:
        super().__init__()
        self.items: deque[tuple[bytes, Addr]] = deque()
        self.closed = False

    def put(self, item: tuple[bytes, Addr]) -> None:
        if not self.wake_value(item):
            self.items.append(item)

    def close(self) -> None:
        self.closed = True
        self.wake(outcome.Error(trio.EndOfChannel()))

    async def get(self) -> tuple[bytes, Addr]:
        if self.items:
            return self.items.popleft()
        if self.closed:
            raise trio.EndOfChannel
        return await self.park("another task already receives on this socket")


class SimTransport:
    """A host's datagram socket on the simulated network."""

    def __init__(self, network: SimNetwork, host: Host, inbox: Inbox) -> None:
        self.network = network
        self.host = host
        self.local_addr = host.addr
        self._inbox = inbox

    async def send(self, data: bytes, addr: Addr) -> None:
        self.network._send(self.host, data, addr)
        await trio.lowlevel.checkpoint_if_cancelled()  # (a send that succeeds does not wait)

    async def receive(self) -> tuple[bytes, Addr]:
        return await self._inbox.get()

    def close(self) -> None:
        if self.network.inboxes.get(self.local_addr) is not None:
            self.network.inboxes.pop(self.local_addr).close()
