"""Floods of a peer's data port (issue 12 #1), each beside a live generation.

One swarm of real processes serves every test here. Each attack runs from
its own loopback address (127.0.0.2) against the middle peer while a client
generates through that peer; the generation must give the whole model's
tokens, and the attack must cost the peer bounded CPU and memory: the peer
ends it (GOAWAY, a closed connection) or holds only its per-source share.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time

import hpack
import pytest

from meshnet_p2p import Client
from meshnet_p2p.dataplane.transport.server import MAX_CONNECTIONS_PER_SOURCE
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.core.multiaddr import Multiaddr

from tests.forwarder import Forwarder
from tests.h2frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    frame,
    frames,
    request_headers,
)
from tests.reference import reference_generate
from tests.swarm import certified_span, start_swarm

PROMPT = "The capital of France is"
ATTACKER = "127.0.0.2"
BYSTANDER = "127.0.0.3"  # another source, with budgets of its own
ENHANCE_YOUR_CALM = 11
HEALTH = "/meshnet.shard.v1.ShardRuntime/Health"
SESSION = "/meshnet.shard.v1.ShardRuntime/Session"
CPU_BOUND_S = 5.0  # the peer's CPU over attack and generation together
RSS_BOUND = 64 << 20


def request_block(enc: hpack.Encoder, path: str = HEALTH) -> bytes:
    return request_headers(enc, path)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, model_path):
    tmp = tmp_path_factory.mktemp("floods")
    boot, addr, joins = start_swarm(tmp, ["0:10", "10:20", "20:30"])
    try:
        middle = certified_span(addr, model_path, 10)
        target = Multiaddr.parse(middle.record.content["addrs"][0])
        pid = joins[1].p.pid  # the join serving 10:20
        reference = reference_generate(model_path, Tokenizer(model_path).encode(PROMPT), 16, n_ubatch=64)[0]
        yield addr, (target.host, target.port), pid, reference, model_path, middle
    finally:
        for p in joins + [boot]:
            p.stop()


def _usage(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and resident bytes of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, int(fields[21]) * os.sysconf("SC_PAGE_SIZE")


class Raw:
    """An attacker's HTTP/2 connection: TLS (verifying nothing), then frames as it likes."""

    def __init__(self, target, *, handshake: bool = True, preface: bool = True, source: str = ATTACKER) -> None:
        self.sock = socket.create_connection(target, timeout=10, source_address=(source, 0))
        if handshake:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            ctx.set_alpn_protocols(["h2"])
            self.sock = ctx.wrap_socket(self.sock)
        self.enc = hpack.Encoder()
        self.received = bytearray()
        if preface:
            self.send(PREFACE + frame(SETTINGS, 0, 0))

    def send(self, data: bytes) -> bool:
        """False once the peer has closed the connection."""
        try:
            self.sock.sendall(data)
            return True
        except (OSError, ssl.SSLError):
            return False

    def flood(self, make, limit: int, batch: int = 200) -> int:
        """Send ``make(i)`` for i in 0..limit in batches until the peer hangs up;
        returns how many were sent. Reads as it goes, as a client that wants the
        acks would (a flooder that never reads is bounded by the send timeout)."""
        sent = 0
        while sent < limit:
            if not self.send(b"".join(make(sent + i) for i in range(batch))):
                break
            sent += batch
            if not self._read(0.0):
                break
        self._read(10.0)
        return sent

    def _read(self, timeout: float) -> bool:
        """Read what is there (up to ``timeout`` for the peer to close); False once closed."""
        deadline = time.monotonic() + timeout
        while True:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                data = self.sock.recv(1 << 16)
            except (TimeoutError, socket.timeout, BlockingIOError, ssl.SSLWantReadError):
                return True
            except (OSError, ssl.SSLError):
                return False
            if not data:
                return False
            self.received += data
            if time.monotonic() >= deadline and timeout:
                return True

    def goaway_code(self) -> int | None:
        """The error code of the GOAWAY the peer sent, if it sent one."""
        for ftype, _, _, payload in frames(bytes(self.received)):
            if ftype == GOAWAY and len(payload) >= 8:
                return struct.unpack(">I", payload[4:8])[0]
        return None

    def close(self) -> None:
        self.sock.close()


