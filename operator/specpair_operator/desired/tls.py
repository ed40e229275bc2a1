"""Mutual TLS between the operator and engine pods: a CA, one server certificate per pair, and
the operator's own client certificate.

Engine pods listen for the operator on a control port (gRPC, mutual TLS) beside their serving
ports. The operator is its only client, and SetSpeculation is accepted only from a certificate
with the operator's common name (OPERATOR_NAME), so turning speculation off or on is an
authenticated call. With rollout.tls the serving ports (gRPC and HTTP) present the same pair
certificate to the pair's clients, who trust the Secret's ca.crt.

- The CA lives in a Secret in the operator's namespace (tls.crt, tls.key). A Secret that exists
  is used as it is: that is how cert-manager plugs in (a CA Certificate writing that Secret, see
  the chart's tls.certManager values). Otherwise the operator generates one and creates it; two
  replicas racing both end up reading the one that won.
- Each pair gets a Secret (tls.crt, tls.key, ca.crt) with the engine Service's DNS names, valid
  SERVER_DAYS and issued again when RENEW_DAYS remain or the CA changed. Engine pods re-read the
  mounted files when the kubelet updates them, so renewal restarts nothing.
- The operator's client certificate is kept in memory, issued again when it nears its end.

The functions here are pure (no I/O); state.py and reconciler.py read and write the Secrets.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from specpair_operator.crd.names import CA_SECRET  # noqa: F401 - tls.CA_SECRET, where the CA is issued

OPERATOR_NAME = "specpair-operator"       # the client certificate's CN; engines allow SetSpeculation to it
CA_DAYS = 3650
SERVER_DAYS = 90
RENEW_DAYS = 30                           # a server certificate is issued again with this much left
CLIENT_DAYS = 30
CLIENT_RENEW_DAYS = 10


@dataclass(frozen=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_ca(common_name: str = "specpair operator CA", now: dt.datetime | None = None) -> KeyPair:
    now = now or _now()
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def check_ca(ca: KeyPair) -> str:
    """'' when `ca` can sign certificates (a CA certificate whose key matches), else why not."""
    try:
        cert = x509.load_pem_x509_certificate(ca.cert_pem)
        key = serialization.load_pem_private_key(ca.key_pem, password=None)
    except ValueError as exc:
        return f"not a PEM certificate and key: {exc}"
    if cert.public_key().public_numbers() != key.public_key().public_numbers():
        return "the key does not belong to the certificate"
    try:
        if not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            return "the certificate is not a CA (basicConstraints ca=false)"
    except x509.ExtensionNotFound:
        return "the certificate is not a CA (no basicConstraints)"
    if cert.not_valid_after_utc <= _now():
        return f"the CA certificate expired on {cert.not_valid_after_utc.isoformat()}"
    return ""


def issue(ca: KeyPair, common_name: str, dns_names: tuple[str, ...] = (), *, server: bool,
          days: int, now: dt.datetime | None = None) -> KeyPair:
    """A leaf certificate signed by `ca`: for a server (its DNS names) or for a client."""
    now = now or _now()
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    key = _key()
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),  # type: ignore[arg-type]
                              critical=False))
    if dns_names:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]),
                                        critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def engine_dns_names(service: str, namespace: str) -> tuple[str, ...]:
    """The names an engine's certificate answers to: the Service's, as clients in the cluster
    dial it (rollout.tls serves this certificate on the serving ports). The operator dials pod
    IPs and checks the certificate against server_name() (gRPC's target-name override), not the IP."""
    return (f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local", f"{service}.{namespace}", service)


def server_name(service: str, namespace: str) -> str:
    return engine_dns_names(service, namespace)[0]


def fingerprint(cert_pem: bytes) -> str:
    """sha256 of the DER certificate: which CA (or certificate) a Secret was issued from."""
    return hashlib.sha256(x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)).hexdigest()


def reissue_reason(cert_pem: bytes | None, ca_pem_in_secret: bytes | None, ca: KeyPair,
                   dns_names: tuple[str, ...], now: dt.datetime | None = None,
                   renew_days: int = RENEW_DAYS) -> str:
    """Why an engine's certificate must be issued again ('' when it is good): missing, not
    readable, from another CA, for other names, or near its end."""
    now = now or _now()
    if not cert_pem or not ca_pem_in_secret:
        return "no certificate yet"
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        if fingerprint(ca_pem_in_secret) != fingerprint(ca.cert_pem):
            return "issued by another CA"
        ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError) as exc:
        return f"certificate not usable: {exc}"
    except Exception as exc:  # noqa: BLE001  (cryptography's InvalidSignature and friends)
        return f"certificate not signed by the CA: {type(exc).__name__}"
    try:
        names = tuple(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                      .get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        names = ()
    if set(names) != set(dns_names):
        return f"issued for {sorted(names)}, needs {sorted(dns_names)}"
    left = cert.not_valid_after_utc - now
    if left < dt.timedelta(days=renew_days):
        return f"expires {cert.not_valid_after_utc.isoformat()} ({left.days} days left)"
    return ""


def not_after(cert_pem: bytes) -> dt.datetime:
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc
