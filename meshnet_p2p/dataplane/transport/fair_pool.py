"""Worker threads shared fairly between sources.

A peer's unary calls (Health, GetCapability, Cancel, Release) are cheap, so a
flood of them is cheap to send too. With one first-come queue, a source with
thousands of calls queued makes everyone else's wait behind them: a route's
GetCapability then times out and the route is lost (issue 12 #2). Here each
source has its own queue, bounded, and workers take one job from each source
in turn: a newcomer waits behind at most one job per other source.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable


class FairPool:
    def __init__(self, workers: int, *, per_source: int, name: str = "fair-pool") -> None:
        self.per_source = per_source
        self._cond = threading.Condition()
        self._queues: dict[str, deque[Callable[[], None]]] = {}
        self._turns: deque[str] = deque()  # sources with queued jobs, in the order they are served
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, source: str, job: Callable[[], None]) -> bool:
        """Queue ``job`` for ``source``; False if that source already has
        ``per_source`` jobs waiting. RuntimeError once shut down."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            queue = self._queues.get(source)
            if queue is None:
                queue = self._queues[source] = deque()
                self._turns.append(source)
            elif len(queue) >= self.per_source:
                return False
            queue.append(job)
            self._cond.notify()
            return True

    def queued(self, source: str) -> int:
        with self._cond:
            return len(self._queues.get(source, ()))

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._turns and not self._closed:
                    self._cond.wait()
                if not self._turns:
                    return  # shut down, and nothing left to run
                source = self._turns.popleft()
                queue = self._queues[source]
                job = queue.popleft()
                if queue:
                    self._turns.append(source)  # its next job waits for everyone else's turn
                else:
                    del self._queues[source]
            try:
                job()
            except BaseException:  # a job reports its own errors; a worker never dies of one
                pass

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new jobs; queued ones still run (each ends its call); join the workers."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait:
            for t in self._threads:
                t.join()
