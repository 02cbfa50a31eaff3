"""A 3-peer route over links with delay, against its ring and star limits, in one run.

    python bench/wan.py [--delays 0,2,5] [--tokens 48] [--reps 3] [--trace PREFIX] [--json]

For each D: a bootstrap peer and three `meshnet-peer join` processes (0:10,
10:20, 20:30), each reached only through its own userspace forwarder that
delays every chunk by D in each direction (bench/_delay_forwarder.py, its
own process: these kernels have no netem), which the peer announces with
`--announce`. The client (this process) generates greedily; between its
generations the whole model runs in this process, giving t, the whole
model's time per token. Two clients take turns: one on the ring (peers
forward to each other, docs/ring.md) and one on the star (the client
carries every hidden state). Reports each one's decode tokens/s against the
ring limit 1 / (t + k*D) (one crossing per hop, k = 3) and the star limit
1 / (t + 2k*D) (two crossings per hop). Per D it also gives each one's ms per
token and how far that is above its limit (``*_above_limit_ms``), and over
all D the least-squares slope of ms per token against D (``ring_slope``,
``star_slope``): the crossings a token pays. Targets (issue 27): the ring at
least 0.85x its limit at D = 2, 5 and 15 ms, ``ring_slope`` at most 3.3, and
at D = 0 at least 0.75x the whole model.

``--trace PREFIX``: every process (peers, links, this client) also writes a
trace (meshnet_p2p/core/trace.py) to PREFIX.d<D>.jsonl, and after the timed
runs one more ring generation of --tokens runs between ``bench.trace``
events; the report of each (bench/_trace_report.py: per decode token, what
waited for what, docs/ring.md "Trace") is in the output as ``trace``. The
smoke mode traces too (to a temporary directory), so the trace does not rot.

``--rpc``: after our peers of each D are gone, llama.cpp's own RPC backend
over the same kind of links, as an anchor (bench/_rpc.py, docs/ring.md "The
anchor beside us"): three ggml RPC servers holding the same layer spans, each
behind its own delayed port, driven by llama-bench (one client holding the
graph: a star). Reports ``rpc_tok_s`` and ``ring_vs_rpc``/``star_vs_rpc``.
It builds the two llama.cpp binaries once (cached; 5-10 min, needs network
once) and fails, never skips, if it cannot. The smoke mode runs it too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from meshnet_p2p.client import Client
from meshnet_p2p.core import trace
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.cut import sha256_file
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.route.local import LocalRoute
from meshnet_p2p.engine.models import default_model_path
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.roles.peer_process import PeerProcess, Swarm

import _rpc
import _trace_report as trace_report  # bench/ is on sys.path when a bench runs
from _report import print_report
from _smoke import parse_args

PROMPT = ("The history of clockmaking is a story of patience. Early water clocks measured hours by the flow "
          "of water through a small opening, while mechanical clocks in medieval towers used weights and gears.")
SPANS = ("0:10", "10:20", "20:30")


class Links:
    """The forwarder process: one delayed port per peer."""

    def __init__(self, delay_ms: float) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        self.p = subprocess.Popen([sys.executable, os.path.join(here, "_delay_forwarder.py"), str(delay_ms)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, line: str) -> str:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def listen(self) -> int:
        return int(self._ask("listen"))

    def target(self, port: int, host: str, target_port: int) -> None:
        assert self._ask(f"target {port} {host}:{target_port}") == "ok"

    def close(self) -> None:
        self.p.stdin.close()
        self.p.terminate()
        self.p.wait(timeout=30)


def run_delay(delay_ms: float, args, whole: LocalRoute, prompt_ids: list[int]) -> dict:
    path = f"{args.trace}.d{delay_ms:g}.jsonl" if args.trace else None
    if path:  # the links and peers started for this D inherit it; this process traces only the traced run
        if os.path.exists(path):
            os.unlink(path)
        os.environ[trace.ENV] = path
    try:
        out = _run_delay(delay_ms, args, whole, prompt_ids, Links(delay_ms), path)
    finally:
        os.environ.pop(trace.ENV, None)
    if args.rpc:  # the anchor, over links of its own (untraced), our peers and their links gone
        out.update(rpc_delay(delay_ms, args, len(prompt_ids), out))
    return out


def rpc_delay(delay_ms: float, args, depth: int, ours: dict) -> dict:
    links = Links(delay_ms)
    try:
        r = _rpc.measure(args.rpc_binaries, links, default_model_path(), SPANS, int(SPANS[-1].split(":")[1]),
                         threads=args.threads, tokens=args.tokens, reps=args.reps, depth=depth)
    finally:
        links.close()
    args.rpc_command = r["command"]
    return {"rpc_tok_s": round(r["tok_s"], 2), "ring_vs_rpc": round(ours["ring_tok_s"] / r["tok_s"], 3),
            "star_vs_rpc": round(ours["star_tok_s"] / r["tok_s"], 3), "rpc_split": ", ".join(r["split"])}


def _run_delay(delay_ms: float, args, whole: LocalRoute, prompt_ids: list[int], links: "Links",
               path: str | None) -> dict:
    swarm = Swarm((), timeout=300)  # the bootstrap peer; the joins, each behind its own link, below
    try:
        for span in SPANS:
            port = links.listen()
            join = PeerProcess("join", "--layers", span, "--bootstrap", swarm.addr, "--threads", str(args.threads),
                               "--announce", f"/ip4/127.0.0.1/tcp/{port}", "--keep-warm", str(args.keep_warm))
            swarm.joins.append(join)
            # its port is known once it serves; it checks it is reachable at the announced one before announcing
            listening = Multiaddr.parse(join.wait_line("serving on ", 300).removeprefix("serving on "))
            links.target(port, listening.host, listening.port)
            join.address(300)
        swarm.certify()
        clients = {"ring": Client([swarm.addr], step_timeout=60.0, ring=True),
                   "star": Client([swarm.addr], step_timeout=60.0, ring=False)}
        greedy = SamplingParams()
        for client in clients.values():  # warm-up all
            client.generate(PROMPT, 4, greedy, stop_at_eog=False)
        whole.generate(prompt_ids, 4, greedy, stop_at_eog=False)
        runs: dict[str, list] = {"ring": [], "star": [], "whole": []}
        for _ in range(args.reps):  # interleaved: the three ways meet the same load
            for name, client in clients.items():
                runs[name].append(client.generate(PROMPT, args.tokens, greedy, stop_at_eog=False))
            runs["whole"].append(whole.generate(prompt_ids, args.tokens, greedy, stop_at_eog=False))
        if path:
            trace.start(path)
            trace.name("client")
            trace.event("bench.trace", d=delay_ms, begin=True)
            clients["ring"].generate(PROMPT, args.tokens, greedy, stop_at_eog=False)
            trace.event("bench.trace", d=delay_ms, begin=False)
            trace.start(None)
    finally:
        swarm.stop()
        links.close()
    t = 1 / statistics.median(r.decode_tokens_per_s for r in runs["whole"])  # the whole model's seconds per token
    k, d = len(SPANS), delay_ms / 1000
    ring, star = 1 / (t + k * d), 1 / (t + 2 * k * d)
    out = {
        "whole_ms_per_token": round(t * 1000, 2),
        "ring_limit_tok_s": round(ring, 2),
        "star_limit_tok_s": round(star, 2),
    }
    for name, limit in (("ring", ring), ("star", star)):
        tok_s = statistics.median(r.decode_tokens_per_s for r in runs[name])
        out[f"{name}_tok_s"] = round(tok_s, 2)
        out[f"{name}_vs_ring_limit"] = round(tok_s / ring, 3)
        out[f"{name}_vs_star_limit"] = round(tok_s / star, 3)
        out[f"{name}_vs_whole"] = round(tok_s * t, 3)  # against the whole model in one process
        out[f"{name}_ms_per_token"] = round(1000 / tok_s, 2)
        # what a token costs beyond its own limit (compute + its crossings): issue 27's penalty
        out[f"{name}_above_limit_ms"] = round(1000 / tok_s - 1000 / limit, 2)
    if path:
        out["trace"] = {"file": path, **trace_report.report(trace_report.load(path))}
    out["identical_tokens"] = all(s.token_ids == w.token_ids for name in ("ring", "star")
                                  for s, w in zip(runs[name], runs["whole"], strict=True))
    return out


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of y against x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays", default="0,2,5", help="one-way delay per link, ms, comma-separated")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads per peer and for the whole model")
    ap.add_argument("--keep-warm", type=int, default=0, metavar="MS",
                    help="the peers' --keep-warm (default 0: off, as theirs is)")
    ap.add_argument("--trace", metavar="PREFIX", help="also trace one ring generation per delay to PREFIX.d<D>.jsonl")
    ap.add_argument("--rpc", action="store_true",
                    help="also llama.cpp's RPC backend over the same links, as an anchor (builds it once, cached)")
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, delays="2", tokens=4, reps=1, threads=1)
    args.rpc = args.rpc or args.smoke  # so the anchor does not rot either (its first build: 5-10 min)
    args.rpc_binaries = _rpc.build() if args.rpc else None  # before anything is measured: fails early
    model = default_model_path()
    whole = LocalRoute.from_model(model, [(0, 30)], source_sha256=sha256_file(model), n_threads=args.threads,
                                  max_sessions=1)
    prompt_ids = Tokenizer(model).encode(PROMPT)
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "tokens": args.tokens, "reps": args.reps, "threads": args.threads,
                 "keep_warm_ms": args.keep_warm}
    tmp = None
    if args.smoke and not args.trace:  # the smoke run traces too, so the trace and its report do not rot
        tmp = tempfile.TemporaryDirectory(prefix="meshnet-wan-trace-")
        args.trace = os.path.join(tmp.name, "t")
    try:
        for d in (float(x) for x in args.delays.split(",")):
            doc[f"d{d:g}ms"] = run_delay(d, args, whole, prompt_ids)
    finally:
        whole.close()
        if tmp is not None:
            tmp.cleanup()
    rows = {float(k[1:-2]): v for k, v in doc.items() if k.startswith("d") and k.endswith("ms")}
    if len(rows) >= 2:  # ms per token against D, least squares: crossings a token pays (ring: k, star: 2k)
        for name in ("ring", "star"):
            doc[f"{name}_slope"] = round(slope([(d, v[f"{name}_ms_per_token"]) for d, v in rows.items()]), 2)
    if args.rpc:
        doc["rpc_command"] = f"{args.rpc_command} (llama.cpp of llama-cpp-python {_rpc.version()})"
    ok = all(v["identical_tokens"] for v in doc.values() if isinstance(v, dict))
    print_report(doc, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
