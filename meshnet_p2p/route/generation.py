"""The one generation loop: a prompt through a route in whole micro-batches,
then a token at a time, whatever the route is made of.

A route is anything with ``n_ubatch`` and ``step(position, token_ids, decode)``
returning the tail's reply (``token_id``, ``is_eog``): a chain of engines in
this process (local.py's LocalSession), a chain of peers the client drives
(star.py's StarRoute), and a ring of peers that forward to each other
(ring.py's RingRoute). They share this loop, so
the local baseline and the network run the same steps in the same order, and
a process that only drives a network route imports no llama.cpp engine here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

PREFILL_STEP_UBATCHES = 4  # a prefill step carries at most this many micro-batches


class Reply(Protocol):
    token_id: int
    is_eog: bool


class Route(Protocol):
    """One open session along a route (every layer), stepped by :func:`generate`."""

    n_ubatch: int

    def step(self, position: int, token_ids: Sequence[int], decode: bool) -> Reply: ...


def prefill_chunks(n_tokens: int, n_ubatch: int) -> list[tuple[int, int]]:
    """A prompt's prefill steps: whole micro-batches (the last may be short), so
    every shard splits the prompt at the boundaries the whole model would."""
    step = n_ubatch * PREFILL_STEP_UBATCHES
    return [(start, min(start + step, n_tokens)) for start in range(0, n_tokens, step)]


@dataclass
class Generation:
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    ttft_ms: float = 0.0  # prompt in, first token out
    decode_ms: float = 0.0  # every later token
    stopped: str = "length"  # "length" or "eog"
    # every step as (position, rows, the tail's token): what evidence of a run records
    steps: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / (self.decode_ms / 1000) if n > 0 and self.decode_ms > 0 else 0.0


def generate(route: Route, prompt: Sequence[int], max_tokens: int, *, stop_at_eog: bool = True,
             on_token: Callable[[int], None] | None = None) -> Generation:
    """Up to ``max_tokens`` tokens after ``prompt``, stopping early at an
    end-of-generation token (not included) when ``stop_at_eog``."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    gen = Generation(prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    reply = None
    for start, end in prefill_chunks(len(prompt), route.n_ubatch):
        reply = route.step(start, prompt[start:end], False)
        gen.steps.append((start, end - start, reply.token_id))
    t1 = time.perf_counter()
    gen.ttft_ms = (t1 - t0) * 1000
    position = len(prompt)
    while True:
        if reply.is_eog and stop_at_eog:
            gen.stopped = "eog"
            break
        gen.token_ids.append(reply.token_id)
        if on_token:
            on_token(reply.token_id)
        if len(gen.token_ids) >= max_tokens:
            break
        reply = route.step(position, (reply.token_id,), True)
        gen.steps.append((position, 1, reply.token_id))
        position += 1
    gen.decode_ms = (time.perf_counter() - t1) * 1000
    return gen
