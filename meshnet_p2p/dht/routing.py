"""Kademlia routing table as pure data: node IDs, XOR distance, k-buckets.

No I/O here. :meth:`RoutingTable.add` never pings anyone: when a bucket is
full it keeps the newcomer in a replacement cache and returns the stalest
member, for the caller to ping (and to :meth:`RoutingTable.fail` if it does not
answer). Failures evict: a contact that missed ``max_failures`` requests in a
row is dropped and a replacement takes its place. That is what keeps frozen
peers from stalling lookups for ever.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from ..identity import PeerId

ID_BITS = 256


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
        return cls(node_id_of(peer_id), peer_id, host, port)


class KBucket:
    def __init__(self, k: int) -> None:
        self.k = k
        self.members: OrderedDict[int, Contact] = OrderedDict()  # least recently seen first
        self.failures: dict[int, int] = {}
        self.replacements: OrderedDict[int, Contact] = OrderedDict()

    def __len__(self) -> int:
        return len(self.members)


class RoutingTable:
    def __init__(self, local_id: int, k: int = 20, max_failures: int = 2) -> None:
        self.local_id = local_id
        self.k = k
        self.max_failures = max_failures
        self.buckets = [KBucket(k) for _ in range(ID_BITS)]

    def _bucket(self, node_id: int) -> KBucket:
        d = node_id ^ self.local_id
        return self.buckets[d.bit_length() - 1] if d else self.buckets[0]

    def add(self, contact: Contact) -> Contact | None:
        """Record that ``contact`` was heard from. Returns a contact to ping when
        the bucket is full (the newcomer then waits in the replacement cache)."""
        if contact.node_id == self.local_id:
            return None
        b = self._bucket(contact.node_id)
        if contact.node_id in b.members:
            b.members.pop(contact.node_id)
            b.members[contact.node_id] = contact  # most recently seen, address refreshed
            b.failures.pop(contact.node_id, None)
            return None
        if len(b.members) < b.k:
            b.members[contact.node_id] = contact
            return None
        b.replacements.pop(contact.node_id, None)
        b.replacements[contact.node_id] = contact
        while len(b.replacements) > b.k:
            b.replacements.popitem(last=False)
        return next(iter(b.members.values()))

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
        if b.members.pop(node_id, None) is not None and b.replacements:
            _, newest = b.replacements.popitem(last=True)
            b.members[newest.node_id] = newest
        b.failures.pop(node_id, None)

    def get(self, node_id: int) -> Contact | None:
        return self._bucket(node_id).members.get(node_id)

    def nearest(self, target: int, count: int | None = None, exclude: set[int] | frozenset[int] = frozenset()) -> list[Contact]:
        count = self.k if count is None else count
        everyone = [c for b in self.buckets for c in b.members.values() if c.node_id not in exclude]
        everyone.sort(key=lambda c: c.node_id ^ target)
        return everyone[:count]

    def contacts(self) -> list[Contact]:
        return [c for b in self.buckets for c in b.members.values()]

    def __len__(self) -> int:
        return sum(len(b) for b in self.buckets)
