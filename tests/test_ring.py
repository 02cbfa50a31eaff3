"""The ring's peer side over real sockets (docs/ring.md): attach streams that
need the session's secret, links checked before any dial, and steps of an
older route that never reach the client. `meshnet-peer serve` processes with
real llama.cpp shards; the ring's failover end to end is in test_e2e.py."""

import contextlib
import os
import socket
import time

import pytest

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.dataplane.client import ShardError, open_attach
from meshnet_p2p.dataplane.ring import MAX_LINKS_PER_SESSION
from meshnet_p2p.identity import Identity

from .test_dataplane import Served, hidden


@pytest.fixture(scope="module")
def middle(shard_dir):
    s = Served(shard_dir[(10, 20)], "--max-sessions", "4")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def other(shard_dir):
    s = Served(shard_dir[(20, 30)], "--max-sessions", "2")
    yield s
    assert s.stop() == 0


def _attach(served, session_id: str, token: bytes, epoch: int = 0):
    """A raw attach stream, as the ring's previous hop opens one; returns it and the first reply."""
    c = served.client(timeout=30)
    call, first = open_attach(c.channel, session_id, token, epoch, 30)
    return c, call, first


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


def _send_step(call, position: int, epoch: int = 0, rows: int = 1) -> None:
    step = pb.Step(idempotency_step=position + 1, route_epoch=epoch, position=position, decode=rows == 1)
    from meshnet_p2p.dataplane.tensors import bundle_to_proto

    bundle_to_proto(hidden(rows, seed=position), out=step.hidden)
    call.send(pb.SessionRequest(step=step).SerializeToString())


def _link(served, **fields) -> pb.LinkSignal:
    base = dict(route_epoch=0, peer_id=str(served.peer_id), address=str(served.addr), tls_cert=served.cert,
                session_id="x" * 32, attach_token=b"t" * 32, forward_until=100)
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
        _send_step(call, 0, rows=3)  # the ring's previous hop feeds it...
        copy = owner.next_result(0, timeout=30)  # ...and the owner gets the copy
        assert copy.position == 3 and copy.hidden.tensors[0].shape == (3, 576)
        assert copy.raw.result.route_epoch == 0
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
        _send_step(call, 0)
        assert owner.next_result(0, timeout=30).position == 1
        # the client fails over: a rollback on a newer route
        owner.signal(pb.SessionRequest(rollback=pb.RollbackSignal(position=0, route_epoch=1)), 1, timeout=30)
        _send_step(call, 0, epoch=0)  # the old route's step, still on its way
        reply = pb.SessionResponse.FromString(call.recv(deadline=time.monotonic() + 30))
        assert reply.error.code == pb.EPOCH_STALE
        a.close()
        owner.route_epoch = 1
        # the owner's next message is the answer to its own next step: nothing of the old route came
        r = owner.step(0, hidden=hidden(1), idempotency_step=1, decode=True, timeout=30)
        assert r.position == 1 and r.raw.result.route_epoch == 1
        owner.release()


