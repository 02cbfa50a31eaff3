"""engine/keepwarm.py: idle-priority threads that keep the CPUs awake for a
window after each step. What it buys is measured by bench/wan.py and
bench/idle.py (a CPU's sleep is the host's, not a unit test's); here: the
threads yield to everything (SCHED_IDLE), the window only grows, and off is off."""

from __future__ import annotations

import os

import pytest

from meshnet_p2p.engine.keepwarm import OFF, KeepWarm
from tests.swarm import meshnet_peer


def _idle_threads() -> list[int]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE:
                out.append(int(tid))
        except OSError:  # ended meanwhile
            pass
    return out


def test_its_threads_run_at_idle_priority():
    kw = KeepWarm(2, 0.05)
    s = kw.stats()
    assert s.threads >= 2 and s.idle_policy is True
    assert len(_idle_threads()) >= 2  # and they are this process's threads, at SCHED_IDLE


def test_a_touch_keeps_them_spinning_for_one_window_and_never_shortens_it():
    long, short = KeepWarm(1, 5.0), KeepWarm(1, 0.001)
    try:
        long.touch()
        assert 4.0 < long.remaining_s() <= 5.0
        short.touch()  # a shorter window from now does not cut the longer one short
        assert long.remaining_s() > 4.0
        long.stop()
        assert long.remaining_s() == 0.0
    finally:
        long.stop()


def test_off_does_nothing():
    for kw in (OFF, KeepWarm(0, 1.0), KeepWarm(4, 0.0)):
        assert not kw.on
        kw.touch()
        kw.stop()
        assert kw.remaining_s() == 0.0
        assert kw.stats().threads == 0


def test_negative_settings_are_refused():
    with pytest.raises(ValueError):
        KeepWarm(-1, 1.0)
    with pytest.raises(ValueError):
        KeepWarm(1, -0.5)


@pytest.mark.parametrize("command", [["serve", "--layers", "0:10"], ["join", "--bootstrap", "/ip4/127.0.0.1/udp/9"]])
@pytest.mark.parametrize("value,needle", [("-5", "0 or more"), ("x", "not a whole number")])
def test_a_bad_keep_warm_flag_is_one_clear_error(command, value, needle):
    r = meshnet_peer(*command, "--keep-warm", value, timeout=120)
    assert r.returncode == 2 and "--keep-warm" in r.stderr and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
