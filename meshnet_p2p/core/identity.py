"""Peer identities: Ed25519 keys, libp2p-format peer IDs, and key files.

A peer ID is libp2p's: the identity multihash of the protobuf-encoded public
key, in base58btc (``12D3KooW...`` for Ed25519). Because the multihash *is* the
key, anyone can check a signature against a peer ID with nothing else, which
is what lets every record on the network be verified without a tracker.

Only Ed25519 identities are accepted. A sha256-multihash peer ID (RSA and
other large keys) does not carry its key, so it could not be verified here.

Key files hold libp2p's protobuf PrivateKey encoding (as go-libp2p writes
them), are created 0600, and are refused if group or others can read them.
"""

from __future__ import annotations

import functools

import os
import stat
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import MeshnetError

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}
MAX_PEER_ID_CHARS = 128  # an Ed25519 peer ID is 52 characters

# libp2p protobuf: PublicKey{Type=Ed25519(1), Data=32 bytes}, PrivateKey{Type=1, Data=64 bytes}
_PUB_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])
_PRIV_PREFIX = bytes([0x08, 0x01, 0x12, 0x40])
_MH_IDENTITY = 0x00
# what every Ed25519 peer ID's multihash starts with (its 32-byte key follows)
ED25519_MULTIHASH_PREFIX = bytes([_MH_IDENTITY, len(_PUB_PREFIX) + 32]) + _PUB_PREFIX


class IdentityError(MeshnetError):
    """A malformed key, peer ID or key file."""


class KeyFileError(IdentityError):
    """A key file that is missing, unsafe (readable by others) or corrupt."""


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    if len(text) > MAX_PEER_ID_CHARS:
        raise IdentityError(f"base58 text of {len(text)} characters is too long")
    n = 0
    for c in text:
        i = _B58_INDEX.get(c)
        if i is None:
            raise IdentityError(f"{c!r} is not a base58btc character")
        n = n * 58 + i
    pad = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * pad + body


def encode_public_key(raw: bytes) -> bytes:
    if len(raw) != 32:
        raise IdentityError("an Ed25519 public key is 32 bytes")
    return _PUB_PREFIX + raw


def decode_public_key(proto: bytes) -> bytes:
    """libp2p PublicKey protobuf -> raw 32-byte Ed25519 key (strict: canonical encoding only)."""
    if len(proto) != 36 or not proto.startswith(_PUB_PREFIX):
        raise IdentityError("not a canonical libp2p Ed25519 public key encoding")
    return proto[4:]


PEER_TAG_BYTES = 8  # of a peer ID, naming it in a gossip digest (dht/gossip.py: why 8 is enough)


@dataclass(frozen=True)
class PeerId:
    """A peer ID: the multihash bytes. ``str()`` gives the base58btc form."""

    multihash: bytes

    @classmethod
    def from_public_key(cls, raw: bytes) -> "PeerId":
        proto = encode_public_key(raw)
        return cls(bytes([_MH_IDENTITY, len(proto)]) + proto)

    @classmethod
    def from_string(cls, text: str) -> "PeerId":
        if not isinstance(text, str) or not text:
            raise IdentityError("a peer ID must be a non-empty string")
        return cls.from_bytes(b58decode(text))

    @classmethod
    def from_bytes(cls, data: bytes) -> "PeerId":
        return _peer_id_of(bytes(data))

    def public_key_bytes(self) -> bytes:
        return decode_public_key(self.multihash[2:])

    def public_key(self) -> Ed25519PublicKey:
        return Ed25519PublicKey.from_public_bytes(self.public_key_bytes())

    def verify(self, signature: bytes, data: bytes) -> bool:
        try:
            self.public_key().verify(signature, data)
            return True
        except (InvalidSignature, ValueError):
            return False

    @functools.cached_property
    def tag(self) -> bytes:
        """The ID's last PEER_TAG_BYTES: how a gossip digest names a signer
        (dht/gossip.py). Cached: a pull's answer looks up every record's."""
        return self.multihash[-PEER_TAG_BYTES:]

    @functools.cached_property
    def _text(self) -> str:  # a frozen dataclass still has a __dict__ for this cache
        return b58encode(self.multihash)

    def __str__(self) -> str:
        # cached: every signed step compares it, and base58 in Python is ~10 us warm, ~70 cold
        return self._text

    def __repr__(self) -> str:
        return f"PeerId({str(self)!r})"

    # Written out, not generated: a generated one packs a one-field tuple per call, and
    # peer IDs are hashed and compared in every DHT datagram's handling (~6 % of a
    # simulated swarm's time at 3,000 peers went to generated __hash__/__eq__).
    def __hash__(self) -> int:
        return hash(self.multihash)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is PeerId:
            return self is other or self.multihash == other.multihash
        return NotImplemented


