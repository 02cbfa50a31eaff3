"""Route costs: advertised throughput seeds the estimate, what the client measured replaces it."""

import math

import pytest

from meshnet_p2p.swarm.placement import (DEFAULT_HOP_MS, DEFAULT_TOKENS_PER_S, MIN_UNMEASURED_MS_PER_TOKEN, Span,
                                   plan_route, span_cost_ms)


def crowding(span: Span) -> float:
    return 1.0 / max(1, span.free_sessions)


def test_unmeasured_cost_is_round_trip_plus_claimed_compute():
    s = Span("p", 0, 10, 50.0, free_sessions=2)
    assert span_cost_ms(s) == pytest.approx(DEFAULT_HOP_MS + 20.0 + 0.5)
    assert span_cost_ms(s, {"p": 7.0}) == pytest.approx(7.0 + 20.0 + 0.5)
    unknown = Span("q", 0, 10, 0.0)
    assert span_cost_ms(unknown) == pytest.approx(DEFAULT_HOP_MS + 1000.0 / DEFAULT_TOKENS_PER_S + 1.0)


def test_measured_replaces_advertised_entirely():
    liar = Span("liar", 0, 10, 100_000.0, free_sessions=4)
    honest = Span("liar", 0, 10, 1.0, free_sessions=4)
    measured = {"liar": 40.0}
    assert span_cost_ms(liar, {"liar": 3.0}, measured) == pytest.approx(40.0 + 0.25)
    assert span_cost_ms(liar, None, measured) == span_cost_ms(honest, None, measured)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, None])
def test_unusable_measures_fall_back_to_the_estimate(bad):
    s = Span("p", 0, 10, 50.0)
    assert span_cost_ms(s, None, {"p": bad}) == span_cost_ms(s)


def test_an_unmeasured_claim_cannot_look_faster_than_the_cap():
    claim = Span("claim", 0, 10, 100_000.0)
    assert span_cost_ms(claim) == pytest.approx(DEFAULT_HOP_MS + MIN_UNMEASURED_MS_PER_TOKEN + 1.0)
    assert span_cost_ms(Span("claim", 0, 10, 1e9)) == span_cost_ms(claim)  # (no report carries 1e9 anyway)


def test_a_huge_claim_beats_a_measured_5ms_peer_only_by_what_the_cap_allows():
    claim = Span("claim", 0, 10, 100_000.0)
    measured = Span("measured", 0, 10, 10.0)
    m = {"measured": 5.0}
    margin = span_cost_ms(measured, None, m) - span_cost_ms(claim, None, m)
    assert margin <= 5.0 - (DEFAULT_HOP_MS + MIN_UNMEASURED_MS_PER_TOKEN) + 1e-9
    # with the claimer's real round trip known, the claim no longer wins at all
    assert [s.peer_id for s in plan_route([claim, measured], 0, 10, latency_ms={"claim": 4.5}, measured_ms=m)] == [
        "measured"]
    # and once the claimer is measured slow, it loses as its numbers say
    m["claim"] = 5.5
    assert [s.peer_id for s in plan_route([claim, measured], 0, 10, measured_ms=m)] == ["measured"]
    m["claim"] = 4.5
    assert [s.peer_id for s in plan_route([claim, measured], 0, 10, measured_ms=m)] == ["claim"]


def test_a_measured_slow_peer_loses_to_an_unmeasured_one_only_as_the_numbers_say():
    slow = Span("slow", 0, 10, 1000.0)  # advertises 1 ms/token...
    fresh = Span("fresh", 0, 10, 50.0)  # ...this one 20 ms, unmeasured: estimate 2 + 20 + 1 = 23 ms
    estimate = span_cost_ms(fresh)
    assert [s.peer_id for s in plan_route([slow, fresh], 0, 10)] == ["slow"]  # seeded by the claims
    # measured: slow's real time decides, not its advertisement
    assert [s.peer_id for s in plan_route([slow, fresh], 0, 10, measured_ms={"slow": estimate - 1.5})] == ["slow"]
    assert [s.peer_id for s in plan_route([slow, fresh], 0, 10, measured_ms={"slow": estimate + 0.5})] == ["fresh"]


