"""The canary in the operator's plans (plan/release_plan.py, plan/serving_canary.py, policy/canary.py) as tables: a passed
candidate whose strategy is Canary serves beside the champion in a second Deployment behind the
same Service, step by step, and is promoted when its pods are judged healthy against the
champion's, or aborted (the champion untouched) when they are worse.

Then recovery: a small model of MLflow, the two Deployments and their pods (whose GetStats carry
each release's latency and acceptance) runs the release and serving passes until nothing is left
to do, with the operator killed after each write in turn (that pass's status and the operator's
memory lost). Every run ends where the undisturbed one does, with each action recorded once.
Pure: no servers.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import random
from collections import Counter
from typing import Any

import pytest

import engine_counters
import plan_tables
from plan_tables import PAIR, available, kinds, mine, pod_info
from specpair_operator.policy import canary
from specpair_operator.desired import manifests
from specpair_operator.act import owned
from specpair_operator.plan import release_steps as rs
from specpair_operator.plan import release_plan as p
from specpair_operator.plan import serving_plan as sp
from specpair_operator.handlers import records_of
from specpair_operator.observe.serving_world import DriftMemory, EnginePod, ServingWorld
from specpair_operator.observe.world import Records

T0 = 1_700_000_000.0
DT = 10.0
GOOD = {"passed": True, "reasons": [], "tokenizer": {"compatible": True, "differences": []},
        "greedyIdentity": 1.0, "acceptanceRate": 0.7, "speedup": 1.4,
        "categories": {"code": {"acceptanceRate": 0.8}}}
STEPS = [{"replicas": 1, "pauseSeconds": 20}, {"share": 1.0, "pauseSeconds": 20}]
ROLLOUT = {"replicas": 2, "strategy": {"type": "Canary", "steps": STEPS}}
SPEC = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "abc"}, "draft": {"drafter": "ngram"},
        "rollout": ROLLOUT, "drift": {"enabled": False}}
CHAMPION_TAGS = plan_tables.release_tags(SPEC)
NEW_TARGET = plan_tables.release_tags({**SPEC, "target": {"source": "HuggingFaceTB/SmolLM2-360M"}})
# v2 (a new target) passed its gate; v1 is champion.
candidate_world = functools.partial(plan_tables.candidate_world, tags=NEW_TARGET, champion_tags=CHAMPION_TAGS,
                                    verdict=GOOD, rollout=ROLLOUT)


# -- the release's plan: whether a passed candidate runs a canary -----------------------------------

CANARY_NAME = manifests.engine_canary_name(PAIR)
PROMOTION = ["TagVersion v2 specpair.promoted_at", "SetAlias previous=1", "SetAlias champion=2",
             "Record Promoted", "ServeChampion 2"]


@pytest.mark.parametrize("what, w, expected", [
    ("a new target with strategy Canary: started, served beside v1, not promoted",
     candidate_world(), ["Record CanaryStarted", "SetStatus previousVersion,servingVersion", "ServeChampion 1 canary v2"]),
    ("already started: the canary carries on",
     candidate_world(records=Records({"GateStarted": ("2",), "GatePassed": ("2",), "CanaryStarted": ("2",)})),
     ["SetStatus previousVersion,servingVersion", "ServeChampion 1 canary v2"]),
    ("aborted (its pass died before its status): recorded once, v1 keeps serving",
     candidate_world(tags={**NEW_TARGET, **canary.mark_tag(canary.ABORTED, "TTFT p95 800 ms")}),
     ["Condition Canary=False Aborted", "Record CanaryAborted", "SetStatus previousVersion,servingVersion",
      "ServeChampion -"]),
    ("passed: CanaryPassed recorded (its pass died first), then promoted as a gate pass is",
     candidate_world(tags={**NEW_TARGET, **canary.mark_tag(canary.PASSED, "all 2 step(s) healthy")}),
     ["Condition Canary=True Passed", "Record CanaryPassed", *PROMOTION]),
    ("strategy Replace: promoted at once", candidate_world(rollout={"replicas": 2, "strategy": {"type": "Replace"}}),
     PROMOTION),
    ("aborted, and the strategy changed to Replace since: still not promoted",
     candidate_world(tags={**NEW_TARGET, **canary.mark_tag(canary.ABORTED, "TTFT p95 800 ms")},
                     records=Records({"GateStarted": ("2",), "GatePassed": ("2",), "CanaryAborted": ("2",)}),
                     rollout={"replicas": 2, "strategy": {"type": "Replace"}}),
     ["Condition Canary=False Aborted", "SetStatus previousVersion,servingVersion", "ServeChampion -"]),
    ("no champion yet: a first release is promoted", candidate_world(aliases={}, champion_release=None),
     ["TagVersion v2 specpair.promoted_at", "SetAlias champion=2", "Record Promoted", "ServeChampion 2"]),
])
def test_a_passed_candidate_runs_its_canary_before_it_is_promoted(what, w, expected):
    steps = p.plan_release(w)
    tail = kinds(steps)[-len(expected):]
    assert tail == expected, what
    start = next((s for s in steps if isinstance(s, rs.ServeChampion) and s.canary), None)
    if start is not None:
        assert start.canary.steps == (canary.Step(1, None, 20.0), canary.Step(None, 1.0, 20.0))
        record = next((s for s in steps if isinstance(s, rs.Record)), None)
        assert record is None or "2 canary step(s): 1 replica(s), pause 20s; share 1, pause 20s" in record.reason
    aborted = next((s for s in steps if isinstance(s, rs.Record) and s.action == "CanaryAborted"), None)
    if aborted is not None:
        assert aborted.reason == "canary of v2 aborted: TTFT p95 800 ms" and (aborted.from_version, aborted.key) == ("1", "2")


# -- the serving plan: the canary's Deployment, steps and verdicts ----------------------------------

class Pod:
    """One engine pod's cumulative counters as GetStats reports them (the probe's dict form)."""

    def __init__(self, name: str, served: dict[str, Any], started: float, seed: int):
        self.name, self.served, self.started = name, served, started
        self.rng = random.Random(seed)
        self.serving: dict[str, Any] = {}
        self.acceptance: dict[str, Any] = {}

    def serve(self, n: int, ttft: float, tpot: float, acceptance: float) -> None:
        c = self.serving.setdefault("code", engine_counters.serving())
        a = self.acceptance.setdefault("code", engine_counters.acceptance())
        for _ in range(n):
            engine_counters.finished(c, "ok")
            engine_counters.latencies(c, self.rng, ttft, tpot, sigma=0.2)
            engine_counters.drafted(a, self.rng, acceptance, 20)

    def view(self, now: float, uid: str) -> EnginePod:
        stats = {"categories": copy.deepcopy(self.acceptance), "serving": copy.deepcopy(self.serving),
                 "uptimeSeconds": now - self.started}
        return EnginePod(self.name, uid, "10.0.0.1", pod_info(self.served), stats=stats)


SPEED = {"1": {"ttft": 0.2, "tpot": 0.02, "acceptance": 0.6},
         "fast": {"ttft": 0.2, "tpot": 0.02, "acceptance": 0.6},
         "slow": {"ttft": 1.5, "tpot": 0.02, "acceptance": 0.6}}


class Cluster(plan_tables.CandidateCluster):
    """MLflow (aliases, tags), the engine's two Deployments (made available at once, as the
    Deployment controller would), and their pods, which serve `per_pod` requests a pass with
    their release's latency and acceptance (`candidate`: v2's, 'fast' or 'slow'). A killed
    operator loses the canary's memory too."""

    candidate_world = staticmethod(candidate_world)

    def __init__(self, candidate: str, per_pod: int = 30):
        super().__init__(CHAMPION_TAGS, NEW_TARGET)
        self.speed = {"1": SPEED["1"], "2": SPEED[candidate]}
        self.per_pod = per_pod
        self.memory: Any = None
        self.now = T0
        self.pods: dict[str, list[Pod]] = {"main": [], "canary": []}
        # v1 serves on its Deployment already.
        w = self.serving_world(rs.ServeChampion({"champion": "1"}, "1"))
        for step in sp.plan_serving(w):
            if isinstance(step, sp.EnsureOwned):
                self.write(step)
            elif isinstance(step, rs.Record):
                self.status["recorded"][step.action] = [step.key]

    def serving_world(self, step: rs.ServeChampion) -> ServingWorld:
        w = self.champion_world(step, SPEC, GOOD, canary_run=step.canary, deployment=self.objects.get("main"),
                                canary_deployment=self.objects.get("canary"), canary_memory=self.memory,
                                drift=DriftMemory(wall=self.now))
        views = {side: tuple(pod.view(self.now, f"u-{side}-{i}") for i, pod in enumerate(self.pods[side]))
                 for side in self.pods}
        return dataclasses.replace(w, ready=views["main"], canary_ready=views["canary"] if step.canary else ())

    def _pods_for(self, side: str, dep: dict[str, Any]) -> None:
        """The Deployment controller and kubelet: pods of the Deployment's template, fresh when it changed."""
        served = json.loads(dep["spec"]["template"]["metadata"]["annotations"][manifests.ANN_RELEASE])
        kept = [pod for pod in self.pods[side] if pod.served == served]
        fresh = [Pod(f"{side}-{served['mlflow']['version']}-{self.generation}-{i}", served, self.now,
                     seed=self.generation * 10 + i) for i in range(len(kept), dep["spec"]["replicas"])]
        self.pods[side] = (kept + fresh)[:dep["spec"]["replicas"]]

    def write_object(self, step: Any) -> None:
        if isinstance(step, sp.EnsureOwned):
            obj = mine(dict(step.manifest), step.mutable)
            if obj["kind"] == "Deployment":
                self.generation += 1
                side = "canary" if obj["metadata"]["name"] == CANARY_NAME else "main"
                obj = available(dict(step.manifest), self.generation)
                self.objects[side] = obj
                self._pods_for(side, obj)
            else:
                self.objects[obj["kind"]] = obj
        elif isinstance(step, canary.ScaleDown):
            dep = self.objects["canary"]
            dep["spec"]["replicas"] = dep["status"]["replicas"] = 0
            dep["metadata"]["annotations"][owned.ANN_MANIFEST] = "scaled-down"
            self.pods["canary"] = []

    def remember(self, step: Any) -> None:
        if isinstance(step, canary.RememberCanary):
            self.memory = step.memory

    def forget(self) -> None:
        self.memory = None

    def one_pass(self, crash_at: int | None) -> bool:
        """Traffic for DT seconds, then one pass; False when it planned nothing to write or
        record and no canary pod is left."""
        self.now += DT
        for side, pods in self.pods.items():
            for pod in pods:
                pod.serve(self.per_pod, **self.speed[pod.served["mlflow"]["version"]])
        return super().one_pass(crash_at) or bool(self.pods["canary"])


