"""``meshnet-peer bootstrap``: a DHT and gossip node with no model, the swarm's
first contact. It also tells joining peers whether their data-plane address
answers (nat/reachability.py). Listening on a wildcard, it prints one
``listening on`` line per local address, loopback last."""

from __future__ import annotations

import argparse

import trio

from meshnet_p2p.core.lifecycle import until_signalled
from meshnet_p2p.nat.reachability import dial_checks
from meshnet_p2p.swarm.node import bootstrap_addrs, node_multiaddrs, parse_listen, start_node
from .flags import metrics_listen, peer_identity, print_line, run_listener, serve_metrics


def run(args: argparse.Namespace) -> int:
    parse_listen(args.listen)  # a bad flag fails before anything starts
    metrics = metrics_listen(args)
    said: list[str] = []  # said after the listening lines: the first line is its address
    identity = peer_identity(args, said.append)
    seeds = bootstrap_addrs(args.bootstrap)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, identity, listen=args.listen, bootstrap=seeds, require_bootstrap=False,
                                    serve=dial_checks, follow_all=True)
            if metrics is not None:
                from .metrics import DhtCollector

                await serve_metrics(nursery, metrics, "bootstrap", DhtCollector(node))
            for addr in node_multiaddrs(node):
                print_line(f"listening on {addr}")
            for line in said:
                print_line(line)
            await until_signalled()
            nursery.cancel_scope.cancel()

    return run_listener(args.listen, serve)
