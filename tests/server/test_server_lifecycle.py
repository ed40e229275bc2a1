"""Health, reflection, graceful shutdown and TLS on a real server."""

import datetime
import ipaddress
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specpair.server.app import TLSFiles
from specpair.server.client import request

from serving_helpers import client_for, make_engine, openai_client, rpc_error, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_status(server, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_not_serving_until_loaded_and_warm_then_serving(tiny_pair, start_server):
    release = threading.Event()
    engine = make_engine(tiny_pair, peaks=(steps := []))

    def slow_load():
        release.wait(30)
        return engine
    server = start_server(load=slow_load, wait=False)
    assert health_status(server) == NOT_SERVING
    assert health_status(server, "specpair.engine.v1.Engine") == NOT_SERVING
    with client_for(server) as c:
        err = rpc_error(lambda: c.generate("hi", max_new_tokens=2, timeout=5))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.details()
        release.set()
        server.wait_ready(30)
        assert steps, "the warm-up step must run before SERVING"
        assert health_status(server) == SERVING
        assert health_status(server, "specpair.engine.v1.Engine") == SERVING
        assert c.generate("hi", max_new_tokens=2).last.usage.completion_tokens == 2


def test_failed_load_stays_not_serving_and_says_why(start_server):
    def broken():
        raise RuntimeError("no such model")
    server = start_server(load=broken, wait=False)
    with pytest.raises(RuntimeError, match="no such model"):
        server.wait_ready(10)
    assert health_status(server) == NOT_SERVING
    with client_for(server) as c:
        err = rpc_error(lambda: c.model_info())
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "no such model" in err.details()


def test_graceful_shutdown_drains_in_flight_streams(tiny_pair, start_server):
    server = start_server(engine=make_engine(tiny_pair, delay=0.02))
    port = server.port
    with client_for(server) as c:
        stream = c.stream(request("def foo(x):", max_new_tokens=40))
        first = next(stream)
        stopped: list[dict] = []
        stopper = threading.Thread(target=lambda: stopped.append(server.stop(drain_timeout=20)))
        stopper.start()
        assert wait_for(lambda: server.phase == "draining")
        assert health_status(server) == NOT_SERVING       # load balancers stop sending traffic
        err = rpc_error(lambda: c.generate("import os", max_new_tokens=2, timeout=5))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details()
        rest = list(stream)                                 # the in-flight stream runs to its end
        stopper.join(30)
    assert rest[-1].usage.completion_tokens == 40
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 40
    assert server.phase == "stopped"
    assert stopped == [{"drained": 1, "aborted": 0}]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=0.5)


