"""Shadow scoring end to end: the operator (real Kopf) on the real control plane, the real gate in
the gate Jobs and `specpair engine serve` in the engine pods, on the tiny models (CPU). v1 serves
with a draft that the target rarely accepts; v2, the same target with a better draft, passes its
gate and is scored in shadow on v1's pod (real GetStats.shadow from the real engine) while code
traffic flows, and is promoted on that evidence. v3 goes back to the poor draft: it passes its
gate too, is scored against v2 on live traffic, and is Rejected with the numbers; v2 keeps
serving, its pod rendered without the shadow again.

Each decision is made under kills: the operator runs as a child process with failpoints on its
writes (failing_operator.py); it gates each candidate undisturbed, dies right after the first
write of the candidate's shadow (the start's mark), and from there every life makes one write
and is killed, until the verdict has landed and the serving state is final. The end state is
the undisturbed one: each Event once, one model version per release, the aliases, the condition
and status.shadow with the numbers, one Deployment, and v1 answering throughout.

Traffic goes to the one ready engine pod's IP, as the Service's EndpointSlice would deliver it
with one replica (the devcluster has no kube-proxy)."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from pathlib import Path

import grpc
import pytest
from mlflow import MlflowClient

from specpair._proto import engine_pb2, engine_pb2_grpc
from specpair_operator.desired import manifests
from specpair_operator.policy.shadow_run import TAG_SHADOW_VERDICT
from cluster_env import CODE_PROMPTS, ONE_PROMPT_GATING, cond, model_name, pair, serving, set_spec, tiny_pair
from failing_operator import FailingOperator, history
from steady_client import ready_address

pytestmark = pytest.mark.slow

MARK = "mlflow.set_model_version_tag specpair.shadow.started_at"   # a shadow's first write


class Traffic:
    """Code requests to the ready engine pod, at most PER_SECOND a second however often it is
    called, counted: answered, and failed on a pod that stays."""

    # Some 10 shadowed requests in 3 s, the most the verdict asks for (rollout.shadow.minRequests);
    # the operator's lives poll far more often, and each request costs the engine a generation.
    PER_SECOND = 4

    def __init__(self, ns):
        self.ns = ns
        self.answered = 0
        self.failed: list[str] = []
        self.next_at = 0.0

    def __call__(self, n: int = 1) -> None:
        if time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + n / self.PER_SECOND
        address = ready_address(self.ns)
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
                    self.answered += 1
                except grpc.RpcError as exc:
                    if address == ready_address(self.ns):   # not a pod being replaced
                        self.failed.append(f"{address}: {exc.code()}")
                    return


def shadowed_by(ns, name: str) -> str | None:
    """The version of the candidate the pair's engine Deployment scores in shadow (None: none)."""
    dep = ns.kube.get("apps/v1", "Deployment", ns.name, manifests.engine_name(name))
    text = (dep["spec"]["template"]["metadata"].get("annotations") or {}).get(manifests.ANN_SHADOW_RELEASE)
    return json.loads(text)["mlflow"]["version"] if text else None


def actions(obj: dict) -> list[str]:
    return [h["action"] for h in obj["status"].get("history") or []]


def events(ns) -> Counter:
    return Counter(e["reason"] for e in ns.events())


