"""TLS bound to a peer's Ed25519 identity.

grpcio's TLS cannot use Ed25519 certificates, so each peer makes a P-256 key
and a self-signed certificate for its data plane. The certificate carries,
as libp2p's TLS spec does (extension 1.3.6.1.4.1.53594.1.1, a DER
``SignedKey``), the peer's Ed25519 public key and its signature over the
certificate's public key: the certificate itself says whose it is, so nobody
can pass off another peer's certificate as their own. Peers publish the
certificate in signed records (``meshnet/tls/v1`` and their capability
report); a client checks the embedded identity and pins exactly that
certificate as its only root, so the TLS handshake proves it talks to that
peer, relay operators notwithstanding.

Clients present such a certificate too (mutual TLS), so a peer can hold each
client to a share of its capacity. The stdlib ``ssl`` module verifies a client
certificate only against trusted issuers and has no hook to accept a
self-signed one, so client certificates are issued by CLIENT_ISSUER: a key
derived from a published seed, whose signature therefore proves nothing and
is relied on for nothing. What binds a client is what binds a peer: TLS
proves possession of the certificate's key, and the libp2p extension carries
the identity's signature over that key (``cert_identity``).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import ssl
import tempfile
import time
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from meshnet_p2p.core.errors import MeshnetError
from meshnet_p2p.core.identity import (
    Identity,
    IdentityError,
    PeerId,
    decode_public_key,
    encode_public_key,
)
from meshnet_p2p.core.records import PayloadType, RecordRejected, RecordVerifier, sign_record

TLS_NAME = "meshnet-peer"  # the certificate's DNS name; clients override the target name to it
TLS_TYPE = "meshnet/tls/v1"
MAX_CERT_PEM = 4096


class TlsBindingError(MeshnetError):
    pass


def _valid(content) -> str | None:
    cert = content.get("cert")
    if not isinstance(cert, str) or not cert.startswith("-----BEGIN CERTIFICATE-----") or len(cert) > MAX_CERT_PEM:
        return "cert is not a PEM certificate"
    if content.get("key") != f"tls/{content.get('peer_id')}":
        return "key must be tls/<peer id>"
    return None


TLS_RECORD_TYPE = PayloadType(TLS_TYPE, max_payload_bytes=MAX_CERT_PEM + 512, replay_key_field="key", validate=_valid)


@dataclass(frozen=True)
class TlsCredentials:
    key_pem: bytes
    cert_pem: bytes


LIBP2P_TLS_OID = x509.ObjectIdentifier("1.3.6.1.4.1.53594.1.1")
_SIGN_PREFIX = b"libp2p-tls-handshake:"


def _der_octets(data: bytes) -> bytes:
    return bytes([0x04, len(data)]) + data  # short-form lengths suffice: every field is < 128 bytes


def _signed_key(identity: Identity, spki: bytes) -> bytes:
    body = _der_octets(encode_public_key(identity.public_key_bytes)) + _der_octets(identity.sign(_SIGN_PREFIX + spki))
    return bytes([0x30, len(body)]) + body


def cert_identity(cert_pem: bytes) -> PeerId:
    """The peer a certificate belongs to, from its signed-key extension (verified)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        ext = cert.extensions.get_extension_for_oid(LIBP2P_TLS_OID).value.value
    except x509.ExtensionNotFound:
        raise TlsBindingError("the certificate carries no peer identity") from None
    except Exception as e:  # noqa: BLE001 - network input: the parser's many errors (InvalidVersion...) are one to us
        raise TlsBindingError(f"malformed certificate ({type(e).__name__})") from None
    parts, pos = [], 2
    if len(ext) < 2 or ext[0] != 0x30 or ext[1] != len(ext) - 2:
        raise TlsBindingError("malformed identity extension")
    while pos < len(ext) and len(parts) < 3:
        if ext[pos] != 0x04 or pos + 2 > len(ext) or ext[pos + 1] >= 128:
            raise TlsBindingError("malformed identity extension")
        n = ext[pos + 1]
        parts.append(ext[pos + 2 : pos + 2 + n])
        pos += 2 + n
    if len(parts) != 2 or pos != len(ext):
        raise TlsBindingError("malformed identity extension")
    try:
        peer = PeerId.from_public_key(decode_public_key(parts[0]))
    except IdentityError as e:
        raise TlsBindingError(f"identity extension: {e}") from None
    try:
        spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    except Exception:  # noqa: BLE001 - a key this library cannot read (UnsupportedAlgorithm...) binds nobody
        raise TlsBindingError("the certificate's key is malformed or of an unknown type") from None
    if not peer.verify(parts[1], _SIGN_PREFIX + spki):
        raise TlsBindingError("the certificate's identity signature does not cover its key")
    return peer


