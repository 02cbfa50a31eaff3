"""The ring's peer side over real sockets (docs/ring.md): attach streams that
need the session's secret, links checked before any dial, and steps of an
older route that never reach the client. `meshnet-peer serve` processes with
real llama.cpp shards; the ring's failover end to end is in test_e2e.py."""

import contextlib
import dataclasses
import os
import socket
import time

import pytest

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.dataplane.stub import ShardClient, ShardError, open_attach, open_channel
from meshnet_p2p.dataplane.wire import WireCommitment, bundle_to_proto, commitment_to_proto
from meshnet_p2p.trust.commitment import Commitment, hidden_digest
from meshnet_p2p.dataplane.ring import MAX_LINKS_PER_SESSION
from meshnet_p2p.swarm.capability import CapabilityReport
from meshnet_p2p.dataplane.transport.tls import make_client_credentials, make_tls_credentials
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import wall_ms

from tests.test_dataplane import Served, hidden


@pytest.fixture(scope="module")
def middle(shard_dir):
    s = Served(shard_dir[(10, 20)], "--max-sessions", "4")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def other(shard_dir, tmp_path_factory):
    identity = Identity.generate()  # its key: the test signs its reports, as its join would
    key = str(tmp_path_factory.mktemp("other") / "identity.key")
    identity.save(key)
    s = Served(shard_dir[(20, 30)], "--max-sessions", "2", "--identity", key)
    s.identity = identity
    yield s
    assert s.stop() == 0


FEEDER = Identity.from_seed(b"\x71" * 32)  # the ring's previous hop (layers 0-10) these tests play
_FEEDER_CREDS: dict = {}


def _attach(served, session_id: str, token: bytes, epoch: int = 0, identity: Identity = FEEDER):
    """A raw attach stream, as the ring's previous hop opens one (presenting its
    identity, as a ring link does); returns it and the first reply."""
    creds = _FEEDER_CREDS.get(identity) or _FEEDER_CREDS.setdefault(identity, make_client_credentials(identity))
    c = ShardClient(open_channel(served.cert, address=(served.addr.host, served.addr.port), client=creds),
                    timeout=30)
    call, first = open_attach(c.channel, session_id, token, epoch, 30)
    return c, call, first


def upstream(fp, position: int, bundle, epoch: int = 0, *, signer: Identity = FEEDER, rows: int = 1,
             output=None) -> Commitment:
    """The previous hop's signed commitment to the step whose output is ``bundle`` (or ``output``)."""
    out = hidden_digest(position, bundle) if output is None else output
    return Commitment(str(signer.peer_id), "f" * 32, fp.model_digest, fp.recipe_digest, 0, 10, epoch, 0,
                      position, rows == 1, b"\1" * 32, out).signed_by(signer)


@contextlib.contextmanager
def _owner(served):
    """A client's session on ``served`` that a ring may attach to: (client, its stream, the secret)."""
    c = served.client()
    token = os.urandom(32)
    try:
        with c.session(c.capability().fingerprint, max_tokens=64, attach_token=token) as owner:
            yield c, owner, token
    finally:
        c.close()


def _send_step(call, position: int, epoch: int = 0, rows: int = 1, fp=None, commitment=None) -> None:
    """Forward a step as the previous hop does: with its commitment (signed by FEEDER, given ``fp``)."""
    step = pb.Step(idempotency_step=position + 1, route_epoch=epoch, position=position, decode=rows == 1)
    given = hidden(rows, seed=position)
    bundle_to_proto(given, out=step.hidden)
    if commitment is None and fp is not None:
        commitment = upstream(fp, position, given, epoch, rows=rows)
    if isinstance(commitment, pb.StepCommitment):  # as it comes over the wire: perhaps malformed
        step.upstream.CopyFrom(commitment)
    elif commitment is not None:
        commitment_to_proto(commitment, step.upstream, forwarded=True)
    call.send(pb.SessionRequest(step=step).SerializeToString())


def _report(identity: Identity, addr: str, cert: bytes, fp: pb.Fingerprint, layers=(20, 30), **kw) -> bytes:
    """A signed capability report, as a peer announces it (and a client plans from it)."""
    now = wall_ms()
    return CapabilityReport(fp.model_digest, fp.recipe_digest, layers, (addr,), throughput=1.0,
                            tls_cert=cert.decode(), **kw).sign(identity, seq=now, now_ms=now)


