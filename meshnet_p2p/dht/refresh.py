"""When a peer's older copy of a signer's record may stand for the newer one, so
a pull's answer leaves the newer one out (pure functions of records).

Peers re-announce every 30 s and their reports live 120 s. Every reader of a
model's reports (swarm/view, status, the keeper, fraud) merges what gossip
brought with a fresh DHT get, which has the homes' newest load figures; so a
follower needs a co-volunteer's refresh (the same report re-signed, its load
figures aside) only to keep its copy alive. Sending every refresh to every
follower was the traffic a node that grew with the swarm (docs/scale.md).

Whoever holds a signer's record (gossip, or a key's home that stores it) keeps
``since``: the seq from which that signer's records all say what the held one
says, for as long a life, each sequenced by its issue time (signers set seq to
it). A peer's copy at a seq at or after ``since`` then says the same, and its
seq tells when it ends: the newer record is left out of a pull's answer unless
it adds a minute to that copy's life or the copy is near its end. A signer
whose seqs are not its issue times starts a new run with every record, so its
refreshes are all sent, as before.
"""

from __future__ import annotations

from typing import Any

from meshnet_p2p.core.records import Record

# A refresh is sent when it adds at least this to the asker's copy's life: two
# re-announcements (30 s apart). Sent for less, a copy of a follower's that was itself
# old replaced an old copy, soon old enough to be replaced again: at 1,000 simulated
# peers a rule of "the asker's copy has under 60 s left" cut the refreshes pulled by 6 %.
REFRESH_GAIN_MS = 60_000
# ... or when the asker's copy has less than this left (a quarter of a report's 120 s,
# dozens of pulls): whatever the gain, it is not left to run out.
REFRESH_MARGIN_MS = 30_000


def _same_but(a: Any, b: Any, volatile: frozenset[str]) -> bool:
    """Whether two records' contents are equal but for the ``volatile`` fields."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a == b
    keys = (a.keys() | b.keys()) - volatile
    return all(a.get(k) == b.get(k) for k in keys) and all((k in a) == (k in b) for k in keys)


def same_but_load(a: Record, b: Record, volatile: frozenset[str]) -> bool:
    """Whether ``b`` says what ``a`` says, its ``volatile`` (load) fields aside."""
    return _same_but(a.content, b.content, volatile)


def since_after(held: Record | None, since: int | None, record: Record, volatile: frozenset[str] = frozenset(),
                *, same: bool | None = None) -> int:
    """The ``since`` of ``record``, which replaces ``held`` (of its signer, its
    ``since`` then as given; None: none held). ``same``: whether it says what
    ``held`` says, if the caller has asked (:func:`same_but_load`); else asked
    here, and only when the rest would make it a refresh."""
    timed = record.seq == record.issued_at_ms
    if (timed and held is not None and since is not None
            and record.expires_at_ms - record.issued_at_ms == held.expires_at_ms - held.issued_at_ms
            and (same if same is not None else same_but_load(held, record, volatile))):
        return since  # a refresh: the run goes on
    return record.seq if timed else record.seq + 1  # a copy older than this one never stands for it


def stands(since: int | None, record: Record, theirs: int, now_ms: int) -> bool:
    """Whether a copy at seq ``theirs`` (older than ``record``, whose ``since`` is
    given: None, not known) says what ``record`` says, for as long, ends less than
    REFRESH_GAIN_MS before it (seqs are issue times within a run), and lives more
    than REFRESH_MARGIN_MS on."""
    if since is None or theirs < since or record.seq - theirs >= REFRESH_GAIN_MS:
        return False
    return theirs + (record.expires_at_ms - record.issued_at_ms) - now_ms > REFRESH_MARGIN_MS
