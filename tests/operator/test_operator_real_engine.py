"""The operator with the real engine: `specpair gate` in the gate Job and `specpair engine serve`
as the pod process, on tiny models (CPU). A compatible pair is gated, recorded and served with
its identity checked over gRPC; a served draft swapped on disk for a bad one drifts, loses
speculation, and is rolled back. (The gate refusing another tokenizer before loading weights is
tested with the engine, tests/test_engine_gate.py; the operator's side of it in
test_operator_e2e.py.)"""

from __future__ import annotations

import json
import shutil
import time as _time
import uuid

import grpc
import pytest
from kopf.testing import KopfRunner
from mlflow import MlflowClient

from specpair._proto import engine_pb2, engine_pb2_grpc
from standins import REAL_GATE, ControllerStandIn, EngineProcesses, free_port
from test_operator_e2e import NS, OPERATOR, cond, serving, smp

CODE_PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n    print(", "import json\n\ndef load(path):",
                "class Point:\n    def __init__(self, x, y):"]


def real_fingerprint(path: str) -> str:
    from transformers import AutoTokenizer

    from specpair.tokenizer_identity import fingerprint

    return fingerprint(AutoTokenizer.from_pretrained(path))["sha256"]


def tiny_pair(name: str, target: str, draft: str, port: int, **spec) -> dict:
    return {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": name, "namespace": NS},
            "spec": {"target": {"source": target}, "draft": {"source": draft}, "speculation": {"k": 3},
                     "gating": {"prompts": [{"prompt": CODE_PROMPTS[0], "category": "code"},
                                            {"prompt": CODE_PROMPTS[1], "category": "code"},
                                            {"prompt": "The weather today is", "category": "chat"}],
                                "maxNewTokens": 12, "thresholds": {"requireGreedyIdentity": True}},
                     # Tiny models on CPU: speculation never pays, so the gate's tuning would switch it
                     # off in serving; this test needs it on to watch acceptance drift.
                     "rollout": {"port": port, "applyGateTuning": False}, **spec}}


def send_code_traffic(port: int, n: int = 2) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for i in range(n):
            req = engine_pb2.GenerateRequest(prompt=CODE_PROMPTS[i % len(CODE_PROMPTS)], max_new_tokens=12, category="code")
            try:
                for _ in stub.Generate(req, timeout=30):
                    pass
            except grpc.RpcError:
                return  # a pod being replaced; the next round goes to the new one


def test_real_gate_and_engine_serve_then_roll_back_a_drifting_draft(
        kube, kubeconfig, mlflow_server, tiny_pair_dirs, tiny_tokenizer, tmp_path, monkeypatch):
    from tiny_models import make_model, save_tiny

    target, good = tiny_pair_dirs["target"], tiny_pair_dirs["draft"]
    swappable = str(tmp_path / "draft-v2")
    shutil.copytree(good, swappable)
    world = tmp_path / "world.json"
    world.write_text("{}")
    monkeypatch.setenv("SPECPAIR_MLFLOW_TRACKING_URI", mlflow_server.url)
    processes = EngineProcesses(tmp_path)
    ctl = ControllerStandIn(kube, None, tmp_path, world, NS, gate=REAL_GATE, processes=processes)
    name = f"tiny-{uuid.uuid4().hex[:5]}"
    model = f"{NS}-{name}"
    port = free_port()
    mlflow = MlflowClient(mlflow_server.url)
    drift = {"intervalSeconds": 1, "windowSeconds": 10, "minDraftedTokens": 20, "consecutiveBreaches": 2,
             "tolerance": 0.05, "noiseAllowance": 0.05}
    try:
        with KopfRunner(OPERATOR, timeout=60) as runner:
            # The compatible pair: gated by the real gate, served by a real engine process.
            ctl.kube.create(tiny_pair(name, target, good, port, drift=drift))
            obj = ctl.wait_for("v1 serving", lambda: serving(ctl, name, "1"), timeout=300)
            gate = obj["status"]["lastGate"]
            assert gate["passed"] and gate["greedyIdentity"] == 1.0 and set(gate["categories"]) == {"code", "chat"}
            tags = mlflow.get_model_version(model, "1").tags
            assert tags["specpair.tokenizer.target_fingerprint"] == real_fingerprint(target)
            assert tags["specpair.tokenizer.draft_fingerprint"] == real_fingerprint(good)
            run_id = tags["specpair.gate.run_id"]
            assert {"gate/verdict.json", "gate/golden_outputs.json"} <= {a.path for a in mlflow.list_artifacts(run_id, "gate")}
            assert "acceptance_rate.code" in mlflow.get_run(run_id).data.metrics

            ctl.kube.patch("specpair.io/v1alpha1", "SpecModelPair", NS, name, {"spec": {"draft": {"source": swappable}}})
            obj = ctl.wait_for("v2 serving", lambda: serving(ctl, name, "2"), timeout=300)
            baseline = obj["status"]["lastGate"]["categories"]["code"]
            # Gated acceptance of this tiny draft varies between identical runs (0.2 to 0.35 seen):
            # the drift floor (baseline - 0.1) must stay above what a random draft gets (about 0).
            assert baseline > 0.12, f"the tiny draft should be accepted at the gate, got {baseline}"

            # Someone replaces the files behind v2's draft path; the pod restarts onto them.
            save_tiny(make_model(tiny_tokenizer, seed=9), swappable)
            processes.restart(next(iter(processes.procs)))
            obj = ctl.wait_for("speculation off", lambda: (o := smp(ctl, name)) and o["status"].get("speculationEnabled") is False and o,
                               timeout=180, during=lambda: send_code_traffic(port),
                               show=lambda: {k: smp(ctl, name)["status"].get(k) for k in ("live", "drift", "lastGate")})
            assert obj["status"]["live"]["acceptance"]["code"] < baseline - 0.1
            assert "category 'code' acceptance" in cond(obj, "Drifted")["message"]
            obj = ctl.wait_for("rolled back to v1", lambda: (o := smp(ctl, name)) and o["status"].get("servingVersion") == "1"
                               and cond(o, "Stalled").get("reason") == "ReleaseNotServable" and o,
                               timeout=180, during=lambda: send_code_traffic(port, 1))
            actions = [h["action"] for h in obj["status"]["history"]]
            assert actions[-3:] == ["SpeculationOff", "RolledBack", "RolloutStarted"]
            assert mlflow.get_registered_model(model).aliases["champion"] == "1"
            # The rolled-back release stays out of service although the spec still names it.
            for _ in range(6):
                ctl.step()
                _time.sleep(0.3)
            assert mlflow.get_registered_model(model).aliases["champion"] == "1"
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
            assert (info.pair, info.version, info.speculation.enabled) == (name, "1", True)
        assert runner.exception is None
    finally:
        processes.stop_all()
