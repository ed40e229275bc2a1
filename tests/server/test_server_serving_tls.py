"""TLS on the serving ports: gRPC and HTTP from one certificate and key, a certificate renewed in
place taken without a restart. Real servers over 127.0.0.1, the official `openai` client, real
certificates (cryptography) in a Secret volume laid out as the kubelet lays it out."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import grpc
import pytest

from serving_helpers import client_for, make_engine, rpc_error
from pki import CA, SERVER_NAME, Issued, SecretVolume, write
from specpair.server.app import EngineServer, ServerOptions
from specpair.server.tls import TLSFiles

x509 = pytest.importorskip("cryptography.x509")
openai = pytest.importorskip("openai")

TIMEOUT = 10.0


def engine_secret(ca: CA, issued: Issued) -> dict[str, bytes]:
    """The engine's Secret as the operator writes it (tls.crt, tls.key, ca.crt)."""
    return {"tls.crt": issued.cert, "tls.key": issued.key, "ca.crt": ca.cert}


def serial(pem_or_der: bytes) -> int:
    if pem_or_der.startswith(b"-----"):
        return x509.load_pem_x509_certificate(pem_or_der).serial_number
    return x509.load_der_x509_certificate(pem_or_der).serial_number


def served_serial(port: int, ca: CA, alpn: list[str] | None = None) -> int:
    """The serial number of the certificate a new TLS connection to the port is shown (verified)."""
    context = ssl.create_default_context(cadata=ca.cert.decode())
    if alpn:
        context.set_alpn_protocols(alpn)
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw:
        with context.wrap_socket(raw, server_hostname=SERVER_NAME) as tls:
            return serial(tls.getpeercert(binary_form=True))


def https_client(server: EngineServer, folder: Path, ca: CA, scheme: str = "https"):
    """The official client, trusting `ca` only (httpx's verify=, as a client of the Service would)."""
    verify = ssl.create_default_context(cafile=write(folder, "ca.crt", ca.cert))
    return openai.OpenAI(base_url=f"{scheme}://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0,
                         timeout=60, http_client=openai.DefaultHttpx2Client(verify=verify))


def completes(server, folder: Path, ca: CA) -> bool:
    with https_client(server, folder, ca) as c:
        reply = c.completions.create(model="tiny", prompt="def foo(x):", max_tokens=3)
    return reply.usage.completion_tokens == 3


def grpc_completes(server, folder: Path, ca: CA) -> bool:
    with client_for(server, insecure=False, ca=write(folder, "grpc-ca.crt", ca.cert), server_name=SERVER_NAME) as c:
        return c.generate("hi", max_new_tokens=3, timeout=TIMEOUT).last.usage.completion_tokens == 3


@pytest.fixture
def tls_server(tiny_pair, start_server, tmp_path):
    ca = CA("specpair-ca")
    first = ca.issue("engine", server=True)
    volume = SecretVolume(tmp_path / "tls", engine_secret(ca, first))
    server = start_server(engine=make_engine(tiny_pair), host="127.0.0.1", http_port=0,
                          tls=TLSFiles(cert=str(volume.root / "tls.crt"), key=str(volume.root / "tls.key")))
    return server, volume, ca, first


def test_both_serving_ports_speak_tls_and_refuse_plaintext(tls_server, tmp_path):
    server, _, ca, first = tls_server
    assert completes(server, tmp_path / "https", ca)
    assert grpc_completes(server, tmp_path / "grpc", ca)

    # Plaintext to a TLS port: the HTTP request finds no HTTP server, the gRPC call no channel.
    with https_client(server, tmp_path / "http", ca, scheme="http") as plain:
        with pytest.raises(openai.APIConnectionError):
            plain.completions.create(model="tiny", prompt="def foo(x):", max_tokens=3)
    with client_for(server) as plain:
        assert rpc_error(lambda: plain.generate("hi", max_new_tokens=2, timeout=3)).code() == \
            grpc.StatusCode.UNAVAILABLE
    # A client that does not trust the engine's CA stops at the handshake.
    with pytest.raises(openai.APIConnectionError):
        completes(server, tmp_path / "stranger", CA("someone-else"))
    assert served_serial(server.http_port, ca) == serial(first.cert)


