"""The control listener: a second gRPC port with mutual TLS, certificates rotated in place, and
SetSpeculation only for the operator's client certificate. Real gRPC over 127.0.0.1, real
certificates (cryptography), a Secret volume laid out as the kubelet lays it out."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tiny_models import save_tiny

from serving_helpers import client_for, make_engine, rpc_error
from pki import CA, OPERATOR, SERVER_NAME, Authority, Issued, SecretVolume, write
from specpair.server.app import EngineServer, ServerOptions
from specpair.server.cli import main as engine_main
from specpair.server.client import EngineClient
from specpair.server.tls import TLSFiles

RPC_TIMEOUT = 10.0
# A refused handshake fails the call at once (UNAVAILABLE); the deadline only bounds a hang.
REFUSED_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two authorities: the engine's, and another whose certificates the engine must refuse."""
    root = tmp_path_factory.mktemp("pki")
    first, other = Authority.new("specpair-ca-1"), Authority.new("specpair-ca-2")
    return root, first, other


def control_client(server: EngineServer, folder: Path, trust: CA, identity: Issued | None) -> EngineClient:
    """A client of the control port that trusts `trust` and shows `identity` (None: no certificate)."""
    folder.mkdir(parents=True, exist_ok=True)
    options = dict(insecure=False, ca=write(folder, "ca.crt", trust.cert), server_name=SERVER_NAME)
    if identity is not None:
        options.update(cert=write(folder, "client.crt", identity.cert), key=write(folder, "client.key", identity.key))
    return EngineClient(f"127.0.0.1:{server.control_port}", **options)


def speculation_enabled(c: EngineClient) -> bool:
    return c.model_info(timeout=RPC_TIMEOUT).speculation.enabled


def denied_total(server) -> float:
    return server.metrics.control_denied.labels("tiny", "1", "specpair", "SetSpeculation")._value.get()


@pytest.fixture
def control_server(tiny_pair, start_server, pki, tmp_path):
    root, first, _ = pki
    volume = SecretVolume(tmp_path / "tls", first.secret())
    server = start_server(engine=make_engine(tiny_pair), host="127.0.0.1", control_port=0,
                          control_tls=volume.tls_files())
    assert server.control_port and server.control_port != server.port
    return server, volume


# -- who may connect --------------------------------------------------------------------------------

def test_control_port_requires_a_client_certificate_from_its_ca(control_server, pki, tmp_path):
    server, _ = control_server
    _, first, other = pki
    with grpc.insecure_channel(f"127.0.0.1:{server.control_port}") as plain:     # plaintext
        stub = health_pb2_grpc.HealthStub(plain)
        err = rpc_error(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=REFUSED_TIMEOUT))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    with control_client(server, tmp_path / "anonymous", first.ca, None) as anonymous:    # TLS, no certificate
        assert rpc_error(lambda: anonymous.model_info(timeout=REFUSED_TIMEOUT)).code() == \
            grpc.StatusCode.UNAVAILABLE
    # The operator's name, but signed by another CA (the client trusts the engine's CA, so only
    # the server's check of the client certificate can refuse it).
    with control_client(server, tmp_path / "foreign", first.ca, other.operator) as foreign:
        assert rpc_error(lambda: foreign.model_info(timeout=REFUSED_TIMEOUT)).code() == \
            grpc.StatusCode.UNAVAILABLE
    with control_client(server, tmp_path / "operator", first.ca, first.operator) as operator:
        assert operator.model_info(timeout=RPC_TIMEOUT).pair == "tiny"
        health = health_pb2_grpc.HealthStub(operator.channel).Check(
            health_pb2.HealthCheckRequest(service="specpair.engine.v1.Engine"), timeout=RPC_TIMEOUT)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


# -- who may call SetSpeculation ----------------------------------------------------------------------

def test_the_operator_turns_speculation_off_over_the_control_port(control_server, pki, tmp_path):
    server, _ = control_server
    _, first, _ = pki
    with control_client(server, tmp_path / "operator", first.ca, first.operator) as operator, \
            client_for(server) as main:
        assert speculation_enabled(operator) and speculation_enabled(main)
        assert operator.stats(timeout=RPC_TIMEOUT).speculation.enabled
        # Generate is open on both listeners.
        assert operator.generate("def foo(x):", max_new_tokens=6, timeout=RPC_TIMEOUT).last.stats.num_draft_tokens > 0
        settings = operator.set_speculation(enabled=False, reason="acceptance drift", timeout=RPC_TIMEOUT)
        assert not settings.enabled
        stats = operator.stats(timeout=RPC_TIMEOUT)
        assert not stats.speculation.enabled and not stats.speculating
        assert not speculation_enabled(operator) and not speculation_enabled(main)
        off = main.generate("def foo(x):", max_new_tokens=6, timeout=RPC_TIMEOUT)
        assert off.last.stats.num_draft_tokens == 0
    assert denied_total(server) == 0


