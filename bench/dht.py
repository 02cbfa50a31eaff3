"""DHT lookups and gossip spread on loopback, with a fraction of the nodes frozen.

    python bench/dht.py --nodes 100 --frozen 0.2 [--lookups 200] [--json]

Layout: this process runs a handful of live nodes (one of them the bootstrap
peer) and issues every lookup from them; the other nodes live in worker
processes, the frozen ones in workers of their own that are SIGSTOPped after
the records are published, so their sockets stay open but silent. Targets
(issue 3): N=100, F=0.2 -> success_rate 1.0 and p99 < 2000 ms; F=0 -> p50 < 50
ms; gossip_full_ms (a new report reaching every live node) < 2000 ms.
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import subprocess
import sys
import time

import trio

from meshnet_p2p.swarm.capability import model_key
from meshnet_p2p.testing import sample_report
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.swarm.node import node_multiaddr, start_node
from meshnet_p2p.core.records import wall_ms

from _report import print_report  # bench/ is on sys.path when a bench runs
from _smoke import parse_args

GOSSIP_MODEL = "99" * 32


def report_for(identity: Identity, digest: str, seq: int = 1) -> bytes:
    rep = sample_report(identity, digest, "00" * 32, port=1, throughput=1.0, free_sessions=1)
    return rep.sign(identity, seq=seq, now_ms=wall_ms(), ttl_ms=600_000)


# --- worker: M nodes in one process -------------------------------------------------------


async def worker(count: int, bootstrap: str) -> None:
    async with trio.open_nursery() as nursery:
        nodes = []
        for _ in range(count):
            nodes.append(await start_node(nursery, Identity.generate(), bootstrap=[bootstrap]))
        for node in nodes:
            nursery.start_soon(_watch_gossip, node)
        print("ready", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


async def _watch_gossip(node) -> None:
    updates = node.subscribe(model_key(GOSSIP_MODEL))
    async for rec in updates:
        print(f"gossip {node.peer_id} {rec.seq} {time.time():.6f}", flush=True)


# --- driver -------------------------------------------------------------------------------


async def driver(args) -> dict:
    n_frozen = round(args.nodes * args.frozen)
    n_local = min(args.local, args.nodes - n_frozen)
    n_remote_live = args.nodes - n_frozen - n_local
    gossip_times: dict[str, float] = {}
    procs: list[tuple[trio.Process, bool]] = []
    async with trio.open_nursery() as nursery:
        local = [await start_node(nursery, Identity.generate())]
        boot = str(node_multiaddr(local[0]))
        for _ in range(n_local - 1):
            local.append(await start_node(nursery, Identity.generate(), bootstrap=[boot]))

        def split(total: int, parts: int) -> list[int]:
            return [total // parts + (1 if i < total % parts else 0) for i in range(parts)] if total else []

        plan = [(c, False) for c in split(n_remote_live, args.workers) if c] + [
            (c, True) for c in split(n_frozen, max(1, args.workers // 2)) if c
        ]
        for count, frozen in plan:
            proc = await trio.lowlevel.open_process(
                [sys.executable, __file__, "--worker", str(count), "--bootstrap", boot],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            procs.append((proc, frozen))
        ready = trio.Event()
        n_ready = 0

        async def read_worker(proc: trio.Process) -> None:
            nonlocal n_ready
            buf = b""
            async for chunk in proc.stdout:
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    parts = line.decode().split()
                    if parts[:1] == ["ready"]:
                        n_ready += 1
                        if n_ready == len(procs):
                            ready.set()
                    elif parts[:1] == ["gossip"] and parts[2] == "2":
                        gossip_times.setdefault(parts[1], float(parts[3]))

        for proc, _ in procs:
            nursery.start_soon(read_worker, proc)
        with trio.fail_after(300):
            await ready.wait()
        for node in local:  # settle: everyone now exists, refresh what we know
            await node.find_node(node.node_id)

        # publish records to look up, then freeze
        keys = []
        for i in range(args.keys):
            digest = f"{i:064x}"
            publisher = local[i % len(local)]
            await publisher.put(model_key(digest), report_for(publisher.identity, digest))
            keys.append(model_key(digest))
        for proc, frozen in procs:
            if frozen:
                proc.send_signal(signal.SIGSTOP)

        latencies, successes = [], 0
        rng = random.Random(1)
        for i in range(args.lookups):
            node, key = local[i % len(local)], rng.choice(keys)
            t0 = time.perf_counter()
            records = await node.get(key)
            latencies.append((time.perf_counter() - t0) * 1000)
            successes += bool(records)
        latencies.sort()

        # gossip: a new report from a local node must reach every live node
        gossip_times.clear()
        local_subs = [n.subscribe(model_key(GOSSIP_MODEL)) for n in local]
        publisher = local[-1]
        await publisher.put(model_key(GOSSIP_MODEL), report_for(publisher.identity, GOSSIP_MODEL, seq=1))
        await trio.sleep(0.5)
        t_pub = time.time()
        nursery.start_soon(publisher.publish, model_key(GOSSIP_MODEL), report_for(publisher.identity, GOSSIP_MODEL, seq=2))
        local_done = []
        with trio.move_on_after(args.gossip_timeout):
            for node, sub in zip(local, local_subs, strict=True):
                if node is publisher:
                    continue
                async for rec in sub:
                    if rec.seq == 2:
                        local_done.append(time.time())
                        break
            while len(gossip_times) < n_remote_live:
                await trio.sleep(0.01)
        reached = len(gossip_times) + len(local_done) + 1
        arrivals = list(gossip_times.values()) + local_done
        result = {
            "nodes": args.nodes,
            "frozen": n_frozen,
            "processes": len(procs) + 1,
            "lookups": args.lookups,
            "success_rate": round(successes / args.lookups, 4),
            "p50_ms": round(statistics.median(latencies), 2),
            "p99_ms": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
            "max_ms": round(latencies[-1], 2),
            "gossip_full_ms": round((max(arrivals) - t_pub) * 1000, 2) if reached == args.nodes - n_frozen else None,
            "gossip_reached": reached,
            "gossip_live_nodes": args.nodes - n_frozen,
            "evictions_seen_by_lookup_nodes": sum(n.stats["evicted"] for n in local),
        }
        for proc, frozen in procs:
            if frozen:
                proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            for proc, _ in procs:
                await proc.wait()
        nursery.cancel_scope.cancel()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--frozen", type=float, default=0.2)
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--keys", type=int, default=20)
    ap.add_argument("--local", type=int, default=10, help="live nodes in the driver process (lookups run from them)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--gossip-timeout", type=float, default=10.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", help=argparse.SUPPRESS)
    args = parse_args(ap, nodes=12, frozen=0.2, lookups=20, keys=4, local=3, workers=2, gossip_timeout=5.0)
    if args.worker:
        trio.run(worker, args.worker, args.bootstrap)
        return 0
    if not 0 <= args.frozen < 1 or args.nodes < 2:
        ap.error("need --nodes >= 2 and 0 <= --frozen < 1")
    print_report(trio.run(driver, args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
