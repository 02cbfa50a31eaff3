"""``meshnet-peer shard cut|info``: cut a layer range out of a GGUF model, or
print a model's or shard's identity, as JSON."""

from __future__ import annotations

import argparse
import json

from meshnet_p2p.engine.cut import cut_shard, inspect_gguf, parse_layer_range
from .flags import model_path
from .progress import TerminalProgress


def run(args: argparse.Namespace) -> int:
    if args.shard_command == "cut":
        start, end = parse_layer_range(args.layers)
        model = model_path(args.model)
        info = cut_shard(model, start, end, args.out, progress=TerminalProgress(f"layers {start}:{end}"))
    else:
        info = inspect_gguf(args.path)
    print(json.dumps(info_doc(info)))
    return 0


def info_doc(info) -> dict:
    return {
        "path": info.path,
        "architecture": info.architecture,
        "layers": [info.start, info.end],
        "source_layers": info.source_layers,
        "role": info.role,
        "source_sha256": info.source_sha256,
        "model_digest": info.model_digest,
        "weight_quantization": info.weight_quantization,
        "tokenizer_digest": info.tokenizer_digest,
        "data_sha256": info.data_sha256,
    }
