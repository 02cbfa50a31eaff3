"""Certification end to end, with real processes: a fresh swarm's recipe is
dark, `certify` takes it out of the dark for the nodes that trust the
certifier, and a peer on another recipe never joins a certified route."""

import json
import urllib.error
import urllib.request

import pytest
import trio

from meshnet_p2p.trust.policy import TrustPolicy
from meshnet_p2p.client import connect
from meshnet_p2p.route.hop import route_fingerprint
from meshnet_p2p.dataplane.stub import ShardError
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.cut import inspect_gguf
from meshnet_p2p.engine.manifest import build_manifest
from meshnet_p2p.engine.tokenizer import Tokenizer
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.swarm.view import survey

from tests.reference import reference_generate
from tests.swarm import Proc, certify_swarm, meshnet_peer, start_swarm

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def reference(model_path):
    return reference_generate(model_path, Tokenizer(model_path).encode(PROMPT), 16, n_ubatch=64)[0]


def generate(addr, *extra):
    return meshnet_peer("generate", "--bootstrap", addr, "--prompt", PROMPT, "--max-tokens", "16", "--json", *extra)


def status(addr, *extra) -> dict:
    r = meshnet_peer("status", "--bootstrap", addr, "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_fresh_swarm_is_dark_until_a_trusted_certifier_certifies_it(tmp_path, reference, model_path):
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "10:20", "20:30"], certify=False)
    api = Proc("api", "--bootstrap", addr, "--listen", "127.0.0.1:0")
    try:
        # dark: every user path refuses, with the reason and the command that certifies
        r = generate(addr)
        assert r.returncode == 2 and "is dark" in r.stderr and "meshnet-peer certify" in r.stderr, r.stderr
        url = api.wait_line("listening on ").removeprefix("listening on ")
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 4}).encode()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", body,
                                                          {"Content-Type": "application/json"}), timeout=120)
        assert e.value.code == 503 and "is dark" in json.loads(e.value.read())["error"]["message"]
        [model] = status(addr)["models"]
        [recipe] = model["recipes"]
        assert recipe["state"] == "dark" and recipe["coverage"] == {"covered": [[0, 30]], "holes": []}
        assert sorted(p["peer_id"] for p in recipe["peers"]) == sorted(j.peer_id for j in joins)
        assert all(p["reachability"] == "direct" and p["rtt_ms"] is not None for p in recipe["peers"])

        # an outsider certifies it: nodes that do not trust the outsider still see it dark
        outsider = tmp_path / "outsider.key"
        summary = certify_swarm(addr, str(outsider))
        assert summary["method"] == "whole-model" and summary["token_ids"] == reference
        assert len({h["peer_id"] for h in summary["routes"][0]}) == 3
        # stored on the bootstrap (a home) and the nodes closest along every path: one host, one network,
        # all this certifier can see, so no warning
        assert summary["stored_on"] >= 1 and summary["stored_networks"] == 1 and "warning" not in summary
        r = generate(addr)
        assert r.returncode == 2 and "is dark" in r.stderr, r.stderr
        assert status(addr)["names"] == []  # nor does its catalogue of names count for them
        trusted = generate(addr, "--trust", summary["certifier"])
        assert trusted.returncode == 0, trusted.stderr
        assert json.loads(trusted.stdout)["token_ids"] == reference

        # the bootstrap operator certifies with the bootstrap's own key: trusted by default
        named = certify_swarm(addr, boot.identity_path)
        # and lists the model in its catalogue under its file's name, bound to the file's manifest
        manifest = build_manifest(model_path)
        assert (named["name"], named["manifest_digest"]) == ("SmolLM2-135M-Instruct", manifest.digest())
        [listed] = status(addr)["names"]
        assert listed == {"name": "SmolLM2-135M-Instruct", "files": 1, "models": [{
            "name": "SmolLM2-135M-Instruct", "model_digest": manifest.model_digest,
            "manifest_digest": manifest.digest(), "file_size": manifest.file_size, "certified_by": [boot.peer_id]}]}
        r = generate(addr)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["token_ids"] == reference
        [recipe] = status(addr)["models"][0]["recipes"]
        assert recipe["state"] == "certified" and recipe["certified_by"] == boot.peer_id
        text = meshnet_peer("status", "--bootstrap", addr, "--no-probe")
        assert text.returncode == 0 and f"certified by {boot.peer_id}" in text.stdout
        assert f"name SmolLM2-135M-Instruct -> model {manifest.model_digest[:16]}" in text.stdout
    finally:
        for p in [api] + joins + [boot]:
            p.stop()


