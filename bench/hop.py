"""Per-token decode overhead of one data-plane hop, measured side by side in one run.

    python bench/hop.py [--layers 10:20] [--tokens 300] [--json]

Runs the same middle shard three ways, in turns of --block tokens: the engine
called in this process, the same shard served by a `meshnet-peer serve`
process over gRPC+TLS on loopback (direct), and the same server reached
through a `meshnet-peer relay` process. The server process is also attached to
the relay. Each step carries one token's float32 hidden state (2,304 bytes for
SmolLM2) in and out, as a real hop does. Reports medians. Target (issue 4):
direct_overhead_ms < 1.

A fourth way, the floor, serves the same shard behind a bare grpcio server
stream over the same TLS (bench/_grpc_floor.py: raw bytes, no protobuf, no
session protocol), reached through the same client: ``floor_overhead_ms`` is
what a hop would cost with grpcio's server and nothing of ours on it, and
``stack_overhead_ms`` (direct minus floor) what our server, protocol and
servicer cost beyond that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from meshnet_p2p.dataplane.stub import ShardClient, open_channel
from meshnet_p2p.dataplane.transport.tls import verify_binding
from meshnet_p2p.engine.contract import HIDDEN, DecodeRequest, LoadRequest, OpenRequest, Tensor, TensorBundle
from meshnet_p2p.engine.cut import parse_layer_range, sha256_file
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.engine.models import default_model_path, ensure_shard
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.roles.peer_process import PeerProcess
from meshnet_p2p.core.records import wall_ms

from _grpc_floor import METHOD, SERVICE  # bench/ is on sys.path when a bench runs
from _report import print_report
from _smoke import parse_args


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="10:20")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="llama.cpp threads, in-process and in the server alike (default: as serve and join, one per CPU)")
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, tokens=6, block=3, threads=1)

    model = default_model_path()
    n_ctx = args.tokens + 8  # KV positions every way's session reserves
    start_l, end_l = parse_layer_range(args.layers)
    shard = ensure_shard(model, start_l, end_l, sha256_file(model))
    procs: list[PeerProcess] = []
    floor = None
    try:
        relay = PeerProcess("relay", "--listen", "127.0.0.1:0")
        procs.append(relay)
        relay_addr = Multiaddr.parse(relay.address())
        server = PeerProcess("serve", "--shard", shard, "--threads", str(args.threads), "--relay", str(relay_addr))
        procs.append(server)
        addr = Multiaddr.parse(server.address())
        peer = addr.peer_id
        cert = verify_binding(bytes.fromhex(server.wait_line("tls-binding ").split()[1]), peer, wall_ms())

        floor = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "_grpc_floor.py"), shard,
                                  str(args.threads), str(n_ctx)], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        floor_port, floor_cert = int(floor.stdout.readline()), bytes.fromhex(floor.stdout.readline().strip())
        floor_channel = open_channel(floor_cert, address=("127.0.0.1", floor_port))
        floor_call = floor_channel.stream(f"/{SERVICE}/{METHOD}")

        engine = LlamaCppShardEngine()
        engine.load(LoadRequest(shard, max_sessions=1, n_ctx_per_session=n_ctx, n_threads=args.threads)).status.raise_for_status()
        direct = ShardClient(open_channel(cert, address=(addr.host, addr.port)))
        relayed = ShardClient(open_channel(cert, relay=(relay_addr.host, relay_addr.port), peer_id=peer))
        fp = direct.capability().fingerprint
        n_embd = engine.capabilities().n_embd
        rng = np.random.default_rng(0)
        hidden = [TensorBundle((Tensor(HIDDEN, "f32", (1, n_embd), (rng.standard_normal((1, n_embd)) * 0.1).astype(np.float32).tobytes()),))
                  for _ in range(args.tokens)]
        engine.open_session(OpenRequest("local", n_ctx)).raise_for_status()
        streams = {"direct": direct.session(fp, max_tokens=n_ctx), "relay": relayed.session(fp, max_tokens=n_ctx)}
        times: dict[str, list[float]] = {"inprocess": [], "floor": [], "direct": [], "relay": []}
        outputs: dict[str, list[bytes]] = {k: [] for k in times}
        pos = 0
        while pos < args.tokens:
            n = min(args.block, args.tokens - pos)
            for way in times:
                for i in range(pos, pos + n):
                    t0 = time.perf_counter()
                    if way == "inprocess":
                        out = engine.decode(DecodeRequest("local", i, hidden=hidden[i])).hidden.tensors[0].data
                    elif way == "floor":
                        floor_call.send(hidden[i].tensors[0].data)
                        out = floor_call.recv()
                    else:
                        out = streams[way].step(i, hidden=hidden[i], decode=True).hidden.tensors[0].data
                    times[way].append(time.perf_counter() - t0)
                    outputs[way].append(out)
            pos += n
        for s in streams.values():
            s.release()
        floor_call.cancel()
        floor_channel.close()
        floor.stdin.close()
        direct.close()
        relayed.close()
        engine.close()
    finally:
        if floor is not None:
            floor.terminate()
            floor.wait(timeout=30)
        for p in reversed(procs):  # the server before the relay it is attached to
            p.stop()

    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    doc = {
        "layers": [start_l, end_l],
        "tokens": args.tokens,
        "inprocess_ms": round(med["inprocess"], 3),
        "direct_ms": round(med["direct"], 3),
        "relay_ms": round(med["relay"], 3),
        "floor_ms": round(med["floor"], 3),
        "direct_overhead_ms": round(med["direct"] - med["inprocess"], 3),
        "relay_overhead_ms": round(med["relay"] - med["inprocess"], 3),
        "floor_overhead_ms": round(med["floor"] - med["inprocess"], 3),
        "stack_overhead_ms": round(med["direct"] - med["floor"], 3),
        "identical_outputs": outputs["inprocess"] == outputs["floor"] == outputs["direct"] == outputs["relay"],
    }
    print_report(doc, args.json)
    return 0 if doc["identical_outputs"] else 1


if __name__ == "__main__":
    sys.exit(main())