def test_a_better_draft_is_promoted_by_shadow_scoring_and_a_worse_one_rejected_killed_after_every_write(
        operator_env, ns, mlflow_server, model_dirs, tiny_tokenizer, devcluster, tmp_path):
    from tiny_models import make_model, save_tiny

    target, good = model_dirs["target"], model_dirs["draft"]
    poor = save_tiny(make_model(tiny_tokenizer, seed=9), Path(good).parent / "draft-poor")
    name = f"shadow-{uuid.uuid4().hex[:5]}"
    model = model_name(ns, name)
    mlflow = MlflowClient(mlflow_server.url)
    operator = FailingOperator(tmp_path / "writes.jsonl")
    rollout = {"applyGateTuning": False, "shadow": {"share": 1.0, "minRequests": 10, "maxSeconds": 600}}
    ns.create(tiny_pair(name, target, str(poor), drift={"enabled": False}, rollout=rollout, gating=ONE_PROMPT_GATING))
    operator.life("log", lambda: serving(ns, name, "1"), time.monotonic() + 300)
    assert serving(ns, name, "1"), ns.pair(name).get("status")

    # v2: only the draft differs, so it is scored in shadow, not promoted, once it passes its gate.
    set_spec(ns, name, {"draft": {"source": good}})
    traffic, seen = Traffic(ns), set()
    operator.killed_after(MARK)
    since = len(operator.writes())

    def promoted() -> bool:
        obj = ns.pair(name)
        seen.add((cond(obj, "ShadowScored").get("reason"), shadowed_by(ns, name)))
        return bool(serving(ns, name, "2")) and shadowed_by(ns, name) is None
    kills = operator.crash_until(promoted, timeout=300, during=traffic)
    crashed = operator.crashed_writes(since)
    for write in ("kube.merge_patch deployments", "mlflow.set_model_version_tag specpair.shadow.verdict",
                  "mlflow.set_model_version_tag specpair.promoted_at", "mlflow.set_registered_model_alias champion"):
        assert write in crashed, (write, crashed)
    assert crashed.count(MARK) == 0, "the start was marked again after its pass died"
    assert ("Scoring", "2") in seen, seen
    obj = ns.pair(name)
    assert [a for a in actions(obj) if a in ("ShadowStarted", "ShadowPromoted", "Promoted")] == \
        ["Promoted", "ShadowStarted", "ShadowPromoted", "Promoted"]
    counts = history(obj)
    for action in ("GateStarted", "GatePassed", "ShadowStarted", "ShadowPromoted", "Promoted"):
        assert counts[(action, "2")] == 1, (action, counts)
    said = events(ns)
    assert (said["ShadowStarted"], said["ShadowPromoted"], said["Promoted"]) == (1, 1, 2), said
    scored = obj["status"]["shadow"]
    assert scored["version"] == "2" and scored["champion"] == "1" and scored["result"] == "Promote"
    code = scored["categories"]["code"]
    assert code["candidateAlpha"] > code["championAlpha"] and code["requests"] >= 10, scored
    shadow_cond = cond(obj, "ShadowScored")
    assert shadow_cond["status"] == "True" and shadow_cond["reason"] == "Promoted"
    assert len(mlflow.search_model_versions(f"name='{model}'")) == 2
    assert mlflow.get_registered_model(model).aliases == {"candidate": "2", "champion": "2", "previous": "1"}
    assert [d["metadata"]["name"] for d in ns.list("apps/v1", "Deployment")] == [manifests.engine_name(name)]
    assert traffic.answered >= 10 and not traffic.failed, (traffic.answered, traffic.failed)

    # v3: the poor draft again (with another k, so another release): it passes its gate but
    # loses to v2 on the same live requests, and is rejected; v2 keeps serving.
    set_spec(ns, name, {"draft": {"source": str(poor)}, "speculation": {"k": 2, "fallbackThreshold": 0}})
    operator.killed_after(MARK)
    traffic = Traffic(ns)
    since = len(operator.writes())

    def rejected() -> bool:
        obj = ns.pair(name)
        return cond(obj, "ShadowScored").get("reason") == "Rejected" and shadowed_by(ns, name) is None \
            and cond(obj, "Stalled").get("reason") == "ReleaseNotServable"
    kills += operator.crash_until(rejected, timeout=300, during=traffic)
    crashed = operator.crashed_writes(since)
    assert "mlflow.set_model_version_tag specpair.shadow.verdict" in crashed and MARK not in crashed, crashed
    obj = ns.pair(name)
    assert obj["status"]["servingVersion"] == "2" and obj["status"]["lastGate"]["passed"]
    counts = history(obj)
    for action in ("GatePassed", "ShadowStarted", "ShadowRejected"):
        assert counts[(action, "3")] == 1, (action, counts)
    assert counts[("Promoted", "3")] == 0 and actions(obj).count("Promoted") == 2
    said = events(ns)
    assert (said["ShadowStarted"], said["ShadowRejected"], said["Promoted"]) == (2, 1, 2), said
    verdict = json.loads(mlflow.get_model_version(model, "3").tags[TAG_SHADOW_VERDICT])
    code = verdict["categories"]["code"]
    assert verdict["result"] == "Rejected" and code["status"] == "worse", verdict
    assert code["candidateAlpha"] < code["championAlpha"]
    assert obj["status"]["shadow"]["result"] == "Rejected" and obj["status"]["shadow"]["version"] == "3"
    assert obj["status"]["shadow"]["categories"]["code"] == code
    assert "rejected by shadow scoring" in cond(obj, "Stalled")["message"]
    assert cond(obj, "Ready")["reason"] == "ChampionKeepsServing"
    assert len(mlflow.search_model_versions(f"name='{model}'")) == 3
    assert mlflow.get_registered_model(model).aliases == {"candidate": "3", "champion": "2", "previous": "1"}
    assert [d["metadata"]["name"] for d in ns.list("apps/v1", "Deployment")] == [manifests.engine_name(name)]
    assert traffic.answered >= 10 and not traffic.failed, (traffic.answered, traffic.failed)
    assert kills >= 8, kills


@pytest.mark.parametrize("change", [
    {"rollout": {"strategy": {"type": "Blue"}}},
    {"rollout": {"shadow": {"share": 0}}},
    {"rollout": {"shadow": {"share": 1.5, "minRequests": 0, "maxSeconds": 0}}},
    {"engine": "vllm", "rollout": {"strategy": {"type": "Shadow"}}},
])
def test_bad_rollout_strategies_are_refused_by_the_api_server_and_the_operator_in_the_same_words(
        operator_env, ns, change):
    ns.assert_refused_in_the_operators_words(pair("bad-strategy", "good-draft", **change))