def _link(served, fp: pb.Fingerprint, **fields) -> pb.LinkSignal:
    base = dict(route_epoch=0, peer_id=str(served.peer_id), session_id="x" * 32, attach_token=b"t" * 32,
                forward_until=100, next_report=_report(served.identity, str(served.addr), served.cert, fp))
    base.update(fields)
    return pb.LinkSignal(**base)


def test_an_attach_needs_the_sessions_secret_and_feeds_its_owner(middle):
    with _owner(middle) as (c, owner, token):
        for sid, tok in [(owner.session_id, os.urandom(32)), (owner.session_id, b""), ("no-such-session", token)]:
            a, _, first = _attach(middle, sid, tok)
            # one answer for a wrong secret and an unknown session: it tells a stranger nothing
            assert first.error.code == pb.UNKNOWN_SESSION and first.error.terminal
            assert first.error.detail == "no session here takes this attach"
            a.close()
        # what a client checks before it blames a next hop for a refused link
        assert c.can_attach(owner.session_id, token, 0, timeout=10)
        assert not c.can_attach(owner.session_id, os.urandom(32), 0, timeout=10)
        assert not c.can_attach(owner.session_id, token, 1, timeout=10)  # not this route's epoch
        a, call, first = _attach(middle, owner.session_id, token)
        assert first.HasField("accepted")
        fp = c.capability().fingerprint
        _send_step(call, 0, rows=3, fp=fp)  # the ring's previous hop feeds it...
        copy = owner.next_result(0, timeout=30)  # ...and the owner gets the copy
        assert copy.position == 3 and copy.hidden.tensors[0].shape == (3, 576)
        assert copy.raw.result.route_epoch == 0
        # with the commitment it was taken with, whole, and its own to what it took in
        sent = upstream(fp, 0, hidden(3, seed=0), rows=3)
        assert copy.upstream == WireCommitment(sent.index, sent.input_digest, sent.output_digest, sent.signature,
                                               sent.prev, sent.session_id, 0, 10, 0, False)
        assert copy.commitment.input_digest == sent.output_digest
        # an attach stream carries steps and credit only
        call.send(pb.SessionRequest(release=pb.ReleaseSignal()).SerializeToString())
        reply = pb.SessionResponse.FromString(call.recv(deadline=time.monotonic() + 30))
        assert reply.error.code == pb.PROTOCOL and reply.error.terminal
        a.close()
        # the owner's session is whole: it steps on from where the ring left it
        # (a ring's steps are numbered by position, whoever feeds them)
        assert owner.step(3, hidden=hidden(1), decode=True, idempotency_step=4).position == 4
        owner.release()


def test_a_step_of_an_older_route_is_refused_and_never_reaches_the_owner(middle):
    with _owner(middle) as (c, owner, token):
        a, call, first = _attach(middle, owner.session_id, token)
        assert first.HasField("accepted")
        fp = c.capability().fingerprint
        _send_step(call, 0, fp=fp)
        assert owner.next_result(0, timeout=30).position == 1
        # the client fails over: a rollback on a newer route
        owner.signal(pb.SessionRequest(rollback=pb.RollbackSignal(position=0, route_epoch=1)), 1, timeout=30)
        _send_step(call, 0, epoch=0, fp=fp)  # the old route's step, still on its way
        reply = pb.SessionResponse.FromString(call.recv(deadline=time.monotonic() + 30))
        assert reply.error.code == pb.EPOCH_STALE
        a.close()
        owner.route_epoch = 1
        # the owner's next message is the answer to its own next step: nothing of the old route came
        r = owner.step(0, hidden=hidden(1), idempotency_step=1, decode=True, timeout=30)
        assert r.position == 1 and r.raw.result.route_epoch == 1
        owner.release()


