"""Which gossiped records are new, as pure data: per topic, the newest record of
each signer, with a per-signer rate bound.

A record is forwarded only the first time this node sees it (a newer sequence
from its signer), which is what stops epidemic push from looping; and only if it
is news: its signer new to the topic here, or what it says changed beyond its
load figures. A refresh (the same report re-signed, as peers re-announce every
30 s) is kept, and travels by pull and DHT lookups: pushed, every re-announce
of every peer cost every node ``fanout`` messages, a load per node that grew
with the swarm (the simulator measured 10 pushes a second per node at 200
peers, docs/scale.md). Duplicates
cost nothing, not even rate budget: the same report arriving from six
neighbours is one report. A signer may publish ``burst`` records at once and
``rate_per_s`` on average; a valid record under that bound is always accepted.

A pull sends a digest of what this node holds: one page of it, bounded in
bytes (``digest``), covering a range of topic names; successive pulls rotate
through the pages, and the answerer sends only what is missing within the
page's range (``missing_from``).

A pull's answer leaves out a refresh while the asker's copy stands for it
(refresh.py: a follower needs a co-volunteer's re-announcement only to keep its
copy alive).

A node may follow only some topics (``DHTNode.follows``: a volunteer, its own
model's): its pull then names each topic it asks about, held records or none
(``digest_of``), and the answer holds only those topics (``missing_among``,
drawing on the answerer's store as well: a key's homes store every record put
there, whether or not they follow it). Both sides keep each topic's records by
signer tag as they come and go (tagged.py): the digest is read off it, and the
answer walks only what the digest does not name at its seq.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from meshnet_p2p.core.identity import PEER_TAG_BYTES
from meshnet_p2p.core.ratelimit import TokenBucket
from meshnet_p2p.core.records import Record
from meshnet_p2p.dht import refresh
from meshnet_p2p.dht.tagged import Tagged, put_tagged


# A pull's digest must fit one datagram (wire.MAX_DATAGRAM, 60,000 bytes) with its
# envelope: issue 24 #0 saw 400 certifier-index topics (~122 chars each) make a
# 70 KB digest whose encoding error ended every process of a swarm.
DIGEST_BUDGET_BYTES = 24_000
MAX_TOPIC_CHARS = 512  # as a DHT key
_TOPIC_OVERHEAD = 8  # msgpack: a str header (<= 3 bytes) and the topic's map header (<= 5)
_ENTRY_OVERHEAD = 14  # a bin header (<= 5 bytes) and a seq (<= 9)
# A digest names a signer by the last bytes of its peer ID (a public key's, or a hash's):
# the whole ID was 38 bytes of an entry's ~50, and digests were the largest part of a
# node's bytes once refreshes were cut (docs/scale.md). Two signers of one topic share a
# tag only if one ground ~2**64 keys for it, and that costs only a record a reader is not
# sent, as a find_value's tags of records held (storage.TAG_BYTES).
SIGNER_TAG_BYTES = PEER_TAG_BYTES  # (PeerId.tag, cached)


@dataclass
class GossipState:
    rate_per_s: float = 20.0
    burst: float = 40.0
    max_topics: int = 1024
    max_per_topic: int = 256  # as many values as a DHT key holds
    max_records: int = 16_384  # in total, over every topic
    max_signers: int = 65_536  # rate buckets kept at once (pruned as they refill)
    topics: dict[str, dict[bytes, Record]] = field(default_factory=dict)
    _buckets: dict[bytes, TokenBucket] = field(default_factory=dict)
    # topics the node's policy calls short-lived (a certifier index naming a model nobody
    # announces: free to make up, issue 24 #3) hold at most this share of topics and records
    short_share: float = 0.25
    _count: int = 0
    _digest_after: str | None = None  # where the next digest page starts
    _short: dict[str, int] = field(default_factory=dict)  # short-lived topic -> its records
    _short_count: int = 0
    _since: dict[str, dict[bytes, int]] = field(default_factory=dict)  # topic -> signer -> refresh.since_after
    # topic -> its records by signer tag, and the {tag: seq} its digest names (tagged.py)
    _tagged: dict[str, Tagged] = field(default_factory=dict)

    def offer(self, topic: str, record: Record, now_ms: int, *, short: bool = False,
              volatile: frozenset[str] = frozenset()) -> str:
        """"new" (keep and forward), "refresh" (keep: the held record's successor that
        differs from it only in ``volatile`` fields), "duplicate", "old", "expired",
        "rate-limited" or "full". ``short``: the topic is short-lived by the node's
        policy (asked only when the topic is new here; it keeps that standing while
        it holds records)."""
        if record.expires_at_ms <= now_ms:
            return "expired"
        signer = record.signer.multihash
        known = self.topics.get(topic, {}).get(signer)
        if known is not None:
            if known.seq == record.seq:
                return "duplicate"
            if known.seq > record.seq:
                return "old"
        else:
            short = topic in self._short if topic in self.topics else short
            if self._no_room(topic, short):
                return "full"
        bucket = self._buckets.get(signer)
        if bucket is None:
            if len(self._buckets) >= self.max_signers:
                self._prune_buckets(now_ms)
                if len(self._buckets) >= self.max_signers:
                    return "full"
            bucket = self._buckets[signer] = TokenBucket(self.burst, self.rate_per_s, now_ms, ticks_per_s=1000)
        if not bucket.spend(now_ms):
            return "rate-limited"
        held = self.topics.setdefault(topic, {})
        if signer not in held:
            self._count += 1
            if short:
                self._short[topic] = self._short.get(topic, 0) + 1
                self._short_count += 1
        held[signer] = record
        put_tagged(self._tagged, topic, record)
        same = known is not None and refresh.same_but_load(known, record, volatile)
        since = self._since.setdefault(topic, {})
        since[signer] = refresh.since_after(known, since.get(signer), record, same=same)
        return "refresh" if same else "new"

    def _no_room(self, topic: str, short: bool) -> bool:
        """No room for a signer new to ``topic`` (``short``: short-lived by the node's policy)."""
        held = self.topics.get(topic)
        if held is None and len(self.topics) >= self.max_topics:
            return True
        if len(held or ()) >= self.max_per_topic or self._count >= self.max_records:
            return True
        return short and ((topic not in self._short and len(self._short) >= self.max_topics * self.short_share)
                          or self._short_count >= self.max_records * self.short_share)

    def holds(self, topic: Any, signer: Any) -> bool:
        """Is a record of ``signer`` held under ``topic`` (any seq)?"""
        return isinstance(topic, str) and isinstance(signer, bytes) and signer in self.topics.get(topic, ())

    def full(self, topic: str) -> bool:
        """Would a record of a signer new to ``topic`` be refused as full now?"""
        return self._no_room(topic, topic in self._short)

    def since_of(self, topic: str, record: Record) -> int | None:
        """``record``'s ``since`` (refresh.py) if its seq is the one held here, else None."""
        held = self.topics.get(topic, {}).get(record.signer.multihash)
        if held is None or held.seq != record.seq:
            return None
        return self._since.get(topic, {}).get(record.signer.multihash)

    def _prune_buckets(self, now_ms: int) -> None:
        """Forget signers whose bucket has refilled: a fresh bucket is the same."""
        refill_ms = self.burst / self.rate_per_s * 1000
        for signer in [s for s, b in self._buckets.items() if now_ms - b.at >= refill_ms]:
            del self._buckets[signer]

    def __len__(self) -> int:
        """Records held, over every topic."""
        return self._count

    def known(self, topic: Any, signer: Any, seq: Any) -> bool:
        """True if a record of ``signer`` at least as new as ``seq`` is held already."""
        if not isinstance(topic, str) or not isinstance(signer, bytes) or not isinstance(seq, int):
            return False
        rec = self.topics.get(topic, {}).get(signer)
        return rec is not None and rec.seq >= seq

    def tagged(self, topic: str) -> Tagged | None:
        """``topic``'s records by signer tag (tagged.py), or None if it holds none."""
        return self._tagged.get(topic)

    def records(self, topic: str) -> list[Record]:
        return list(self.topics.get(topic, {}).values())

    def digest(self, budget: int = DIGEST_BUDGET_BYTES) -> tuple[dict[str, dict[bytes, int]], str | None, str | None]:
        """What this node holds, for a pull: one page of {topic: {signer tag: seq}} of at
        most ``budget`` bytes once packed, and the range of topics it covers,
        (after, upto]: None for the start and the end of the topic names. Pages
        rotate: each call starts after where the last one ended, so successive
        pulls cover every topic, and a topic this node has never seen falls in
        some page's range (the peer sends what it holds there)."""
        names = sorted(self.topics)
        after = self._digest_after
        if after is not None:
            names = [t for t in names if t > after]
        out: dict[str, dict[bytes, int]] = {}
        used = 8  # the map's own header, with margin
        for topic in names:
            cost = len(topic.encode()) + _TOPIC_OVERHEAD
            entries = {}
            for signer, rec in self.topics[topic].items():
                more = SIGNER_TAG_BYTES + _ENTRY_OVERHEAD
                if used + cost + more > budget:
                    break
                entries[rec.signer.tag] = rec.seq
                cost += more
            if len(entries) < len(self.topics[topic]) and out:
                # this topic does not fit whole: the page ends before it
                self._digest_after = upto = max(out)
                return out, after, upto
            out[topic] = entries  # (a topic bigger than a page alone is listed in part)
            used += cost
            if len(entries) < len(self.topics[topic]):
                self._digest_after = topic
                return out, after, topic
        self._digest_after = None  # the end of the names: the next page starts again at the beginning
        return out, after, None

    @staticmethod
    def parse_digest(raw: Any) -> dict[str, dict[bytes, int]]:
        """{topic: {signer tag: seq}}, whether the digest names signers by tag or by
        whole peer ID (as nodes did before 2026-12-06). (A tag named twice keeps one
        of its seqs: only a digest made so, the asker's own, can name one twice.)"""
        if not isinstance(raw, dict) or len(raw) > 1024:
            return {}
        out: dict[str, dict[bytes, int]] = {}
        for topic, seqs in raw.items():
            if isinstance(topic, str) and isinstance(seqs, dict) and len(seqs) <= 1024:
                out[topic] = {s[-SIGNER_TAG_BYTES:]: q for s, q in seqs.items()
                              if isinstance(s, bytes) and len(s) >= SIGNER_TAG_BYTES and isinstance(q, int)}
        return out

    @staticmethod
    def parse_bound(raw: Any) -> str | None:
        """One end of a digest's range: a topic name, or None (no bound). Anything
        else is no bound: the asker then gets what it would have without one."""
        return raw if isinstance(raw, str) and len(raw) <= MAX_TOPIC_CHARS else None

    @staticmethod
    def missing_among(have: dict[str, dict[bytes, int]], records_of: Callable[[str], Iterable[Record]], *,
                      budget: int, stands: Callable[[str, Record, int], bool] | None = None,
                      new_signers: bool = True) -> list[Record]:
        """Records newer than a peer's digest says it holds, of the topics its
        digest names and no other (``records_of(topic)``: what the answerer holds
        of it, one record a signer), but those its copy stands for (``stands(topic,
        record, its seq)``: refresh.py), and without ``new_signers`` (the asker's
        topic is full) only of signers it names, up to ``budget`` bytes."""
        out, used = [], 0
        for topic in sorted(have):
            theirs = have[topic]
            for rec in records_of(topic):
                seq = theirs.get(rec.signer.tag, -1)
                if seq < 0 and not new_signers:
                    continue
                if seq < rec.seq and (seq < 0 or stands is None or not stands(topic, rec, seq)):
                    if used + len(rec.wire) > budget:
                        return out
                    out.append(rec)
                    used += len(rec.wire)
        return out

    def missing_from(self, have: dict[str, dict[bytes, int]], *, budget: int, now_ms: int,
                     after: str | None = None, upto: str | None = None) -> list[Record]:
        """Records newer than what a peer's digest says it holds, among the topics
        in its range (after, upto], but those its copy stands for, up to ``budget`` bytes."""
        out, used = [], 0
        for topic, records in self.topics.items():
            if (after is not None and topic <= after) or (upto is not None and topic > upto):
                continue
            theirs, since = have.get(topic, {}), self._since.get(topic, {})
            for signer, rec in records.items():
                seq = theirs.get(rec.signer.tag, -1)
                if seq < rec.seq and (seq < 0 or not refresh.stands(since.get(signer), rec, seq, now_ms)):
                    if used + len(rec.wire) > budget:
                        return out
                    out.append(rec)
                    used += len(rec.wire)
        return out

    def digest_of(self, topic: str, budget: int = DIGEST_BUDGET_BYTES) -> dict[str, dict[bytes, int]]:
        """A pull's digest naming one topic: what this node holds of it, within
        ``budget`` bytes (a larger topic is listed in part: the answer then
        repeats some of what it holds, never leaves it without the rest)."""
        entries: dict[bytes, int] = {}
        used = 8 + len(topic.encode()) + _TOPIC_OVERHEAD
        held = self.topics.get(topic, {})
        if used + len(held) * (SIGNER_TAG_BYTES + _ENTRY_OVERHEAD) <= budget:  # all of it fits: no count kept
            return {topic: dict(self._tagged[topic].seqs) if topic in self._tagged else {}}
        for rec in held.values():
            used += SIGNER_TAG_BYTES + _ENTRY_OVERHEAD
            if used > budget:
                break
            entries[rec.signer.tag] = rec.seq
        return {topic: entries}

    def drop(self, topic: str) -> None:
        """Forget a topic (no longer followed)."""
        records = self.topics.pop(topic, {})
        self._since.pop(topic, None)
        self._tagged.pop(topic, None)
        self._count -= len(records)
        if topic in self._short:
            self._short_count -= self._short.pop(topic)

    def expire(self, now_ms: int) -> None:
        for topic in list(self.topics):
            records = self.topics[topic]
            gone = [s for s, r in records.items() if r.expires_at_ms <= now_ms]
            since = self._since.get(topic, {})
            for signer in gone:
                self._tagged[topic].drop(records.pop(signer))
                since.pop(signer, None)
                self._count -= 1
            if gone and topic in self._short:
                self._short[topic] -= len(gone)
                self._short_count -= len(gone)
                if not self._short[topic]:
                    del self._short[topic]
            if not records:
                del self.topics[topic]
                self._since.pop(topic, None)
                self._tagged.pop(topic, None)
        self._prune_buckets(now_ms)