def converge(candidate: str, crash_at: int | None = None) -> Cluster:
    cluster = Cluster(candidate)
    for _ in range(40):
        if not cluster.one_pass(crash_at):
            return cluster
    raise AssertionError(f"no convergence: {cluster.history}; {cluster.status.get('canary')}")


def test_a_healthy_canary_grows_step_by_step_and_is_promoted_its_pods_then_retired():
    cl = converge("fast")
    assert cl.aliases["champion"] == "2" and cl.aliases["previous"] == "1"
    assert [a for a, _ in cl.history] == ["CanaryStarted", "CanaryAdvanced", "CanaryPassed", "Promoted",
                                          "RolloutStarted", "CanaryScaledDown"]
    assert canary.mark(cl.tags["2"])[0] == canary.PASSED
    assert cl.objects["canary"]["spec"]["replicas"] == 0
    served = json.loads(cl.objects["main"]["spec"]["template"]["metadata"]["annotations"][manifests.ANN_RELEASE])
    assert served["mlflow"]["version"] == "2" and cl.objects["main"]["spec"]["replicas"] == 2
    entry = cl.status["canary"]
    assert entry["phase"] == "Promoted" and entry["step"] == 2 and entry["replicas"] == 2
    assert entry["trafficShare"] == 0.5
    # Both sides' pods serve alike here: the share observed in the pods' counters is the ratio's.
    assert entry["shareBasis"].startswith("approximate: replica ratio") and entry["observedShare"] == 0.5
    assert entry["judged"]["ttft:*"]["verdict"] == "fine" and entry["judged"]["ttft:*"]["requests"] >= 50


