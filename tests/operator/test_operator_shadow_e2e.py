"""Shadow scoring end to end: the operator (real Kopf) on the real control plane, the real gate in
the gate Jobs and `specpair engine serve` in the engine pods, on the tiny models (CPU). v1 serves
with a draft that the target rarely accepts; v2, the same target with a better draft, passes its
gate and is scored in shadow on v1's pod (real GetStats.shadow from the real engine) while code
traffic flows, and is promoted on that evidence. v3 goes back to the poor draft: it passes its
gate too, is scored against v2 on live traffic, and is Rejected with the numbers; v2 keeps
serving, its pod rendered without the shadow again.

Traffic goes to the one ready engine pod's IP, as the Service's EndpointSlice would deliver it
with one replica (the devcluster has no kube-proxy)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import grpc
import pytest
from kopf.testing import KopfRunner
from mlflow import MlflowClient

from specpair._proto import engine_pb2, engine_pb2_grpc
from specpair_devcluster.client import ApiError
from specpair_operator import manifests
from specpair_operator.shadow_run import TAG_SHADOW_VERDICT
from specpair_operator.validation import validate_spec
from cluster_env import CODE_PROMPTS, OPERATOR, cond, engine_pods, model_name, pair, serving, set_spec, tiny_pair

pytestmark = pytest.mark.slow


def ready_address(ns) -> str | None:
    """The ready engine pod's gRPC address."""
    for pod in engine_pods(ns):
        if any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])):
            return f"{pod['status']['podIP']}:50051"
    return None


def code_traffic(ns, n: int = 4) -> None:
    address = ready_address(ns)
    if address is None:
        return
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for i in range(n):
            req = engine_pb2.GenerateRequest(prompt=CODE_PROMPTS[i % len(CODE_PROMPTS)], max_new_tokens=32,
                                             category="code")
            try:
                for _ in stub.Generate(req, timeout=30):
                    pass
            except grpc.RpcError:
                return  # a pod being replaced; the next look sends to the new one


def shadowed_by(ns, name: str) -> str | None:
    """The version of the candidate the pair's engine Deployment scores in shadow (None: none)."""
    dep = ns.kube.get("apps/v1", "Deployment", ns.name, manifests.engine_name(name))
    text = (dep["spec"]["template"]["metadata"].get("annotations") or {}).get(manifests.ANN_SHADOW_RELEASE)
    return json.loads(text)["mlflow"]["version"] if text else None


def actions(obj: dict) -> list[str]:
    return [h["action"] for h in obj["status"].get("history") or []]


def test_a_better_draft_is_promoted_by_shadow_scoring_and_a_worse_one_rejected(
        operator_env, ns, mlflow_server, model_dirs, tiny_tokenizer, devcluster):
    from tiny_models import make_model, save_tiny

    target, good = model_dirs["target"], model_dirs["draft"]
    poor = save_tiny(make_model(tiny_tokenizer, seed=9), Path(good).parent / "draft-poor")
    name = f"shadow-{uuid.uuid4().hex[:5]}"
    mlflow = MlflowClient(mlflow_server.url)
    rollout = {"applyGateTuning": False, "shadow": {"share": 1.0, "minRequests": 10, "maxSeconds": 600}}
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(tiny_pair(name, target, str(poor), drift={"enabled": False}, rollout=rollout))
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=300)

        # v2: only the draft differs, so it is scored in shadow, not promoted, once it passes its gate.
        set_spec(ns, name, {"draft": {"source": good}})
        obj = ns.wait_for("v2 scored in shadow on v1's pod",
                          lambda: (o := ns.pair(name)) and cond(o, "ShadowScored").get("reason") == "Scoring"
                          and shadowed_by(ns, name) == "2" and o, timeout=300)
        assert obj["status"]["servingVersion"] == "1" and "ShadowStarted" in actions(obj)
        assert cond(obj, "ShadowScored")["observedGeneration"] == obj["metadata"]["generation"]
        obj = ns.wait_for_during("v2 promoted by shadow scoring", lambda: serving(ns, name, "2"),
                                 during=lambda: code_traffic(ns), timeout=300)
        history = actions(obj)
        assert [a for a in history if a in ("ShadowStarted", "ShadowPromoted", "Promoted")] == \
            ["Promoted", "ShadowStarted", "ShadowPromoted", "Promoted"]
        scored = obj["status"]["shadow"]
        assert scored["version"] == "2" and scored["result"] == "Promote"
        code = scored["categories"]["code"]
        assert code["candidateAlpha"] > code["championAlpha"] and code["requests"] >= 10, scored
        assert shadowed_by(ns, name) is None
        assert mlflow.get_model_version_by_alias(model_name(ns, name), "champion").version == "2"

        # v3: the poor draft again (with another k, so another release): it passes its gate but
        # loses to v2 on the same live requests, and is rejected; v2 keeps serving.
        set_spec(ns, name, {"draft": {"source": str(poor)}, "speculation": {"k": 2, "fallbackThreshold": 0}})
        ns.wait_for("v3 scored in shadow on v2's pod", lambda: shadowed_by(ns, name) == "3", timeout=300)
        obj = ns.wait_for_during("v3 rejected",
                                 lambda: (o := ns.pair(name)) and cond(o, "ShadowScored").get("reason") == "Rejected"
                                 and o, during=lambda: code_traffic(ns), timeout=300)
        assert obj["status"]["servingVersion"] == "2" and obj["status"]["lastGate"]["passed"]
        assert actions(obj)[-1] == "ShadowRejected" and actions(obj).count("Promoted") == 2
        verdict = json.loads(mlflow.get_model_version(model_name(ns, name), "3").tags[TAG_SHADOW_VERDICT])
        code = verdict["categories"]["code"]
        assert verdict["result"] == "Rejected" and code["status"] == "worse", verdict
        assert code["candidateAlpha"] < code["championAlpha"]
        ns.wait_for("v2's pod without the shadow", lambda: shadowed_by(ns, name) is None, timeout=60)
        obj = ns.wait_for("v2 rolled out again, v3 reported not servable",
                          lambda: (o := ns.pair(name)) and cond(o, "Stalled").get("reason") == "ReleaseNotServable"
                          and o, timeout=120)
        assert "rejected by shadow scoring" in cond(obj, "Stalled")["message"]
        assert cond(obj, "Ready")["reason"] == "ChampionKeepsServing"
    assert runner.exception is None


@pytest.mark.parametrize("change", [
    {"rollout": {"strategy": {"type": "Blue"}}},
    {"rollout": {"shadow": {"share": 0}}},
    {"rollout": {"shadow": {"share": 1.5, "minRequests": 0, "maxSeconds": 0}}},
    {"engine": "vllm", "rollout": {"strategy": {"type": "Shadow"}}},
])
def test_bad_rollout_strategies_are_refused_by_the_api_server_and_the_operator_in_the_same_words(
        operator_env, ns, change):
    bad = pair("bad-strategy", "good-draft", **change)
    with pytest.raises(ApiError) as err:
        ns.create(bad)
    assert err.value.status == 422
    ours = validate_spec(bad["spec"])
    assert ours, f"the operator's check let through what the API server refused: {err.value.message}"
    for message in ours:
        assert message in err.value.message, (message, err.value.message)
