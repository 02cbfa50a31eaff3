"""Token sampling at the tail, as a pure function of (logits, params, position).

The random draw for position p is derived from (seed, p) alone, not from a
generator that advances: a step replayed after a rollback, or re-run on a
different tail after a failover, samples exactly the token the original run
would have. Greedy is argmax with the lowest index winning ties, as llama.cpp's
greedy sampler does.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from .contract import SamplingParams


def uniform_for(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) fixed by (seed, position)."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed, position), digest_size=8, person=b"meshnet-sample").digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / params.temperature
    n = x.shape[0]
    if 0 < params.top_k < n:
        # The k largest, ties at the boundary going to the lowest token ids, so the
        # candidate set never depends on the partition algorithm's whims.
        kth = np.partition(x, n - params.top_k)[n - params.top_k]
        above = np.flatnonzero(x > kth)
        tied = np.flatnonzero(x == kth)[: params.top_k - len(above)]
        candidates = np.concatenate([above, tied])
    else:
        candidates = np.arange(n)
    # Highest logit first; ties broken by token id so the order is total.
    order = candidates[np.lexsort((candidates, -x[candidates]))]
    z = x[order]
    p = np.exp(z - z[0])
    p /= p.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(p)
        keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        order, p = order[:keep], p[:keep]
        p = p / p.sum()
    u = uniform_for(params.seed, position)
    idx = int(np.searchsorted(np.cumsum(p), u, side="right"))
    return int(order[min(idx, len(order) - 1)])