def test_a_renewed_certificate_is_served_without_a_restart(tls_server, tmp_path):
    server, volume, ca, first = tls_server
    assert served_serial(server.http_port, ca) == serial(first.cert)
    assert served_serial(server.port, ca, alpn=["h2"]) == serial(first.cert)

    # Half an update (the new certificate with the old key): kept out, the old pair serves on.
    renewed = ca.issue("engine", server=True)
    volume.update(engine_secret(ca, Issued(renewed.cert, first.key)))
    assert served_serial(server.http_port, ca) == serial(first.cert)
    assert served_serial(server.port, ca, alpn=["h2"]) == serial(first.cert)

    # The operator's renewal: same CA, a new certificate and key, swapped in by the kubelet.
    volume.update(engine_secret(ca, renewed))
    assert served_serial(server.http_port, ca) == serial(renewed.cert)
    assert served_serial(server.port, ca, alpn=["h2"]) == serial(renewed.cert)
    assert completes(server, tmp_path / "https", ca)
    assert grpc_completes(server, tmp_path / "grpc", ca)
    assert server.phase == "serving"


def test_a_client_ca_makes_the_http_port_mutual_tls_too(tiny_pair, start_server, tmp_path):
    ca = CA("specpair-ca")
    issued = ca.issue("engine", server=True)
    folder = tmp_path / "tls"
    server = start_server(engine=make_engine(tiny_pair), host="127.0.0.1", http_port=0, tls=TLSFiles(
        cert=write(folder, "tls.crt", issued.cert), key=write(folder, "tls.key", issued.key),
        client_ca=write(folder, "ca.crt", ca.cert)))
    with pytest.raises(openai.APIConnectionError):                 # no client certificate
        completes(server, tmp_path / "anonymous", ca)
    client = ca.issue("client")
    verify = ssl.create_default_context(cafile=write(tmp_path / "c", "ca.crt", ca.cert))
    verify.load_cert_chain(write(tmp_path / "c", "client.crt", client.cert), write(tmp_path / "c", "client.key",
                                                                                   client.key))
    with openai.OpenAI(base_url=f"https://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0,
                       timeout=60, http_client=openai.DefaultHttpx2Client(verify=verify)) as c:
        assert c.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_unusable_serving_files_stop_the_start(tiny_pair, tmp_path):
    ca = CA("specpair-ca")
    one, other = ca.issue("engine", server=True), ca.issue("engine", server=True)
    folder = tmp_path / "tls"
    server = EngineServer(lambda: make_engine(tiny_pair), ServerOptions(
        port=0, metrics_port=None, http_port=0,
        tls=TLSFiles(cert=write(folder, "tls.crt", one.cert), key=write(folder, "tls.key", other.key))),
        progress=lambda _m: None)
    with pytest.raises(RuntimeError, match=r"serving TLS .*tls.crt / .*tls.key: not a usable certificate and key"):
        server.start()


def test_health_answers_over_https_without_a_token_as_the_kubelets_probe_asks(tiny_pair, start_server, tmp_path):
    """The operator's probes with rollout.tls: the kubelet's HTTPS GET of /health, which verifies
    no certificate and carries no token, sees 200 once the models are loaded."""
    import json
    import urllib.request

    ca = CA("specpair-ca")
    issued = ca.issue("engine", server=True)
    folder = tmp_path / "tls"
    server = start_server(engine=make_engine(tiny_pair), host="127.0.0.1", http_port=0, auth_token="s3cret",
                          tls=TLSFiles(cert=write(folder, "tls.crt", issued.cert),
                                       key=write(folder, "tls.key", issued.key)))
    kubelet = ssl._create_unverified_context()
    with urllib.request.urlopen(f"https://127.0.0.1:{server.http_port}/health", context=kubelet, timeout=TIMEOUT) as r:
        assert r.status == 200 and json.load(r)["status"] == "serving"
    with https_client(server, tmp_path / "client", ca) as c:          # the API itself still wants the token
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
