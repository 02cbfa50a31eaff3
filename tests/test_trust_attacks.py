"""Issue 59's attacks, as a patient attacker with one machine runs them against a
real loopback swarm of processes, every peer at an address of its own (the
scenarios are tests/adversaries.py's, which bench/verify.py measures too):

- the **sleeper**: a real whole-model peer, honest until a certifier's review
  vouches for it, then answering every session with the attacker's text;
- the **trigger**: the same, lying only when the prompt holds " bank";
- the **Sybil pair**: two identities with no weights on one network, the same
  wrong answer, both claiming the whole model;
- **framing**: forged fraud reports from fresh identities against an honest peer.

The acceptance (issue 59): sleeper and trigger, at most one wrong answer
delivered (returned, not withheld) over 20 fresh clients after the flip, none
after a fraud report exists (now none at all: a whole-model peer a client has not
checked itself runs beside a second route); the Sybil pair, none with --verify always, at most
one with auto, and no honest peer convicted; framing convicts nobody.
"""

from __future__ import annotations

import json

import pytest

from meshnet_p2p.client import Client

from tests.adversaries import PLAIN, TRIGGERED, HonestSwarm, answers as whole_model_answers, forge_reports, \
    fresh_client, fresh_clients
from tests.swarm import meshnet_peer, own_address

FRESH_CLIENTS = 20


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    with HonestSwarm(tmp_path_factory.mktemp("attacks")) as swarm:
        yield swarm
        codes = swarm.stop()
    assert codes == [0] * len(codes)


@pytest.fixture(scope="module")
def answers(model_path):
    return whole_model_answers(model_path)


def outcomes(addr, prompts, answers, **kw) -> list[str]:
    return [o.what for o in fresh_clients(addr, prompts, answers, **kw)]


def test_a_vouched_sleeper_deceives_no_fresh_client(honest, answers, tmp_path, monkeypatch):
    flip = tmp_path / "flip"
    sleeper = honest.liar("sleeper", "--flip-file", str(flip))
    try:
        honest.review()  # honest so far: vouched
        flip.write_text("now")
        # the first user after the flip, whom the planner sends to the sleeper (the worst case, made
        # certain), keeping its records on its machine as the CLI does
        mine = {**honest.env, "MESHNET_CACHE_DIR": str(tmp_path / "first")}
        monkeypatch.setenv("MESHNET_CACHE_DIR", mine["MESHNET_CACHE_DIR"])
        first = fresh_client(honest.addr, PLAIN[0], answers[PLAIN[0]], through=sleeper.peer_id, keep_records=True)
        monkeypatch.setenv("MESHNET_CACHE_DIR", honest.env["MESHNET_CACHE_DIR"])
        got = [first.what, *outcomes(honest.addr, [PLAIN[i % len(PLAIN)] for i in range(1, FRESH_CLIENTS)],
                                     answers)]
        # that user's audit caught it: its machine's status says so, and the proof it published
        # convinces another machine only by that machine's own replays
        r = meshnet_peer("status", "--bootstrap", honest.addr, "--no-probe", env=mine)
        assert r.returncode == 0 and "CAUGHT computing something else" in r.stdout, (r.stdout, r.stderr[-2000:])
        elsewhere = {**honest.env, "MESHNET_CACHE_DIR": str(tmp_path / "elsewhere")}
        r = meshnet_peer("audit", "--bootstrap", honest.addr, "--peer", sleeper.peer_id, "--recheck", "--json",
                         env=elsewhere)
        assert r.returncode == 3, r.stderr[-3000:]
        assert {x["outcome"] for x in json.loads(r.stdout)["reports"]} == {"confirmed"}, r.stdout
    finally:
        assert sleeper.stop() == 0
    # the first user, sent to it, ran a second route beside it (a vouch is someone else's check; one
    # identity computing every layer decides the whole answer): they disagreed at the first token, and
    # with no third route of verified peers (one chain here is vouched) the answer was withheld, not
    # delivered; its audit then proved the lie (above) for every client after it
    assert got[0] in ("right", "withheld"), got
    assert got[1:] == ["right"] * (FRESH_CLIENTS - 1), got  # a report exists: none after it


def test_a_vouched_trigger_deceives_no_fresh_client(honest, answers):
    liar = honest.liar("trigger")
    try:
        honest.review()  # its prompts are drawn: they may or may not hold the trigger
        prompts = [(TRIGGERED if i % 2 else PLAIN)[(i // 2) % 5] for i in range(FRESH_CLIENTS)]
        got = outcomes(honest.addr, prompts, answers)
    finally:
        assert liar.stop() == 0
    # every fresh client runs a second route beside a whole-model peer it has not checked itself:
    # the lie is never delivered; the first trigger prompt is withheld (no verified third route)
    # and its audit's proof stops the clients after it
    assert "WRONG" not in got and got.count("withheld") <= 1, list(zip(prompts, got))


def test_a_sybil_pair_decides_no_answer_and_convicts_no_honest_peer(honest, answers):
    """Two identities with no weights on one network, both claiming the whole model and
    answering with the attacker's text. They were the two "disjoint" routes of --verify
    always (17 of 20 runs: the attacker's text, marked cross-checked), and a review could
    take both as the two replays that convict an honest whole-model peer."""
    whole, sybils = honest.join("0:30"), []
    try:
        host = own_address()
        sybils = [honest.liar("hijack", host=host) for _ in range(2)]  # one address: one network
        got = outcomes(honest.addr, [PLAIN[i % len(PLAIN)] for i in range(FRESH_CLIENTS)], answers,
                       verify="always")
        assert "WRONG" not in got, got  # --verify always: never the attacker's text
        doc = honest.review()
        honest_peers = {p.peer_id for p in (whole, *honest.joins)}
        assert not honest_peers & set(doc["convicted"]), doc  # no honest peer convicted
        assert not {s.peer_id for s in sybils} & set(doc["verified"]), doc  # nor a Sybil vouched
        auto = outcomes(honest.addr, PLAIN, answers)
        assert auto.count("WRONG") <= 1, auto
    finally:
        codes = [p.stop() for p in (*sybils, whole)]
    assert codes == [0] * len(codes)


def test_forged_reports_against_an_honest_peer_convict_nobody_and_cost_few_rechecks(honest, answers):
    """Forty reports from fresh identities, of false but transferable proofs (the peer's own
    signed commitments from two sessions, a made-up replay), against an honest whole-model
    peer the review vouched for: a fresh client finds them before it plans (the peer is
    reported: never the one route an answer depends on), re-checks each proof once off the
    answer's path, refutes them, and convicts nobody; every answer stays right."""
    import trio

    framed = honest.join("0:30")  # two replays on other networks can check it: the two chains
    try:
        doc = honest.review()
        assert framed.peer_id in doc["verified"], doc
        assert forge_reports(honest.addr, framed.peer_id, 40, sessions=2) >= 1
        c = Client([honest.addr])
        try:
            trio.run(c.spans)  # the survey looks the reports up
            assert c.records.reported(framed.peer_id) and not c.records.verified(framed.peer_id)
            assert c.auditor.wait_rechecks(300)
            mine = [r for r in c.auditor.rechecks if r.peer_id == framed.peer_id]
            assert [r.outcome.value for r in mine] == ["refuted", "refuted"], [(r.outcome, r.detail) for r in mine]
            assert framed.peer_id not in c.records.caught() and c.records.verified(framed.peer_id)
        finally:
            c.close()
        got = outcomes(honest.addr, PLAIN, answers)
        assert got == ["right"] * len(PLAIN), got
    finally:
        assert framed.stop() == 0
