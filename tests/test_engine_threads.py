"""A pass's thread count is a choice of speed only (engine/threads.py): the choice
follows what each count cost, and a row computes bit for bit alike on any count."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet_p2p.engine.contract import OpenRequest
from meshnet_p2p.engine.threads import EXPLORE_EVERY, SMALL_PASS_ROWS, FixedThreads, ThreadChooser, thread_counts
from meshnet_p2p.engine.tokenizer import Tokenizer

from tests.test_batching import _output, _run

# --- the choice, as data ----------------------------------------------------------------------


def _drive(chooser: ThreadChooser, cost, gap: float, passes: int, rows: int = 1) -> list[int]:
    """``passes`` passes after ``gap`` idle, each costing ``cost(threads)``: the counts chosen."""
    chosen = []
    for _ in range(passes):
        n = chooser.choose(gap, rows)
        chooser.observe(gap, rows, n, cost(n))
        chosen.append(n)
    return chosen


def test_the_counts_tried_are_one_the_powers_of_two_below_and_all():
    assert thread_counts(1) == (1,)
    assert thread_counts(2) == (1, 2)
    assert thread_counts(6) == (1, 2, 4, 6)
    assert thread_counts(8) == (1, 2, 4, 8)


def test_each_kind_of_pass_settles_on_its_own_cheapest_count():
    # A VM whose idle CPUs halt: two threads win back to back, one wins after idle.
    c = ThreadChooser(2)
    busy = _drive(c, {1: 0.0038, 2: 0.0025}.get, gap=0.0002, passes=64)
    idle = _drive(c, {1: 0.0044, 2: 0.0113}.get, gap=0.030, passes=64)
    assert busy[:2] == [2, 1] and idle[:2] == [2, 1]  # each count measured once, all threads first
    assert busy[2:].count(2) > 0.9 * 62
    assert idle[2:].count(1) > 0.9 * 62


def test_the_other_counts_are_tried_now_and_then_so_a_change_is_seen():
    c = ThreadChooser(2)
    cost = {1: 0.004, 2: 0.011}
    first = _drive(c, cost.get, gap=0.03, passes=4 * EXPLORE_EVERY)
    assert 2 in first[2:], "the dearer count was never tried again"
    cost.update({2: 0.002})  # the machine changed: the team wakes fast now
    then = _drive(c, cost.get, gap=0.03, passes=6 * EXPLORE_EVERY)
    assert then[-EXPLORE_EVERY:].count(2) >= EXPLORE_EVERY - 1


def test_large_passes_and_single_thread_engines_use_every_thread():
    c = ThreadChooser(4)
    assert _drive(c, lambda n: 1.0 / n, gap=1.0, passes=5, rows=SMALL_PASS_ROWS + 1) == [4] * 5
    assert _drive(ThreadChooser(1), lambda n: 1.0, gap=1.0, passes=5) == [1] * 5
    assert FixedThreads(3).choose(1.0, 1) == 3


def test_nonsense_is_refused():
    with pytest.raises(ValueError):
        ThreadChooser(0)
    with pytest.raises(ValueError):
        ThreadChooser(2, explore_every=1)


# --- the engine: any count, the same bits -----------------------------------------------------


class _Alternate:
    """Every pass on the other count: 1, 2, 1, ... (whatever the rows)."""

    max_threads = 2

    def __init__(self) -> None:
        self.chosen: list[int] = []

    def choose(self, gap_s: float, rows: int) -> int:
        self.chosen.append(1 + len(self.chosen) % 2)
        return self.chosen[-1]

    def observe(self, *args) -> None:
        pass


def _steps(engine, feeds: list, decodes: int):
    """A prompt (``feeds[0]``) and ``decodes`` decode steps fed ``feeds[1:]``: the outputs,
    with a tail's logits."""
    assert engine.open_session(OpenRequest("s", 256)).ok
    out, position = [], 0
    for k, given in enumerate(feeds[: 1 + decodes]):
        r = _run(engine, "s", position, given, decode=k > 0)
        got = _output(r)
        logits = engine.last_logits.get("s")  # a tail's (kept: keep_logits)
        out.append((got if isinstance(got, int) else got.tobytes(), None if logits is None else logits.tobytes()))
        position += 1 if k else len(given)
    return out


@pytest.mark.parametrize("span", [(0, 10), (10, 20), (20, 30)], ids=["head", "middle", "tail"])
def test_a_step_computes_the_same_bits_on_one_thread_or_two(span, shard_dir, model_path, load_engine):
    fixed = load_engine(shard_dir[span], n_threads=2, choose_threads=False)
    mixed = load_engine(shard_dir[span], n_threads=2)
    alternate = mixed.thread_chooser = _Alternate()
    assert isinstance(fixed.thread_chooser, FixedThreads)
    fixed.keep_logits = mixed.keep_logits = True
    decodes = 8
    if span[0] == 0:  # a head takes token ids (a prompt over two micro-batches, then one token a step)
        ids = Tokenizer(model_path).encode("The three primary colors are red, yellow and " * 8)
        feeds = [ids] + [[ids[k]] for k in range(decodes)]
    else:  # other hops take hidden states: any real-looking rows will do, the same for both
        rng = np.random.default_rng(7)
        feeds = [rng.standard_normal((40, 576), dtype=np.float32)]
        feeds += [rng.standard_normal((1, 576), dtype=np.float32) for _ in range(decodes)]
    assert _steps(mixed, feeds, decodes) == _steps(fixed, feeds, decodes)
    assert set(alternate.chosen) == {1, 2}
    assert mixed.metrics().fewer_thread_passes == alternate.chosen.count(1)


def test_gemma3_computes_the_same_bits_on_one_thread_or_two(gemma_path, load_engine):
    fixed = load_engine(gemma_path, n_threads=2, choose_threads=False)
    mixed = load_engine(gemma_path, n_threads=2)
    mixed.thread_chooser = _Alternate()
    fixed.keep_logits = mixed.keep_logits = True
    ids = Tokenizer(gemma_path).encode("In a quiet village by the mountains there lived an old clockmaker " * 3)
    feeds = [ids] + [[ids[k]] for k in range(6)]
    assert _steps(mixed, feeds, 6) == _steps(fixed, feeds, 6)


def test_the_flags_choose_by_default_and_fixed_threads_turns_it_off():
    import argparse

    from meshnet_p2p.roles.flags import add_engine_flags, engine_options

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_options(p.parse_args(["--threads", "2"])).choose_threads is True
    fixed = engine_options(p.parse_args(["--threads", "2", "--fixed-threads"]))
    assert fixed.choose_threads is False
    assert fixed.load_request("x.gguf").choose_threads is False
