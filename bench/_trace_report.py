"""What a ring token waits for, from a trace (meshnet_p2p/core/trace.py; bench/wan.py --trace).

    python bench/_trace_report.py TRACE.jsonl [--json] [--show N]

(bench/wan.py --trace runs it on each trace it writes, and its smoke mode traces,
so CI runs this too.)

Takes the events between the client's ``bench.trace`` begin and end. A decode
token at position p runs from the head's ``step`` at p (fed by the tail, or the
client) to the head's ``step`` at p+1. For every such token it orders the
events that name p on every process (peers' step/compute/copy/forward, the
client's copies) and reports, over the tokens, the median and 90th percentile
of each gap between consecutive events (labelled ``who:event -> who:event``),
the token's whole period, and the share of it that was compute. ``--show N``
prints the N-th token's full timeline, with the unlabelled events in between
(the links' chunk reads and writes, frames received, flow-control waits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict


def load(path: str) -> list[dict]:
    with open(path) as f:
        events = [json.loads(line) for line in f if line.strip()]
    events.sort(key=lambda e: e["t"])
    begin = next((e["t"] for e in events if e["ev"] == "bench.trace" and e.get("begin")), None)
    end = next((e["t"] for e in events if e["ev"] == "bench.trace" and e.get("begin") is False), None)
    if begin is None or end is None:
        raise SystemExit(f"{path}: no bench.trace begin and end events")
    return [e for e in events if begin <= e["t"] <= end]


def head_of(events: list[dict]) -> str:
    """The peer whose span starts at 0."""
    return next(e["who"] for e in events if e["who"].startswith("peer 0:"))


def tokens(events: list[dict]) -> list[tuple[int, int, int]]:
    """(p, t of the head's step at p, t of its step at p+1) for each decode token fed by the tail."""
    head = head_of(events)
    steps = {e["pos"]: e["t"] for e in events if e["who"] == head and e["ev"] == "step" and e.get("attached")}
    return [(p, t, steps[p + 1]) for p, t in sorted(steps.items()) if p + 1 in steps]


def chain(events: list[dict], p: int, t0: int, t1: int) -> list[tuple[int, str]]:
    """The labelled events of token p: everything naming p on its way, then the head's step at p+1."""
    head = head_of(events)
    out = [(e["t"], f"{e['who']}:{e['ev']}") for e in events if e.get("pos") == p and t0 <= e["t"] < t1
           and "pos" in e]
    out.append((t1, f"{head}:step(next)"))
    return sorted(out)


def report(events: list[dict]) -> dict:
    gaps: dict[str, list[float]] = defaultdict(list)
    periods, computes = [], []
    order: dict[str, float] = {}
    for p, t0, t1 in tokens(events):
        c = chain(events, p, t0, t1)
        periods.append((t1 - t0) / 1e6)
        busy = 0
        starts: dict[str, int] = {}
        for t, label in c:
            who, ev = label.rsplit(":", 1)
            if ev == "compute":
                starts[who] = t
            elif ev == "computed" and who in starts:
                busy += t - starts.pop(who)
        computes.append(busy / 1e6)
        for (ta, a), (tb, b) in zip(c, c[1:]):
            key = f"{a} -> {b}"
            gaps[key].append((tb - ta) / 1e6)
            order.setdefault(key, (ta - t0) / 1e6)
    if not periods:
        raise SystemExit("no decode token fed by the tail in the traced window")

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"n": len(xs), "median_ms": round(statistics.median(xs), 3),
                "p90_ms": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 3)}

    return {"tokens": len(periods), "period": stats(periods), "compute": stats(computes),
            "gaps": {k: stats(gaps[k]) for k in sorted(gaps, key=lambda k: order[k])}}


def timeline(events: list[dict], n: int) -> list[str]:
    toks = tokens(events)
    p, t0, t1 = toks[min(n, len(toks) - 1)]
    return [f"{(e['t'] - t0) / 1e6:9.3f} ms  {e['who']:<12} {e['ev']:<12} "
            + " ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "pid", "who", "ev"))
            for e in events if t0 <= e["t"] <= t1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--show", type=int, metavar="N", help="print the N-th token's whole timeline")
    args = ap.parse_args()
    events = load(args.trace)
    doc = report(events)
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"{doc['tokens']} tokens: period median {doc['period']['median_ms']} ms "
              f"(p90 {doc['period']['p90_ms']}), compute median {doc['compute']['median_ms']} ms")
        for k, v in doc["gaps"].items():
            print(f"  {v['median_ms']:8.3f} ms (p90 {v['p90_ms']:8.3f}, n={v['n']})  {k}")
    if args.show is not None:
        print("\n".join(timeline(events, args.show)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
