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


def test_off_a_terminal_each_phase_says_when_it_ends_and_little_while_it_lasts():
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
    assert lines == [
        "preparing the shard: hashing 40% of 98 MB",  # a long phase: a line every 10 s...
        "preparing the shard: hashing 80% of 98 MB",
        "preparing the shard: hashing 100% of 98 MB in 25.0 s",  # ...and its end
        "preparing the shard: loading 100% in 0.0 s",  # a short one: its end only
    ]
    assert PLAIN_EVERY_S == 10.0


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


def test_a_status_line_stays_at_the_bottom_and_other_lines_print_above_it():
    from meshnet_p2p.progress import StatusLine

    out, printed = Tty(), []
    status = StatusLine(out)
    say = status.wrap(lambda line: (printed.append(line), out.write(line + "\n")))
    status.update("3 sessions")
    say("session abc opened")
    assert printed == ["session abc opened"]
    assert out.getvalue() == "\r\x1b[K3 sessions" + "\r\x1b[K" + "session abc opened\n" + "3 sessions"
    quiet = StatusLine(io.StringIO())  # off a terminal: nothing but the ordinary lines
    quiet.update("3 sessions")
    assert quiet.wrap(print) is print and quiet.stream.getvalue() == ""


def test_join_on_a_terminal_shows_its_progress_and_a_live_status_line(tmp_path):
    """A real `join` under a pseudo-terminal: a progress bar redrawn in place
    while it prepares its shard, then one status line: sessions, tok/s, peers."""
    import os
    import pty
    import select
    import signal
    import subprocess
    import sys
    import time

    from meshnet_p2p.peer_process import PeerProcess

    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)}  # a fresh cache: it cuts its shard here
    boot = PeerProcess("bootstrap", "--listen", "127.0.0.1:0", env=env)
    master, slave = pty.openpty()
    join = None
    try:
        join = subprocess.Popen([sys.executable, "-m", "meshnet_p2p", "join", "--layers", "0:10", "--listen",
                                 "127.0.0.1:0", "--threads", "1", "--bootstrap", boot.address(60)],
                                stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        seen, deadline = b"", time.monotonic() + 180
        while b"peers seen" not in seen and time.monotonic() < deadline and join.poll() is None:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    seen += os.read(master, 65536)
                except OSError:  # the other end closed
                    break
        text = seen.decode(errors="replace")
        assert "peers seen" in text and "| direct" in text and "sessions |" in text, text[-2000:]
        assert "preparing the shard: writing" in text and "preparing the shard: loading" in text  # bars...
        assert "\rpreparing the shard" in text  # ...redrawn in place
        assert "listening on " in text  # the ordinary lines still print, above the status line
    finally:
        if join is not None:
            join.send_signal(signal.SIGTERM)
            try:
                join.wait(timeout=60)
            except subprocess.TimeoutExpired:
                join.kill()
                join.wait(timeout=30)
        os.close(master)
        boot.stop()
