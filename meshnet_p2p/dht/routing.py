"""Kademlia routing table as pure data: node IDs, XOR distance, k-buckets.

No I/O here. :meth:`RoutingTable.add` never pings anyone: when a bucket is
full it keeps the newcomer in a replacement cache and returns the stalest
member, for the caller to ping (and to :meth:`RoutingTable.fail` if it does not
answer), unless that member was heard from within FRESH_S: then it is alive
enough and nobody is pinged (the caller passes its clock). Failures evict: a
contact that missed ``max_failures`` requests in a row is dropped and a
replacement takes its place. That is what keeps frozen peers from stalling
lookups for ever.

Address diversity (as libp2p's kad-dht does): one network (an IPv4 /24, an
IPv6 /48) holds at most MAX_PER_GROUP_IN_BUCKET members of a bucket and
MAX_PER_GROUP of the table, so one host minting identities cannot fill the
table or eclipse a key. Loopback, private and link-local addresses are exempt:
local swarms and LANs share one network by design.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Iterator

from meshnet_p2p.core.identity import PeerId
from meshnet_p2p.core.netgroup import ip_group

ID_BITS = 256
MAX_PER_GROUP_IN_BUCKET = 2
MAX_PER_GROUP = 8
# A member heard from this recently is not pinged when a newcomer would take its place.
# BEP 5 keeps a node "good" for 15 minutes; a dead member is still found by the lookups
# that time out on it (fail), so the price of a long window is small. Pinging the stalest
# member for every newcomer was a third of a simulated swarm's pings (docs/scale.md).
FRESH_S = 300.0


@functools.lru_cache(maxsize=16384)  # asked for every contact of every reply: the same peers again and again
def node_id_of(peer_id: PeerId) -> int:
    """A node's DHT ID: sha256 of its peer ID bytes, so IDs are uniform and bound to keys."""
    return int.from_bytes(hashlib.sha256(peer_id.multihash).digest(), "big")


def key_id(key: bytes) -> int:
    return int.from_bytes(hashlib.sha256(key).digest(), "big")


@dataclass(frozen=True)
class Contact:
    node_id: int
    peer_id: PeerId
    host: str
    port: int

    @property
    def addr(self) -> tuple[str, int]:
        return (self.host, self.port)

    @classmethod
    def of(cls, peer_id: PeerId, host: str, port: int) -> "Contact":
        return _contact(peer_id, host, port)


@functools.lru_cache(maxsize=65536)  # every reply's contacts are made again: the same few thousand
def _contact(peer_id: PeerId, host: str, port: int) -> Contact:
    return Contact(node_id_of(peer_id), peer_id, host, port)  # (frozen: one object serves every holder)


class KBucket:
    def __init__(self, k: int, index: int = 0) -> None:
        self.k = k
        self.index = index  # members' distance from the local ID has this highest bit
        self.members: OrderedDict[int, Contact] = OrderedDict()  # least recently seen first
        self.seen: dict[int, float] = {}  # when each member was last heard from (the caller's clock)
        self.failures: dict[int, int] = {}
        self.replacements: OrderedDict[int, Contact] = OrderedDict()

    def __len__(self) -> int:
        return len(self.members)


