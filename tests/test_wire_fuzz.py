"""Property tests for the data plane's parsers of network input."""

import numpy as np
import trio
from hypothesis import given
from hypothesis import strategies as st

from meshnet_p2p._proto import shard_runtime_pb2 as pb
from meshnet_p2p.nat.relay import Relay
from meshnet_p2p.dataplane.wire import PayloadError, bundle_from_proto, bundle_to_proto, crc32c
from meshnet_p2p.engine.contract import HIDDEN, Tensor, TensorBundle
from meshnet_p2p.core.identity import Identity

fragment = st.builds(lambda off, data: pb.Fragment(byte_offset=off, payload=data), st.integers(0, 5000), st.binary(max_size=300))
tensor = st.builds(
    lambda name, dtype, shape, total, frags, crc: pb.TensorData(name=name, dtype=dtype, shape=shape, total_bytes=total,
                                                                fragments=frags, crc32c=crc),
    st.sampled_from(["hidden", "", "x"]), st.sampled_from(["f32", "f16", "bf16", "q4", ""]),
    st.lists(st.integers(0, 2000), max_size=4), st.integers(0, 6000), st.lists(fragment, max_size=6),
    st.integers(0, 2**32 - 1),
)


@given(st.lists(tensor, max_size=10))
def test_any_bundle_either_parses_exactly_or_is_refused(tensors):
    msg = pb.TensorBundle(tensors=tensors)
    try:
        bundle = bundle_from_proto(msg)
    except PayloadError:
        return
    for t, td in zip(bundle.tensors, msg.tensors, strict=True):
        assert crc32c(t.data) == td.crc32c and len(t.data) == td.total_bytes


@given(st.integers(1, 40), st.integers(100, 100_000))
def test_fragmented_bundles_round_trip(rows, fragment_bytes):
    data = np.arange(rows * 576, dtype=np.float32).tobytes()
    bundle = TensorBundle((Tensor(HIDDEN, "f32", (rows, 576), data),))
    assert bundle_from_proto(bundle_to_proto(bundle, fragment_bytes)).tensors[0].data == data


async def test_relay_survives_junk_and_keeps_serving():
    relay = Relay(Identity.generate())
    junk = [b"\x00" * 100 + b"\n", b"CONNECT\n\n", b"CONNECT nothing HTTP/1.1\r\n" + b"X: y\r\n" * 100 + b"\r\n",
            b"MESHNET-RESERVE not-a-peer zz\n", b"MESHNET-ATTACH deadbeef\n", b"A" * 20000, b"MESHNET-RESERVE\n"]
    async with trio.open_nursery() as nursery:
        port = await nursery.start(relay.serve, "127.0.0.1", 0)
        for data in junk:
            s = await trio.open_tcp_stream("127.0.0.1", port)
            try:
                await s.send_all(data)
                with trio.move_on_after(2):
                    while await s.receive_some(1000):
                        pass
            except trio.BrokenResourceError:
                pass
            await s.aclose()
        # a well-formed reservation still works afterwards
        from meshnet_p2p.nat.relay import reserve
        from meshnet_p2p.core.multiaddr import Multiaddr

        control, _ = await reserve(Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{port}/p2p/{relay.identity.peer_id}"), Identity.generate())
        assert len(relay.reservations) == 1
        await control.aclose()
        nursery.cancel_scope.cancel()
