"""The whole model in one plain llama.cpp context: the oracle every route must match.

Deliberately independent of the engine under test: it uses llama.cpp the way
an ordinary program would (one context, the prompt in one llama_decode call
that llama.cpp splits into micro-batches itself, logits of the last row), with
only the micro-batch size and attention kernel pinned to the recipe's.
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from meshnet_p2p.engine.llama_native import ensure_backend


def reference_generate(model_path: str, prompt: list[int], max_tokens: int, *, n_ubatch: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and the logits they were chosen from, step by step."""
    ensure_backend()
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
    assert model
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 2048
    cp.n_batch = 2048
    cp.n_ubatch = n_ubatch
    cp.n_seq_max = 1
    cp.flash_attn_type = 0
    cp.n_threads = cp.n_threads_batch = 2
    ctx = llama_cpp.llama_init_from_model(model, cp)
    assert ctx
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(max(len(prompt), 1), 0, 1)
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    try:
        feed = list(prompt)
        pos = 0
        for _ in range(max_tokens):
            batch.n_tokens = len(feed)
            for i, t in enumerate(feed):
                batch.token[i] = t
                batch.pos[i] = pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = int(i == len(feed) - 1)
            assert llama_cpp.llama_decode(ctx, batch) == 0
            pos += len(feed)
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
            logits.append(row)
            tok = int(np.argmax(row))
            tokens.append(tok)
            feed = [tok]
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return tokens, logits
