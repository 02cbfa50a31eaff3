"""Capability reports are validated field by field: each lie or oddity has its own reason."""

import json
import math
import pathlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_p2p.swarm.capability import CAPABILITY_TYPE, TYPES, CapabilityReport, _valid
from meshnet_p2p.dataplane.transport.tls import make_tls_credentials
from meshnet_p2p.engine.recipe import recipe_digest
from meshnet_p2p.core.identity import Identity
from meshnet_p2p.core.multiaddr import Multiaddr
from meshnet_p2p.core.records import MAX_RECORD_BYTES, RecordRejected, RecordVerifier, Reject, sign_record, wall_ms

MODEL = "ab" * 32
RECIPE = "cd" * 32
IDENT = Identity.generate()
OTHER = Identity.generate()
RELAY_ID = Identity.generate()
CERT = make_tls_credentials(IDENT).cert_pem.decode()
ADDR = str(Multiaddr.for_socket("127.0.0.1", "tcp", 4000, IDENT.peer_id))
RELAY = str(Multiaddr.for_socket("10.0.0.1", "tcp", 4002, RELAY_ID.peer_id))


def report(**kw) -> CapabilityReport:
    args = dict(model_digest=MODEL, recipe_digest=RECIPE, layers=(0, 10), addrs=(ADDR,), throughput=25.0,
                free_sessions=3, kv_tokens_free=4096, tls_cert=CERT, public_name="alice")
    return CapabilityReport(**{**args, **kw})


def valid_content() -> dict:
    return report().content(IDENT)


def test_a_real_report_is_valid_direct_and_relayed():
    assert _valid(valid_content()) is None
    assert _valid(report(relay=RELAY).content(IDENT)) is None
    axes = json.loads((pathlib.Path(__file__).parent / "data" / "recipe_vectors.json").read_text())["recipes"][0]["axes"]
    with_recipe = {**valid_content(), "recipe": axes, "recipe_digest": recipe_digest(axes),
                   "recipe_labels": {"name": "default"}}
    assert _valid(with_recipe) is None
    # axes must hash to the digest beside them: nobody can name other axes for a recipe
    assert _valid({**with_recipe, "recipe": {**axes, "n_ubatch": 32}}) == "recipe axes do not hash to recipe_digest"
    assert _valid({**with_recipe, "recipe": {"seam_dtype": "f32"}}) == "recipe axes do not hash to recipe_digest"
    wire = report().sign(IDENT, seq=1, now_ms=wall_ms())
    assert RecordVerifier(TYPES).verify(wire, wall_ms()).content["throughput"] == 25.0


def test_a_relayed_report_announces_its_circuit_address_through_that_relay_only():
    circuit = f"{RELAY}/p2p-circuit/p2p/{IDENT.peer_id}"
    assert _valid(report(relay=RELAY, addrs=(circuit,)).content(IDENT)) is None
    other_relay = str(Multiaddr.for_socket("10.0.0.2", "tcp", 4002, OTHER.peer_id))
    assert _valid(report(relay=RELAY, addrs=(f"{other_relay}/p2p-circuit/p2p/{IDENT.peer_id}",)).content(IDENT)) \
        == "addrs entry must be a direct tcp address with host and port"
    assert _valid(report(relay=RELAY, addrs=(f"{RELAY}/p2p-circuit/p2p/{OTHER.peer_id}",)).content(IDENT)) is not None
    assert _valid(report(addrs=(circuit,)).content(IDENT)) is not None  # a circuit needs its relay named


def test_a_report_may_say_what_its_peer_did_lately():
    assert _valid(report(load=LOAD).content(IDENT)) is None
    assert "load" not in valid_content()  # optional: older reports carry none


def test_payload_bound_allows_recipe_axes_but_stays_below_the_record_bound():
    assert CAPABILITY_TYPE.max_payload_bytes == 8192 < MAX_RECORD_BYTES


