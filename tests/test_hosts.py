"""tests/hosts.py: simulated hosts in network namespaces, with plain Python
processes as endpoints. A server prints its port, then the address of whoever
reached it; a client prints the echo it got back, or why it got none."""

import contextlib
import os
import subprocess
import sys
import time

import pytest

from tests.hosts import IP, Net, require_hosts

PY = sys.executable

TCP_SERVER = """
import socket
s = socket.create_server(("0.0.0.0", 0)); s.settimeout(10)
print(s.getsockname()[1], flush=True)
while True:
    c, (addr, _) = s.accept()
    c.sendall(c.recv(100)); c.close()
    print(addr, flush=True)
"""

UDP_SERVER = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 0)); s.settimeout(10)
print(s.getsockname()[1], flush=True)
while True:
    data, (addr, port) = s.recvfrom(100)
    s.sendto(data, (addr, port))
    print(addr, flush=True)
"""

CLIENT = """
import socket, sys
proto, host, port, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
try:
    if proto == "tcp":
        s = socket.create_connection((host, port), timeout=timeout)
        s.sendall(b"hello"); print(s.recv(100).decode())
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(timeout)
        s.sendto(b"hello", (host, port)); print(s.recvfrom(100)[0].decode())
except OSError as e:
    print(type(e).__name__, e)
"""


def serve(host, proto: str = "tcp") -> tuple[subprocess.Popen, int]:
    """An echo server on ``host``, and its port."""
    p = host.popen([PY, "-c", TCP_SERVER if proto == "tcp" else UDP_SERVER], stdout=subprocess.PIPE, text=True)
    return p, int(p.stdout.readline())


def call(host, proto: str, ip: str, port: int, timeout: float = 5.0) -> str:
    """What a client on ``host`` got back from ip:port: 'hello', or the error."""
    r = host.run([PY, "-c", CLIENT, proto, ip, str(port), str(timeout)], capture_output=True, text=True,
                 timeout=timeout + 30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@contextlib.contextmanager
def new_net(**kw):
    """A Net, and the pipes of its processes closed after it (a Net leaves them to their owner)."""
    net = Net(**kw)
    try:
        with net:
            yield net
    finally:
        for p in net.procs:
            if p.stdout:
                p.stdout.close()


def test_two_public_hosts_reach_each_other_over_tcp_and_udp():
    require_hosts()
    with new_net() as net:
        a, b = net.public_host("a"), net.public_host("b")
        assert a.ip != b.ip and a.public_ip == a.ip
        for proto in ("tcp", "udp"):
            for server, client in ((a, b), (b, a)):
                p, port = serve(server, proto)
                assert call(client, proto, server.ip, port) == "hello"
                assert p.stdout.readline().strip() == client.ip


def test_a_nat_host_reaches_a_public_host_from_its_routers_address():
    require_hosts()
    with new_net() as net:
        a, n = net.public_host("a"), net.nat_host("n")
        assert n.ip.startswith("192.168.") and n.public_ip.startswith("10.0.0.") and n.behind_nat
        for proto in ("tcp", "udp"):
            p, port = serve(a, proto)
            assert call(n, proto, a.ip, port) == "hello"  # the reply made it back in
            assert p.stdout.readline().strip() == n.public_ip


def test_no_public_host_opens_a_connection_to_a_nat_host():
    require_hosts()
    with new_net() as net:
        a, n = net.public_host("a"), net.nat_host("n")
        p, port = serve(n)
        t0 = time.monotonic()
        assert call(a, "tcp", n.ip, port, 1.0).startswith("OSError [Errno 101]")  # no route to the home network
        assert call(a, "tcp", n.public_ip, port, 1.0).startswith("ConnectionRefusedError")  # the router's own port
        # Even with a route through the router, it forwards nothing that is not a reply.
        a.run([IP, "route", "add", n.ip, "via", n.public_ip], check=True)
        assert call(a, "tcp", n.ip, port, 1.0).startswith("TimeoutError")
        assert call(a, "udp", n.ip, port, 0.2).startswith("TimeoutError")
        assert time.monotonic() - t0 < 10
        assert call(n, "tcp", "127.0.0.1", port) == "hello"  # it was listening all along
        p.terminate()
        assert p.communicate(timeout=10)[0].split() == ["127.0.0.1"]  # the only caller that got through


def test_partition_drops_traffic_between_two_groups_until_healed():
    require_hosts()
    with new_net() as net:
        a, b, n = net.public_host("a"), net.public_host("b"), net.nat_host("n")
        servers = {h.name: serve(h) for h in (a, b)}
        udp_a = serve(a, "udp")

        def reaches(client, server) -> bool:
            return call(client, "tcp", server.ip, servers[server.name][1], 0.5) == "hello"

        net.partition([a], [b, n])
        assert not reaches(b, a) and not reaches(a, b) and not reaches(n, a)
        assert call(n, "udp", a.ip, udp_a[1], 0.2).startswith("PermissionError")  # dropped as it leaves n
        assert reaches(n, b) and reaches(a, a)  # the rest of the network is as it was
        net.heal()
        assert reaches(b, a) and reaches(a, b) and reaches(n, a)
        assert call(n, "udp", a.ip, udp_a[1]) == "hello"
        assert udp_a[0].stdout.readline().strip() == n.public_ip  # what got through: only after the heal


def test_a_process_sees_the_environment_and_pipes_it_was_given(tmp_path):
    require_hosts()
    with new_net() as net:
        a = net.public_host("a")
        env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp_path), "VIRTUAL_ENV": sys.prefix, "HOME": str(tmp_path)}
        names = ["MESHNET_CACHE_DIR", "VIRTUAL_ENV", "HOME", "PATH"]
        p = a.popen([PY, "-c", f"import os, sys; print(sys.prefix, *(os.environ[v] for v in {names}))"],
                    stdout=subprocess.PIPE, text=True, env=env)
        out, _ = p.communicate(timeout=30)
        assert out.split() == [sys.prefix, *(env[v] for v in names)]


def _interfaces() -> set[str]:
    out = subprocess.run([IP, "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def _namespaces(tag: str) -> list[str]:
    out = subprocess.run([IP, "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag + ".")]


def _exited(pid: int) -> bool:
    """Gone, or a zombie (its parent, not us, reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("body_raises", [False, True])
def test_leaving_a_net_kills_its_processes_and_deletes_everything(body_raises):
    require_hosts()
    before = _interfaces()
    with pytest.raises(RuntimeError) if body_raises else contextlib.nullcontext():
        with new_net(grace=0.5) as net:
            a, n = net.public_host("a"), net.nat_host("n")
            assert len(_namespaces(net.tag)) == 4  # the internet, a, n and n's router
            calm = a.popen([PY, "-c", "import time; print(1, flush=True); time.sleep(300)"], stdout=subprocess.PIPE)
            stubborn = n.popen([PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                          "print(1, flush=True); time.sleep(300)"], stdout=subprocess.PIPE)
            # A process it did not start itself: the child of a shell it started.
            shell = a.popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
            orphan = int(shell.stdout.readline())
            assert calm.stdout.readline() == stubborn.stdout.readline() == b"1\n"  # both running, SIGTERM set
            assert _interfaces() == before  # nothing in the root namespace
            if body_raises:
                raise RuntimeError("the test failed halfway")
    assert _namespaces(net.tag) == []
    assert _interfaces() == before
    assert calm.returncode == -15 and stubborn.returncode == -9  # reaped, the stubborn one killed
    assert shell.returncode is not None and _exited(orphan)