def test_a_forwarded_step_is_taken_only_as_its_previous_hop_committed_to_it(middle):
    """A hop that forwards one thing and commits to another (or commits to nothing,
    or in another peer's name, or sends a malformed commitment) is refused with
    UPSTREAM_MISMATCH, on the attach stream and to the owner, before the step
    counts (a signature that fails is found after the step computed and forwarded,
    off the token's path, and the step is undone): the step is still free, and the
    stream and session serve on, from the same position."""
    import dataclasses

    stranger = Identity.from_seed(b"\x72" * 32)
    with _owner(middle) as (c, owner, token):
        fp = c.capability().fingerprint
        a, call, first = _attach(middle, owner.session_id, token)
        assert first.HasField("accepted")
        honest = upstream(fp, 0, hidden(1, seed=0))
        cheats = {
            "none": None,
            "other output": upstream(fp, 0, hidden(1, seed=0), output=hidden_digest(0, hidden(1, seed=9))),
            "another signer": upstream(fp, 0, hidden(1, seed=0), signer=stranger),
            "other layers": dataclasses.replace(honest, end=15).signed_by(FEEDER),
            "bad signature": dataclasses.replace(honest, signature=bytes(64)),
            "another epoch": upstream(fp, 0, hidden(1, seed=0), epoch=1),
        }
        # malformed on the wire: refused as the request's error, the stream and session go on
        wire = commitment_to_proto(honest, pb.StepCommitment(), forwarded=True)
        malformed = {
            "short output digest": dict(output_digest=honest.output_digest[:31]),
            "long input digest": dict(input_digest=b"\1" * 33),
            "no prev": dict(prev=b""),
            "short signature": dict(signature=honest.signature[:63]),
            "huge index": dict(index=2**64 - 1),
            "huge position": dict(position=2**63),
            "long session id": dict(session_id="s" * 5000),
        }
        for why, change in malformed.items():
            bad = pb.StepCommitment()
            bad.CopyFrom(wire)
            for name, value in change.items():
                setattr(bad, name, value)
            cheats[why] = bad
        for why, commitment in cheats.items():
            _send_step(call, 0, commitment=commitment)
            reply = pb.SessionResponse.FromString(call.recv(deadline=time.monotonic() + 30))
            assert reply.error.code == pb.UPSTREAM_MISMATCH and not reply.error.terminal, why
            if why in malformed:
                assert "malformed" in reply.error.detail, (why, reply.error.detail)
            with pytest.raises(ShardError) as e:  # the owner hears of it: its client blames the hop before
                owner.next_result(0, timeout=30)
            assert e.value.code_name == "UPSTREAM_MISMATCH", why
        _send_step(call, 0, commitment=honest)  # nothing counted: the honest step is taken
        assert owner.next_result(0, timeout=30).upstream.signature == honest.signature
        a.close()
        owner.release()


