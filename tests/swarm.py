"""Helpers for tests that run `meshnet-peer` as OS processes: one command to
completion, a long-running peer, a swarm of them on loopback."""

import os
import subprocess
import sys
import tempfile

from meshnet_p2p.peer_process import PeerProcess, Swarm


def meshnet_peer(*args: str, timeout: float = 300, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run one ``meshnet-peer`` command to completion, as a user would."""
    return subprocess.run([sys.executable, "-m", "meshnet_p2p", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


class Proc(PeerProcess):
    """A PeerProcess whose stderr is kept, and shown when an expected line never comes."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        super().__init__(*args, env=env, stderr=self.stderr)

    def missing(self, prefix: str) -> str:
        self.stderr.seek(0)
        return f"no {prefix!r} line: {self.lines}; stderr: {self.stderr.read()[-2000:]}"

    @property
    def peer_id(self) -> str:
        return self.address().rsplit("/", 1)[1]


def start_swarm(tmp_path, spans, *extra):
    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)}  # shards cut for this test only
    swarm = Swarm(spans, "--threads", "1", *extra, env=env, process=Proc, timeout=120)
    return swarm.boot, swarm.addr, swarm.joins
