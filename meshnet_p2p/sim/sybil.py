"""Colluding identities for the simulated swarm: ground close to a key, and hostile.

Peer IDs cost nothing (no S/Kademlia puzzle), so an attacker grinds identities
whose DHT IDs share the top bits with the key it wants: they become the key's
closest nodes. What each does there (``Behaviour``):

- ``eclipse``: says "stored" and keeps nothing, gives no values, and names only
  its siblings, whatever it is asked (tests/test_dht_eclipse.py's double);
- ``slow``: answers everything correctly, ``slow_s`` late (a lookup must not
  wait on it);
- ``liar``: an honest DHT node that also announces a capability report for the
  target model it cannot serve: the whole model, fast, at an address nobody
  answers on (a signed claim costs nothing; the client's route search must
  get past it).

They sit on ``networks`` public /24s (1: one host or one cloud subnet, the
DHT's per-network bounds apply; as many as Sybils: a botnet).
"""

from __future__ import annotations

import enum
import random
from typing import Any

import trio

from meshnet_p2p.core.identity import Identity
from meshnet_p2p.dht import wire
from meshnet_p2p.dht.node import DHTNode
from meshnet_p2p.dht.routing import Contact, node_id_of


class Behaviour(str, enum.Enum):
    ECLIPSE = "eclipse"
    SLOW = "slow"
    LIAR = "liar"


def grind(target: int, count: int, bits: int, rng: random.Random) -> list[Identity]:
    """``count`` identities whose node IDs share their top ``bits`` bits with ``target``
    (about count * 2**bits key generations: what the attacker pays)."""
    found: list[Identity] = []
    shift = 256 - bits
    while len(found) < count:
        ident = Identity.from_seed(rng.randbytes(32))
        if (node_id_of(ident.peer_id) ^ target) >> shift == 0:
            found.append(ident)
    return found


class SybilNode(DHTNode):
    """A production node with one behaviour changed (see the module's doc)."""

    behaviour: Behaviour = Behaviour.ECLIPSE
    siblings: list[Contact] = []
    slow_s: float = 3.0

    def _handle(self, msg: wire.Message, addr) -> tuple[str, dict[str, Any]]:
        if self.behaviour is not Behaviour.ECLIPSE:
            return super()._handle(msg, addr)
        others = [c for c in self.siblings if c.node_id != self.node_id][: self.config.k]
        if msg.kind == "store":
            return "stored", {"ok": True, "reason": "stored"}
        if msg.kind == "find_node":
            return "nodes", {"nodes": wire.encode_contacts(others)}
        if msg.kind == "find_value":
            return "values", {"values": [], "more": False, "nodes": wire.encode_contacts(others)}
        if msg.kind == "gossip_push":
            return "gossip_ack", {"accepted": 0}
        if msg.kind == "gossip_pull":
            return "gossip_records", {"records": []}
        return super()._handle(msg, addr)

    def _gossip_in(self, record_wire: bytes, *, from_peer=None, record=None, pulled: bool = False) -> bool:
        if self.behaviour is Behaviour.ECLIPSE:
            return False  # passes nothing on
        return super()._gossip_in(record_wire, from_peer=from_peer, record=record, pulled=pulled)

    async def _reply(self, msg: wire.Message, addr, kind: str, body: dict[str, Any], request_bytes: int,
                     proven: bool) -> None:
        if self.behaviour is not Behaviour.SLOW or self._nursery is None:
            return await super()._reply(msg, addr, kind, body, request_bytes, proven)

        async def late() -> None:
            await trio.sleep(self.slow_s)
            await DHTNode._reply(self, msg, addr, kind, body, request_bytes, proven)

        self._nursery.start_soon(late)
