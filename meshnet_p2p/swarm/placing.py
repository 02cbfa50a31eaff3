"""``join --layers auto``'s evidence: which capability reports to count before
choosing a span (placement.choose_span).

A report's layers, rate and address cost nothing to claim. Counted as they
stand, ten identities claiming one slice at a high rate made every new
volunteer avoid that slice, and the model lost those layers (the simulator,
docs/scale.md). So placement counts a report only once its peer answered a dial
at the address the report names (``dial``: ``join`` passes a TLS handshake
bound to the peer's identity, straight or through its relay), and counts it in
the network it answered from, where placement.coverage bounds what one network
adds. The network call is passed in (the simulator passes its own).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Awaitable, Callable, Sequence

import trio

from meshnet_p2p.core.netgroup import network_of

from .placement import Span

PLACEMENT_DIALS = 64  # reports dialled at most: a uniform sample keeps the coverage's shape
PLACEMENT_DIALS_AT_ONCE = 16
PLACEMENT_DIAL_TIMEOUT_S = 5.0

# span -> the host it answered at (its own, or its relay's), or None
Dial = Callable[[Span], Awaitable["str | None"]]


async def answering_spans(spans: Sequence[Span], dial: Dial, *, limit: int = PLACEMENT_DIALS,
                          timeout: float = PLACEMENT_DIAL_TIMEOUT_S, rng: random.Random | None = None) -> list[Span]:
    """Those of ``spans`` (at most ``limit``, sampled uniformly) whose peer answered
    ``dial`` within ``timeout``, each with the network it answered from."""
    sample = list(spans) if len(spans) <= limit else (rng or random).sample(list(spans), limit)
    answered: list[Span] = []
    limiter = trio.CapacityLimiter(PLACEMENT_DIALS_AT_ONCE)

    async def one(span: Span) -> None:
        async with limiter:
            with trio.move_on_after(timeout):
                host = await dial(span)
                if host is not None:
                    answered.append(dataclasses.replace(span, network=network_of(host)))

    async with trio.open_nursery() as nursery:
        for span in sample:
            nursery.start_soon(one, span)
    return answered