def make_tls_credentials(identity: Identity | None = None, days: int = 30) -> TlsCredentials:
    """A P-256 key and self-signed certificate; with ``identity``, the certificate
    carries that identity's signature over its key (what peers always use)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    )
    if identity is not None:
        spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        cert = cert.add_extension(x509.UnrecognizedExtension(LIBP2P_TLS_OID, _signed_key(identity, spki)), critical=False)
    cert = cert.sign(key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return TlsCredentials(key_pem, cert.public_bytes(serialization.Encoding.PEM))


_ISSUER_SEED = b"meshnet-p2p client certificate issuer v1 (a published key: its signature proves nothing)"
_ISSUER_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshnet-client-issuer")])
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


@functools.cache
def _client_issuer() -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    scalar = int.from_bytes(hashlib.sha256(_ISSUER_SEED).digest(), "big") % (_P256_ORDER - 1) + 1
    key = ec.derive_private_key(scalar, ec.SECP256R1())
    start = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_ISSUER_NAME)
        .issuer_name(_ISSUER_NAME)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=365 * 30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    return key, cert.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def client_issuer_pem() -> bytes:
    """The certificate a peer trusts for client certificates (see the module's doc)."""
    return _client_issuer()[1]


def make_client_credentials(identity: Identity, hours: int = 24) -> TlsCredentials:
    """A client's P-256 key and certificate, carrying ``identity``'s signature
    over the key; it is issued by CLIENT_ISSUER only so that ``ssl`` accepts it."""
    issuer_key, issuer_pem = _client_issuer()
    issuer = x509.load_pem_x509_certificate(issuer_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshnet-client")]))
        .issuer_name(_ISSUER_NAME)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=hours))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.public_key()), critical=False)
        .add_extension(x509.UnrecognizedExtension(LIBP2P_TLS_OID, _signed_key(identity, spki)), critical=False)
        .sign(issuer_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return TlsCredentials(key_pem, cert.public_bytes(serialization.Encoding.PEM))


_DEFAULT_CLIENT_RENEW_S = 12 * 3600
_default_client: tuple[TlsCredentials, float] | None = None  # and when it was made (monotonic seconds)


def default_client_credentials() -> TlsCredentials:
    """This process's client certificate when the caller names no identity: a
    fresh identity per process (renewed well before its certificate expires),
    so even a casual client is counted as itself, not in the anonymous budget."""
    global _default_client
    now = time.monotonic()
    if _default_client is None or now - _default_client[1] > _DEFAULT_CLIENT_RENEW_S:
        _default_client = (make_client_credentials(Identity.generate()), now)
    return _default_client[0]


def load_key_pair(ctx: ssl.SSLContext, creds: TlsCredentials) -> None:
    """``ctx.load_cert_chain`` from memory: ssl loads keys only from paths, and an
    anonymous in-memory file keeps the key off disk."""
    fd = os.memfd_create("meshnet-tls", 0) if hasattr(os, "memfd_create") else None
    if fd is not None:
        try:
            os.write(fd, creds.cert_pem + b"\n" + creds.key_pem)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
    else:  # pragma: no cover - non-Linux
        with tempfile.NamedTemporaryFile() as f:  # created 0600
            f.write(creds.cert_pem + b"\n" + creds.key_pem)
            f.flush()
            ctx.load_cert_chain(f.name)


# --- the SSL contexts every TLS end of the data plane uses ------------------------------------


def _context(protocol: int) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])  # gRPC: HTTP/2 only (handshake() insists on it)
    return ctx


