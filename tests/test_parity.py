"""A chain of shards computes exactly what the whole model computes."""

import numpy as np
import pytest

from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.route.local import LocalRoute

from tests.conftest import N_UBATCH
from tests.reference import reference_generate

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    # longer than one micro-batch (N_UBATCH tokens), so prefill spans several
    "In a quiet village by the mountains there lived an old clockmaker who repaired every clock "
    "in the valley, and every evening he wound the great clock in the square before walking home "
    "along the river, counting the lanterns as they were lit one by one. The children of the "
    "village followed him, asking about the gears and springs, and he told them each clock had "
    "a heart that needed patience more than it needed oil.",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return Tokenizer(model_path)


@pytest.fixture(scope="module")
def references(model_path, tokenizer):
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        out[prompt] = (ids, *reference_generate(model_path, ids, MAX_TOKENS, n_ubatch=N_UBATCH))
    return out


def test_long_prompt_spans_several_micro_batches(references):
    assert len(references[PROMPTS[2]][0]) > 2 * N_UBATCH


@pytest.mark.parametrize("split", [[(0, 15), (15, 30)], [(0, 10), (10, 20), (20, 30)]], ids=["2-shards", "3-shards"])
def test_chain_matches_whole_model_exactly(split, shard_dir, load_engine, references):
    engines = [load_engine(shard_dir[r]) for r in split]
    engines[-1].keep_logits = True
    route = LocalRoute(engines)
    for prompt in PROMPTS:
        ids, ref_tokens, ref_logits = references[prompt]
        step_logits = []
        orig = engines[-1]._sample

        def spy(s, logits, position, _orig=orig, _out=step_logits):
            _out.append(logits.copy())
            return _orig(s, logits, position)

        engines[-1]._sample = spy
        try:
            gen = route.generate(ids, MAX_TOKENS, stop_at_eog=False)
        finally:
            engines[-1]._sample = orig
        assert gen.token_ids == ref_tokens, prompt
        assert len(step_logits) == MAX_TOKENS
        for mine, ref in zip(step_logits, ref_logits, strict=True):
            # bit-identical, not merely close
            assert mine.tobytes() == ref.tobytes()


def test_whole_model_engine_matches_reference(model_path, model_digest, load_engine, references):
    engine = load_engine(model_path, source_sha256=model_digest)
    route = LocalRoute([engine])
    ids, ref_tokens, _ = references[PROMPTS[2]]
    assert route.generate(ids, MAX_TOKENS, stop_at_eog=False).token_ids == ref_tokens


def test_half_precision_seam_is_a_different_recipe(shard_dir, load_engine):
    a = load_engine(shard_dir[(0, 15)], seam_dtype="f16")
    b = load_engine(shard_dir[(15, 30)])
    assert a.capabilities().recipe_digest != b.capabilities().recipe_digest
    with pytest.raises(Exception, match="disagree"):
        LocalRoute([a, b])


def test_reference_is_sensitive_to_micro_batch_split(model_path, references):
    """Guards the test itself: llama.cpp's numbers do depend on how rows are
    split into micro-batches (here: one row at a time vs N_UBATCH), so parity
    at one split is a real constraint, not a tautology."""
    ids, _, ref_logits = references[PROMPTS[2]]
    _, other = reference_generate(model_path, ids, 1, n_ubatch=1)
    assert other[0].tobytes() != ref_logits[0].tobytes()
    assert np.abs(other[0] - ref_logits[0]).max() < 5.0
