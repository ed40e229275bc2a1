"""The model fetch Job and its decisions, as tables: whether a release needs one, what the Job
holds, and what its state is from the Job and its pods."""

from __future__ import annotations

import json

import pytest

from specpair.contract import content_hash
from specpair_operator.desired import engine_objects, gate_objects, manifests, model_fetch
from specpair_operator.desired.learning import CAPTURE_FINALIZER
from specpair_operator.desired.manifests import MlflowCredentials, PodDefaults
from specpair_operator.release.content import build_release

PROMPTS = [{"prompt": "hi", "category": "general"}]
PVC = {"modelCache": {"persistentVolumeClaim": "models"}}


def _release(target: str | None = "models:/target/3", draft: dict | None = None) -> dict:
    spec = {"target": {"source": target, "revision": None}, "draft": draft or {"drafter": "ngram"}}
    return build_release("chat", "team", spec, PROMPTS)


@pytest.mark.parametrize("target, draft, rollout, fetched, needed", [
    ("models:/target/3", None, PVC, (), True),
    ("models:/target/3", None, {}, (), False),                                   # no model cache: pods download
    ("default", None, PVC, (), False),                                           # embedded in the image
    ("/models/llama", None, PVC, (), False),                                     # a path in the image
    ("default", {"source": "org/draft", "revision": "abc"}, PVC, (), True),      # a hub draft
    ("default", {"source": "runs:/r1/head"}, PVC, (), True),                     # a head in MLflow
    ("org/target", None, {"modelCache": {"sizeLimit": "1Gi"}}, (), False),
    ("org/target", None, PVC, "digest-of-release", False),                       # recorded as fetched
])
def test_needs_fetch(target, draft, rollout, fetched, needed):
    release = _release(target, draft)
    if fetched == "digest-of-release":
        fetched = (model_fetch.models_digest(release),)
    assert model_fetch.needs_fetch(release, rollout, fetched) is needed


def test_fetched_sources_name_role_kind_and_revision():
    release = _release("org/target", {"source": "models:/draft/2", "revision": None})
    release["target"]["revision"] = "v1.0"
    assert model_fetch.fetched_sources(release) == [
        {"role": "target", "source": "org/target", "revision": "v1.0", "kind": "hub"},
        {"role": "draft", "source": "models:/draft/2", "revision": None, "kind": "mlflow"}]


def test_one_fetch_per_set_of_models():
    """Speculation, gating and the gate's tuning of the served release change the release's
    content hash, not its models: the same Job. Another revision or source is another Job."""
    release = _release("org/target", {"source": "models:/draft/2"})
    tuned = {**release, "speculation": {**release["speculation"], "k": 7},
             "gating": {**release["gating"], "maxNewTokens": 99},
             "mlflow": {"trackingUri": "http://mlflow:5000", "modelName": "team.chat", "version": "4"}}
    assert content_hash(tuned) != content_hash(release)
    assert model_fetch.models_digest(tuned) == model_fetch.models_digest(release)
    assert _job(release=tuned)["metadata"]["name"] == _job(release=release)["metadata"]["name"]
    assert not model_fetch.needs_fetch(tuned, PVC, {model_fetch.models_digest(release)})
    pinned = _release("org/target", {"source": "models:/draft/2"})
    pinned["target"]["revision"] = "abc123"
    others = {model_fetch.models_digest(r) for r in (pinned, _release("org/target", {"source": "models:/draft/3"}),
                                                     _release("org/other", {"source": "models:/draft/2"}))}
    assert len(others) == 3 and model_fetch.models_digest(release) not in others


def _job(rollout=None, credentials=None, defaults=PodDefaults(), release=None):
    release = release or _release()
    return model_fetch.desired_fetch_job("chat", "team", release, rollout or PVC, "http://mlflow:5000", credentials,
                                         defaults)


