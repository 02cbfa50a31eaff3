"""``meshnet-peer demo``: a whole swarm on this machine, in one command.

Starts a bootstrap peer and three volunteers (``meshnet-peer join``, each its
own OS process, on loopback) serving a third of the model's layers each,
certifies their recipe with the bootstrap peer's key (a fresh swarm's recipe
is dark), generates from a prompt through them, prints the text and the route, and
shuts everything down (SIGTERM, then waits for each process).
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Callable, TextIO

from meshnet_p2p.client import Client
from .peer_process import Swarm

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."


def thirds(n_layer: int) -> tuple[str, str, str]:
    """Three contiguous spans covering ``n_layer`` layers, as even as can be."""
    if n_layer < 3:
        raise ValueError(f"a model of {n_layer} layers cannot be split across three volunteers")
    cuts = [round(n_layer * i / 3) for i in range(4)]
    return tuple(f"{a}:{b}" for a, b in itertools.pairwise(cuts))  # type: ignore[return-value]


def run(args) -> int:
    """The ``demo`` command: the story on stdout, or with --json only the result."""
    import io
    import json

    from .flags import model_path

    model = model_path(args.model) if args.model else None
    out = io.StringIO() if args.json else sys.stdout
    result = run_demo(args.prompt or DEFAULT_PROMPT, args.max_tokens, chat=not args.no_chat, model=model, out=out)
    if args.json:
        print(json.dumps(result))
    return 0


def run_demo(prompt: str = DEFAULT_PROMPT, max_tokens: int = 64, *, chat: bool = True, model: str | None = None,
             out: TextIO = sys.stdout, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    from meshnet_p2p.engine.cut import inspect_gguf
    from meshnet_p2p.engine.models import default_model_path
    from meshnet_p2p.engine.tokenizer import Tokenizer

    spans = thirds(inspect_gguf(model or default_model_path()).source_layers)
    if chat and not Tokenizer(model or default_model_path()).has_chat_template:
        # checked before any process starts: a base model completes text instead of answering
        log("the model has no chat template (a base model): sending the prompt as is")
        chat = False
    log("starting a bootstrap peer and three volunteers ...")
    swarm = Swarm(spans, "--threads", "1", *(["--model", model] if model else []))
    try:
        for span, p in zip(spans, swarm.joins, strict=True):
            log(f"volunteer serving layers {span} at {p.address()}")
        # A fresh swarm's recipe is dark: the bootstrap operator certifies it with the
        # bootstrap's own key, which clients trust by default.
        log("certifying the swarm's recipe with the bootstrap peer's key ...")
        swarm.certify(model, log)
        client = Client([swarm.addr], model_path=model)
        t0 = time.perf_counter()
        result = client.generate(prompt, max_tokens, chat=chat, on_token=lambda t: (out.write(t), out.flush()))
        out.write("\n")
        route = " -> ".join(f"layers {h['layers'][0]}-{h['layers'][1] - 1} on {h['peer_id']}" for h in result.route)
        log(f"route: {route}")
        log(f"{len(result.token_ids)} tokens in {time.perf_counter() - t0:.2f} s "
            f"(first after {result.ttft_ms:.0f} ms, {result.decode_tokens_per_s:.1f} tok/s)")
        return {"text": result.text, "token_ids": result.token_ids, "route": result.route}
    finally:
        log("shutting the swarm down ...")
        swarm.stop()
