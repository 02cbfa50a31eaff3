"""Capability reports: what a serving peer offers, signed, stored under
``model/<model digest>`` in the DHT and spread by gossip.

The report names its key inside its signed content, so a report can only
ever be found under the model it claims to serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from . import __version__
from .identity import Identity
from .records import PayloadType, sign_record

CAPABILITY = "meshnet/capability/v1"
CAPABILITY_TTL_MS = 120_000  # peers re-announce well within this while alive


def model_key(model_digest: str) -> str:
    return f"model/{model_digest}"


def _valid(content: Mapping[str, Any]) -> str | None:
    """Why a capability report's content is malformed, or None."""
    try:
        layers = content["layers"]
        ok = (
            isinstance(content["model_digest"], str)
            and len(content["model_digest"]) == 64
            and content["key"] == model_key(content["model_digest"])
            and isinstance(content["recipe_digest"], str)
            and isinstance(layers, list)
            and len(layers) == 2
            and all(isinstance(x, int) for x in layers)
            and 0 <= layers[0] < layers[1] <= 100_000
            and isinstance(content["addrs"], list)
            and len(content["addrs"]) <= 8
            and all(isinstance(a, str) and len(a) <= 512 for a in content["addrs"])
            and isinstance(content["free_sessions"], int)
            and isinstance(content["throughput"], (int, float))
        )
    except (KeyError, TypeError):
        return "missing or mistyped fields"
    return None if ok else "fields out of range"


CAPABILITY_TYPE = PayloadType(CAPABILITY, max_payload_bytes=4096, replay_key_field="key", validate=_valid)
TYPES = {CAPABILITY: CAPABILITY_TYPE}


@dataclass(frozen=True)
class CapabilityReport:
    model_digest: str
    recipe_digest: str
    layers: tuple[int, int]
    addrs: tuple[str, ...]
    throughput: float = 0.0  # tokens/s this peer measured for its span
    free_sessions: int = 0
    kv_tokens_free: int = 0
    relay: str | None = None  # multiaddr of the relay it is reachable through, if not direct
    tls_cert: str = ""  # PEM of the data plane's TLS certificate (the signature binds it to the peer)
    public_name: str = ""
    departing: bool = False  # announced on shutdown: route around this peer

    def content(self, identity: Identity) -> dict[str, Any]:
        return {
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
