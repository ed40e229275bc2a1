"""Serving ports behind a token: `spec.rollout.auth.tokenSecretRef`, on the real control plane
with the real engine (tiny models, the project's engine image run by the devcluster node).

The operator mounts the Secret's key into the engine pods and passes `--auth-token-file`; the
pod becomes Ready (the gRPC health service needs no token) and the operator verifies what it
serves over its mutual-TLS control port. A request without the token is refused on both
serving ports; with it, it is answered. A vLLM engine takes the same Secret as vLLM's API key
(real vLLM behind it: tests/operator/test_operator_vllm.py).

`spec.rollout.tls.enabled` puts the pair's engine certificate (the operator's Secret, the control
port's) on both serving ports: the pod becomes Ready through the HTTPS /health probe, clients that
trust the Secret's ca.crt are answered over HTTPS and gRPC TLS, plaintext is refused.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from kopf.testing import KopfRunner

from cluster_env import CODE_PROMPTS, OPERATOR, engine_pods, serving, tiny_pair
from specpair_devcluster.client import ApiError
from specpair_operator.desired import tls as tls_mod
from specpair_operator.crd.validation import validate_spec
from specpair._proto import engine_pb2, engine_pb2_grpc
from specpair_operator.desired import engine_objects, manifests

TOKEN = "s3cret-" + uuid.uuid4().hex


def test_manifest_mounts_the_token_by_reference():
    rel = {"target": {"source": "t"}, "draft": {"drafter": "ngram"}, "speculation": {}, "gating": {}}
    dep = engine_objects.engine_deployment("p", "ns", rel, "d" * 64, "1",
                                      {"auth": {"tokenSecretRef": {"name": "serving-token", "key": "t"}}}, "http://m")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][-2:] == ["--auth-token-file", f"{manifests.AUTH_DIR}/token"]
    assert {"name": "auth", "mountPath": manifests.AUTH_DIR, "readOnly": True} in container["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "auth"]
    assert volume["secret"] == {"secretName": "serving-token", "defaultMode": 0o440,
                                "items": [{"key": "t", "path": "token"}]}
    plain = engine_objects.engine_deployment("p", "ns", rel, "d" * 64, "1", {}, "http://m")
    assert "--auth-token-file" not in plain["spec"]["template"]["spec"]["containers"][0]["command"]


def test_a_vllm_pair_takes_the_token_in_its_companion(operator_env, ns):
    """The API server admits rollout.auth for vLLM, and the pod's companion (in front of vLLM,
    which listens on a Unix socket) gets the token file from the Secret by reference, as our
    engine does; the token never appears in the Deployment."""
    created = ns.create({"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": "v"},
                         "spec": {"engine": "vllm", "target": {"source": "t"}, "draft": {"source": "d"},
                                  "rollout": {"auth": {"tokenSecretRef": {"name": "serving-token"}}}}})
    rollout = created["spec"]["rollout"]
    assert rollout["auth"] == {"tokenSecretRef": {"name": "serving-token", "key": "token"}}
    rel = {"target": {"source": "t"}, "draft": {"source": "d"}, "speculation": {}, "gating": {},
           "engine": {"kind": "vllm", "image": "x"}}
    pod = engine_objects.engine_deployment("v", "ns", rel, "d" * 64, "1", rollout, "http://m")["spec"]["template"]["spec"]
    vllm, companion = pod["containers"]
    assert companion["command"][companion["command"].index("--auth-token-file") + 1] == f"{manifests.AUTH_DIR}/token"
    assert {"name": "auth", "mountPath": manifests.AUTH_DIR, "readOnly": True} in companion["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "auth"]
    assert volume["secret"] == {"secretName": "serving-token", "defaultMode": 0o440,
                                "items": [{"key": "token", "path": "token"}]}
    assert not any(m["name"] == "auth" for m in vllm["volumeMounts"]) and "--api-key" not in vllm["command"]
    (_, plain) = engine_objects.engine_deployment("v", "ns", rel, "d" * 64, "1", {},
                                             "http://m")["spec"]["template"]["spec"]["containers"]
    assert "--auth-token-file" not in plain["command"]


def test_a_vllm_pods_companion_serves_https_with_the_pairs_certificate_and_checks_the_token(tmp_path):
    """rollout.tls and rollout.auth on a vLLM pair: the companion container's command exactly as
    the Deployment renders it (its paths moved under a temporary folder, its ports free ones),
    run in front of a real HTTP upstream streaming vLLM's captured reply on the pod's Unix socket
    (real vLLM behind the same companion: tests/engine/test_engine_vllm_peer.py). The official
    client trusting only the Secret's ca.crt streams through it over HTTPS with the token; the
    served certificate answers to the Service's name; the kubelet's probe (HTTPS, unverified,
    no token) reads /health; plaintext and a missing token are refused; a certificate the
    operator issues again is served to new connections without a restart."""
    import tempfile

    import openai
    import rendered_companion
    from cryptography import x509

    from specpair.vllm_companion_bench import ReplayServer
    from specpair.vllm_peer import free_port
    from specpair.vllm_serve import VLLM_SOCKET

    rollout = {"tls": {"enabled": True}, "auth": {"tokenSecretRef": {"name": "serving-token"}}}
    rel = {"pair": "v", "target": {"source": "t"}, "draft": {"source": "d"}, "speculation": {}, "gating": {},
           "engine": {"kind": "vllm", "image": "x"}, "mlflow": {"version": "4"}}
    pod = engine_objects.engine_deployment("v", "ns", rel, "d" * 64, "4", rollout, "http://m")["spec"]["template"]
    vllm, companion = pod["spec"]["containers"]
    for probe in ("startupProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"]["scheme"] == "HTTPS", vllm[probe]
    assert companion["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    assert engine_objects.engine_service("v", "ns", rollout, kind="vllm")["spec"]["ports"][0]["appProtocol"] == "https"
    plain = engine_objects.engine_deployment("v", "ns", rel, "d" * 64, "4", {}, "http://m")["spec"]["template"]
    assert "--tls-cert" not in plain["spec"]["containers"][1]["command"]
    assert "scheme" not in plain["spec"]["containers"][1]["readinessProbe"]["httpGet"]

    # The pair's Secret as the operator issues it (desired/tls.py), mounted where the pod mounts it.
    run = Path(tempfile.mkdtemp(prefix="sp-tls-"))     # short: a Unix socket path has ~100 bytes
    service = manifests.engine_name("v")
    ca = tls_mod.new_ca()

    def write_secret() -> tls_mod.KeyPair:
        return rendered_companion.write_engine_secret(run, ca, service, "ns")
    first = write_secret()
    (run / manifests.AUTH_DIR.lstrip("/")).mkdir(parents=True)
    (run / manifests.AUTH_DIR.lstrip("/") / "token").write_text(TOKEN + "\n")
    (run / manifests.RELEASE_FILE.lstrip("/")).parent.mkdir(parents=True)
    (run / manifests.RELEASE_FILE.lstrip("/")).write_text(json.dumps(rel))
    (run / VLLM_SOCKET.lstrip("/")).parent.mkdir(parents=True)
    ports = {flag: free_port() for flag in rendered_companion.PORT_FLAGS}
    argv = rendered_companion.local_argv(companion["command"], run, ports)
    base = f"https://127.0.0.1:{ports['--port']}"
    ca_file = run / manifests.TLS_DIR.lstrip("/") / "ca.crt"
    trusting = ssl.create_default_context(cafile=str(ca_file))

    def served_serial() -> int:
        with socket.create_connection(("127.0.0.1", ports["--port"]), timeout=30) as raw:
            with trusting.wrap_socket(raw, server_hostname=tls_mod.server_name(service, "ns")) as conn:
                return x509.load_der_x509_certificate(conn.getpeercert(binary_form=True)).serial_number

    with ReplayServer(uds=str(run / VLLM_SOCKET.lstrip("/"))):
        proc = rendered_companion.start(argv, base)      # its /health read as the kubelet's probe reads it
        try:
            assert served_serial() == x509.load_pem_x509_certificate(first.cert_pem).serial_number

            by_ip = ssl.create_default_context(cafile=str(ca_file))
            by_ip.check_hostname = False       # the chain is still verified; the name was checked above
            with openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=60,
                               http_client=openai.DefaultHttpx2Client(verify=by_ip)) as client:
                text = "".join(c.choices[0].text for c in client.completions.create(
                    model="peer", prompt="x", max_tokens=4, stream=True, extra_body={"specpair": {"category": "code"}}))
                assert text == "VVVV"
            with openai.OpenAI(base_url=f"{base}/v1", api_key="not-it", max_retries=0, timeout=60,
                               http_client=openai.DefaultHttpx2Client(verify=by_ip)) as wrong:
                with pytest.raises(openai.AuthenticationError):
                    wrong.completions.create(model="peer", prompt="x", max_tokens=4)
            with pytest.raises((urllib.error.URLError, ConnectionError)):
                urllib.request.urlopen(f"http://127.0.0.1:{ports['--port']}/health", timeout=30)
            # /metrics stays open (over HTTPS), and counted the request in its category.
            with urllib.request.urlopen(f"{base}/metrics", context=by_ip, timeout=30) as metrics:
                assert ('specpair_requests_total{category="code",engine="vllm",pair="v",protocol="http",'
                        'status="ok",version="4"} 1.0') in metrics.read().decode()

            renewed = write_secret()     # the operator's renewal: the Secret's files replaced in place
            assert served_serial() == x509.load_pem_x509_certificate(renewed.cert_pem).serial_number
            assert proc.poll() is None
        finally:
            proc.terminate()
            assert proc.wait(60) == 0


def test_a_pair_with_a_token_serves_only_requests_that_carry_it(operator_env, ns, mlflow_server, model_dirs):
    ns.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "serving-token"},
               "stringData": {"token": TOKEN}})
    name = f"auth-{uuid.uuid4().hex[:5]}"
    spec = tiny_pair(name, model_dirs["target"], model_dirs["draft"])
    spec["spec"]["rollout"]["auth"] = {"tokenSecretRef": {"name": "serving-token"}}
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(spec)
        ns.wait_for("v1 serving, its identity verified over the control port", lambda: serving(ns, name, "1"),
                    timeout=300)
    assert runner.exception is None
    (pod,) = engine_pods(ns)
    ip = pod["status"]["podIP"]
    request = engine_pb2.GenerateRequest(prompt=CODE_PROMPTS[0], max_new_tokens=4, category="code")
    with grpc.insecure_channel(f"{ip}:50051") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as wrong:
            list(stub.Generate(request, timeout=30, metadata=[("authorization", "Bearer not-it")]))
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answered = list(stub.Generate(request, timeout=60, metadata=[("authorization", f"Bearer {TOKEN}")]))
        assert answered
    url = f"http://{ip}:{manifests.HTTP_PORT}/v1/completions"
    body = json.dumps({"model": name, "prompt": CODE_PROMPTS[0], "max_tokens": 4}).encode()
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout=30)
    assert denied.value.code == 401
    with urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json",
                                                                   "Authorization": f"Bearer {TOKEN}"}),
                                timeout=60) as ok:
        assert ok.status == 200 and json.load(ok)["choices"]


@pytest.mark.parametrize("spec, words", [
    ({"rollout": {"tls": {"enabled": True}, "httpPort": 0}}, "rollout.tls needs rollout.httpPort (not 0)"),
    ({"engine": "vllm", "rollout": {"tls": {"enabled": True}, "httpPort": 0}},
     "rollout.tls needs rollout.httpPort (not 0)"),
])
def test_tls_is_refused_without_the_http_port_in_the_operators_words(operator_env, ns, spec, words):
    """The CRD's rules, on the real API server, and the operator's twin: same refusal, same words.
    A vLLM pair with TLS is admitted (its companion serves it)."""
    body = {"target": {"source": "t"}, "draft": {"source": "d"}, **spec}
    with pytest.raises(ApiError) as err:
        ns.create({"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": "refused"},
                   "spec": body})
    assert err.value.status == 422 and words in err.value.message
    (ours,) = validate_spec(body)
    assert words in ours and ours in err.value.message, (ours, err.value.message)
    admitted = ns.create({"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": "ok"},
                          "spec": {"target": {"source": "t"}, "draft": {"source": "d"}, "rollout": {"tls": {}}}})
    assert admitted["spec"]["rollout"]["tls"] == {"enabled": False}
    vllm = ns.create({"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": "v-tls"},
                      "spec": {"engine": "vllm", "target": {"source": "t"}, "draft": {"source": "d"},
                               "rollout": {"tls": {"enabled": True}}}})
    assert vllm["spec"]["rollout"]["tls"] == {"enabled": True}


def test_a_pair_with_tls_serves_both_ports_with_its_engine_certificate(operator_env, ns, mlflow_server, model_dirs):
    name = f"tls-{uuid.uuid4().hex[:5]}"
    spec = tiny_pair(name, model_dirs["target"], model_dirs["draft"])
    spec["spec"]["rollout"]["tls"] = {"enabled": True}
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(spec)
        ns.wait_for("v1 serving over TLS (Ready through the HTTPS /health probe)",
                    lambda: serving(ns, name, "1"), timeout=300)
    assert runner.exception is None
    (pod,) = engine_pods(ns)
    ip = pod["status"]["podIP"]
    secret = ns.get("v1", "Secret", manifests.engine_tls_secret_name(name))
    ca_pem = base64.b64decode(secret["data"]["ca.crt"])
    service = manifests.engine_name(name)
    server_name = tls_mod.server_name(service, ns.name)

    # HTTPS, trusting the Secret's ca.crt; the pod is dialled by IP, so the name checked is the Service's.
    trust = ssl.create_default_context(cadata=ca_pem.decode())
    with socket.create_connection((ip, manifests.HTTP_PORT), timeout=30) as raw:
        with trust.wrap_socket(raw, server_hostname=server_name) as conn:
            served = conn.getpeercert()
    assert ("DNS", f"{service}.{ns.name}.svc.cluster.local") in served["subjectAltName"]
    body = json.dumps({"model": name, "prompt": CODE_PROMPTS[0], "max_tokens": 4}).encode()
    by_ip = ssl.create_default_context(cadata=ca_pem.decode())
    by_ip.check_hostname = False          # the chain is still verified; the name was checked above
    with urllib.request.urlopen(urllib.request.Request(f"https://{ip}:{manifests.HTTP_PORT}/v1/completions", body,
                                                       {"Content-Type": "application/json"}),
                                context=by_ip, timeout=60) as ok:
        assert ok.status == 200 and json.load(ok)["choices"]
    # Plaintext HTTP to the TLS port: the TLS server drops the connection without an HTTP reply.
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(urllib.request.Request(f"http://{ip}:{manifests.HTTP_PORT}/v1/completions", body,
                                                      {"Content-Type": "application/json"}), timeout=30)

    request = engine_pb2.GenerateRequest(prompt=CODE_PROMPTS[0], max_new_tokens=4, category="code")
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    with grpc.secure_channel(f"{ip}:50051", credentials,
                             options=[("grpc.ssl_target_name_override", server_name)]) as channel:
        assert list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60))
    with grpc.insecure_channel(f"{ip}:50051") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
