"""Plain counters and fixed-bucket histograms that the engine, the DHT and the
data plane keep, and the role-level metrics module (metrics.py) reads.

No third-party import here: the lower layers count without knowing of
Prometheus, and a scrape only reads a snapshot. Both types take a lock of
their own, so the data plane's handler threads may count at once; it is a
leaf lock (nothing else is taken under it), so holding another lock while
counting is safe.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass
from typing import Iterable, Sequence

# Upper bounds (seconds) for one step on one peer: ~10 ms is a decode step of the
# whole embedded model here, a long prefill takes seconds.
STEP_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A DHT lookup: tens of ms on a LAN, up to seconds when nodes are frozen (docs/dht.md)
LOOKUP_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Rows per llama_decode: a decode step is one row, a prefill chunk up to n_ubatch
BATCH_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Counters:
    """Named counts, thread-safe. Callers use a small fixed set of names (strings, or
    tuples of strings when a count has several labels)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(names, 0)  # present from the start: a scrape shows 0

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]  # upper bounds, ascending (the +Inf bucket is implied)
    counts: tuple[int, ...]  # per bucket, not cumulative; one more than bounds (the last: above every bound)
    total: float  # sum of the observed values

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it), the last bound +Inf: Prometheus' bucket form."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append((bound, running))
        return out


class Histogram:
    """Observations counted under fixed upper bounds, with their sum."""

    def __init__(self, bounds: Sequence[float]) -> None:
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram bounds must be distinct and ascending")
        self.bounds = tuple(float(b) for b in bounds)
        self._lock = threading.Lock()
        self._counts = [0] * (len(self.bounds) + 1)
        self._total = 0.0

    def observe(self, value: float) -> None:
        i = bisect_left(self.bounds, value)  # the first bound >= value: Prometheus' "le"
        with self._lock:
            self._counts[i] += 1
            self._total += value

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            return HistogramSnapshot(self.bounds, tuple(self._counts), self._total)


# What a step's time is spent on, on one peer (dataplane/servicer.py measures them):
#   queue    the step's message decoded -> the engine starts it (the session's lock, checks, payload CRC)
#   compute  the engine's call: waiting to join a batched llama_decode, and the passes themselves
#   reply    the engine's result -> the reply built, the ring's copy sent and the output forwarded
#   total    the step's message decoded -> its reply written to the connection (or, fed by the
#            ring, its copy and forward sent)
STEP_PHASES = ("queue", "compute", "reply", "total")
STEP_KINDS = ("prefill", "decode")
# what became of the ring links clients asked for (docs/ring.md): linked; refused over the bounds per client
# and peer; refused for the report; not dialled, its target backing off; dialled and not reached; or refused
# by the next hop once it proved its identity
LINK_OUTCOMES = ("linked", "limited", "report_refused", "backing_off", "unreached", "next_hop_refused")


class ServingStats:
    """What a peer's ShardRuntime servicer counts. Labels are from small fixed
    sets (phases, step kinds, error code names), never a session or a peer."""

    def __init__(self) -> None:
        self.sessions = Counters(("opened", "released_idle", "reclaimed"))
        self.refused = Counters()  # session opens refused, by the ErrorCode name answered
        self.steps = Counters(STEP_KINDS)  # steps computed
        self.tokens = Counters(STEP_KINDS)  # the rows those steps carried in (token ids or hidden states)
        self.step_errors = Counters()  # steps answered with an error, by ErrorCode name
        self.step_seconds = {phase: Histogram(STEP_SECONDS) for phase in STEP_PHASES}
        self.links = Counters(LINK_OUTCOMES)


# A generation's first token, as a client waits for it: a route found and opened, the prompt prefilled
FIRST_TOKEN_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ClientStats:
    """What a Client counts over its generations (the api role exposes them)."""

    def __init__(self) -> None:
        self.generations = Counters(("completed", "failed"))  # by outcome
        self.tokens = Counters(("prompt", "generated"))  # of completed generations
        self.failovers = Counters(("failovers",))  # peers replaced mid-generation, whatever came of it
        self.first_token_seconds = Histogram(FIRST_TOKEN_SECONDS)
