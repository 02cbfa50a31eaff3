"""The swarm at internet scale, simulated: real DHT code, virtual time (issue 30).

    python bench/sim.py --peers 1000 [--minutes M] [--seed 1] [--json]

Runs ``meshnet_p2p.sim``: every peer a production DHTNode on a simulated internet
(region RTTs, access delays, 1 % loss, a share behind NAT in client mode),
heavy-tailed churn, volunteers re-announcing capability reports every 30 s as
``join`` does, a certifier's certificates, clients looking models and nodes up,
fresh clients surveying for a certified route as ``generate`` does, and
optionally attackers (``--sybils``). Reports lookup recall,
completeness and latency percentiles (and where the records of volunteers a
lookup missed were), node-lookup success and queries, how
often and how fast a fresh client finds a route and how good it is against an
oracle (``route_quality``: its ring's time per token over the best ring's), how long
a new volunteer takes to be found, messages and bytes per node per second (and
requests by kind), memory per peer, and the wall time the simulation took.
docs/scale.md: the figures, the assumptions and their sources.
"""

from __future__ import annotations

import argparse
import os
import sys

from meshnet_p2p.dht.node import DHTConfig
from meshnet_p2p.sim.churn import Churn
from meshnet_p2p.sim.net import NetModel
from meshnet_p2p.sim.records import N_LAYER
from meshnet_p2p.sim.swarm import SimConfig, default_window, simulate

