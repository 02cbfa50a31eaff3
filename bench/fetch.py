"""Volunteers that fetch only their span (issue 29), against cutting from a local
file, and the serving peer's inference while it uploads, measured in one run.

    python bench/fetch.py [--threads 1] [--tokens 96] [--reps 3] [--model GGUF] [--json]

Two peers hold the model file whole and serve half its layers each (a route
for certification has two hops at least); the bootstrap peer's key certifies
it and lists it under a name. For each third of the layers, two
volunteers start with empty caches, one after the other, each stopped before
the next (so the holders are the only sources):

- ``local``: `join --model FILE --layers A:B`, cutting its shard from the file here;
- ``fetched``: `join --model NAME --layers A:B` with no file: the manifest, the
  header and the span's tensors fetched from the holders, each checked.

Per span: seconds from the process's start to serving (``listening on``) for
both, their ratio, and the bytes fetched against the whole file.

Then the holders serve a client's greedy generations, in turns: idle, and
while this process downloads the whole file from them part after part in a
loop (as a volunteer would, up to each holder's limits: 32 MiB/s and 2
downloads from one host by default). ``upload_ratio`` = decode tokens/s while
uploading / idle (target >= 0.9: serving weights must not starve inference),
beside the upload rate reached. The downloader stands for another machine,
so its threads run at the lowest CPU priority here (its hashing and
decryption cost more CPU than the sending).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import threading
import time

import trio

from meshnet_p2p.client import Client
from meshnet_p2p.client.fetch import fetch_parts
from meshnet_p2p.client.named import find_model, model_sources
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.cut import inspect_gguf
from meshnet_p2p.engine.models import default_model_path
from meshnet_p2p.engine.partial import HEADER, PartialModel
from meshnet_p2p.roles.demo import thirds
from meshnet_p2p.roles.peer_process import PeerProcess, Swarm
from meshnet_p2p.swarm.node import start_node
from meshnet_p2p.trust.policy import TrustPolicy

from _report import print_report  # bench/ is on sys.path when a bench runs
from _smoke import parse_args

NAME = "bench-fetched"
PROMPT = "The history of clockmaking is a story of patience. Early water clocks"


def time_to_serve(addr: str, model: str, span: str, threads: int, cache: str) -> tuple[float, str]:
    """Seconds from starting a volunteer with an empty cache to its serving, and its output."""
    env = {**os.environ, "MESHNET_CACHE_DIR": cache}
    t0 = time.monotonic()
    p = PeerProcess("join", "--bootstrap", addr, "--model", model, "--layers", span, "--threads", str(threads),
                    "--listen", "127.0.0.1:0", env=env)
    try:
        p.address(600)
        return time.monotonic() - t0, "\n".join(p.lines)
    finally:
        p.stop()


class Downloads:
    """This process downloading the whole file from the holders while ``on``: ``streams``
    threads, a part at a time each (as fetch_parts does), so a pause waits one part."""

    def __init__(self, addr: str, trust: TrustPolicy, streams: int = 2) -> None:
        async def sources():
            async with trio.open_nursery() as nursery:
                node = await start_node(nursery, Identity.generate(), bootstrap=[addr], client_mode=True)
                named = await find_model(node, NAME, trust)
                found = await model_sources(node, named, lambda m: None)
                nursery.cancel_scope.cancel()
            return found

        self.manifest, _, self.sources, self.holdings = trio.run(sources)
        self.on, self.stopping = threading.Event(), threading.Event()
        self.bytes, self.seconds = 0, 0.0  # seconds: while on
        self._lock = threading.Lock()
        self._in_flight = threading.Condition(self._lock)
        self._busy = 0
        self._todo: list[str] = []
        self._partial: PartialModel | None = None
        self.root = tempfile.mkdtemp(prefix="meshnet-fetch-bench-")
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]
        for t in self.threads:
            t.start()

    def _next(self) -> tuple[PartialModel, str]:
        with self._lock:
            if not self._todo:  # a whole file done: start again from nothing, once no part is in flight
                self._in_flight.wait_for(lambda: self._busy == 0, timeout=120)
                if self._partial is not None:
                    shutil.rmtree(self._partial.dir)
                self._partial = PartialModel(self.root, self.manifest)
                self._todo = [HEADER, *(t.name for t in self.manifest.tensors)]
            self._busy += 1
            return self._partial, self._todo.pop()

    def _run(self) -> None:
        # the downloader stands for another machine: on this one, its hashing and decryption
        # (more CPU than the sending) would otherwise compete with the holders' inference
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            self.on.wait()
            if self.stopping.is_set():
                return
            partial, part = self._next()
            got = 0
            try:
                got = fetch_parts(partial, [part], self.sources, self.holdings, parallel=1).bytes
            finally:
                with self._lock:
                    self.bytes += got
                    self._busy -= 1
                    self._in_flight.notify_all()

    def start(self) -> None:
        self._t0 = time.monotonic()
        self.on.set()

    def pause(self) -> None:
        """Stop asking for parts, and wait for those in flight."""
        if not self.on.is_set():
            return
        self.on.clear()
        with self._lock:
            self._in_flight.wait_for(lambda: self._busy == 0, timeout=120)
            self.seconds += time.monotonic() - self._t0

    def close(self) -> None:
        self.pause()
        self.stopping.set()
        self.on.set()
        for t in self.threads:
            t.join(120)
        for c in self.sources.values():
            c.channel.close()
        shutil.rmtree(self.root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads per peer")
    ap.add_argument("--tokens", type=int, default=96, help="tokens a generation decodes")
    ap.add_argument("--reps", type=int, default=3, help="generations idle and uploading, in turns")
    ap.add_argument("--spans", type=int, default=3, help="how many of the three spans to fetch (smoke: 1)")
    ap.add_argument("--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, tokens=8, reps=1, spans=1)

    model = args.model or default_model_path()
    n_layer = inspect_gguf(model).source_layers
    size = os.path.getsize(model)
    doc: dict = {"model": os.path.basename(model), "file_bytes": size, "threads": args.threads}
    with tempfile.TemporaryDirectory(prefix="meshnet-fetch-") as tmp, \
            Swarm([f"0:{n_layer // 2}", f"{n_layer // 2}:{n_layer}"], "--threads", str(args.threads), "--model", model,
                  env={**os.environ, "MESHNET_CACHE_DIR": os.path.join(tmp, "holder")}) as swarm:
        swarm.certify(model, name=NAME)
        for i, span in enumerate(thirds(n_layer)[:args.spans]):
            local_s, _ = time_to_serve(swarm.addr, model, span, args.threads, os.path.join(tmp, f"local-{i}"))
            fetched_s, out = time_to_serve(swarm.addr, NAME, span, args.threads, os.path.join(tmp, f"fetched-{i}"))
            got = int(re.search(r"fetched (\d+) bytes of", out).group(1))
            doc[f"span {span}"] = {"fetched_bytes": got, "fetched_share": round(got / size, 4),
                                   "local_cut_s": round(local_s, 2), "fetched_s": round(fetched_s, 2),
                                   "fetched_vs_local": round(fetched_s / local_s, 3)}
        # the holders serve the client's generations, idle and while uploading, in turns
        client = Client([swarm.addr], model_path=model)
        downloads = Downloads(swarm.addr, client.trust)
        greedy = SamplingParams()
        runs: dict[str, list[float]] = {"idle": [], "uploading": []}
        try:
            client.generate(PROMPT, 4, greedy, stop_at_eog=False)  # warm-up
            downloads.start()  # the rate with nothing else to do: a whole file's worth
            deadline = time.monotonic() + 300
            while downloads.bytes < size and time.monotonic() < deadline:
                time.sleep(0.05)
            downloads.pause()
            doc["download_alone_mib_s"] = round(downloads.bytes / downloads.seconds / 2**20, 1)
            downloads.bytes, downloads.seconds = 0, 0.0
            for _ in range(args.reps):
                for mode in ("idle", "uploading"):
                    if mode == "uploading":
                        downloads.start()
                    r = client.generate(PROMPT, args.tokens, greedy, stop_at_eog=False)
                    downloads.pause()
                    runs[mode].append(r.decode_tokens_per_s)
        finally:
            downloads.close()
            client.close()
    doc["idle_decode_tok_s"] = round(statistics.median(runs["idle"]), 2)
    doc["uploading_decode_tok_s"] = round(statistics.median(runs["uploading"]), 2)
    doc["upload_ratio"] = round(doc["uploading_decode_tok_s"] / doc["idle_decode_tok_s"], 4)
    doc["uploading_mib_s"] = round(downloads.bytes / max(downloads.seconds, 1e-9) / 2**20, 1)
    print_report(doc, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
