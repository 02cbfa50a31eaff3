"""What a DHT node stores: verified records, one per signer per key, with limits.

A key (``model/<digest>``, say) holds many values, one per signer. A record
names its key inside its signed content (field ``key``), so nobody can replant
someone else's record under another key. A newer sequence number from the
same signer replaces the older record; an older or equal one is refused.
Bounds: values per key, keys per signer and values in total, so one signer
(or many fake ones) cannot fill a node. A full key still takes a record
whose signer the node knows is live (a routing-table member: it entered
after answering a round trip at its address): it replaces a value whose
signer is not, from the source that stored most. Identities cost nothing;
answering from a real address does, so floods of records from identities
that run no node give way to volunteers that do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..records import Record


@dataclass
class ValueStore:
    max_values_per_key: int = 256
    max_keys_per_signer: int = 64
    max_values: int = 100_000
    # values of one key stored for one source host: a quarter of a key, so a host
    # (however many identities it makes) cannot fill one; generous enough for a NAT
    max_values_per_source: int = 64
    _by_key: dict[str, dict[bytes, Record]] = field(default_factory=dict)
    _keys_of_signer: dict[bytes, set[str]] = field(default_factory=dict)
    _source_of: dict[tuple[str, bytes], Any] = field(default_factory=dict)
    _count: int = 0

    def put(self, key: str, record: Record, now_ms: int, *, source: Any = None, own: bool = False,
            live: Callable[[Record], bool] | None = None) -> tuple[bool, str]:
        """``source``: the address a store came from (None: this node). ``own``: a
        record this node signed, which others' records never crowd out. ``live``:
        whether a record's signer is known live here (see the module's doc)."""
        if record.content.get("key") != key:
            return False, "the record's signed key does not match the key it is stored under"
        if record.expires_at_ms <= now_ms:
            return False, "expired"
        signer = record.signer.multihash
        values = self._by_key.get(key, {})
        old = values.get(signer)
        if old is not None:
            if old.seq > record.seq or (old.seq == record.seq and old.wire != record.wire):
                return False, f"sequence {record.seq} is not newer than the stored {old.seq}"
            values[signer] = record
            return True, "replaced" if old.seq < record.seq else "unchanged"
        if source is not None and sum(1 for s in values if self._source_of.get((key, s)) == source) \
                >= self.max_values_per_source:
            return False, f"this source already stored {self.max_values_per_source} values under this key"
        if len(values) >= self.max_values_per_key:
            if own:
                self._drop(key, min(values, key=lambda s: values[s].expires_at_ms))  # the soonest to expire goes
            else:
                victim = self._unproven(key, values, live) if live is not None and live(record) else None
                if victim is None:
                    return False, f"key holds the maximum of {self.max_values_per_key} values"
                self._drop(key, victim)
        keys = self._keys_of_signer.setdefault(signer, set())
        if len(keys) >= self.max_keys_per_signer:
            return False, f"signer already holds the maximum of {self.max_keys_per_signer} keys here"
        if self._count >= self.max_values:
            return False, "this node's store is full"
        self._by_key.setdefault(key, values)[signer] = record
        keys.add(key)
        if source is not None:
            self._source_of[(key, signer)] = source
        self._count += 1
        return True, "stored"

    def _unproven(self, key: str, values: dict[bytes, Record], live: Callable[[Record], bool]) -> bytes | None:
        """A value a live record may replace: its signer not known live, stored by
        the source holding most of the key, the soonest to expire among those."""
        candidates = [s for s, r in values.items() if not live(r)]  # the node's own records count as live
        if not candidates:
            return None
        per_source: dict[Any, int] = {}
        for s in candidates:
            src = self._source_of.get((key, s))
            per_source[src] = per_source.get(src, 0) + 1
        return max(candidates, key=lambda s: (per_source[self._source_of.get((key, s))], -values[s].expires_at_ms))

    def _drop(self, key: str, signer: bytes) -> None:
        del self._by_key[key][signer]
        self._keys_of_signer[signer].discard(key)
        self._source_of.pop((key, signer), None)
        self._count -= 1

    def get(self, key: str, now_ms: int, *, after: bytes = b"", budget: int = 48_000) -> tuple[list[Record], bool]:
        """Live records of ``key`` ordered by signer, after ``after``, up to ``budget`` bytes.
        Returns (records, more)."""
        self.expire_key(key, now_ms)
        values = self._by_key.get(key, {})
        out, used = [], 0
        for signer in sorted(s for s in values if s > after):
            rec = values[signer]
            if used + len(rec.wire) > budget and out:
                return out, True
            out.append(rec)
            used += len(rec.wire)
        return out, False

    def expire_key(self, key: str, now_ms: int) -> None:
        values = self._by_key.get(key)
        if not values:
            return
        for signer in [s for s, r in values.items() if r.expires_at_ms <= now_ms]:
            self._drop(key, signer)
        if not values:
            del self._by_key[key]

    def expire(self, now_ms: int) -> None:
        for key in list(self._by_key):
            self.expire_key(key, now_ms)

    def items(self) -> list[tuple[str, Record]]:
        return [(k, r) for k, values in self._by_key.items() for r in values.values()]

    def __len__(self) -> int:
        return self._count
