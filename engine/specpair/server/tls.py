"""TLS for the engine's listeners: the serving ports' files and the control port's, re-read on rotation.

The certificates come from a Kubernetes Secret volume, which the kubelet updates by swapping a
symlink: new contents appear under the same paths, all at once, without the server being told;
the operator renews the engine certificate in place, so no listener may need a restart to take it.
One mechanism serves every listener (`ReloadingTLS`): gRPC asks `fetch` before every new
connection's handshake, and answers a new configuration when the files' bytes changed, None (keep
the current one) otherwise; the HTTP front's `ssl.SSLContext` (`ssl_context`) asks the same check
from its SNI callback, which OpenSSL runs on every ClientHello (with or without a server name),
and hands the handshake the context of the newest whole files. Existing connections keep the
certificate they were opened with.

The control port (`--control-port`) requires mutual TLS (a client CA); the serving ports use it
only when given `--tls-client-ca`.
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass

import grpc

log = logging.getLogger("specpair.server")

DEFAULT_CONTROL_CLIENT_NAMES = ("specpair-operator",)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class TLSFiles:
    cert: str
    key: str
    client_ca: str | None = None     # set: clients must present a certificate it signed (mTLS)


class ReloadingTLS:
    """Server credentials (mutual TLS when the files name a client CA) re-read when their contents change.

    A change is taken only once it is whole: the key must match the certificate, the client CA
    (if any) must hold a certificate, and a second read must give the same bytes (the files are
    read one after the other, and a swap can fall between two reads). Anything else (a file
    missing for a moment, a certificate written before its key) keeps the last good
    configuration, logged once per distinct state, and is tried again at the next connection.
    """

    def __init__(self, files: TLSFiles, label: str = "control TLS"):
        """label: names the listener in errors and logs ("control TLS", "serving TLS")."""
        self.files = files
        self.label = label
        self._lock = threading.Lock()        # gRPC may call fetch from several threads at once
        contents = self._read_all()
        problem, context = self._check(contents)
        if problem:
            raise ValueError(f"{label} {self._names()}: {problem}")
        self._current = contents
        self._context = context              # built from self._current's files (the HTTP front's)
        self._last_problem: str | None = None
        self.reloads = 0                     # configurations taken after the first (tests, logs)

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC credentials that ask `fetch` before every handshake."""
        return grpc.dynamic_ssl_server_credentials(self._configuration(self._current), self.fetch,
                                                   require_client_authentication=bool(self.files.client_ca))

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: a new configuration, or None for no change."""
        return self._configuration(self._current) if self._refresh() else None

    def ssl_context(self) -> ssl.SSLContext:
        """A server SSLContext (the HTTP front's) whose handshakes use the newest whole files.

        Its SNI callback runs `_refresh` on every ClientHello and moves the handshake onto the
        context built from the files in use; `sni_callback` is the one hook OpenSSL offers
        between a connection's arrival and the choice of its certificate.
        """
        listener = self._context

        def choose(connection, _server_name, _context):
            self._refresh()
            current = self._context
            if connection.context is not current:
                connection.context = current
            return None
        listener.sni_callback = choose
        return listener

    def _refresh(self) -> bool:
        """Take the files' contents if they changed and are whole: True when they were taken."""
        with self._lock:
            try:
                contents = self._read_all()
            except OSError as exc:
                self._report(f"cannot read ({exc}); keeping the certificates in use")
                return False
            if contents == self._current:
                self._last_problem = None
                return False
            problem, context = self._check(contents)
            if problem is None:
                try:
                    if self._read_all() != contents:
                        problem = "the files changed while being read"
                except OSError as exc:
                    problem = f"cannot read ({exc})"
            if problem:
                self._report(f"{problem}; keeping the certificates in use until the files are whole")
                return False
            self._current, self._context = contents, context
            self._last_problem = None
            self.reloads += 1
            log.warning("%s: %s changed; new connections use them", self.label, self._names())
            return True

    def _names(self) -> str:
        return " / ".join(path for path in (self.files.cert, self.files.key, self.files.client_ca) if path)

    def _read_all(self) -> tuple[bytes, bytes, bytes | None]:
        ca = _read(self.files.client_ca) if self.files.client_ca else None
        return _read(self.files.cert), _read(self.files.key), ca

    def _check(self, contents: tuple[bytes, bytes, bytes | None]) -> tuple[str | None, ssl.SSLContext | None]:
        """Why these bytes cannot serve (None: they can), and the server SSLContext they make.
        OpenSSL, as gRPC's BoringSSL would."""
        cert, key, ca = contents
        if not (cert.strip() and key.strip() and (ca is None or ca.strip())):
            return "a file is empty", None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            if ca is not None:
                context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
                context.verify_mode = ssl.CERT_REQUIRED
            # load_cert_chain reads paths only; the second read in _refresh checks they still
            # hold these bytes. It also checks that the key belongs to the certificate.
            context.load_cert_chain(self.files.cert, self.files.key)
        except (ssl.SSLError, OSError, ValueError) as exc:
            what = "certificate, key and CA" if ca is not None else "certificate and key"
            return f"not a usable {what} ({exc})", None
        return None, context

    def _report(self, problem: str) -> None:
        # Once per distinct state: the check runs before every handshake.
        if problem != self._last_problem:
            log.error("%s: %s: %s", self.label, self._names(), problem)
            self._last_problem = problem

    @staticmethod
    def _configuration(contents: tuple[bytes, bytes, bytes | None]) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = contents
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


def peer_common_names(context) -> list[str]:
    """The common names of the peer's client certificate, as TLS verified it ([] without one).

    gRPC puts `x509_common_name` in the auth context only for a certificate the handshake
    accepted: every listener that asks for client certificates here also requires them to chain
    to its client CA (no request-but-don't-verify mode is ever configured).
    """
    auth = context.auth_context() or {}
    return [value.decode("utf-8", "replace") for value in auth.get("x509_common_name", ())]
