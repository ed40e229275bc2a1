"""The canary end to end: the operator (real Kopf) on the real control plane, the real gate in the
gate Jobs and `specpair engine serve` in the engine pods, on tiny models (CPU). v1 serves; v2, a
new target (the same weights from another path) with `rollout.strategy: Canary`, passes its gate,
runs a canary pod beside v1's behind the same Service, is judged on live traffic (the real
engines' GetStats: TTFT and TPOT histograms, requests by status, acceptance) and promoted. v3, a
target of eight layers 256 wide (its prefill about ten times the tiny target's on this CPU),
passes its gate too and is aborted on its TTFT breach with the numbers; v2 keeps serving on the
pod it had.

Each decision is made under kills: the operator runs as a child process with failpoints on its
writes (failing_operator.py); it gates each candidate undisturbed, dies right after the canary's
first write (its Deployment), and from there every life makes one write and is killed, until the
decision has landed and the serving state is final. Status writes are spared: the canary's
evidence is the operator's memory (canary.py), so an operator killed after every pass's status
would never gather any; every status is still lost with the pass a kill ends. The end state is the
undisturbed one: each Event once, one model version per release, the aliases, the condition and
status.canary with the numbers, two Deployments, and the champion answering throughout.

Traffic reaches the pods as the Service would deliver it: round robin over the ready pods its
selector picks, which is what its EndpointSlice would list. The devcluster has no kube-proxy, and
its API server refuses the loopback pod addresses in EndpointSlices (docs/devcluster.md), so the
test client spreads the requests itself."""

from __future__ import annotations

import itertools
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path

import grpc
import pytest
from mlflow import MlflowClient
from specpair_devcluster.client import ApiError

from specpair._proto import engine_pb2, engine_pb2_grpc
from specpair_operator import canary, manifests
from cluster_env import CODE_PROMPTS, ONE_PROMPT_GATING, cond, model_name, service_endpoints, serving, set_spec, tiny_pair
from failing_operator import FailingOperator, history

pytestmark = pytest.mark.slow

_turn = itertools.count()
STATUS = "kube.merge_patch specmodelpairs"     # spared (module docstring)


# Prompts of some 150 tokens: the prefill, not the engine's fixed cost, is most of a request's TTFT.
LONG_PROMPTS = ["\n\n".join(CODE_PROMPTS[i:] + CODE_PROMPTS[:i]) * 3 for i in range(len(CODE_PROMPTS))]