def test_the_job_writes_the_pvc_that_engine_and_gate_pods_read_only():
    release = _release()
    digest = content_hash(release)
    rollout = {**PVC, "resources": {"limits": {"nvidia.com/gpu": 1}}}
    job = _job(rollout, release=release)
    models = model_fetch.models_digest(release)
    assert job["metadata"]["name"] == model_fetch.fetch_job_name("chat", models) == f"chat-fetch-{models[:10]}"
    assert job["metadata"]["annotations"][manifests.ANN_HASH] == digest
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    hub = next(v for v in pod["volumes"] if v["name"] == "hub")
    assert hub == {"name": "hub", "persistentVolumeClaim": {"claimName": "models"}}          # read-write
    assert {"name": "hub", "mountPath": manifests.HUB_CACHE_DIR} in container["volumeMounts"]
    assert container["command"][-6:] == ["--release", manifests.RELEASE_FILE, "--cache-dir",
                                         manifests.HUB_CACHE_DIR, "--termination-log", manifests.TERMINATION_LOG]
    env = {e["name"]: e for e in container["env"]}
    assert "HF_HUB_OFFLINE" not in env and "HF_HUB_CACHE" not in env                         # it downloads
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert json.loads(annotations[manifests.ANN_RELEASE]) == release
    # Everywhere else the same claim is read-only and offline.
    gate = gate_objects.gate_job("chat", "team", release, digest, "3", rollout, "http://mlflow:5000")
    engine = engine_objects.engine_deployment("chat", "team", release, digest, "3", rollout, "http://mlflow:5000")
    for other in (gate["spec"]["template"]["spec"], engine["spec"]["template"]["spec"]):
        assert next(v for v in other["volumes"] if v["name"] == "hub")["persistentVolumeClaim"]["readOnly"] is True
        assert {e["name"]: e.get("value") for e in other["containers"][0]["env"]}["HF_HUB_OFFLINE"] == "1"
    # A download asks for no GPU, whatever the engine asks for.
    assert container["resources"] == model_fetch.FETCH_RESOURCES
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])


def test_the_job_is_bounded_unprivileged_and_owned_by_nothing_but_its_pair():
    job = _job()
    spec = job["spec"]
    assert spec["backoffLimit"] == model_fetch.FETCH_BACKOFF_LIMIT <= 3
    assert spec["activeDeadlineSeconds"] == model_fetch.FETCH_DEADLINE_SECONDS
    assert spec["ttlSecondsAfterFinished"] == PodDefaults().gate_ttl_seconds
    assert "ownerReferences" not in job["metadata"]    # added by the adapter (kopf.adopt), as for every child
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == manifests.NONROOT_UID
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    longer = _job({"modelCache": {"persistentVolumeClaim": "models", "fetch": {"activeDeadlineSeconds": 7200}}})
    assert longer["spec"]["activeDeadlineSeconds"] == 7200


def test_the_job_gets_the_credentials_the_gate_gets():
    release = _release("org/target", {"source": "models:/draft/2"})
    rollout = {"modelCache": {"persistentVolumeClaim": "models", "hubTokenSecretRef": {"name": "hf", "key": "tok"}}}
    credentials = MlflowCredentials.for_pair({"credentialsSecretRef": {"name": "mlflow-auth"}}, None)
    defaults = PodDefaults(image_pull_secrets=("regcred",))
    job = _job(rollout, credentials, defaults, release)
    gate = gate_objects.gate_job("chat", "team", release, content_hash(release), "3", rollout, "http://mlflow:5000",
                              credentials=credentials, defaults=defaults)

    def secrets(pod):
        return sorted((e["name"], json.dumps(e["valueFrom"], sort_keys=True))
                      for e in pod["containers"][0]["env"] if "valueFrom" in e)
    pod, gate_pod = job["spec"]["template"]["spec"], gate["spec"]["template"]["spec"]
    assert secrets(pod) == secrets(gate_pod) and {n for n, _ in secrets(pod)} == {
        "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "HF_TOKEN"}
    assert {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert pod["imagePullSecrets"] == gate_pod["imagePullSecrets"] == [{"name": "regcred"}]
    # The installation's hub token when the pair names none; no MLflow credentials for a release
    # whose models all come from the hub.
    job = _job(PVC, credentials, PodDefaults(hub_token=("install-hf", "token")), _release("org/target"))
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "install-hf", "key": "token"}}
    assert not [name for name in env if name.startswith("MLFLOW_TRACKING_") and name != "MLFLOW_TRACKING_URI"]


