"""Serving ports behind a token: `spec.rollout.auth.tokenSecretRef`, on the real control plane
with the real engine (tiny models, the project's engine image run by the devcluster node).

The operator mounts the Secret's key into the engine pods and passes `--auth-token-file`; the
pod becomes Ready (the gRPC health service needs no token) and the operator verifies what it
serves over its mutual-TLS control port. A request without the token is refused on both
serving ports; with it, it is answered. A vLLM engine takes the same Secret as vLLM's API key
(real vLLM behind it: tests/operator/test_operator_vllm.py).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import grpc
import pytest
from kopf.testing import KopfRunner

from cluster_env import OPERATOR
from specpair._proto import engine_pb2, engine_pb2_grpc
from specpair_operator import manifests
from test_operator_e2e import engine_pods, serving  # noqa: F401
from test_operator_real_engine import CODE_PROMPTS, tiny_pair
from test_operator_real_engine import model_dirs  # noqa: F401 - pytest fixture

TOKEN = "s3cret-" + uuid.uuid4().hex


def test_manifest_mounts_the_token_by_reference():
    rel = {"target": {"source": "t"}, "draft": {"drafter": "ngram"}, "speculation": {}, "gating": {}}
    dep = manifests.engine_deployment("p", "ns", rel, "d" * 64, "1",
                                      {"auth": {"tokenSecretRef": {"name": "serving-token", "key": "t"}}}, "http://m")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][-2:] == ["--auth-token-file", f"{manifests.AUTH_DIR}/token"]
    assert {"name": "auth", "mountPath": manifests.AUTH_DIR, "readOnly": True} in container["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "auth"]
    assert volume["secret"] == {"secretName": "serving-token", "defaultMode": 0o440,
                                "items": [{"key": "t", "path": "token"}]}
    plain = manifests.engine_deployment("p", "ns", rel, "d" * 64, "1", {}, "http://m")
    assert "--auth-token-file" not in plain["spec"]["template"]["spec"]["containers"][0]["command"]


def test_a_vllm_pair_takes_the_token_as_vllms_api_key(operator_env, ns):
    """The API server admits rollout.auth for vLLM, and the pods get VLLM_API_KEY from the Secret
    by reference (vLLM reads it as --api-key); the token never appears in the Deployment."""
    created = ns.create({"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": "v"},
                         "spec": {"engine": "vllm", "target": {"source": "t"}, "draft": {"source": "d"},
                                  "rollout": {"auth": {"tokenSecretRef": {"name": "serving-token"}}}}})
    rollout = created["spec"]["rollout"]
    assert rollout["auth"] == {"tokenSecretRef": {"name": "serving-token", "key": "token"}}
    rel = {"target": {"source": "t"}, "draft": {"source": "d"}, "speculation": {}, "gating": {},
           "engine": {"kind": "vllm", "image": "x"}}
    (container,) = manifests.engine_deployment("v", "ns", rel, "d" * 64, "1", rollout,
                                               "http://m")["spec"]["template"]["spec"]["containers"]
    assert {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "serving-token", "key": "token"}}} \
        in container["env"]
    assert "--api-key" not in container["command"]
    (plain,) = manifests.engine_deployment("v", "ns", rel, "d" * 64, "1", {},
                                           "http://m")["spec"]["template"]["spec"]["containers"]
    assert not any(e["name"] == "VLLM_API_KEY" for e in plain["env"])


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
