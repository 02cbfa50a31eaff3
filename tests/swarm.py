"""Helpers for tests that run `meshnet-peer` as OS processes: one command to
completion, a long-running peer, a swarm of them on loopback."""

import itertools
import json
import os
import subprocess
import sys
import tempfile

from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.dataplane.stub import ShardClient, open_channel
from meshnet_p2p.dataplane.transport.tls import verify_binding
from meshnet_p2p.roles.peer_process import OutputLines, PeerProcess, Swarm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HOSTS = itertools.count()


def own_address() -> str:
    """A loopback address no other peer process of this test run listens on (all of
    127/8 is loopback here): each counts as a network of its own (netgroup.network_of),
    as volunteers on different machines do, so verification has independent witnesses
    (issue 59: many identities of one network are one witness)."""
    n = next(_HOSTS)
    return f"127.1.{(n // 250) % 250}.{1 + n % 250}"


def meshnet_peer(*args: str, timeout: float = 300, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run one ``meshnet-peer`` command to completion, as a user would."""
    return subprocess.run([sys.executable, "-m", "meshnet_p2p", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


class Proc(PeerProcess):
    """A PeerProcess whose stderr is kept, and shown when an expected line never comes."""

    def __init__(self, *args: str, env: dict | None = None, prefix: tuple[str, ...] = ()) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        super().__init__(*args, env=env, stderr=self.stderr, prefix=prefix)

    def missing(self, prefix: str) -> str:
        self.stderr.seek(0)
        return f"no {prefix!r} line: {self.lines}; stderr: {self.stderr.read()[-2000:]}"

    @property
    def peer_id(self) -> str:
        return self.address().rsplit("/", 1)[1]


class Cheater(PeerProcess):
    """``python -m tests.cheaters MODE ...`` as its own process (stopped like a role)."""

    def __init__(self, mode: str, *args: str) -> None:
        self.args = (mode, *args)
        self.stderr = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        OutputLines.__init__(self, subprocess.Popen([sys.executable, "-m", "tests.cheaters", *self.args], cwd=ROOT,
                                                    env=env, stdout=subprocess.PIPE, stderr=self.stderr, text=True))

    def missing(self, prefix: str) -> str:
        self.stderr.seek(0)
        return f"cheater {self.args[0]} printed no {prefix!r} line: {self.lines}; stderr: {self.stderr.read()[-2000:]}"

    @property
    def peer_id(self) -> str:
        return self.address(60).rsplit("/", 1)[1]

    def client(self) -> ShardClient:
        addr = Multiaddr.parse(self.address(60))
        binding = bytes.fromhex(self.wait_line("tls-binding ").split()[1])
        cert = verify_binding(binding, addr.peer_id, wall_ms())
        return ShardClient(open_channel(cert, address=(addr.host, addr.port)), timeout=30)


def certify_swarm(addr: str, identity_path: str, *extra: str) -> dict:
    """`meshnet-peer certify`, as a bootstrap operator runs it; the summary it prints."""
    r = meshnet_peer("certify", "--bootstrap", addr, "--identity", identity_path, "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def start_swarm(tmp_path, spans, *extra, certify: bool = True, spread: bool = False):
    """A bootstrap peer (its key at ``boot.identity_path``) and one join per span;
    with ``certify``, the bootstrap's key certifies their recipe, as an operator would;
    with ``spread``, each join at an address of its own (:func:`own_address`)."""
    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)}  # shards cut for this test only
    key = str(tmp_path / "bootstrap.key")
    swarm = Swarm(spans, "--threads", "1", *extra, env=env, process=Proc, timeout=120, boot_identity=key,
                  join_hosts=[own_address() for _ in spans] if spread else None)
    swarm.boot.identity_path = key
    if certify:
        try:
            certify_swarm(swarm.addr, key)
        except BaseException:
            swarm.stop()
            raise
    return swarm.boot, swarm.addr, swarm.joins


def certified_span(addr: str, model_path: str, start: int):
    """The span of the swarm's certified recipe that starts at layer ``start``, as a client sees it."""
    import trio

    from meshnet_p2p.trust.policy import TrustPolicy
    from meshnet_p2p.engine.cut import inspect_gguf
    from meshnet_p2p.swarm.view import survey

    info = inspect_gguf(model_path)
    view = trio.run(survey, [addr], info.model_digest, info.source_layers, TrustPolicy.default([addr]))
    return next(s for s in view.certified()[0].spans if s.start == start)
