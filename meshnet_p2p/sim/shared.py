"""A record checked once for the whole simulated swarm, not once per node.

In a swarm every node checks each record it takes in: a volunteer's
re-announcement reaches its ~20 homes and every follower of its model, each of
which unpacks it, checks its signature, its canonical encoding and its content.
In a simulation those nodes share one process, and at 10,000 peers the same
bytes were checked ~1,400 times over (13 % of the wall time), each check making
its own copy of the record (most of a node's memory: docs/scale.md).

While ``shared_record_checks`` is active, :meth:`RecordVerifier.checked` (the
part of a record's check that is a pure function of its bytes and the
verifier's types) answers from a table of the records it already passed, and
hands every node the same immutable :class:`Record`. What depends on the node
(the clock, the sequence numbers it saw) is still checked by each, and a record
that fails is checked afresh every time: a node accepts or refuses exactly what
it would without the table. As with ``stand_in_signatures``, what the check cost
is not the behaviour under study. (The simulator's process only.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from meshnet_p2p.core.records import Record, RecordVerifier

# Records passed, kept until they expire; swept when the table has doubled since the last sweep.
_MIN_SWEEP = 4096


@contextlib.contextmanager
def shared_record_checks(now_ms: Callable[[], int]) -> Iterator[dict]:
    """``now_ms``: the simulation's clock, to forget expired records. Yields the table
    ({(types id, wire): record}) for tests to look at."""
    passed: dict[tuple[int, bytes], Record] = {}
    types_seen: dict[int, Any] = {}  # kept alive: an id is only unique while its object lives
    sweep_at = _MIN_SWEEP
    real_checked = RecordVerifier.checked

    def checked(self: RecordVerifier, wire: bytes, unpacked: tuple[list, Any] | None = None) -> Record:
        nonlocal sweep_at
        key = (id(self.types), bytes(wire))
        record = passed.get(key)
        if record is not None:
            return record
        record = real_checked(self, wire, unpacked)  # raises for a record that fails: nothing kept
        types_seen.setdefault(id(self.types), self.types)
        passed[key] = record
        if len(passed) >= sweep_at:
            now = now_ms()
            for k in [k for k, r in passed.items() if r.expires_at_ms <= now]:
                del passed[k]
            sweep_at = max(_MIN_SWEEP, 2 * len(passed))
        return record

    RecordVerifier.checked = checked
    try:
        yield passed
    finally:
        RecordVerifier.checked = real_checked
