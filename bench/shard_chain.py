"""Decode speed and prefill time of a 3-shard in-process chain against the whole
model, measured side by side in one run (alternating, medians).

    python bench/shard_chain.py [--split 10,20] [--prompt-tokens 96] [--decode-tokens 64] [--reps 5] [--json]

Target (issue 2): decode ratio >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.cut import inspect_gguf, sha256_file
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.route.local import LocalRoute, parse_split
from meshnet_p2p.engine.models import default_model_path

from _smoke import parse_args  # bench/ is on sys.path when a bench runs

TEXT = (
    "The history of clockmaking is a story of patience. Early water clocks measured hours by the flow "
    "of water through a small opening, while mechanical clocks in medieval towers used weights, gears and "
    "an escapement to divide the day. Later, pendulums and springs made clocks small enough for a room "
    "and then for a pocket, and each improvement changed how people worked, travelled and met each other. "
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--split", default="10,20")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--block", type=int, default=8, help="tokens per turn when the two routes alternate")
    ap.add_argument("--n-ubatch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, prompt_tokens=16, decode_tokens=8, reps=1, block=4, threads=1)

    model = args.model or default_model_path()
    digest = sha256_file(model)
    n_layer = inspect_gguf(model, source_sha256=digest).source_layers
    tok = Tokenizer(model)
    prompt = (tok.encode(TEXT) * 8)[: args.prompt_tokens]
    common = dict(source_sha256=digest, n_ubatch=args.n_ubatch, n_threads=args.threads, max_sessions=1,
                  n_ctx_per_session=args.prompt_tokens + args.decode_tokens)
    whole = LocalRoute.from_model(model, [(0, n_layer)], **common)
    split = parse_split(args.split, n_layer)
    chain = LocalRoute.from_model(model, split, **common)
    greedy = SamplingParams()
    # Side by side in small blocks: both routes decode the same sequence, taking
    # turns every --block tokens, so a noisy neighbour on this shared machine
    # slows both alike instead of skewing one run. The first token of each
    # block is not timed: it pays for the other route having just used the
    # caches, which a peer serving only its own shard never does.
    per_token: dict[str, list[float]] = {"whole": [], "chain": []}
    prefill_ms: dict[str, list[float]] = {"whole": [], "chain": []}
    tokens: dict[str, list[int]] = {"whole": [], "chain": []}
    routes = {"whole": whole, "chain": chain}
    try:
        for route in (whole, chain):  # warm-up: page in weights, build graphs
            route.generate(prompt, 8, greedy, stop_at_eog=False)
        for rep in range(args.reps):
            order = ["whole", "chain"] if rep % 2 == 0 else ["chain", "whole"]
            sids = {name: routes[name].open(len(prompt) + args.decode_tokens, greedy) for name in order}
            nxt = {}
            for name in order:
                t0 = time.perf_counter()
                nxt[name] = routes[name].prefill(sids[name], prompt).token.token_id
                prefill_ms[name].append((time.perf_counter() - t0) * 1000)
                tokens[name].append(nxt[name])
            position = {name: len(prompt) for name in order}
            left = args.decode_tokens - 1
            turn = 0
            while left > 0:
                n = min(args.block, left)
                for name in (order if turn % 2 == 0 else order[::-1]):
                    for j in range(n):
                        t0 = time.perf_counter()
                        result = routes[name].step(sids[name], position[name], (nxt[name],), decode=True)
                        if j:
                            per_token[name].append(time.perf_counter() - t0)
                        nxt[name] = result.token.token_id
                        tokens[name].append(nxt[name])
                        position[name] += 1
                left -= n
                turn += 1
            for name in order:
                routes[name].release(sids[name])
    finally:
        whole.close()
        chain.close()
    same = tokens["whole"] == tokens["chain"]

    doc = {
        "split": [list(r) for r in split],
        "prompt_tokens": len(prompt),
        "decode_tokens": args.decode_tokens,
        "reps": args.reps,
        # tokens/s over all timed tokens (what a user sees), and from the median
        # token time (what a step costs when the machine is not interrupted)
        "whole_decode_tok_s": round(len(per_token["whole"]) / sum(per_token["whole"]), 2),
        "chain_decode_tok_s": round(len(per_token["chain"]) / sum(per_token["chain"]), 2),
        "whole_median_tok_s": round(1 / statistics.median(per_token["whole"]), 2),
        "chain_median_tok_s": round(1 / statistics.median(per_token["chain"]), 2),
        "whole_prefill_ms": round(statistics.median(prefill_ms["whole"]), 2),
        "chain_prefill_ms": round(statistics.median(prefill_ms["chain"]), 2),
        "identical_tokens": same,
    }
    doc["decode_ratio"] = round(doc["chain_decode_tok_s"] / doc["whole_decode_tok_s"], 4)
    doc["median_decode_ratio"] = round(doc["chain_median_tok_s"] / doc["whole_median_tok_s"], 4)
    doc["prefill_ratio"] = round(doc["chain_prefill_ms"] / doc["whole_prefill_ms"], 4)
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"whole model : decode {doc['whole_decode_tok_s']:7.2f} tok/s   prefill {doc['whole_prefill_ms']:7.2f} ms")
        print(f"3-shard chain: decode {doc['chain_decode_tok_s']:7.2f} tok/s   prefill {doc['chain_prefill_ms']:7.2f} ms")
        print(f"decode ratio {doc['decode_ratio']:.3f} (target >= 0.97; median-token ratio {doc['median_decode_ratio']:.3f})   "
              f"prefill time ratio {doc['prefill_ratio']:.3f}   "
              f"identical tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