LOAD = {"sessions": 2, "rows_per_pass": 1.5, "tokens_per_s": 40.0, "busy": 0.25}
ip6 = str(Multiaddr.for_socket("::1", "tcp", 4000, IDENT.peer_id))
BAD = [
    # (field, bad value, words the reason must contain)
    ("load", {**LOAD, "busy": 1.5}, "load must hold"),
    ("load", {**LOAD, "tokens_per_s": math.inf}, "load must hold"),
    ("load", {**LOAD, "sessions": -1}, "load must hold"),
    ("load", {**LOAD, "sessions": True}, "load must hold"),
    ("load", {"sessions": 2}, "load must hold"),
    ("load", [1, 2], "load must hold"),
    ("throughput", math.nan, "throughput"),
    ("throughput", math.inf, "throughput"),
    ("throughput", -math.inf, "throughput"),
    ("throughput", -1.0, "throughput"),
    ("throughput", 0.0, "throughput"),
    ("throughput", 0, "throughput"),
    ("throughput", 1e12, "throughput"),
    ("throughput", 100_000.5, "throughput"),
    ("throughput", True, "throughput"),
    ("throughput", "25", "throughput"),
    ("throughput", None, "throughput"),
    ("free_sessions", -1, "free_sessions"),
    ("free_sessions", 4097, "free_sessions"),
    ("free_sessions", 1.0, "free_sessions"),
    ("free_sessions", True, "free_sessions"),
    ("free_sessions", math.nan, "free_sessions"),
    ("kv_tokens_free", -1, "kv_tokens_free"),
    ("kv_tokens_free", 2**40 + 1, "kv_tokens_free"),
    ("kv_tokens_free", 1e12, "kv_tokens_free"),
    ("kv_tokens_free", False, "kv_tokens_free"),
    ("layers", [10, 5], "layers"),
    ("layers", [0, 100_001], "layers"),
    ("layers", [-1, 5], "layers"),
    ("layers", [0, 10, 20], "layers"),
    ("layers", [False, True], "layers"),
    ("layers", [0.0, 10.0], "layers"),
    ("layers", "0:10", "layers"),
    ("addrs", [], "addrs must be a list"),
    ("addrs", [ADDR] * 9, "addrs must be a list"),
    ("addrs", ADDR, "addrs must be a list"),
    ("addrs", [42], "addrs entry is not a multiaddr string"),
    ("addrs", ["not an addr"], "addrs entry is not a multiaddr"),
    ("addrs", ["/ip4/999.0.0.1/tcp/1/p2p/" + str(IDENT.peer_id)], "addrs entry is not a multiaddr"),
    ("addrs", ["/ip4/127.0.0.1/tcp/4000"], "addrs entry must end in one /p2p peer id"),
    ("addrs", ["/ip4/127.0.0.1/udp/4000/p2p/" + str(IDENT.peer_id)], "addrs entry must be a direct tcp"),
    ("addrs", ["/p2p/" + str(IDENT.peer_id)], "addrs entry must be a direct tcp"),
    ("addrs", [RELAY + "/p2p-circuit/p2p/" + str(IDENT.peer_id)], "addrs entry must be a direct tcp"),
    ("addrs", [ADDR, str(Multiaddr.for_socket("127.0.0.1", "tcp", 4001, OTHER.peer_id))], "another peer"),
    ("addrs", ["/ip4/127.0.0.1/tcp/4000/p2p/" + "x" * 600], "addrs entry is not a multiaddr"),
    ("relay", "/ip4/10.0.0.1/tcp/4002", "relay must end in one /p2p"),
    ("relay", "garbage", "relay is not a multiaddr"),
    ("relay", 7, "relay is not a multiaddr string"),
    ("relay", "/ip4/10.0.0.1/udp/4002/p2p/" + str(RELAY_ID.peer_id), "relay must be a direct tcp"),
    ("direct", 1, "direct must be a bool"),
    ("direct", None, "direct must be a bool"),
    ("tls_cert", "", "tls_cert"),
    ("tls_cert", "-----BEGIN PRIVATE KEY-----\n", "tls_cert"),
    ("tls_cert", "-----BEGIN CERTIFICATE-----" + "A" * 4096, "tls_cert"),
    ("tls_cert", CERT.encode(), "tls_cert"),
    ("name", "n" * 65, "name"),
    ("name", None, "name"),
    ("departing", 0, "departing"),
    ("departing", "no", "departing"),
    ("version", "v" * 33, "version"),
    ("version", 1, "version"),
    ("model_digest", "AB" * 32, "model_digest"),
    ("model_digest", "short", "model_digest"),
    ("model_digest", "zz" * 32, "model_digest"),
    ("recipe_digest", "CD" * 32, "recipe_digest"),
    ("recipe_digest", "cd" * 33, "recipe_digest"),
    ("recipe_digest", None, "recipe_digest"),
    ("key", "model/other", "key"),
    ("peer_id", 12, "peer_id"),
    ("peer_id", str(OTHER.peer_id), "addrs entry names another peer"),
    ("recipe", {"n_ubatch": 1.5}, "recipe must map"),
    ("recipe", {"k" * 65: "x"}, "recipe must map"),
    ("recipe", {"seam": "x" * 257}, "recipe must map"),
    ("recipe", {f"a{i}": i for i in range(33)}, "recipe must map"),
    ("recipe", {"list": [1]}, "recipe must map"),
    ("recipe", {"none": None}, "recipe must map"),
    ("recipe", ["seam", "f32"], "recipe must map"),
    ("recipe_labels", {"name": 1}, "recipe_labels"),
    ("recipe_labels", {"name": "x" * 65}, "recipe_labels"),
    ("recipe_labels", {f"l{i}": "x" for i in range(9)}, "recipe_labels"),
    ("recipe_labels", "default", "recipe_labels"),
]


