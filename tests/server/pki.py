"""Certificates for the TLS tests, made with `cryptography` as a cluster's issuer would make them, and a
Secret volume laid out as the kubelet lays it out (files behind an atomically swapped `..data`)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from specpair.server.tls import TLSFiles

SERVER_NAME = "engine.test.svc"
OPERATOR = "specpair-operator"


# -- certificates -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Issued:
    cert: bytes
    key: bytes


class CA:
    def __init__(self, name: str):
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._cert = self._build(self._name, self._key.public_key(), ca=True)
        self.cert = self._cert.public_bytes(serialization.Encoding.PEM)

    def _build(self, subject, public_key, *, ca=False, usage=None, hosts=()):
        now = dt.datetime.now(dt.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(self._name)
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if hosts:
            sans = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h) for h in hosts]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self._key, hashes.SHA256())

    def issue(self, common_name: str, *, server: bool = False) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        cert = self._build(subject, key.public_key(),
                           usage=ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH,
                           hosts=(SERVER_NAME, "127.0.0.1") if server else ())
        return Issued(cert.public_bytes(serialization.Encoding.PEM),
                      key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))


@dataclass(frozen=True)
class Authority:
    """One CA with what it issued: the engine's serving certificate and clients' certificates."""
    ca: CA
    server: Issued
    operator: Issued
    someone_else: Issued

    @classmethod
    def new(cls, name: str) -> "Authority":
        ca = CA(name)
        return cls(ca, ca.issue("engine", server=True), ca.issue(OPERATOR), ca.issue("someone-else"))

    def secret(self) -> dict[str, bytes]:
        """The engine's Secret: what the operator mounts at /etc/specpair/tls."""
        return {"tls.crt": self.server.cert, "tls.key": self.server.key, "ca.crt": self.ca.cert}


class SecretVolume:
    """A Secret volume as the kubelet writes it: files are symlinks into `..data`, itself a symlink
    to a timestamped directory; an update writes a new directory and renames a new `..data` over
    the old one (one atomic step for all files), then removes the old directory."""

    def __init__(self, root: Path, files: dict[str, bytes]):
        self.root, self.revision = root, 0
        root.mkdir(parents=True)
        self.update(files)
        for name in files:
            (root / name).symlink_to(f"..data/{name}")

    def update(self, files: dict[str, bytes]) -> None:
        old = (self.root / "..data").resolve() if (self.root / "..data").exists() else None
        self.revision += 1
        version = self.root / f"..2026_01_01_00_00_00.{self.revision:04d}"
        version.mkdir()
        for name, data in files.items():
            (version / name).write_bytes(data)
        (self.root / "..data_tmp").symlink_to(version.name)
        os.replace(self.root / "..data_tmp", self.root / "..data")
        if old is not None:
            shutil.rmtree(old)

    def tls_files(self) -> TLSFiles:
        return TLSFiles(cert=str(self.root / "tls.crt"), key=str(self.root / "tls.key"),
                        client_ca=str(self.root / "ca.crt"))


def write(folder: Path, name: str, data: bytes) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return str(folder / name)
