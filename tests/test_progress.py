"""Progress: a bar on a terminal; plain, sparse lines anywhere else."""

import io

from meshnet_p2p.roles.progress import PLAIN_EVERY_S, TerminalProgress


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
    from meshnet_p2p.roles.progress import StatusLine

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

    from meshnet_p2p.roles.peer_process import PeerProcess

    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)}  # a fresh cache: it cuts its shard here
    boot = PeerProcess("bootstrap", "--listen", "127.0.0.1:0", env=env)
    master, slave = pty.openpty()
    join = None
    try:
        join = subprocess.Popen([sys.executable, "-m", "meshnet_p2p", "join", "--layers", "0:10", "--listen",
                                 "127.0.0.1:0", "--threads", "1", "--bootstrap", boot.address(60), "--ephemeral-identity"],
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
        join.send_signal(signal.SIGTERM)  # it leaves as usual, the pty read all the while
        deadline = time.monotonic() + 60
        while join.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        assert join.wait(timeout=30) == 0
        assert seen.endswith(b"\r\x1b[K") or b"\r\x1b[K" in seen[-200:]  # it cleared its line as it left
    finally:
        if join is not None and join.poll() is None:
            join.kill()
            join.wait(timeout=30)
        os.close(master)
        boot.stop()


def test_the_same_phase_twice_is_two_runs():
    """Loading three shards through one progress: each load says it ended."""
    out, clock = io.StringIO(), Clock()
    p = TerminalProgress("preparing shards", out, clock=clock)
    for _ in range(3):
        for i in range(0, 1001, 250):
            clock.t += 0.5
            p("loading", i, 1000)
    assert out.getvalue().splitlines() == ["preparing shards: loading 100% in 2.0 s"] * 3


def test_the_status_line_is_whole_under_threads_and_quiet_once_the_terminal_goes():
    import threading

    from meshnet_p2p.roles.progress import StatusLine

    class Terminal(Tty):
        def __init__(self) -> None:
            super().__init__()
            self.gone = False

        def write(self, data):
            if self.gone:
                raise OSError(5, "Input/output error")
            for ch in data:  # one character at a time: an unlocked writer would interleave
                super().write(ch)
            return len(data)

    out = Terminal()
    status = StatusLine(out)
    say = status.wrap(lambda line: out.write(line + "\n"))
    status.update("STATUS")

    def printer(n):
        for i in range(50):
            say(f"line {n}-{i}")

    import sys

    threads = [threading.Thread(target=printer, args=(n,)) for n in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two characters, as they may on a busy machine
    try:
        for t in threads:
            t.start()
        for _ in range(50):
            status.update("STATUS")
        for t in threads:
            t.join(timeout=30)
    finally:
        sys.setswitchinterval(interval)
    # every printed line is whole, on its own line, after a clear: no status text glued to it
    # what a terminal shows of each line: the text after its last clear
    printed = [l.split("\r\x1b[K")[-1] for l in out.getvalue().split("\n") if "line " in l]
    assert sorted(printed) == sorted(f"line {n}-{i}" for n in range(4) for i in range(50))
    out.gone = True  # the terminal went away: no exception, and nothing more is tried
    status.update("STATUS")
    status.close()
    assert status.enabled is False and status.wrap(print) is print
