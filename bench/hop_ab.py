"""A/B of one hop's decode overhead: this tree against another checkout, in one run.

    python bench/hop_ab.py --before /path/to/old/checkout [--tokens 300] [--json]

The same middle shard is stepped three ways in turns of --block tokens: the
engine in this process, and a direct hop (a `meshnet-peer serve` process and
a client, gRPC over TLS on loopback) with each tree's own client and server.
Each tree's hop runs in a worker process with that tree first on PYTHONPATH
(bench/_hop_worker.py, which uses only API both trees have), so the two are
measured under the same load, interleaved, as bench/hop.py measures its ways.
Reports each tree's ``direct_overhead_ms`` (median step minus the in-process
median) and whether all outputs are identical. The other checkout needs its
generated code (meshnet_p2p/_proto) and built hooks, as `pip install -e .`
leaves them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


from meshnet_p2p.engine.contract import DecodeRequest, LoadRequest, OpenRequest
from meshnet_p2p.engine.cut import parse_layer_range, sha256_file
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.engine.models import default_model_path, ensure_shard

from _hidden import hidden_states
from _report import print_report  # bench/ is on sys.path when a bench runs
from _smoke import parse_args

HERE = os.path.dirname(os.path.abspath(__file__))


class Worker:
    def __init__(self, tree: str, shard: str, threads: int, n_ctx: int, n_embd: int) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, HERE])}
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "_hop_worker.py"), shard, str(threads),
                                   str(n_ctx), str(n_embd)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=env, cwd=tree)
        ready = self.p.stdout.readline()
        if not ready.startswith("ready"):
            raise RuntimeError(f"the worker for {tree} did not start: {ready!r}")
        self.tree = ready.split(None, 1)[1].strip()

    def run(self, start: int, n: int) -> tuple[list[float], list[str]]:
        self.p.stdin.write(f"{start} {n}\n")
        self.p.stdin.flush()
        reply = json.loads(self.p.stdout.readline())
        return reply["times"], reply["digests"]

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            self.p.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="the other checkout (its root directory; with --smoke: this one)")
    ap.add_argument("--layers", default="10:20")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, tokens=6, block=3, threads=1, before=os.path.dirname(HERE))
    if args.before is None:
        ap.error("--before is required")

    import hashlib

    model = default_model_path()
    n_ctx = args.tokens + 8
    start_l, end_l = parse_layer_range(args.layers)
    shard = ensure_shard(model, start_l, end_l, sha256_file(model))
    engine = LlamaCppShardEngine()
    engine.load(LoadRequest(shard, max_sessions=1, n_ctx_per_session=n_ctx, n_threads=args.threads)).status.raise_for_status()
    n_embd = engine.capabilities().n_embd
    hidden = hidden_states(args.tokens, n_embd)
    engine.open_session(OpenRequest("local", n_ctx)).raise_for_status()
    workers = {}
    try:
        workers["after"] = Worker(os.path.dirname(HERE), shard, args.threads, n_ctx, n_embd)
        workers["before"] = Worker(os.path.abspath(args.before), shard, args.threads, n_ctx, n_embd)
        times: dict[str, list[float]] = {"inprocess": [], "after": [], "before": []}
        digests: dict[str, list[str]] = {k: [] for k in times}
        pos = 0
        while pos < args.tokens:
            n = min(args.block, args.tokens - pos)
            for i in range(pos, pos + n):
                t0 = time.perf_counter()
                out = engine.decode(DecodeRequest("local", i, hidden=hidden[i])).hidden.tensors[0].data
                times["inprocess"].append(time.perf_counter() - t0)
                digests["inprocess"].append(hashlib.sha256(out).hexdigest())
            for way in (("after", "before") if (pos // args.block) % 2 else ("before", "after")):  # neither always first
                t, d = workers[way].run(pos, n)
                times[way] += t
                digests[way] += d
            pos += n
    finally:
        for w in workers.values():
            w.close()
        engine.close()
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    doc = {
        "layers": [start_l, end_l],
        "tokens": args.tokens,
        "after_tree": workers["after"].tree,
        "before_tree": workers["before"].tree,
        "inprocess_ms": round(med["inprocess"], 3),
        "after_direct_overhead_ms": round(med["after"] - med["inprocess"], 3),
        "before_direct_overhead_ms": round(med["before"] - med["inprocess"], 3),
        "after_minus_before_ms": round(med["after"] - med["before"], 3),
        "identical_outputs": digests["inprocess"] == digests["after"] == digests["before"],
    }
    print_report(doc, args.json)
    return 0 if doc["identical_outputs"] else 1


if __name__ == "__main__":
    sys.exit(main())
