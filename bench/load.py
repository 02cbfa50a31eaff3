"""Many users at once (issue 13): B concurrent generations on a 3-peer loopback
swarm, from one client process and through `meshnet-peer api`, beside the
engine's own batched ceiling for the same B, measured in one run.

    python bench/load.py [--sessions 1,4,8,16] [--tokens 32] [--json]

For each B: the ceiling is B sessions of the whole model in this process,
each prefilling its prompt and decoding side by side on one engine (its
compute thread batches their steps), in aggregate tokens/s, with every core
of this machine (the swarm's three peers share the same cores). The swarm (three `meshnet-peer join` processes:
0:10, 10:20, 20:30) then serves B greedy generations at once, started
together from B threads of one Client, and B concurrent `/v1/completions`
requests to an API process in front of the same swarm. Each reports how
many completed, how many equal the whole model's tokens (the reference),
per-session decode tokens/s, aggregate tokens/s (all B generations' tokens
over the wall time from their start to the last one's end), p50/p99 time
per token, and
``swarm_vs_ceiling`` (aggregate / ceiling). Target at B=16: 16/16 complete
and identical, swarm_vs_ceiling >= 0.8. Beside it, the ceiling of one
process with as many threads as one peer has (``..._peer_threads``): the
swarm is three such processes on the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from meshnet_p2p.client import Client
from meshnet_p2p.engine.contract import DecodeRequest, LoadRequest, OpenRequest, PrefillRequest, SamplingParams
from meshnet_p2p.engine.cut import sha256_file
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.route.local import LocalRoute
from meshnet_p2p.engine.models import default_model_path
from meshnet_p2p.roles.peer_process import PeerProcess, Swarm

from _report import print_report  # bench/ is on sys.path when a bench runs
from _smoke import parse_args

SUBJECTS = ["The capital of France", "Water", "The largest planet", "A good breakfast", "Python", "The moon",
            "Music", "The ocean", "A library", "Winter", "The oldest tree", "Mathematics", "A bicycle", "Coffee",
            "The internet", "A volcano", "Chess", "A lighthouse", "Bread", "The desert"]


def prompts(n: int) -> list[str]:
    return [f"{SUBJECTS[i % len(SUBJECTS)]} is" + " really" * (i // len(SUBJECTS)) for i in range(n)]


def ceiling(model: str, ids: list[list[int]], tokens: int, threads: int) -> float:
    """Aggregate decode tokens/s of len(ids) sessions on one whole-model engine, stepping side by side."""
    e = LlamaCppShardEngine()
    e.load(LoadRequest(model, max_sessions=max(len(ids), 1), n_ctx_per_session=256, n_threads=threads,
                       source_sha256=sha256_file(model))).status.raise_for_status()
    try:
        for i, p in enumerate(ids):
            e.open_session(OpenRequest(f"s{i}", len(p) + tokens + 1)).raise_for_status()
        start = threading.Barrier(len(ids) + 1)

        def run(i: int) -> None:
            start.wait()
            r = e.prefill(PrefillRequest(f"s{i}", 0, token_ids=tuple(ids[i])))  # as a user's request: prompt first
            r.status.raise_for_status()
            tok, pos = r.token.token_id, len(ids[i])
            for _ in range(tokens - 1):
                r = e.decode(DecodeRequest(f"s{i}", pos, token_id=tok))
                r.status.raise_for_status()
                tok, pos = r.token.token_id, pos + 1

        with ThreadPoolExecutor(len(ids)) as pool:
            done = [pool.submit(run, i) for i in range(len(ids))]
            start.wait()
            t0 = time.perf_counter()
            for f in done:
                f.result()
            wall = time.perf_counter() - t0
        return len(ids) * tokens / wall
    finally:
        e.close()


def _summary(results: list[tuple[list[int] | None, list[float], float]], expected: list[list[int]], wall: float,
             tokens: int) -> dict:
    done = [r for r in results if r[0] is not None]
    gaps = [g for r in done for g in r[1]]
    per = [r[2] for r in done]
    return {
        "completed": len(done),
        "identical": sum(1 for r, want in zip(results, expected, strict=True) if r[0] == want),
        "per_session_tok_s": round(statistics.median(per), 2) if per else 0.0,
        "aggregate_tok_s": round(len(done) * tokens / wall, 2) if wall > 0 else 0.0,
        "p50_ms_per_token": round(statistics.median(gaps) * 1000, 1) if gaps else None,
        "p99_ms_per_token": round(statistics.quantiles(gaps, n=100)[98] * 1000, 1) if len(gaps) >= 2 else None,
    }


def together(one, texts: list[str], start: threading.Barrier) -> tuple[list, float]:
    """``one(text)`` for every text at once (each waits at ``start``), and the wall
    time from when all are released to when the last ends."""
    with ThreadPoolExecutor(len(texts)) as pool:
        futures = [pool.submit(one, t) for t in texts]
        start.wait()
        t0 = time.perf_counter()
        results = [f.result() for f in futures]
    return results, time.perf_counter() - t0


def through_client(client: Client, texts: list[str], tokens: int) -> tuple[list, float]:
    start = threading.Barrier(len(texts) + 1)

    def one(text: str):
        stamps: list[float] = []
        start.wait()
        try:
            r = client.generate(text, tokens, SamplingParams(), stop_at_eog=False,
                                on_token=lambda piece: stamps.append(time.perf_counter()))
        except Exception as e:  # counted as not completed, and said why
            print(f"client generation failed: {e}", file=sys.stderr)
            return None, [], 0.0
        gaps = [b - a for a, b in zip(stamps[:-2], stamps[1:-1], strict=False)]  # the last callback is the flush
        return r.token_ids, gaps, r.decode_tokens_per_s

    return together(one, texts, start)


def through_api(url: str, model_name: str, texts: list[str], tokens: int) -> tuple[list, float]:
    start = threading.Barrier(len(texts) + 1)

    def one(text: str):
        body = json.dumps({"model": model_name, "prompt": text, "max_tokens": tokens, "temperature": 0,
                           "stream": True}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        stamps, pieces = [], []
        start.wait()
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                for line in resp:
                    line = line.strip()
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        piece = json.loads(line[6:])["choices"][0]["text"]
                        if piece:
                            stamps.append(time.perf_counter())
                            pieces.append(piece)
        except Exception as e:
            print(f"API request failed: {e}", file=sys.stderr)
            return None, [], 0.0
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else 0.0
        return "".join(pieces), gaps, rate

    return together(one, texts, start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp threads per peer (default 1: the three peers share this machine's cores)")
    ap.add_argument("--ceiling-threads", type=int, default=os.cpu_count() or 1,
                    help="llama.cpp threads of the ceiling's one process (default: every core, as the swarm has)")
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, sessions="1,2", tokens=4)
    sizes = [int(x) for x in args.sessions.split(",")]
    model = default_model_path()
    tok = Tokenizer(model)
    texts_all = prompts(max(sizes))
    whole = LocalRoute.from_model(model, [(0, 30)], source_sha256=sha256_file(model), n_threads=args.threads,
                                  max_sessions=1)
    try:
        expected_ids = [whole.generate(tok.encode(t), args.tokens, SamplingParams(), stop_at_eog=False).token_ids
                        for t in texts_all]
    finally:
        whole.close()
    doc: dict = {"tokens": args.tokens, "peer_threads": args.threads, "ceiling_threads": args.ceiling_threads,
                 "date": time.strftime("%Y-%m-%d")}
    ok = True
    with Swarm(("0:10", "10:20", "20:30"), "--threads", str(args.threads)) as swarm:
        swarm.certify()
        client = Client([swarm.addr], step_timeout=120.0)
        api = PeerProcess("api", "--bootstrap", swarm.addr, "--listen", "127.0.0.1:0", "--step-timeout", "120")
        try:
            url = api.wait_line("listening on ").removeprefix("listening on ")
            client.generate(texts_all[0], 4, SamplingParams(), stop_at_eog=False)  # warm-up
            model_name = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=60).read())["data"][0]["id"]
            for b in sizes:
                texts, want = texts_all[:b], expected_ids[:b]
                roof = ceiling(model, [tok.encode(t) for t in texts], args.tokens, args.ceiling_threads)
                same = roof if args.threads == args.ceiling_threads else \
                    ceiling(model, [tok.encode(t) for t in texts], args.tokens, args.threads)
                results, wall = through_client(client, texts, args.tokens)
                row = {"ceiling_tok_s": round(roof, 2), "ceiling_peer_threads_tok_s": round(same, 2),
                       **_summary(results, want, wall, args.tokens)}
                row["swarm_vs_ceiling"] = round(row["aggregate_tok_s"] / roof, 3)
                row["swarm_vs_ceiling_peer_threads"] = round(row["aggregate_tok_s"] / same, 3)
                api_results, api_wall = through_api(url, model_name, texts, args.tokens)
                api_want = [tok.decode(w) for w in want]
                api_row = _summary(api_results, api_want, api_wall, args.tokens)
                row.update({f"api_{k}": v for k, v in api_row.items()})
                ok = ok and row["identical"] == b and api_row["identical"] == b
                doc[f"b{b}"] = row
        finally:
            api.stop()
    doc["all_identical"] = ok
    print_report(doc, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
