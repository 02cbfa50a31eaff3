"""Per-session protocol state of the Session stream, as a pure state machine.

Decides, for each incoming step, whether it may reach the engine: cancelled
work, a stale route epoch, an expired deadline, a repeated idempotency step
(acknowledged, never applied twice) and exhausted flow-control credit are all
refused here, before any shard state changes. Cancels may arrive before the
session is opened (an out-of-band Cancel racing its SessionOpen) and are
remembered, so the session fails closed when it does open.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from meshnet_p2p.trust.attestation import SEAM_DOMAIN, RowDigest
from meshnet_p2p.trust.commitment import GENESIS


class Verdict(str, Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"
    CANCELLED = "cancelled"
    EPOCH_STALE = "epoch-stale"
    DEADLINE = "deadline"
    NO_CREDIT = "no-credit"
    NOT_OPEN = "not-open"


@dataclass
class SessionState:
    session_id: str
    epoch: int = 0
    credits: int = 0
    max_credits: int = 0
    opened: bool = False
    cancelled: bool = False  # the whole session
    cancelled_work: set[str] = field(default_factory=set)
    last_step: int = -1  # highest idempotency step applied
    running: str | None = None  # work id of the step in the engine now
    # What this session computed, for a signed attestation (trust/attestation.py):
    # running digests of every applied step's input and output.
    inputs: RowDigest = field(default_factory=lambda: RowDigest(SEAM_DOMAIN))
    outputs: RowDigest = field(default_factory=lambda: RowDigest(SEAM_DOMAIN))
    steps_done: int = 0
    # Its chain of signed step commitments (trust/commitment.py): per step, the position
    # the session reached and the commitment's link. A rollback drops the steps past it.
    chain: list[tuple[int, bytes]] = field(default_factory=list)
    last_active_ms: int = 0  # when it last sent anything (idle sessions are released)

    def open(self, epoch: int, credits: int) -> None:
        self.opened = True
        self.epoch = epoch
        self.credits = self.max_credits = credits

    def check_step(self, work_id: str, step: int, epoch: int, deadline_ms: int, now_ms: int) -> Verdict:
        if not self.opened:
            return Verdict.NOT_OPEN
        if self.cancelled or work_id in self.cancelled_work:
            return Verdict.CANCELLED
        if epoch < self.epoch:
            return Verdict.EPOCH_STALE
        if deadline_ms and now_ms > deadline_ms:
            return Verdict.DEADLINE
        if step <= self.last_step:
            return Verdict.DUPLICATE
        if self.credits <= 0:
            return Verdict.NO_CREDIT
        return Verdict.APPLY

    def check_rollback(self, epoch: int) -> Verdict:
        """A rollback rewinds the shard's cache: only for an open, live session, from the current route."""
        if not self.opened:
            return Verdict.NOT_OPEN
        if self.cancelled:
            return Verdict.CANCELLED
        if epoch < self.epoch:
            return Verdict.EPOCH_STALE
        return Verdict.APPLY

    def rolled_back(self, epoch: int, position: int) -> None:
        """A rollback from a newer route (a ring's failover) makes its steps new
        again: ring steps are numbered by position (idempotency step = position + 1)."""
        if epoch > self.epoch:
            self.last_step = min(self.last_step, position)
        self.epoch = max(self.epoch, epoch)
        while self.chain and self.chain[-1][0] > position:  # the chain resumes from the last step kept
            self.chain.pop()

    def chain_head(self) -> tuple[int, bytes]:
        """(index, prev) of the session's next commitment."""
        return len(self.chain), (self.chain[-1][1] if self.chain else GENESIS)

    def chained(self, position_after: int, link: bytes) -> None:
        self.chain.append((position_after, link))

    def applied(self, step: int, epoch: int) -> None:
        """A step reached the engine (whatever its outcome): spend a credit, remember it."""
        self.last_step = max(self.last_step, step)
        self.credits -= 1
        self.epoch = max(self.epoch, epoch)

    def top_up(self, credits: int) -> int:
        self.credits = min(self.max_credits, self.credits + credits)
        return self.credits

    def cancel(self, work_id: str = "") -> bool:
        """Returns True if something newly became cancelled."""
        if not work_id:
            was, self.cancelled = self.cancelled, True
            return not was
        was = work_id in self.cancelled_work
        self.cancelled_work.add(work_id)
        return not was
