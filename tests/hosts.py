"""Throwaway hosts for multi-process tests: each a network namespace with its
own IPv4 address, so that peers run as real OS processes on their own
addresses, some of them behind a home NAT.

    with Net() as net:
        a = net.public_host("a")            # 10.0.0.x on the "internet"
        n = net.nat_host("n")               # 192.168.k.2 behind a router at n.public_ip
        p = a.popen([sys.executable, "-m", "meshnet_p2p", ...], stdout=subprocess.PIPE, text=True)
        net.partition([a], [n]); ...; net.heal()

The "internet" is a bridge in a namespace of its own; every interface is
created directly inside the Net's namespaces, so nothing is ever added to the
root namespace (no address, route, rule or interface), and two Nets never see
each other: each has its own 10.0.0.0/24 and 192.168.k.0/24 networks. Leaving
the `with` kills every process in the Net's namespaces and deletes them (which
deletes their interfaces), however the body ended. Needs root, `ip` and
`iptables`: tests call `require_hosts()` first."""

from __future__ import annotations

import functools
import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import time

_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
IP = shutil.which("ip", path=_PATH) or "ip"
IPTABLES = shutil.which("iptables", path=_PATH) or "iptables"

_nets = itertools.count()


def _run(*argv: str, **kw) -> subprocess.CompletedProcess:
    """A short command that must succeed; its stderr is in the error if it does not."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    kw.setdefault("timeout", 30)
    r = subprocess.run(argv, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exited {r.returncode}: {(r.stderr or '').strip()}")
    return r


class Host:
    """A namespace with one address. ``public_ip`` is what other hosts see as its
    source: the router's address for a NAT'd host, ``ip`` itself for a public one."""

    def __init__(self, net: Net, name: str, ns: str, ip: str, public_ip: str | None = None) -> None:
        self.net, self.name, self.ns, self.ip = net, name, ns, ip
        self.public_ip = public_ip or ip

    @property
    def behind_nat(self) -> bool:
        return self.public_ip != self.ip

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """``argv`` run in this host's namespace (env, cwd, pipes pass through
        `ip netns exec`, which execs it: the Popen's pid is the program's own);
        killed when the Net closes, if still running."""
        p = subprocess.Popen([IP, "netns", "exec", self.ns, *argv], **kw)
        self.net.procs.append(p)
        return p

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """A short command run to completion in this host's namespace (60 s at most unless told)."""
        kw.setdefault("timeout", 60)
        return subprocess.run([IP, "netns", "exec", self.ns, *argv], **kw)

    def __repr__(self) -> str:
        return f"Host({self.name!r}, ip={self.ip}, public_ip={self.public_ip})"