def test_a_link_is_checked_before_any_dial_and_bounded(middle, other):
    c = middle.client()
    fp = c.capability().fingerprint
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # a port where nothing listens
    stranger = Identity.generate().peer_id
    try:
        with c.session(fp, max_tokens=64, attach_token=os.urandom(32)) as owner:
            cases = [
                (_link(other, peer_id=str(stranger)), "certificate belongs to another peer"),
                (_link(other, peer_id="not a peer id"), "no valid peer id"),
                (_link(other, tls_cert=b"garbage"), "not a peer certificate"),
                (_link(other, address="/ip4/127.0.0.1/udp/4001"), "not a TCP address"),
                (_link(other, address="nonsense"), "not a multiaddr"),
                (_link(other, address=f"/ip4/127.0.0.1/tcp/{port}/p2p/{middle.peer_id}"), "names another peer"),
                (_link(other, attach_token=b""), "no usable attach token"),
                (_link(other, address=f"/ip4/127.0.0.1/tcp/{port}"), "cannot reach the next hop"),
                (_link(other), "refused to attach"),  # a real peer, but no session there takes this secret
            ]
            for msg, why in cases:
                t0 = time.monotonic()
                with pytest.raises(ShardError) as e:
                    owner.signal(pb.SessionRequest(link=msg), 0, timeout=30)
                assert e.value.code_name == "LINK_FAILED" and why in e.value.detail, (why, e.value.detail)
                assert time.monotonic() - t0 < 10
            for _ in range(MAX_LINKS_PER_SESSION - len(cases)):
                with pytest.raises(ShardError):
                    owner.signal(pb.SessionRequest(link=_link(other)), 0, timeout=30)
            with pytest.raises(ShardError) as e:  # a session's dials are bounded: then no more
                owner.signal(pb.SessionRequest(link=_link(other)), 0, timeout=30)
            assert e.value.code_name == "INVALID_ARGUMENT" and "linked at most" in e.value.detail
            owner.signal(pb.SessionRequest(rollback=pb.RollbackSignal(position=0, route_epoch=2)), 2, timeout=30)
            with pytest.raises(ShardError) as e:  # and a stale route's link is refused outright
                owner.signal(pb.SessionRequest(link=_link(other, route_epoch=1)), 2, timeout=30)
            assert e.value.code_name == "EPOCH_STALE"
            owner.route_epoch = 2
            assert owner.step(0, hidden=hidden(2), timeout=30).position == 2  # the session serves on
            owner.release()
        with pytest.raises(ShardError) as e:  # an attach secret is at most 32 bytes
            c.session(fp, max_tokens=64, attach_token=b"t" * 33)
        assert e.value.code_name == "INVALID_ARGUMENT"
    finally:
        c.close()


# --- whom a failed link blames (the client's side, with stand-in hops) ------------------------------------

class _Stream:
    def __init__(self, answer=None) -> None:
        self.answer = answer  # what a link signal raises (None: it is acknowledged)
        self.session_id = "s" * 32

    def signal(self, request, epoch, timeout=None):
        if self.answer is not None:
            raise self.answer
        return pb.SessionResponse(ack=pb.Ack())


class _Peer:
    def __init__(self, alive: bool) -> None:
        self.alive = alive  # whether its session takes an attach from the client

    def can_attach(self, session_id, attach_token, route_epoch, timeout) -> bool:
        return self.alive


def _route(hops):
    from meshnet_p2p.client import RouteSession, _Hop
    from meshnet_p2p.placement import Span

    route = object.__new__(RouteSession)  # only what _link_ring reads
    route.epoch, route.step_timeout, route.max_tokens, route.stop_at_eog = 0, 1.0, 64, True

    class _Record:
        content = {"tls_cert": "", "addrs": ["/ip4/127.0.0.1/tcp/1"]}

    route.hops = [_Hop(Span(f"peer{i}", i * 10, i * 10 + 10, record=_Record()), _Peer(alive), stream, 64,
                       attach_token=b"t" * 32) for i, (stream, alive) in enumerate(hops)]
    return route


def test_a_hop_that_cannot_reach_a_live_next_hop_is_the_one_at_fault():
    """A link refused as LINK_FAILED blames the next hop only if it will not take the
    attach from this client either: a hop that claims every successor unreachable
    (or whose own network fails it) is replaced itself, instead of spending
    failovers on them; a next hop that answers but never attaches is the one at
    fault (test_hostile's lying grpcio peer)."""
    def link_failed():
        return ShardError(pb.Error(code=pb.LINK_FAILED, detail="cannot reach the next hop"))

    assert _route([(_Stream(link_failed()), True), (_Stream(), True)])._link_ring()[0] == 0  # next hop takes ours
    assert _route([(_Stream(link_failed()), True), (_Stream(), False)])._link_ring()[0] == 1  # it takes nobody's
    full = ShardError(pb.Error(code=pb.CAPACITY, detail="no worker", retryable=True))
    assert _route([(_Stream(), True), (_Stream(full), True), (_Stream(), True)])._link_ring()[0] == 2  # busy next
    assert _route([(_Stream(), True), (_Stream(), True)])._link_ring() is None