def test_a_peer_with_another_micro_batch_size_forms_its_own_dark_recipe(tmp_path, model_path):
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "10:20", "20:30"])
    odd = Proc("join", "--layers", "10:20", "--bootstrap", addr, "--threads", "1", "--n-ubatch", "32")
    try:
        odd.wait_line("listening on ")
        [model] = status(addr, "--no-probe")["models"]
        certified, dark = model["recipes"]
        assert certified["state"] == "certified" and dark["state"] == "dark"
        assert [p["peer_id"] for p in dark["peers"]] == [odd.peer_id]
        assert [k for k in certified["axes"] if certified["axes"][k] != dark["axes"][k]] == ["n_ubatch"]

        # at session open it refuses the certified recipe, naming the axis
        info = inspect_gguf(model_path)

        async def views():
            return await survey([addr], info.model_digest, info.source_layers, TrustPolicy.default([addr]))

        view = trio.run(views)
        good = view.recipe(certified["recipe_digest"]).spans[0].record.content
        client = connect(view.recipe(dark["recipe_digest"]).spans[0], 10)
        try:
            with pytest.raises(ShardError) as e:
                client.open_session(route_fingerprint(good), max_tokens=8, sampling=SamplingParams())
            assert e.value.code_name == "FINGERPRINT_MISMATCH"
            assert [m.split()[0] for m in e.value.mismatches] == ["n_ubatch"]
        finally:
            client.close()

        # it never joins a user route of the certified recipe, even when it is the only 10:20 left
        r = generate(addr)
        assert r.returncode == 0 and odd.peer_id not in r.stdout
        joins[1].stop()
        r = generate(addr)
        assert r.returncode == 2 and "layers 10-19" in r.stderr and "n_ubatch is 32 there, 64 here" in r.stderr, r.stderr
    finally:
        for p in [odd] + joins + [boot]:
            p.stop()


def test_a_certifier_without_the_whole_model_compares_two_disjoint_routes(tmp_path, reference):
    boot, addr, joins = start_swarm(tmp_path, ["0:15", "15:30", "0:15", "15:30"], certify=False)
    try:
        summary = certify_swarm(addr, boot.identity_path, "--method", "two-routes")
        assert summary["method"] == "two-routes" and summary["token_ids"] == reference
        first, second = ({h["peer_id"] for h in route} for route in summary["routes"])
        assert len(first) == len(second) == 2 and not first & second
        r = generate(addr)
        assert r.returncode == 0 and json.loads(r.stdout)["token_ids"] == reference
    finally:
        for p in joins + [boot]:
            p.stop()


def test_certify_refuses_a_swarm_with_a_hole(tmp_path):
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "20:30"], certify=False)
    try:
        r = meshnet_peer("certify", "--bootstrap", addr, "--identity", boot.identity_path)
        assert r.returncode == 2 and "layers 10-19" in r.stderr and "Traceback" not in r.stderr
        assert Identity.load(boot.identity_path)  # the key file is the bootstrap's, untouched
    finally:
        for p in joins + [boot]:
            p.stop()


@pytest.mark.parametrize("command,needle", [
    (["generate", "--prompt", "hi", "--trust", "not-a-peer"], "not a peer ID"),
    (["status", "--trust-file", "/nonexistent/trusted.txt"], "cannot read trust file"),
    (["status", "--model", "/nonexistent.gguf"], "no model file"),
    (["certify", "--method", "by-vote"], "invalid choice"),
    (["certify", "--max-tokens", "0"], "at least 1"),
    (["certify", "--name", "my model"], "--name 'my model'"),
])
def test_bad_certification_flags_are_one_clear_error(command, needle):
    nobody = f"/ip4/127.0.0.1/udp/9/p2p/{Identity.generate().peer_id}"
    r = meshnet_peer(*command, "--bootstrap", nobody, timeout=120)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