def test_set_speculation_is_refused_without_the_operator_certificate(control_server, pki, tmp_path):
    server, _ = control_server
    _, first, _ = pki
    with client_for(server) as main, \
            control_client(server, tmp_path / "someone-else", first.ca, first.someone_else) as someone_else:
        # The main (plaintext) port: no certificate at all.
        err = rpc_error(lambda: main.set_speculation(enabled=False, k=3, timeout=RPC_TIMEOUT))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "client certificate on the control port" in err.details()
        # Refused before the request is read: bytes that are no request get the same answer.
        raw = main.channel.unary_unary("/specpair.engine.v1.Engine/SetSpeculation")
        assert rpc_error(lambda: raw(b"\xff\xff\xff", timeout=RPC_TIMEOUT)).code() == \
            grpc.StatusCode.PERMISSION_DENIED
        # The right CA, so the connection is accepted, but not the operator's name.
        assert someone_else.model_info(timeout=RPC_TIMEOUT).speculation.enabled      # reads are open
        err = rpc_error(lambda: someone_else.set_speculation(enabled=False, timeout=RPC_TIMEOUT))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "'someone-else'" in err.details()
        info = main.model_info(timeout=RPC_TIMEOUT)
    assert info.speculation.enabled and not info.speculation.HasField("k_override")     # nothing changed
    assert denied_total(server) == 3


def test_a_client_ca_on_the_main_port_restricts_set_speculation_too(tiny_pair, start_server, pki, tmp_path):
    _, first, _ = pki
    folder = tmp_path / "main-tls"
    server = start_server(engine=make_engine(tiny_pair), host="127.0.0.1", tls=TLSFiles(
        cert=write(folder, "tls.crt", first.server.cert), key=write(folder, "tls.key", first.server.key),
        client_ca=write(folder, "ca.crt", first.ca.cert)))
    assert server.control_port is None

    def client(name, identity):
        return client_for(server, insecure=False, ca=str(folder / "ca.crt"), server_name=SERVER_NAME,
                          cert=write(tmp_path / name, "c.crt", identity.cert),
                          key=write(tmp_path / name, "c.key", identity.key))
    with client("other", first.someone_else) as someone_else, client("operator", first.operator) as operator:
        assert rpc_error(lambda: someone_else.set_speculation(enabled=False, timeout=RPC_TIMEOUT)).code() == \
            grpc.StatusCode.PERMISSION_DENIED
        assert speculation_enabled(operator)
        assert not operator.set_speculation(enabled=False, timeout=RPC_TIMEOUT).enabled
        assert not speculation_enabled(someone_else)


def test_named_clients_replace_the_default(tiny_pair, start_server, pki, tmp_path):
    _, first, _ = pki
    volume = SecretVolume(tmp_path / "tls", first.secret())
    server = start_server(engine=make_engine(tiny_pair), host="127.0.0.1", control_port=0,
                          control_tls=volume.tls_files(), control_client_names=("someone-else",))
    with control_client(server, tmp_path / "op", first.ca, first.operator) as operator, \
            control_client(server, tmp_path / "se", first.ca, first.someone_else) as someone_else:
        assert rpc_error(lambda: operator.set_speculation(enabled=False, timeout=RPC_TIMEOUT)).code() == \
            grpc.StatusCode.PERMISSION_DENIED
        assert not someone_else.set_speculation(enabled=False, timeout=RPC_TIMEOUT).enabled


# -- rotation -------------------------------------------------------------------------------------------

def test_rotated_certificates_are_used_without_a_restart(control_server, pki, tmp_path):
    server, volume = control_server
    _, first, _ = pki
    second = Authority.new("specpair-ca-rotated")

    def works(trust, identity, name) -> bool:
        with control_client(server, tmp_path / name, trust, identity) as c:
            try:
                return c.model_info(timeout=REFUSED_TIMEOUT).pair == "tiny"
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                return False

    assert works(first.ca, first.operator, "before")

    # Half an update: the new certificate with the old key. Kept out; the old files serve on.
    volume.update(dict(first.secret(), **{"tls.crt": second.server.cert}))
    assert works(first.ca, first.operator, "half-written")
    # A moment with a file missing (its symlink dangles): the same.
    volume.update({"tls.crt": first.server.cert, "tls.key": first.server.key})
    assert works(first.ca, first.operator, "unreadable")
    assert server.control_tls.reloads == 0

    volume.update(second.secret())
    assert works(second.ca, second.operator, "after")
    assert server.control_tls.reloads == 1
    assert not works(first.ca, first.operator, "old-client")          # trusts the old server certificate
    assert not works(second.ca, first.operator, "old-certificate")   # the server no longer trusts the old CA
    with control_client(server, tmp_path / "after-set", second.ca, second.operator) as operator:
        assert not operator.set_speculation(enabled=False, timeout=RPC_TIMEOUT).enabled
    assert server.phase == "serving"


