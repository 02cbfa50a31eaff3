"""Many users at once on a real 3-process swarm (issue 13): every generation
is exact, a full peer makes clients wait instead of failing, and a request
no route can hold is the request's error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from meshnet_p2p.client import Client, GenerationError, RequestRefused, RouteOptions, open_route
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.tokenizer import Tokenizer

from tests.conftest import N_UBATCH
from tests.reference import reference_generate
from tests.swarm import start_swarm

TOKENS = 12
PROMPTS = [f"{subject} is" for subject in (
    "The capital of France", "Water", "The largest planet", "A good breakfast", "Python", "The moon",
    "Music", "The ocean", "A library", "Winter", "The oldest tree", "Mathematics", "A bicycle",
    "Coffee", "The internet", "A volcano")]


@pytest.fixture(scope="module")
def references(model_path):
    tok = Tokenizer(model_path)
    return {p: reference_generate(model_path, tok.encode(p), TOKENS, n_ubatch=N_UBATCH)[0] for p in PROMPTS}


def test_sixteen_concurrent_generations_equal_their_single_session_outputs(tmp_path, model_path, references):
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "10:20", "20:30"])
    try:
        client = Client([addr], model_path=model_path, step_timeout=60.0)
        start = threading.Barrier(len(PROMPTS))

        def generate(prompt: str) -> list[int]:
            start.wait(timeout=60)
            return client.generate(prompt, TOKENS, SamplingParams(), stop_at_eog=False).token_ids

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outputs = dict(zip(PROMPTS, pool.map(generate, PROMPTS), strict=True))
        assert outputs == references
    finally:
        codes = [j.stop() for j in joins] + [boot.stop()]
    assert codes == [0] * 4


def test_a_full_peer_makes_clients_wait_and_a_request_too_long_is_refused(tmp_path, model_path, references):
    boot, addr, joins = start_swarm(tmp_path, ["0:15", "15:30"], "--max-sessions", "1")
    try:
        client = Client([addr], model_path=model_path, step_timeout=60.0)
        spans = client.spans
        import trio

        # One user holds the only session of every peer...
        holder = open_route(lambda: trio.run(spans), client.n_layer, RouteOptions(max_tokens=64))
        # ...so a second one is told each peer is full, and waits: no ban, no failure.
        events: list[str] = []
        busy = threading.Event()

        def on_event(msg: str) -> None:
            events.append(msg)
            if "busy" in msg:
                busy.set()

        waiting = Client([addr], model_path=model_path, step_timeout=60.0, on_event=on_event)
        prompt = PROMPTS[0]
        with ThreadPoolExecutor(1) as pool:
            later = pool.submit(waiting.generate, prompt, TOKENS, SamplingParams(), stop_at_eog=False)
            try:
                assert busy.wait(timeout=60), events
            finally:
                holder.close()  # the first user leaves: the waiting one gets its turn
            assert later.result(timeout=120).token_ids == references[prompt]
        assert not [e for e in events if "failed" in e], events

        # A user who cannot wait long is told why when its own deadline passes.
        holder = open_route(lambda: trio.run(spans), client.n_layer, RouteOptions(max_tokens=64))
        try:
            with pytest.raises(GenerationError, match="busy"):
                open_route(lambda: trio.run(spans), client.n_layer, RouteOptions(max_tokens=64, open_timeout=1.0))
            # A prompt longer than any route holds is the request's error, naming both numbers, at
            # once even while every peer is busy: no waiting for a turn that could never serve it.
            with pytest.raises(RequestRefused) as e:
                open_route(lambda: trio.run(spans), client.n_layer,
                           RouteOptions(max_tokens=40_000, open_timeout=600.0))
            assert "holds at most 2048" in str(e.value), str(e.value)
        finally:
            holder.close()
        with pytest.raises(RequestRefused) as e:
            client.generate("hello " * 33_000, 8)
        text = str(e.value)
        assert "the prompt has" in text and "holds at most" in text, text
        assert client.generate(prompt, TOKENS, SamplingParams(), stop_at_eog=False).token_ids == references[prompt]
    finally:
        codes = [j.stop() for j in joins] + [boot.stop()]
    assert codes == [0] * 3


def test_generations_that_start_together_share_one_survey(model_path, monkeypatch):
    """Sixteen users starting at once made sixteen surveys of the DHT from one
    address, and under that burst one came back empty (`no peer announces this
    model`). A recent survey, or one under way, is shared; a failover surveys afresh."""
    import functools

    import trio

    from meshnet_p2p.client import api as client_mod
    from meshnet_p2p.swarm.placement import NoRoute

    calls = []
    outcomes = [NoRoute([(0, 30)], "no peer announces this model")]  # the first survey fails: never cached

    async def fake_survey(*args, then=None):
        calls.append(threading.get_ident())
        await trio.sleep(0)
        if outcomes:
            raise outcomes.pop()
        # a view with no certificate (routable_spans is faked) and no certifier's verdicts
        return SimpleNamespace(certified=lambda: [], verified_by_certifiers=set, convicted=dict)

    monkeypatch.setattr(client_mod, "survey", fake_survey)
    monkeypatch.setattr(client_mod, "routable_spans", lambda view, trust: ["span"])
    client = Client(["/ip4/127.0.0.1/udp/9/p2p/12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"], model_path=model_path)
    with pytest.raises(NoRoute):
        trio.run(functools.partial(client.spans, max_age_s=5.0))
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: trio.run(functools.partial(client.spans, max_age_s=5.0)), range(16)))
    assert results == [["span"]] * 16
    assert len(calls) == 2  # the failed one, then one for all sixteen
    provide = client._provider(trio.run)
    assert provide() == ["span"] and len(calls) == 2  # a route's first look: the shared survey
    assert provide() == ["span"] and len(calls) == 3  # looking again (a failover): afresh


def test_a_busy_peers_hint_cannot_stall_a_client():
    """retry_after_ms costs a peer nothing to inflate: the client waits at most
    its own ceiling (4 s, +25% jitter), and backs off when the hint is small."""
    from meshnet_p2p.route.search import BACKOFF_MAX_S, backoff

    assert max(backoff(0, 10**6) for _ in range(100)) <= BACKOFF_MAX_S * 1.25
    assert max(backoff(0, 0.0) for _ in range(100)) <= 0.25 * 1.25
    assert min(backoff(10, 0.0) for _ in range(100)) >= BACKOFF_MAX_S * 0.75


def test_sixteen_cli_clients_from_one_host_all_generate_exactly(tmp_path, model_path, references):
    """Sixteen `meshnet-peer generate` processes started at once from one host (a lab,
    an office, a NAT): each surveys the DHT with its own short-lived node, all from one
    address. Limits that stop an attacker must not turn them away, and a survey that
    comes back empty while the swarm is alive is asked again, never a `no route`."""
    boot, addr, joins = start_swarm(tmp_path, ["0:10", "10:20", "20:30"])
    procs = []
    try:
        for p in PROMPTS:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "meshnet_p2p", "generate", "--bootstrap", addr, "--prompt", p,
                 "--max-tokens", str(TOKENS), "--json"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "MESHNET_CACHE_DIR": str(tmp_path)}))
        results = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        codes = [j.stop() for j in joins] + [boot.stop()]
    failed = [(p, proc.returncode, err[-500:]) for p, proc, (_, err) in zip(PROMPTS, procs, results)
              if proc.returncode != 0]
    assert failed == []
    tok = Tokenizer(model_path)
    for p, (out, _) in zip(PROMPTS, results):
        got = json.loads(out)["token_ids"]  # the reference runs past an end of generation; the CLI stops before it
        assert got == references[p][:len(got)] and (len(got) == TOKENS or tok.is_eog(references[p][len(got)])), p
    assert codes == [0] * 4