def beside_a_generation(swarm, attack):
    """Run ``attack()`` in a thread while a client generates through the attacked
    peer; returns the attack's result and the peer's CPU seconds and RSS growth."""
    addr, _, pid, reference, model_path, _ = swarm
    cpu0, rss0 = _usage(pid)
    result: list = []
    errors: list = []

    def run():
        try:
            result.append(attack())
        except BaseException as e:  # shown by the assertion below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        got = Client([addr], model_path=model_path, step_timeout=10.0).generate(PROMPT, 16, stop_at_eog=False)
    finally:
        t.join(120)
    assert not t.is_alive() and not errors, errors
    assert got.token_ids == reference
    cpu1, rss1 = _usage(pid)
    assert cpu1 - cpu0 < CPU_BOUND_S, f"the peer spent {cpu1 - cpu0:.1f} s of CPU"
    assert rss1 - rss0 < RSS_BOUND, f"the peer grew by {(rss1 - rss0) >> 20} MiB"
    return result[0]


def test_rapid_reset_is_ended_after_its_budget(swarm):
    """CVE-2023-44487: HEADERS then RST_STREAM in a loop. h2 accepts each pair
    (~86 us of CPU), so only a budget ends it: GOAWAY(ENHANCE_YOUR_CALM)."""
    conn = Raw(swarm[1])

    def attack():
        def pair(i):
            sid = 2 * i + 1
            return frame(HEADERS, END_HEADERS, sid, request_block(conn.enc)) + \
                frame(RST_STREAM, 0, sid, struct.pack(">I", 8))
        return conn.flood(pair, 20_000)

    try:
        sent = beside_a_generation(swarm, attack)
        assert conn.goaway_code() == ENHANCE_YOUR_CALM and sent < 20_000
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["ping", "settings", "priority", "empty-data"])
def test_control_frame_floods_are_ended_after_their_budget(swarm, kind):
    """PING and SETTINGS are answered by h2 on its own (one ack per frame, a
    1:1 reflection), PRIORITY and empty DATA cost a frame each: all end in
    GOAWAY(ENHANCE_YOUR_CALM) once over their budget."""
    conn = Raw(swarm[1])
    if kind == "empty-data":
        conn.send(frame(HEADERS, END_HEADERS, 1, request_block(conn.enc, SESSION)))
    make = {
        "ping": lambda i: frame(PING, 0, 0, struct.pack(">Q", i)),
        "settings": lambda i: frame(SETTINGS, 0, 0),
        "priority": lambda i: frame(PRIORITY, 0, 2 * i + 101, struct.pack(">IB", 0, 15)),
        "empty-data": lambda i: frame(DATA, 0, 1),
    }[kind]
    try:
        sent = beside_a_generation(swarm, lambda: conn.flood(make, 100_000))
        assert conn.goaway_code() == ENHANCE_YOUR_CALM and sent < 100_000
    finally:
        conn.close()


def test_a_continuation_flood_is_ended(swarm):
    """A header block that never ends: CONTINUATION after CONTINUATION. h2
    takes at most 64 frames (about 1 MiB) of one block, then ends the connection."""
    conn = Raw(swarm[1])
    block = request_block(conn.enc)
    conn.send(frame(HEADERS, 0, 1, block))
    try:
        sent = beside_a_generation(swarm, lambda: conn.flood(lambda i: frame(CONTINUATION, 0, 1, b"\x00" * 16384),
                                                             10_000, batch=16))
        assert conn.goaway_code() is not None and sent < 10_000
    finally:
        conn.close()


