"""A ``meshnet-peer`` command run as its own OS process, its output lines
collected as they come: what the demo, the benches and the multi-process
tests start their swarms with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Sequence

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.local_addrs import is_wildcard


def _on_loopback(line: str) -> bool:
    """Whether a ``listening on`` line names a loopback address (a multiaddr or a URL)."""
    return any(mark in line for mark in ("/ip4/127.", "/ip6/::1/", "://127.", "://[::1]"))


class OutputLines:
    """A running process's output lines (its stdout, a text pipe), collected as they come."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.p = p
        self.lines: list[str] = []
        self.ended = False  # its output ended (it exited, or closed stdout): every line is in
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self.changed:
                self.lines.append(line.strip())
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def wait_line(self, prefix: str, timeout: float = 120, *, after: int = 0, where=lambda line: True) -> str:
        """The first line starting with ``prefix`` (and ``where`` holds for) among those
        printed after the first ``after``, waiting for it while the process writes."""
        def found() -> list[str]:
            return [l for l in self.lines[after:] if l.startswith(prefix) and where(l)]

        with self.changed:
            self.changed.wait_for(lambda: found() or self.ended, timeout)
            lines = found()
        if not lines:
            raise MeshnetError(self.missing(prefix))
        return lines[0]

    def missing(self, prefix: str) -> str:
        return f"{self.p.args!r} printed no {prefix!r} line (its output: {self.lines[-5:]})"


PEER_ROLES = ("join", "relay", "bootstrap")  # the roles that take the machine's key by default


class PeerProcess(OutputLines):
    """A peer role started by code (the demo, benches, tests) is a throwaway peer unless
    given a key (``--identity``): several on one machine cannot all be the machine's peer.
    ``machine_key``: with no ``--identity``, the machine's own key, as a volunteer runs it."""

    def __init__(self, *args: str, env: dict | None = None, stderr=subprocess.DEVNULL, prefix: tuple[str, ...] = (),
                 machine_key: bool = False) -> None:
        if args and args[0] in PEER_ROLES and not machine_key and "--identity" not in args \
                and "--ephemeral-identity" not in args:
            args = (*args, "--ephemeral-identity")
        self.args = args
        # prefix: how to run it elsewhere, e.g. ("ip", "netns", "exec", NS) for a simulated host
        super().__init__(subprocess.Popen([*prefix, sys.executable, "-m", "meshnet_p2p", *args], stdout=subprocess.PIPE,
                                          stderr=stderr, text=True, env=env))

    def missing(self, prefix: str) -> str:
        return f"`meshnet-peer {' '.join(self.args[:2])}` printed no {prefix!r} line (its output: {self.lines[-5:]})"

    def address(self, timeout: float = 120) -> str:
        """The address of its ``listening on`` line: with ``--listen`` on one address,
        that one; on every address (a wildcard, or no ``--listen``: a line per local
        address, loopback last), the loopback one, the one this machine dials."""
        listen = self.args[self.args.index("--listen") + 1] if "--listen" in self.args else ""
        host = listen.rpartition(":")[0].strip("[]")
        one = bool(host) and not is_wildcard(host)
        return self.wait_line("listening on ", timeout, where=lambda line: one or _on_loopback(line)) \
            .removeprefix("listening on ")

    def stop(self) -> int:
        """SIGTERM (after SIGCONT, in case it was frozen), then wait; kill if it hangs."""
        if self.p.poll() is None:
            try:
                self.p.send_signal(signal.SIGCONT)
                self.p.send_signal(signal.SIGTERM)
                return self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.p.kill()
        return self.p.wait(timeout=30)


class Swarm:
    """A bootstrap peer and one ``join`` per span, as OS processes on loopback.
    ``with Swarm(...) as swarm`` stops them all (joins first) however it ends."""

    def __init__(self, spans, *join_args: str, env: dict | None = None, process=PeerProcess, timeout: float = 300,
                 boot_identity: str | None = None, boot_args: tuple[str, ...] = (),
                 join_hosts: Sequence[str] | None = None) -> None:
        # join_hosts: where each join listens (one loopback address each: a network of its own,
        # as volunteers on different machines are; default: every address, dialled at loopback)
        # The bootstrap peer runs with a key file, so its operator can certify the
        # swarm's recipe with it (clients trust their bootstrap peers' keys).
        self._keys = None
        if boot_identity is None:
            self._keys = tempfile.TemporaryDirectory(prefix="meshnet-swarm-")
            boot_identity = os.path.join(self._keys.name, "bootstrap.key")
        self.boot_identity = boot_identity
        self.boot = process("bootstrap", "--listen", "127.0.0.1:0", "--identity", boot_identity, *boot_args, env=env)
        self.joins: list[PeerProcess] = []
        try:
            self.addr = self.boot.address(timeout)
            where = [("--listen", f"{h}:0") for h in join_hosts] if join_hosts else [()] * len(spans)
            self.joins = [process("join", "--layers", s, "--bootstrap", self.addr, *w, *join_args, env=env)
                          for s, w in zip(spans, where)]
            for j in self.joins:
                j.address(timeout)
        except BaseException:
            self.stop()
            raise

    def certify(self, model: str | None = None, log=lambda m: None, name: str | None = None) -> dict:
        """Certify the swarm's recipe with the bootstrap peer's key, in this process (and
        list the model in its catalogue as ``name``, by default its file's stem)."""
        import trio

        from .certify import CertifyOptions, certify
        from meshnet_p2p.core.identity import Identity
        from meshnet_p2p.engine.models import default_model_path

        opts = CertifyOptions([self.addr], Identity.load(self.boot_identity), model or default_model_path(), name=name)
        return trio.run(certify, opts, log)

    def stop(self) -> list[int]:
        """Exit codes, joins first, then the bootstrap peer."""
        codes = [p.stop() for p in [*self.joins, self.boot]]
        if self._keys is not None:
            self._keys.cleanup()
        return codes

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
