"""A volunteer with no model file joins by the model's name (issue 29, points 3 and 5): real
processes on loopback. Two peers hold the file; the bootstrap operator certifies
the swarm and names the model; volunteers with empty caches `join --model NAME`
(or its digest), each fetching only its span's parts, checked, from the peers
that have them; with the file's holders gone, a client with no file either
(by name: only the tokenizer's header fetched) gets the whole model's output."""

from __future__ import annotations

import json
import os
import re

from meshnet_p2p.engine.manifest import build_manifest

from tests.swarm import Proc, certify_swarm, meshnet_peer, start_swarm

PROMPT = "The capital of France is"
NAME = "smol-fetched"


def volunteer(tmp_path, addr: str, ref: str, layers: str) -> Proc:
    cache = tmp_path / f"cache-{layers.replace(':', '-')}"  # its own, empty: no model file, no shard
    env = {**os.environ, "MESHNET_CACHE_DIR": str(cache)}
    return Proc("join", "--bootstrap", addr, "--model", ref, "--layers", layers, "--threads", "1",
                "--listen", "127.0.0.1:0", env=env)


def fetched_bytes(p: Proc) -> tuple[int, int]:
    line = p.wait_line("fetched ", 120)
    got, whole = re.match(r"fetched (\d+) bytes of (\d+)", line).groups()
    return int(got), int(whole)


def test_volunteers_with_no_file_join_by_name_and_serve_exactly(tmp_path, model_path):
    boot, addr, holders = start_swarm(tmp_path / "holder", ["0:15", "15:30"], certify=False)
    joined: list[Proc] = []
    try:
        named = certify_swarm(addr, boot.identity_path, "--name", NAME)
        manifest = build_manifest(model_path)
        assert named["manifest_digest"] == manifest.digest()
        # by name, and by model digest
        joined = [volunteer(tmp_path, addr, NAME, "0:10"), volunteer(tmp_path, addr, manifest.model_digest, "10:20")]
        for p in joined:
            p.address()
        # the third can fetch from the holder or from the middle volunteer (which serves what it fetched)
        joined.append(volunteer(tmp_path, addr, NAME, "20:30"))
        joined[-1].address()
        for p, span in zip(joined, [(0, 10), (10, 20), (20, 30)], strict=True):
            got, whole = fetched_bytes(p)
            assert whole == manifest.file_size
            assert got < whole * ((span[1] - span[0]) / 30 + 0.3), f"layers {span}: {got} of {whole} bytes"
            print(f"layers {span[0]}-{span[1] - 1}: fetched {got} of {whole} bytes ({got / whole:.0%})")
        for h in holders:  # only the volunteers are left
            h.stop()
        # a client with no file either: by name, only the header (tokenizer) is fetched, from the volunteers
        client_cache = tmp_path / "client-cache"
        r = meshnet_peer("generate", "--bootstrap", addr, "--model", NAME, "--prompt", PROMPT, "--max-tokens", "16",
                         "--json", env={**os.environ, "MESHNET_CACHE_DIR": str(client_cache)})
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["model_digest"] == manifest.model_digest
        on_disk = sum(f.stat().st_blocks * 512 for f in client_cache.rglob("*") if f.is_file())
        print(f"the client's cache: {on_disk} bytes on disk (the header is {manifest.header_size})")
        assert on_disk < manifest.header_size + (1 << 20), "the client fetched more than the header"
        local = meshnet_peer("generate", "--local", "--prompt", PROMPT, "--max-tokens", "16", "--json")
        assert doc["token_ids"] == json.loads(local.stdout)["token_ids"]
        # the API by name too: the model it lists is the catalogue's name, and it answers as the model
        from openai import OpenAI

        api = Proc("api", "--bootstrap", addr, "--model", NAME, "--listen", "127.0.0.1:0",
                   env={**os.environ, "MESHNET_CACHE_DIR": str(tmp_path / "api-cache")})
        try:
            url = api.wait_line("listening on ", 120).removeprefix("listening on ")
            openai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            assert [m.id for m in openai.models.list().data] == [NAME]
            r = openai.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0)
            assert r.choices[0].text == doc["text"]
        finally:
            assert api.stop() == 0
        assert [h["peer_id"] for h in doc["route"]] == [p.peer_id for p in joined]
    finally:
        for p in [*joined, *holders, boot]:
            p.stop()


def test_a_name_nobody_certified_is_one_clear_error(tmp_path):
    boot, addr, [holder] = start_swarm(tmp_path, ["0:30"], certify=False)
    try:
        env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp_path / "empty")}
        r = meshnet_peer("join", "--bootstrap", addr, "--model", "no-such-model", "--listen", "127.0.0.1:0", env=env,
                         timeout=120)
        assert r.returncode != 0 and "no certifier this client trusts names a model 'no-such-model'" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        r = meshnet_peer("generate", "--bootstrap", addr, "--model", "no-such-model", "--prompt", "hi", env=env,
                         timeout=120)
        assert r.returncode != 0 and "no certifier this client trusts names a model 'no-such-model'" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    finally:
        holder.stop(), boot.stop()