@functools.lru_cache(maxsize=16384)
def _peer_id_of(data: bytes) -> PeerId:
    """A peer ID from its bytes, checked; interned (the same few hundred peers come in
    every DHT reply, and a new object would base58-encode its text again: ~30 us each)."""
    if len(data) < 2:
        raise IdentityError("peer ID is too short")
    if data[0] != _MH_IDENTITY:
        raise IdentityError("only Ed25519 peer IDs (identity multihash, 12D3KooW...) are accepted")
    if data[1] != len(data) - 2:
        raise IdentityError("peer ID multihash length does not match its content")
    decode_public_key(data[2:])
    return PeerId(data)


@functools.lru_cache(maxsize=4096)
def _verifier(peer_id: str) -> Ed25519PublicKey:
    """The public key a peer ID string carries (IdentityError/ValueError if it carries none);
    cached, as a ring hop and a client verify the same few peers' signatures step after step."""
    return PeerId.from_string(peer_id).public_key()


def signed_by_peer(peer_id: str, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` over ``data`` is the peer's whose ID is ``peer_id`` (a string
    from the network: a malformed ID or signature is simply False)."""
    if not isinstance(peer_id, str) or not isinstance(signature, bytes) or len(signature) != 64:
        return False
    try:
        _verifier(peer_id).verify(signature, data)
        return True
    except (IdentityError, ValueError, InvalidSignature):
        return False


class Identity:
    """A peer's private identity: an Ed25519 key and the peer ID it derives."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_key_bytes = raw
        self.peer_id = PeerId.from_public_key(raw)

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "Identity":
        if len(seed) != 32:
            raise IdentityError("an Ed25519 seed is 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def seed(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def to_protobuf(self) -> bytes:
        """libp2p PrivateKey protobuf: seed followed by public key (64 bytes of data)."""
        return _PRIV_PREFIX + self.seed() + self.public_key_bytes

    @classmethod
    def from_protobuf(cls, data: bytes) -> "Identity":
        if len(data) != 68 or not data.startswith(_PRIV_PREFIX):
            raise IdentityError("not a libp2p Ed25519 private key encoding")
        ident = cls.from_seed(data[4:36])
        if ident.public_key_bytes != data[36:68]:
            raise IdentityError("private key encoding carries a public key that does not match its seed")
        return ident

    # --- key files ---------------------------------------------------------------

    def save(self, path: str, *, overwrite: bool = False) -> None:
        """Write the key with mode 0600 from the first byte (never world-readable, even briefly)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise KeyFileError(f"{path} already exists; refusing to overwrite an identity") from None
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, self.to_protobuf())
            os.fsync(fd)
        finally:
            os.close(fd)

    @classmethod
    def load(cls, path: str) -> "Identity":
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise KeyFileError(f"no identity at {path}; create one with `meshnet-peer identity new`") from None
        except OSError as e:
            raise KeyFileError(f"cannot open {path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KeyFileError(f"{path} is not a regular file")
            if st.st_mode & 0o077:
                raise KeyFileError(
                    f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`"
                )
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
        try:
            return cls.from_protobuf(data)
        except IdentityError as e:
            raise KeyFileError(f"{path}: {e}") from None


def default_identity_path() -> str:
    root = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return os.path.join(root, "meshnet-p2p", "identity.key")