def test_a_link_is_checked_before_any_dial_and_bounded(middle, other):
    c = middle.client()
    fp = c.capability().fingerprint
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # a port where nothing listens
    stranger = Identity.generate()
    stranger_cert = make_tls_credentials(stranger).cert_pem
    closed = f"/ip4/127.0.0.1/tcp/{port}/p2p/{stranger.peer_id}"
    try:
        with c.session(fp, max_tokens=64, attach_token=os.urandom(32)) as owner:
            honest = _link(other, fp).next_report
            cases = [  # refused before any dial: the message's own fault
                (_link(other, fp, peer_id=str(stranger.peer_id)), "INVALID_ARGUMENT", "signed by another peer"),
                (_link(other, fp, next_report=b""), "INVALID_ARGUMENT", "no report of the next hop"),
                (_link(other, fp, next_report=honest[:-1] + bytes([honest[-1] ^ 1])), "INVALID_ARGUMENT",
                 "bad-signature"),
                (_link(other, fp, next_report=_report(other.identity, str(other.addr), other.cert, fp, layers=(10, 20))),
                 "INVALID_ARGUMENT", "does not start where"),
                (_link(other, fp, next_report=_report(other.identity, str(other.addr), other.cert, fp,
                                                      departing=True)), "INVALID_ARGUMENT", "leaving"),
                (_link(other, fp, next_report=_report(other.identity, str(other.addr), stranger_cert, fp)),
                 "INVALID_ARGUMENT", "certificate of no peer or another"),
                (_link(other, fp, attach_token=b""), "INVALID_ARGUMENT", "no usable attach token"),
                # what the report binds is dialled, and fails: one answer, whatever was there
                (_link(other, fp, next_report=_report(stranger, closed, stranger_cert, fp),
                       peer_id=str(stranger.peer_id)), "LINK_FAILED", "cannot reach the next hop"),
                (_link(other, fp), "LINK_FAILED", "refused to attach"),  # a real peer, but no session takes this secret
            ]
            for msg, code, why in cases:
                t0 = time.monotonic()
                with pytest.raises(ShardError) as e:
                    owner.signal(pb.SessionRequest(link=msg), 0, timeout=30)
                assert e.value.code_name == code and why in e.value.detail, (why, e.value.detail)
                assert time.monotonic() - t0 < 10
            for _ in range(MAX_LINKS_PER_SESSION - len(cases)):
                with pytest.raises(ShardError):
                    owner.signal(pb.SessionRequest(link=_link(other, fp)), 0, timeout=30)
            with pytest.raises(ShardError) as e:  # a session's dials are bounded: then no more
                owner.signal(pb.SessionRequest(link=_link(other, fp)), 0, timeout=30)
            assert e.value.code_name == "INVALID_ARGUMENT" and "linked at most" in e.value.detail
            owner.signal(pb.SessionRequest(rollback=pb.RollbackSignal(position=0, route_epoch=2)), 2, timeout=30)
            with pytest.raises(ShardError) as e:  # and a stale route's link is refused outright
                owner.signal(pb.SessionRequest(link=_link(other, fp, route_epoch=1)), 2, timeout=30)
            assert e.value.code_name == "EPOCH_STALE"
            owner.route_epoch = 2
            assert owner.step(0, hidden=hidden(2), timeout=30).position == 2  # the session serves on
            owner.release()
        with pytest.raises(ShardError) as e:  # an attach secret is at most 32 bytes
            c.session(fp, max_tokens=64, attach_token=b"t" * 33)
        assert e.value.code_name == "INVALID_ARGUMENT"
    finally:
        c.close()


def test_a_link_on_a_pooled_connection_that_died_while_idle_dials_anew(middle, monkeypatch):
    """Rings through one next hop share a connection to it (pool.py); one that died
    while idle (the next hop closed it to make room, a NAT dropped it) is found dead
    only by the attach written on it. That says nothing about the next hop: the link
    attaches on a new connection, instead of reporting a next hop that "did not take
    the attach" and making the client replace a healthy peer."""
    import socket as sockets

    from meshnet_p2p.dataplane import ring
    from meshnet_p2p.dataplane.transport.pool import ChannelPool

    creds = make_client_credentials(FEEDER)
    hop = ring.NextHop(middle.peer_id, middle.cert, (middle.addr.host, middle.addr.port), None)
    pool = ChannelPool()
    died = []
    real_lease = ring.lease_channel

    def lease_one_that_died(*args, **kwargs):
        channel, release = real_lease(*args, **kwargs)
        if channel.wire is not None and not died:  # the pooled one: its connection is gone now
            died.append(channel)
            channel.sock.shutdown(sockets.SHUT_WR)
        return channel, release

    try:
        warm, release = real_lease(pool, middle.cert, peer_id=middle.peer_id, client=creds, **hop.way)
        assert ShardClient(warm).health().serving
        release()  # idle in the pool, for the next ring through this hop
        monkeypatch.setattr(ring, "lease_channel", lease_one_that_died)
        with _owner(middle) as (_, owner, token):
            msg = pb.LinkSignal(route_epoch=0, session_id=owner.session_id, attach_token=token, forward_until=100)
            link = ring.RingLink(msg, hop, creds, pool)
            assert died == [warm] and link.error is None
            link.close()
            owner.release()
    finally:
        pool.close()


# --- whom a failed link blames (the client's side, with stand-in hops) ------------------------------------

class _Stream:
    def __init__(self, answer=None, *, then=()) -> None:
        self.answer = answer  # what a link signal raises (None: it is acknowledged)...
        self.then = list(then)  # ...after these, one per link signal, first
        self.session_id = "s" * 32
        self.sent = []

    def link(self, order, timeout=None):
        self.sent.append(order)
        answer = self.then.pop(0) if self.then else self.answer
        if answer is not None:
            raise answer


