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

# Reports of one peer a fetch returns, and their bytes: every one a key holds up to these
# (a DHT key holds at most 256 values, 64 from one source network; a report is at most
# 16 KiB). Not the newest few: the accused can always publish newer ones against itself
# (issue 59, the shield), so a fetch keeps the earliest, which predate a lie's discovery.
MAX_REPORTS_PER_PEER = 64
MAX_REPORT_BYTES_PER_PEER = 512 * 1024
MAX_PEERS_LOOKED_UP = 64


def earliest_first(records: Iterable[Record], key: str) -> list[Record]:
    """The fraud reports under ``key`` among ``records``, the newest of each reporter,
    earliest first, within the count and byte bounds; none signed by the accused."""
    found: dict[bytes, Record] = {}
    accused = key.rsplit("/", 1)[-1]
    for r in records:
        if r.payload_type == FRAUD_REPORT and r.content.get("key") == key and str(r.signer) != accused:
            old = found.get(r.signer.multihash)
            if old is None or r.seq > old.seq:
                found[r.signer.multihash] = r
    out, size = [], 0
    for r in sorted(found.values(), key=lambda r: (r.issued_at_ms, r.signature)):
        size += len(r.wire)
        if len(out) >= MAX_REPORTS_PER_PEER or size > MAX_REPORT_BYTES_PER_PEER:
            break
        out.append(r)
    return out


async def fetch_reports(node, model_digest: str, peers: Iterable[str]) -> dict[str, list[Record]]:
    """peer -> the fraud reports against it for ``model_digest`` (gossip, then lookups),
    earliest first (:func:`earliest_first`)."""
    out: dict[str, list[Record]] = {}

    async def one(peer: str) -> None:
        key = report_key(model_digest, peer)
        found = earliest_first([*node.records(key), *await node.get(key)], key)
        if found:
            out[peer] = found

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
