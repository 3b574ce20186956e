"""Mutual TLS for the Ray clusters dcpserve runs: a cluster's certificate authority, each node's certificate, the
environment Ray reads them from, and the checks that make a bad certificate stop a node with the file's name.

Why: every Ray gRPC server (the GCS, raylets, core workers, the dashboard agent and each Serve replica's
inter-deployment server, which Ray 2.60 binds to every interface and which unpickles what it receives) takes plain
connections unless `RAY_USE_TLS=1`. With it, Ray's C++ and Python gRPC servers and clients all load
`RAY_TLS_SERVER_CERT` / `RAY_TLS_SERVER_KEY` (the process's own certificate, also presented as its client
certificate) and `RAY_TLS_CA_CERT`, and a server requires a client certificate signed by that CA: a peer without the
cluster's keys cannot open a connection, let alone send a pickle.

Layout of a cluster's TLS directory (0700; every key 0600, written with that mode, never readable in between):

    ca.crt  ca.key          the cluster's CA (ECDSA P-256), made once per cluster, never reused
    <name>/node.crt .key    one identity per node or client (`head`, `client`, a worker node's id), signed by the CA

`make serve`, `make cluster` and the tests' and benches' heads make a fresh directory at every start (dcpserve/local);
on a cloud cluster the operator makes the CA once (`dcpserve tls ca DIR`) and every node issues its own certificate
at setup (`dcpserve tls node`, ray_cluster.yaml). No function here prints, logs or puts key material in an error.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

# The variables Ray's gRPC servers and clients read (ray._common.tls_utils, and the same names in Ray's C++ config).
USE_TLS = "RAY_USE_TLS"
SERVER_CERT = "RAY_TLS_SERVER_CERT"
SERVER_KEY = "RAY_TLS_SERVER_KEY"
CA_CERT = "RAY_TLS_CA_CERT"
TLS_VARIABLES = (USE_TLS, SERVER_CERT, SERVER_KEY, CA_CERT)
# dcpserve's switch: "0" turns mutual TLS off for the clusters dcpserve starts (with a warning, TLS_OFF_WARNING).
TLS_SWITCH = "DCPSERVE_TLS"

CA_VALID_DAYS = 365
NODE_VALID_DAYS = 365
TLS_OFF_WARNING = (
    "DCPSERVE_TLS=0: Ray's mutual TLS is off. Every Ray gRPC server of this cluster then takes plain connections: "
    "each Serve replica's inter-deployment server listens on every interface (Ray 2.60 binds it to [::]:0) and "
    "unpickles what it receives, so anyone who can reach that port can run code in the replica's process and call "
    "the engine past the API keys, tenant limits and admission queue. Keep this for a machine no one else can reach.")


class TlsConfigError(ValueError):
    """A certificate or key that cannot be used: missing, unreadable, expired, not yet valid, or not signed by the
    cluster's CA. The message names the file and the fix, never its contents."""


def tls_enabled(env: Mapping[str, str]) -> bool:
    """Whether dcpserve starts its clusters with mutual TLS: on unless DCPSERVE_TLS=0 (any other value but 1 is an
    error, so that a typo never turns it off)."""
    value = env.get(TLS_SWITCH, "1").strip()
    if value not in ("0", "1"):
        raise TlsConfigError(f"{TLS_SWITCH} must be 1 (mutual TLS, the default) or 0 (off), got {value!r}")
    return value == "1"


