"""The answer one request waits for.

A request of the DHT waits for one datagram, its answer, or its timeout. A trio
memory channel per request did this with four objects and a checkpoint on
each side; at thousands of requests a second (a simulated swarm, a busy
bootstrap peer) trio's channel code was ~9 % of the CPU, these channels and a
simulated host's socket together (docs/scale.md). This is the least that is
needed: the first answer is kept and wakes the waiting task, any later one is
dropped, and a cancelled wait (the request's timeout) leaves nothing behind.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import outcome
import trio

T = TypeVar("T")


class Pending(Generic[T]):
    __slots__ = ("answer", "_task")

    def __init__(self) -> None:
        self.answer: T | None = None
        self._task: trio.lowlevel.Task | None = None

    def set(self, answer: T) -> bool:
        """Keep ``answer`` and wake the waiter, if it is the first; False if one came before."""
        if self.answer is not None:
            return False
        self.answer = answer
        if self._task is not None:
            task, self._task = self._task, None
            trio.lowlevel.reschedule(task, outcome.Value(answer))
        return True

    async def wait(self) -> T:
        """The answer, once it comes (it may already have). One task waits at a time."""
        if self.answer is not None:
            await trio.lowlevel.checkpoint()
            return self.answer
        if self._task is not None:
            raise trio.BusyResourceError("another task already waits for this answer")
        self._task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._task = None
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)