from _report import print_report  # bench/ is on sys.path when a bench runs
from _smoke import parse_args


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=None,
                    help="simulated minutes measured (default: 10,000 peer-minutes, 1 to 10: 10 at 1,000 peers, 1 at 10,000)")
    ap.add_argument("--warmup-minutes", type=float, default=None,
                    help="simulated minutes to join, not measured (default: 2 up to 1,000 peers, 1 beyond)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--models", type=int, default=4)
    ap.add_argument("--nat", type=float, default=0.3, help="share of peers behind NAT")
    ap.add_argument("--nat-filtering", choices=("address", "endpoint"), default="address",
                    help="what a NAT lets in: from addresses its host sent to, or anyone while its mapping is open")
    ap.add_argument("--loss", type=float, default=0.01)
    ap.add_argument("--uplink-mbps", type=float, default=0.0,
                    help="median uplink of a host, Mbit/s (log-normal); a datagram waits its turn on it. 0: unlimited")
    ap.add_argument("--session-minutes", type=float, default=60.0, help="median online session")
    ap.add_argument("--vanish-share", type=float, default=0.0,
                    help="share of sessions ending with the machine gone (no FIN): a generation waits out a step")
    ap.add_argument("--lookups-per-s", type=float, default=2.0)
    ap.add_argument("--surveys-per-s", type=float, default=0.5, help="fresh clients surveying for a route")
    ap.add_argument("--generation-tokens", type=int, default=64,
                    help="tokens each routed survey then generates on its route, failing over as peers leave")
    ap.add_argument("--partition", metavar="REGIONS", default="",
                    help="cut these regions (comma-separated: na,eu,as,sa,oc,af) off from the rest")
    ap.add_argument("--partition-at", type=float, default=0.5, help="measured minutes before the cut")
    ap.add_argument("--partition-minutes", type=float, default=1.0, help="how long the cut lasts")
    ap.add_argument("--relays", type=int, default=0, help="public relays; NATed volunteers reserve on one")
    ap.add_argument("--relay-capacity", type=int, default=128, help="reservations a relay holds")
    ap.add_argument("--relay-session-minutes", type=float, default=0.0,
                    help="relays' median session and offline gap (0: always online)")
    ap.add_argument("--bad-relays", type=int, default=0, help="relays besides --relays that misbehave")
    ap.add_argument("--bad-relay-behaviour", choices=("blackhole", "selective"), default="blackhole",
                    help="blackhole: carry nothing; selective: carry only the reserved peer's own dials")
    ap.add_argument("--reachability", action="store_true",
                    help="public peers dial others back and each joining volunteer checks its own reachability")
    ap.add_argument("--verdicts", action="store_true",
                    help="the certifier also vouches for the volunteers it audited (review's verdicts)")
    ap.add_argument("--sybils", type=int, default=0, help="attacker identities (meshnet_p2p/sim/sybil.py)")
    ap.add_argument("--sybil-behaviour", choices=("eclipse", "slow", "liar"), default="eclipse")
    ap.add_argument("--sybil-target", choices=("model", "certifier"), default="model",
                    help="ground close to model 0's key, or to the certifier's index of model 0")
    ap.add_argument("--sybil-networks", type=int, default=1, help="the /24s the attackers' addresses span")
    ap.add_argument("--placement", choices=("slices", "auto"), default="slices",
                    help="volunteers serve a random third, or choose as join --layers auto does")
    ap.add_argument("--sybil-layers", default=f"0:{N_LAYER}", help="A:B, what a liar claims to serve")
    ap.add_argument("--follow-all", action="store_true",
                    help="every node gossips every topic (as before 2026-12-05), not only those it follows")
    ap.add_argument("--refresh-s", type=float, default=DHTConfig.refresh_interval,
                    help="how often a node refreshes its routing table with a random-ID lookup")
    ap.add_argument("--refresh-paths", type=int, choices=range(1, DHTConfig.lookup_paths + 1), metavar=f"1..{DHTConfig.lookup_paths}",
                    default=DHTConfig.refresh_paths,
                    help="disjoint paths of the table's refresh lookup (3 before 2026-12-06)")
    ap.add_argument("--check-each", action="store_true",
                    help="every node runs all of a record's checks itself, as a real node does (before 2026-12-06 "
                         "the simulator always did; the verdicts are the same, only slower: meshnet_p2p/sim/shared.py)")
    ap.add_argument("--no-probe", action="store_true",
                    help="fresh clients plan blind, without probing their candidates' round trips (before 2026-12-05)")
    ap.add_argument("--procs", type=int, choices=(1, 2), default=None,
                    help="processes the run is split over, a core each (meshnet_p2p/sim/split.py; default: 2 where "
                         "there are two cores, 1 with --relays, which a split run does not simulate)")
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, peers=40, minutes=0.5, warmup_minutes=0.5, models=1, sybils=4)
    measured, warmup = default_window(args.peers)
    args.minutes = measured if args.minutes is None else args.minutes
    args.warmup_minutes = warmup if args.warmup_minutes is None else args.warmup_minutes
    if args.procs is None:
        args.procs = 1 if args.relays + args.bad_relays or (os.cpu_count() or 1) < 2 else 2
    churn = Churn(session_median_s=args.session_minutes * 60, gap_median_s=args.session_minutes * 60,
                  vanish_share=args.vanish_share)
    cfg = SimConfig(peers=args.peers, minutes=args.minutes, warmup_minutes=args.warmup_minutes, seed=args.seed,
                    models=args.models, nat_share=args.nat, lookups_per_s=args.lookups_per_s, churn=churn,
                    net=NetModel(loss=args.loss, uplink_mbps=args.uplink_mbps, nat_filtering=args.nat_filtering), surveys_per_s=args.surveys_per_s, sybils=args.sybils,
                    sybil_behaviour=args.sybil_behaviour, sybil_target=args.sybil_target,
                    sybil_networks=args.sybil_networks, placement=args.placement, generation_tokens=args.generation_tokens,
                    verdicts=args.verdicts, probe=not args.no_probe, reachability=args.reachability, relays=args.relays,
                    relay_capacity=args.relay_capacity, relay_session_minutes=args.relay_session_minutes,
                    bad_relays=args.bad_relays, bad_relay_behaviour=args.bad_relay_behaviour, partition_regions=tuple(r for r in args.partition.split(",") if r),
                    partition_at_minutes=args.partition_at, partition_minutes=args.partition_minutes,
                    sybil_layers=tuple(int(x) for x in args.sybil_layers.split(":")),
                    dht=DHTConfig(follow_all=args.follow_all, refresh_interval=args.refresh_s,
                                  refresh_paths=args.refresh_paths), share_checks=not args.check_each,
                    procs=args.procs)
    doc = simulate(cfg)
    print_report(doc, args.json)
    if args.smoke and not (doc["model_lookups"] and doc["model_lookup_found_any"] == 1.0 and doc["surveys"]):
        print("smoke: no model lookup found the model's peers", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
