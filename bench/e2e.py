"""A 3-peer loopback swarm against the whole model in one llama.cpp process,
measured side by side in one run.

    python bench/e2e.py [--tokens 64] [--reps 5] [--threads 2] [--model GGUF] [--json]

Starts a bootstrap peer and three `meshnet-peer join` processes (a third of
the model's layers each: [0,10), [10,20), [20,30) of the embedded model; any
other GGUF with --model), then alternates: a generation
through the swarm (this process as the client), a generation with the whole
model in this process. The swarm is driven two ways in turns: as a ring
(the default route: peers forward to each other) and as a star (the client
carries every hop). Reports medians, `decode_ratio` (the ring's decode
tokens/s / whole model's), `star_decode_ratio` likewise, and `ttft_ratio`
(the ring's time to first token / whole model's). Target (issue 5):
decode_ratio >= 0.85.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from meshnet_p2p.client import Client
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.cut import inspect_gguf, sha256_file
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.route.local import LocalRoute
from meshnet_p2p.engine.models import default_model_path
from meshnet_p2p.roles.demo import thirds
from meshnet_p2p.roles.peer_process import Swarm

from _report import print_report  # bench/ is on sys.path when a bench runs
from _smoke import parse_args

PROMPT = ("The history of clockmaking is a story of patience. Early water clocks measured hours by the flow "
          "of water through a small opening, while mechanical clocks in medieval towers used weights and gears.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads per peer and for the whole model")
    ap.add_argument("--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, tokens=4, reps=1, threads=1)

    model = args.model or default_model_path()
    n_layer = inspect_gguf(model).source_layers
    with Swarm(thirds(n_layer), "--threads", str(args.threads), "--model", model) as swarm:
        swarm.certify(model)  # a fresh swarm's recipe is dark until certified
        # the ring (the default route) and the star (the client carries every hop) take turns
        clients = {"swarm": Client([swarm.addr], model_path=model),
                   "star": Client([swarm.addr], ring=False, model_path=model)}
        whole = LocalRoute.from_model(model, [(0, n_layer)], source_sha256=sha256_file(model), n_ubatch=64,
                                      n_threads=args.threads, max_sessions=1)
        prompt_ids = Tokenizer(model).encode(PROMPT)
        greedy = SamplingParams()
        runs: dict[str, list] = {"swarm": [], "star": [], "whole": []}
        for client in clients.values():  # warm-up all
            client.generate(PROMPT, 4, greedy, stop_at_eog=False)
        whole.generate(prompt_ids, 4, greedy, stop_at_eog=False)
        for _ in range(args.reps):
            for name, client in clients.items():
                runs[name].append(client.generate(PROMPT, args.tokens, greedy, stop_at_eog=False))
            runs["whole"].append(whole.generate(prompt_ids, args.tokens, greedy, stop_at_eog=False))
        whole.close()
    same = all(s.token_ids == w.token_ids for name in ("swarm", "star")
               for s, w in zip(runs[name], runs["whole"], strict=True))
    doc = {"model": os.path.basename(model), "tokens": args.tokens, "reps": args.reps, "threads": args.threads}
    for name in ("swarm", "star", "whole"):
        doc[f"{name}_decode_tok_s"] = round(statistics.median(r.decode_tokens_per_s for r in runs[name]), 2)
        doc[f"{name}_ttft_ms"] = round(statistics.median(r.ttft_ms for r in runs[name]), 2)
    doc["identical_tokens"] = same
    doc["decode_ratio"] = round(doc["swarm_decode_tok_s"] / doc["whole_decode_tok_s"], 4)  # the ring
    doc["star_decode_ratio"] = round(doc["star_decode_tok_s"] / doc["whole_decode_tok_s"], 4)
    doc["ttft_ratio"] = round(doc["swarm_ttft_ms"] / doc["whole_ttft_ms"], 4)
    print_report(doc, args.json)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
