"""The model fetch end to end on the real control plane: the fetch Job the operator renders
(model_fetch.desired_fetch_job, applied here; tests/operator/test_model_fetch.py has the operator
create it) fills a
hostPath-backed claim from a real MLflow server, and an engine Deployment as the operator renders
it, the claim read-only, HF_HUB_OFFLINE=1 and MLflow out of reach, serves the release from it. A
release whose draft is not in MLflow ends as a failed fetch whose state names the model."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest
from waiting import wait_until
import yaml

from specpair._proto import engine_pb2, engine_pb2_grpc
from specpair.contract import content_hash
from specpair_operator.desired import engine_objects, manifests, model_fetch, tls
from specpair_devcluster.client import ApiError
from specpair_operator.release.content import build_release

CRD = Path(__file__).resolve().parents[2] / "crds" / "specmodelpair.yaml"

# Nothing listens here: an engine pod that asked MLflow for a model would fail to start.
UNREACHABLE_MLFLOW = "http://127.0.0.1:9"
PROMPTS = [{"prompt": "def add(a, b):", "category": "code"}]


def wait(what: str, fn: Callable[[], Any], timeout: float = 120.0) -> Any:
    """tests/waiting.wait_until with this file's longer default (models load in these pods)."""
    return wait_until(what, fn, timeout)


class Registry:
    """Where the models are (MLflow's address) and their registered names, by side."""

    def __init__(self, url: str, models: dict[str, str]):
        self.url, self.models = url, models


@pytest.fixture(scope="module")
def registry(mlflow_server, tiny_pair_dirs) -> Registry:
    """The session's real `mlflow server` with the tiny target and draft registered under names of
    this module's own (version 1 each)."""
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server.url)
    prefix = f"fetch-{uuid.uuid4().hex[:6]}"
    experiment = client.create_experiment(prefix)
    models = {}
    for name in ("target", "draft"):
        run = client.create_run(experiment)
        client.log_artifacts(run.info.run_id, tiny_pair_dirs[name], artifact_path="model")
        client.set_terminated(run.info.run_id)
        models[name] = client.create_registered_model(f"{prefix}-{name}").name
        client.create_model_version(models[name], f"runs:/{run.info.run_id}/model", run.info.run_id)
    return Registry(mlflow_server.url, models)


def run_fetch(devcluster, ns: str, job: dict[str, Any]) -> model_fetch.FetchState:
    devcluster.kube.create(job)
    name = job["metadata"]["name"]

    def finished():
        live = devcluster.kube.get("batch/v1", "Job", ns, name)
        pods = devcluster.kube.list("v1", "Pod", ns, labels=f"job-name={name}")
        state = model_fetch.fetch_state(live, pods)
        return state if state.phase in (model_fetch.DONE, model_fetch.FAILED) else None
    return wait(f"the fetch Job {name} to finish", finished)


def test_the_fetch_job_fills_the_claim_and_the_engine_serves_from_it_offline(devcluster, registry, ns, models_claim,
                                                                               tmp_path):
    volume = tmp_path / "volume"
    rollout = {"modelCache": {"persistentVolumeClaim": models_claim(volume)}}
    spec = {"target": {"source": f"models:/{registry.models['target']}/1"},
            "draft": {"source": f"models:/{registry.models['draft']}/1"}, "speculation": {"k": 3}, "rollout": rollout}
    release = build_release("chat", ns, spec, PROMPTS)
    digest = content_hash(release)
    assert model_fetch.needs_fetch(release, rollout)

    state = run_fetch(devcluster, ns, model_fetch.desired_fetch_job("chat", ns, release, rollout, registry.url))
    assert state.phase == model_fetch.DONE, state.message
    assert (volume / ".specpair" / "releases" / f"{digest}.json").is_file()

    ca = tls.new_ca()
    leaf = tls.issue(ca, "chat-engine", tls.engine_dns_names(manifests.engine_name("chat"), ns), server=True, days=1)
    devcluster.kube.create(manifests.engine_tls_secret("chat", ns, leaf.cert_pem, leaf.key_pem, ca.cert_pem))
    devcluster.kube.create(engine_objects.engine_deployment("chat", ns, release, digest, "1", rollout, UNREACHABLE_MLFLOW))

    def ready_ip():
        for pod in devcluster.kube.list("v1", "Pod", ns, labels="specpair.io/role=engine"):
            if any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])):
                return pod["status"]["podIP"]
        return None
    ip = wait("an engine pod to be Ready", ready_ip, 180)
    with grpc.insecure_channel(f"{ip}:50051") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
        assert info.content_hash == digest
        for side in (info.target, info.draft):
            assert side.path.startswith(str(volume / "specpair-mlflow")), side.path
        tokens = [r for r in stub.Generate(engine_pb2.GenerateRequest(prompt=PROMPTS[0]["prompt"], max_new_tokens=8),
                                           timeout=30)]
        assert tokens


def test_a_fetch_that_cannot_find_a_model_fails_with_its_reason(devcluster, registry, ns, models_claim, tmp_path):
    rollout = {"modelCache": {"persistentVolumeClaim": models_claim(tmp_path / "volume")}}
    spec = {"target": {"source": f"models:/{registry.models['target']}/1"},
            "draft": {"source": f"models:/{registry.models['draft']}/7"}}
    release = build_release("chat", ns, spec, PROMPTS)
    job = model_fetch.desired_fetch_job("chat", ns, release, rollout, registry.url)
    job["spec"]["backoffLimit"] = 0     # one attempt is enough to read the reason (the Job controller backs off 10 s+)
    state = run_fetch(devcluster, ns, job)
    assert state.phase == model_fetch.FAILED and state.reason == "BackoffLimitExceeded"
    assert f"cannot fetch draft models:/{registry.models['draft']}/7 from MLflow" in state.message, state.message
    assert not (tmp_path / "volume" / ".specpair" / "releases").exists()


def test_the_pair_takes_a_fetch_deadline_and_refuses_a_short_one(devcluster, ns):
    devcluster.kube.apply(yaml.safe_load(CRD.read_text()))

    def pair(name: str, seconds: int) -> dict[str, Any]:
        return {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": name, "namespace": ns},
                "spec": {"target": {"source": "org/target"}, "draft": {"drafter": "ngram"},
                         "rollout": {"modelCache": {"persistentVolumeClaim": "models",
                                                    "fetch": {"activeDeadlineSeconds": seconds}}}}}

    def created():
        try:
            return devcluster.kube.create(pair("long", 7200))
        except ApiError as exc:
            if exc.status == 404:      # the CRD is not served yet
                return None
            raise
    live = wait("the CRD to serve pairs", created, 60)
    assert live["spec"]["rollout"]["modelCache"]["fetch"] == {"activeDeadlineSeconds": 7200}
    with pytest.raises(ApiError, match="activeDeadlineSeconds"):
        devcluster.kube.create(pair("short", 10))