@dataclass(frozen=True)
class Identity:
    """One node's (or client's) certificate and key, and the CA certificate it trusts."""

    cert: Path
    key: Path
    ca_cert: Path

    def env(self) -> dict[str, str]:
        """The environment under which a Ray process (or a driver, or the `ray` CLI) uses this identity."""
        return {USE_TLS: "1", SERVER_CERT: str(self.cert), SERVER_KEY: str(self.key), CA_CERT: str(self.ca_cert)}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Identity | None:
        """The identity Ray would use under env; None when RAY_USE_TLS is off. TlsConfigError names any variable
        that is missing (Ray itself would fail later, with a less clear message)."""
        if env.get(USE_TLS, "0").lower() not in ("1", "true"):
            return None
        missing = [name for name in (SERVER_CERT, SERVER_KEY, CA_CERT) if not env.get(name)]
        if missing:
            raise TlsConfigError(f"{USE_TLS}=1 but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                                 f"set: set each to a PEM file (`dcpserve tls node` writes them), or unset {USE_TLS}")
        return cls(Path(env[SERVER_CERT]), Path(env[SERVER_KEY]), Path(env[CA_CERT]))


def _write_private(path: Path, data: bytes) -> None:
    """data into a new file of mode 0600, created with that mode (never world-readable, not even for a moment)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class ClusterCa:
    """A cluster's certificate authority: issues each node's certificate."""

    directory: Path

    @property
    def cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def key(self) -> Path:
        return self.directory / "ca.key"

    @classmethod
    def create(cls, directory: Path, name: str = "dcpserve cluster", valid_days: int = CA_VALID_DAYS) -> ClusterCa:
        """A new CA in directory (made 0700). Refuses a directory that already holds a CA: a cluster's keys are
        never reused for another (remove it, or name a new directory)."""
        ca = cls(directory)
        if ca.cert.exists() or ca.key.exists():
            raise TlsConfigError(f"{directory} already holds a CA ({ca.cert.name}, {ca.key.name}): a new cluster gets "
                                 "new keys; remove the directory or name another")
        _private_dir(directory)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, name)])
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=valid_days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             key_cert_sign=True, crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        _write_private(ca.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
        ca.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return ca

    @classmethod
    def load(cls, directory: Path) -> ClusterCa:
        ca = cls(directory)
        for path in (ca.cert, ca.key):
            if not path.is_file():
                raise TlsConfigError(f"no CA file {path}: `dcpserve tls ca {directory}` makes a cluster's CA")
        return ca

    def issue(self, out: Path, name: str, addresses: Iterable[str] = (), valid_days: int = NODE_VALID_DAYS,
              not_before: datetime.datetime | None = None) -> Identity:
        """A certificate for `name` signed by this CA, and its key, in out/ (0700): node.crt, node.key. It serves
        and authenticates as a client (both key usages: a Ray process is both), for loopback, this host's name and
        `addresses` (the node's IPs or DNS names: a Ray client checks the server's certificate against the address
        it dials)."""
        ca_cert = x509.load_pem_x509_certificate(_read(self.cert, "the CA certificate"))
        ca_key = serialization.load_pem_private_key(_read(self.key, "the CA key"), password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise TlsConfigError(f"the CA key {self.key} is not an EC key: dcpserve's CAs are (`dcpserve tls ca`)")
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for address in ["127.0.0.1", "::1", "localhost", socket.gethostname(), *addresses]:
            try:
                entry: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(address))
            except ValueError:
                entry = x509.DNSName(address)
            if entry not in names:
                names.append(entry)
        start = not_before or _now() - datetime.timedelta(minutes=5)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=valid_days))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH,
                                                      x509.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _private_dir(out)
        identity = Identity(out / "node.crt", out / "node.key", self.cert)
        _write_private(identity.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
        identity.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return identity


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TlsConfigError(f"{what} {path} does not exist") from None
    except OSError as err:
        raise TlsConfigError(f"{what} {path} cannot be read ({err.strerror}): check its owner and mode") from None


def check_identity(identity: Identity, now: datetime.datetime | None = None) -> None:
    """Checks what Ray would otherwise find out late and vaguely (a node that cannot join, a gRPC handshake that
    fails without a file's name): each file exists and is readable PEM, the key is the certificate's, the
    certificate is valid now and signed by the CA. TlsConfigError names the file and the fix."""
    ca_bytes = _read(identity.ca_cert, f"the CA certificate ({CA_CERT})")
    cert_bytes = _read(identity.cert, f"the node certificate ({SERVER_CERT})")
    key_bytes = _read(identity.key, f"the node key ({SERVER_KEY})")
    try:
        ca_cert = x509.load_pem_x509_certificate(ca_bytes)
    except ValueError:
        raise TlsConfigError(f"the CA certificate {identity.ca_cert} ({CA_CERT}) is not a PEM certificate") from None
    try:
        cert = x509.load_pem_x509_certificate(cert_bytes)
    except ValueError:
        raise TlsConfigError(f"the node certificate {identity.cert} ({SERVER_CERT}) is not a PEM certificate"
                             ) from None
    try:
        key = serialization.load_pem_private_key(key_bytes, password=None)
    except (ValueError, TypeError):
        raise TlsConfigError(f"the node key {identity.key} ({SERVER_KEY}) is not an unencrypted PEM private key"
                             ) from None
    now = now or _now()
    for path, what, certificate in ((identity.ca_cert, "CA certificate", ca_cert),
                                    (identity.cert, "node certificate", cert)):
        if now < certificate.not_valid_before_utc:
            start = f"{certificate.not_valid_before_utc:%Y-%m-%d %H:%M}"
            raise TlsConfigError(f"the {what} {path} is not valid before {start} UTC (check this machine's clock)")
        if now > certificate.not_valid_after_utc:
            raise TlsConfigError(f"the {what} {path} expired on {certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: "
                                 "issue a new one (`dcpserve tls node`, or `dcpserve tls ca` for a new CA)")
    spki = (serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise TlsConfigError(f"the node key {identity.key} ({SERVER_KEY}) is not the key of the certificate "
                             f"{identity.cert} ({SERVER_CERT}): issue them together")
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise TlsConfigError(f"the node certificate {identity.cert} ({SERVER_CERT}) is not signed by the CA "
                             f"{identity.ca_cert} ({CA_CERT}): issue it from this cluster's CA (`dcpserve tls node "
                             "--ca ...`)") from None


def check_env(env: Mapping[str, str]) -> Identity | None:
    """Identity.from_env and check_identity: the check every node and driver runs before it starts or joins."""
    identity = Identity.from_env(env)
    if identity is not None:
        check_identity(identity)
    return identity


@dataclass(frozen=True)
class ClusterTls:
    """The TLS directory of one cluster that dcpserve starts: its CA and the identities issued from it."""

    ca: ClusterCa

    @classmethod
    def fresh(cls, directory: Path) -> ClusterTls:
        """A new CA in directory, after removing whatever an earlier cluster left there: never reused."""
        if directory.exists():
            shutil.rmtree(directory)
        return cls(ClusterCa.create(directory))

    @property
    def directory(self) -> Path:
        return self.ca.directory

    def identity(self, name: str, addresses: Iterable[str] = ()) -> Identity:
        """The identity `name` (issued now, the first time it is asked for)."""
        out = self.directory / name
        existing = Identity(out / "node.crt", out / "node.key", self.ca.cert)
        if existing.cert.is_file() and existing.key.is_file():
            return existing
        return self.ca.issue(out, name, addresses)
