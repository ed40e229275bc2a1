"""The canary end to end: the operator (real Kopf) on the real control plane, the real gate in the
gate Jobs and `specpair engine serve` in the engine pods, on tiny models (CPU). v1 serves on one
pod; v2, a new target (the same weights from another path) with `rollout.strategy: Canary` in two
steps (`share: 0.5` of the champion's replicas: one pod beside v1's; then `replicas: 2`), passes
its gate, runs its canary pods beside v1's behind the same Service, is judged on live traffic at
each step (the real engines' GetStats: TTFT and TPOT histograms, requests by status, acceptance),
advances, and is promoted. v3, a target of eight layers 512 wide (its warm prefill many times the
tiny target's on this CPU), passes its gate too and is aborted on its TTFT breach with the
numbers; v2 keeps serving on the pod it had.

Each decision is made under kills: the operator runs as a child process with failpoints on its
writes (failing_operator.py); it gates each candidate undisturbed, dies right after the canary's
first write (its Deployment), and from there every life makes one write and is killed (the
advance's scale-up among them), until the decision has landed and the serving state is final.
Status writes are spared: the canary's evidence is the operator's memory (canary.py), so an
operator killed after every pass's status would never gather any; every status is still lost with
the pass a kill ends. What a user watching v2 sees is checked at every look: the canary
Deployment's replicas and step annotation going one way, the Service's ready endpoints holding
the canary's pods beside the champion's at each step, status.canary's step and numbers. The end
state is the undisturbed one: each Event once (one CanaryAdvanced for the one advance), one model
version per release, the aliases, the condition and status.canary with the numbers, two
Deployments, and the champion answering throughout.

Traffic reaches the pods as the Service would deliver it: round robin over the ready pods its
selector picks, which is what its EndpointSlice would list. The devcluster has no kube-proxy, and
its API server refuses the loopback pod addresses in EndpointSlices (docs/devcluster.md), so the
test client spreads the requests itself."""

from __future__ import annotations

import itertools
import re
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
from specpair_operator.policy import canary
from specpair_operator.desired import manifests
from cluster_env import (CODE_PROMPTS, ONE_PROMPT_GATING, cond, engine_pods, model_name, service_endpoints, serving,
                         set_spec, tiny_pair)
from failing_operator import FailingOperator, history

pytestmark = pytest.mark.slow

_turn = itertools.count()
STATUS = "kube.merge_patch specmodelpairs"     # spared (module docstring)


# Prompts of some 150 tokens: the prefill, not the engine's fixed cost, is most of a request's TTFT.
LONG_PROMPTS = ["\n\n".join(CODE_PROMPTS[i:] + CODE_PROMPTS[:i]) * 3 for i in range(len(CODE_PROMPTS))]


def tracks(ns) -> dict[str, str]:
    """Each engine pod's gRPC address (as service_endpoints gives it) -> 'canary' or 'champion'."""
    return {f"{p['status']['podIP']}:50051": "canary" if canary.is_canary_pod(p) else "champion"
            for p in engine_pods(ns) if p["status"].get("podIP")}


