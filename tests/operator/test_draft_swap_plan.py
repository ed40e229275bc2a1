"""A draft-only release promoted in place (plan/serving_draft_swap.py, policy/draft_swap.py), as
tables: the champion moves to a release that differs from the one its pods run only in the draft,
and the plan swaps the draft on each pod (SwapDraft), then moves the engine Deployment's template
without a roll (PromoteInPlace), or says why the pods roll instead. Then passes of a small model
of the cluster, killed after each write in turn, all end with the pods swapped, the template
moved, no pod rolled and DraftSwapped recorded once."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

import plan_tables
from plan_tables import CURRENT_TLS, MODEL, NOW, NS, PAIR, TLS, UID, kinds, mine
from specpair_operator.desired import engine_objects, manifests
from specpair_operator.observe.serving_world import EnginePod, ServingWorld
from specpair_operator.observe.world import Records
from specpair_operator.plan import release_steps as rs
from specpair_operator.plan import serving_plan as sp
from specpair_operator.plan import serving_draft_swap as ds
from specpair_operator.policy import draft_swap
from specpair_operator.release import content as release

GOOD = {"passed": True, "reasons": [], "tokenizer": {"compatible": True, "differences": []},
        "greedyIdentity": 1.0, "acceptanceRate": 0.7, "speedup": 1.4, "categories": {"code": {"acceptanceRate": 0.8}}}
SPEC = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "abc"}, "draft": {"drafter": "ngram"},
        "speculation": {"k": 4}, "rollout": {"replicas": 2}}
REPLICASET = "chat-engine-5d8f7"


def tags(spec: dict[str, Any]) -> dict[str, str]:
    return plan_tables.release_tags(spec)


def v1_world() -> ServingWorld:
    return ServingWorld(pair=PAIR, namespace=NS, uid=UID, model=MODEL, aliases={"champion": "1"}, desired="1",
                        spec=SPEC, status={"engineTLS": CURRENT_TLS}, now=NOW, tags=tags(SPEC), verdict=GOOD, tls=TLS)


def deployment_of(w: ServingWorld) -> dict[str, Any]:
    dep = mine(sp.engine_deployment(w, sp.served_release(w)))
    n = dep["spec"]["replicas"]
    dep["metadata"]["generation"] = 1
    dep["status"] = {"observedGeneration": 1, "replicas": n, "updatedReplicas": n, "availableReplicas": n}
    return dep


def pod(i: int, replicaset: str = REPLICASET, version: str = "1") -> dict[str, Any]:
    return {"metadata": {"name": f"chat-engine-{i}", "uid": f"u{i}", "labels": {manifests.LABEL_VERSION: version},
                         "ownerReferences": [{"kind": "ReplicaSet", "name": replicaset, "controller": True}]},
        "status": {"phase": "Running", "podIP": f"10.0.0.{i}", "conditions": [{"type": "Ready", "status": "True"}]}}


def info(started: dict[str, Any], drafting: dict[str, Any] | None = None, **changes: Any) -> dict[str, Any]:
    """What a pod started with release `started` reports, drafting with `drafting` (default: it)."""
    drafting = drafting or started
    return {"pair": PAIR, "releaseVersion": started["mlflow"]["version"], "contentHash": release.content_hash(started),
            "draftVersion": drafting["mlflow"]["version"], "draftContentHash": release.content_hash(drafting),
            "tokenizer": {"target": "t", "draft": "d"}, "speculationEnabled": True, **changes}


def promoted(draft: dict[str, Any], spec_changes: dict[str, Any] | None = None, pods: int = 2,
             drafting_v2: int = 0, **info_changes: Any) -> ServingWorld:
    """v1's engine serving on `pods` pods, the first `drafting_v2` of them swapped to v2 already;
    champion now v2, whose release changes the draft to `draft` (and the spec by `spec_changes`)."""
    w1 = v1_world()
    live, v1 = deployment_of(w1), sp.served_release(w1)
    spec2 = {**SPEC, "draft": draft, **(spec_changes or {})}
    w2 = dataclasses.replace(w1, aliases={"champion": "2", "previous": "1"}, desired="2", spec=spec2, tags=tags(spec2))
    v2 = sp.served_release(w2)
    rolled_out = f"1@{sp.template_fingerprint(live)}"
    ready = tuple(EnginePod(f"chat-engine-{i}", f"u{i}", f"10.0.0.{i}",
                            info(v1, v2 if i < drafting_v2 else None, **info_changes)) for i in range(pods))
    return dataclasses.replace(
        w2, deployment=live, records=Records({"RolloutStarted": (rolled_out,)}),
        pods=tuple(pod(i, version="2" if i < drafting_v2 else "1") for i in range(pods)),
        service=mine(engine_objects.engine_service(PAIR, NS, {}), mutable=False),
        policy=mine(engine_objects.engine_network_policy(PAIR, NS)), ready=ready)


NEW_DRAFT = {"source": "HuggingFaceTB/SmolLM2-135M-draft"}


def test_a_draft_only_release_is_swapped_into_each_pod_then_the_template_moves_without_a_roll():
    w = promoted(NEW_DRAFT)
    steps = sp.plan_serving(w)
    swaps = [s for s in steps if isinstance(s, ds.SwapDraft)]
    assert [(s.pod, s.address, s.version) for s in swaps] == [("chat-engine-0", "10.0.0.0:50052", "2"),
                                                              ("chat-engine-1", "10.0.0.1:50052", "2")]
    served = sp.served_release(w)
    assert json.loads(swaps[0].release_json) == served
    # ... and each pod is given v2's version label and release file (routes select by the label).
    assert swaps[0].metadata == {"labels": {manifests.LABEL_VERSION: "2"}, "annotations": {
        manifests.ANN_RELEASE: json.dumps(served, sort_keys=True), manifests.ANN_HASH: release.content_hash(served)}}
    assert not [k for k in kinds(steps) if k.startswith(("EnsureOwned Deployment", "Record"))]
    assert steps[-1].reason == "RollingOut" and "swapping the draft of v2 into the running pods in place: 0 of 2" \
        in steps[-1].message

    # One pod swapped (a pass died after it): only the other is asked.
    steps = sp.plan_serving(promoted(NEW_DRAFT, drafting_v2=1))
    assert [s.pod for s in steps if isinstance(s, ds.SwapDraft)] == ["chat-engine-1"]
    # Swapped but not yet labelled (the pass died between the two): asked again, which relabels it.
    w = promoted(NEW_DRAFT, drafting_v2=2)
    w = dataclasses.replace(w, pods=(w.pods[0], pod(1)))
    assert [s.pod for s in sp.plan_serving(w) if isinstance(s, ds.SwapDraft)] == ["chat-engine-1"]

    # Both swapped: the template moves in place, recorded once; no rollout.
    w = promoted(NEW_DRAFT, drafting_v2=2)
    steps = sp.plan_serving(w)
    [move] = [s for s in steps if isinstance(s, ds.PromoteInPlace)]
    assert move.replicaset == REPLICASET and move.live is w.deployment
    assert move.manifest == sp.engine_deployment(w, sp.served_release(w))
    assert [k for k in kinds(steps) if k.startswith("Record")] == ["Record DraftSwapped"]
    record = next(s for s in steps if isinstance(s, rs.Record))
    assert (record.from_version, record.to_version) == ("1", "2") and "no pod restarted" in record.reason
    assert not [s for s in steps if isinstance(s, (ds.SwapDraft, sp.EnsureOwned)) and
                getattr(s, "manifest", {}).get("kind") == "Deployment"]


def test_after_the_move_the_swapped_pods_are_the_champions_and_nothing_is_written():
    w = promoted(NEW_DRAFT, drafting_v2=2)
    move = next(s for s in sp.plan_serving(w) if isinstance(s, ds.PromoteInPlace))
    key = move.key
    moved = deployment_of(w)
    after = dataclasses.replace(w, deployment=moved, records=Records({**w.records.recorded, "DraftSwapped": (key,)}))
    steps = sp.plan_serving(after)
    assert not [s for s in steps if isinstance(s, sp.WRITES + (ds.SwapDraft, ds.PromoteInPlace, ds.ResumeEngine))]
    assert not [k for k in kinds(steps) if k.startswith("Record")]
    assert steps[-1].otherwise.reason == "Serving", steps[-1]
    # A pass that died after the move, before its status said so: DraftSwapped, not RolloutStarted.
    died = dataclasses.replace(after, records=w.records)
    assert [k for k in kinds(sp.plan_serving(died)) if k.startswith("Record")] == ["Record DraftSwapped"]
    # ... and one that died holding the Deployment paused: resumed.
    paused = json.loads(json.dumps(moved))
    paused["metadata"]["annotations"][draft_swap.ANN_PAUSED_FOR_SWAP] = key
    paused["spec"]["paused"] = True
    steps = sp.plan_serving(dataclasses.replace(after, deployment=paused))
    assert ds.ResumeEngine(moved["metadata"]["name"]) in steps


@pytest.mark.parametrize("what, world, why", [
    ("the engine refused it", lambda: dataclasses.replace(
        promoted(NEW_DRAFT), records=Records({"RolloutStarted": ("x",), "DraftSwapRefused": (key_of(promoted(NEW_DRAFT)),)})),
     "the engine refused to swap the draft"),
    ("an engine that does not report its draft (older than SwapDraft)",
     lambda: promoted(NEW_DRAFT, draftContentHash="", draftVersion=""), "does not report the draft it serves"),
    ("a head on the new side", lambda: promoted({"source": "org/eagle3-head", "method": "eagle3"}),
     "eagle3 head"),
    ("the pod template changes beyond the release",
     lambda: promoted(NEW_DRAFT, {"rollout": {"replicas": 2, "nodeSelector": {"pool": "b"}}}),
     "the pod template changes beyond the release"),
    ("a pod not ready", lambda: dataclasses.replace(promoted(NEW_DRAFT), pods=(pod(0), unready(pod(1)))),
     "not every engine pod is ready"),
    ("a pod that did not answer", lambda: dataclasses.replace(
        promoted(NEW_DRAFT), ready=(promoted(NEW_DRAFT).ready[0], EnginePod("chat-engine-1", "u1", "10.0.0.1",
                                                                             unreachable="UNAVAILABLE"))),
     "a pod did not say which draft it serves"),
    ("pods of two ReplicaSets", lambda: dataclasses.replace(promoted(NEW_DRAFT), pods=(pod(0), pod(1, "other"))),
     "one ReplicaSet"),
])
def test_a_draft_only_release_the_pods_cannot_swap_rolls_them_and_says_why(what, world, why):
    steps = sp.plan_serving(world())
    assert not [s for s in steps if isinstance(s, (ds.SwapDraft, ds.PromoteInPlace))]
    assert "EnsureOwned Deployment" in kinds(steps)
    [rolled] = [s for s in steps if isinstance(s, rs.Record) and s.action == "RolloutStarted"]
    assert rolled.reason.startswith("engine Deployment rolled to v2 (not swapped in place: ") and why in rolled.reason, \
        rolled.reason


def unready(p: dict[str, Any]) -> dict[str, Any]:
    return {**p, "status": {**p["status"], "conditions": [{"type": "Ready", "status": "False"}]}}


def test_pods_not_yet_asked_are_asked_first():
    # Observe asks pods who they are once the rollout is available; while a draft may be swapped
    # in place the plan needs them asked, and says so.
    w = dataclasses.replace(promoted(NEW_DRAFT), ready=())
    assert sp.rollout_state(w)[0] == "available"
    steps = sp.plan_serving(w)
    assert not [s for s in steps if isinstance(s, (ds.SwapDraft, ds.PromoteInPlace, sp.EnsureOwned))
                and getattr(s, "manifest", {}).get("kind", "Deployment") == "Deployment"]
    assert steps[-1].reason == "RollingOut" and "asking the engine pods which draft they serve" in steps[-1].message
    # A release that changes more than the draft: the rollout's own state.
    assert sp.rollout_state(dataclasses.replace(promoted(NEW_DRAFT, {"speculation": {"k": 5}}), ready=()))[0] == \
        "progressing"


def key_of(w: ServingWorld) -> str:
    dep = sp.engine_deployment(w, sp.served_release(w))
    return f"2@{dep['metadata']['annotations'][sp.ANN_TEMPLATE]}"


def test_a_release_that_changes_more_than_the_draft_rolls_as_before():
    steps = sp.plan_serving(promoted(NEW_DRAFT, {"speculation": {"k": 5}}))
    [rolled] = [s for s in steps if isinstance(s, rs.Record) and s.action == "RolloutStarted"]
    assert rolled.reason == "engine Deployment rolled to v2"
    assert not [s for s in steps if isinstance(s, (ds.SwapDraft, ds.PromoteInPlace))]


# -- the decision, pure -------------------------------------------------------------------------

V1 = {"pair": "p", "target": {"source": "t"}, "draft": {"drafter": "ngram"}, "speculation": {"k": 4},
      "engine": {"image": "i"}, "gating": {"prompts": []}, "mlflow": {"version": "1"}}


@pytest.mark.parametrize("served, why", [
    ({**V1, "draft": {"source": "d"}, "gating": {"prompts": [1]}, "mlflow": {"version": "2"}}, None),
    ({**V1, "draft": {"source": "d"}, "speculation": {"k": 5}}, "changes speculation, not only the draft"),
    ({**V1, "draft": {"source": "d"}, "target": {"source": "u"}}, "changes target"),
    ({**V1, "draft": {"source": "d"}, "engine": {"image": "i", "kind": "vllm"}}, "changes engine"),
    ({**V1, "mlflow": {"version": "2"}}, "nothing to swap"),
    ({**V1, "draft": {}}, "no draft"),
    ({**V1, "draft": {"source": "h", "method": "eagle"}}, "eagle head"),
    ({**V1, "draft": {"source": "h", "method": "mtp"}}, "mtp head"),
])
def test_which_releases_swap_in_place(served, why):
    got = draft_swap.release_refusal(V1, served)
    assert (got is None) if why is None else (why in (got or "")), got


def test_vllm_pods_never_swap():
    vllm = {**V1, "engine": {"image": "i", "kind": "vllm"}}
    assert "vLLM cannot swap" in draft_swap.release_refusal(vllm, {**vllm, "draft": {"source": "d"}})


def test_which_pods_serve_a_release():
    v1, v2 = {"h": "1"}, {"h": "2"}
    started = {"pair": "p", "releaseVersion": "1", "contentHash": "h1", "draftVersion": "1", "draftContentHash": "h1"}
    swapped = {**started, "draftVersion": "2", "draftContentHash": "h2"}
    older = {"pair": "p", "releaseVersion": "1", "contentHash": "h1"}
    assert v1 != v2
    assert draft_swap.serves(started, "p", "1", "h1") and not draft_swap.serves(started, "p", "2", "h2")
    assert draft_swap.serves(swapped, "p", "2", "h2") and draft_swap.swapped(swapped, "p", "2", "h2")
    # Swapped away from the release it started with: it no longer serves that one.
    assert not draft_swap.serves(swapped, "p", "1", "h1") and not draft_swap.swapped(started, "p", "1", "h1")
    assert draft_swap.serves(older, "p", "1", "h1") and not draft_swap.serves(older, "q", "1", "h1")
    assert draft_swap.owning_replicaset([pod(0), pod(1)]) == REPLICASET
    assert draft_swap.owning_replicaset([pod(0), pod(1, "b")]) is None
    assert draft_swap.owning_replicaset([{"metadata": {"name": "bare"}}]) is None


# -- passes killed after each write ---------------------------------------------------------------

def pod_template(dep: dict[str, Any]) -> str:
    return json.dumps(dep["spec"]["template"], sort_keys=True)


class Cluster:
    """The pair's engine as passes leave it: the Deployment, its ReplicaSet's template, whether it
    is paused, what each pod drafts with, the status's records. The Deployment controller rolls
    the pods (which this journey must never see) whenever the Deployment is not paused and no
    ReplicaSet's template equals its own."""

    def __init__(self) -> None:
        self.w = promoted(NEW_DRAFT)
        self.replicaset = pod_template(self.w.deployment)
        self.rolled = 0
        self.recorded: dict[str, tuple[str, ...]] = dict(self.w.records.recorded)
        self.history: list[str] = []

    def world(self) -> ServingWorld:
        return dataclasses.replace(self.w, records=Records(dict(self.recorded)))

    def controller(self) -> None:
        dep = self.w.deployment
        if not dep["spec"].get("paused") and pod_template(dep) != self.replicaset:
            self.rolled += 1
            self.replicaset = pod_template(dep)

    def writes(self, step: Any) -> list[Any]:
        """The API writes one step makes, each a function (act's order)."""
        w = self.w
        if isinstance(step, ds.SwapDraft):
            def swap() -> None:
                served = json.loads(step.release_json)
                ready = tuple(dataclasses.replace(p, info={**p.info, "draftVersion": step.version,
                                                          "draftContentHash": release.content_hash(served)})
                              if p.name == step.pod else p for p in self.w.ready)
                self.w = dataclasses.replace(self.w, ready=ready)

            def label() -> None:
                pods = tuple({**p, "metadata": {**p["metadata"], "labels": {**p["metadata"]["labels"],
                                                                            **step.metadata["labels"]}}}
                             if p["metadata"]["name"] == step.pod else p for p in self.w.pods)
                self.w = dataclasses.replace(self.w, pods=pods)
            return [swap, label]
        if isinstance(step, ds.PromoteInPlace):
            def pause() -> None:
                dep = json.loads(json.dumps(self.w.deployment))
                dep["spec"]["paused"] = True
                dep["metadata"]["annotations"][draft_swap.ANN_PAUSED_FOR_SWAP] = step.key
                self.w = dataclasses.replace(self.w, deployment=dep)

            def replicaset() -> None:
                self.replicaset = pod_template(step.manifest)

            def deployment() -> None:
                dep = mine(dict(step.manifest))
                dep["spec"]["paused"] = True
                dep["metadata"]["annotations"][draft_swap.ANN_PAUSED_FOR_SWAP] = step.key
                dep["status"] = self.w.deployment["status"]
                dep["metadata"]["generation"] = 1
                self.w = dataclasses.replace(self.w, deployment=dep)
            return [pause, replicaset, deployment, self.resume]
        if isinstance(step, ds.ResumeEngine):
            return [self.resume]
        if isinstance(step, sp.EnsureOwned) and step.manifest["kind"] == "Deployment":
            def patch() -> None:
                dep = mine(dict(step.manifest))
                dep["status"], dep["metadata"]["generation"] = w.deployment["status"], 1
                self.w = dataclasses.replace(self.w, deployment=dep)
            return [patch]
        assert not isinstance(step, sp.WRITES), step
        return []

    def resume(self) -> None:
        dep = json.loads(json.dumps(self.w.deployment))
        dep["spec"]["paused"] = False
        dep["metadata"]["annotations"].pop(draft_swap.ANN_PAUSED_FOR_SWAP, None)
        self.w = dataclasses.replace(self.w, deployment=dep)

    def one_pass(self, kill_after: int | None, done: list[int]) -> bool:
        """One pass; killed after the write numbered `kill_after` (counting across passes in
        `done`). True when it was killed."""
        recorded, history = dict(self.recorded), []
        for step in sp.plan_serving(self.world()):
            for write in self.writes(step):
                write()
                self.controller()
                done[0] += 1
                if done[0] == kill_after:
                    return True       # the status of this pass is lost
            if isinstance(step, rs.Record):
                history.append(step.action)
                if step.key:
                    recorded[step.action] = (*recorded.get(step.action, ()), step.key)
        self.recorded, self.history = recorded, self.history + history
        return False


def journey(kill_after: int | None) -> Cluster:
    cluster, done = Cluster(), [0]
    for _ in range(12):
        cluster.one_pass(kill_after, done)
    return cluster


def test_passes_killed_after_any_write_swap_every_pod_move_the_template_and_never_roll():
    calm = journey(None)
    writes = 2 * 2 + 4   # a SwapDraft and a label per pod, then the move's pause, ReplicaSet, Deployment, resume
    assert calm.history == ["DraftSwapped"] and calm.rolled == 0
    for kill in range(1, writes + 1):
        cluster = journey(kill)
        assert cluster.rolled == 0, f"killed after write {kill}: the pods rolled"
        assert cluster.history == ["DraftSwapped"], (kill, cluster.history)
        dep = cluster.w.deployment
        assert not dep["spec"].get("paused") and draft_swap.ANN_PAUSED_FOR_SWAP not in dep["metadata"]["annotations"]
        assert pod_template(dep) == cluster.replicaset == pod_template(calm.w.deployment)
        assert all(draft_swap.swapped(p.info, PAIR, "2", release.content_hash(sp.served_release(cluster.w)))
                   for p in cluster.w.ready)
