"""TLS for the engine's gRPC listeners: the main port's files, and the control port's, re-read on rotation.

The control port (`--control-port`) requires mutual TLS. Its certificate, key and client CA come
from a Kubernetes Secret volume, which the kubelet updates by swapping a symlink: new contents
appear under the same paths, all three at once, without the server being told. gRPC asks
`ReloadingTLS.fetch` before every new connection's handshake; it answers a new configuration
when the files' bytes changed, and None (keep the current one) otherwise. Existing connections
keep the certificate they were opened with.
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

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(self.client_ca) if self.client_ca else None,
            require_client_auth=bool(self.client_ca))


class ReloadingTLS:
    """Mutual-TLS server credentials whose files are re-read when their contents change.

    A change is taken only once it is whole: the key must match the certificate, the client CA
    must hold a certificate, and a second read must give the same bytes (the three files are
    read one after the other, and a swap can fall between two reads). Anything else (a file
    missing for a moment, a certificate written before its key) keeps the last good
    configuration, logged once per distinct state, and is tried again at the next connection.
    """

    def __init__(self, files: TLSFiles):
        if not files.client_ca:
            raise ValueError("the control port requires a client CA (mutual TLS)")
        self.files = files
        self._lock = threading.Lock()        # gRPC may call fetch from several threads at once
        contents = self._read_all()
        problem = self._problem(contents)
        if problem:
            raise ValueError(f"control TLS {files.cert} / {files.key} / {files.client_ca}: {problem}")
        self._current = contents
        self._last_problem: str | None = None
        self.reloads = 0                     # configurations taken after the first (tests, logs)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._configuration(self._current), self.fetch,
                                                   require_client_authentication=True)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each handshake: a new configuration, or None for no change."""
        with self._lock:
            try:
                contents = self._read_all()
            except OSError as exc:
                self._report(f"cannot read ({exc}); keeping the certificates in use")
                return None
            if contents == self._current:
                self._last_problem = None
                return None
            problem = self._problem(contents)
            if problem is None:
                try:
                    if self._read_all() != contents:
                        problem = "the files changed while being read"
                except OSError as exc:
                    problem = f"cannot read ({exc})"
            if problem:
                self._report(f"{problem}; keeping the certificates in use until the files are whole")
                return None
            self._current = contents
            self._last_problem = None
            self.reloads += 1
            log.warning("control TLS: %s, %s and %s changed; new connections use them",
                        self.files.cert, self.files.key, self.files.client_ca)
            return self._configuration(contents)

    def _read_all(self) -> tuple[bytes, bytes, bytes]:
        return _read(self.files.cert), _read(self.files.key), _read(self.files.client_ca)

    def _problem(self, contents: tuple[bytes, bytes, bytes]) -> str | None:
        """Why these bytes cannot serve (None: they can). OpenSSL, as gRPC's BoringSSL would."""
        cert, key, ca = contents
        if not (cert.strip() and key.strip() and ca.strip()):
            return "a file is empty"
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
            # load_cert_chain reads paths only; the second read in fetch checks they still hold
            # these bytes. It also checks that the key belongs to the certificate.
            context.load_cert_chain(self.files.cert, self.files.key)
        except (ssl.SSLError, OSError, ValueError) as exc:
            return f"not a usable certificate, key and CA ({exc})"
        return None

    def _report(self, problem: str) -> None:
        # Once per distinct state: fetch runs before every handshake.
        if problem != self._last_problem:
            log.error("control TLS: %s / %s / %s: %s", self.files.cert, self.files.key,
                      self.files.client_ca, problem)
            self._last_problem = problem

    @staticmethod
    def _configuration(contents: tuple[bytes, bytes, bytes]) -> grpc.ServerCertificateConfiguration:
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