class _Peer:
    def __init__(self, alive: bool) -> None:
        self.alive = alive  # whether its session takes an attach from the client

    def can_attach(self, session_id, attach_token, route_epoch, timeout) -> bool:
        return self.alive


def _route(hops):
    from meshnet_p2p.client import RouteOptions
    from meshnet_p2p.route.hop import Hop
    from meshnet_p2p.route.ring import RingRoute
    from meshnet_p2p.route.search import RouteSearch
    from meshnet_p2p.swarm.placement import Span

    search = RouteSearch(lambda: [], RouteOptions(max_tokens=64, ring=True, step_timeout=1.0))

    class _Record:
        content = {"tls_cert": "", "addrs": ["/ip4/127.0.0.1/tcp/1"]}
        seq, expires_at_ms, wire = 1, wall_ms() + 60_000, b"report"

    hops = [Hop(Span(f"peer{i}", i * 10, i * 10 + 10, record=_Record()), _Peer(alive), stream, 64,
                attach_token=b"t" * 32) for i, (stream, alive) in enumerate(hops)]
    return RingRoute(hops, search, 10 * len(hops))  # no I/O: the hops are stand-ins


def test_a_hop_that_cannot_reach_a_live_next_hop_is_the_one_at_fault():
    """A link refused as LINK_FAILED blames the next hop only if it will not take the
    attach from this client either: a hop that claims every successor unreachable
    (or whose own network fails it) is replaced itself, instead of spending
    failovers on them; a next hop that answers but never attaches is the one at
    fault (test_hostile's lying grpcio peer)."""
    def link_failed():
        return ShardError(pb.Error(code=pb.LINK_FAILED, detail="cannot reach the next hop"))

    assert _route([(_Stream(link_failed()), True), (_Stream(), True)])._link()[0] == 0  # next hop takes ours
    assert _route([(_Stream(link_failed()), True), (_Stream(), False)])._link()[0] == 1  # it takes nobody's
    full = ShardError(pb.Error(code=pb.CAPACITY, detail="no worker", retryable=True))
    assert _route([(_Stream(), True), (_Stream(full), True), (_Stream(), True)])._link()[0] == 2  # busy next
    assert _route([(_Stream(), True), (_Stream(), True)])._link() is None


def test_a_peer_that_limits_our_links_is_asked_again_when_it_says_not_routed_around():
    """LINK_LIMITED bounds the links one client may ask of a peer over time (a client
    starting many short generations meets it): busy, not faulty. The client waits as
    the peer says and links again, for up to a step's timeout (1 s here) in all; only
    then is the hop routed around (as before, with no ban)."""
    def limited(after_ms: int):
        return ShardError(pb.Error(code=pb.LINK_LIMITED, detail="no more ring links for this client now",
                                   retryable=True, retry_after_ms=after_ms))

    events = []
    route = _route([(_Stream(then=[limited(100), limited(100)]), True), (_Stream(), True)])
    route.opts = dataclasses.replace(route.opts, on_event=events.append)
    t0 = time.monotonic()
    assert route._link() is None  # linked on the third ask, no fault
    assert 0.2 <= time.monotonic() - t0 < 1.0
    assert len(route.hops[0].stream.sent) == 3 and len(events) == 2
    assert "asking again in 0.1 s" in events[0]
    t0 = time.monotonic()
    stubborn = _route([(_Stream(limited(400)), True), (_Stream(), True)])
    assert stubborn._link()[0] == 0  # still limited after a step's timeout: that hop is routed around
    assert time.monotonic() - t0 < 1.5 and len(stubborn.hops[0].stream.sent) == 3  # asked at 0, 0.4, 0.8 s
    assert _route([(_Stream(limited(5_000)), True), (_Stream(), True)])._link()[0] == 0  # past the budget: at once