def test_measures_are_summed_along_a_chain():
    a, b, whole = Span("a", 0, 5, 50.0), Span("b", 5, 10, 50.0), Span("whole", 0, 10, 50.0)
    m = {"a": 3.0, "b": 3.0, "whole": 8.0}
    assert [s.peer_id for s in plan_route([a, b, whole], 0, 10, measured_ms=m)] == ["a", "b"]  # 6 + 2 < 8 + 1
    m["whole"] = 6.5
    assert [s.peer_id for s in plan_route([a, b, whole], 0, 10, measured_ms=m)] == ["whole"]  # 7.5 < 8


def test_existing_callers_keep_working_positionally():
    spans = [Span("a", 0, 10, 50.0), Span("b", 0, 10, 60.0)]
    assert [s.peer_id for s in plan_route(spans, 0, 10)] == ["b"]
    assert span_cost_ms(spans[0], {"a": 1.0}) == pytest.approx(1.0 + 20.0 + 1.0)


def test_span_from_a_verified_report_reads_the_validated_fields():
    from meshnet_p2p.swarm.capability import TYPES, CapabilityReport
    from meshnet_p2p.dataplane.transport.tls import make_tls_credentials
    from meshnet_p2p.core.identity import Identity
    from meshnet_p2p.core.multiaddr import Multiaddr
    from meshnet_p2p.core.records import RecordVerifier, wall_ms

    ident = Identity.generate()
    rep = CapabilityReport("ab" * 32, "cd" * 32, (3, 9), (str(Multiaddr.for_socket("127.0.0.1", "tcp", 4000, ident.peer_id)),),
                           throughput=40, free_sessions=2, tls_cert=make_tls_credentials(ident).cert_pem.decode(),
                           departing=True)
    record = RecordVerifier(TYPES).verify(rep.sign(ident, seq=1, now_ms=wall_ms()), wall_ms())
    span = Span.from_report(record)
    assert (span.peer_id, span.start, span.end, span.throughput, span.free_sessions, span.departing) == (
        str(ident.peer_id), 3, 9, 40.0, 2, True)
    assert isinstance(span.throughput, float) and span.record is record


def test_an_implausible_unmeasured_claim_is_tried_after_measured_honest_peers():
    from meshnet_p2p.swarm.placement import IMPLAUSIBLE_PENALTY_MS, Span, plan_route, span_cost_ms

    honest = [Span("h1", 0, 10, 300.0, 2), Span("h2", 10, 20, 300.0, 2), Span("h3", 20, 30, 300.0, 2)]
    liar = Span("liar", 0, 30, 100_000.0, 4096)
    measured = {"h1": 5.0, "h2": 5.0, "h3": 5.0}  # 0.5 ms a layer, measured
    assert [s.peer_id for s in plan_route(honest + [liar], 0, 30)] == ["liar"]  # nothing measured: the claim seeds
    assert [s.peer_id for s in plan_route(honest + [liar], 0, 30, measured_ms=measured)] == ["h1", "h2", "h3"]
    # a claim within twice the best measured speed is plausible and competes on its numbers
    near = Span("near", 0, 30, 1000.0 / 7.6, 4096)
    assert span_cost_ms(near, None, measured, 0.5) < IMPLAUSIBLE_PENALTY_MS
    assert [s.peer_id for s in plan_route(honest + [near], 0, 30, measured_ms=measured)] == ["near"]


def test_missing_layers_costs_what_the_spans_cost_not_what_a_claim_of_layers_costs():
    from meshnet_p2p.swarm.placement import missing_layers

    # a per-layer walk could not even allocate this range; a sweep over the spans does not care
    huge = 10**15
    spans = [Span(f"p{i}", 0, huge // 2) for i in range(2000)] + [Span("q", huge - 10, huge)]
    assert missing_layers(spans, 0, huge) == [(huge // 2, huge - 10)]
    # the rules of old, on small cases
    assert missing_layers([Span("a", 0, 3), Span("b", 5, 8)], 0, 10) == [(3, 5), (8, 10)]
    assert missing_layers([Span("a", 2, 4), Span("b", 3, 6)], 0, 6) == [(0, 2)]
    assert missing_layers([], 4, 9) == [(4, 9)]
    assert missing_layers([Span("a", 0, 10)], 2, 5) == []
