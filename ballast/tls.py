"""Certificates for transport security: a local CA and the certificates it signs, and where they live.

The embedded control plane (`ballast up`, `ballast demo`, tests) needs no setup: the first server to start
creates a CA, a server certificate and per-agent client certificates under <data_dir>/tls, once, and reuses
them. Production points tls_ca / tls_cert / tls_key at certificates issued elsewhere (or by `ballast tls init`).
EC P-256 keys keep generation in the milliseconds. No gRPC here: this is files and X.509 only.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ballast.config import Settings

CA_DAYS = 3650
LEAF_DAYS = 825
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class TlsError(ValueError):
    """A missing or unusable certificate; the message names the setting and the fix."""


@dataclass(frozen=True)
class Identity:
    """A certificate and its private key (PEM files)."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class TlsFiles:
    """The CA every peer trusts and this process's own identity."""

    ca: Path
    identity: Identity
    local: bool  # all three derived from the data dir: the local CA may create them


def local_dir(settings: Settings) -> Path:
    return settings.data_dir / "tls"


def tls_files(settings: Settings) -> TlsFiles:
    """The configured paths; an empty setting means the local CA's file in <data_dir>/tls."""
    d = local_dir(settings)
    ca = Path(settings.tls_ca).expanduser() if settings.tls_ca else d / "ca.crt"
    cert = Path(settings.tls_cert).expanduser() if settings.tls_cert else d / "server.crt"
    key = Path(settings.tls_key).expanduser() if settings.tls_key else d / "server.key"
    local = not (settings.tls_ca or settings.tls_cert or settings.tls_key)
    return TlsFiles(ca, Identity(cert, key), local)


def server_names(settings: Settings) -> list[str]:
    """Names a client may dial this host by: loopback, the bind and advertised host, this machine's names."""
    names = [*LOOPBACK_NAMES, socket.gethostname(), socket.getfqdn()]
    for host in (settings.host, settings.advertise_host):
        if host and host not in ("0.0.0.0", "::"):
            names.append(host)
    return list(dict.fromkeys(names))


def ensure_server_files(settings: Settings) -> TlsFiles:
    """The files a server needs, created by the local CA when they are the data dir's own; explicit paths must
    exist already."""
    files = tls_files(settings)
    if files.local:
        with _locked(local_dir(settings)):
            ca = ensure_ca(local_dir(settings))
            if not files.identity.cert.exists():
                issue(ca, files.identity, "ballast-server", server_names(settings), server=True, client=False)
    _require(files.ca, "tls_ca")
    _require(files.identity.cert, "tls_cert")
    _require(files.identity.key, "tls_key")
    return files


SCRAPER = "metrics-scraper"


def scraper_identity(settings: Settings) -> Identity:
    """The client certificate a Prometheus (or curl) presents to the metrics ports, which serve only a client the
    plane's CA vouches for: <data_dir>/tls/scraper.crt and .key, issued by the local CA on first use. With your own
    PKI, issue one from your CA (`ballast tls init --agent prometheus`)."""
    d = local_dir(settings)
    identity = Identity(d / "scraper.crt", d / "scraper.key")
    if not tls_files(settings).local:
        _require(identity.cert, "the scraper's certificate (tls/scraper.crt)")
        return identity
    with _locked(d):
        ca = ensure_ca(d)
        if not identity.cert.exists():
            issue(ca, identity, SCRAPER, [SCRAPER], server=False, client=True)
    return identity


def agent_identity(settings: Settings, name: str) -> Identity:
    """The client certificate an executor agent proves its host with: the configured tls_cert / tls_key, or
    (embedded) one the local CA issues for `name`."""
    files = tls_files(settings)
    if not files.local:
        _require(files.identity.cert, "tls_cert")
        _require(files.identity.key, "tls_key")
        return files.identity
    d = local_dir(settings)
    identity = Identity(d / "agents" / f"{name}.crt", d / "agents" / f"{name}.key")
    with _locked(d):
        ca = ensure_ca(d)
        if not identity.cert.exists():
            issue(ca, identity, name, [name, *LOOPBACK_NAMES], server=True, client=True)
    return identity


def init_bundle(ca_dir: Path, out: Path, names: list[str], agents: list[str]) -> list[Path]:
    """`ballast tls init`: a CA in `ca_dir` (its key stays there) and, in `out`, ca.crt, a server certificate for
    `names` and one certificate per agent (CN = its host name); what exists is kept. Returns what was written."""
    import shutil

    written: list[Path] = []
    with _locked(ca_dir):
        ca = ensure_ca(ca_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "ca.crt").exists():
        shutil.copyfile(ca.cert, out / "ca.crt")
        written.append(out / "ca.crt")
    server = Identity(out / "server.crt", out / "server.key")
    wanted = [*names, *LOOPBACK_NAMES]
    if not server.cert.exists() or not set(wanted) <= alt_names(server.cert):  # a new service's name: issued anew
        written.append(issue(ca, server, "ballast-server", wanted, server=True, client=False).cert)
    for agent in agents:
        identity = Identity(out / "agents" / f"{agent}.crt", out / "agents" / f"{agent}.key")
        if not identity.cert.exists():
            written.append(issue(ca, identity, agent, [agent, *LOOPBACK_NAMES], server=True, client=True).cert)
    return written


def alt_names(cert: Path) -> set[str]:
    """The DNS names and IP addresses a PEM certificate is good for."""
    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    try:
        sans = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n.value) for n in sans if isinstance(n, x509.DNSName | x509.IPAddress)}


def common_name(cert: Path) -> str:
    """The subject CN of a PEM certificate (an agent's host name)."""
    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    values = loaded.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(values[0].value) if values else ""


def ensure_ca(directory: Path) -> Identity:
    """The CA in `directory` (ca.crt, ca.key), created on first use."""
    ca = Identity(directory / "ca.crt", directory / "ca.key")
    if ca.cert.exists() and ca.key.exists():
        return ca
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"ballast local CA ({socket.gethostname()})")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write(ca, cert, key)
    return ca


def issue(ca: Identity, out: Identity, common: str, names: Iterable[str], *, server: bool, client: bool) -> Identity:
    """A leaf certificate signed by `ca` for `common` with `names` as SANs (DNS names or IP addresses)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usages = [oid for oid, wanted in ((ExtendedKeyUsageOID.SERVER_AUTH, server),
                                      (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if wanted]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(list(_alt_names(names))), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    _write(out, cert, key)
    return out


def _alt_names(names: Iterable[str]) -> Iterator[x509.GeneralName]:
    for name in dict.fromkeys(names):
        try:
            yield x509.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            yield x509.DNSName(name)


def _write(out: Identity, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    """Key first (0600 from creation, never readable by others), then the certificate; each via a rename so a
    reader never sees half a file."""
    out.key.parent.mkdir(parents=True, exist_ok=True)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    _atomic(out.key, key_pem, 0o600)
    _atomic(out.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _atomic(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, mode)  # the umask may have narrowed it; never widened beyond `mode`
    os.replace(tmp, path)


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialise generation across the processes `ballast up` starts at once."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(directory / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _require(path: Path, setting: str) -> None:
    if not path.exists():
        raise TlsError(f"{setting}: {path} does not exist; set BALLAST_{setting.upper()} to an existing PEM file, "
                       "leave all tls_* settings empty to use the data dir's local CA, or run with "
                       "BALLAST_PLAINTEXT=1 on loopback only")
