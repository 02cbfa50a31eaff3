"""Channels shared between sessions (meshnet_p2p/dataplane/pool.py), with a
stand-in for a channel: what the pool looks at is whether it is broken."""

from meshnet_p2p.dataplane.transport.pool import ChannelPool


class _Wire:
    goaway = None
    closed = False


class FakeChannel:
    def __init__(self) -> None:
        self.broken = None
        self.wire = _Wire()
        self.closed = 0

    def close(self) -> None:
        self.closed += 1
        self.broken = "closed"

    def read_once(self, timeout, *, unless_waiters=False) -> None:
        pass  # an idle channel is read before reuse: nothing came on this one


def test_sessions_to_one_peer_share_a_channel_up_to_its_share_of_calls():
    pool = ChannelPool(per_channel=2)
    made = []

    def make():
        made.append(FakeChannel())
        return made[-1]

    a, ra = pool.lease("peer", make)
    b, rb = pool.lease("peer", make)
    c, rc = pool.lease("peer", make)  # the first carries two already: a second channel
    other, ro = pool.lease("other peer", make)
    assert a is b and c is not a and other not in (a, c) and len(made) == 3
    ra()
    ra()  # giving back twice counts once
    d, rd = pool.lease("peer", make)
    assert d is a  # room again on the first
    for release in (rb, rc, rd, ro):
        release()
    e, re_ = pool.lease("peer", make)
    assert e in (a, c) and not any(ch.closed for ch in made)  # idle ones are kept for reuse
    re_()
    pool.close()
    assert all(ch.closed == 1 for ch in made)


def test_a_broken_channel_is_never_handed_out_and_closed_once_idle():
    pool = ChannelPool()
    first, release = pool.lease("peer", FakeChannel)
    first.broken = "the peer closed the connection"
    second, release2 = pool.lease("peer", FakeChannel)
    assert second is not first and first.closed == 0  # still leased: its user finds out for itself
    release()
    assert first.closed == 1
    second.wire.goaway = object()  # the peer is going away: no new calls on it
    third, release3 = pool.lease("peer", FakeChannel)
    assert third not in (first, second)
    release2()
    release3()
    pool.close()


def test_an_idle_channel_old_enough_to_be_closing_is_not_reused():
    pool = ChannelPool(reuse_idle_s=0.0)  # any idle time is too long
    first, release = pool.lease("peer", FakeChannel)
    release()
    second, release2 = pool.lease("peer", FakeChannel)
    assert second is not first and first.closed == 1
    release2()
    capped = ChannelPool(max_idle=1)
    chans = [capped.lease(k, FakeChannel) for k in ("a", "b", "c")]
    for _, r in chans:
        r()
    capped.lease("d", FakeChannel)  # a lease sweeps: only the newest idle one is kept
    assert [ch.closed for ch, _ in chans] == [1, 1, 0]
    pool.close()
    capped.close()


def test_first_contact_on_a_pooled_connection_the_peer_just_closed_tries_a_new_one(shard_dir, load_engine, monkeypatch):
    """The keep-alive race, end to end (bench/wan.py, 2026-12-03: a route's only
    head banned for "connection lost: Broken pipe"): a client's pooled channel sits
    idle; the peer closes it to make room while the next first contact leases it, so
    the GOAWAY crosses the contact's first call. That says nothing about the peer:
    the contact tries once more on a new connection and succeeds."""
    import select
    import socket
    from types import SimpleNamespace

    from meshnet_p2p.route import hop
    from meshnet_p2p.route.options import PeerMeasures, RouteOptions
    from meshnet_p2p.core.identity import Identity
    from meshnet_p2p.dataplane.servicer import ShardRuntimeServicer
    from meshnet_p2p.dataplane.transport.server import Server
    from meshnet_p2p.dataplane.transport.tls import make_tls_credentials
    from meshnet_p2p.swarm.placement import Span

    identity = Identity.generate()
    creds = make_tls_credentials(identity)
    srv = ShardRuntimeServicer(load_engine(shard_dir[(10, 20)])).register(
        Server(creds, max_connections_per_source=1)).start()
    pool = ChannelPool()
    newer = []
    try:
        pid = str(identity.peer_id)
        record = SimpleNamespace(content={"peer_id": pid, "tls_cert": creds.cert_pem.decode(),
                                          "addrs": [f"/ip4/127.0.0.1/tcp/{srv.port}/p2p/{pid}"]})
        span = Span(pid, 10, 20, record=record)
        opts, measures = RouteOptions(max_tokens=8, pool=pool), PeerMeasures()
        first = hop.connect(span, 10, pool=pool)
        fp = first.peer_capability().fingerprint
        record.content.update(model_digest=fp.model_digest, recipe_digest=fp.recipe_digest)
        first.close()  # idle in the pool now

        real_connect = hop.connect

        def connect_as_the_peer_gives_way(*args, **kwargs):
            client = real_connect(*args, **kwargs)
            if client.channel.wire is not None and not newer:  # the pooled one: the peer closes it now
                newer.append(socket.create_connection(("127.0.0.1", srv.port)))  # over the source's cap
                assert select.select([client.channel.sock], [], [], 10)[0]  # the GOAWAY came, unread
            return client

        monkeypatch.setattr(hop, "connect", connect_as_the_peer_gives_way)
        contact = hop.first_contact(span, opts, measures)
        assert newer and contact.cap.start == 10 and contact.client.channel is not first.channel
        contact.client.close()
    finally:
        for s in newer:
            s.close()
        pool.close()
        srv.stop(0)
