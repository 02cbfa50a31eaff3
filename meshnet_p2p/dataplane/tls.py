"""TLS bound to a peer's Ed25519 identity.

grpcio's TLS cannot use Ed25519 certificates, so each peer makes a P-256 key
and a self-signed certificate for its data plane, and vouches for it with its
Ed25519 identity in a signed record (``meshnet/tls/v1``, and the same
certificate inside its capability report). A client pins exactly that
certificate as its only root: the TLS handshake then proves the server holds
the key the peer's identity signed for, and nobody else can pass it, relay
operators included.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ..errors import MeshnetError
from ..identity import Identity, PeerId
from ..records import PayloadType, RecordRejected, RecordVerifier, sign_record

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

    @property
    def cert_sha256(self) -> str:
        return cert_fingerprint(self.cert_pem)


def cert_fingerprint(cert_pem: bytes) -> str:
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def make_tls_credentials(days: int = 30) -> TlsCredentials:
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
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return TlsCredentials(key_pem, cert.public_bytes(serialization.Encoding.PEM))


def sign_binding(identity: Identity, creds: TlsCredentials, *, now_ms: int, ttl_ms: int = 24 * 3600 * 1000, seq: int | None = None) -> bytes:
    """The identity's signed statement: "my data plane's certificate is this one"."""
    content = {"key": f"tls/{identity.peer_id}", "peer_id": str(identity.peer_id), "cert": creds.cert_pem.decode()}
    return sign_record(identity, TLS_TYPE, content, seq=now_ms if seq is None else seq, now_ms=now_ms, ttl_ms=ttl_ms)


def verify_binding(record_wire: bytes, expected_peer: PeerId, now_ms: int) -> bytes:
    """The certificate PEM a binding vouches for, if it is signed by ``expected_peer``."""
    try:
        rec = RecordVerifier({TLS_TYPE: TLS_RECORD_TYPE}).verify(record_wire, now_ms, remember=False)
    except RecordRejected as e:
        raise TlsBindingError(f"TLS binding rejected: {e}") from None
    if rec.signer != expected_peer:
        raise TlsBindingError(f"TLS binding is signed by {rec.signer}, not by {expected_peer}")
    return rec.content["cert"].encode()
