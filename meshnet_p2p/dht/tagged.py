"""A topic's held records by their signer's tag, kept as records come and go.

A follower pulls a topic about once a second, naming every signer it holds by
tag with its seq (gossip's digest); the answerer sends what it holds newer.
Walking a topic's up to 256 records (and, at a key's home, merging the stored
ones with the gossiped) for every digest, and building each digest afresh,
was 16 % of a profile of a simulated 10,000-peer swarm (docs/scale.md). Kept
per topic instead: ``seqs`` ({tag: seq}) is a digest's whole topic, and the
records a digest does not name at their seq are found in one pass over the
topic's tags (and none when the digest names exactly what is held), so an answer
walks only those (usually few). Two signers of a topic sharing a
tag (one ground ~2**64 keys for it) are held here once: the other is not
offered by pull, as a digest could never name it apart.
"""

from __future__ import annotations

from meshnet_p2p.core.records import Record


class Tagged:
    __slots__ = ("seqs", "records")

    def __init__(self) -> None:
        self.seqs: dict[bytes, int] = {}  # signer tag -> the seq held (in the order first held)
        self.records: dict[bytes, Record] = {}  # signer tag -> the record held

    def put(self, record: Record) -> None:
        """``record`` is now its signer's held record (new, or in place of an older)."""
        t = record.signer.tag
        self.seqs[t] = record.seq
        self.records[t] = record

    def drop(self, record: Record) -> None:
        """``record`` is no longer held."""
        t = record.signer.tag
        if self.records.get(t) is record:
            del self.records[t], self.seqs[t]


def put_tagged(index: dict[str, Tagged], topic: str, record: Record) -> None:
    """``record`` is now its signer's held record of ``topic`` in ``index`` (a
    topic's index made with its first record, not per record as setdefault would)."""
    tagged = index.get(topic)
    if tagged is None:
        tagged = index[topic] = Tagged()
    tagged.put(record)


def unnamed(theirs: dict[bytes, int], *held: Tagged | None, named_only: bool = False) -> list[Record]:
    """The newest record of each tag over ``held`` whose (tag, seq) ``theirs`` (a
    digest's topic) does not name: every record an answer may owe it (newer than
    it holds, or of a signer it lacks), among some it does not (older than it holds:
    the caller compares); with ``named_only`` (an asker whose topic is full: it
    could hold no new signer) only of tags it names. In the order ``held`` holds
    them: the order each got its records (tag order would offer every asker the
    same signers first, and an asker with room for only some would hold the same
    part of a topic as every other)."""
    out: dict[bytes, Record] = {}
    held = tuple(h for h in held if h is not None)
    for h in held:
        if h.seqs == theirs:  # (a follower that holds what this source holds: nothing to walk)
            continue
        seqs = h.seqs
        # one pass in the order held, ~1.8x quicker here than a set difference of the items
        # (which makes a tuple of each item of both sides: 256 a side for a full topic)
        if named_only:
            differ = [t for t, s in seqs.items() if (q := theirs.get(t)) is not None and q != s]
        else:
            differ = [t for t, s in seqs.items() if theirs.get(t) != s]
        for t in differ:
            have = out.get(t)
            if have is None or have.seq < seqs[t]:
                out[t] = h.records[t]
    if len(held) < 2 or len(out) < 2:  # one source (every node but a key's home): found in the order it holds
        return list(out.values())
    return [out[t] for t in dict.fromkeys(t for h in held for t in h.seqs if t in out)]