def test_a_canary_slower_to_first_token_is_aborted_and_the_champion_is_untouched():
    cl = converge("slow")
    assert cl.aliases == {"champion": "1", "candidate": "2"}
    assert [a for a, _ in cl.history] == ["CanaryStarted", "CanaryAborted"]
    state, reason = canary.mark(cl.tags["2"])
    assert state == canary.ABORTED and reason.startswith("candidate worse than the champion: category 'code' TTFT")
    assert cl.objects["canary"]["spec"]["replicas"] == 0 and not cl.pods["canary"]
    served = json.loads(cl.objects["main"]["spec"]["template"]["metadata"]["annotations"][manifests.ANN_RELEASE])
    assert served["mlflow"]["version"] == "1" and cl.generation == 2      # v1's Deployment never rolled
    entry = cl.status["canary"]
    assert entry["phase"] == "Aborted" and entry["judged"]["ttft:code"]["verdict"] == "breach"
    assert entry["judged"]["ttft:code"]["candidate"] > 3 * entry["judged"]["ttft:code"]["champion"]


def test_an_abort_scales_down_after_its_mark_and_reports_the_numbers():
    cl = Cluster("slow")
    while "CanaryAborted" not in [a for a, _ in cl.history]:
        cl.one_pass(None)
    steps = cl.last_serving
    names = kinds(steps)
    tag, down = names.index("TagVersion v2 specpair.canary"), names.index(f"ScaleDown {CANARY_NAME}")
    assert tag < down < names.index("Record CanaryAborted")
    assert names[-1] == "ReportSpeculation CanaryAborted"
    report = steps[-1].otherwise
    assert report.how == "stalled" and "v1 keeps serving" in report.message and "TTFT p95" in report.message


