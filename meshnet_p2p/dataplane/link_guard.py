"""How often a peer dials for ring links, and what it will not dial again soon (docs/ring.md).

A link makes this peer open a TCP + TLS connection to the next hop a signed
report names; any identity can sign a report naming any address, so a link is
a dial a client asks for. Sessions are free to open and release, so the bounds
are over time, never per session:

- link attempts per client network, per client identity and per peer (token
  buckets, ``core.ratelimit.TokenBucket``): a client that asks for more is told so
  before anything is dialled;
- a target whose dial failed before it proved its TLS identity is not dialled
  again for a while (doubling on each new failure): a thousand links naming
  one victim cost it a handful of connections.

A pure core: the clock is passed in, nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from meshnet_p2p.core.ratelimit import TokenBucket


@dataclass(frozen=True)
class LinkBounds:
    # (burst, per second). A ring asks one link per hop per route and one per failover:
    # an honest client, even sixteen behind one NAT, stays far below these.
    per_network: tuple[int, float] = (64, 8.0)
    per_client: tuple[int, float] = (32, 4.0)
    per_peer: tuple[int, float] = (128, 16.0)
    backoff_s: float = 10.0  # a target that failed is left alone this long, doubling per failure...
    max_backoff_s: float = 300.0  # ...up to this
    max_tracked: int = 4096  # buckets and failed targets kept (each table), beyond which the oldest go


@dataclass
class _Failed:
    until: float  # not dialled before this
    wait_s: float  # the last backoff: the next failure doubles it
    forget_at: float  # after this a new failure starts from backoff_s again


class LinkGuard:
    def __init__(self, bounds: LinkBounds = LinkBounds()) -> None:
        self.bounds = bounds
        self._buckets: dict[tuple[str, str], TokenBucket] = {}  # per network, per client
        self._peer: TokenBucket | None = None  # this peer's own, over every client
        self._failed: dict[Hashable, _Failed] = {}

    def admit(self, network: str, client: str | None, now: float) -> bool:
        """Whether a link from ``client`` (its peer ID, None: anonymous) on ``network``
        (its source's host group) may be attempted now; if so it is counted."""
        b = self.bounds
        if self._peer is None:
            self._peer = TokenBucket(*b.per_peer, now)
        buckets = [self._bucket(("network", network), *b.per_network, now),
                   self._bucket(("client", client or f"anonymous@{network}"), *b.per_client, now), self._peer]
        if any(bucket.level(now) < 1 for bucket in buckets):
            return False
        for bucket in buckets:
            bucket.spend(now)
        return True

    def may_dial(self, target: Hashable, now: float) -> bool:
        """Whether ``target`` (what a dial connects to) is not backing off."""
        f = self._failed.get(target)
        return f is None or now >= f.until

    def failed(self, target: Hashable, now: float) -> None:
        """A dial to ``target`` failed before the next hop proved its identity."""
        b = self.bounds
        old = self._failed.pop(target, None)
        wait = b.backoff_s if old is None or now >= old.forget_at else min(b.max_backoff_s, 2 * old.wait_s)
        self._failed[target] = _Failed(now + wait, wait, now + 2 * wait)  # (re-inserted: newest last)
        if len(self._failed) > b.max_tracked:
            self._failed = {t: f for t, f in self._failed.items() if now < f.forget_at}
            while len(self._failed) > b.max_tracked:
                self._failed.pop(next(iter(self._failed)))

    def reached(self, target: Hashable) -> None:
        """A dial to ``target`` reached a peer that proved its identity: no backoff."""
        self._failed.pop(target, None)

    def _bucket(self, key: tuple[str, str], burst: int, rate: float, now: float) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.bounds.max_tracked:  # forget the ones that refilled: they hold nothing
                self._buckets = {k: v for k, v in self._buckets.items() if v.level(now) < v.burst}
                while len(self._buckets) >= self.bounds.max_tracked:
                    self._buckets.pop(next(iter(self._buckets)))
            bucket = self._buckets[key] = TokenBucket(burst, rate, now)
        return bucket
