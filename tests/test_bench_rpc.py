"""bench/_rpc.py's pure parts (bench/wan.py --rpc, the llama.cpp RPC anchor): the
cache stamp that decides whether to build again, the tensor split that puts
llama.cpp's layers where ours are, and what it reads from llama-bench."""

import importlib.util
import json
import os

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_rpc", os.path.join(os.path.dirname(__file__), os.pardir, "bench", "_rpc.py"))
rpc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rpc)

SPANS = ("0:10", "10:20", "20:30")


def _build(folder, stamp=None, binaries=(rpc.SERVER, rpc.BENCH)):
    os.makedirs(folder / "bin", exist_ok=True)
    for name in binaries:
        (folder / "bin" / name).write_text("#!/bin/sh\n")
        (folder / "bin" / name).chmod(0o755)
    if stamp is not None:
        rpc.write_stamp(str(folder), stamp)


def test_a_finished_build_of_the_same_version_and_flags_is_reused(tmp_path):
    expected = rpc.expected_stamp("0.3.36")
    _build(tmp_path, {**expected, "built": "2026-12-02 19:40:00", "build_seconds": 300})
    paths = rpc.cached(str(tmp_path), expected)
    assert paths == {n: str(tmp_path / "bin" / n) for n in (rpc.SERVER, rpc.BENCH)}
    assert sorted(os.listdir(tmp_path)) == ["bin", rpc.STAMP]  # written whole: no partial stamp left


@pytest.mark.parametrize("case", ["no stamp", "other version", "other flags", "binary gone", "not executable",
                                  "unreadable stamp", "not a dict"])
def test_anything_else_means_build_again(tmp_path, case):
    expected = rpc.expected_stamp("0.3.36")
    stamp = {"no stamp": None, "other version": {**expected, "version": "0.3.35"},
             "other flags": {**expected, "cmake_flags": expected["cmake_flags"][:-1]}}.get(case, expected)
    _build(tmp_path, stamp, binaries=(rpc.SERVER,) if case == "binary gone" else (rpc.SERVER, rpc.BENCH))
    if case == "not executable":
        (tmp_path / "bin" / rpc.BENCH).chmod(0o644)
    if case == "unreadable stamp":
        (tmp_path / rpc.STAMP).write_text('{"version": "0.3.36", "cmake_fl')
    if case == "not a dict":
        (tmp_path / rpc.STAMP).write_text(json.dumps([expected]))
    assert rpc.cached(str(tmp_path), expected) is None


def _llama_cpp_split(ts: str, n_layer: int) -> list[int]:
    """The device of each layer (and of the output, layer n_layer) as llama.cpp's load_tensors
    computes it with -ngl 99: float cumulative shares, upper_bound of il / (n_layer + 1)."""
    shares = np.array([float(x) for x in ts.split("/")], dtype=np.float32)
    splits = np.cumsum(shares, dtype=np.float32)
    splits = splits / np.float32(splits[-1])
    act = n_layer + 1
    return [int(np.searchsorted(splits, np.float32(il) / np.float32(act), side="right")) for il in range(act)]


@pytest.mark.parametrize("spans", [SPANS, ("0:15", "15:30"), ("0:5", "5:17", "17:30"), ("0:1", "1:2", "2:30")])
def test_the_tensor_split_puts_the_layers_exactly_on_our_spans(spans):
    n_layer = int(spans[-1].split(":")[1])
    devices = _llama_cpp_split(rpc.tensor_split(spans), n_layer)
    expected = [i for i, s in enumerate(spans) for _ in range(*map(int, s.split(":")))] + [len(spans) - 1]
    assert devices == expected
    assert rpc.tensor_split(SPANS) == "10/10/11"


# the lines of llama-bench -v's log that say where the model went (this llama.cpp's, abridged)
LOG = "\n".join(
    [f"llama_prepare_model_devices: using device RPC{d} (127.0.0.1:{4000 + d}) (unknown id) - 24105 MiB free"
     for d in range(3)]
    + ["load_tensors: loading model tensors, this can take a while... (load_mode = mmap)"]
    + [f"load_tensors: layer {il:3d} assigned to device RPC{dev}, is_swa = 0"
       for il, dev in enumerate([0] * 10 + [1] * 10 + [2] * 11)]
    + ["create_tensor: loading tensor blk.9.attn_norm.weight",
       "load_tensors: offloaded 31/31 layers to GPU",
       "load_tensors:   CPU_Mapped model buffer size =    28.69 MiB"]
    + [f"load_tensors: RPC0[127.0.0.1:{4000 + d}] model buffer size =    {mib} MiB"
       for d, mib in enumerate(("21.14", "21.14", "49.83"))]
    + ["llama_kv_cache: RPC0[127.0.0.1:4000] KV buffer size =     1.88 MiB"])


def test_the_split_is_read_from_llama_bench_s_log():
    split = rpc.parse_split(LOG + "\n" + LOG)  # a model loaded twice: the same split, once
    assert list(split) == [f"127.0.0.1:{4000 + d}" for d in range(3)]
    assert [d["mib"] for d in split.values()] == [21.14, 21.14, 49.83]
    assert rpc.spans_of(split, 30) == ["0:10", "10:20", "20:30+output"]
    with pytest.raises(rpc.RpcError):
        rpc.spans_of({"a": {"layers": [0, 1, 3]}, "b": {"layers": [2]}}, 4)


def test_decode_tokens_per_s_is_the_median_of_the_generation_test():
    tests = [{"n_prompt": 0, "n_gen": 0, "n_depth": 40, "samples_ts": [1.0]},
             {"n_prompt": 0, "n_gen": 48, "n_depth": 40, "samples_ts": [20.5, 9.0, 21.0]}]
    assert rpc.parse_bench(json.dumps(tests), 48) == {"tok_s": 20.5, "samples_tok_s": [20.5, 9.0, 21.0],
                                                      "n_depth": 40}
    with pytest.raises(rpc.RpcError):
        rpc.parse_bench(json.dumps(tests), 32)
    with pytest.raises(rpc.RpcError):
        rpc.parse_bench("error: failed to load model\n", 48)