def test_a_canary_left_by_a_candidate_no_longer_wanted_is_scaled_down():
    cl = Cluster("fast")
    for _ in range(2):
        cl.one_pass(None)
    assert cl.objects["canary"]["spec"]["replicas"] == 1
    # The spec moved on (v2 is not the spec's release any more): the serving plan runs without a canary.
    steps = sp.plan_serving(cl.serving_world(rs.ServeChampion(dict(cl.aliases), "1")))
    assert kinds(steps)[-3:-1] == [f"ScaleDown {CANARY_NAME}", "Event CanaryScaledDown"]
    event = next(s for s in steps if isinstance(s, rs.PostEvent))
    assert "v2 is no longer a candidate" in event.message


def test_a_promoted_canarys_scale_down_is_recorded_so_a_pass_on_a_body_not_showing_it_yet_is_held_back():
    """The pass that retires a promoted canary knows it from the status (canary phase Passed), so
    what it says is a keyed record: the next pass on a body the watch has not updated yet is held
    back (handlers.reconcile compares the records), and a pass on the new status says nothing more.
    As a bare Event it changed no record, and the real operator's periodic pass on such a body
    posted CanaryScaledDown a second time."""
    cl = Cluster("fast")
    for _ in range(40):
        before = copy.deepcopy(cl.status)
        cl.one_pass(None)
        if cl.status["canary"]["phase"] == "Promoted":
            break
    assert [a for a, _ in cl.history][-1] == "CanaryScaledDown", cl.history
    assert records_of(before) != records_of(cl.status)
    assert cl.status["canary"]["phase"] == "Promoted"
    serve = next(s for s in p.plan_release(cl.release_world()) if isinstance(s, rs.ServeChampion))
    assert not [s for s in sp.plan_serving(cl.serving_world(serve)) if isinstance(s, (rs.Record, rs.PostEvent))]


def test_the_canary_step_is_read_back_from_its_deployment_when_the_status_that_said_so_was_lost():
    cl = Cluster("fast")
    while "CanaryAdvanced" not in [a for a, _ in cl.history]:
        cl.one_pass(None)
    assert cl.objects["canary"]["spec"]["replicas"] == 2
    lost = {k: v for k, v in cl.status.items() if k != "canary"}
    serve = next(s for s in p.plan_release(cl.release_world()) if isinstance(s, rs.ServeChampion))
    w = dataclasses.replace(cl.serving_world(serve), status=lost, canary_memory=None)
    steps = sp.plan_serving(w)
    assert not [s for s in steps if isinstance(s, sp.EnsureOwned)], "not scaled back to step 1"
    entry = next(s.fields["canary"] for s in steps if isinstance(s, rs.SetStatus) and "canary" in s.fields)
    assert entry["step"] == 2 and entry["replicas"] == 2


