"""A long-running role SIGTERMed the instant it prints ``listening on`` exits 0.

Parents (tests, benches, the demo) signal a role as soon as they read that
line. Each role here runs in its own process with ``print`` wrapped so that the
process sends itself SIGTERM right after writing its first ``listening on``
line: the narrowest window there is. A role that caught signals only from
``until_signalled`` on died of the default action (exit -15), as CI once saw."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshnet_p2p.roles.peer_process import PeerProcess

SELF_TERM = """
import builtins, os, signal, sys
_print = builtins.print

def print_then_term(*a, **k):
    _print(*a, **k)
    if a and str(a[0]).startswith("listening on "):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGTERM)

builtins.print = print_then_term
from meshnet_p2p.roles.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def run_self_terminating(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SELF_TERM, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def boot():
    proc = PeerProcess("bootstrap", "--listen", "127.0.0.1:0")
    try:
        yield proc.address()
    finally:
        assert proc.stop() == 0


@pytest.mark.parametrize("role", ["bootstrap", "bootstrap-wildcard", "relay", "monitor", "serve", "join"])
def test_a_role_signalled_as_it_prints_its_address_exits_cleanly(role, boot):
    args = {"bootstrap": ["bootstrap", "--listen", "127.0.0.1:0"],
            "bootstrap-wildcard": ["bootstrap", "--listen", "0.0.0.0:0"],
            "relay": ["relay", "--listen", "127.0.0.1:0", "--bootstrap", boot],
            "monitor": ["monitor", "--listen", "127.0.0.1:0", "--bootstrap", boot],
            "serve": ["serve", "--layers", "0:4", "--listen", "127.0.0.1:0"],
            "join": ["join", "--layers", "0:4", "--listen", "127.0.0.1:0", "--bootstrap", boot]}[role]
    done = run_self_terminating(*args)
    assert "listening on " in done.stdout, done.stderr[-2000:]
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_the_self_terminating_harness_catches_a_role_that_ignores_the_signal_window():
    """The harness itself can fail: a program that prints the line before catching signals dies of it."""
    late = SELF_TERM.split("from meshnet_p2p")[0] + """
import trio
from meshnet_p2p.core.lifecycle import until_signalled

async def main():
    print("listening on nowhere")
    await until_signalled()

trio.run(main)
"""
    done = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, timeout=60)
    assert done.returncode == -15
