"""The operator with the engine's real `specpair gate` on tiny models (CPU): a compatible draft
is gated, recorded in MLflow and served; a draft with another tokenizer is refused."""

from __future__ import annotations

import json
import uuid

import pytest
from kopf.testing import KopfRunner
from mlflow import MlflowClient

from standins import REAL_GATE, ControllerStandIn, EngineStandIn
from test_operator_e2e import NS, OPERATOR, cond, serving, smp


@pytest.fixture
def foreign_draft_dir(tmp_path_factory):
    from tiny_models import make_model, make_tokenizer, save_tiny

    return save_tiny(make_model(make_tokenizer(vocab_size=350), seed=4), tmp_path_factory.mktemp("foreign") / "draft")


def real_fingerprint(path: str) -> str:
    from transformers import AutoTokenizer

    from specpair.tokenizer_identity import fingerprint

    return fingerprint(AutoTokenizer.from_pretrained(path))["sha256"]


def tiny_pair(name: str, target: str, draft: str, port: int) -> dict:
    return {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": name, "namespace": NS},
            "spec": {"target": {"source": target}, "draft": {"source": draft}, "speculation": {"k": 3},
                     "gating": {"prompts": [{"prompt": "def foo(x):\n    return", "category": "code"},
                                            {"prompt": "The weather today is", "category": "chat"}],
                                "maxNewTokens": 8, "thresholds": {"requireGreedyIdentity": True}},
                     "rollout": {"port": port}}}


def test_real_gate_promotes_a_compatible_tiny_pair_and_refuses_another_tokenizer(
        kube, kubeconfig, mlflow_server, tiny_pair_dirs, foreign_draft_dir, tmp_path, monkeypatch):
    target, draft = tiny_pair_dirs["target"], tiny_pair_dirs["draft"]
    fps = {p: real_fingerprint(p) for p in (target, draft, foreign_draft_dir)}
    engine = EngineStandIn({}, fingerprints=fps)
    world = tmp_path / "world.json"
    world.write_text("{}")
    monkeypatch.setenv("SPECPAIR_MLFLOW_TRACKING_URI", mlflow_server.url)
    ctl = ControllerStandIn(kube, engine, tmp_path, world, NS, gate=REAL_GATE)
    good, bad = f"tiny-{uuid.uuid4().hex[:5]}", f"foreign-{uuid.uuid4().hex[:5]}"
    mlflow = MlflowClient(mlflow_server.url)
    try:
        with KopfRunner(OPERATOR, timeout=60) as runner:
            ctl.kube.create(tiny_pair(good, target, draft, engine.port))
            obj = ctl.wait_for("tiny pair serving", lambda: serving(ctl, good, "1"), timeout=240)
            gate = obj["status"]["lastGate"]
            assert gate["passed"] and gate["greedyIdentity"] == 1.0 and set(gate["categories"]) == {"code", "chat"}
            tags = mlflow.get_model_version(f"{NS}-{good}", "1").tags
            assert tags["specpair.tokenizer.target_fingerprint"] == fps[target]
            assert tags["specpair.tokenizer.draft_fingerprint"] == fps[draft]
            run_id = tags["specpair.gate.run_id"]
            artifacts = [a.path for a in mlflow.list_artifacts(run_id, "gate")]
            assert "gate/verdict.json" in artifacts and "gate/golden_outputs.json" in artifacts
            assert "acceptance_rate.code" in mlflow.get_run(run_id).data.metrics
            best = json.loads(tags["specpair.gate.best_speculation"])
            assert ctl.engine.release["speculation"]["k"] == best["k"]  # serves the k the gate found best

            ctl.kube.create(tiny_pair(bad, target, foreign_draft_dir, engine.port))
            obj = ctl.wait_for("foreign draft refused",
                               lambda: (o := smp(ctl, bad)) and cond(o, "TokenizerCompatible").get("status") == "False" and o,
                               timeout=120)
            assert cond(obj, "Gated")["reason"] == "TokenizerMismatch" and cond(obj, "Gated")["message"]
            assert "vocab" in cond(obj, "TokenizerCompatible")["message"].lower()
            assert ctl.kube.get("apps/v1", "Deployment", NS, f"{bad}-engine") is None
        assert runner.exception is None
    finally:
        engine.stop()