def test_a_link_carries_the_next_hops_newest_report():
    """The hop dials only what the report says: the client sends the newest it holds
    (a long generation outlives the report its route was planned from)."""
    from meshnet_p2p.swarm.placement import Span

    route = _route([(_Stream(), True), (_Stream(), True)])
    assert route._link() is None
    assert [h.stream.sent[0].next_report for h in route.hops] == [b"report", b"report"]
    assert route.hops[0].stream.sent[0].peer_id == "peer1"

    class _Newer:
        content = {}
        seq, expires_at_ms, wire = 2, wall_ms() + 60_000, b"newer report"

    route.search.spans = [Span("peer1", 10, 20, record=_Newer())]
    assert route._link() is None
    assert route.hops[0].stream.sent[1].next_report == b"newer report"
    assert route.hops[1].stream.sent[1].next_report == b"report"

    class _Expiring:
        content = {}
        seq, expires_at_ms, wire = 3, wall_ms() + 5_000, b"expiring report"

    class _Fresh:
        content = {}
        seq, expires_at_ms, wire = 4, wall_ms() + 120_000, b"fresh report"

    route.search.spans = [Span("peer1", 10, 20, record=_Expiring())]  # about to expire: the client surveys again
    route.search.spans_provider = lambda: [Span("peer1", 10, 20, record=_Fresh())]
    assert route._link() is None
    assert route.hops[0].stream.sent[2].next_report == b"fresh report"

    class _Leaving:
        content = {"departing": True}
        seq, expires_at_ms, wire = 5, wall_ms() + 120_000, b"leaving report"

    route.search.spans.append(Span("peer1", 10, 20, record=_Leaving()))  # it said it leaves: its session still serves
    assert route._link() is None
    assert route.hops[0].stream.sent[3].next_report == b"fresh report"


# --- whom a missing copy blames (the client's side: real session streams over scripted calls) -----------

class _Call:
    """The far end of one hop's Session call as the client sees it: what the peer has sent
    (then silence: frozen, or never given its input; or, ``ended``, the end of a peer that
    died), and with ``on_step`` what it answers a step this client sends it itself."""

    def __init__(self, *responses, ended: bool = False, on_step=None) -> None:
        self.inbox = [r.SerializeToString() for r in responses]
        self.dead = ended
        self.on_step = on_step
        self.steps = []  # positions of the steps this client sent

    def send(self, raw: bytes, **_) -> None:
        req = pb.SessionRequest.FromString(raw)
        if req.WhichOneof("kind") == "step":
            self.steps.append(req.step.position)
            if self.on_step is not None:
                self.inbox.append(self.on_step.SerializeToString())

    def wait_readable(self, timeout: float) -> bool:
        return bool(self.inbox) or self.dead  # at once: what never comes never will

    def recv(self, deadline=None):
        from meshnet_p2p.dataplane.transport.channel import ChannelError

        if self.inbox:
            return self.inbox.pop(0)
        if self.dead:
            raise ChannelError("UNAVAILABLE", "the peer closed the connection")
        raise ChannelError("DEADLINE_EXCEEDED", "no answer before the deadline")

    def ended(self) -> bool:
        return self.dead

    def cancel(self) -> None:
        pass


def _session(call: _Call):
    """A SessionStream already open (as open_session leaves it) on ``call``."""
    import itertools

    from meshnet_p2p.dataplane.stub import SessionStream

    s = object.__new__(SessionStream)
    s.session_id, s.route_epoch, s.record, s.responses = "s" * 32, 0, False, []
    s._steps, s._held, s._call = itertools.count(1), None, call
    s.granted = pb.FlowControl(credits=64)
    s.credits = 64
    return s


def _copy(position: int, *, tail: bool = False, epoch: int = 0) -> pb.SessionResponse:
    """A hop's copy of the decode step at ``position`` (the tail's: a token)."""
    from types import SimpleNamespace

    from meshnet_p2p.dataplane.wire import reply_result

    return reply_result(f"w{position + 1}", position + 1, position + 1, epoch,
                        token=SimpleNamespace(token_id=42, is_eog=False) if tail else None,
                        hidden=None if tail else hidden(1, seed=position))


DUPLICATE = pb.SessionResponse(ack=pb.Ack(work_id="w8", idempotency_step=8, duplicate=True))


class _Blamed(Exception):
    pass


def _blamed(calls, position: int = 7, epoch: int = 0) -> int:
    """The index of the hop a ring's step at ``position`` of route ``epoch`` blames, the
    tail having fed it (its recovery is replaced by a note of the fault)."""
    route = _route([(_session(c), True) for c in calls])
    route._ring_next = position  # the tail sent its token on as this step
    route.epoch = epoch
    for hop in route.hops:
        hop.stream.route_epoch = epoch

    def recover(_position, fault):
        raise _Blamed(fault)

    route._recover = recover
    with pytest.raises(_Blamed) as e:
        route.step(position, (42,), True)
    return e.value.args[0][0]


