"""What a DHT node stores: verified records, one per signer per key, with limits.

A key (``model/<digest>``, say) holds many values, one per signer. A record
names its key inside its signed content (field ``key``), so nobody can replant
someone else's record under another key. A newer sequence number from the
same signer replaces the older record; an older or equal one is refused.

Bounds, so that no signer and no source (however many identities it makes)
can fill a node:

- per key: values in all, and values one source stored (a quarter of a key);
- per signer: keys it holds values under;
- per source *network* (the node passes ``netgroup.ip_group`` of the storing
  address, or the exact address for loopback and private ones), across every
  key: ``max_values_per_network``;
- per node: ``max_values``. A full node makes room rather than refuse: it
  evicts from the most-represented source network (its short-lived values
  first, then its soonest to expire), as long as that network holds more than
  the newcomer's. A source holding less than its fair share is never refused
  for lack of room; the one that holds the most is.

A value may be given a shorter life than its record claims (``lifetime_cap_ms``:
the node's policy, e.g. a certifier index naming a model nobody announces):
it expires then, and goes first when room is needed.

A full key still takes a record whose signer the node knows is live (a
routing-table member: it entered after answering a round trip at its
address): it replaces a value whose signer is not, from the source that
stored most. Identities cost nothing; answering from a real address does, so
floods of records from identities that run no node give way to volunteers
that do. The node's own values (source None) are never evicted.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from meshnet_p2p.core.records import Record
from meshnet_p2p.dht.refresh import since_after
from meshnet_p2p.dht.tagged import Tagged, put_tagged

TAG_BYTES = 8  # of a record's signature: which version of which signer's record it is
MAX_KNOWN_TAGS = 512  # tags a reader names as already held, in one find_value (4 KB)


def tag(record: Record) -> bytes:
    """A short name of one record: the head of its signature, which covers its
    signer, content and sequence (two records sharing one would take a signer
    ~2**64 tries to make: the cost of it is only a record a reader is not sent)."""
    return record.signature[:TAG_BYTES]


Slot = tuple[str, bytes]  # (key, signer)


@dataclass
class _Meta:
    source: Any  # the source network that stored it; None: this node
    expires_at_ms: int  # the record's own expiry, or sooner (a lifetime cap)
    short: bool  # its life was capped: it goes first when room is needed
    since: int  # refresh.since_after: from which seq a copy of its signer's stands for it


@dataclass
class ValueStore:
    max_values_per_key: int = 256
    max_keys_per_signer: int = 64
    max_values: int = 100_000
    # values of one key stored for one source host: a quarter of a key, so a host
    # (however many identities it makes) cannot fill one; generous enough for a NAT
    max_values_per_source: int = 64
    # values one source network stores across every key: a 25th of the node, so
    # filling it takes 25 networks; an office of 16 volunteers stores a few dozen
    max_values_per_network: int = 4096
    # and in bytes (records are up to 16 KiB): a node's values in memory stay bounded
    # (~2 KB of bookkeeping per value on top of its wire bytes, measured)
    max_bytes: int = 256 * 1024 * 1024
    max_bytes_per_network: int = 16 * 1024 * 1024
    _by_key: dict[str, dict[bytes, Record]] = field(default_factory=dict)
    _tagged: dict[str, Tagged] = field(default_factory=dict)  # key -> its values by signer tag (tagged.py)
    _keys_of_signer: dict[bytes, set[str]] = field(default_factory=dict)
    _meta: dict[Slot, _Meta] = field(default_factory=dict)
    _of_source: dict[Any, dict[Slot, None]] = field(default_factory=dict)  # source -> its values (not None's)
    # (key, source) -> values of that key the source stored: the per-source bound of a key is
    # checked for every new value, and walking the key's up to 256 values for it was 3.5 % of a
    # simulated 10,000-peer swarm's time (docs/scale.md)
    _in_key: dict[tuple[str, Any], int] = field(default_factory=dict)
    _by_count: dict[int, set[Any]] = field(default_factory=dict)  # n -> sources holding n values
    _top: int = 0  # the most values one source holds
    _count: int = 0
    _bytes: int = 0  # wire bytes of every value held
    _bytes_of_source: dict[Any, int] = field(default_factory=dict)
    # key -> no value of it expires before this (a lower bound): a read of a key with
    # nothing due skips walking its values (every find_value and pull reads one)
    _soonest: dict[str, int] = field(default_factory=dict)
    # stores that met a full key: refused, or taken in place of a value whose signer is not
    # known live (a key with more signers than it holds: who is left out, and how often)
    full_key_refused: int = 0
    full_key_replaced: int = 0
    # this node's order of signers when a full key makes room (_unproven): its own, so that
    # the homes of a key leave out different volunteers, and secret, so that nobody grinds
    # identities a home keeps before others
    _salt: bytes = field(default_factory=lambda: os.urandom(16))

    def put(self, key: str, record: Record, now_ms: int, *, source: Any = None, own: bool = False,
            live: Callable[[Record], bool] | None = None, lifetime_cap_ms: int | None = None,
            volatile: frozenset[str] = frozenset(), per_source: int | None = None) -> tuple[bool, str]:
        """``source``: the network a store came from (None: this node). ``own``: a
        record this node signed, which others' records never crowd out. ``live``:
        whether a record's signer is known live here (see the module's doc).
        ``lifetime_cap_ms``: the longest this value may live here from now on.
        ``volatile``: its payload type's load fields (a refresh changes only those).
        ``per_source``: the values of this key one source may store, when the node's
        policy bounds it tighter than ``max_values_per_source`` (e.g. fraud reports)."""
        if record.content.get("key") != key:
            return False, "the record's signed key does not match the key it is stored under"
        if record.expires_at_ms <= now_ms:
            return False, "expired"
        if own or source is None:
            lifetime_cap_ms = None  # the node's own values live as they say
        expires = record.expires_at_ms if lifetime_cap_ms is None else min(record.expires_at_ms,
                                                                          now_ms + lifetime_cap_ms)
        short = expires < record.expires_at_ms
        signer = record.signer.multihash
        values = self._by_key.get(key, {})
        old = values.get(signer)
        if old is not None:
            if old.seq > record.seq or (old.seq == record.seq and old.wire != record.wire):
                return False, f"sequence {record.seq} is not newer than the stored {old.seq}"
            values[signer] = record
            self._tagged[key].put(record)
            meta = self._meta[(key, signer)]
            meta.expires_at_ms, meta.short = expires, short  # a re-store renews (by today's policy)
            meta.since = since_after(old, meta.since, record, volatile)
            self._soonest[key] = min(self._soonest.get(key, expires), expires)  # a cap may shorten it
            self._add_bytes(meta.source, len(record.wire) - len(old.wire))
            return True, "replaced" if old.seq < record.seq else "unchanged"
        bound = self.max_values_per_source if per_source is None else min(per_source, self.max_values_per_source)
        if source is not None and self._in_key.get((key, source), 0) >= bound:
            return False, f"this source already stored {bound} values under this key"
        if source is not None and self._held(source) >= self.max_values_per_network:
            return False, f"this source network already stored {self.max_values_per_network} values here"
        size = len(record.wire)
        if source is not None and self._bytes_of_source.get(source, 0) + size > self.max_bytes_per_network:
            return False, f"this source network already stored {self.max_bytes_per_network} bytes here"
        keys = self._keys_of_signer.get(signer, ())
        if len(keys) >= self.max_keys_per_signer:
            return False, f"signer already holds the maximum of {self.max_keys_per_signer} keys here"
        if len(values) >= self.max_values_per_key:
            if own:
                self._drop(key, min(values, key=lambda s: values[s].expires_at_ms))  # the soonest to expire goes
            else:
                victim = self._unproven(key, values, live) if live is not None and live(record) else None
                if victim is None:
                    self.full_key_refused += 1
                    return False, f"key holds the maximum of {self.max_values_per_key} values"
                self._drop(key, victim)
                self.full_key_replaced += 1
        while self._count >= self.max_values or self._bytes + size > self.max_bytes:
            victim = self._room_for(source, short)
            if victim is None:
                return False, "this node's store is full"
            self._drop(*victim)
        self._by_key.setdefault(key, values)[signer] = record
        put_tagged(self._tagged, key, record)
        self._keys_of_signer.setdefault(signer, set()).add(key)
        self._meta[(key, signer)] = _Meta(source, expires, short, since_after(None, None, record))
        self._soonest[key] = min(self._soonest.get(key, expires), expires)
        if source is not None:
            self._of_source.setdefault(source, {})[(key, signer)] = None
            self._in_key[(key, source)] = self._in_key.get((key, source), 0) + 1
            self._recount(source, +1)
        self._add_bytes(source, size)
        self._count += 1
        return True, "stored"

    # --- who holds what -----------------------------------------------------------------------

    def _source(self, slot: Slot) -> Any:
        meta = self._meta.get(slot)
        return None if meta is None else meta.source

    def _add_bytes(self, source: Any, n: int) -> None:
        self._bytes += n
        if source is not None:
            left = self._bytes_of_source.get(source, 0) + n
            if left:
                self._bytes_of_source[source] = left
            else:
                del self._bytes_of_source[source]

    def _held(self, source: Any) -> int:
        return len(self._of_source.get(source, ()))

    def _recount(self, source: Any, delta: int) -> None:
        """Keep sources bucketed by how many values they hold, and the top count, in O(1)."""
        n = self._held(source)  # (already changed by delta)
        before = n - delta
        if before:
            self._by_count[before].discard(source)
            if not self._by_count[before]:
                del self._by_count[before]
        if n:
            self._by_count.setdefault(n, set()).add(source)
        if n > self._top:
            self._top = n
        while self._top and self._top not in self._by_count:
            self._top -= 1

    def _room_for(self, source: Any, short: bool) -> Slot | None:
        """The value a full node drops for a newcomer from ``source``: from the
        network holding the most (its short-lived values first, then its soonest
        to expire), if that network holds more than the newcomer's, or if the
        newcomer lives its full life and the victim was short-lived anyway."""
        if not self._top:
            return None  # only the node's own values: they stay
        mine = 0 if source is None else self._held(source)
        top = next(iter(self._by_count[self._top]))
        slots = self._of_source[top]
        victim = min(slots, key=lambda s: (not self._meta[s].short, self._meta[s].expires_at_ms))
        if self._top > mine or (self._meta[victim].short and not short):
            return victim
        return None

    def _unproven(self, key: str, values: dict[bytes, Record], live: Callable[[Record], bool]) -> bytes | None:
        """A value a live record may replace: its signer not known live, stored by
        the source holding most of the key; among those, the last in this node's own
        order of signers (a keyed hash). Not the soonest to expire: every home of a
        key then chose the same volunteers (those whose records it held longest
        without a renewal, the first to announce), and a lookup found them at none
        of the homes near the key (bench/sim.py, one model of ~840 volunteers)."""
        candidates = [s for s, r in values.items() if not live(r)]  # the node's own records count as live
        if not candidates:
            return None
        per_source: dict[Any, int] = {}
        for s in candidates:
            src = self._source((key, s))
            per_source[src] = per_source.get(src, 0) + 1
        salt = self._salt
        return max(candidates, key=lambda s: (per_source[self._source((key, s))],
                                              hashlib.blake2b(s, key=salt, digest_size=8).digest()))

    def _drop(self, key: str, signer: bytes) -> None:
        values = self._by_key[key]
        dropped = values.pop(signer)
        self._tagged[key].drop(dropped)
        if not values:
            del self._by_key[key]
            del self._tagged[key]
            self._soonest.pop(key, None)
        keys = self._keys_of_signer[signer]
        keys.discard(key)
        if not keys:
            del self._keys_of_signer[signer]  # (bookkeeping stays as small as what is held)
        meta = self._meta.pop((key, signer))
        self._add_bytes(meta.source, -len(dropped.wire))
        if meta.source is not None:
            held = self._of_source[meta.source]
            del held[(key, signer)]
            if not held:
                del self._of_source[meta.source]
            n = self._in_key.pop((key, meta.source)) - 1
            if n:
                self._in_key[(key, meta.source)] = n
            self._recount(meta.source, -1)
        self._count -= 1

    # --- reading and expiring -------------------------------------------------------------------

    def holds(self, key: str, now_ms: int) -> bool:
        """Is any live value held under ``key``?"""
        values = self._by_key.get(key, {})
        return any(self._meta[(key, s)].expires_at_ms > now_ms for s in values)

    def since_of(self, key: str, record: Record) -> int | None:
        """``record``'s ``since`` (refresh.py) if its seq is the one stored here, else None."""
        signer = record.signer.multihash
        held = self._by_key.get(key, {}).get(signer)
        return self._meta[(key, signer)].since if held is not None and held.seq == record.seq else None

    def expires_at(self, key: str, signer: bytes) -> int | None:
        meta = self._meta.get((key, signer))
        return None if meta is None else meta.expires_at_ms

    def get(self, key: str, now_ms: int, *, after: bytes = b"", upto: bytes | None = None,
            budget: int = 48_000, known: Collection[bytes] = ()) -> tuple[list[Record], bool, int]:
        """Live records of ``key`` ordered by signer, of signers in (``after``,
        ``upto``] (``upto`` None: no end), up to ``budget`` bytes, leaving out those
        whose tag (:func:`tag`) is in ``known`` (the asker holds them). Returns
        (records, more, how many were left out as known)."""
        self.expire_key(key, now_ms)
        values = self._by_key.get(key, {})
        out, used, skipped = [], 0, 0
        for signer in sorted(s for s in values if s > after and (upto is None or s <= upto)):
            rec = values[signer]
            if known and tag(rec) in known:
                skipped += 1
                continue
            if used + len(rec.wire) > budget and out:
                return out, True, skipped
            out.append(rec)
            used += len(rec.wire)
        return out, False, skipped

    def live(self, key: str, now_ms: int) -> dict[bytes, Record]:
        """Every live record of ``key``, by signer (a copy; unordered, unbounded: for this node's own use)."""
        self.expire_key(key, now_ms)
        return dict(self._by_key.get(key, {}))

    def tagged(self, key: str, now_ms: int) -> Tagged | None:
        """``key``'s live values by signer tag (tagged.py), or None if it holds none."""
        self.expire_key(key, now_ms)
        return self._tagged.get(key)

    def expire_key(self, key: str, now_ms: int) -> None:
        values = self._by_key.get(key)
        if not values or now_ms < self._soonest.get(key, now_ms):
            return
        for signer in [s for s in values if self._meta[(key, s)].expires_at_ms <= now_ms]:
            self._drop(key, signer)
        if key in self._by_key:
            self._soonest[key] = min(self._meta[(key, s)].expires_at_ms for s in values)

    def expire(self, now_ms: int) -> None:
        for key in list(self._by_key):
            self.expire_key(key, now_ms)

    def items(self) -> list[tuple[str, Record]]:
        return [(k, r) for k, values in self._by_key.items() for r in values.values()]

    def sources(self) -> dict[Any, int]:
        """How many values each source network holds here (not the node's own)."""
        return {s: len(v) for s, v in self._of_source.items()}

    def __len__(self) -> int:
        return self._count