class Traffic:
    """Code requests round robin over the Service's ready endpoints, at most PER_SECOND a second
    however often it is called, counted: answered, and failed on a pod the Service still lists."""

    # Some 3 requests a second a side: the 10 a side a judgement needs (drift.latency.minRequests)
    # within a step's 5 s pause; the operator's lives poll far more often, and each request costs
    # an engine a prefill of some 150 tokens.
    PER_SECOND = 6

    def __init__(self, ns, name: str):
        self.ns, self.name = ns, name
        self.answered = 0
        self.failed: list[str] = []
        self.next_at = 0.0

    def __call__(self, n: int = 2) -> None:
        if time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + n / self.PER_SECOND
        addresses = service_endpoints(self.ns, self.name)
        for _ in range(n if addresses else 0):
            turn = next(_turn)
            address = addresses[turn % len(addresses)]
            req = engine_pb2.GenerateRequest(prompt=LONG_PROMPTS[turn // len(addresses) % len(LONG_PROMPTS)],
                                             max_new_tokens=8, category="code")
            try:
                with grpc.insecure_channel(address) as channel:
                    for _ in engine_pb2_grpc.EngineStub(channel).Generate(req, timeout=30):
                        pass
                self.answered += 1
            except grpc.RpcError as exc:
                if address in service_endpoints(self.ns, self.name):   # not a pod going away
                    self.failed.append(f"{address}: {exc.code()}")
                return  # the next round reads the endpoints again


def canary_replicas(ns, name: str) -> int | None:
    dep = ns.get("apps/v1", "Deployment", manifests.engine_canary_name(name))
    return None if dep is None else int(dep["spec"].get("replicas") or 0)


def canary_entry(ns, name: str, version: str, phase: str) -> dict | None:
    entry = (ns.pair(name).get("status") or {}).get("canary") or {}
    return entry if entry.get("version") == version and entry.get("phase") == phase else None


def events(ns) -> Counter:
    return Counter(e["reason"] for e in ns.events())


def test_a_canary_of_a_new_target_is_promoted_when_healthy_and_aborted_on_a_ttft_breach_killed_after_every_write(
        operator_env, ns, mlflow_server, model_dirs, tiny_tokenizer, devcluster, tmp_path):
    from tiny_models import make_model, save_tiny

    target, draft = model_dirs["target"], model_dirs["draft"]
    same_weights = str(shutil.copytree(target, Path(target).parent / "target-copy"))
    name = f"canary-{uuid.uuid4().hex[:5]}"
    model = model_name(ns, name)
    mlflow = MlflowClient(mlflow_server.url)
    operator = FailingOperator(tmp_path / "writes.jsonl", spare=(STATUS,))
    deployments = sorted([manifests.engine_name(name), manifests.engine_canary_name(name)])
    # Latency judged from 10 requests a side; the canary's TTFT and TPOT may be up to 3x the
    # champion's p95: at a few milliseconds a new pod's TPOT lands a bucket above a warm one's
    # (the engine's buckets are 1, 2.5, 5, 10 ms there), which 1.5x (the default) reads as a breach.
    drift = {"latency": {"minRequests": 10, "ttftP95Ratio": 3.0, "tpotP95Ratio": 3.0}}
    # The API server refuses a step that is both (the operator's check has the same words).
    with pytest.raises(ApiError, match="a canary step gives either replicas or share, not both"):
        ns.create(tiny_pair(f"{name}-bad", target, draft, rollout={
            "strategy": {"type": "Canary", "steps": [{"replicas": 1, "share": 0.5}]}}))
    ns.create(tiny_pair(name, target, draft, drift=drift, gating=ONE_PROMPT_GATING))
    operator.life("log", lambda: serving(ns, name, "1"), time.monotonic() + 300)
    assert serving(ns, name, "1"), ns.pair(name).get("status")

    # v2: another target (the same weights from another path), rolled out as a canary.
    strategy = {"type": "Canary", "steps": [{"replicas": 1, "pauseSeconds": 5}]}
    set_spec(ns, name, {"target": {"source": same_weights},
                        "rollout": {"applyGateTuning": False, "strategy": strategy}})
    operator.killed_after("kube.create Deployment")
    since = len(operator.writes())
    traffic, seen = Traffic(ns, name), set()

    def promoted() -> bool:
        seen.add((len(service_endpoints(ns, name)), canary_replicas(ns, name)))
        return bool(serving(ns, name, "2")) and canary_replicas(ns, name) == 0 \
            and (ns.pair(name)["status"].get("canary") or {}).get("phase") == "Promoted"
    kills = operator.crash_until(promoted, timeout=300, during=traffic)
    crashed = operator.crashed_writes(since)
    for write in ("mlflow.set_model_version_tag specpair.canary", "mlflow.set_model_version_tag specpair.promoted_at",
                  "mlflow.set_registered_model_alias champion", "kube.merge_patch deployments"):
        assert write in crashed, (write, crashed)
    assert (2, 1) in seen, f"v2's canary pod never served beside v1's: {seen}"
    obj = ns.pair(name)
    history_v2 = [h["action"] for h in obj["status"]["history"] if h["toVersion"] == "2"]
    assert history_v2.index("CanaryStarted") < history_v2.index("CanaryPassed") < history_v2.index("Promoted"), history_v2
    counts = history(obj)
    for action in ("GateStarted", "GatePassed", "CanaryStarted", "CanaryPassed", "Promoted"):
        assert counts[(action, "2")] == 1, (action, counts)
    said = events(ns)
    assert (said["CanaryStarted"], said["CanaryPassed"], said["Promoted"], said["CanaryScaledDown"]) == (1, 1, 2, 1), said
    entry = obj["status"]["canary"]
    assert entry["phase"] == "Promoted" and entry["version"] == "2" and entry["champion"] == "1"
    assert entry["trafficShare"] == 0.5
    for key in ("errors:*", "ttft:*", "tpot:*"):
        assert entry["judged"][key]["verdict"] == "fine" and entry["judged"][key]["requests"] >= 10, entry
    canary_cond = cond(obj, canary.CONDITION)
    assert canary_cond["status"] == "True" and canary_cond["reason"] == "Passed"
    assert len(mlflow.search_model_versions(f"name='{model}'")) == 2
    assert mlflow.get_registered_model(model).aliases == {"candidate": "2", "champion": "2", "previous": "1"}
    assert sorted(d["metadata"]["name"] for d in ns.list("apps/v1", "Deployment")) == deployments
    assert traffic.answered >= 20 and not traffic.failed, (traffic.answered, traffic.failed)

    # v3: a target of eight layers 256 wide, several times slower to its first token. Acceptance
    # (drift.minDraftedTokens above what the test drafts) and TPOT (a ratio of 10) are left out
    # of the judgement: the abort is the TTFT breach's.
    slow = save_tiny(make_model(tiny_tokenizer, seed=1, layers=8, hidden=256, heads=4),
                     Path(target).parent / "target-slow")
    v2_pods = set(service_endpoints(ns, name))
    strategy = {"type": "Canary", "steps": [{"replicas": 1, "pauseSeconds": 120}]}
    set_spec(ns, name, {"target": {"source": slow}, "drift": {"minDraftedTokens": 10**9,
                                                             "latency": {**drift["latency"], "tpotP95Ratio": 10.0}},
                        "rollout": {"applyGateTuning": False, "strategy": strategy}})
    operator.killed_after("kube.merge_patch deployments")     # the canary Deployment scaled up again
    since = len(operator.writes())
    traffic, seen = Traffic(ns, name), set()

    def aborted() -> bool:
        seen.add((len(service_endpoints(ns, name)), canary_replicas(ns, name)))
        return canary_replicas(ns, name) == 0 and set(service_endpoints(ns, name)) == v2_pods \
            and bool(canary_entry(ns, name, "3", "Aborted"))
    kills += operator.crash_until(aborted, timeout=300, during=traffic)
    crashed = operator.crashed_writes(since)
    assert "mlflow.set_model_version_tag specpair.canary" in crashed and "kube.merge_patch deployments" in crashed, \
        crashed
    assert (2, 1) in seen, f"v3's canary pod never served beside v2's: {seen}"
    obj = ns.pair(name)
    assert obj["status"]["servingVersion"] == "2"
    entry = obj["status"]["canary"]
    ttft = entry["judged"]["ttft:code"]      # the candidate's p95 against the champion's
    assert ttft["verdict"] == "breach" and ttft["candidate"] > 3 * ttft["champion"], entry
    assert "TTFT p95" in entry["message"] and "candidate worse than the champion" in entry["message"]
    canary_cond = cond(obj, canary.CONDITION)
    assert canary_cond["status"] == "False" and canary_cond["reason"] == "Aborted"
    assert canary_cond["observedGeneration"] == obj["metadata"]["generation"]
    aborted_entries = [h for h in obj["status"]["history"] if h["action"] == "CanaryAborted"]
    assert len(aborted_entries) == 1 and aborted_entries[0]["toVersion"] == "3" and "TTFT" in aborted_entries[0]["reason"]
    counts = history(obj)
    assert counts[("CanaryStarted", "3")] == 1 and counts[("Promoted", "3")] == 0, counts
    said = events(ns)
    assert (said["CanaryStarted"], said["CanaryAborted"], said["Promoted"]) == (2, 1, 2), said
    assert len(mlflow.search_model_versions(f"name='{model}'")) == 3
    assert mlflow.get_registered_model(model).aliases == {"candidate": "3", "champion": "2", "previous": "1"}
    assert sorted(d["metadata"]["name"] for d in ns.list("apps/v1", "Deployment")) == deployments
    assert traffic.answered >= 10 and not traffic.failed, (traffic.answered, traffic.failed)
    assert kills >= 6, kills
