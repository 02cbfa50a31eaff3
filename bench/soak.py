"""Sixteen users for two minutes (issue 13): nothing lost, nothing leaked.

    python bench/soak.py [--sessions 16] [--seconds 120] [--tokens 24] [--json]

A 3-peer loopback swarm (0:10, 10:20, 20:30 of the embedded model, one
llama.cpp thread each: they share this machine's cores). B client threads
each run greedy generations back to back until the time is up, every one
checked against the whole model's tokens for its prompt. Reports
generations completed, failed and wrong (``lost`` = failed + wrong; target
0), and per peer its open descriptors and RSS after a warm-up and after the
soak, once its sessions have closed. Bounds (``within_bounds``): at most
FD_SLACK more descriptors and RSS_SLACK_MB more RSS per peer than after the
warm-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import trio

from meshnet_p2p.client import Client, connect
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.cut import sha256_file
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.route.local import LocalRoute
from meshnet_p2p.engine.models import default_model_path
from meshnet_p2p.roles.peer_process import Swarm

from _report import print_report  # bench/ is on sys.path when a bench runs
from _smoke import parse_args
from load import prompts

FD_SLACK = 8  # descriptors: a few connections may still be closing
RSS_SLACK_MB = 32  # allocator and Python caches settle; a leak per session would be far more over hundreds


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def settled(pids: list[int], engine_idle) -> tuple[list[int], list[float]]:
    """Descriptors and RSS once every peer has closed its sessions (bounded wait)."""
    for _ in range(100):
        if engine_idle():
            break
        time.sleep(0.1)  # a bench, not a test: polling the peers' state is what an operator would do
    return [fds(p) for p in pids], [round(rss_mb(p), 1) for p in pids]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, sessions=2, seconds=3.0, tokens=4)
    model = default_model_path()
    tok = Tokenizer(model)
    texts = prompts(args.sessions)
    whole = LocalRoute.from_model(model, [(0, 30)], source_sha256=sha256_file(model), max_sessions=1)
    try:
        want = {t: whole.generate(tok.encode(t), args.tokens, SamplingParams(), stop_at_eog=False).token_ids for t in texts}
    finally:
        whole.close()
    with Swarm(("0:10", "10:20", "20:30"), "--threads", str(args.threads)) as swarm:
        swarm.certify()
        client = Client([swarm.addr], step_timeout=120.0)
        pids = [j.p.pid for j in swarm.joins]

        spans = trio.run(client.spans)

        def idle() -> bool:  # every peer says it holds no session (its Health call)
            for span in spans:
                peer = connect(span, 10.0)
                try:
                    if peer.health().active_sessions:
                        return False
                finally:
                    peer.close()
            return True

        with ThreadPoolExecutor(args.sessions) as pool:  # warm-up: every user once
            list(pool.map(lambda t: client.generate(t, 4, SamplingParams(), stop_at_eog=False), texts))
        fd0, rss0 = settled(pids, idle)
        counts = {"completed": 0, "failed": 0, "wrong": 0}
        lock = threading.Lock()
        stop = time.monotonic() + args.seconds

        def user(text: str) -> None:
            while time.monotonic() < stop:
                try:
                    got = client.generate(text, args.tokens, SamplingParams(), stop_at_eog=False).token_ids
                    outcome = "completed" if got == want[text] else "wrong"
                except Exception as e:
                    print(f"generation failed: {e}", file=sys.stderr)
                    outcome = "failed"
                with lock:
                    counts[outcome] += 1

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.sessions) as pool:
            list(pool.map(user, texts))
        wall = time.perf_counter() - t0
        fd1, rss1 = settled(pids, idle)
    within = all(b - a <= FD_SLACK for a, b in zip(fd0, fd1, strict=True)) and \
        all(b - a <= RSS_SLACK_MB for a, b in zip(rss0, rss1, strict=True))
    doc = {
        "date": time.strftime("%Y-%m-%d"), "sessions": args.sessions, "seconds": round(wall, 1), "tokens": args.tokens,
        **counts, "lost": counts["failed"] + counts["wrong"],
        "aggregate_tok_s": round(counts["completed"] * args.tokens / wall, 2),
        "fds_before": fd0, "fds_after": fd1, "rss_mb_before": rss0, "rss_mb_after": rss1,
        "fd_slack": FD_SLACK, "rss_slack_mb": RSS_SLACK_MB, "within_bounds": within,
    }
    print_report(doc, args.json)
    return 0 if within and doc["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
