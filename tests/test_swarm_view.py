"""Which recipes a node may route user traffic over, and what it says when
none: pure functions of verified records and a trust policy."""

import dataclasses
import json
import pathlib

import pytest
import trio
import trio.testing

from meshnet_p2p.swarm.capability import model_key
from meshnet_p2p.trust.policy import Certificate, TrustPolicy
from meshnet_p2p.dht.node import DHTConfig
from meshnet_p2p.engine.recipe import recipe_digest
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.swarm.placement import NoRoute
from meshnet_p2p.core.records import Record
from meshnet_p2p.swarm.view import (CERTIFY_HINT, SURVEY_RETRY_WAITS_S, RecipeNotCertified, build_view,
                                    fetch_believable, fetch_records, routable_spans)
from meshnet_p2p.trust.evidence import cert_key, index_key
from meshnet_p2p.testing import sample_report

AXES = json.loads((pathlib.Path(__file__).parent / "data" / "recipe_vectors.json").read_text())["recipes"][0]["axes"]
ODD = {**AXES, "n_ubatch": 32}
GOOD, DARK = recipe_digest(AXES), recipe_digest(ODD)
MODEL = "ab" * 32


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


def record(layers, recipe=GOOD, axes=AXES, free=2) -> Record:
    ident = Identity.generate()
    rep = sample_report(ident, MODEL, recipe, layers, free_sessions=free)
    content = {**rep.content(ident), "recipe": dict(axes), "recipe_labels": {}}
    return Record("meshnet/capability/v1", content, 1, 0, 2**62, ident.peer_id, b"", b"")


def view(reports, certified=()):
    v = build_view(MODEL, 30, reports, [], TrustPolicy())
    for r in v.recipes:
        if r.recipe_digest in certified:
            r.certificate = Certificate(MODEL, r.recipe_digest, "someone", "whole-model", 0, ())
    return v


def test_only_a_certified_recipe_serves_users():
    good = [record((0, 10)), record((10, 20)), record((20, 30))]
    odd = [record((0, 30), DARK, ODD)]
    spans = routable_spans(view(good + odd, {GOOD}), TrustPolicy())
    assert {s.peer_id for s in spans} == {r.content["peer_id"] for r in good}


def test_fake_recipes_with_more_peers_do_not_hide_the_certified_one():
    good = [record((0, 30))]
    fakes = [record((0, 30), f"{i:02x}" * 32, {}) for i in range(40)]
    spans = routable_spans(view(good + fakes, {GOOD}), TrustPolicy())
    assert [s.peer_id for s in spans] == [good[0].content["peer_id"]]


def test_a_dark_swarm_is_refused_with_the_command_that_certifies_it():
    with pytest.raises(RecipeNotCertified) as e:
        routable_spans(view([record((0, 15)), record((15, 30))]), TrustPolicy())
    assert "is dark" in str(e.value) and CERTIFY_HINT in str(e.value)


def test_a_dark_swarm_with_a_hole_names_the_hole_first():
    with pytest.raises(NoRoute) as e:
        routable_spans(view([record((0, 10)), record((20, 30))]), TrustPolicy())
    assert "layers 10-19" in str(e.value) and "is dark" in str(e.value)


def test_layers_only_a_dark_recipe_serves_are_refused_naming_the_differing_axis():
    reports = [record((0, 10)), record((20, 30)), record((10, 20), DARK, ODD)]
    with pytest.raises(NoRoute) as e:
        routable_spans(view(reports, {GOOD}), TrustPolicy())
    assert "layers 10-19" in str(e.value) and "n_ubatch is 32 there, 64 here" in str(e.value)


def test_a_certified_recipe_whose_peers_are_all_full_says_so():
    with pytest.raises(NoRoute, match="full, departing"):
        routable_spans(view([record((0, 30), free=0)], {GOOD}), TrustPolicy())


def test_no_peer_at_all():
    with pytest.raises(NoRoute, match="no peer announces"):
        routable_spans(view([]), TrustPolicy())


class _LossyNode:
    """A DHT node double whose lookups of a key come back empty ``lost`` times (answers
    lost on a loaded host), then with what the swarm holds."""

    def __init__(self, held: list[Record], lost: int) -> None:
        self.held, self.lost, self.asked = held, lost, 0
        self.config = DHTConfig()

    def records(self, key):
        return []

    async def get(self, key):
        self.asked += 1
        return [] if self.asked <= self.lost else [r for r in self.held if r.content.get("key") == key]


def keyed(rec: Record) -> Record:
    return dataclasses.replace(rec, content={**rec.content, "key": model_key(MODEL)})


async def test_an_empty_survey_is_asked_again_before_it_is_believed(autojump_clock):
    held = [keyed(record((0, 30)))]
    node = _LossyNode(held, lost=2)
    reports, _ = await fetch_believable(node, MODEL, TrustPolicy())
    assert reports == held and node.asked == 3
    assert node.config.request_timeout > DHTConfig().request_timeout  # each retry waits longer for answers


async def test_a_swarm_that_is_really_empty_is_asked_a_bounded_number_of_times(autojump_clock):
    node = _LossyNode([], lost=0)
    start = trio.current_time()
    reports, certs = await fetch_believable(node, MODEL, TrustPolicy())
    assert reports == certs == [] and node.asked == 1 + len(SURVEY_RETRY_WAITS_S)
    assert trio.current_time() - start <= 1.5 * sum(SURVEY_RETRY_WAITS_S)


async def test_a_survey_that_leaves_layers_unserved_is_asked_again(autojump_clock):
    held = [keyed(record((0, 10))), keyed(record((10, 30)))]

    class Partial(_LossyNode):
        async def get(self, key):
            self.asked += 1
            return self.held[:1] if self.asked == 1 else self.held  # one report's store was lost at first

    node = Partial(held, lost=0)
    reports, _ = await fetch_believable(node, MODEL, TrustPolicy(), 30)
    assert {r.signer for r in reports} == {r.signer for r in held} and node.asked == 2


async def test_a_survey_costs_two_lookups_one_after_the_other_not_one_per_key(autojump_clock):
    """Each lookup is a few internet round trips (seconds, bench/sim.py); a fresh
    client surveys before its first token. Only a certificate waits (for the
    recipes its certifier indexed and peers serve): the reports, the verdicts
    and the index are looked up side by side. Failed before: the reports, then
    per certifier the verdicts, the index and the certificates, in turn (4 s)."""
    certifier = Identity.generate()
    me = str(certifier.peer_id)

    def signed(content: dict) -> Record:
        return Record("x", content, 1, 0, 2**62, certifier.peer_id, b"", b"")

    held = [keyed(record((0, 30))), signed({"key": index_key(MODEL, me), "recipes": [GOOD, DARK]}),
            signed({"key": cert_key(MODEL, GOOD, me)}),
            signed({"key": cert_key(MODEL, DARK, me)})]  # indexed, but no peer serves it: not looked up

    class Slow(_LossyNode):
        keys: list[str] = []

        def homes_of(self, signer):
            return []

        async def get(self, key, also_ask=()):
            self.keys.append(key)
            await trio.sleep(1.0)
            return [r for r in self.held if r.content.get("key") == key]

    node = Slow(held, lost=0)
    start = trio.current_time()
    reports, certs = await fetch_records(node, MODEL, [me])
    assert trio.current_time() - start == pytest.approx(2.0)
    assert reports == held[:1] and {c.content["key"] for c in certs} == {cert_key(MODEL, GOOD, me)}
    assert cert_key(MODEL, DARK, me) not in node.keys
