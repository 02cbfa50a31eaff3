"""The answer one request waits for.

A request of the DHT waits for one datagram, its answer, or its timeout. A trio
memory channel per request did this with four objects and a checkpoint on
each side; at thousands of requests a second (a simulated swarm, a busy
bootstrap peer) trio's channel code was ~9 % of the CPU, these channels and a
simulated host's socket together (docs/scale.md). This is the least that is
needed: the first answer is kept and wakes the waiting task, any later one is
dropped, and a cancelled wait (the request's timeout) leaves nothing behind.
``Parked``, the one waiting task, is shared with the simulator's socket.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import outcome
import trio

T = TypeVar("T")


class Parked:
    """The one task parked on something (a request's answer, a simulated socket):
    ``park`` suspends the caller until ``wake`` hands it an outcome, and a
    cancelled park (a timeout) leaves nobody parked."""

    __slots__ = ("_task",)

    def __init__(self) -> None:
        self._task: trio.lowlevel.Task | None = None

    def wake(self, result: outcome.Outcome) -> bool:
        """Resume the parked task with ``result``; False if nobody is parked."""
        if self._task is None:
            return False
        task, self._task = self._task, None
        trio.lowlevel.reschedule(task, result)
        return True

    def wake_value(self, value: object) -> bool:
        """Resume the parked task with ``value``; False if nobody is parked. (Its
        outcome is made only for a task to take: most answers and simulated
        datagrams come while nobody waits.)"""
        return self._task is not None and self.wake(outcome.Value(value))

    async def park(self, busy: str):
        if self._task is not None:
            raise trio.BusyResourceError(busy)
        self._task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._task = None
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)


class Pending(Parked, Generic[T]):
    __slots__ = ("answer",)

    def __init__(self) -> None:
        super().__init__()
        self.answer: T | None = None

    def set(self, answer: T) -> bool:
        """Keep ``answer`` and wake the waiter, if it is the first; False if one came before."""
        if self.answer is not None:
            return False
        self.answer = answer
        self.wake_value(answer)
        return True

    async def wait(self) -> T:
        """The answer, once it comes (it may already have). One task waits at a time."""
        if self.answer is not None:
            await trio.lowlevel.checkpoint()
            return self.answer
        return await self.park("another task already waits for this answer")
