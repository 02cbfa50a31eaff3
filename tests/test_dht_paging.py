"""Reading a key in parallel pages (dht/paging.py): the ranges asked for at once
cover every signer after a first page exactly once, and a home answers each range
with exactly its signers, but those the reader names as held."""

from hypothesis import example, given
from hypothesis import strategies as st

from meshnet_p2p.core.records import wall_ms
from meshnet_p2p.dht import paging
from meshnet_p2p.dht.storage import ValueStore, tag
from meshnet_p2p.swarm.capability import TYPES, model_key
from meshnet_p2p.core.records import RecordVerifier
from meshnet_p2p.testing import sample_report, swarm_identity

ED = paging.ED25519_PREFIX
signers = st.binary(min_size=32, max_size=32).map(lambda b: ED + b)
# keys ground near the ends of the key space too, where a density estimate is at its worst
edge = st.sampled_from([b"\x00" * 32, b"\x00" * 31 + b"\x01", b"\xff" * 32, b"\x7f" + b"\xff" * 31]).map(lambda b: ED + b)


def _owner(ranges, s: bytes) -> list[int]:
    return [i for i, (a, b) in enumerate(ranges) if s > a and (b is None or s <= b)]


@given(st.lists(signers | edge, min_size=1, max_size=60, unique=True), st.data(),
       st.integers(1, 300), st.integers(0, 16))
@example([ED + b"\x00" * 32], None, 1, 15)  # a first page that ended at the very start of the key space
def test_the_ranges_asked_at_once_hold_every_later_signer_exactly_once(keys, data, first_page, most):
    keys = sorted(keys)
    last = keys[0] if data is None else data.draw(st.sampled_from(keys))
    ranges = paging.split_rest(last, first_page, most)
    assert 1 <= len(ranges) <= max(1, most)
    assert ranges[0][0] == last and ranges[-1][1] is None
    for (a, b), (a2, _) in zip(ranges, ranges[1:]):
        assert a < b == a2  # in order, contiguous, none empty
    for s in keys:
        assert len(_owner(ranges, s)) == (1 if s > last else 0)


def test_a_denser_first_page_asks_for_fewer_ranges_and_an_odd_signer_for_one():
    mid = paging.cursor_at(0.5) + b"\x00" * 24
    assert len(paging.split_rest(mid, 60, 15)) == 2  # half the space held 60: ~60 left, two pages' worth
    assert len(paging.split_rest(paging.cursor_at(0.1) + b"\x00" * 24, 60, 15)) == 15  # ~540 left: bounded
    assert len(paging.split_rest(paging.cursor_at(0.9) + b"\x00" * 24, 60, 15)) == 1
    assert paging.split_rest(b"\x01\x02" + bytes(36), 60, 15) == [(b"\x01\x02" + bytes(36), None)]  # not Ed25519
    assert paging.position(b"\x00" * 38) is None and paging.position(ED + b"\x00" * 31) is None


_VERIFIER = RecordVerifier(TYPES)
_KEY = model_key("ab" * 32)
_NOW = wall_ms()
_RECORDS = [_VERIFIER.verify(sample_report(swarm_identity(7000 + i), "ab" * 32).sign(
    swarm_identity(7000 + i), seq=1, now_ms=_NOW, ttl_ms=600_000), _NOW, remember=False) for i in range(40)]


@given(st.data(), st.integers(600, 20_000))
def test_a_home_answers_a_range_with_its_signers_in_order_and_pages_on_within_it(data, budget):
    store = ValueStore()
    for rec in _RECORDS:
        assert store.put(_KEY, rec, _NOW)[0]
    every = sorted(r.signer.multihash for r in _RECORDS)
    bounds = data.draw(st.lists(st.sampled_from(every) | signers | st.just(b""), min_size=2, max_size=2))
    after, upto = min(bounds), data.draw(st.sampled_from([None, max(bounds)]))
    held = [_RECORDS[i] for i in data.draw(st.sets(st.integers(0, len(_RECORDS) - 1)))]  # what the reader holds
    known = {tag(r) for r in held} | data.draw(st.sets(st.binary(min_size=8, max_size=8), max_size=3))
    in_range = [s for s in every if s > after and (upto is None or s <= upto)]
    want = [s for s in in_range if s not in {r.signer.multihash for r in held}]
    got, cursor, left_out = [], after, 0
    for _ in range(len(every) + 1):
        page, more, skipped = store.get(_KEY, _NOW, after=cursor, upto=upto, budget=budget, known=known)
        got += [r.signer.multihash for r in page]
        left_out += skipped
        if not more:
            break
        cursor = page[-1].signer.multihash
    assert got == want
    assert left_out >= len(in_range) - len(want)  # each held one in range left out (again, on each page it ends)
