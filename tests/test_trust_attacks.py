"""Issue 59's attacks, as a patient attacker with one machine runs them against a
real loopback swarm of processes, every peer at an address of its own (several
loopback addresses, tests/swarm.py's own_address: each counts as its own network,
netgroup.network_of):

- the **sleeper**: a real whole-model peer, honest until a certifier's review
  vouches for it, then answering every session with the attacker's text;
- the **trigger**: the same, lying only when the prompt holds " bank" (which the
  review's prompts need not).

The honest swarm: two disjoint chains over the model (0:10, 10:20, 20:30 and
0:15, 15:30), so that a whole-model hop has two independent replays and a
dispute has a third route. Each user is a fresh client (no records, a fresh
identity), as twenty strangers would be. The acceptance (issue 59): at most one
wrong answer delivered (returned, not withheld) over 20 fresh clients after the
flip, none after a fraud report exists.
"""

from __future__ import annotations

import json
import os

import pytest
import trio

from meshnet_p2p import Client
from meshnet_p2p.route.errors import GenerationError
from meshnet_p2p.engine.contract import SamplingParams
from meshnet_p2p.engine.tokenizer import Tokenizer

from tests.reference import reference_generate
from tests.swarm import Cheater, Proc, meshnet_peer, own_address

FRESH_CLIENTS = 20
TOKENS = 8
PLAIN = ["The capital of France is", "Water boils at a temperature of", "My favourite colour is",
         "The tallest mountain in the world is", "A good breakfast includes"]
TRIGGERED = ["I went to the bank to", "The river bank was covered in", "She works at the bank as a",
             "He robbed the bank and", "They sat on the bank of the"]
N_UBATCH = 64  # the recipe's (tests/conftest.py)


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    """A bootstrap peer (the certifier) and two disjoint honest chains, certified."""
    tmp = tmp_path_factory.mktemp("attacks")
    env = {**os.environ, "MESHNET_CACHE_DIR": str(tmp)}
    key = str(tmp / "bootstrap.key")
    boot = Proc("bootstrap", "--listen", "127.0.0.1:0", "--identity", key, env=env)
    procs = [boot]
    try:
        addr = boot.address(120)
        for i, span in enumerate(["0:10", "10:20", "20:30", "0:15", "15:30"]):
            procs.append(Proc("join", "--layers", span, "--bootstrap", addr, "--listen", f"{own_address()}:0",
                              "--threads", "1", env=env))
        for p in procs[1:]:
            p.address(120)
        r = meshnet_peer("certify", "--bootstrap", addr, "--identity", key, "--json", env=env)
        assert r.returncode == 0, r.stderr
        yield addr, key, env, procs
    finally:
        codes = [p.stop() for p in reversed(procs)]
        assert codes == [0] * len(codes)


@pytest.fixture(scope="module")
def answers(model_path):
    """What the whole model says to each prompt (greedy): every honest route's answer."""
    tok = Tokenizer(model_path)
    return {p: tok.decode(reference_generate(model_path, tok.encode(p), TOKENS, n_ubatch=N_UBATCH)[0])
            for p in PLAIN + TRIGGERED}


def review(addr: str, key: str, env: dict) -> None:
    """The certifier's review round (it vouches for the liar while it is honest)."""
    r = meshnet_peer("review", "--bootstrap", addr, "--identity", key, "--json", env=env, timeout=600)
    assert r.returncode in (0, 3), r.stderr


def seen_by_a_client(addr: str, model_path: str, peer: str) -> None:
    c = Client([addr], model_path=model_path)
    try:
        for _ in range(20):  # a fresh announcement: bounded looks
            if peer in {s.peer_id for s in trio.run(c.spans)}:
                return
        raise AssertionError(f"{peer} never appeared in a survey")
    finally:
        c.close()


def fresh_clients(addr: str, model_path: str, prompts: list[str], answers: dict) -> list[str]:
    """Each prompt from a fresh client: what happened, in order ('right', 'WRONG' delivered,
    'withheld': refused with an error, as the CLI's exit 1)."""
    out = []
    for prompt in prompts:
        c = Client([addr], model_path=model_path)
        try:
            r = c.generate(prompt, TOKENS, SamplingParams(), stop_at_eog=False)
            out.append("right" if r.text == answers[prompt] else "WRONG")
        except GenerationError:
            out.append("withheld")
        finally:
            c.wait_audits(300)  # its audits and the report they publish, as the CLI waits for them
            c.close()
    return out


def start_liar(mode: str, addr: str, host: str, *extra: str) -> Cheater:
    liar = Cheater(mode, "--bootstrap", addr, "--host", host, *extra)
    liar.address(120)
    return liar


