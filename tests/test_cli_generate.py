"""`meshnet-peer generate --local`, as a user runs it."""

import json
import os

import pytest

from meshnet_p2p.engine.tokenizer import Tokenizer

from tests.reference import reference_generate
from tests.swarm import meshnet_peer


def test_generate_local_json_matches_the_whole_model(model_path, tmp_path, monkeypatch):
    prompt = "The capital of France is"
    r = meshnet_peer("generate", "--local", "--split", "10,20", "--prompt", prompt, "--max-tokens", "12",
                     "--temperature", "0", "--json", env={**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    tok = Tokenizer(model_path)
    ids = tok.encode(prompt)
    expected, _ = reference_generate(model_path, ids, 12, n_ubatch=64)
    assert len(doc["token_ids"]) == 12 or doc["stopped"] == "eog"
    assert doc["token_ids"] == expected[: len(doc["token_ids"])]
    assert doc["text"] == tok.decode(doc["token_ids"])
    assert [h["layers"] for h in doc["route"]] == [[0, 10], [10, 20], [20, 30]]
    assert doc["timing"]["ttft_ms"] > 0 and doc["prompt_tokens"] == len(ids)


def test_generate_streams_text_and_supports_chat(tmp_path):
    r = meshnet_peer("generate", "--local", "--split", "15", "--chat", "--prompt", "Say hello.", "--max-tokens", "8",
                     env={**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "route 0:15 -> 15:30" in r.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--split", "20,10"], "strictly increasing"),
        (["--split", "0,40"], "strictly increasing"),
        (["--split", "x"], "not a layer number"),
        (["--max-tokens", "0"], "at least 1"),
        (["--temperature", "-1"], ">= 0"),
        (["--top-p", "2"], "top_p"),
        (["--model", "/nonexistent.gguf"], "no model file"),
    ],
)
def test_generate_bad_flags_are_clear_errors(args, needle):
    r = meshnet_peer("generate", "--local", "--prompt", "hi", *args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["serve", "join"])
@pytest.mark.parametrize("value,needle", [("0", "must be at least 1"), ("abc", "not a whole number")])
def test_a_bad_kv_memory_is_one_clear_error(command, value, needle):
    r = meshnet_peer(command, "--layers", "0:10", "--kv-memory", value)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
