"""Capability reports: what a serving peer offers, signed, stored under
``model/<model digest>`` in the DHT and spread by gossip.

The report names its key inside its signed content, so a report can only
ever be found under the model it claims to serve.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from collections.abc import Mapping  # not typing's: an isinstance through its alias costs 3x
from typing import Any

from meshnet_p2p import __version__
from meshnet_p2p.engine.recipe import recipe_digest
from meshnet_p2p.core.identity import Identity, IdentityError
from meshnet_p2p.core.multiaddr import Multiaddr, MultiaddrError
from meshnet_p2p.core.records import MAX_RECORD_BYTES, PayloadType, sign_record, never_raising

CAPABILITY = "meshnet/capability/v1"
CAPABILITY_TTL_MS = 120_000  # peers re-announce well within this while alive


def model_key(model_digest: str) -> str:
    return f"model/{model_digest}"


MAX_THROUGHPUT = 100_000.0  # tokens/s; no span of any model decodes faster than this
MAX_FREE_SESSIONS = 4096
MAX_KV_TOKENS = 2**40
MAX_LAYER = 100_000
MAX_ADDRS = 8
MAX_TLS_CERT_CHARS = 4096
MAX_NAME_CHARS = 64
MAX_VERSION_CHARS = 32
MAX_RECIPE_AXES = 32
MAX_RECIPE_KEY_CHARS = 64
MAX_RECIPE_VALUE_CHARS = 256
MAX_RECIPE_LABELS = 8
MAX_LABEL_CHARS = 64
PEM_CERT_HEADER = "-----BEGIN CERTIFICATE-----"

_HEX64 = re.compile(r"[0-9a-f]{64}")
_REQUIRED = ("key", "peer_id", "model_digest", "recipe_digest", "layers", "addrs", "throughput", "free_sessions",
             "kv_tokens_free", "direct", "relay", "tls_cert", "name", "departing", "version")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_hex64(x: Any) -> bool:
    return isinstance(x, str) and _HEX64.fullmatch(x) is not None


def _short_str(x: Any, limit: int) -> bool:
    return isinstance(x, str) and len(x) <= limit


def _addr_problem(text: Any) -> tuple[Multiaddr | None, str | None]:
    """``text`` as a dialable tcp multiaddr (host, port, one /p2p, no circuit), or why not."""
    if not isinstance(text, str):
        return None, "is not a multiaddr string"
    try:
        addr = Multiaddr.parse(text)
    except (MultiaddrError, IdentityError, ValueError):
        return None, "is not a multiaddr"
    protos = [p for p, _ in addr.components]
    if addr.transport != "tcp" or addr.host is None or addr.port is None or "p2p-circuit" in protos:
        return None, "must be a direct tcp address with host and port"
    if protos.count("p2p") != 1:
        return None, "must end in one /p2p peer id"
    return addr, None


def _why(c: Mapping[str, Any]) -> str | None:
    if not isinstance(c, Mapping):
        return "content is not a map"
    for name in _REQUIRED:
        if name not in c:
            return f"missing field {name}"
    peer_id = c["peer_id"]
    if not _short_str(peer_id, 128) or not peer_id:
        return "peer_id must be a peer ID string"
    if not _is_hex64(c["model_digest"]):
        return "model_digest must be 64 lowercase hex digits"
    if c["key"] != model_key(c["model_digest"]):
        return "key must be model/<model_digest>"
    if not _is_hex64(c["recipe_digest"]):
        return "recipe_digest must be 64 lowercase hex digits"
    layers = c["layers"]
    if not (isinstance(layers, list) and len(layers) == 2 and all(_is_int(x) for x in layers)
            and 0 <= layers[0] < layers[1] <= MAX_LAYER):
        return f"layers must be [start, end] with 0 <= start < end <= {MAX_LAYER}"
    t = c["throughput"]
    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= MAX_THROUGHPUT and math.isfinite(t)):
        return f"throughput must be finite and in (0, {MAX_THROUGHPUT:.0f}]"
    if not (_is_int(c["free_sessions"]) and 0 <= c["free_sessions"] <= MAX_FREE_SESSIONS):
        return f"free_sessions must be an int in [0, {MAX_FREE_SESSIONS}]"
    if not (_is_int(c["kv_tokens_free"]) and 0 <= c["kv_tokens_free"] <= MAX_KV_TOKENS):
        return "kv_tokens_free must be an int in [0, 2**40]"
    relay, direct = c["relay"], c["direct"]
    if relay is not None:
        _, why = _addr_problem(relay)
        if why is not None:
            return f"relay {why}"
    addrs = c["addrs"]
    if not (isinstance(addrs, list) and 1 <= len(addrs) <= MAX_ADDRS):
        return f"addrs must be a list of 1 to {MAX_ADDRS} multiaddrs"
    for a in addrs:
        if relay is not None and a == f"{relay}/p2p-circuit/p2p/{peer_id}":
            continue  # reached through its relay, as libp2p writes it
        addr, why = _addr_problem(a)
        if why is not None:
            return f"addrs entry {why}"
        if str(addr.peer_id) != peer_id:
            return "addrs entry names another peer than peer_id"
    if not isinstance(direct, bool):
        return "direct must be a bool"
    if direct != (relay is None):
        return "direct must be true exactly when relay is None"
    cert = c["tls_cert"]
    if not (_short_str(cert, MAX_TLS_CERT_CHARS) and cert.startswith(PEM_CERT_HEADER)):
        return f"tls_cert must be a PEM certificate of at most {MAX_TLS_CERT_CHARS} chars"
    if not _short_str(c["name"], MAX_NAME_CHARS):
        return f"name must be a str of at most {MAX_NAME_CHARS} chars"
    if not isinstance(c["departing"], bool):
        return "departing must be a bool"
    if not _short_str(c["version"], MAX_VERSION_CHARS):
        return f"version must be a str of at most {MAX_VERSION_CHARS} chars"
    if "recipe" in c:
        recipe = c["recipe"]
        if not (isinstance(recipe, Mapping) and len(recipe) <= MAX_RECIPE_AXES and all(
                _short_str(k, MAX_RECIPE_KEY_CHARS)
                and (isinstance(v, (bool, int)) or _short_str(v, MAX_RECIPE_VALUE_CHARS))
                for k, v in recipe.items())):
            return (f"recipe must map at most {MAX_RECIPE_AXES} names (<= {MAX_RECIPE_KEY_CHARS} chars) "
                    f"to int, bool or str (<= {MAX_RECIPE_VALUE_CHARS} chars)")
        # the axes must be exactly those this build knows and hash to the digest
        # they ride beside: otherwise anyone could name any axes for a recipe
        try:
            matches = recipe_digest(recipe) == c["recipe_digest"]
        except ValueError:
            matches = False
        if not matches:
            return "recipe axes do not hash to recipe_digest"
    if "load" in c:
        load = c["load"]
        if not (isinstance(load, Mapping) and set(load) == set(_LOAD_FIELDS)
                and _is_int(load["sessions"]) and 0 <= load["sessions"] <= MAX_FREE_SESSIONS
                and all(_finite_in(load[k], 0.0, bound) for k, bound in _LOAD_BOUNDS.items())):
            return (f"load must hold exactly {', '.join(_LOAD_FIELDS)}: sessions an int in [0, {MAX_FREE_SESSIONS}], "
                    f"the others finite and in range")
    if "recipe_labels" in c:
        labels = c["recipe_labels"]
        if not (isinstance(labels, Mapping) and len(labels) <= MAX_RECIPE_LABELS and all(
                _short_str(k, MAX_LABEL_CHARS) and _short_str(v, MAX_LABEL_CHARS) for k, v in labels.items())):
            return f"recipe_labels must map at most {MAX_RECIPE_LABELS} str to str, each <= {MAX_LABEL_CHARS} chars"
    return None


# What a peer says of its recent work (since its last report), for monitors: the peer's own
# claim, shown, never used to route. Optional: older reports have none.
_LOAD_BOUNDS = {"rows_per_pass": 65536.0, "tokens_per_s": MAX_THROUGHPUT, "busy": 1.0}
_LOAD_FIELDS = ("sessions", *_LOAD_BOUNDS)


def _finite_in(x: Any, lo: float, hi: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and lo <= x <= hi


# Why a capability report's content is malformed (a short reason naming the field), or None.
_valid = never_raising(_why)


MAX_REPORT_LIFETIME_MS = 10 * 60_000  # a report is re-announced every 30 s: it lives minutes, not a day
CAPABILITY_TYPE = PayloadType(CAPABILITY, max_payload_bytes=8192, replay_key_field="key", validate=_valid,
                              max_lifetime_ms=MAX_REPORT_LIFETIME_MS,
                              # a peer re-announces every 30 s; only what is news travels by push
                              volatile_fields=frozenset({"throughput", "free_sessions", "kv_tokens_free", "load"}))

# Which models a swarm serves: each serving peer also signs a small index entry
# under one well-known key, so `status` can list models without knowing them.
MODEL_INDEX = "meshnet/model-index/v1"
MODELS_KEY = "models"


def _valid_index(c: Mapping[str, Any]) -> str | None:
    try:
        if c["key"] != MODELS_KEY:
            return "key must be models"
        if not _is_hex64(c["model_digest"]):
            return "model_digest must be 64 lowercase hex digits"
        if not _short_str(c["name"], MAX_NAME_CHARS):
            return f"name must be a str of at most {MAX_NAME_CHARS} chars"
        if not (_is_int(c["n_layer"]) and 1 <= c["n_layer"] <= MAX_LAYER):
            return "n_layer out of range"
    except (KeyError, TypeError):
        return "missing or mistyped fields"
    return None


MODEL_INDEX_TYPE = PayloadType(MODEL_INDEX, max_payload_bytes=512, replay_key_field="key", validate=_valid_index,
                               max_lifetime_ms=MAX_REPORT_LIFETIME_MS)


def sign_model_index(identity: Identity, model_digest: str, name: str, n_layer: int, *, now_ms: int,
                     ttl_ms: int = CAPABILITY_TTL_MS) -> bytes:
    content = {"key": MODELS_KEY, "peer_id": str(identity.peer_id), "model_digest": model_digest,
               "name": name[:MAX_NAME_CHARS], "n_layer": n_layer}
    return sign_record(identity, MODEL_INDEX, content, seq=now_ms, now_ms=now_ms, ttl_ms=ttl_ms)


TYPES = {CAPABILITY: CAPABILITY_TYPE, MODEL_INDEX: MODEL_INDEX_TYPE}
assert CAPABILITY_TYPE.max_payload_bytes < MAX_RECORD_BYTES


@dataclass(frozen=True)
class CapabilityReport:
    model_digest: str
    recipe_digest: str
    layers: tuple[int, int]
    addrs: tuple[str, ...]
    throughput: float = 0.0  # tokens/s this peer measured for its span; must be in (0, MAX_THROUGHPUT] to publish
    free_sessions: int = 0
    kv_tokens_free: int = 0
    relay: str | None = None  # multiaddr of the relay it is reachable through, if not direct
    tls_cert: str = ""  # PEM of the data plane's TLS certificate (the signature binds it to the peer)
    public_name: str = ""
    departing: bool = False  # announced on shutdown: route around this peer
    recipe: Mapping[str, Any] | None = None  # every recipe axis, so a reader can name the ones that differ
    recipe_labels: Mapping[str, str] | None = None  # names beside the digest, not digested
    # its recent work: {"sessions": open now, "rows_per_pass": batch occupancy, "tokens_per_s": rows
    # computed per second, "busy": share of the time its engine computed}, since its last report
    load: Mapping[str, Any] | None = None

    def content(self, identity: Identity) -> dict[str, Any]:
        extra = {} if self.recipe is None else {"recipe": dict(self.recipe), "recipe_labels": dict(self.recipe_labels or {})}
        if self.load is not None:
            extra["load"] = dict(self.load)
        return extra | {
            "key": model_key(self.model_digest),
            "peer_id": str(identity.peer_id),
            "model_digest": self.model_digest,
            "recipe_digest": self.recipe_digest,
            "layers": list(self.layers),
            "addrs": list(self.addrs),
            "throughput": float(self.throughput),
            "free_sessions": self.free_sessions,
            "kv_tokens_free": self.kv_tokens_free,
            "direct": self.relay is None,
            "relay": self.relay,
            "tls_cert": self.tls_cert,
            "name": self.public_name[:64],
            "departing": self.departing,
            "version": __version__,
        }

    def sign(self, identity: Identity, *, seq: int, now_ms: int, ttl_ms: int = CAPABILITY_TTL_MS) -> bytes:
        return sign_record(identity, CAPABILITY, self.content(identity), seq=seq, now_ms=now_ms, ttl_ms=ttl_ms)
