"""Test doubles for the network: an in-memory datagram network and an
in-process DHT swarm. Unit-test tools only; real sockets are the default
everywhere else.

Frozen endpoints behave like SIGSTOPped processes: their sockets stay "open"
but nothing goes in or out, so every request to them times out.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import trio

from meshnet_p2p.dht.node import DHTConfig, DHTNode
from meshnet_p2p.dht.transport import Addr
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import PayloadType


class FakeNetwork:
    def __init__(self) -> None:
        self.endpoints: dict[Addr, "FakeTransport"] = {}
        self.frozen: set[Addr] = set()
        self._next = 1

    def endpoint(self) -> "FakeTransport":
        addr = (f"10.0.{self._next // 250}.{self._next % 250 + 1}", 4001)
        self._next += 1
        t = FakeTransport(self, addr)
        self.endpoints[addr] = t
        return t

    def freeze(self, addr: Addr) -> None:
        self.frozen.add(addr)

    def thaw(self, addr: Addr) -> None:
        self.frozen.discard(addr)


class FakeTransport:
    def __init__(self, network: FakeNetwork, addr: Addr) -> None:
        self.network = network
        self.local_addr = addr
        self._send, self._recv = trio.open_memory_channel[tuple[bytes, Addr]](math.inf)

    async def send(self, data: bytes, addr: Addr) -> None:
        net = self.network
        dest = net.endpoints.get(addr)
        if dest is None or self.local_addr in net.frozen or addr in net.frozen:
            return  # like UDP: silently lost
        dest._send.send_nowait((bytes(data), self.local_addr))
        await trio.lowlevel.checkpoint()

    async def receive(self) -> tuple[bytes, Addr]:
        while True:
            data, src = await self._recv.receive()
            if self.local_addr not in self.network.frozen:
                return data, src

    def close(self) -> None:
        self.network.endpoints.pop(self.local_addr, None)


def swarm_identity(i: int) -> Identity:
    """Deterministic identities, so a failing swarm test replays exactly."""
    return Identity.from_seed(i.to_bytes(4, "big") * 8)


async def start_swarm(
    nursery: trio.Nursery,
    n: int,
    types: Mapping[str, PayloadType],
    *,
    config: DHTConfig | None = None,
    seeds: int = 1,
    now_ms: Callable[[], int] | None = None,
) -> tuple[FakeNetwork, list[DHTNode]]:
    """``n`` nodes on a fake network, each bootstrapped from the first ``seeds`` nodes
    (``now_ms``: the nodes' clock of record times, by default the wall's)."""
    network = FakeNetwork()
    nodes: list[DHTNode] = []
    clock = {} if now_ms is None else {"now_ms": now_ms}
    for i in range(n):
        node = DHTNode(swarm_identity(i + 1), network.endpoint(), types, config or DHTConfig(), **clock)
        await nursery.start(node.run)
        nodes.append(node)
    boot = [nodes[i].contact() for i in range(min(seeds, n))]
    for node in nodes:
        await node.bootstrap([c for c in boot if c.peer_id != node.peer_id])
    return network, nodes


FAKE_CERT_PEM = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"


def sample_report(identity: Identity, model_digest: str, recipe_digest: str = "cd" * 32, layers=(0, 10), *,
                  port: int = 7000, throughput: float = 12.5, free_sessions: int = 2):
    """A capability report that passes validation (its certificate is a stand-in:
    fine for the control plane, never dialled)."""
    from meshnet_p2p.swarm.capability import CapabilityReport
    from meshnet_p2p.core.multiaddr import Multiaddr

    return CapabilityReport(model_digest, recipe_digest, tuple(layers),
                            (str(Multiaddr.for_socket("127.0.0.1", "tcp", port, identity.peer_id)),),
                            throughput=throughput, free_sessions=free_sessions, tls_cert=FAKE_CERT_PEM)