# -- starting it ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    (["--control-port", "0"], "--control-port needs --control-tls-cert, --control-tls-key and --control-tls-client-ca"),
    (["--control-port", "0", "--control-tls-cert", "c", "--control-tls-key", "k"], "--control-port needs"),
    (["--control-tls-cert", "c", "--control-tls-key", "k", "--control-tls-client-ca", "a"],
     "need --control-port"),
    (["--control-tls-client-ca", "a"], "need --control-port"),
    (["--control-client-name", "ops"], "--control-client-name needs --control-port or --tls-client-ca"),
    (["--port", "50061", "--control-port", "50061", "--control-tls-cert", "c", "--control-tls-key", "k",
      "--control-tls-client-ca", "a"], "--control-port 50061 is also --port"),
])
def test_bad_control_flags_are_clear_errors(capsys, extra, message):
    argv = ["engine", "serve", "--insecure", "--host", "127.0.0.1", "--metrics-port", "-1", "--target",
            "/nonexistent-model"] + extra
    assert engine_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unusable_control_files_stop_the_start(tiny_pair, pki, tmp_path):
    _, first, other = pki
    folder = tmp_path / "tls"
    files = TLSFiles(cert=write(folder, "tls.crt", first.server.cert), key=write(folder, "tls.key", other.server.key),
                     client_ca=write(folder, "ca.crt", first.ca.cert))
    server = EngineServer(lambda: make_engine(tiny_pair), ServerOptions(port=0, metrics_port=None, control_port=0,
                                                                       control_tls=files),
                          progress=lambda _m: None)
    with pytest.raises(RuntimeError, match=r"\(control port 0\): ValueError: control TLS .*tls.crt"):
        server.start()
    with pytest.raises(ValueError, match="client_ca"):       # a control port without a client CA
        EngineServer(lambda: None, ServerOptions(control_port=0, control_tls=TLSFiles("c", "k")))


@pytest.mark.slow
def test_serve_command_as_the_operator_starts_it(tiny_pair, pki, tmp_path):
    """`engine serve` with the operator's flags: the control port is reported, and answers the
    operator's certificate."""
    target, _ = tiny_pair
    _, first, _ = pki
    volume = SecretVolume(tmp_path / "tls", first.secret())
    cmd = [sys.executable, "-m", "specpair.server", "engine", "serve", "--target", save_tiny(target, tmp_path / "t"),
           "--drafter", "ngram", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--insecure",
           "--device", "cpu", "--control-port", "0", "--control-tls-cert", str(volume.root / "tls.crt"),
           "--control-tls-key", str(volume.root / "tls.key"), "--control-tls-client-ca", str(volume.root / "ca.crt"),
           "--control-client-name", OPERATOR]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()

    def wait_line(pattern: str, timeout: float = 90.0) -> re.Match:
        seen = []
        while True:
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in: {''.join(seen)}") from None
            seen.append(line)
            match = re.search(pattern, line)
            if match:
                return match
    try:
        listening = wait_line(r"gRPC listening on 127\.0\.0\.1:(\d+) \(plaintext\) and on 127\.0\.0\.1:(\d+) "
                              r"\(control: mutual TLS, SetSpeculation for specpair-operator\)")
        wait_line(r"serving on")
        port, control_port = int(listening.group(1)), int(listening.group(2))
        assert control_port not in (0, port)
        server = type("Ports", (), {"port": port, "control_port": control_port})()
        with control_client(server, tmp_path / "operator", first.ca, first.operator) as operator, \
                client_for(server) as main:
            assert rpc_error(lambda: main.set_speculation(enabled=False, timeout=RPC_TIMEOUT)).code() == \
                grpc.StatusCode.PERMISSION_DENIED
            assert speculation_enabled(main)
            assert not operator.set_speculation(enabled=False, timeout=RPC_TIMEOUT).enabled
            assert not speculation_enabled(main)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# -- the serving ports' bearer token ---------------------------------------------------------------------