@pytest.mark.parametrize("died", ["tail", "middle", "head"])
def test_a_hop_that_died_after_its_copy_is_blamed_not_the_next_one_it_never_fed(died):
    """A hop may send its copy before its whole forward (what the next hop's window held
    back goes after it: dataplane/steps.py). Killed in between, its copy is here but
    the next hop never gets its input: that one's copy is late through no fault of its own.
    The tail's case is the run of test_e2e's tail-kill that failed (the client kills the
    tail from on_token, right after reading its copy): the head, whose copy never came,
    was banned, and it had no twin."""
    if died == "tail":  # the head would answer a step this client gave it; the tail is gone
        calls = [_Call(on_step=_copy(7)), _Call(_copy(7)), _Call(ended=True)]
    elif died == "middle":  # its copy came, then its end; the tail was never fed
        calls = [_Call(_copy(7)), _Call(_copy(7), ended=True), _Call()]
    else:
        calls = [_Call(_copy(7), ended=True), _Call(), _Call()]
    assert _blamed(calls) == ["head", "middle", "tail"].index(died)


def test_a_late_hop_is_blamed_when_no_hop_died():
    """A frozen hop (its connection alive) is blamed for its own late copy; a tail frozen
    after its copy, before its forward, is found by feeding the head ourselves: the head
    answers, the tail then does not."""
    assert _blamed([_Call(_copy(7)), _Call(), _Call()]) == 1
    head = _Call(on_step=_copy(7))
    assert _blamed([head, _Call(_copy(7)), _Call()]) == 2
    assert head.steps == [7]


def test_a_duplicate_steps_acknowledgement_never_stands_for_a_copy_or_a_signals_answer():
    """When the ring fed the head before the step this client fed it, the head acknowledges
    ours as a duplicate after its copy. At the next step that acknowledgement is not the
    head's copy (the head is late only if no copy of its own comes), nor is a copy of an
    older route, and in a recovery it is not the answer to a rollback or a link (each
    would take the one meant for the one before, and a link's failure would surface as a
    step's)."""
    assert _blamed([_Call(DUPLICATE), _Call(), _Call(ended=True)]) == 2  # the tail died: not the head
    assert _blamed([_Call(_copy(7, epoch=0)), _Call(), _Call(ended=True)], epoch=1) == 2
    call = _Call(DUPLICATE, pb.SessionResponse(ack=pb.Ack()))
    _session(call).rollback(7, 1, b"t" * 32, timeout=1.0)
    assert call.inbox == []  # it took its own answer, not the duplicate's


def test_a_hop_forwards_before_its_copy_and_writes_what_the_window_held_back_after_it():
    """The forward is on the token's path and the client's copy is not: the forward is
    written first, as far as the next hop's window admits (RingLink.forward does not
    wait), then the copy, then the rest (flush). A next hop that holds its window shut
    delays only the flush, never the copy the client judges this hop by."""
    from types import SimpleNamespace as NS

    from meshnet_p2p.dataplane.steps import Steps

    order: list[str] = []

    class Link:
        epoch, forward_until, stop_at_eog = 1, 100, False

        def forward(self, *args, **kw):
            order.append("forward")
            return True

        def flush(self):
            order.append("flush")
            return True

    state = NS(epoch=1, ring=NS(link=Link(), push=lambda r: order.append("copy")))
    steps = Steps(None, caps=NS(start=10, end=20), limits=None, stats=None, now_ms=None, identity=None, peer_id="p")
    step = NS(route_epoch=1, position=7, decode=True)
    result = NS(token=None, position=8)
    response = NS(result=NS(hidden=b"h"))
    link = steps._forward(state, step, result, response, None)
    assert steps._answer(state, step, response, True, link) is None
    assert order == ["forward", "copy", "flush"]
    order.clear()  # a step of an older route forwards nothing, and its copy still goes
    assert steps._forward(state, NS(route_epoch=0, position=7, decode=True), result, response, None) is None
