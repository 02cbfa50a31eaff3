"""What a wait between steps costs, and whether it is ours: side by side in one run.

    python bench/idle.py [--span 10:20] [--gaps 0,2,5,10,20,50] [--steps 40] [--json]

For each gap G (ms slept before every measured operation), medians of:
- ``shard_step_ms``: one decode step of a real shard engine (the span given,
  fed random hidden states or token ids), as a peer of a ring takes it;
- ``shard_step_warm_ms``: the same, with the peer's keep-warm on
  (engine/keepwarm.py: after each step, idle-priority threads keep the CPUs
  awake for --keep-warm ms, as `serve` and `join` do by default);
- ``shard_step_touched_ms``: the same, after every cache line of the shard's
  file was read just before the step (the weights llama.cpp computes from are
  that file's pages, mapped: data caches are physically tagged), i.e. with
  its weights prefetched;
- ``stream_ms``: numpy summing an array the size of the shard file: memory
  only, no llama.cpp;
- ``wake_us``: a round trip between two Python threads (Event set, Event
  set back), the hand-off every step makes at least twice;
- ``python_ms``: a pure-Python integer loop (no memory traffic to speak of):
  the control that tells a slower clock from colder caches.

Each row also gives each figure against its gap-0 value. On this project's
2-vCPU Firecracker VMs (2026-12-01) everything that touches memory or wakes
a thread gets 1.5-8x slower after 10-50 ms idle while the integer loop does
not, and prefetching the weights does not bring the step back: see
docs/engine.md, "A step after idle".
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import threading
import time

import numpy as np

from meshnet_p2p.engine.contract import (
    HIDDEN, DecodeRequest, LoadRequest, OpenRequest, PrefillRequest, SamplingParams, Tensor, TensorBundle,
)
from meshnet_p2p.engine.cut import sha256_file
from meshnet_p2p.engine.keepwarm import KeepWarm
from meshnet_p2p.engine.llama_engine import LlamaCppShardEngine
from meshnet_p2p.engine.models import default_model_path, ensure_shard

from _report import print_report  # bench/ is on sys.path when a bench runs
from _smoke import parse_args


class ShardStepper:
    """One session on one shard engine, a decode step at a time."""

    def __init__(self, path: str, head: bool, threads: int) -> None:
        self.engine = LlamaCppShardEngine()
        self.engine.load(LoadRequest(path, max_sessions=1, n_ctx_per_session=4096, n_threads=threads,
                                     seam_dtype="f32", n_ubatch=64)).status.raise_for_status()
        self.head, self.pos = head, 0
        self.n_embd = self.engine.capabilities().n_embd
        self.rng = np.random.default_rng(0)
        self.engine.open_session(OpenRequest("idle", 4000, SamplingParams())).raise_for_status()
        self.step(32)
        for _ in range(20):
            self.step()

    def step(self, rows: int = 1) -> float:
        if self.head:
            kw = {"token_ids": tuple(range(1, rows + 1))} if rows > 1 else {"token_id": 5}
        else:
            h = self.rng.standard_normal((rows, self.n_embd), dtype=np.float32)
            kw = {"hidden": TensorBundle((Tensor(HIDDEN, "f32", h.shape, h.tobytes()),))}
        t0 = time.perf_counter()
        if rows > 1:
            result = self.engine.prefill(PrefillRequest("idle", self.pos, **kw))
        else:
            result = self.engine.decode(DecodeRequest("idle", self.pos, **kw))
        dt = time.perf_counter() - t0
        result.status.raise_for_status()
        self.pos += rows
        return dt

    def close(self) -> None:
        self.engine.close()


class Pinger:
    """A thread that answers a ping: two wake-ups of a sleeping thread per round trip."""

    def __init__(self) -> None:
        self.ping, self.pong = threading.Event(), threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.ping.wait()
            self.ping.clear()
            self.pong.set()

    def round_trip(self) -> float:
        t0 = time.perf_counter()
        self.ping.set()
        self.pong.wait()
        self.pong.clear()
        return time.perf_counter() - t0


def python_loop(n: int = 20_000) -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x = (x * 31 + i) & 0xFFFF
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--span", default="10:20")
    ap.add_argument("--gaps", default="0,2,5,10,20,50")
    ap.add_argument("--steps", type=int, default=40, help="measurements per gap and kind")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep-warm", type=int, default=250, metavar="MS", help="the window of shard_step_warm_ms")
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, gaps="0,2", steps=3, threads=1)
    start, end = (int(x) for x in args.span.split(":"))
    model = default_model_path()
    path = ensure_shard(model, start, end, sha256_file(model))
    stepper = ShardStepper(path, head=start == 0, threads=args.threads)
    with open(path, "rb") as f:
        pages = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
    array = np.ones(len(pages) // 4, dtype=np.float32)
    pinger = Pinger()
    warm = KeepWarm(args.threads, args.keep_warm / 1000)
    kinds = {
        "shard_step_ms": stepper.step,
        "shard_step_warm_ms": lambda: _then(stepper.step(), warm.touch),
        "shard_step_touched_ms": lambda: (int(pages[::64].sum()), stepper.step())[1],
        "stream_ms": lambda: _timed(array.sum),
        "wake_us": pinger.round_trip,
        "python_ms": python_loop,
    }
    scale = {k: (1e6 if k.endswith("_us") else 1e3) for k in kinds}
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "span": args.span, "shard_bytes": len(pages),
                 "cpus": os.cpu_count(), "threads": args.threads}
    base: dict[str, float] = {}
    try:
        for gap in (float(g) for g in args.gaps.split(",")):
            row = {}
            for name, op in kinds.items():
                warm.stop()  # only its own kind keeps the CPUs awake
                op()  # one untimed: the previous kind's data is in the caches
                times = []
                for _ in range(args.steps):
                    if gap:
                        time.sleep(gap / 1000)
                    times.append(op())
                median = statistics.median(times) * scale[name]
                base.setdefault(name, median)
                row[name] = round(median, 3)
                row[name.rsplit("_", 1)[0] + "_vs_gap0"] = round(median / base[name], 2)
            doc[f"gap_{gap:g}ms"] = row
        warm.stop()
        doc["keep_warm_spun_s"] = round(warm.stats().spun_s, 3)  # its price: CPU seconds spent spinning
    finally:
        stepper.close()
    print_report(doc, args.json)
    return 0


def _then(value: float, fn) -> float:
    fn()
    return value


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