@pytest.mark.parametrize("field,value,reason", BAD, ids=[f"{f}={str(v)[:20]}" for f, v, _ in BAD])
def test_each_bad_field_is_refused_with_its_reason(field, value, reason):
    content = {**valid_content(), field: value}
    why = _valid(content)
    assert why is not None and reason in why


def test_reasons_differ_field_by_field():
    fields = {}
    for field, value, _ in BAD:
        fields.setdefault(_valid({**valid_content(), field: value}), set()).add(field)
    # one reason never covers two fields (peer_id is caught through its addrs)
    assert all(len(fs) == 1 or fs == {"peer_id", "addrs"} for fs in fields.values()), fields


@pytest.mark.parametrize("relay,direct", [(None, False), (RELAY, True)])
def test_direct_must_agree_with_relay(relay, direct):
    content = {**valid_content(), "relay": relay, "direct": direct}
    assert _valid(content) == "direct must be true exactly when relay is None"


@pytest.mark.parametrize("field", ["throughput", "addrs", "tls_cert", "direct", "relay", "version", "peer_id"])
def test_missing_required_fields_are_named(field):
    content = valid_content()
    del content[field]
    assert _valid(content) == f"missing field {field}"


def test_odd_shapes_never_raise():
    class Hostile(dict):
        def __contains__(self, key):
            raise RuntimeError("boom")

    for odd in (None, [], "content", 3, Hostile(valid_content())):
        assert isinstance(_valid(odd), str)


@given(st.dictionaries(st.sampled_from(sorted(valid_content()) + ["recipe", "recipe_labels"]),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80)
                                    | st.binary(max_size=8),
                                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                                    max_leaves=8)))
def test_any_mutation_yields_none_or_a_reason(mutation):
    why = _valid({**valid_content(), **mutation})
    assert why is None or (isinstance(why, str) and why and not why.startswith("unreadable"))


def test_a_signed_report_with_nan_throughput_is_refused_by_the_verifier():
    wire = report(throughput=math.nan).sign(IDENT, seq=1, now_ms=wall_ms())
    with pytest.raises(RecordRejected) as e:
        RecordVerifier(TYPES).verify(wire, wall_ms())
    assert e.value.reason is Reject.MALFORMED
    assert "capability/v1 content: throughput must be finite" in str(e.value)


def test_a_report_of_someone_elses_address_is_refused_by_the_verifier():
    content = {**valid_content(), "addrs": [str(Multiaddr.for_socket("127.0.0.1", "tcp", 4000, OTHER.peer_id))]}
    wire = sign_record(IDENT, "meshnet/capability/v1", content, seq=1, now_ms=wall_ms(), ttl_ms=60_000)
    with pytest.raises(RecordRejected) as e:
        RecordVerifier(TYPES).verify(wire, wall_ms())
    assert e.value.reason is Reject.MALFORMED and "another peer" in str(e.value)
