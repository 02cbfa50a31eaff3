"""``meshnet-peer relay``: keeps peers behind NAT reachable by splicing TLS it
cannot read (nat/relay.py), and, given bootstrap peers, announces itself and
its limits and load in the DHT (swarm/relay_offers.py)."""

from __future__ import annotations

import argparse

import trio

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.guard import Guard
from meshnet_p2p.core.lifecycle import until_signalled
from meshnet_p2p.core.local_addrs import listen_multiaddrs
from meshnet_p2p.core.multiaddr import Multiaddr, announced
from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.nat.reachability import dial_checks
from meshnet_p2p.nat.relay import Relay, RelayLimits
from meshnet_p2p.swarm.node import advertised_host, bootstrap_addrs, parse_listen, start_node
from meshnet_p2p.swarm.relay_offers import RELAY_ANNOUNCE_INTERVAL_S, RELAYS_KEY, sign_relay_record
from .flags import metrics_listen, peer_identity, print_line, run_listener, serve_metrics


def run(args: argparse.Namespace) -> int:
    host, port = parse_listen(args.listen)
    metrics = metrics_listen(args)
    identity = peer_identity(args, print_line)
    announce = announced(args.announce, identity.peer_id) if args.announce else None
    seeds = bootstrap_addrs(args.bootstrap)
    limits = RelayLimits(max_reservations=args.max_reservations, max_connections_per_peer=args.max_connections_per_peer,
                         bytes_per_second_per_peer=args.max_mbps_per_peer * 1e6 / 8,
                         max_circuits_per_source=args.max_circuits_per_source)

    def splice_line(peer, moved: int, seconds: float) -> None:
        print_line(f"splice to {peer} closed: {moved} bytes in {seconds:.1f} s")

    async def serve() -> None:
        relay = Relay(identity, limits, on_splice=splice_line)
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(relay.serve, host, port)
            # on every address: announced at the one this machine reaches its bootstrap peers from
            here = Multiaddr.for_socket(advertised_host(host, seeds), "tcp", bound, identity.peer_id)
            addr = announce or here
            if seeds:
                node = await start_node(nursery, identity, listen=f"{host}:0", bootstrap=seeds, require_bootstrap=False,
                                        serve=dial_checks)

                async def publish() -> None:  # peers behind NAT find this relay, its limits and load, here
                    guard = Guard("relay_publish", node.stats)  # a failure: counted, tried again, relaying goes on
                    while True:
                        async with guard:
                            record = sign_relay_record(identity, addr, {
                                "max_reservations": limits.max_reservations,
                                "max_connections_per_peer": limits.max_connections_per_peer,
                                "bytes_per_second_per_peer": int(limits.bytes_per_second_per_peer)}, relay.load(),
                                now_ms=wall_ms())
                            try:
                                await node.publish(RELAYS_KEY, record)
                            except MeshnetError as e:  # others' refusal is theirs: keep relaying, try again
                                print_line(f"announce failed, retrying: {e}")
                        await trio.sleep(RELAY_ANNOUNCE_INTERVAL_S)

                nursery.start_soon(publish)
            if metrics is not None:
                from .metrics import DhtCollector, RelayCollector

                await serve_metrics(nursery, metrics, "relay", RelayCollector(relay),
                                    *([DhtCollector(node)] if seeds else []))
            for local in listen_multiaddrs(host, "tcp", bound, identity.peer_id):
                print_line(f"listening on {local}")
            if announce is not None:
                print_line(f"announcing {addr}")
            await until_signalled()
            nursery.cancel_scope.cancel()

    return run_listener(args.listen, serve)
