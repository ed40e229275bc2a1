"""End to end: real Kopf running the operator against the API emulator and a real MLflow server.

The gate Job runs the operator's own gate runner as a subprocess (with the engine's
`specpair gate` when installed, the stand-in otherwise); the engine pod is a real gRPC server
on loopback; Deployments and Jobs are progressed by the controller stand-in.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner
from mlflow import MlflowClient

from specpair_operator import release
from specpair_operator.registry import ReleaseRegistry
from standins import ControllerStandIn, EngineStandIn

NS = "default"
WORLD = {
    # draft -> what the gate measures, and the live acceptance per category under traffic
    "good-draft": {"acceptanceRate": 0.7, "speedup": 1.6, "categories": {"code": 0.8, "chat": 0.6},
                   "live": {"code": 0.78, "chat": 0.6}},
    "faster-draft": {"acceptanceRate": 0.75, "speedup": 1.8, "categories": {"code": 0.85, "chat": 0.65},
                     "live": {"code": 0.84, "chat": 0.66}},
    "bad-draft": {"acceptanceRate": 0.2, "speedup": 0.9, "categories": {"code": 0.25, "chat": 0.15}, "live": {}},
    "foreign-draft": {"acceptanceRate": 0.7, "speedup": 1.5, "categories": {"code": 0.8}, "live": {},
                      "tokenizerOf": "meta-llama/Llama-3.2-1B"},
}
OPERATOR = ["run", "--all-namespaces", "--standalone", "-m", "specpair_operator.handlers"]


@pytest.fixture
def cluster(kube, kubeconfig, mlflow_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    world_file = tmp_path / "world.json"
    world_file.write_text(json.dumps(WORLD))
    engine = EngineStandIn(WORLD)
    monkeypatch.setenv("SPECPAIR_MLFLOW_TRACKING_URI", mlflow_server.url)
    ctl = ControllerStandIn(kube, engine, tmp_path, world_file, NS)
    yield ctl
    engine.stop()


def pair(name: str, draft: str, port: int, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "main"},
                     "draft": {"source": draft},
                     "gating": {"prompts": [{"prompt": "def fib(n):", "category": "code"},
                                            {"prompt": "Hi! How are you?", "category": "chat"}],
                                "thresholds": {"minAcceptance": 0.5, "minCategoryAcceptance": {"code": 0.6}}},
                     "rollout": {"port": port}, **spec}}


def smp(ctl: ControllerStandIn, name: str) -> dict[str, Any]:
    return ctl.kube.get("specpair.io/v1alpha1", "SpecModelPair", NS, name) or {}


def cond(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def serving(ctl: ControllerStandIn, name: str, version: str) -> dict[str, Any] | None:
    obj = smp(ctl, name)
    st = obj.get("status") or {}
    ready = cond(obj, "Ready")
    if st.get("phase") == "Serving" and st.get("servingVersion") == version and ready.get("status") == "True" \
            and ready.get("observedGeneration") == obj["metadata"]["generation"]:
        return obj
    return None


def set_spec(ctl: ControllerStandIn, name: str, spec_patch: dict[str, Any]) -> None:
    ctl.kube.patch("specpair.io/v1alpha1", "SpecModelPair", NS, name, {"spec": spec_patch})


def test_apply_gate_promote_serve_then_new_release_then_failed_gate_keeps_champion(cluster, mlflow_server):
    ctl = cluster
    name = f"chat-{uuid.uuid4().hex[:5]}"
    model = f"{NS}-{name}"
    mlflow = MlflowClient(mlflow_server.url)
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ctl.kube.create(pair(name, "good-draft", ctl.engine.port))
        obj = ctl.wait_for("v1 serving", lambda: serving(ctl, name, "1"), timeout=90)
        st = obj["status"]
        assert st["lastGate"]["passed"] and st["lastGate"]["acceptanceRate"] == 0.7 and st["speedup"] == 1.6
        assert st["acceptance"] == 0.7  # gated value until live traffic is measured
        assert cond(obj, "Gated")["status"] == "True" and cond(obj, "TokenizerCompatible")["status"] == "True"
        assert cond(obj, "Reconciling")["status"] == "False" and cond(obj, "Stalled")["status"] == "False"
        assert [h["action"] for h in st["history"]] == ["GateStarted", "Promoted", "RolloutStarted"]
        assert mlflow.get_registered_model(model).aliases == {"candidate": "1", "champion": "1"}
        jobs = ctl.kube.list("batch/v1", "Job", NS)
        assert len(jobs) == 1 and jobs[0]["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        dep = ctl.kube.get("apps/v1", "Deployment", NS, f"{name}-engine")
        assert dep["metadata"]["ownerReferences"][0]["kind"] == "SpecModelPair"
        assert ctl.kube.get("v1", "Service", NS, f"{name}-engine") is not None
        assert ctl.engine.release["mlflow"]["version"] == "1"  # the pod serves what MLflow says
        events = ctl.kube.list("v1", "Event", NS)
        assert any(e.get("reason") == "Promoted" for e in events)

        # A changed spec is a new release, gated and promoted; the old champion becomes previous.
        set_spec(ctl, name, {"draft": {"source": "faster-draft"}})
        obj = ctl.wait_for("v2 serving", lambda: serving(ctl, name, "2"), timeout=90)
        assert obj["status"]["previousVersion"] == "1"
        assert mlflow.get_registered_model(model).aliases == {"candidate": "2", "champion": "2", "previous": "1"}
        assert ctl.engine.release["draft"]["source"] == "faster-draft"

        # A release that fails its gate never serves; the condition says which threshold by how much.
        set_spec(ctl, name, {"draft": {"source": "bad-draft"}})
        obj = ctl.wait_for("v3 gate failed", lambda: (o := smp(ctl, name)) and cond(o, "Gated").get("status") == "False"
                           and o["status"].get("phase") == "Degraded" and o)
        msg = cond(obj, "Gated")["message"]
        assert "acceptance 0.200 < minAcceptance 0.500 (short by 0.300)" in msg
        assert "category 'code' acceptance 0.250 < 0.600 (short by 0.350)" in msg
        assert cond(obj, "Ready")["status"] == "False" and cond(obj, "Stalled")["status"] == "True"
        assert obj["status"]["servingVersion"] == "2" and obj["status"]["candidateVersion"] == "3"
        assert mlflow.get_registered_model(model).aliases["champion"] == "2"
        assert ctl.engine.release["mlflow"]["version"] == "2"
        assert mlflow.get_model_version(model, "3").tags["specpair.gate.status"] == "failed"
        assert len(mlflow.search_model_versions(f"name='{model}'")) == 3
    assert runner.exception is None


def test_tokenizer_mismatched_draft_fails_the_gate_with_the_differences(cluster, mlflow_server):
    ctl = cluster
    name = f"foreign-{uuid.uuid4().hex[:5]}"
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ctl.kube.create(pair(name, "foreign-draft", ctl.engine.port))
        obj = ctl.wait_for("gate refused", lambda: (o := smp(ctl, name)) and cond(o, "TokenizerCompatible").get("status") == "False" and o)
        assert "49152 vs 32000" in cond(obj, "TokenizerCompatible")["message"]
        assert cond(obj, "Gated")["reason"] == "TokenizerMismatch"
        assert obj["status"]["phase"] == "Failed" and cond(obj, "Stalled")["status"] == "True"
        assert ctl.kube.get("apps/v1", "Deployment", NS, f"{name}-engine") is None
    assert runner.exception is None


def test_restarted_operator_makes_no_duplicates_and_mlflow_outage_recovers(cluster, mlflow_server):
    ctl = cluster
    name = f"restart-{uuid.uuid4().hex[:5]}"
    model = f"{NS}-{name}"
    mlflow = MlflowClient(mlflow_server.url)
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ctl.kube.create(pair(name, "good-draft", ctl.engine.port))
        # Killed while the gate is running: the Job exists, no verdict yet.
        import time
        deadline = time.monotonic() + 60
        while not ctl.kube.list("batch/v1", "Job", NS) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert runner.exception is None
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ctl.wait_for("v1 serving after restart", lambda: serving(ctl, name, "1"), timeout=90)
        assert len(ctl.kube.list("batch/v1", "Job", NS)) == 1 and len(ctl.gates_run) == 1
        assert len(mlflow.search_model_versions(f"name='{model}'")) == 1

        mlflow_server.stop()
        try:
            set_spec(ctl, name, {"draft": {"source": "faster-draft"}})
            obj = ctl.wait_for("MLflow outage reported",
                               lambda: (o := smp(ctl, name)) and cond(o, "Reconciling").get("reason") == "MLflowUnavailable" and o)
            assert obj["status"]["servingVersion"] == "1" and len(ctl.kube.list("batch/v1", "Job", NS)) == 1
        finally:
            mlflow_server.start()
        ctl.wait_for("v2 serving after the outage", lambda: serving(ctl, name, "2"), timeout=120)
        assert len(mlflow.search_model_versions(f"name='{model}'")) == 2
        assert mlflow.get_registered_model(model).aliases["previous"] == "1"
    assert runner.exception is None

    # Killed mid-promotion: v3 gated and passed, `previous` already moved, `champion` not yet.
    # This is the state the operator's own steps leave when it dies between the two alias writes.
    set_spec(ctl, name, {"speculation": {"k": 6}})
    body = smp(ctl, name)
    rel = release.build_release(name, NS, body["spec"], body["spec"]["gating"]["prompts"])
    reg = ReleaseRegistry(mlflow_server.url)
    v3 = reg.ensure_release(model, rel, release.content_hash(rel))
    reg.set_tags(model, v3, {"specpair.release": json.dumps(rel, sort_keys=True, separators=(",", ":"))})
    reg.record_gate(model, v3, {"passed": True, "reasons": [], "greedyIdentity": 1.0, "acceptanceRate": 0.7,
                                "speedup": 1.6, "categories": {"code": {"acceptanceRate": 0.8}},
                                "tokenizer": {"compatible": True, "differences": []}})
    reg.set_alias(model, "candidate", v3)
    reg.set_alias(model, "previous", "2")
    assert reg.aliases(model) == {"candidate": "3", "champion": "2", "previous": "2"}
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ctl.wait_for("v3 serving after restart mid-promotion", lambda: serving(ctl, name, "3"), timeout=90)
        assert reg.aliases(model) == {"candidate": "3", "champion": "3", "previous": "2"}
        assert len(mlflow.search_model_versions(f"name='{model}'")) == 3
        assert len(ctl.kube.list("batch/v1", "Job", NS)) == 2  # v1's and v2's; v3 already had its verdict
    assert runner.exception is None


def test_configmap_prompts_tokenizer_mismatch_on_a_pod_and_failed_rollout_roll_back(cluster, mlflow_server):
    ctl = cluster
    name = f"guard-{uuid.uuid4().hex[:5]}"
    model = f"{NS}-{name}"
    mlflow = MlflowClient(mlflow_server.url)
    prompts = [{"prompt": "class Stack:", "category": "code"}, {"prompt": "Tell me a joke", "category": "chat"},
               {"prompt": "import os", "category": "code"}]
    ctl.kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "golden", "namespace": NS},
                     "data": {"prompts.jsonl": "\n".join(json.dumps(p) for p in prompts)}})
    spec = pair(name, "good-draft", ctl.engine.port)
    spec["spec"]["gating"] = {"configMapRef": {"name": "golden"}, "thresholds": {"minAcceptance": 0.5}}
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ctl.kube.create(spec)
        ctl.wait_for("v1 serving", lambda: serving(ctl, name, "1"), timeout=90)
        released = json.loads(mlflow.get_model_version(model, "1").tags["specpair.release"])
        assert released["gating"]["prompts"] == prompts

        set_spec(ctl, name, {"draft": {"source": "faster-draft"}})
        ctl.wait_for("v2 serving", lambda: serving(ctl, name, "2"), timeout=90)
        # The pod now reports a draft tokenizer that is not the one the release was gated with.
        ctl.engine.fingerprints["faster-draft"] = "f" * 64
        obj = ctl.wait_for("rolled back on tokenizer mismatch",
                           lambda: (o := smp(ctl, name)) and o["status"].get("servingVersion") == "1"
                           and cond(o, "Stalled").get("status") == "True" and o)
        last = [h for h in obj["status"]["history"] if h["action"] == "RolledBack"][-1]
        assert "tokenizer mismatch" in last["reason"] and (last["fromVersion"], last["toVersion"]) == ("2", "1")
        assert "specpair.rolled_back" in mlflow.get_model_version(model, "2").tags

        # A release whose pods never become available is rolled back too.
        ctl.failing_versions.add("3")
        set_spec(ctl, name, {"draft": {"source": "good-draft"}, "speculation": {"k": 5}})
        obj = ctl.wait_for("rolled back after failed rollout",
                           lambda: (o := smp(ctl, name)) and any(h["action"] == "RolledBack" and h["fromVersion"] == "3"
                                                                 for h in o["status"].get("history", [])) and o)
        assert "rollout of v3 failed: engine pods crash-looping" in obj["status"]["history"][-1]["reason"] or \
            any("crash-looping" in h["reason"] for h in obj["status"]["history"])
        ctl.wait_for("v1 serving again", lambda: (o := smp(ctl, name)) and o["status"].get("servingVersion") == "1"
                     and o["status"].get("phase") == "Degraded" and ctl.engine.release["mlflow"]["version"] == "1")
        assert mlflow.get_registered_model(model).aliases["champion"] == "1"
        assert len(mlflow.search_model_versions(f"name='{model}'")) == 3
    assert runner.exception is None
