"""Progress: a bar on a terminal; plain, sparse lines anywhere else."""

import io

from meshnet_p2p.progress import PLAIN_EVERY_S, TerminalProgress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_each_phase_says_when_it_starts_and_ends_and_little_between():
    out, clock = io.StringIO(), Clock()
    p = TerminalProgress("preparing the shard", out, clock=clock)
    total = 98_000_000
    for i in range(0, 101):
        clock.t += 0.25  # 25 s of hashing in 100 reports
        p("hashing", total * i // 100, total)
    p("hashing", total, total)  # the end reported twice: shown once
    for i in range(0, 1001, 100):
        p("loading", i, 1000)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "preparing the shard: hashing 0% of 98 MB"
    assert lines[-3] == "preparing the shard: hashing 100% of 98 MB in 25.0 s"
    assert lines[-2:] == ["preparing the shard: loading 0%", "preparing the shard: loading 100% in 0.0 s"]
    between = lines[1:-3]
    assert len(between) == int(25 / PLAIN_EVERY_S)  # one line every 10 s of a long phase


def test_on_a_terminal_one_line_is_redrawn_in_place():
    out, clock = Tty(), Clock()
    p = TerminalProgress("layers 0:10", out, clock=clock)
    for i in range(0, 11):
        clock.t += 0.2
        p("cutting", i * 10, 100 * 10)
    text = out.getvalue()
    assert text.count("\n") == 0 and text.count("\r") == 11
    p("cutting", 1000, 1000)
    assert out.getvalue().endswith("100.0%\n")
