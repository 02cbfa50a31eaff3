"""Which rows go into the next llama_decode: continuous batching as a pure function.

Steps of different sessions that wait at the same time share a llama_decode,
within what keeps every session's numbers exactly those of the whole model
run alone (checked by tests/test_batching.py):

- A row computes the same in a batch as alone only if llama.cpp keeps it in a
  micro-batch of the same shape for its own sequence. With one KV stream per
  sequence (``kv_unified`` false) llama.cpp splits a batch "equally": a
  micro-batch holds the same number of rows of each sequence, and only
  sequences whose ids run consecutively (0, 1, 2, not 0, 2). So one pass is
  either one row each of a run of consecutive sequence ids (decode steps,
  and one-token prefills), or one micro-batch of one sequence's multi-row step,
  cut at the same n_ubatch boundaries (from the step's first row) as the
  reference cuts it. A pass never holds more than n_ubatch rows, so llama.cpp
  never splits it again.
- Fairness: each round runs every waiting single row (in runs), then one
  micro-batch of the oldest multi-row step. A long prompt therefore advances
  one micro-batch per round and never holds decodes back by more than one.

Data in, a plan out; the engine (llama_engine.py) runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Waiting:
    """A step waiting for compute: its sequence, its rows and how many are done."""

    key: int  # the engine's handle of the step (arrival order)
    seq_id: int
    rows: int
    done: int = 0


@dataclass(frozen=True)
class Pass:
    """One llama_decode: ``(key, first row, row count)`` per step in it, in row order."""

    parts: tuple[tuple[int, int, int], ...]

    @property
    def rows(self) -> int:
        return sum(n for _, _, n in self.parts)


def plan_round(waiting: Sequence[Waiting], n_ubatch: int) -> list[Pass]:
    """The passes of one round over what waits now (at most one step per sequence)."""
    seqs = [w.seq_id for w in waiting]
    if len(set(seqs)) != len(seqs):
        raise ValueError("one step per sequence at a time")
    singles = sorted((w for w in waiting if w.rows == 1 and w.done == 0), key=lambda w: w.seq_id)
    passes: list[Pass] = []
    run: list[Waiting] = []
    for w in singles:
        if run and (w.seq_id != run[-1].seq_id + 1 or len(run) == n_ubatch):
            passes.append(Pass(tuple((r.key, 0, 1) for r in run)))
            run = []
        run.append(w)
    if run:
        passes.append(Pass(tuple((r.key, 0, 1) for r in run)))
    multi = [w for w in waiting if w.rows > 1 and w.done < w.rows]
    if multi:
        w = min(multi, key=lambda w: w.key)  # the oldest: it runs one micro-batch each round
        passes.append(Pass(((w.key, w.done, min(n_ubatch, w.rows - w.done)),)))
    return passes
