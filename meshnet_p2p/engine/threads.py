"""How many threads a small llama_decode runs on, chosen by what each count cost before.

Why: llama.cpp's CPU backend splits every pass over a team of threads (OpenMP)
that sleeps between passes. A hop of a route over links idles for the rest of
the ring's period between its steps, and where waking a sleeping CPU is slow
(a VM whose idle vCPUs halt into the hypervisor) a step after idle is faster
on fewer threads, while back to back it is faster on all of them: on this
project's 2-vCPU VM (2026-12-04, bench/idle.py, a 10-layer shard) 2.5 ms on
two threads back to back, 11.3 ms on two after 20 ms idle, 4.4 ms on one.
On a machine whose CPUs wake fast the full team wins everywhere. Which holds
is the machine's, so it is measured, not assumed: for each kind of pass (how
long the engine sat idle before it, bucketed, and how many rows it carries)
a running cost per thread count; the cheapest is chosen, and every other is
tried now and then (its cost then is what that pass took) so a change of
conditions is seen within a few dozen passes, while one slow pass of the count
in use does not turn the choice.

Exactness: a row's result does not depend on the thread count (ggml gives each
output element's dot product to one thread; tests/test_engine_threads.py
checks bit identity on real weights), so this is a choice of speed only.

Pure: the engine passes in the gap and the time each pass took.
"""

from __future__ import annotations

import bisect
from collections import Counter

GAP_EDGES_S = (0.001, 0.004, 0.016, 0.064)  # idle before a pass: <1 ms, <4, <16, <64, longer
SMALL_PASS_ROWS = 4  # larger passes compute long enough that a wake-up is noise: every thread
EXPLORE_EVERY = 32  # of a kind's passes, one tries a count other than the cheapest (it may cost a wake-up: ~7 ms here)
ALPHA = 0.25  # weight of a new measurement in a running cost


def thread_counts(max_threads: int) -> tuple[int, ...]:
    """The counts worth trying: 1, the powers of two below ``max_threads``, and it."""
    counts = {1, max_threads}
    k = 2
    while k < max_threads:
        counts.add(k)
        k *= 2
    return tuple(sorted(counts))


def gap_bucket(gap_s: float) -> int:
    return bisect.bisect_right(GAP_EDGES_S, gap_s)


class ThreadChooser:
    """Per pass, a thread count in ``thread_counts(max_threads)``."""

    def __init__(self, max_threads: int, *, explore_every: int = EXPLORE_EVERY) -> None:
        if max_threads < 1 or explore_every < 2:
            raise ValueError("max_threads must be positive and explore_every at least 2")
        self.max_threads = max_threads
        self.counts = thread_counts(max_threads)
        self.explore_every = explore_every
        self._cost: dict[tuple[int, int, int], float] = {}  # (gap bucket, rows, threads) -> seconds
        self._passes: Counter = Counter()  # (gap bucket, rows) -> passes chosen for
        self._trying: tuple[int, int, int] | None = None  # the key of a pass on a count not the cheapest

    def _chooses(self, rows: int) -> bool:
        """Whether a pass of ``rows`` has a choice: small, with more than one count to try."""
        return rows <= SMALL_PASS_ROWS and len(self.counts) > 1

    def choose(self, gap_s: float, rows: int) -> int:
        self._trying = None  # (a tried pass whose time never came, e.g. cut short, is forgotten)
        if not self._chooses(rows):
            return self.max_threads
        kind = (gap_bucket(gap_s), rows)
        n = self._passes[kind]
        self._passes[kind] += 1
        for count in reversed(self.counts):  # each count measured once first, the whole team first
            if (*kind, count) not in self._cost:
                return count
        best = min(self.counts, key=lambda c: self._cost[(*kind, c)])
        if n % self.explore_every == self.explore_every - 1:
            others = [c for c in self.counts if c != best]
            self._trying = (*kind, others[(n // self.explore_every) % len(others)])
            return self._trying[-1]
        return best

    def observe(self, gap_s: float, rows: int, threads: int, took_s: float) -> None:
        """What a pass ``choose`` was asked about cost on ``threads`` threads."""
        if not self._chooses(rows):
            return
        key = (gap_bucket(gap_s), rows, threads)
        old = self._cost.get(key)
        if old is None or key == self._trying:  # a count tried now and then: its old cost is stale
            self._cost[key] = took_s
        else:  # the count in use: smoothed (one slow pass does not turn the choice)
            self._cost[key] = old + ALPHA * (took_s - old)
        self._trying = None


class FixedThreads:
    """Every pass on every thread (``--fixed-threads``)."""

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads

    def choose(self, gap_s: float, rows: int) -> int:
        return self.max_threads

    def observe(self, gap_s: float, rows: int, threads: int, took_s: float) -> None:
        pass