def test_an_hpack_bomb_is_ended(swarm):
    """A 4 KiB header put in the dynamic table once, then named by its one-byte
    index thousands of times: the decoded list outgrows what we advertised
    (16 KiB) and h2 ends the connection with ENHANCE_YOUR_CALM."""
    conn = Raw(swarm[1])
    big = hpack.Encoder()
    first = request_block(big) + big.encode([("x-bomb", "b" * 4000)])  # literal, indexed: table entry 62
    bomb = first + b"\xbe" * 16000  # 0x80 | 62: "that header again", 64 MB decoded
    conn.enc = big

    def attack():
        conn.send(frame(HEADERS, 0, 1, bomb[:16384]) + frame(CONTINUATION, END_HEADERS, 1, bomb[16384:]))
        conn._read(10.0)

    try:
        beside_a_generation(swarm, attack)
        assert conn.goaway_code() == ENHANCE_YOUR_CALM
    finally:
        conn.close()


def test_streams_over_the_limit_end_their_connection(swarm):
    """Calls the client opens past the advertised SETTINGS_MAX_CONCURRENT_STREAMS
    (32): h2 ends that connection; calls on other connections go on."""
    conn = Raw(swarm[1])
    try:
        sent = beside_a_generation(swarm, lambda: conn.flood(
            lambda i: frame(HEADERS, END_HEADERS, 2 * i + 1, request_block(conn.enc, SESSION)), 10_000, batch=50))
        assert conn.goaway_code() is not None and sent < 10_000
    finally:
        conn.close()


@pytest.mark.parametrize("stage", ["handshake", "headers", "body"])
def test_slowloris_holds_only_its_sources_share(swarm, stage):
    """64 connections from one source that each stop partway (inside the TLS
    handshake, inside a header block, inside a call's first message), trickling
    a byte now and then: the source holds at most its 32, newer ones push out
    its older idle ones, and the generation beside them is served."""
    target = swarm[1]
    conns: list[Raw] = []

    def attack():
        for i in range(64):
            try:
                if stage == "handshake":
                    c = Raw(target, handshake=False, preface=False)
                    c.send(b"\x16\x03\x01\x02\x00\x01")  # a ClientHello's first bytes, and no more
                else:
                    c = Raw(target)
                    if stage == "headers":
                        c.send(frame(HEADERS, 0, 1, request_block(c.enc, SESSION)))  # no END_HEADERS
                    else:
                        c.send(frame(HEADERS, END_HEADERS, 1, request_block(c.enc, SESSION)) +
                               frame(DATA, 0, 1, struct.pack(">BI", 0, 1000) + b"\x00" * 10))
            except (OSError, ssl.SSLError):  # refused: the peer's right
                continue
            conns.append(c)
        # The peer takes connections in the order they arrived, one at a time; one
        # whose TLS handshake completes was taken after all of them, and each made
        # its room as it was taken. Counted before that, a stalled handshake still
        # waiting in the kernel's backlog (a loaded host) looked held (34 of 32).
        # The barrier comes from another address: a 65th of the attacker's own is over
        # its source's connection budget (a burst of 32, then 10 a second, at most 32
        # waiting their turn), and is closed before TLS whenever 32 still wait.
        barrier = Raw(target, source=BYSTANDER)
        for c in conns:  # a trickle: each still looks alive
            c.send(b"\x00" if stage == "handshake" else frame(PING, 0, 0, b"\x00" * 8))
        alive = sum(1 for c in conns if c._read(0.05)) + barrier._read(0.05)
        conns.append(barrier)
        return alive

    try:
        alive = beside_a_generation(swarm, attack)
        assert alive <= MAX_CONNECTIONS_PER_SOURCE + 1, f"{alive} of one source's connections still open"
    finally:
        for c in conns:
            c.close()


# --- a stock load tool, from its own address --------------------------------------------------------