def test_no_job_without_a_claim():
    with pytest.raises(ValueError, match="persistentVolumeClaim"):
        _job({"modelCache": {"sizeLimit": "1Gi"}})


def test_the_command_is_one_the_engine_cli_takes():
    from specpair.cli import build_parser

    command = _job()["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["python", "-m", "specpair"]
    args = build_parser().parse_args(command[3:])
    assert (args.release, args.cache_dir, args.termination_log) == (
        manifests.RELEASE_FILE, manifests.HUB_CACHE_DIR, manifests.TERMINATION_LOG)


# -- fetch_state ---------------------------------------------------------------------------------

DIGEST = "d" * 64
NAME = model_fetch.fetch_job_name("chat", DIGEST)


def job_with(*conditions: tuple[str, str, str]) -> dict:
    return {"metadata": {"name": NAME, "annotations": {manifests.ANN_HASH: DIGEST}},
            "status": {"conditions": [{"type": t, "status": "True", "reason": r, "message": m}
                                      for t, r, m in conditions]}}


def pod(terminated: dict | None = None, waiting: dict | None = None, job: str = NAME) -> dict:
    state = {"terminated": terminated} if terminated else {"waiting": waiting} if waiting else {"running": {}}
    return {"metadata": {"name": f"{job}-x", "labels": {"job-name": job}},
            "status": {"containerStatuses": [{"name": "fetch", "state": state}]}}


REPORT = json.dumps({"digest": DIGEST, "error": "cannot fetch draft models:/d/9 from MLflow (http://mlflow): "
                                                "RESOURCE_DOES_NOT_EXIST: Model Version (name=d, version=9) not found"})
FAILED = ("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")


@pytest.mark.parametrize("job, pods, phase, reason, says", [
    (None, [], model_fetch.ABSENT, "", "not there yet"),
    (job_with(), [pod()], model_fetch.RUNNING, "", f"(Job {NAME})"),
    (job_with(), [pod(waiting={"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'})],
     model_fetch.RUNNING, "", 'CreateContainerConfigError: secret "hf" not found'),
    (job_with(), [pod(terminated={"exitCode": 2, "message": REPORT, "finishedAt": "t1"}), pod()],
     model_fetch.RUNNING, "", "an attempt failed: cannot fetch draft models:/d/9"),
    (job_with(("Complete", "", "")), [], model_fetch.DONE, "", "models fetched"),
    (job_with(FAILED), [pod(terminated={"exitCode": 2, "message": REPORT, "finishedAt": "t1"})],
     model_fetch.FAILED, "BackoffLimitExceeded", "(BackoffLimitExceeded): cannot fetch draft models:/d/9 from MLflow"),
    # Another release's report (a name reused) is not this one's reason: the Job's own words.
    (job_with(FAILED), [pod(terminated={"exitCode": 2, "message": REPORT.replace(DIGEST, "e" * 64)})],
     model_fetch.FAILED, "BackoffLimitExceeded", "backoff limit"),
    # Died before writing a report: the log's last line (FallbackToLogsOnError).
    (job_with(FAILED), [pod(terminated={"exitCode": 1, "message": "Traceback ...\nMemoryError: out of memory"})],
     model_fetch.FAILED, "BackoffLimitExceeded", ": MemoryError: out of memory"),
    (job_with(("Failed", "DeadlineExceeded", "Job was active longer than specified deadline")), [],
     model_fetch.FAILED, "DeadlineExceeded", "active longer than specified deadline"),
    # Pods of another Job are not this one's.
    (job_with(FAILED), [pod(terminated={"exitCode": 2, "message": REPORT}, job="other")],
     model_fetch.FAILED, "BackoffLimitExceeded", "backoff limit"),
])
def test_fetch_state(job, pods, phase, reason, says):
    state = model_fetch.fetch_state(job, pods)
    assert (state.phase, state.reason) == (phase, reason)
    assert says in state.message, state.message


def test_the_crd_knob_and_its_default():
    from pathlib import Path

    import yaml

    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "specmodelpair.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    deadline = spec["properties"]["rollout"]["properties"]["modelCache"]["properties"]["fetch"]["properties"][
        "activeDeadlineSeconds"]
    assert f"Absent: {model_fetch.FETCH_DEADLINE_SECONDS}." in deadline["description"]
    assert deadline["minimum"] == 60


# -- on the real control plane --------------------------------------------------------------------

@pytest.mark.slow
def test_the_operator_fetches_before_it_gates(env):
    """A pair with a model cache claim: the operator's first pass creates the release's fetch Job,
    owned by the pair, with its Event, and reports ModelsFetching; no gate Job while the models are
    not there (the claim is never bound here, so the fetch pod waits)."""
    import uuid

    from kopf.testing import KopfRunner

    from cluster_env import OPERATOR, cond, pair

    ns = env
    name = f"fetch-{uuid.uuid4().hex[:5]}"
    spec = pair(name, "good-draft", rollout={"modelCache": {"persistentVolumeClaim": "models-not-bound"}})
    with KopfRunner(OPERATOR, timeout=60):
        ns.create(spec)
        fetching = ns.wait_for("ModelsFetching", lambda: cond(ns.pair(name), "Reconciling").get("reason")
                               == model_fetch.MODELS_FETCHING, timeout=60)
        assert fetching
        jobs = ns.list("batch/v1", "Job")
        assert [j["metadata"]["labels"][manifests.LABEL_ROLE] for j in jobs] == [model_fetch.ROLE], jobs
        job = jobs[0]
        assert job["metadata"]["name"].startswith(f"{name}-fetch-")
        owner = job["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("SpecModelPair", name,
                                                                ns.pair(name)["metadata"]["uid"])
        assert ns.wait_for("the ModelFetchStarted Event", lambda: ns.events("ModelFetchStarted"), timeout=120)
        assert "modelCache" not in (ns.pair(name).get("status") or {})


@pytest.mark.slow
# Not the suite's 600 s: setup (the devcluster's start) 138 s + call 277 s at load 30 here, the
# call now with the engine pods' stop before the capture clean-up; the official machine is slower.
@pytest.mark.timeout(1200)
def test_a_pair_is_fetched_gated_and_served_from_its_claim(operator_env, ns, mlflow_server, tiny_pair_dirs, tmp_path):
    """The whole journey with the real engine image: the tiny models in a real MLflow, a
    hostPath-backed claim; the operator fetches them into it, gates and serves v1 from it."""
    import uuid

    from kopf.testing import KopfRunner
    from mlflow import MlflowClient

    from cluster_env import OPERATOR, serving, tiny_pair

    name = f"cache-{uuid.uuid4().hex[:5]}"
    client = MlflowClient(mlflow_server.url)
    experiment = client.create_experiment(f"fetch-{name}")
    sources = {}
    for role in ("target", "draft"):
        run = client.create_run(experiment)
        client.log_artifacts(run.info.run_id, tiny_pair_dirs[role], artifact_path="model")
        client.set_terminated(run.info.run_id)
        client.create_registered_model(f"{name}-{role}")
        client.create_model_version(f"{name}-{role}", f"runs:/{run.info.run_id}/model", run.info.run_id)
        sources[role] = f"models:/{name}-{role}/1"
    volume = tmp_path / "volume"
    pv = f"models-{ns.name}"
    ns.kube.create({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                    "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                             "persistentVolumeReclaimPolicy": "Retain",
                             "hostPath": {"path": str(volume), "type": "DirectoryOrCreate"}}})
    ns.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
               "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
                        "resources": {"requests": {"storage": "1Gi"}}}})
    # Its served traffic captured on a claim of its own (spec.learning, issue 58: docs/learning.md).
    traffic, traffic_pv = tmp_path / "traffic", f"traffic-{ns.name}"
    ns.kube.create({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": traffic_pv},
                    "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                             "persistentVolumeReclaimPolicy": "Retain",
                             "hostPath": {"path": str(traffic), "type": "DirectoryOrCreate"}}})
    ns.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "traffic"},
               "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": traffic_pv,
                        "resources": {"requests": {"storage": "1Gi"}}}})
    spec = tiny_pair(name, sources["target"], sources["draft"])
    spec["spec"]["rollout"]["modelCache"] = {"persistentVolumeClaim": "models"}
    spec["spec"]["learning"] = {"enabled": True, "persistentVolumeClaim": "traffic", "sampleRate": 1.0}
    try:
        with KopfRunner(OPERATOR, timeout=60) as runner:
            ns.create(spec)
            # Minutes: fetch, gate Job and engine start; 300 s ran out once at load 24 with the
            # gate Job still running (R, 2026-12-07). It ends as soon as v1 serves.
            ns.wait_for("v1 serving from the claim", lambda: serving(ns, name, "1"), timeout=600)
            status = ns.pair(name)["status"]
            roles = sorted(j["metadata"]["labels"][manifests.LABEL_ROLE] for j in ns.list("batch/v1", "Job"))
            assert CAPTURE_FINALIZER in ns.pair(name)["metadata"]["finalizers"]
            replies = captured_replies(ns, name, traffic / name)
            # Deleting the pair stops its engine pods, then deletes its captured traffic (a Job),
            # then the pair goes. A pod still capturing beside the Job would create the folder
            # again with its next shard (every 60 s or 256 records).
            ns.kube.delete("specpair.io/v1alpha1", "SpecModelPair", ns.name, name)
            job_beside_engine_pods = []

            def gone() -> bool:
                if any(j["metadata"]["labels"].get(manifests.LABEL_ROLE) == "capture-cleanup"
                       for j in ns.list("batch/v1", "Job")):
                    job_beside_engine_pods.extend(
                        p["metadata"]["name"] for p in ns.list("v1", "Pod")
                        if p["metadata"].get("labels", {}).get(manifests.LABEL_ROLE) == "engine")
                return not ns.pair(name)
            # Minutes: the engine pods' stop (stop delay, drain, exit) comes before the Job now.
            ns.wait_for("the pair gone after its engines stopped and its clean-up", gone, timeout=600)
            # Posted after the finalizer's removal lets the pair go: awaited while the operator
            # still runs (leaving the runner at once lost it on a loaded CI worker, 2c181f8).
            ns.wait_for_event("CaptureDeleted")
        assert not job_beside_engine_pods, f"the clean-up Job ran beside engine pods {job_beside_engine_pods}"
        assert runner.exception is None
        assert len(status["modelCache"]["fetched"]) == 1
        assert roles == ["gate", model_fetch.ROLE], roles
        assert ns.events("ModelFetchStarted") and ns.events("ModelsFetched")
        assert (volume / ".specpair" / "releases").is_dir()
        assert replies and not (traffic / name).exists() and traffic.is_dir()
        assert ns.events("CaptureCleanupArmed") and ns.events("CaptureCleanupStarted") and ns.events("CaptureDeleted")
        assert ns.events("CaptureEnginesStopping") and not ns.list("v1", "Pod", labels=f"{manifests.LABEL_ROLE}=engine")
    finally:
        ns.kube.delete("v1", "PersistentVolume", None, pv)
        ns.kube.delete("v1", "PersistentVolume", None, traffic_pv)


def captured_replies(ns, name: str, folder) -> list[list[int]]:
    """Three requests to the pair's engine pod, and the records its capture wrote of them: the
    prompt's and the reply's token ids the pod served, in the pair's folder on its claim."""
    from cluster_env import service_endpoints
    from specpair.server.client import EngineClient

    (address,) = service_endpoints(ns, name)
    with EngineClient(address, insecure=True) as client:
        replies = [client.generate(p, max_new_tokens=6, category="code", timeout=60).token_ids
                   for p in ("def foo(x):", "import os", "class A:")]

    def written() -> list[dict]:   # the shard being written (a shard closes at 256 records or 60 s)
        return [json.loads(line) for shard in sorted((folder / "code").glob("*.jsonl*"))
                for line in shard.read_text().splitlines()] if (folder / "code").is_dir() else []
    ns.wait_for("the three requests captured", lambda: len(written()) == 3, timeout=120)
    assert [r["reply_ids"] for r in written()] == replies
    return replies
