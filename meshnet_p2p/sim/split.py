"""A simulation split over two processes, one core each: conservative parallel
discrete-event simulation with a lookahead.

Each process runs the nodes of half the peers (and the users' work it owns) under
its own trio ``MockClock``. No datagram arrives sooner than ``LOOKAHEAD_S`` after it
was sent (half the smallest round trip between regions, ``net.RTT_MS``; access
delays only add), so the two need agree only every ``LOOKAHEAD_S`` of simulated time:
at each such point ``t`` both stop, and hand each other what they sent the other
since the last (each due at ``t`` or later: nothing arrives in the past), the hosts
they created (a fresh client's, whose answers come back to it), and what changed
of their peers (online, announced, gone: the stand-ins the other process's users
and oracle read, ``RemotePeerNode``), then go on to ``t + LOOKAHEAD_S``. Between two
points each runs alone, as fast as its own work allows; what one sees of the
other's peers is at most one lookahead old.

The two processes share the swarm as it was populated (``os.fork`` after
``SimSwarm.populate``) and exchange msgpack over a socket pair: no pickle. A
question one side's oracle asks of the other's nodes (``ask``) is answered at the
next point, from the other's state then.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import struct
import sys
import time
from typing import Any, Callable

import msgpack
import trio

from .net import RTT_MS

# No datagram between two hosts is faster than half the fastest round trip between regions.
LOOKAHEAD_S = min(RTT_MS.values()) / 2000

_LEN = struct.Struct("!Q")


class PartnerGone(Exception):
    """The other process ended (its error is in its own output)."""


class RemotePeerNode:
    """What this process knows of a peer the other process runs, for one session: its
    node runs (``online``), and its node ID (node lookups aim at it). A new session
    is a new object, as a new node is (a generation's hop compares them)."""

    __slots__ = ("node_id",)
    running = True

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id


class Partner:
    """This process's end of the link to the other (``me``: 0 or 1)."""

    def __init__(self, sock: socket.socket, me: int, lookahead_s: float = LOOKAHEAD_S) -> None:
        self.sock = sock
        self.me = me
        self.lookahead_s = lookahead_s  # (a point every this much; net.py refuses a faster datagram to the other)
        self.datagrams: list[list] = []  # sent to the other's hosts: [due, dst ip, dst port, data, src ip, src port]
        self.hosts: list[list] = []  # hosts made here since the last point: [ip, port, region, access_s, natted]
        self.changes: list[list] = []  # of this process's peers: [index, field, value]
        self.asks: list[list] = []  # [id, name, args]
        self.answers: list[list] = []  # [id, result]
        self.handlers: dict[str, Callable[..., Any]] = {}  # what the other may ask of this side
        self._waiting: dict[int, tuple[trio.Event, list]] = {}
        self._ids = itertools.count()
        self.waited_s = 0.0  # wall time blocked on the other (its half's work took longer)
        self.wants_end: Callable[[], bool] = lambda: False

    # --- the exchange --------------------------------------------------------------------------

    def _send(self, payload: bytes) -> None:
        self.sock.sendall(_LEN.pack(len(payload)) + payload)

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise PartnerGone("the other process of the simulation ended")
            buf += chunk
        return bytes(buf)

    def _recv(self) -> bytes:
        return self._recv_exact(_LEN.unpack(self._recv_exact(_LEN.size))[0])

    def swap(self, mine: Any) -> Any:
        """Send ``mine``, take theirs (blocking: the whole process waits, as it must).
        Process 0 sends first and process 1 receives first, so a batch larger than the
        socket's buffer cannot leave both blocked sending."""
        out = msgpack.packb(mine, use_bin_type=True)
        if self.me == 0:
            self._send(out)
        t0 = time.perf_counter()
        got = self._recv()
        self.waited_s += time.perf_counter() - t0
        if self.me == 1:
            self._send(out)
        return msgpack.unpackb(got, raw=False, strict_map_key=False)

    async def run(self, net, apply_change: Callable[[int, str, Any], None]) -> None:
        """Meet the other process every LOOKAHEAD_S of simulated time until both want
        to end (``wants_end``) at the same point."""
        for k in itertools.count(1):
            await trio.sleep_until(k * self.lookahead_s)
            wants = self.wants_end()
            mine = [self.hosts, self.datagrams, self.changes, self.asks, self.answers, wants]
            self.hosts, self.datagrams, self.changes, self.asks, self.answers = [], [], [], [], []
            hosts, datagrams, changes, asks, answers, theirs = self.swap(mine)
            for ip, port, region, access_s, natted in hosts:
                net.add_remote_host((ip, port), region, access_s, natted, owner=1 - self.me)
            for due, dip, dport, data, sip, sport in datagrams:
                net.arrive(due, (dip, dport), data, (sip, sport))
            for index, name, value in changes:
                apply_change(index, name, value)
            for qid, result in answers:
                event, box = self._waiting.pop(qid)
                box.append(result)
                event.set()
            for qid, name, args in asks:
                self.answers.append([qid, self.handlers[name](*args)])
            if wants and theirs:
                return

    async def ask(self, name: str, *args: Any) -> Any:
        """The other process's ``handlers[name](*args)``, from its state at the next point."""
        qid = next(self._ids)
        event, box = trio.Event(), []
        self._waiting[qid] = (event, box)
        self.asks.append([qid, name, list(args)])
        await event.wait()
        return box[0]

    def close(self) -> None:
        self.sock.close()


def run_split(swarm, run: Callable) -> dict:
    """``swarm``'s run (``run(swarm)``: a trio run of it) in two processes: the swarm
    drawn, then forked; each runs half the peers, and the parent adds the child's
    part (``report.Part``) to its own and reports."""
    swarm.populate()
    wall0 = time.perf_counter()
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: process 1
        code = 1
        try:
            mine.close()
            part = _half(swarm, theirs, 1, run)
            swarm.partner._send(part.pack())
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    theirs.close()
    try:
        part = _half(swarm, mine, 0, run)
        child = swarm.partner._recv()
    finally:
        mine.close()
        _, status = os.waitpid(pid, 0)
    if status:
        raise RuntimeError(f"the simulation's second process failed (status {status}; its traceback above)")
    part.add(child)
    return swarm.report(part, time.perf_counter() - wall0)


def _half(swarm, sock: socket.socket, me: int, run: Callable):
    """Process ``me`` of a split run: its half of the peers (``SimSwarm.runs``), its own
    random streams, the other's hosts reached through the partner link."""
    cfg, net = swarm.cfg, swarm.net
    swarm.me, net.me = me, me
    swarm.partner = net.partner = Partner(sock, me)
    swarm.partner.handlers["where_held"] = swarm.clients.held_here
    net.port = 4001 + me  # hosts made from here on (fresh clients'): never the other's addresses
    for p in swarm.peers:
        net.owner[p.host.addr] = swarm.owner(p)
    swarm.rng.seed(f"{cfg.seed}/half/{me}")  # (the network's too: one object) drawn apart from the other's
    swarm.clients.rng.seed(f"probes/{cfg.seed}/half/{me}")
    random.seed(f"{cfg.seed}/half/{me}")
    return run(swarm)