@pytest.mark.skipif(not shutil.which("h2load") and not os.environ.get("MESHNET_REQUIRE_TOOLS"),
                    reason="h2load (Debian's nghttp2-client) is not installed")  # CI installs it, and requires it
def test_a_flood_of_cheap_calls_from_one_source_does_not_stop_a_generation(swarm, tmp_path):
    """Issue 12 #2 as reported: `h2load -c 64 -m 100` sending Health calls to a
    middle peer made a generation started during the flood fail with `no
    route`. A source over its call budget is now not read, and unary calls
    queue per source and take their turns: another source's calls are
    answered about as fast as with no flood. Without the budget, Health took
    0.28 s a call in the flood (1.9 ms before it), the peer's CPU was all the
    flood's, and with the turns alone the generation failed as reported. (The
    bound, 20x the quiet latency or 0.1 s, leaves room for a loaded machine:
    52 ms was seen with two test suites running at once.)"""
    from meshnet_p2p.client import connect

    def health_s(n: int = 10) -> float:
        """Median seconds of a Health call from the client's own address, on a fresh connection."""
        honest = connect(swarm[5], 10.0)
        try:
            honest.capability()
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                honest.health()
                times.append(time.perf_counter() - t0)
            return sorted(times)[n // 2]
        finally:
            honest.close()

    quiet = health_s()
    body = tmp_path / "health.bin"
    body.write_bytes(b"\x00\x00\x00\x00\x00")  # one gRPC message: an empty HealthRequest
    forwarder = Forwarder(swarm[1], source=ATTACKER)  # h2load cannot choose its source address
    port = forwarder.port
    cmd = ["h2load", "-c", "64", "-m", "100", "-D", "6", "-d", str(body), "-H", "content-type: application/grpc",
           "-H", "te: trailers", f"https://127.0.0.1:{port}{HEALTH}"]
    flood = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while flood.poll() is None and time.monotonic() < deadline:  # until the flood is under way
            if _connections_from(ATTACKER, swarm[1][1]) >= 8:
                break
            time.sleep(0.05)  # polling the kernel's table: no event to wait on
        flooded = health_s()
        beside_a_generation(swarm, lambda: None)
        # Its duration over, h2load stops its clients; but one the peer made give way
        # (GOAWAY: 64 connections from one address, over its cap) reconnects and floods
        # on, even after the duration (h2load 1.52, Client::try_again_or_fail), so h2load
        # would end only when the peer next closed that connection. Once it has stopped,
        # the forwarder cuts what it carries: h2load sees its connections end and reports.
        head = _read_until(flood.stdout, "Stopped all clients", timeout=60)
        forwarder.cut()
        rest, _ = flood.communicate(timeout=60)
        out = head + rest
        assert flooded < max(20 * quiet, 0.1), f"Health took {flooded * 1e3:.1f} ms in the flood, {quiet * 1e3:.1f} before"
        succeeded = int(re.search(r"(\d+) succeeded", out).group(1))
        assert succeeded > 100, out  # the peer kept answering the flood too
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.communicate()
        forwarder.close()


def _read_until(stream, marker: str, timeout: float) -> str:
    """Lines of ``stream`` up to and including one containing ``marker`` (or all of
    them, if it ends first); fails after ``timeout`` seconds."""
    lines: list[str] = []

    def read() -> None:
        for line in stream:
            lines.append(line)
            if marker in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert not reader.is_alive(), f"no {marker!r} within {timeout} s: {''.join(lines)[-2000:]}"
    return "".join(lines)


def _connections_from(source: str, port: int) -> int:
    """Established TCP connections from ``source`` to a local ``port`` (from /proc/net/tcp)."""
    want_src = socket.inet_aton(source)[::-1].hex().upper()
    n = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, remote, state = line.split()[1:4]
            if state == "01" and remote.split(":")[0] == want_src and int(local.split(":")[1], 16) == port:
                n += 1
    return n
