"""A 3-peer loopback swarm against the whole model in one llama.cpp process,
measured side by side in one run.

    python bench/e2e.py [--tokens 64] [--reps 5] [--threads 2] [--json]

Starts a bootstrap peer and three `meshnet-peer join` processes ([0,10),
[10,20), [20,30) of the embedded model), then alternates: a generation
through the swarm (this process as the client), a generation with the whole
model in this process. Reports medians and `decode_ratio` (swarm decode
tokens/s / whole model's) and `ttft_ratio` (swarm time to first token /
whole model's). Target (issue 5): decode_ratio >= 0.85.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from meshnet_p2p.client import Client
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.cut import sha256_file
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.local import LocalRoute
from meshnet_p2p.models import default_model_path
from meshnet_p2p.peer_process import Swarm

from _report import print_report  # bench/ is on sys.path when a bench runs

PROMPT = ("The history of clockmaking is a story of patience. Early water clocks measured hours by the flow "
          "of water through a small opening, while mechanical clocks in medieval towers used weights and gears.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads per peer and for the whole model")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model = default_model_path()
    with Swarm(("0:10", "10:20", "20:30"), "--threads", str(args.threads)) as swarm:
        swarm.certify()  # a fresh swarm's recipe is dark until certified
        client = Client([swarm.addr])
        whole = LocalRoute.from_model(model, [(0, 30)], source_sha256=sha256_file(model), n_ubatch=64,
                                      n_threads=args.threads, max_sessions=1)
        prompt_ids = Tokenizer(model).encode(PROMPT)
        greedy = SamplingParams()
        swarm_runs, whole_runs = [], []
        client.generate(PROMPT, 4, greedy, stop_at_eog=False)  # warm-up both
        whole.generate(prompt_ids, 4, greedy, stop_at_eog=False)
        for _ in range(args.reps):
            swarm_runs.append(client.generate(PROMPT, args.tokens, greedy, stop_at_eog=False))
            whole_runs.append(whole.generate(prompt_ids, args.tokens, greedy, stop_at_eog=False))
        whole.close()
    same = all(s.token_ids == w.token_ids for s, w in zip(swarm_runs, whole_runs, strict=True))
    doc = {
        "tokens": args.tokens,
        "reps": args.reps,
        "threads": args.threads,
        "swarm_decode_tok_s": round(statistics.median(r.decode_tokens_per_s for r in swarm_runs), 2),
        "whole_decode_tok_s": round(statistics.median(r.decode_tokens_per_s for r in whole_runs), 2),
        "swarm_ttft_ms": round(statistics.median(r.ttft_ms for r in swarm_runs), 2),
        "whole_ttft_ms": round(statistics.median(r.ttft_ms for r in whole_runs), 2),
        "identical_tokens": same,
    }
    doc["decode_ratio"] = round(doc["swarm_decode_tok_s"] / doc["whole_decode_tok_s"], 4)
    doc["ttft_ratio"] = round(doc["swarm_ttft_ms"] / doc["whole_ttft_ms"], 4)
    print_report(doc, args.json)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
