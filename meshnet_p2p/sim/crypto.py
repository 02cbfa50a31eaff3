"""Signatures at simulation speed: the checks stay, Ed25519's arithmetic goes.

At ~100 us to sign and ~100-300 us to verify on this project's 2-core machines,
Ed25519 alone would spend most of a 10,000-peer run. While ``stand_in_signatures``
is active, ``Identity.sign`` makes a keyed BLAKE2b of the data with a key only that
identity's signing uses (derived from its peer ID under a secret of the run, which
no node's code sees: so both processes of a split run, ``split.py``, check each
other's signatures), and ``PeerId.verify`` accepts exactly those: a signature still
verifies only for its signer's key and its exact bytes, so a forged, altered or
replayed-under-another-name record fails as it does for real; what it cost is
not the behaviour under study. Signature sizes stay 64 bytes (datagram sizes are).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
from typing import Iterator

from cryptography.exceptions import InvalidSignature

from meshnet_p2p.core import identity as identity_module
from meshnet_p2p.core.identity import Identity, PeerId


@contextlib.contextmanager
def stand_in_signatures(secret: bytes | None = None) -> Iterator[None]:
    """``secret``: the run's (drawn here when not given; a split run's processes share one)."""
    secret = os.urandom(32) if secret is None else secret
    keys: dict[bytes, bytes] = {}  # peer ID multihash -> the key only that identity's signing uses
    real_sign, real_verify = Identity.sign, PeerId.verify

    def key_of(multihash: bytes) -> bytes:
        key = keys.get(multihash)
        if key is None:  # (not setdefault: its default would be computed every datagram)
            key = keys[multihash] = hashlib.blake2b(multihash, key=secret, digest_size=32).digest()
        return key

    def sign(self: Identity, data: bytes) -> bytes:
        return hashlib.blake2b(data, key=key_of(self.peer_id.multihash), digest_size=64).digest()

    def verify(self: PeerId, signature: bytes, data: bytes) -> bool:
        return isinstance(signature, bytes) and \
            hmac.compare_digest(hashlib.blake2b(data, key=key_of(self.multihash), digest_size=64).digest(), signature)

    class _Key:  # what ``signed_by_peer`` (statements: attestations, commitments) verifies with
        def __init__(self, peer_id: str) -> None:
            self.peer = PeerId.from_string(peer_id)

        def verify(self, signature: bytes, data: bytes) -> None:
            if not verify(self.peer, signature, data):
                raise InvalidSignature()

    real_verifier = identity_module._verifier
    Identity.sign, PeerId.verify, identity_module._verifier = sign, verify, _Key
    try:
        yield
    finally:
        Identity.sign, PeerId.verify, identity_module._verifier = real_sign, real_verify, real_verifier