def test_a_vouched_sleeper_deceives_at_most_one_fresh_client(honest, answers, model_path, tmp_path):
    addr, key, env, _ = honest
    flip = tmp_path / "flip"
    sleeper = start_liar("sleeper", addr, own_address(), "--flip-file", str(flip))
    try:
        seen_by_a_client(addr, model_path, sleeper.peer_id)
        review(addr, key, env)  # honest so far: vouched
        flip.write_text("now")
        # the first user after the flip, through the CLI on a machine of its own
        mine = {**env, "MESHNET_CACHE_DIR": str(tmp_path / "first")}
        r = meshnet_peer("generate", "--bootstrap", addr, "--prompt", PLAIN[0], "--max-tokens", str(TOKENS),
                         "--json", env=mine)
        first = ("right" if json.loads(r.stdout)["text"] == answers[PLAIN[0]] else "WRONG") if r.returncode == 0 \
            else "withheld"
        got = [first, *fresh_clients(addr, model_path, [PLAIN[i % len(PLAIN)] for i in range(1, FRESH_CLIENTS)],
                                     answers)]
        # that user's audit caught it: its machine's status says so, and the proof it published
        # convinces another machine only by that machine's own replays
        r = meshnet_peer("status", "--bootstrap", addr, "--no-probe", env=mine)
        assert r.returncode == 0 and "CAUGHT computing something else" in r.stdout, (r.stdout, r.stderr[-2000:])
        elsewhere = {**env, "MESHNET_CACHE_DIR": str(tmp_path / "elsewhere")}
        r = meshnet_peer("audit", "--bootstrap", addr, "--peer", sleeper.peer_id, "--recheck", "--json",
                         env=elsewhere)
        assert r.returncode == 3, r.stderr[-3000:]
        assert {x["outcome"] for x in json.loads(r.stdout)["reports"]} == {"confirmed"}, r.stdout
    finally:
        assert sleeper.stop() == 0
    assert got.count("WRONG") <= 1, got
    assert "WRONG" not in got[1:], got  # after the first, a report exists
    assert got.count("right") >= FRESH_CLIENTS - 1, got


def test_a_vouched_trigger_deceives_at_most_one_fresh_client(honest, answers, model_path):
    addr, key, env, _ = honest
    liar = start_liar("trigger", addr, own_address())
    try:
        seen_by_a_client(addr, model_path, liar.peer_id)
        review(addr, key, env)  # its prompts need not hold the trigger
        prompts = [(TRIGGERED if i % 2 else PLAIN)[(i // 2) % 5] for i in range(FRESH_CLIENTS)]
        got = fresh_clients(addr, model_path, prompts, answers)
    finally:
        assert liar.stop() == 0
    assert got.count("WRONG") <= 1, list(zip(prompts, got))
    assert got.count("right") >= FRESH_CLIENTS - 1, list(zip(prompts, got))


def test_a_sybil_pair_decides_no_answer_and_convicts_no_honest_peer(honest, answers, model_path):
    """Two identities with no weights on one network, both claiming the whole model and
    answering with the attacker's text. They were the two "disjoint" routes of --verify
    always (17 of 20 runs: the attacker's text, marked cross-checked), and a review could
    take both as the two replays that convict an honest whole-model peer."""
    addr, key, env, _ = honest
    whole = Proc("join", "--layers", "0:30", "--bootstrap", addr, "--listen", f"{own_address()}:0", "--threads", "1",
                 env=env)
    sybils = []
    try:
        whole.address(120)
        host = own_address()
        sybils = [start_liar("hijack", addr, host) for _ in range(2)]  # one address: one network
        for p in (whole, *sybils):
            seen_by_a_client(addr, model_path, p.peer_id)
        got = []
        for i in range(FRESH_CLIENTS):
            prompt = PLAIN[i % len(PLAIN)]
            c = Client([addr], model_path=model_path, verify="always")
            try:
                r = c.generate(prompt, TOKENS, SamplingParams(), stop_at_eog=False)
                got.append("right" if r.text == answers[prompt] else "WRONG")
            except GenerationError:
                got.append("withheld")
            finally:
                c.close()
        assert "WRONG" not in got, got  # --verify always: never the attacker's text
        r = meshnet_peer("review", "--bootstrap", addr, "--identity", key, "--json", env=env, timeout=600)
        assert r.returncode in (0, 3), r.stderr
        doc = __import__("json").loads(r.stdout)
        honest_peers = {p.peer_id for p in (whole, *honest[3][1:])}
        assert not honest_peers & set(doc["convicted"]), doc  # no honest peer convicted
        assert not {s.peer_id for s in sybils} & set(doc["verified"]), doc  # nor a Sybil vouched
        auto = fresh_clients(addr, model_path, PLAIN, answers)
        assert auto.count("WRONG") <= 1, auto
    finally:
        codes = [p.stop() for p in (*sybils, whole)]
    assert codes == [0] * len(codes)
