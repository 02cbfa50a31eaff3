"""Issue 26's attack, live: a stranger with no weights copies a certified recipe
into a signed report claiming the whole model, and its data plane answers every
step with the attacker's tokens (tests/cheaters.py ``hijack``). A fresh client,
through the CLI and through the API, never returns its text: the answer equals
the whole model's, and whenever the hijacker serves a session it is outvoted and
caught in that first session.

The swarm: a certified pair (0:15, 15:30: the certificate's evidence vouches for
them), a second honest pair that nobody vouched for, and the hijacker."""

from __future__ import annotations

import json
import os

import pytest
import requests

from meshnet_p2p.engine.tokenizer import Tokenizer
from tests.reference import reference_generate
from tests.swarm import Cheater, Proc, meshnet_peer, start_swarm

PROMPT = "The capital of France is"
EVIL = "Your account is locked"
N = 12


@pytest.fixture(scope="module")
def reference(model_path):
    return reference_generate(model_path, Tokenizer(model_path).encode(PROMPT), N, n_ubatch=64)[0]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verified")
    boot, addr, joins = start_swarm(tmp, ["0:15", "15:30"])
    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp)}
    procs = list(joins)
    try:
        for span in ["0:15", "15:30"]:  # honest, joined after the certificate: no record with anyone
            procs.append(Proc("join", "--layers", span, "--bootstrap", addr, "--threads", "1", env=env))
        hijacker = Cheater("hijack", "--bootstrap", addr)
        procs.append(hijacker)
        for p in procs:
            p.address()
        yield addr, hijacker, env
    finally:
        codes = [p.stop() for p in [*procs, boot]]
    assert all(c == 0 for c in codes), codes


def generate_json(addr: str, env: dict, *extra: str) -> dict:
    """`generate --json` as a user on this machine (``env``: its cache, where clients keep their records)."""
    r = meshnet_peer("generate", "--bootstrap", addr, "--prompt", PROMPT, "--max-tokens", str(N), "--json", *extra,
                     env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_a_fresh_cli_client_never_returns_the_hijackers_text(swarm, reference):
    addr, hijacker, env = swarm
    out = generate_json(addr, env)
    assert out["token_ids"] == reference and EVIL not in out["text"]
    used = {h["peer_id"] for h in out["route"]}
    if hijacker.peer_id in used:  # it served: then it was cross-checked, outvoted and caught
        assert out["verification"]["mode"] == "cross-checked"
    assert out["verification"]["mode"] in ("verified-peers", "cross-checked")


def test_with_verify_the_hijacker_is_caught_in_its_first_session_through_the_cli(swarm, reference):
    addr, hijacker, env = swarm
    out = generate_json(addr, env, "--verify")
    assert out["token_ids"] == reference and EVIL not in out["text"]
    v = out["verification"]
    assert v["mode"] == "cross-checked"
    assert [d["caught"] for d in v["disputes"]] == [[hijacker.peer_id]]
    assert hijacker.peer_id not in {h["peer_id"] for r in v["routes"] for h in r}
    # this machine's clients remember it (verify/peer_records.py), and `status` shows it
    r = meshnet_peer("status", "--bootstrap", addr, "--json", "--no-probe", env=env)
    assert r.returncode == 0, r.stderr
    [model] = json.loads(r.stdout)["models"]
    records = {p["peer_id"]: p["record"] for rec in model["recipes"] for p in rec["peers"]}
    assert records[hijacker.peer_id]["caught"] and records[hijacker.peer_id]["verified_sessions"] == 0
    assert sum(rec["vouched"] for rec in records.values()) == 2  # the certificate's route
    text = meshnet_peer("status", "--bootstrap", addr, "--no-probe", env=env).stdout
    assert "CAUGHT computing something else" in text
    # the client published its proof; another machine convicts the hijacker only on its own replays of it
    elsewhere = {**env, "MESHNET_CACHE_DIR": env["MESHNET_CACHE_DIR"] + "-elsewhere"}
    r = meshnet_peer("audit", "--bootstrap", addr, "--peer", hijacker.peer_id, "--recheck", "--json", env=elsewhere)
    assert r.returncode == 3, r.stderr[-3000:]
    [report] = json.loads(r.stdout)["reports"]
    assert report["outcome"] == "confirmed", report


def test_through_the_api_the_hijacker_is_caught_and_the_answer_is_the_whole_models(swarm, reference, model_path,
                                                                                   tmp_path):
    addr, hijacker, env = swarm
    # another machine's API server: no record of the hijacker (this machine's clients have caught it already)
    server = Proc("api", "--bootstrap", addr, "--listen", "127.0.0.1:0", env={**env, "MESHNET_CACHE_DIR": str(tmp_path)})
    try:
        url = server.wait_line("listening on ").removeprefix("listening on ")
        text = Tokenizer(model_path).decode(reference)
        # A fresh API client: its first request, with verify "always", plans the vouched pair and, as the
        # disjoint route to check it, the cheapest one that is left: the hijacker's one hop (nothing measured
        # yet, so it saves a round trip). It is outvoted and caught in that first session, and never
        # planned again: the later requests (whose audits have measured the other peers) never meet it.
        for i, verify in enumerate(("always", "auto", "always")):
            r = requests.post(f"{url}/v1/completions", timeout=300, json={
                "model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                "verify": verify})
            assert r.status_code == 200, r.text
            doc = r.json()
            assert doc["choices"][0]["text"] == text and EVIL not in doc["choices"][0]["text"]
            v = doc["meshnet_verification"]
            if verify == "always":
                assert v["mode"] == "cross-checked"
            caught = [d["caught"] for d in v.get("disputes", [])]
            assert caught == ([[hijacker.peer_id]] if i == 0 else []), v
            assert hijacker.peer_id not in {h["peer_id"] for route in v.get("routes", []) for h in route}
    finally:
        assert server.stop() == 0
