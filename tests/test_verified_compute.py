"""Issue 26's attack, live: a stranger with no weights copies a certified recipe
into a signed report claiming the whole model, and its data plane answers every
step with the attacker's tokens (tests/cheaters.py ``hijack``). A fresh client,
through the CLI and through the API, never returns its text: the answer equals
the whole model's, and the hijacker decides nothing.

The swarm, each peer at an address of its own: a certified pair (0:15, 15:30:
the certificate's evidence vouches for them), a second honest pair the
certifier's review vouched for, and the hijacker. (The catch of a liar that
does serve, its proof published and re-checked on another machine, is
tests/test_trust_attacks.py's and tests/test_audit_live.py's.)"""

from __future__ import annotations

import json
import os

import pytest
import requests

from meshnet_p2p.engine.tokenizer import Tokenizer
from tests.reference import reference_generate
from tests.swarm import Cheater, Proc, meshnet_peer, own_address, start_swarm

PROMPT = "The capital of France is"
EVIL = "Your account is locked"
N = 12


@pytest.fixture(scope="module")
def reference(model_path):
    return reference_generate(model_path, Tokenizer(model_path).encode(PROMPT), N, n_ubatch=64)[0]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verified")
    boot, addr, joins = start_swarm(tmp, ["0:15", "15:30"], spread=True)  # each peer a network of its own
    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp)}
    procs = list(joins)
    try:
        for span in ["0:15", "15:30"]:  # honest, joined after the certificate: no record with anyone
            procs.append(Proc("join", "--layers", span, "--bootstrap", addr, "--threads", "1",
                              "--listen", f"{own_address()}:0", env=env))
        for p in procs:
            p.address()
        # the certifier reviews them (each span has a replayer on another network): a dispute is settled
        # only by a third route of verified peers (issue 59), and these are the swarm's other route
        r = meshnet_peer("review", "--bootstrap", addr, "--identity", boot.identity_path, "--json", env=env,
                         timeout=300)
        assert r.returncode == 0 and len(json.loads(r.stdout)["verified"]) == 4, (r.stdout, r.stderr[-2000:])
        hijacker = Cheater("hijack", "--bootstrap", addr, "--host", own_address())
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


def test_with_verify_two_routes_on_other_networks_answer_and_the_hijacker_decides_nothing(swarm, reference):
    """--verify: two routes with no peer and no network in common, stepped side by side. The
    swarm has two routes of peers verified for this client (the certificate's, the review's),
    so the hijacker, with no record, is not even the second: it decides nothing (issue 59;
    a dispute is settled only by a third route of verified peers, tests/test_crosscheck.py)."""
    addr, hijacker, env = swarm
    out = generate_json(addr, env, "--verify")
    assert out["token_ids"] == reference and EVIL not in out["text"]
    v = out["verification"]
    assert v["mode"] == "cross-checked" and v["disputes"] == [] and len(v["routes"]) == 2
    first, second = ({h["peer_id"] for h in r} for r in v["routes"])
    assert not first & second and hijacker.peer_id not in first | second
    r = meshnet_peer("status", "--bootstrap", addr, "--json", "--no-probe", env=env)
    assert r.returncode == 0, r.stderr
    [model] = json.loads(r.stdout)["models"]
    records = {p["peer_id"]: p["record"] for rec in model["recipes"] for p in rec["peers"]}
    assert sum(rec["vouched"] for rec in records.values()) == 4  # the certificate's route and the review's
    assert not records[hijacker.peer_id]["vouched"] and not records[hijacker.peer_id]["caught"]


def test_through_the_api_the_hijacker_decides_nothing_and_the_answer_is_the_whole_models(swarm, reference, model_path,
                                                                                   tmp_path):
    addr, hijacker, env = swarm
    # another machine's API server: no record of the hijacker (this machine's clients have caught it already)
    server = Proc("api", "--bootstrap", addr, "--listen", "127.0.0.1:0", env={**env, "MESHNET_CACHE_DIR": str(tmp_path)})
    try:
        url = server.wait_line("listening on ").removeprefix("listening on ")
        text = Tokenizer(model_path).decode(reference)
        # A fresh API client: whatever it is asked to verify, the hijacker (no record) never decides an
        # answer: "always" checks two routes of verified peers on other networks against each other
        for verify in ("always", "auto", "always"):
            r = requests.post(f"{url}/v1/completions", timeout=300, json={
                "model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                "verify": verify})
            assert r.status_code == 200, r.text
            doc = r.json()
            assert doc["choices"][0]["text"] == text and EVIL not in doc["choices"][0]["text"]
            v = doc["meshnet_verification"]
            if verify == "always":
                assert v["mode"] == "cross-checked" and v["disputes"] == []
            assert hijacker.peer_id not in {h["peer_id"] for route in v.get("routes", []) for h in route}
    finally:
        assert server.stop() == 0
