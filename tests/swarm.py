"""Helpers for tests that run a swarm of OS processes on loopback."""

import os
import signal
import subprocess
import sys
import tempfile
import threading


class Proc:
    """An OS process whose stdout lines are collected as they come."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen([sys.executable, "-m", "meshnet_p2p", *args], stdout=subprocess.PIPE,
                                  stderr=self.stderr, text=True, env=env)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self.changed:
                self.lines.append(line.strip())
                self.changed.notify_all()

    def wait_line(self, prefix: str, timeout: float = 120) -> str:
        with self.changed:
            ok = self.changed.wait_for(lambda: any(l.startswith(prefix) for l in self.lines) or self.p.poll() is not None, timeout)
            found = [l for l in self.lines if l.startswith(prefix)]
        if not (ok and found):
            self.stderr.seek(0)
            raise AssertionError(f"no {prefix!r} line: {self.lines}; stderr: {self.stderr.read()[-2000:]}")
        return found[0]

    @property
    def peer_id(self) -> str:
        return self.wait_line("listening on ").rsplit("/", 1)[1]

    def stop(self) -> int | None:
        if self.p.poll() is None:
            try:
                self.p.send_signal(signal.SIGCONT)
                self.p.send_signal(signal.SIGTERM)
                return self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.p.kill()
        return self.p.wait(timeout=30)


def start_swarm(tmp_path, spans, *extra):
    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)}  # shards cut for this test only
    boot = Proc("bootstrap", "--listen", "127.0.0.1:0", env=env)
    addr = boot.wait_line("listening on ").removeprefix("listening on ")
    joins = [Proc("join", "--layers", s, "--bootstrap", addr, "--threads", "1", *extra, env=env) for s in spans]
    try:
        for j in joins:
            j.wait_line("listening on ")
    except BaseException:
        for p in joins + [boot]:
            p.stop()
        raise
    return boot, addr, joins
