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


def test_a_withheld_answer_waits_for_its_audits_before_exiting_2(monkeypatch, capsys):
    """Issue 59: routes that disagree with no verified third route withhold the answer; the
    audits of both are what prove the liar and publish it, so `generate` waits for them (as
    after an answer) before it exits, instead of dropping them with the process. (The Client
    is a unit-test double here; the live dispute is tests/test_trust_attacks.py's.)"""
    from types import SimpleNamespace

    import meshnet_p2p.client as client_pkg
    from meshnet_p2p.roles.cli import main
    from meshnet_p2p.verify.crosscheck import OutputWithheld
    from meshnet_p2p.verify.replay import Verdict

    seen = []

    class Withholding:
        def __init__(self, *a, **kw):
            self.auditor = SimpleNamespace(results=[])

        def generate(self, *a, **kw):
            raise OutputWithheld("at position 7 the routes disagree; the answer is withheld")

        def wait_audits(self, timeout):
            seen.append("waited")
            self.auditor.results = [SimpleNamespace(peer_id="12D3KooWLiar", start=0, end=30, verdict=Verdict.MISMATCH)]
            return True

        def close(self):
            seen.append("closed")

    monkeypatch.setattr(client_pkg, "Client", Withholding)
    code = main(["generate", "--bootstrap", "/ip4/127.0.0.1/udp/9/p2p/12D3KooWDvvhbSkXBPTEFmWjAPHrSC4hEungQGj4gxcULMMDo9sE",
                 "--prompt", "hi", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and seen == ["waited", "closed"], (code, seen, err)
    assert "audit of 12D3KooWLiar on layers 0-29: mismatch" in err and "error: " in err and "withheld" in err
