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

import json
import shutil
import uuid
from pathlib import Path

import grpc
from kopf.testing import KopfRunner
from mlflow import MlflowClient

from specpair._proto import engine_pb2, engine_pb2_grpc
from cluster_env import CODE_PROMPTS, OPERATOR, cond, engine_pods, model_name, serving, set_spec, tiny_pair
from steady_client import SteadyClient, ready_address
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
        ns.wait_for("a new pod", lambda: (a := ready_address(ns)) and old["status"]["podIP"] not in a, timeout=180)
        obj = ns.wait_for_during("speculation off", lambda: (o := ns.pair(name)) and
                                 o["status"].get("speculationEnabled") is False and o,
                                 during=lambda: send_code_traffic(ready_address(ns), 4), timeout=240)
        assert "category 'code'" in cond(obj, "Drifted")["message"]
        assert [h["action"] for h in obj["status"]["history"]][-1] == "SpeculationOff"
        # The real engine was told: it serves target-only now.
        with grpc.insecure_channel(ready_address(ns)) as channel:
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


def test_a_draft_only_release_is_swapped_into_the_running_pod_and_one_it_cannot_swap_rolls_it(
        operator_env, ns, mlflow_server, model_dirs, devcluster):
    """Promotion in place with the real engine (plan/serving_draft_swap.py): v1 drafts with a draft
    model, whose cache the engine keeps in its paged pool (the CPU's default), so v2 (the n-gram
    lookup) is refused by the engine and the pod rolls; v3 (a draft model again) is swapped into
    v2's running pod, under a steady stream of greedy requests: the same pod, 0 failed, every reply
    the same, and the pod reports v3's draft."""
    from cluster_env import ONE_PROMPT_GATING
    from specpair.contract import content_hash
    from specpair_operator.desired import manifests

    target, draft = model_dirs["target"], model_dirs["draft"]
    again = str(Path(draft).parent / "draft-again")      # v3's draft: v1's weights at another path
    shutil.copytree(draft, again, dirs_exist_ok=True)
    name = f"swap-{uuid.uuid4().hex[:5]}"
    spec = tiny_pair(name, target, draft, drift={"enabled": False}, gating=ONE_PROMPT_GATING,
                     rollout={"applyGateTuning": False, "strategy": {"type": "Replace"}})

    def history(obj: dict) -> list[tuple[str, str]]:
        return [(h["action"], h["toVersion"]) for h in obj["status"].get("history") or []]

    def pods() -> list[tuple[str, str]]:
        return sorted((p["metadata"]["name"], p["metadata"]["uid"]) for p in engine_pods(ns))

    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(spec)
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=300)
        v1_pods = pods()
        # v2 drafts with the n-gram lookup: v1's draft model lives in the paged pool, so the engine
        # refuses the swap and the pod rolls.
        set_spec(ns, name, {"draft": {"source": None, "drafter": "ngram"}})
        obj = ns.wait_for("v2 serving", lambda: serving(ns, name, "2"), timeout=300)
        assert ("DraftSwapRefused", "2") in history(obj) and ("RolloutStarted", "2") in history(obj), history(obj)
        rolled = next(h for h in obj["status"]["history"] if h["action"] == "RolloutStarted" and h["toVersion"] == "2")
        assert "not swapped in place: the engine refused" in rolled["reason"], rolled
        ns.wait_for("v1's pod gone", lambda: len(pods()) == 1 and pods() != v1_pods, timeout=120)
        v2_pods = pods()
        # v3: the draft model again, swapped into v2's running pod under steady traffic.
        with SteadyClient(ns) as client:
            ns.wait_for("replies before the swap", lambda: len(client.replies) == len(client.PROMPTS), timeout=120)
            set_spec(ns, name, {"draft": {"source": again, "drafter": None}})
            obj = ns.wait_for("v3 serving", lambda: serving(ns, name, "3"), timeout=300)
            served = sum(len(r) for r in client.replies.values())
            ns.wait_for("replies after the swap", lambda: sum(len(r) for r in client.replies.values()) >= served + 2,
                        timeout=120)
        assert pods() == v2_pods, "the pod was restarted"
        assert [p["metadata"]["uid"] for p in engine_pods(ns, "3")] == [uid for _, uid in v2_pods]   # relabelled
        assert ("DraftSwapped", "3") in history(obj) and ("RolloutStarted", "3") not in history(obj), history(obj)
        assert not client.failed, client.failed
        for prompt, replies in client.replies.items():
            assert len(set(replies)) == 1, (prompt, replies)
        print("steady client across the swap:", {p[:12]: len(r) for p, r in client.replies.items()}, "0 failed")
        dep = ns.get("apps/v1", "Deployment", manifests.engine_name(name))
        release = json.loads(dep["spec"]["template"]["metadata"]["annotations"][manifests.ANN_RELEASE])
        assert release["draft"].get("source") == again and release["mlflow"]["version"] == "3"
        with grpc.insecure_channel(ready_address(ns)) as channel:
            info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
        assert (info.version, info.draft_version, info.draft.kind) == ("2", "3", "model"), info
        assert info.draft_content_hash == content_hash(release) != info.content_hash
    assert runner.exception is None