class Net:
    """Hosts on a simulated internet (a bridge, 10.0.0.0/24) and home networks behind
    NAT routers (192.168.k.0/24). Use as a context manager: leaving it kills every
    process of its namespaces (SIGTERM, then SIGKILL after ``grace`` seconds, always
    reaped) and deletes every namespace it created."""

    def __init__(self, grace: float = 5.0) -> None:
        self.tag = f"mn{os.getpid()}.{next(_nets)}"  # prefix of all its namespace names
        self.grace = grace
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.hosts: dict[str, Host] = {}
        self.internet = f"{self.tag}.internet"
        self._rules: list[tuple[str, list[str]]] = []  # (namespace, rule) of each partition
        self._public = itertools.count(2)  # last octet of the next address on 10.0.0.0/24
        self._homes = itertools.count(1)  # k of the next 192.168.k.0/24

    def __enter__(self) -> Net:
        try:
            self._namespace(self.internet)
            _run(IP, "-n", self.internet, "link", "add", "name", "br0", "type", "bridge")
            _run(IP, "-n", self.internet, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- hosts ------------------------------------------------------------------------------------

    def public_host(self, name: str) -> Host:
        """A host on the internet bridge, reachable by every other public host."""
        ns = self._host_namespace(name)
        host = self.hosts[name] = Host(self, name, ns, self._plug(ns, "eth0"))
        return host

    def nat_host(self, name: str) -> Host:
        """A host behind a router of its own, which masquerades whatever the host
        sends out and forwards nothing that is not a reply: like a home NAT. Public
        hosts have no route to its private address."""
        ns = self._host_namespace(name)
        router = self._namespace(f"{ns}.nat")
        public_ip = self._plug(router, "wan")
        k = next(self._homes)
        if k > 254:
            raise RuntimeError("no more home networks in this Net")
        _run(IP, "-n", router, "link", "add", "name", "lan", "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._address(router, "lan", f"192.168.{k}.1")
        self._address(ns, "eth0", f"192.168.{k}.2")
        _run(IP, "-n", ns, "route", "add", "default", "via", f"192.168.{k}.1")
        _run(IP, "netns", "exec", router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        for rule in (["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"],
                     ["-A", "FORWARD", "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                      "-j", "ACCEPT"],
                     ["-A", "FORWARD", "-i", "wan", "-j", "DROP"]):
            self._iptables(router, *rule)
        host = self.hosts[name] = Host(self, name, ns, f"192.168.{k}.2", public_ip)
        return host

    def forward_port(self, host: Host, port: int) -> None:
        """Port forwarding on a NAT'd host's router, as a volunteer sets up at home:
        TCP to the router's public address at ``port`` goes to the host's same port."""
        if not host.behind_nat:
            raise ValueError(f"{host.name} is not behind a NAT")
        router = f"{host.ns}.nat"
        self._iptables(router, "-t", "nat", "-A", "PREROUTING", "-i", "wan", "-p", "tcp", "--dport", str(port),
                       "-j", "DNAT", "--to-destination", f"{host.ip}:{port}")
        self._iptables(router, "-I", "FORWARD", "1", "-i", "wan", "-p", "tcp", "-d", host.ip, "--dport", str(port),
                       "-j", "ACCEPT")

    # --- partitions -------------------------------------------------------------------------------

    def partition(self, group_a: list[Host], group_b: list[Host]) -> None:
        """Drop all traffic between the two groups, both ways: in each host's namespace,
        INPUT from and OUTPUT to every address of the other group (a NAT'd host's
        private and public address). Packets already on the way are lost as on a real
        network, but a drop in OUTPUT is seen by the sender: UDP `sendto` fails with
        EPERM at once, TCP `connect` times out."""
        for hosts, others in ((group_a, group_b), (group_b, group_a)):
            for h in hosts:
                for addr in sorted({a for o in others for a in (o.ip, o.public_ip)}):
                    for rule in (["INPUT", "-s", addr, "-j", "DROP"], ["OUTPUT", "-d", addr, "-j", "DROP"]):
                        self._iptables(h.ns, "-A", *rule)
                        self._rules.append((h.ns, rule))

    def heal(self) -> None:
        """Remove every partition rule."""
        while self._rules:
            ns, rule = self._rules.pop()
            self._iptables(ns, "-D", *rule)

    # --- cleanup ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process this Net started or that runs in its namespaces, then delete them."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.send_signal(signal.SIGCONT)  # in case a test froze it
        deadline = time.monotonic() + self.grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ns in self.namespaces:  # what they left behind there (their children, say)
            r = subprocess.run([IP, "netns", "pids", ns], capture_output=True, text=True, timeout=30)
            for pid in r.stdout.split():
                _kill(int(pid), self.grace)
        failed = [ns for ns in reversed(self.namespaces)
                  if subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=30).returncode != 0]
        self.namespaces = failed
        if failed:
            raise RuntimeError(f"could not delete network namespaces {failed}")

    # --- plumbing ---------------------------------------------------------------------------------

    def _namespace(self, ns: str) -> str:
        _run(IP, "netns", "add", ns)
        self.namespaces.append(ns)
        _run(IP, "-n", ns, "link", "set", "lo", "up")
        return ns

    def _host_namespace(self, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", name) or name in self.hosts:
            raise ValueError(f"host name {name!r} is taken or not [A-Za-z0-9_-]{{1,32}}")
        return self._namespace(f"{self.tag}.{name}")

    def _plug(self, ns: str, dev: str) -> str:
        """A veth from the internet bridge into ``ns``, named ``dev`` there; its new public address."""
        n = next(self._public)
        if n > 254:
            raise RuntimeError("no more public addresses in this Net")
        _run(IP, "-n", self.internet, "link", "add", "name", f"v{n}", "type", "veth", "peer", "name", dev, "netns", ns)
        _run(IP, "-n", self.internet, "link", "set", f"v{n}", "master", "br0", "up")
        return self._address(ns, dev, f"10.0.0.{n}")

    @staticmethod
    def _address(ns: str, dev: str, ip: str) -> str:
        _run(IP, "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        _run(IP, "-n", ns, "link", "set", dev, "up")
        return ip

    @staticmethod
    def _iptables(ns: str, *args: str) -> None:
        _run(IP, "netns", "exec", ns, IPTABLES, "-w", *args)


def _kill(pid: int, timeout: float) -> None:
    """SIGKILL a process that is not our child, and wait (bounded) until it has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([fd], [], [], timeout)  # readable once it has exited
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


@functools.cache
def available() -> str | None:
    """None when Nets can be built here, else why not (one line)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables")):
        if not shutil.which(tool, path=_PATH):
            return f"`{tool}` is not installed (Debian's {package})"
    probe = f"mnprobe{os.getpid()}"
    try:
        _run(IP, "netns", "add", probe)
        _run(IP, "-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b")
        _run(IP, "netns", "exec", probe, IPTABLES, "-w", "-t", "nat", "-A", "POSTROUTING", "-o", "a", "-j",
             "MASQUERADE")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"cannot build a network namespace here: {e}".replace("\n", " ")
    finally:
        subprocess.run([IP, "netns", "del", probe], capture_output=True, timeout=30)
    return None


def require_hosts() -> None:
    """Skip the calling test when Nets cannot be built here; fail it instead when
    MESHNET_REQUIRE_TOOLS is set (CI), so that a missing tool is never silently skipped."""
    import pytest

    reason = available()
    if reason is None:
        return
    if os.environ.get("MESHNET_REQUIRE_TOOLS"):
        pytest.fail(f"MESHNET_REQUIRE_TOOLS is set: {reason}")
    pytest.skip(reason)
