"""TLS for NATS beyond loopback: the head makes a CA and a server certificate on first start; clients trust that
CA alone. A joining worker learns the CA inside the authenticated join (its fingerprint is sealed with the
token), pins it, and from then on refuses any server whose certificate that CA did not sign."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    @property
    def ca_pem(self) -> str:
        return self.ca.read_text()

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.ca_pem)


def fingerprint(ca_pem: str) -> str:
    """SHA-256 of the CA certificate (DER), hex: what a worker pins."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(ca_pem)).hexdigest()


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def ensure_certs(folder: Path, names: list[str] | None = None) -> TlsFiles:
    """The head's CA and server certificate in `folder` (made once: keys 0600, certificates 0644)."""
    files = TlsFiles(folder / "ca.pem", folder / "server.pem", folder / "server-key.pem")
    if files.ca.exists() and files.cert.exists() and files.key.exists():
        return files
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"coderai cluster CA {os.urandom(4).hex()}")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert, key = _leaf(ca, ca_key, [socket.gethostname(), *(names or [])])
    pem = serialization.Encoding.PEM
    pkcs8, clear = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    _write(folder / "ca-key.pem", ca_key.private_bytes(pem, pkcs8, clear), 0o600)
    _write(files.key, key.private_bytes(pem, pkcs8, clear), 0o600)
    _write(files.cert, cert.public_bytes(pem), 0o644)
    _write(files.ca, ca.public_bytes(pem), 0o644)
    return files


def _leaf(ca, ca_key, names: list[str]):
    """(certificate, key) of a server signed by `ca`: for localhost, 127.0.0.1 and `names` (addresses or DNS
    names), for server and client use (a head's route to another head presents it: runtime/embedded.Routes)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "coderai-nats")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def issue(ca_pem: str, ca_key_pem: str, names: list[str]) -> tuple[str, str]:
    """(certificate, key) PEM for another head at `names`, signed by the heads' CA (its PEM and key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert, key = _leaf(
        x509.load_pem_x509_certificate(ca_pem.encode()),
        serialization.load_pem_private_key(ca_key_pem.encode(), password=None),
        names,
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return cert.public_bytes(pem).decode(), key_pem.decode()


def client_context(ca_pem: str = "") -> ssl.SSLContext:
    """A client context that trusts `ca_pem` alone (names are not checked: the pinned CA signs one server). Without
    a CA: no verification at all, for a join's first contact only, whose answers the token authenticates."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    if ca_pem:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=ca_pem)
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def ca_text(value: str) -> str:
    """A setting that holds a CA: PEM text, or the path of a file with it; '' when empty."""
    if not value:
        return ""
    if "BEGIN CERTIFICATE" in value:
        return value
    return Path(os.path.expanduser(value)).read_text()
