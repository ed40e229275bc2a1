"""The operator with the real engine on the real control plane: `specpair gate` in the gate Job and
`specpair engine serve` in the engine pods (the project's engine image, run by the devcluster
node), on tiny models (CPU). A compatible pair is gated, recorded and served with its identity
checked over gRPC (a golden prompt asking for JSON judged and recorded as schema validity); its
draft swapped on disk for a bad one drifts on the real engine's counters, and the operator turns
speculation off on it, the SpeculationOff readable in MLflow (tag in words, history, event run). (What the drift ladder does next, a rollback or
not, is decided by serving_plan.py and proven as tables in test_operator_serving_plan.py; a
rollback end to end in test_operator_e2e.py. The gate refusing another tokenizer before loading
weights is tested with the engine, tests/engine/test_engine_gate.py.)"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import grpc
from kopf.testing import KopfRunner
from mlflow import MlflowClient

from specpair._proto import engine_pb2, engine_pb2_grpc
from cluster_env import CODE_PROMPTS, OPERATOR, cond, engine_pods, model_name, serving, tiny_pair
from specpair_operator.release.registry_contract import gate_experiment

# One key, two values: the reply is a handful of the tiny tokenizer's tokens (maxNewTokens 12).
PICK = {"type": "object", "additionalProperties": False, "required": ["a"], "properties": {"a": {"enum": [1, 2]}}}


def real_fingerprint(path: str) -> str:
    from transformers import AutoTokenizer

    from specpair.tokenizer_identity import fingerprint

    return fingerprint(AutoTokenizer.from_pretrained(path))["sha256"]


def send_code_traffic(address: str | None, n: int = 2) -> None:
    if address is None:
        return
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for i in range(n):
            req = engine_pb2.GenerateRequest(prompt=CODE_PROMPTS[i % len(CODE_PROMPTS)], max_new_tokens=12, category="code")
            try:
                for _ in stub.Generate(req, timeout=30):
                    pass
            except grpc.RpcError:
                return  # a pod being replaced; the next round goes to the new one


def serving_address(ns) -> str | None:
    """The ready engine pod's gRPC address (pod IP: there is no kube-proxy on devcluster)."""
    for pod in engine_pods(ns):
        if any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])):
            return f"{pod['status']['podIP']}:50051"
    return None


def test_real_gate_and_engine_serve_then_turn_speculation_off_on_a_drifting_draft(
        operator_env, ns, mlflow_server, model_dirs, tiny_tokenizer, devcluster):
    from tiny_models import make_model, save_tiny

    target, good = model_dirs["target"], model_dirs["draft"]
    swappable = str(Path(good).parent / "draft-swappable")
    shutil.copytree(good, swappable)
    name = f"tiny-{uuid.uuid4().hex[:5]}"
    model = model_name(ns, name)
    mlflow = MlflowClient(mlflow_server.url)
    drift = {"intervalSeconds": 1, "windowSeconds": 10, "minDraftedTokens": 20, "minRequests": 4,
             "consecutiveBreaches": 1, "probeAfterWindows": 1000, "ladder": ["SpeculationOff"]}
    spec = tiny_pair(name, target, swappable, drift=drift)
    # A golden prompt that asks for JSON, as a client would: it reaches the real gate through the
    # CRD and the release, and its schema validity is judged and recorded beside acceptance.
    spec["spec"]["gating"]["prompts"].append({"prompt": "Pick one as JSON:", "category": "json", "response_format": {
        "type": "json_schema", "json_schema": {"name": "pick", "schema": PICK}}})
    with KopfRunner(OPERATOR, timeout=60) as runner:
        # The compatible pair: gated by the real gate, served by a real engine pod.
        ns.create(spec)
        obj = ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=300)
        gate = obj["status"]["lastGate"]
        assert gate["passed"] and gate["greedyIdentity"] == 1.0 and set(gate["categories"]) == {"code", "chat", "json"}
        assert gate["categories"]["code"] > 0.12, f"the tiny draft should be accepted at the gate, got {gate}"
        tags = mlflow.get_model_version(model, "1").tags
        assert tags["specpair.tokenizer.target_fingerprint"] == real_fingerprint(target)
        assert tags["specpair.tokenizer.draft_fingerprint"] == real_fingerprint(swappable)
        run_id = tags["specpair.gate.run_id"]
        assert {"gate/verdict.json", "gate/golden_outputs.json"} <= {a.path for a in mlflow.list_artifacts(run_id, "gate")}
        metrics = mlflow.get_run(run_id).data.metrics
        assert "acceptance_rate.code" in metrics
        assert metrics["schema_validity.json"] == 1.0 and "schema_validity.code" not in metrics

        # Someone replaces the files behind the draft's path; the pod is replaced and loads them.
        save_tiny(make_model(tiny_tokenizer, seed=9), swappable)
        (old,) = engine_pods(ns, "1")
        ns.kube.delete("v1", "Pod", ns.name, old["metadata"]["name"])
        ns.wait_for("a new pod", lambda: (a := serving_address(ns)) and old["status"]["podIP"] not in a, timeout=180)
        obj = ns.wait_for_during("speculation off", lambda: (o := ns.pair(name)) and
                                 o["status"].get("speculationEnabled") is False and o,
                                 during=lambda: send_code_traffic(serving_address(ns), 4), timeout=240)
        assert "category 'code'" in cond(obj, "Drifted")["message"]
        assert [h["action"] for h in obj["status"]["history"]][-1] == "SpeculationOff"
        # The real engine was told: it serves target-only now.
        with grpc.insecure_channel(serving_address(ns)) as channel:
            info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
        assert (info.pair, info.version, info.speculation.enabled) == (name, "1", False)
        # The SpeculationOff a reviewer reads in MLflow: a short tag in words on the version, a
        # line in its history, and a run of its own with the drift judgement's figures.
        version = ns.wait_for("the speculation-off record", lambda: (
            v := mlflow.get_model_version(model, "1")) and "specpair.event.speculation-off" in v.tags and v, timeout=60)
        said = version.tags["specpair.event.speculation-off"]
        assert said.startswith("v1 serving target-only (speculation off): sustained drift: ") and \
            "category 'code' acceptance" in said, said
        assert "**speculation-off**: v1 serving target-only" in version.description
        exp = mlflow.get_experiment_by_name(gate_experiment(model))
        [event] = mlflow.search_runs([exp.experiment_id], filter_string="tags.`specpair.event` = 'speculation-off'")
        assert event.info.run_name == "speculation-off-v1" and event.data.metrics["live_acceptance.code"] < 0.3
    assert runner.exception is None