def test_a_token_guards_the_grpc_serving_port_and_the_operator_certificate_passes(tiny_pair, start_server, pki,
                                                                                  tmp_path):
    _, first, _ = pki
    volume = SecretVolume(tmp_path / "tls", first.secret())
    server = start_server(engine=make_engine(tiny_pair), host="127.0.0.1", control_port=0,
                          control_tls=volume.tls_files(), auth_token="s3cret")
    calls = {"Generate": lambda c: c.generate("def foo(x):", max_new_tokens=3, timeout=RPC_TIMEOUT).text,
             "GetModelInfo": lambda c: c.model_info(timeout=RPC_TIMEOUT).pair,
             "GetStats": lambda c: c.stats(timeout=RPC_TIMEOUT).pair,
             "SetSpeculation": lambda c: c.set_speculation(k=2, timeout=RPC_TIMEOUT).k_override}
    with client_for(server) as anonymous, client_for(server, token="nope") as wrong:
        for name, call in calls.items():
            for c in (anonymous, wrong):
                err = rpc_error(lambda: call(c))
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, name
                assert "bearer token" in err.details()
        # Health stays open: kubelet probes carry no token.
        health = health_pb2_grpc.HealthStub(anonymous.channel).Check(health_pb2.HealthCheckRequest(),
                                                                     timeout=RPC_TIMEOUT)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with client_for(server, token="s3cret") as main:
        assert main.model_info(timeout=RPC_TIMEOUT).pair == "tiny" and main.stats(timeout=RPC_TIMEOUT).pair == "tiny"
        assert main.generate("def foo(x):", max_new_tokens=3, timeout=RPC_TIMEOUT).token_ids
        # The token lets a client in; only the operator's certificate may control the server.
        assert rpc_error(lambda: main.set_speculation(k=2, timeout=RPC_TIMEOUT)).code() == \
            grpc.StatusCode.PERMISSION_DENIED
    with control_client(server, tmp_path / "operator", first.ca, first.operator) as operator:
        assert operator.set_speculation(k=2, timeout=RPC_TIMEOUT).k_override == 2
        assert operator.stats(timeout=RPC_TIMEOUT).pair == "tiny"
    with control_client(server, tmp_path / "other", first.ca, first.someone_else) as other:
        assert rpc_error(lambda: other.stats(timeout=RPC_TIMEOUT)).code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_serving_token_never_reaches_set_speculation_without_client_certificates(tiny_pair, start_server):
    """No control port, no client CA, a token on the serving ports: the token's holder generates
    and reads, but SetSpeculation is refused to it (and to everyone), and nothing changes."""
    server = start_server(engine=make_engine(tiny_pair), host="127.0.0.1", auth_token="s3cret")
    with client_for(server, token="s3cret") as holder, client_for(server, token="nope") as wrong:
        assert holder.generate("def foo(x):", max_new_tokens=6, timeout=RPC_TIMEOUT).last.stats.num_draft_tokens > 0
        before = holder.model_info(timeout=RPC_TIMEOUT).speculation
        assert before.enabled and not before.HasField("k_override")
        for change in (dict(enabled=False), dict(k=2), dict(enabled=True, k=0)):
            err = rpc_error(lambda: holder.set_speculation(**change, reason="a client", timeout=RPC_TIMEOUT))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, change
            assert "bearer token, which is for clients" in err.details()
        assert denied_total(server) == 3
        # A wrong token is told so first, as on every RPC.
        assert rpc_error(lambda: wrong.set_speculation(enabled=False, timeout=RPC_TIMEOUT)).code() == \
            grpc.StatusCode.UNAUTHENTICATED
        after = holder.model_info(timeout=RPC_TIMEOUT).speculation
        assert after.enabled and not after.HasField("k_override")
        assert holder.generate("def foo(x):", max_new_tokens=6, timeout=RPC_TIMEOUT).last.stats.num_draft_tokens > 0


def test_without_token_or_certificates_set_speculation_stays_open(tiny_pair, start_server):
    """The laptop: nothing tells callers apart and nothing guards any RPC; control is open too."""
    server = start_server(engine=make_engine(tiny_pair), host="127.0.0.1")
    with client_for(server) as anyone:
        assert not anyone.set_speculation(enabled=False, timeout=RPC_TIMEOUT).enabled
        assert anyone.generate("def foo(x):", max_new_tokens=6, timeout=RPC_TIMEOUT).last.stats.num_draft_tokens == 0
    assert denied_total(server) == 0
