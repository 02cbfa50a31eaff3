"""A ring link is no reflector and no port scanner (issue 24, item 1; docs/ring.md).

A client that opens sessions on volunteers and sends them LinkSignals must not
make them dial addresses of its choosing, nor learn from the answers what
listens there. The servicer runs in-process on a stand-in engine; the
"victims" are loopback sockets this test opens and counts connections on. The
honest ring over real sockets is tests/test_ring.py and tests/test_e2e.py.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.swarm.capability import CapabilityReport, sign_model_index
from meshnet_p2p.dataplane.link_guard import LinkBounds, LinkGuard
from meshnet_p2p.dataplane.servicer import Limits, ShardRuntimeServicer
from meshnet_p2p.dataplane.transport.tls import make_tls_credentials
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import wall_ms

from tests.test_fuzz_decoders import FINGERPRINT, MODEL, RECIPE, FakeEngine, _open

HOP = Identity.from_seed(b"\x61" * 32)  # the volunteer whose session gets the links (layers 10-20)
ATTACKER = Identity.from_seed(b"\x62" * 32)  # a peer ID the client chose, with a certificate it made itself
DIAL_MS, ANSWER_MS = 600, 1000  # the volunteer's dial timeout, and when it answers a failed link


def _servicer(dial_ms: int = DIAL_MS, answer_ms: int = ANSWER_MS) -> ShardRuntimeServicer:
    return ShardRuntimeServicer(FakeEngine(10, 20, max_sessions=8), identity=HOP,
                                limits=Limits(link_dial_ms=dial_ms, link_answer_ms=answer_ms))


class Listener:
    """A loopback TCP socket that counts the connections made to it: ``silent``
    holds them open without a word, else each is closed once accepted."""

    def __init__(self, *, silent: bool) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.silent = silent
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = None
        if not silent:
            self._thread = threading.Thread(target=self._close_each, daemon=True)
            self._thread.start()

    def _close_each(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            with self._lock:
                self.accepted += 1
            conn.close()

    def count(self) -> int:
        """Connections made so far (a silent listener's are taken off its backlog here)."""
        if self.silent:
            self.sock.setblocking(False)
            while True:
                try:
                    conn, _ = self.sock.accept()
                except BlockingIOError:
                    break
                self._held.append(conn)
                self.accepted += 1
        with self._lock:
            return self.accepted

    def close(self) -> None:
        self.sock.close()
        for c in self._held:
            c.close()
        if self._thread is not None:
            self._thread.join(timeout=10)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


_CERT: dict = {}


def _attacker_cert() -> bytes:
    return _CERT.setdefault("pem", make_tls_credentials(ATTACKER).cert_pem)


def _report(port: int, *, signer: Identity = ATTACKER, cert: bytes | None = None, model: str = MODEL,
            recipe: str = RECIPE, layers=(20, 30), departing: bool = False, now_ms: int | None = None,
            ttl_ms: int = 60_000) -> bytes:
    """A capability report as anyone can sign one: for its own peer ID, binding ``port`` on loopback."""
    now = wall_ms() if now_ms is None else now_ms
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{signer.peer_id}"
    return CapabilityReport(model, recipe, layers, (addr,), throughput=1.0, departing=departing,
                            tls_cert=(cert or make_tls_credentials(signer).cert_pem).decode()).sign(
        signer, seq=now, now_ms=now, ttl_ms=ttl_ms)


def _victim_link(port: int, **report) -> pb.LinkSignal:
    """What an attacker sends now: a link whose report it signed itself, binding ``port``."""
    signer = report.get("signer", ATTACKER)
    return pb.LinkSignal(peer_id=str(signer.peer_id), next_report=_report(port, **report), session_id="x" * 32,
                         attach_token=b"t" * 32, forward_until=10)


def _field(number: int, value: bytes) -> bytes:
    """One length-delimited protobuf field, as an older client wrote it."""
    n, length = len(value), b""
    while True:
        length += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return bytes([number << 3 | 2]) + length + value


def _old_style(msg: pb.LinkSignal, port: int) -> pb.LinkSignal:
    """``msg`` with the fields the measured attack set: an address of its choosing (3) and its own certificate (5)."""
    raw = msg.SerializeToString() + _field(3, f"/ip4/127.0.0.1/tcp/{port}".encode()) + _field(5, _attacker_cert())
    return pb.LinkSignal.FromString(raw)


def _session(servicer, links, sid: str):
    """A session on ``servicer`` that sends ``links``; yields (answer, seconds it took) for each."""
    requests = iter([_open(sid, 0, FINGERPRINT, 3, 0.0, 0, 0.0, 0, 16),
                     *(pb.SessionRequest(link=m) for m in links)])
    answers = servicer.Session(requests, None, push=lambda m: None)
    assert next(answers).HasField("accepted")
    while True:
        t0 = time.monotonic()
        try:
            answer = next(answers)
        except StopIteration:
            return
        yield answer, time.monotonic() - t0


def test_a_link_dials_no_address_the_client_chose():
    """The attack as measured: a peer ID and certificate the client made, and the
    address of a listener that is no peer. No connection may reach it: not
    without a report, and not when the report binds another address."""
    victim = Listener(silent=True)
    elsewhere = _closed_port()
    try:
        bare = pb.LinkSignal(peer_id=str(ATTACKER.peer_id), session_id="x" * 32, attach_token=b"t" * 32)
        links = [_old_style(bare, victim.port), _old_style(_victim_link(elsewhere), victim.port)]
        answers = [a for a, _ in _session(_servicer(dial_ms=100, answer_ms=200), links, "s1")]
        assert answers[0].error.code == pb.INVALID_ARGUMENT and "no report" in answers[0].error.detail
        assert answers[1].error.code == pb.LINK_FAILED  # what the report binds was dialled, and failed
        assert victim.count() == 0
    finally:
        victim.close()


def test_a_report_that_is_not_current_signed_and_this_rings_is_refused_before_any_dial():
    victim = Listener(silent=True)
    other_model = "ef" * 32
    honest = _report(victim.port)
    stranger = Identity.from_seed(b"\x63" * 32)
    try:
        cases = {
            "unsigned": honest[:-64] + bytes(64),
            "forged": _report(victim.port, signer=stranger).replace(
                str(stranger.peer_id).encode(), str(ATTACKER.peer_id).encode()),
            "expired": _report(victim.port, now_ms=wall_ms() - 120_000, ttl_ms=60_000),
            "from another model": _report(victim.port, model=other_model),
            "from another recipe": _report(victim.port, recipe="01" * 32),
            "not the next layers": _report(victim.port, layers=(0, 10)),
            "leaving": _report(victim.port, departing=True),
            "signed by another than the link names": _report(victim.port, signer=stranger),
            "binding another peer's certificate": _report(victim.port, cert=make_tls_credentials(stranger).cert_pem),
            "not a capability report": sign_model_index(ATTACKER, MODEL, "m", 30, now_ms=wall_ms()),
            "garbage": b"\x93\x01\x02",
        }
        links = [pb.LinkSignal(peer_id=str(ATTACKER.peer_id), next_report=r, session_id="x" * 32,
                               attach_token=b"t" * 32) for r in cases.values()]
        answers = [a for a, _ in _session(_servicer(), links, "s1")]
        for why, answer in zip(cases, answers):
            assert answer.error.code == pb.INVALID_ARGUMENT and "report" in answer.error.detail, (why, answer)
        assert victim.count() == 0
    finally:
        victim.close()


def test_links_from_many_sessions_to_one_failing_address_cost_it_a_handful_of_connections():
    """Sessions are free to open: a bound per session is no bound. Forty links
    over four sessions to one address that fails: a few connections at most."""
    victim = Listener(silent=False)
    servicer = _servicer(dial_ms=100, answer_ms=150)
    try:
        codes = []
        for n in range(4):
            codes += [a.error.code for a, _ in _session(servicer, [_victim_link(victim.port)] * 10, f"s{n}")]
        assert set(codes) <= {pb.LINK_FAILED, pb.LINK_LIMITED} and len(codes) == 40
        assert victim.count() <= 2
        links = servicer.stats.links.snapshot()  # what an operator sees (metrics.py)
        assert links["unreached"] == victim.count() and links["linked"] == 0
        assert links["unreached"] + links["backing_off"] + links["limited"] == 40
    finally:
        victim.close()


def test_a_failed_links_answer_tells_nothing_of_the_port():
    """Closed, open and silent, open and closing at once: the same answer, and
    none before the fixed floor (the dial's timeout is below it)."""
    silent, closing = Listener(silent=True), Listener(silent=False)
    servicer = _servicer()
    try:
        answers = []
        for i, port in enumerate([_closed_port(), silent.port, closing.port]):
            [(answer, took)] = list(_session(servicer, [_victim_link(port)], f"t{i}"))
            answers.append((answer.error.code, answer.error.detail, answer.error.retryable))
            assert ANSWER_MS / 1000 <= took < ANSWER_MS / 1000 + 1.5, (port, took)
        assert len(set(answers)) == 1, answers
        assert answers[0][:2] == (pb.LINK_FAILED, "cannot reach the next hop")
    finally:
        silent.close()
        closing.close()


def test_links_at_once_to_one_address_are_one_dial():
    """A burst of links naming one address, from sessions side by side, each for
    a fresh identity (no shared connection): one dial reaches it, and the others
    wait for its outcome instead of dialling too."""
    victim = Listener(silent=True)
    servicer = _servicer()
    start = threading.Barrier(8)
    answers = []
    fresh = [Identity.generate() for _ in range(8)]

    def one(n: int) -> None:
        link = _victim_link(victim.port, signer=fresh[n])
        start.wait(timeout=30)
        answers.extend(a.error.code for a, _ in _session(servicer, [link], f"c{n}"))

    threads = [threading.Thread(target=one, args=(n,)) for n in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(answers) == 8 and set(answers) == {pb.LINK_FAILED}
        assert victim.count() <= 1
    finally:
        victim.close()


# --- the bounds' pure core (meshnet_p2p/dataplane/link_guard.py) -------------------------------------

def test_link_attempts_are_bounded_per_client_network_and_peer_over_time():
    g = LinkGuard(LinkBounds(per_network=(4, 1.0), per_client=(2, 0.5), per_peer=(6, 2.0)))
    assert [g.admit("net-a", "alice", 0.0) for _ in range(3)] == [True, True, False]  # alice's own burst
    assert g.admit("net-a", "bob", 0.0) and g.admit("net-a", "carol", 0.0)  # new identities, one network...
    assert not g.admit("net-a", "dave", 0.0)  # ...share its bound
    assert g.admit("net-b", "erin", 0.0) and g.admit("net-b", "frank", 0.0)  # another network: the peer's bound
    assert not g.admit("net-c", "grace", 0.0)
    assert not g.admit("net-a", "alice", 1.0)  # the peer's bucket has refilled some, alice's not yet
    assert g.admit("net-a", "alice", 2.0)  # half a token a second: one again after two seconds
    # anonymous clients share one client bucket per network
    assert [g.admit("net-c", None, 2.0) for _ in range(3)] == [True, True, False]


def test_a_target_that_failed_is_left_alone_doubling_and_a_reached_one_at_once():
    g = LinkGuard(LinkBounds(backoff_s=10.0, max_backoff_s=25.0, max_tracked=3))
    assert g.may_dial("v", 0.0)
    g.failed("v", 0.0)
    assert not g.may_dial("v", 9.9) and g.may_dial("v", 10.0)
    g.failed("v", 10.0)  # again soon after: twice as long
    assert not g.may_dial("v", 29.9) and g.may_dial("v", 30.0)
    g.failed("v", 30.0)
    assert not g.may_dial("v", 54.9) and g.may_dial("v", 55.0)  # capped
    g.reached("v")
    assert g.may_dial("v", 55.0)
    g.failed("v", 1000.0)  # long after: from the start again
    assert g.may_dial("v", 1010.0)
    for t in "abcd":  # the table is bounded: the oldest go
        g.failed(t, 1001.0)
    assert len(g._failed) <= 3 and not g.may_dial("d", 1002.0)


def test_a_link_dials_the_reports_address_or_its_relay_and_the_tail_links_only_to_a_head():
    from meshnet_p2p.dataplane.ring import ReportRefused, next_hop

    def link(report: bytes) -> pb.LinkSignal:
        return pb.LinkSignal(peer_id=str(ATTACKER.peer_id), next_report=report, session_id="x" * 32,
                             attach_token=b"t" * 32)

    hop = next_hop(link(_report(7001)), now_ms=wall_ms(), model_digest=MODEL, recipe_digest=RECIPE, end=20, total=30)
    assert (hop.address, hop.relay, hop.target) == (("127.0.0.1", 7001), None, ("tcp", "127.0.0.1", 7001))
    now = wall_ms()
    relayed = CapabilityReport(MODEL, RECIPE, (0, 10), (f"/ip4/127.0.0.2/tcp/4001/p2p/{HOP.peer_id}/p2p-circuit/p2p/"
                                                        f"{ATTACKER.peer_id}",), throughput=1.0,
                               relay=f"/ip4/127.0.0.2/tcp/4001/p2p/{HOP.peer_id}",
                               tls_cert=_attacker_cert().decode()).sign(ATTACKER, seq=now, now_ms=now)
    tail = dict(now_ms=now, model_digest=MODEL, recipe_digest=RECIPE, end=30, total=30)
    hop = next_hop(link(relayed), **tail)  # the tail feeds a head, through the relay its report names
    assert (hop.address, hop.relay) == (None, ("127.0.0.2", 4001))
    assert hop.target == ("relay", "127.0.0.2", 4001, str(ATTACKER.peer_id))
    with pytest.raises(ReportRefused):
        next_hop(link(_report(7001)), **tail)  # layers 20-30: no head
