"""The hidden states bench/hop_ab.py steps, made alike in both trees' workers.

Depends only on numpy and engine.contract, which every layout has had, so a
worker running an older tree can import it."""

from __future__ import annotations

import numpy as np

from meshnet_p2p.engine.contract import HIDDEN, Tensor, TensorBundle


def hidden_states(n: int, n_embd: int) -> list[TensorBundle]:
    rng = np.random.default_rng(0)  # every worker makes the same ones
    return [TensorBundle((Tensor(HIDDEN, "f32", (1, n_embd), (rng.standard_normal((1, n_embd)) * 0.1)
                                 .astype(np.float32).tobytes()),)) for _ in range(n)]
