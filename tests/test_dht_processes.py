"""The control plane on real sockets: six `meshnet-peer bootstrap` OS processes
on loopback, joined by in-test nodes on real UDP sockets."""

import signal
import subprocess
import sys

import pytest
import trio

from meshnet_p2p.swarm.capability import model_key
from meshnet_p2p.testing import sample_report
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.swarm.node import BootstrapError, peers_for_model, start_node
from meshnet_p2p.core.records import wall_ms

MODEL = "ef" * 32


async def read_line(proc: trio.Process, limit: int = 4096) -> str:
    buf = b""
    while b"\n" not in buf:
        chunk = await proc.stdout.receive_some(256)
        if not chunk:
            raise AssertionError(f"process exited before printing a line: {buf!r}")
        buf += chunk
        if len(buf) > limit:
            raise AssertionError("no newline in output")
    return buf.split(b"\n", 1)[0].decode()


async def start_bootstrap(*extra: str) -> tuple[trio.Process, str]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "meshnet_p2p", "bootstrap", "--listen", "127.0.0.1:0", "--ephemeral-identity", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    with trio.fail_after(30):
        line = await read_line(proc)
    assert line.startswith("listening on /ip4/127.0.0.1/udp/"), line
    return proc, line.removeprefix("listening on ")


@pytest.fixture
async def six_bootstraps():
    procs: list[trio.Process] = []
    try:
        first, addr0 = await start_bootstrap()
        procs.append(first)
        addrs = [addr0]
        for _ in range(5):
            proc, addr = await start_bootstrap("--bootstrap", addr0)
            procs.append(proc)
            addrs.append(addr)
        yield addrs
    finally:
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            for p in procs:
                await p.wait()
    assert [p.returncode for p in procs] == [0] * len(procs)  # clean exit on SIGTERM


async def test_publish_and_find_across_six_processes(six_bootstraps):
    addrs = six_bootstraps
    publisher_id, reader_id = Identity.generate(), Identity.generate()
    async with trio.open_nursery() as nursery:
        with trio.fail_after(60):
            publisher = await start_node(nursery, publisher_id, bootstrap=[addrs[3]])
            reader = await start_node(nursery, reader_id, bootstrap=[addrs[5]])
            updates = reader.subscribe(model_key(MODEL))
            report = sample_report(publisher_id, MODEL, "01" * 32, port=7001, throughput=20.0, free_sessions=3)
            stored = await publisher.publish(model_key(MODEL), report.sign(publisher_id, seq=1, now_ms=wall_ms()))
            assert stored >= 3
            # found by a lookup...
            found = await peers_for_model(reader, MODEL)
            assert [r.signer for r in found] == [publisher_id.peer_id]
            assert found[0].content["layers"] == [0, 10]
            # ...and a newer report reaches the reader by gossip, through the processes
            newer = sample_report(publisher_id, MODEL, "01" * 32, port=7001, throughput=20.0, free_sessions=1)
            await publisher.publish(model_key(MODEL), newer.sign(publisher_id, seq=2, now_ms=wall_ms()))
            while True:
                rec = await updates.receive()
                if rec.seq == 2:
                    break
            assert rec.content["free_sessions"] == 1
        nursery.cancel_scope.cancel()


async def test_a_bootstrap_address_with_the_wrong_peer_id_is_refused(six_bootstraps):
    addr = six_bootstraps[0]
    wrong = addr.rsplit("/", 1)[0] + "/" + str(Identity.generate().peer_id)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(30):
            with pytest.raises(BootstrapError, match="another key"):
                await start_node(nursery, Identity.generate(), bootstrap=[wrong])
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("listen, loopback, joiner", [("0.0.0.0:0", "/ip4/127.0.0.1/udp/", "127.0.0.1:0"),
                                                      ("[::]:0", "/ip6/::1/udp/", "[::1]:0")])
async def test_a_wildcard_bootstrap_prints_addresses_that_work(listen, loopback, joiner):
    """bootstrap/README.md's `--listen 0.0.0.0:4001`: one line per local address,
    loopback last, never the wildcard; the loopback one, passed on, lets a node join."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "meshnet_p2p", "bootstrap", "--listen", listen, "--ephemeral-identity"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        lines, buf = [], b""
        with trio.fail_after(30):
            while not any(loopback in line for line in lines):  # loopback comes last
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, f"it exited after {lines}"
                buf += chunk
                *done, buf = buf.split(b"\n")
                lines += [d.decode() for d in done]
        lines = [line for line in lines if not line.startswith("identity ")]  # (said after its addresses)
        assert lines and all(line.startswith("listening on /ip") for line in lines), lines
        assert not any("/0.0.0.0/" in line or "/ip6/::/" in line for line in lines), lines
        assert loopback in lines[-1] and sum(loopback in line for line in lines) == 1, lines
        addr = lines[-1].removeprefix("listening on ")
        async with trio.open_nursery() as nursery:
            with trio.fail_after(30):  # only through loopback: raises BootstrapError if nobody answered
                await start_node(nursery, Identity.generate(), listen=joiner, bootstrap=[addr])
            nursery.cancel_scope.cancel()
    finally:
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            await proc.wait()
    assert proc.returncode == 0


def test_a_wildcard_peer_process_is_dialled_at_loopback():
    """PeerProcess.address(), what tests and benches dial: the loopback line of a wildcard listen."""
    from meshnet_p2p.roles.peer_process import PeerProcess

    proc = PeerProcess("bootstrap", "--listen", "0.0.0.0:0")
    try:
        assert proc.address().startswith("/ip4/127.0.0.1/udp/")
    finally:
        assert proc.stop() == 0
