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

from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.cut import inspect_gguf, sha256_file
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.local import LocalRoute, parse_split
from meshnet_p2p.models import default_model_path

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
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-ubatch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model = args.model or default_model_path()
    digest = sha256_file(model)
    n_layer = inspect_gguf(model, source_sha256=digest).source_layers
    tok = Tokenizer(model)
    prompt = (tok.encode(TEXT) * 8)[: args.prompt_tokens]
    common = dict(source_sha256=digest, n_ubatch=args.n_ubatch, n_threads=args.threads, max_sessions=1,
                  n_ctx_per_session=args.prompt_tokens + args.decode_tokens)
    whole = LocalRoute.from_model(model, [(0, n_layer)], **common)
    chain = LocalRoute.from_model(model, parse_split(args.split, n_layer), **common)
    greedy = SamplingParams()
    runs: dict[str, list] = {"whole": [], "chain": []}
    try:
        for route in (whole, chain):  # warm-up: page in weights, build graphs
            route.generate(prompt, 8, greedy, stop_at_eog=False)
        for _ in range(args.reps):
            for name, route in (("whole", whole), ("chain", chain)):
                runs[name].append(route.generate(prompt, args.decode_tokens, greedy, stop_at_eog=False))
    finally:
        whole.close()
        chain.close()
    same = all(a.token_ids == b.token_ids for a, b in zip(runs["whole"], runs["chain"], strict=True))

    def med(name, attr):
        return statistics.median(getattr(g, attr) for g in runs[name])

    doc = {
        "split": [list(r) for r in parse_split(args.split, n_layer)],
        "prompt_tokens": len(prompt),
        "decode_tokens": args.decode_tokens,
        "reps": args.reps,
        "whole_decode_tok_s": round(med("whole", "decode_tokens_per_s"), 2),
        "chain_decode_tok_s": round(med("chain", "decode_tokens_per_s"), 2),
        "whole_prefill_ms": round(med("whole", "ttft_ms"), 2),
        "chain_prefill_ms": round(med("chain", "ttft_ms"), 2),
        "identical_tokens": same,
    }
    doc["decode_ratio"] = round(doc["chain_decode_tok_s"] / doc["whole_decode_tok_s"], 4)
    doc["prefill_ratio"] = round(doc["chain_prefill_ms"] / doc["whole_prefill_ms"], 4)
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"whole model : decode {doc['whole_decode_tok_s']:7.2f} tok/s   prefill {doc['whole_prefill_ms']:7.2f} ms")
        print(f"3-shard chain: decode {doc['chain_decode_tok_s']:7.2f} tok/s   prefill {doc['chain_prefill_ms']:7.2f} ms")
        print(f"decode ratio {doc['decode_ratio']:.3f} (target >= 0.97)   prefill time ratio {doc['prefill_ratio']:.3f}   "
              f"identical tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
