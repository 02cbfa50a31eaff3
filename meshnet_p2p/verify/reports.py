"""Fraud reports through the DHT: publish the ones this node made, fetch the
ones others made against the peers it uses (trust/verdicts.py says what a
report is; verify/recheck.py what makes one count: nothing on its word).

A client has no long-lived DHT node, so :func:`exchange_reports` runs one in
client mode for the exchange, as a survey does."""

from __future__ import annotations

from typing import Iterable, Sequence

import trio

from meshnet_p2p.core.errors import unwrap_errors
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.records import Record
from meshnet_p2p.trust.verdicts import FRAUD_REPORT, report_key

MAX_REPORTS_PER_PEER = 4  # reports of one peer a fetch returns (the newest): re-checking each costs replays
MAX_PEERS_LOOKED_UP = 16


async def fetch_reports(node, model_digest: str, peers: Iterable[str]) -> dict[str, list[Record]]:
    """peer -> the newest fraud reports against it for ``model_digest`` (gossip, then lookups)."""
    out: dict[str, list[Record]] = {}

    async def one(peer: str) -> None:
        key = report_key(model_digest, peer)
        found: dict[bytes, Record] = {}
        for r in [*node.records(key), *await node.get(key)]:
            if r.payload_type == FRAUD_REPORT and r.content.get("key") == key:
                old = found.get(r.signer.multihash)
                if old is None or r.seq > old.seq:
                    found[r.signer.multihash] = r
        if found:
            out[peer] = sorted(found.values(), key=lambda r: -r.seq)[:MAX_REPORTS_PER_PEER]

    async with trio.open_nursery() as nursery:
        for peer in sorted(set(peers))[:MAX_PEERS_LOOKED_UP]:
            nursery.start_soon(one, peer)
    return out


async def exchange_reports(bootstrap: Sequence, model_digest: str, publish: Iterable[tuple[str, bytes]] = (),
                           lookup: Iterable[str] = ()) -> tuple[dict[str, list[Record]], int]:
    """Through a short-lived client-mode node: store each (key, report wire) of ``publish``
    and fetch the reports against ``lookup``'s peers. Returns (reports by peer, how many
    of the published ones some node took)."""
    from meshnet_p2p.swarm.node import start_node

    stored = 0
    with unwrap_errors():
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, Identity.generate(), bootstrap=bootstrap, client_mode=True)
            for key, wire in publish:
                held = await node.publish(key, wire)
                stored += int(held) > 0
            found = await fetch_reports(node, model_digest, lookup)
            nursery.cancel_scope.cancel()
    return found, stored