class Traffic:
    """Code requests round robin over the Service's ready endpoints, at most PER_SECOND a second
    however often it is called, counted: answered (by `stage`, what the test last saw, and the
    pod's track), and failed on a pod the Service still lists."""

    # Some 3 requests a second a side with one pod a side (2 a pod with three): the 10 a side a
    # judgement needs (drift.latency.minRequests) within a few seconds of a step; the operator's
    # lives poll far more often, and each request costs an engine a prefill of some 150 tokens.
    PER_SECOND = 6

    def __init__(self, ns, name: str):
        self.ns, self.name = ns, name
        self.answered: Counter = Counter()      # (stage, track) -> requests answered
        self.stage = ""
        self.failed: list[str] = []
        self.next_at = 0.0

    def __call__(self, n: int = 2) -> None:
        if time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + n / self.PER_SECOND
        addresses = service_endpoints(self.ns, self.name)
        track = tracks(self.ns)
        for _ in range(n if addresses else 0):
            turn = next(_turn)
            address = addresses[turn % len(addresses)]
            req = engine_pb2.GenerateRequest(prompt=LONG_PROMPTS[turn // len(addresses) % len(LONG_PROMPTS)],
                                             max_new_tokens=8, category="code")
            try:
                with grpc.insecure_channel(address) as channel:
                    for _ in engine_pb2_grpc.EngineStub(channel).Generate(req, timeout=30):
                        pass
                self.answered[(self.stage, track.get(address, "gone"))] += 1
            except grpc.RpcError as exc:
                if address in service_endpoints(self.ns, self.name):   # not a pod going away
                    self.failed.append(f"{time.strftime('%H:%M:%S')} {address} ({self.stage or 'no step'}, "
                                       f"{track.get(address, 'gone')}): {exc.code()}: {exc.details()}; "
                                       f"{pod_state(self.ns, address)}")
                return  # the next round reads the endpoints again


def pod_state(ns, address: str) -> str:
    """The pod at a gRPC address as the API server has it, for a failed request's line: its name,
    readiness, restarts and its containers' states (a restart or a stop shows there)."""
    for p in engine_pods(ns):
        if f"{p['status'].get('podIP')}:50051" == address:
            ready = next((c["status"] for c in p["status"].get("conditions", []) if c["type"] == "Ready"), "?")
            containers = [(c.get("restartCount"), list(c.get("state") or {}))
                          for c in p["status"].get("containerStatuses", [])]
            return f"pod {p['metadata']['name']} Ready={ready} restarts, state: {containers}"
    return "no pod at that address"


def canary_replicas(ns, name: str) -> int | None:
    dep = ns.get("apps/v1", "Deployment", manifests.engine_canary_name(name))
    return None if dep is None else int(dep["spec"].get("replicas") or 0)


def canary_look(ns, name: str) -> dict:
    """What a user watching the rollout sees at one moment: the canary Deployment's replicas and
    step annotation, the ready endpoints of the Service by track, and status.canary's step."""
    dep = ns.get("apps/v1", "Deployment", manifests.engine_canary_name(name)) or {}
    entry = (ns.pair(name).get("status") or {}).get("canary") or {}
    ready = Counter(tracks(ns).get(a, "gone") for a in service_endpoints(ns, name))
    return {"replicas": int((dep.get("spec") or {}).get("replicas") or 0),
            "annotation": ((dep.get("metadata") or {}).get("annotations") or {}).get(canary.ANN_STEP),
            "champion": ready["champion"], "canary": ready["canary"],
            "status": tuple(entry.get(k) for k in ("version", "phase", "step", "steps", "replicas", "trafficShare"))}


def changes(values) -> list:
    """The values in order, each run of equal ones as one."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def canary_entry(ns, name: str, version: str, phase: str) -> dict | None:
    entry = (ns.pair(name).get("status") or {}).get("canary") or {}
    return entry if entry.get("version") == version and entry.get("phase") == phase else None


def events(ns) -> Counter:
    return Counter(e["reason"] for e in ns.events())


# Its own waits allow 300 s each for v1 serving, v2's promotion and v3's abort (with three gates
# and five engine pods started between them), and as the first file of a worker it also starts
# the session's control plane: 218 s alone at load 10-19, past the suite's 600 s at load 36-62
# (e688af1). A deadline above its waits' sum, so a slow machine fails on what it waited for.
@pytest.mark.timeout(1200)
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
    # Latency judged from 10 requests a side; v2's canary (the same weights) may be up to 10x the
    # champion's p95 in TTFT and TPOT: at a few milliseconds a new pod's TPOT lands a bucket above a
    # warm one's (the engine's buckets are 1, 2.5, 5, 10 ms there), which 1.5x (the default) reads
    # as a breach, and under CI's load (3 workers on 2 cores, load 5-15) two buckets (1 to 5 ms)
    # are one scheduling delay, which 3x read as a breach too. v3's TTFT is judged at 3x (below).
    drift = {"latency": {"minRequests": 10, "ttftP95Ratio": 10.0, "tpotP95Ratio": 10.0}}
    v3_ttft_ratio = 3.0
    # The API server refuses a step that is both (the operator's check has the same words).
    with pytest.raises(ApiError, match="a canary step gives one of replicas, share or weight"):
        ns.create(tiny_pair(f"{name}-bad", target, draft, rollout={
            "strategy": {"type": "Canary", "steps": [{"replicas": 1, "share": 0.5}]}}))
    ns.create(tiny_pair(name, target, draft, drift=drift, gating=ONE_PROMPT_GATING))
    operator.life("log", lambda: serving(ns, name, "1"), time.monotonic() + 300)
    assert serving(ns, name, "1"), ns.pair(name).get("status")

    # v2: another target (the same weights from another path), rolled out as a canary in two
    # steps on the champion's one pod: a share of half its replicas (one pod), then two pods.
    strategy = {"type": "Canary", "steps": [{"share": 0.5, "pauseSeconds": 3}, {"replicas": 2, "pauseSeconds": 3}]}
    set_spec(ns, name, {"target": {"source": same_weights},
                        "rollout": {"applyGateTuning": False, "strategy": strategy}})
    operator.killed_after("kube.create Deployment")
    since = len(operator.writes())
    traffic, looks = Traffic(ns, name), []

    def promoted() -> bool:
        look = canary_look(ns, name)
        looks.append(look)
        traffic.stage = f"step {int(look['annotation']) + 1}" if look["replicas"] else ""
        return bool(serving(ns, name, "2")) and look["replicas"] == 0 and look["status"][1] == "Promoted"
    kills = operator.crash_until(promoted, timeout=300, during=traffic)
    crashed = operator.crashed_writes(since)
    for write in ("mlflow.set_model_version_tag specpair.canary", "mlflow.set_model_version_tag specpair.promoted_at",
                  "mlflow.set_registered_model_alias champion", "kube.merge_patch deployments"):
        assert write in crashed, (write, crashed)
    # The advance's scale-up is the first Deployment write after the canary's start, before its mark.
    assert crashed.index("kube.merge_patch deployments") < crashed.index("mlflow.set_model_version_tag specpair.canary"), \
        crashed
    # The canary Deployment: one pod (step 1), two (step 2), none once v2 serves; never back.
    assert changes([(look["replicas"], look["annotation"]) for look in looks]) == [(1, "0"), (2, "1"), (0, "1")], \
        changes([(look["replicas"], look["annotation"]) for look in looks])
    # The Service's ready endpoints held the canary's pods beside the champion's at each step, and
    # never none (the canary pods serve while the engine Deployment rolls to v2).
    by_step = {(look["annotation"], look["champion"], look["canary"]) for look in looks if look["replicas"]}
    assert ("0", 1, 1) in by_step and ("1", 1, 2) in by_step, by_step
    assert min(look["champion"] + look["canary"] for look in looks) >= 1, looks
    # status.canary said each step with its numbers, in order.
    progressing = changes([look["status"][2:] for look in looks if look["status"][:2] == ("2", "Progressing")])
    assert progressing == [(1, 2, 1, 0.5), (2, 2, 2, 0.6667)], progressing
    # The champion answered at each step, and the canary's pods did.
    for step in ("step 1", "step 2"):
        assert traffic.answered[(step, "champion")] >= 1 and traffic.answered[(step, "canary")] >= 1, traffic.answered
    obj = ns.pair(name)
    history_v2 = [h["action"] for h in obj["status"]["history"] if h["toVersion"] == "2"]
    assert history_v2.index("CanaryStarted") < history_v2.index("CanaryAdvanced") < history_v2.index("CanaryPassed") \
        < history_v2.index("Promoted"), history_v2
    counts = history(obj)
    for action in ("GateStarted", "GatePassed", "CanaryStarted", "CanaryAdvanced", "CanaryPassed", "Promoted"):
        assert counts[(action, "2")] == 1, (action, counts)
    said = events(ns)
    assert (said["CanaryStarted"], said["CanaryAdvanced"], said["CanaryPassed"], said["Promoted"],
            said["CanaryScaledDown"]) == (1, 1, 1, 2, 1), said
    advanced = [e["message"] for e in ns.events("CanaryAdvanced")]
    assert "v2" in advanced[0] and "step 2 of 2: 2 pod(s) beside 1" in advanced[0], advanced
    entry = obj["status"]["canary"]
    assert entry["phase"] == "Promoted" and entry["version"] == "2" and entry["champion"] == "1"
    assert (entry["step"], entry["steps"], entry["replicas"], entry["trafficShare"]) == (2, 2, 2, 0.6667), entry
    for key in ("errors:*", "ttft:*", "tpot:*"):
        assert entry["judged"][key]["verdict"] == "fine" and entry["judged"][key]["requests"] >= 10, entry
    canary_cond = cond(obj, canary.CONDITION)
    assert canary_cond["status"] == "True" and canary_cond["reason"] == "Passed"
    assert len(mlflow.search_model_versions(f"name='{model}'")) == 2
    assert mlflow.get_registered_model(model).aliases == {"candidate": "2", "champion": "2", "previous": "1"}
    assert sorted(d["metadata"]["name"] for d in ns.list("apps/v1", "Deployment")) == deployments
    assert not traffic.failed, f"{len(traffic.failed)} requests failed on listed pods: {traffic.failed}"
    assert sum(traffic.answered.values()) >= 20, traffic.answered

    # v3: a target of eight layers 512 wide, many times slower to its first token once warm. A
    # pod's first requests are not judged (canary.WARM_UP_REQUESTS): 256 wide, warm, measured only
    # ~3x the champion's TTFT p95 in CI (p95 67.8 ms, 1.9% of 204 requests above the 3x threshold)
    # and passed. Acceptance (drift.minDraftedTokens above what the test drafts) and TPOT (a ratio
    # of 100, the CRD's largest) are left out of the judgement: the abort is the TTFT breach's. (A
    # ratio of 10 let the official CI at ad9d86f abort on TPOT first: p95 24.7 ms against a
    # champion's 1.8 ms, threshold 18.5 ms; this target's TPOT is one 8-layer step, far below 100x.)
    slow = save_tiny(make_model(tiny_tokenizer, seed=1, layers=8, hidden=512, heads=4),
                     Path(target).parent / "target-slow")
    v2_pods = set(service_endpoints(ns, name))
    strategy = {"type": "Canary", "steps": [{"replicas": 1, "pauseSeconds": 120}]}
    set_spec(ns, name, {"target": {"source": slow}, "drift": {"minDraftedTokens": 10**9,
                                                             "latency": {**drift["latency"], "ttftP95Ratio": v3_ttft_ratio,
                                                                         "tpotP95Ratio": 100.0}},
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
    # The abort is a TTFT breach: more of the candidate's requests than 5% (by the lower bound)
    # above 3x the champion's p95. Read from the abort's message, the record the abort itself
    # wrote: `judged` may hold a later pass's fresh evidence once an operator killed after the
    # abort's MLflow mark restarts (CI at b48dac2: message "22.4% of 17 requests above the
    # threshold (lower bound 7.5%) > 5%", judged without a TTFT breach; an earlier form of this
    # check read judged['ttft:code']).
    breach = re.search(r"TTFT p95 (?:[\d.]+ ms|above the largest bucket) \(champion p95 ([\d.]+) ms, threshold "
                       r"([\d.]+) ms\): [\d.]+% of (\d+) requests above the threshold \(lower bound ([\d.]+)%\) > "
                       r"(\d+)%", entry["message"])
    assert breach, entry["message"]
    champion_p95, threshold, requests, lower, limit = map(float, breach.groups())
    assert abs(threshold - v3_ttft_ratio * champion_p95) <= 0.2 and requests >= 10 and lower > limit, entry["message"]
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
    assert not traffic.failed, f"{len(traffic.failed)} requests failed on listed pods: {traffic.failed}"
    assert sum(traffic.answered.values()) >= 10, traffic.answered
    assert kills >= 6, kills