@pytest.mark.parametrize("candidate", ["fast", "slow"])
def test_a_canary_converges_from_a_crash_after_any_write(candidate):
    undisturbed = converge(candidate)
    actions = Counter(a for a, _ in undisturbed.history)
    for crash_at in range(undisturbed.writes):
        crashed = converge(candidate, crash_at)
        assert crashed.aliases == undisturbed.aliases, crash_at
        assert canary.mark(crashed.tags["2"])[0] == canary.mark(undisturbed.tags["2"])[0], crash_at
        assert crashed.objects["canary"]["spec"]["replicas"] == 0, crash_at
        assert crashed.objects["main"]["spec"]["template"] == undisturbed.objects["main"]["spec"]["template"], crash_at
        assert sorted(set(crashed.history)) == sorted(crashed.history), f"recorded twice (crash at {crash_at})"
        assert Counter(a for a, _ in crashed.history) == actions, crash_at


def test_a_canary_deployment_scaled_down_before_is_scaled_up_again_for_the_canary_that_runs():
    cl = Cluster("fast")
    cl.one_pass(None)
    cl.write(canary.ScaleDown(CANARY_NAME))        # left at zero by an earlier canary of this version
    serve = next(s for s in p.plan_release(cl.release_world()) if isinstance(s, rs.ServeChampion))
    steps = sp.plan_serving(cl.serving_world(serve))
    ensured = [s for s in steps if isinstance(s, sp.EnsureOwned) and s.manifest["metadata"]["name"] == CANARY_NAME]
    assert ensured and ensured[0].manifest["spec"]["replicas"] == 1


def converge_killed_at_every_write(candidate: str) -> Cluster:
    """The operator killed right after every write it makes (each pass dies at its first write,
    its status and memory lost), until nothing is left to do."""
    cluster = Cluster(candidate)
    for _ in range(80):
        if not cluster.one_pass(cluster.writes):
            return cluster
    raise AssertionError(f"no convergence: {cluster.history}; {cluster.status.get('canary')}")


@pytest.mark.parametrize("candidate, phase, decisive", [("fast", "Promoted", canary.REQUIRED),
                                                        ("slow", "Aborted", ("ttft:code",))])
def test_a_canary_converges_when_killed_after_every_write(candidate, phase, decisive):
    """Killed right after its mark, the deciding pass loses its status: the mark carries the
    numbers, and status.canary, the condition and CanaryPassed (also when every write of the
    promotion was killed) come from it; killed after the scale-down, the entry still ends
    Promoted, with its Event."""
    undisturbed = converge(candidate)
    crashed = converge_killed_at_every_write(candidate)
    assert crashed.aliases == undisturbed.aliases
    assert canary.mark(crashed.tags["2"])[0] == canary.mark(undisturbed.tags["2"])[0]
    assert crashed.objects["canary"]["spec"]["replicas"] == 0 and not crashed.pods["canary"]
    assert crashed.objects["main"]["spec"]["template"] == undisturbed.objects["main"]["spec"]["template"]
    assert sorted(set(crashed.history)) == sorted(crashed.history), "recorded twice"
    assert Counter(a for a, _ in crashed.history) == Counter(a for a, _ in undisturbed.history)
    entry, expected = crashed.status["canary"], undisturbed.status["canary"]
    assert entry["phase"] == expected["phase"] == phase, entry
    assert {k: (entry["judged"].get(k) or {}).get("verdict") for k in decisive} == \
        {k: expected["judged"][k]["verdict"] for k in decisive}, entry
    assert Counter(crashed.events + [a for a, _ in crashed.history])["CanaryScaledDown"] == \
        Counter(undisturbed.events + [a for a, _ in undisturbed.history])["CanaryScaledDown"]