def test_replies_count_as_in_flight_until_they_end_on_both_protocols(tiny_pair, start_server):
    """What a drain waits for and reports: admitted requests whose replies have not ended, however
    they end (sent, the client gone, the queue full), on gRPC and HTTP alike."""
    server = start_server(engine=make_engine(tiny_pair, delay=0.02), http_port=0, max_batch_size=1, max_queue=1)
    admission = server._service.admission
    with client_for(server) as c:
        assert c.generate("def foo(x):", max_new_tokens=3).last.usage.completion_tokens == 3
        assert admission.replying == 0
        running = c.stream(request("def foo(x):", max_new_tokens=400))
        next(running)
        queued = c.stream(request("import os", max_new_tokens=2))
        assert wait_for(lambda: server.worker.waiting == 1)
        assert rpc_error(lambda: c.generate("x", max_new_tokens=2)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert admission.replying == 2
        running.cancel()                                    # the client leaves mid-stream
        assert sum(len(m.token_ids) for m in queued) == 2
        assert wait_for(lambda: admission.replying == 0)
    http = openai_client(server)
    assert http.completions.create(model="tiny", prompt="def foo(x):", max_tokens=3, temperature=0).usage.completion_tokens == 3
    streamed = http.completions.create(model="tiny", prompt="def foo(x):", max_tokens=400, temperature=0, stream=True)
    next(iter(streamed))
    assert admission.replying == 1
    streamed.close()                                        # an HTTP client leaving mid-stream
    assert wait_for(lambda: admission.replying == 0)
    assert server.stop() == {"drained": 0, "aborted": 0}


def test_drain_timeout_ends_streams_with_a_clear_status(tiny_pair, start_server):
    server = start_server(engine=make_engine(tiny_pair, delay=0.02), max_batch_size=1, max_queue=2)
    with client_for(server) as c:
        running = c.stream(request("def foo(x):", max_new_tokens=400))
        next(running)
        queued = c.stream(request("import os", max_new_tokens=400))
        assert wait_for(lambda: server.worker.waiting == 1)
        started = time.monotonic()
        result = server.stop(drain_timeout=0.3)
        # Not the two 400-token requests run out (batch 1, 20 ms a token: 16 s and more).
        assert time.monotonic() - started < 12
        assert result == {"drained": 0, "aborted": 2}
        for stream in (running, queued):
            err = rpc_error(lambda: list(stream))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "drain timeout of 0.3 s expired" in err.details()


def test_reflection_lists_the_engine_and_health_services(shared_server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    with grpc.insecure_channel(f"127.0.0.1:{shared_server.port}") as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"specpair.engine.v1.Engine", "grpc.health.v1.Health"} <= services
        from google.protobuf.descriptor_pool import DescriptorPool
        pool = DescriptorPool(db)
        method = pool.FindServiceByName("specpair.engine.v1.Engine").methods_by_name["Generate"]
        assert method.server_streaming and method.output_type.full_name == "specpair.engine.v1.GenerateResponse"


# -- TLS ---------------------------------------------------------------------------------------------

def _certificates(tmp_path):
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all PEM files."""
    try:
        import cryptography  # noqa: F401  (mlflow depends on it, so it is normally there)
    except ImportError:
        return _certificates_openssl(tmp_path)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def make(name, issuer=None, issuer_key=None, ca=False, san=None, usage=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(issuer.subject if issuer else subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return cert, key, str(cert_path), str(key_path)

    ca, ca_key, ca_file, _ = make("specpair-test-ca", ca=True)
    _, _, server_crt, server_key = make("engine", ca, ca_key, san=[
        x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        usage=ExtendedKeyUsageOID.SERVER_AUTH)
    _, _, client_crt, client_key = make("operator", ca, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return ca_file, (server_crt, server_key), (client_crt, client_key)


def _certificates_openssl(tmp_path):
    import shutil
    import subprocess
    if not shutil.which("openssl"):
        pytest.skip("neither the cryptography package nor the openssl CLI is available")

    def sh(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)
    sh("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
       "-subj", "/CN=specpair-test-ca", "-keyout", "ca.key", "-out", "ca.crt")
    for name, ext in (("engine", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                      ("operator", "extendedKeyUsage=clientAuth")):
        (tmp_path / f"{name}.ext").write_text(ext + "\n")
        sh("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
           "-keyout", f"{name}.key", "-out", f"{name}.csr")
        sh("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
           "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.crt")
    path = lambda name: str(tmp_path / name)  # noqa: E731
    return path("ca.crt"), (path("engine.crt"), path("engine.key")), (path("operator.crt"), path("operator.key"))


@pytest.mark.parametrize("make_certificates", [_certificates, _certificates_openssl], ids=["cryptography", "openssl"])
def test_tls_and_mutual_tls(tiny_pair, start_server, tmp_path, make_certificates):
    ca, (server_crt, server_key), (client_crt, client_key) = make_certificates(tmp_path)
    tls_server = start_server(engine=make_engine(tiny_pair), tls=TLSFiles(cert=server_crt, key=server_key))
    with client_for(tls_server, insecure=False, ca=ca) as c:
        assert c.generate("hi", max_new_tokens=3, timeout=10).last.usage.completion_tokens == 3
    with client_for(tls_server) as plain:                    # plaintext client, TLS server
        assert rpc_error(lambda: plain.generate("hi", max_new_tokens=2, timeout=3)).code() == \
            grpc.StatusCode.UNAVAILABLE

    mtls_server = start_server(engine=make_engine(tiny_pair),
                               tls=TLSFiles(cert=server_crt, key=server_key, client_ca=ca))
    with client_for(mtls_server, insecure=False, ca=ca, cert=client_crt, key=client_key) as c:
        assert c.generate("hi", max_new_tokens=3, timeout=10).last.usage.completion_tokens == 3
    with client_for(mtls_server, insecure=False, ca=ca) as anonymous:    # no client certificate
        assert rpc_error(lambda: anonymous.generate("hi", max_new_tokens=2, timeout=3)).code() == \
            grpc.StatusCode.UNAVAILABLE


def test_a_port_in_use_is_a_clear_start_error(tiny_pair, shared_server):
    from specpair.server.app import EngineServer, ServerOptions
    server = EngineServer(lambda: make_engine(tiny_pair), ServerOptions(port=shared_server.port, metrics_port=0),
                          progress=lambda _m: None)
    with pytest.raises(RuntimeError, match=f"did not start on 127.0.0.1:{shared_server.port}"):
        server.start()
    assert server._metrics_httpd is None      # nothing left listening
    assert server.stop() == {"drained": 0, "aborted": 0}