def server_context(creds: TlsCredentials) -> ssl.SSLContext:
    """A data-plane listener's: our identity-bound certificate, and an optional
    client certificate (mutual TLS); clients without one are served as anonymous.
    The issuer check means nothing (see CLIENT_ISSUER above): ``peer_of_der``
    is what proves a client's identity."""
    ctx = _context(ssl.PROTOCOL_TLS_SERVER)
    load_key_pair(ctx, creds)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    ctx.load_verify_locations(cadata=client_issuer_pem().decode("ascii"))
    return ctx


def client_context(pinned: bytes | None, creds: TlsCredentials | None = None) -> ssl.SSLContext:
    """A dialer's. ``pinned``: the peer's certificate (PEM), the only root, verified
    with its name (connect with ``server_hostname=TLS_NAME``); None verifies
    nothing, for a dialer that checks the certificate's identity extension itself
    (``peer_of_der``: the handshake still proves the server holds its key).
    ``creds``: our client certificate, presented for mutual TLS."""
    ctx = _context(ssl.PROTOCOL_TLS_CLIENT)
    if pinned is None:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.load_verify_locations(cadata=pinned.decode("ascii"))
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # as Python 3.13 does by default: the same checks everywhere
    if creds is not None:
        load_key_pair(ctx, creds)
    return ctx


def peer_of_der(der: bytes | None) -> PeerId | None:
    """The identity a client's certificate (DER, as ``getpeercert(True)`` gives
    it) is bound to; None for a client that sent none. TlsBindingError if it
    claims one it cannot prove."""
    if not der:
        return None
    return cert_identity(ssl.DER_cert_to_PEM_cert(der).encode())


def sign_binding(identity: Identity, creds: TlsCredentials, *, now_ms: int, ttl_ms: int = 24 * 3600 * 1000) -> bytes:
    """The identity's signed statement: "my data plane's certificate is this one"."""
    content = {"key": f"tls/{identity.peer_id}", "peer_id": str(identity.peer_id), "cert": creds.cert_pem.decode()}
    return sign_record(identity, TLS_TYPE, content, seq=now_ms, now_ms=now_ms, ttl_ms=ttl_ms)


def verify_binding(record_wire: bytes, expected_peer: PeerId, now_ms: int) -> bytes:
    """The certificate PEM a binding vouches for, if it is signed by ``expected_peer``."""
    try:
        rec = RecordVerifier({TLS_TYPE: TLS_RECORD_TYPE}).verify(record_wire, now_ms, remember=False)
    except RecordRejected as e:
        raise TlsBindingError(f"TLS binding rejected: {e}") from None
    if rec.signer != expected_peer:
        raise TlsBindingError(f"TLS binding is signed by {rec.signer}, not by {expected_peer}")
    cert = rec.content["cert"].encode()
    owner = cert_identity(cert)
    if owner != expected_peer:
        raise TlsBindingError(f"the certificate belongs to {owner}, not to {expected_peer}")
    return cert


def decrypt(tls: ssl.SSLObject, incoming: ssl.MemoryBIO, data: bytes) -> tuple[bytes, bool]:
    """Feed ``data`` from the socket to a MemoryBIO-driven TLS session: the plaintext
    it completes (b"" if none yet), and whether the peer closed the session (what came
    before its close_notify is still returned: a GOAWAY, say). A record that fails its
    check raises ``ssl.SSLError``."""
    incoming.write(data)
    plain = []
    while True:
        try:
            chunk = tls.read(1 << 18)
        except ssl.SSLWantReadError:
            return b"".join(plain), False
        if not chunk:
            return b"".join(plain), True
        plain.append(chunk)


def handshake(tls: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO, send, recv) -> None:
    """Run a MemoryBIO-driven TLS handshake over ``send(bytes)`` and ``recv() ->
    bytes``, then insist on HTTP/2 (ALPN h2). Raises ``ssl.SSLError`` if the
    handshake fails, ``ConnectionError`` if the peer hangs up or will not speak h2."""
    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            send(outgoing.read())
            data = recv()
            if not data:
                raise ConnectionError("the peer closed the connection during the TLS handshake") from None
            incoming.write(data)
    send(outgoing.read())
    if tls.selected_alpn_protocol() != "h2":
        raise ConnectionError("the peer did not agree to HTTP/2")