class RoutingTable:
    def __init__(self, local_id: int, k: int = 20, max_failures: int = 2, fresh_s: float = FRESH_S) -> None:
        self.local_id = local_id
        self.k = k
        self.max_failures = max_failures
        self.fresh_s = fresh_s
        self.buckets = [KBucket(k, i) for i in range(ID_BITS)]
        self._members: dict[int, Contact] = {}  # every bucket's members
        self._filled: set[int] = set()  # indices of the buckets with members, for nearest()
        self._groups: Counter[str] = Counter()  # members per ip_group, table-wide
        self.refused_for_diversity = 0

    def _diverse_enough(self, b: KBucket, contact: Contact) -> bool:
        g = ip_group(contact.host)
        if g is None:
            return True
        in_bucket = sum(1 for c in b.members.values() if ip_group(c.host) == g)
        return in_bucket < MAX_PER_GROUP_IN_BUCKET and self._groups[g] < MAX_PER_GROUP

    def _joined(self, b: KBucket, contact: Contact) -> None:
        b.members[contact.node_id] = contact
        self._members[contact.node_id] = contact
        self._filled.add(b.index)
        if (g := ip_group(contact.host)) is not None:
            self._groups[g] += 1

    def _left(self, b: KBucket, node_id: int) -> Contact | None:
        c = b.members.pop(node_id, None)
        self._members.pop(node_id, None)
        b.seen.pop(node_id, None)
        if not b.members:
            self._filled.discard(b.index)
        if c is not None and (g := ip_group(c.host)) is not None:
            self._groups[g] -= 1
            if not self._groups[g]:
                del self._groups[g]
        return c

    def _bucket(self, node_id: int) -> KBucket:
        d = node_id ^ self.local_id
        return self.buckets[d.bit_length() - 1] if d else self.buckets[0]

    def add(self, contact: Contact, now: float | None = None) -> Contact | None:
        """Record that ``contact`` was heard from (at ``now``, on the caller's clock).
        Returns a contact to ping when the bucket is full (the newcomer then waits
        in the replacement cache): its stalest member, unless that one was heard
        from within ``fresh_s`` of ``now`` (with no clock given: always)."""
        if contact.node_id == self.local_id:
            return None
        b = self._bucket(contact.node_id)
        old = b.members.get(contact.node_id)
        if old is not None:
            if old.host == contact.host:
                b.members.move_to_end(contact.node_id)  # most recently seen
                b.members[contact.node_id] = contact
                self._members[contact.node_id] = contact
            else:  # an address change: the new address's network must have room
                self._left(b, contact.node_id)
                if not self._diverse_enough(b, contact):
                    self._joined(b, old)
                    self.refused_for_diversity += 1
                    return None
                self._joined(b, contact)
            b.failures.pop(contact.node_id, None)
            self._seen(b, contact.node_id, now)
            return None
        if not self._diverse_enough(b, contact):
            self.refused_for_diversity += 1
            return None
        if len(b.members) < b.k:
            self._joined(b, contact)
            self._seen(b, contact.node_id, now)
            return None
        b.replacements.pop(contact.node_id, None)
        b.replacements[contact.node_id] = contact
        while len(b.replacements) > b.k:
            b.replacements.popitem(last=False)
        stalest = next(iter(b.members.values()))
        return None if self._fresh(b, stalest.node_id, now) else stalest

    def has_room(self, node_id: int, now: float) -> bool:
        """Whether a newcomer ``node_id`` could enter its bucket now: it has room, or
        its stalest member is due a ping. A caller need not check a newcomer that could
        not (its round trip would buy nothing)."""
        b = self._bucket(node_id)
        return len(b.members) < b.k or not self._fresh(b, next(iter(b.members)), now)

    @staticmethod
    def _seen(b: KBucket, node_id: int, now: float | None) -> None:
        if now is not None:
            b.seen[node_id] = now

    def _fresh(self, b: KBucket, node_id: int, now: float | None) -> bool:
        seen = b.seen.get(node_id)
        return now is not None and seen is not None and now - seen < self.fresh_s

    def fail(self, node_id: int) -> bool:
        """A request to ``node_id`` timed out. Returns True if it was evicted."""
        b = self._bucket(node_id)
        if node_id not in b.members:
            b.replacements.pop(node_id, None)
            return False
        b.failures[node_id] = b.failures.get(node_id, 0) + 1
        if b.failures[node_id] < self.max_failures:
            return False
        self.evict(node_id)
        return True

    def evict(self, node_id: int) -> None:
        """Drop a member that failed a liveness check; promote its newest replacement."""
        b = self._bucket(node_id)
        if self._left(b, node_id) is not None:
            while b.replacements:  # the newest replacement the diversity bound still admits
                _, newest = b.replacements.popitem(last=True)
                if self._diverse_enough(b, newest):
                    self._joined(b, newest)
                    break
        b.failures.pop(node_id, None)

    def get(self, node_id: int) -> Contact | None:
        return self._members.get(node_id)  # (every bucket's members in one dict: no bucket to find)

    def nearest(self, target: int, count: int | None = None, exclude: set[int] | frozenset[int] = frozenset()) -> list[Contact]:
        """The ``count`` members closest to ``target``, closest first, none of ``exclude``.

        Read off the buckets in bands of distance instead of sorting every member
        (most requests a node answers ask for this, and a full table has hundreds of
        members): with ``t`` the highest bit of target ^ local ID, bucket t's members
        are nearer than 2**t; those of every lower bucket lie in [2**t, 2**(t+1)); a
        bucket j above t is its own band [2**j, 2**(j+1)). Usually bucket t alone fills
        the answer."""
        count = self.k if count is None else count
        if count <= 0:
            return []
        out: list[Contact] = []
        for band in self._bands((target ^ self.local_id).bit_length() - 1):
            members = [c for b in band for c in b.members.values() if c.node_id not in exclude]
            need = count - len(out)
            if len(members) > need:
                out += heapq.nsmallest(need, members, key=lambda c: c.node_id ^ target)
                return out
            members.sort(key=lambda c: c.node_id ^ target)
            out += members
            if len(out) == count:
                return out
        return out

    def _bands(self, t: int) -> Iterator[list[KBucket]]:
        """The filled buckets grouped by distance band from a target whose distance from
        the local ID has highest bit ``t`` (-1: the local ID itself), nearest first."""
        filled = self._filled
        if t in filled:
            yield [self.buckets[t]]
        if t > 0:
            yield [self.buckets[j] for j in filled if j < t]
        for j in sorted(j for j in filled if j > t):
            yield [self.buckets[j]]

    def contacts(self) -> list[Contact]:
        return [c for b in self.buckets for c in b.members.values()]

    def __len__(self) -> int:
        return len(self._members)
