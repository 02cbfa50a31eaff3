"""Token buckets per source, as pure data: ``allow(source, now_ms)`` says whether
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


@dataclass
class SourceRates:
    rate_per_s: float
    burst: float
    max_sources: int = 16_384
    _buckets: OrderedDict[Any, tuple[float, int]] = field(default_factory=OrderedDict)  # source -> (tokens, at)

    def allow(self, source: Any, now_ms: int) -> bool:
        tokens, at = self._buckets.pop(source, (self.burst, now_ms))
        tokens = min(self.burst, tokens + max(0, now_ms - at) / 1000 * self.rate_per_s)
        ok = tokens >= 1
        self._buckets[source] = (tokens - 1 if ok else tokens, now_ms)  # (most recently used last)
        while len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)
        return ok

    def __len__(self) -> int:
        return len(self._buckets)
