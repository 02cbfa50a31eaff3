"""Token buckets, as pure data: the one rate limiter every layer uses.

:class:`TokenBucket` holds up to ``burst`` tokens and refills ``rate`` a second;
every method takes ``now`` from the caller's clock (seconds, or ticks with
``ticks_per_s``: 1000 for a clock in milliseconds), refills up to it, then
decides. A clock that steps back refills nothing.

:class:`SourceRates` keeps one per source: ``allow(source, now_ms)`` says whether
one more request from ``source`` is within ``burst`` at once and ``rate_per_s``
on average. At most ``max_sources`` buckets are kept: the least recently used
goes first (a forgotten source starts again with a full bucket, which is no
more than a new source gets), so the bookkeeping stays bounded whatever the
number of sources.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


class TokenBucket:
    """``burst`` tokens at once, ``rate`` a second on average. ``spend`` takes one if
    it is there; ``take`` takes a chunk, waiting for at most a burst of it; ``charge``
    takes one regardless, into debt (at most one burst), which ``debt_s`` measures."""

    __slots__ = ("tokens", "burst", "rate", "at", "ticks_per_s")

    def __init__(self, burst: float, rate: float, now: float, *, ticks_per_s: float = 1.0) -> None:
        self.tokens, self.burst, self.rate, self.at, self.ticks_per_s = float(burst), burst, rate, now, ticks_per_s

    def level(self, now: float) -> float:
        """Tokens there at ``now`` (negative: in debt)."""
        return min(self.burst, self.tokens + max(0, now - self.at) / self.ticks_per_s * self.rate)

    def _refill(self, now: float) -> None:
        self.tokens, self.at = self.level(now), now

    def spend(self, now: float) -> bool:
        """Take one token if there is one; whether it was taken."""
        self._refill(now)
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def take(self, now: float, n: float) -> float:
        """Take ``n`` tokens once ``min(n, burst)`` are there (a chunk larger than a
        burst runs into debt rather than waiting for ever): 0.0 when taken, else the
        seconds until they are there (then ask again)."""
        self._refill(now)
        need = min(n, self.burst)
        if self.tokens >= need:
            self.tokens -= n
            return 0.0
        return (need - self.tokens) / self.rate

    def charge(self, now: float) -> None:
        """Spend one even without it: the debt (at most one burst) is paid back first."""
        self.tokens, self.at = max(-self.burst, self.level(now) - 1), now

    def debt_s(self, now: float) -> float:
        """Seconds until the bucket is out of debt (0 if it is not in debt)."""
        return max(0.0, -self.level(now) / self.rate)


@dataclass
class SourceRates:
    rate_per_s: float
    burst: float
    max_sources: int = 16_384
    _buckets: OrderedDict[Any, TokenBucket] = field(default_factory=OrderedDict)

    def allow(self, source: Any, now_ms: int) -> bool:
        bucket = self._buckets.pop(source, None) or TokenBucket(self.burst, self.rate_per_s, now_ms, ticks_per_s=1000)
        self._buckets[source] = bucket  # (most recently used last)
        while len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)
        return bucket.spend(now_ms)

    def __len__(self) -> int:
        return len(self._buckets)
