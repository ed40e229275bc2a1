"""The champion's serving (serving_plan.py) as tables: for each scenario the end-to-end tests
drive through a real API server, MLflow and engines (a first rollout; scaling; a new template;
the legacy engine retired; a name taken by an object the pair does not own; a certificate
issued, kept or reissued; a pod with another tokenizer; the drift ladder from SpeculationOff to
a rollback, or to RollbackWouldNotHelp; MLflow down), a ServingWorld and the steps plan_serving
returns for it.

Then recovery: a small model of the cluster (`Cluster`) runs passes until nothing is left to
do, with the operator killed after each write of the way in turn (the writes stay, the status
and the in-process memory of that pass are lost). Every run ends where the undisturbed one does,
with each action recorded once.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections import Counter
from typing import Any, Iterator

import pytest
from specpair.server.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS

import plan_tables
from plan_tables import CURRENT_TLS, MODEL, NOW, NS, PAIR, TLS, UID, kinds, mine, pod_info
from specpair_operator.policy import drift, serving_health
from specpair_operator.desired import engine_objects, model_fetch
from specpair_operator.act import metrics
from specpair_operator.crd import conditions
from specpair_operator.release import content as release
from specpair_operator.plan import release_steps as rs
from specpair_operator.plan import release_plan as p
from specpair_operator.plan import serving_plan as sp
from specpair_operator.plan import serving_steps
from specpair_operator.release.registry_contract import TAG_RELEASE, TAG_ROLLED_BACK, TAG_SPECULATION_OFF
from specpair_operator.observe.serving_world import DriftMemory, EnginePod, ServingWorld
from specpair_operator.observe.world import Records, ReleaseWorld

GOOD = {"passed": True, "reasons": [], "tokenizer": {"compatible": True, "differences": []},
        "greedyIdentity": 1.0, "acceptanceRate": 0.7, "speedup": 1.4,
        "categories": {"code": {"acceptanceRate": 0.8}, "chat": {"acceptanceRate": 0.6}}}
# Small windows so a few passes climb the ladder: every pass is a check.
DRIFT = {"windowSeconds": 10, "intervalSeconds": 0, "minDraftedTokens": 100, "minRequests": 5,
         "consecutiveBreaches": 1, "probeAfterWindows": 1000}
SPEC = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "abc"}, "draft": {"drafter": "ngram"},
        "rollout": {"replicas": 1}, "drift": DRIFT}


def release_tags(version: str, draft: dict[str, Any] | None = None) -> dict[str, str]:
    """A release of the pair (k differs per version; the draft only when given)."""
    return plan_tables.release_tags({**SPEC, "speculation": {"k": 3 + int(version)},
                                     **({"draft": draft} if draft else {})})


def base(**changes: Any) -> ServingWorld:
    w = ServingWorld(pair=PAIR, namespace=NS, uid=UID, model=MODEL, aliases={"champion": "1"}, desired="1",
                     spec=SPEC, status={"engineTLS": CURRENT_TLS}, now=NOW, tags=release_tags("1"), verdict=GOOD,
                     tls=TLS)
    return dataclasses.replace(w, **changes)


def theirs(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["metadata"]["ownerReferences"] = [{"uid": "someone-else", "controller": True}]
    return obj


def deployment(w: ServingWorld, available: bool = True, **status: Any) -> dict[str, Any]:
    dep = mine(sp.engine_deployment(w, sp.served_release(w)))
    n = dep["spec"]["replicas"]
    dep["metadata"]["generation"] = 1
    dep["status"] = {"observedGeneration": 1, "replicas": n, "updatedReplicas": n,
                     "availableReplicas": n if available else 0, **status}
    return dep


def serving(w: ServingWorld | None = None, pods: int = 1, **info: Any) -> ServingWorld:
    """`w` with its engine in place and available, and `pods` ready pods that answer."""
    w = w or base()
    dep = deployment(w)
    rolled_out = f"{w.aliases['champion']}@{sp.template_fingerprint(dep)}"  # its RolloutStarted is recorded
    return dataclasses.replace(
        w, deployment=dep, records=Records({"RolloutStarted": (rolled_out,)}),
        service=mine(engine_objects.engine_service(PAIR, NS, {}), mutable=False),
        policy=mine(engine_objects.engine_network_policy(PAIR, NS)),
        ready=tuple(EnginePod(f"pod{i}", f"u{i}", f"10.0.0.{i}", pod_info(sp.served_release(w), **info)) for i in range(pods)))


def writes(steps: tuple[Any, ...]) -> list[str]:
    return [k for s, k in zip(steps, kinds(steps)) if isinstance(s, sp.WRITES)]


# -- the engine's objects -----------------------------------------------------------------------

ENGINE = ["EnsureOwned NetworkPolicy", "EnsureOwned Deployment"]  # created, or patched to what is rendered now


def test_a_first_rollout_creates_the_engine_and_records_it_once():
    steps = sp.plan_serving(base(status={}))
    assert kinds(steps) == [
        "SetStatus previousVersion,servingVersion", "SetStatus speedup", "ExportSpeedup", "SetStatus acceptance",
        "IssueCertificate", *ENGINE, "Record RolloutStarted", "SetStatus replicas,selector", "EnsureOwned Service",
        "EnsureAutoscaler", "Report reconciling RollingOut/RollingOut"]
    report = steps[-1]
    assert report.message == "rolling out v1: Deployment controller has not observed the new template yet"
    # Created: its pods wait on the scheduler, which the report says.
    stuck = {"metadata": {"name": "chat-engine-x"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes: Insufficient cpu"}]}}
    w = base()
    progressing = sp.plan_serving(dataclasses.replace(w, deployment=deployment(w, available=False), pods=(stuck,)))
    assert progressing[-1].message.endswith("pod chat-engine-x is Pending: Unschedulable: 0/1 nodes: Insufficient cpu")
    assert "Record RolloutStarted" in kinds(progressing)  # created by a pass that died before its status


def test_an_available_engine_whose_pods_answer_serves():
    w = serving(pods=2)
    steps = sp.plan_serving(w)
    assert writes(steps) == []  # everything is as rendered: nothing written
    assert kinds(steps)[-1] == "ReportSpeculation Serving"
    assert steps[-1].otherwise.message == "v1 serving on 2 pod(s), identity verified"
    assert sp.RememberChampion("1", w.tags, GOOD, release.content_hash(sp.served_release(w))) in steps


@pytest.mark.parametrize("what, change, expected", [
    ("a new replica count is scaling: an Event, no history entry",
     {"rollout": {"replicas": 3}}, ["Event Scaled"]),
    ("a new pod template is a rollout: RolloutStarted",
     {"rollout": {"replicas": 1, "nodeSelector": {"gpu": "a100"}}}, ["Record RolloutStarted"]),
])
def test_scaled_vs_rollout_started(what, change, expected):
    w = serving()
    w = dataclasses.replace(w, spec={**SPEC, **change})
    steps = kinds(sp.plan_serving(w))
    assert [k for k in steps if k in ("Event Scaled", "Record RolloutStarted")] == expected
    # The Deployment controller has not seen the new spec yet: rolling out, not serving.
    assert steps[-1] == "Report reconciling RollingOut/RollingOut"


CACHE = {**SPEC, "rollout": {"replicas": 1, "modelCache": {"persistentVolumeClaim": "hub"}}}
MODELS = "m" * 64
FETCH_HEAD = ["SetStatus previousVersion,servingVersion", "SetStatus speedup", "ExportSpeedup", "SetStatus acceptance",
              "IssueCertificate", "EnsureOwned NetworkPolicy"]


def fetching(phase: str, message: str = "", **changes: Any) -> ServingWorld:
    """The champion's engine to roll, its models not in the pair's model cache yet."""
    return base(spec=CACHE, status={}, models=MODELS, model_fetch=model_fetch.FetchState(phase, message=message),
                **changes)


@pytest.mark.parametrize("what, w, expected", [
    ("no fetch Job: it is created, an Event, ModelsFetching; no Deployment",
     fetching(model_fetch.ABSENT),
     [*FETCH_HEAD, "EnsureOwned Job", "Event ModelFetchStarted", "Report reconciling RollingOut/ModelsFetching"]),
    ("the fetch runs: ModelsFetching with its words, nothing written",
     fetching(model_fetch.RUNNING, "fetching (Job x); pod y cannot start: ErrImagePull: nope"),
     [*FETCH_HEAD, "Report reconciling RollingOut/ModelsFetching"]),
    ("the fetch failed: Stalled ModelFetchFailed, recorded once; no Deployment, no rollback",
     fetching(model_fetch.FAILED, "model fetch Job x failed: models:/t/3: 404"),
     [*FETCH_HEAD, "Record ModelFetchFailed", "Report stalled Failed/ModelFetchFailed"]),
    ("the fetch failed, recorded already: no second Event",
     fetching(model_fetch.FAILED, "model fetch Job x failed", records=Records({"ModelFetchFailed": (MODELS,)})),
     [*FETCH_HEAD, "Report stalled Failed/ModelFetchFailed"]),
    ("the fetch is done: recorded in status, then the Deployment",
     fetching(model_fetch.DONE, "models fetched by Job x"),
     [*FETCH_HEAD, "SetStatus modelCache", "Event ModelsFetched", "EnsureOwned Deployment", "Record RolloutStarted",
      "SetStatus replicas,selector", "EnsureOwned Service", "EnsureAutoscaler",
      "Report reconciling RollingOut/RollingOut"]),
])
def test_the_engine_rolls_only_once_its_models_are_fetched(what, w, expected):
    assert kinds(sp.plan_serving(w)) == expected


def test_the_fetch_job_is_the_served_release_s_and_owned_like_every_child():
    w = fetching(model_fetch.ABSENT)
    job = next(s for s in sp.plan_serving(w) if isinstance(s, sp.EnsureOwned)
               and s.manifest["kind"] == "Job")
    assert (job.mutable, job.live) == (False, None)
    assert job.manifest == model_fetch.desired_fetch_job(PAIR, NS, sp.served_release(w), dict(CACHE["rollout"]),
                                                         w.installation.tracking_uri, w.installation.credentials,
                                                         w.installation.pods)
    # An engine already running the release is not held back by an unrecorded fetch.
    running = serving(fetching(model_fetch.ABSENT))
    assert "EnsureOwned Job" not in kinds(sp.plan_serving(running))


def test_a_rollback_to_a_release_whose_models_are_not_fetched_fetches_them_first():
    # The pass that rolled back moved champion to 1; the engine still runs v2's template.
    v2 = serving(base(spec=CACHE, aliases={"champion": "2", "previous": "1"}, tags=release_tags("2")))
    w = dataclasses.replace(v2, aliases={"champion": "1", "previous": "2"}, tags=release_tags("1"), ready=(),
                            models=MODELS, model_fetch=model_fetch.FetchState(model_fetch.ABSENT))
    steps = kinds(sp.plan_serving(w))
    assert "EnsureOwned Job" in steps and "EnsureOwned Deployment" not in steps
    assert steps[-1] == "Report reconciling RollingOut/ModelsFetching"
    done = kinds(sp.plan_serving(dataclasses.replace(w, model_fetch=model_fetch.FetchState(model_fetch.DONE))))
    assert "EnsureOwned Job" not in done and "EnsureOwned Deployment" in done


def test_a_failed_rollout_rolls_back_to_the_previous_release():
    w = base(aliases={"champion": "2", "previous": "1"}, tags=release_tags("2"))
    w = dataclasses.replace(w, deployment=deployment(w, available=False, conditions=[
        {"type": "Progressing", "reason": "ProgressDeadlineExceeded", "message": "crash looping"}]))
    steps = sp.plan_serving(w)
    assert kinds(steps)[-8:] == ["Condition Drifted=True RolledBack", "TagVersion v2 specpair.rolled_back",
                                 "SetAlias champion=1", "Record RolledBack", "ForgetDrift",
                                 "SetStatus acceptance,drift,live,speculationEnabled", "SetStatus previousVersion,servingVersion",
                                 "Report reconciling RollingOut/RolledBack"]
    # The drift fields are v1's from here, fresh: the RolledBack condition says why v1 serves.
    assert steps[-3].fields["drift"]["version"] == "1" and steps[-3].fields["live"]["trafficShift"] == {}
    assert steps[-3].fields["speculationEnabled"] is True
    assert steps[-1].ready_message == "rollout of v2 failed: rollout failed: crash looping"
    rolled = next(s for s in steps if isinstance(s, rs.Record) and s.action == "RolledBack")
    assert metrics.rollback_cause(rolled.reason) == "rollout", rolled.reason


def test_the_legacy_engine_is_retired_once_the_current_one_is_available():
    name = "chat.v2"  # not a DNS label: its objects got a hash in their names
    w = base(pair=name, tags=release_tags("1"))
    legacy = mine({"apiVersion": "apps/v1", "kind": "Deployment", "spec": {"replicas": 2},
                   "metadata": {"name": "chat-v2-engine", "namespace": NS}})
    w = serving(dataclasses.replace(w, legacy_deployment=legacy))
    w = dataclasses.replace(w, ready=tuple(dataclasses.replace(x, info={**x.info, "pair": name}) for x in w.ready))
    steps = sp.plan_serving(w)
    assert sp.RetireLegacyEngine("chat-v2-engine") in steps and "Event LegacyEngineRetired" in kinds(steps)
    # Scaled to zero already, or another's, or not yet available: left alone.
    for legacy_now in ({**legacy, "spec": {"replicas": 0}}, theirs(legacy)):
        assert "RetireLegacyEngine" not in kinds(sp.plan_serving(dataclasses.replace(w, legacy_deployment=legacy_now)))
    rolling = dataclasses.replace(w, deployment=deployment(w, available=False))
    assert "RetireLegacyEngine" not in kinds(sp.plan_serving(rolling))


@pytest.mark.parametrize("field, kind", [("deployment", "Deployment"), ("service", "Service"),
                                         ("policy", "NetworkPolicy")])
def test_a_name_taken_by_an_object_the_pair_does_not_own_is_never_touched(field, kind):
    w = serving()
    w = dataclasses.replace(w, **{field: theirs(getattr(w, field))})
    steps = sp.plan_serving(w)
    assert not [s for s in steps if isinstance(s, sp.EnsureOwned)]
    assert kinds(steps)[-1] == "Report stall Failed/NameConflict"
    assert steps[-1].message.startswith(f"{kind} {NS}/chat-engine exists and is not owned by SpecModelPair {PAIR}")


@pytest.mark.parametrize("what, status_tls, tls, expected", [
    ("status knows a current certificate: kept", CURRENT_TLS, TLS, "SetStatus engineTLS"),
    ("none yet", None, TLS, "IssueCertificate no certificate from this CA yet"),
    ("a new CA", CURRENT_TLS, dataclasses.replace(TLS, ca_fingerprint="ca2"),
     "IssueCertificate no certificate from this CA yet"),
    ("the Service's names changed", CURRENT_TLS, dataclasses.replace(TLS, names=("x.team.svc",)),
     "IssueCertificate the Service's names changed"),
    ("near its end", {**CURRENT_TLS, "notAfter": "2026-12-01T00:00:00Z"}, TLS,
     "IssueCertificate it expires 2026-12-01T00:00:00Z"),
    ("its Secret deleted by hand", CURRENT_TLS, dataclasses.replace(TLS, missing=True),
     "IssueCertificate engine pods cannot find Secret chat-engine-tls"),
    ("issued by a pass that died before its status: kept, renewed within a day", None,
     dataclasses.replace(TLS, held=True), "SetStatus engineTLS"),
])
def test_the_engine_certificate(what, status_tls, tls, expected):
    w = serving(base(status={"engineTLS": status_tls} if status_tls else {}, tls=tls))
    step = next(s for s in sp.plan_serving(w) if isinstance(s, sp.IssueCertificate)
                or (isinstance(s, rs.SetStatus) and "engineTLS" in s.fields))
    said = f"IssueCertificate {step.reason}" if isinstance(step, sp.IssueCertificate) else "SetStatus engineTLS"
    assert said == expected
    if tls.held:
        assert step.fields["engineTLS"]["notAfter"] == "2026-12-26T12:00:00Z"
    # vLLM pods' control listener is their companion's: the same certificate, the same steps.
    vllm = dataclasses.replace(w, tags={**w.tags, TAG_RELEASE: json.dumps(
        {**json.loads(w.tags[TAG_RELEASE]), "engine": {"kind": "vllm", "image": "v"}})})
    assert [str(s) for s in sp.plan_serving(vllm) if isinstance(s, sp.IssueCertificate)] == \
        [str(s) for s in sp.plan_serving(w) if isinstance(s, sp.IssueCertificate)]


# -- identity ------------------------------------------------------------------------------------

def test_a_pod_with_another_tokenizer_rolls_back():
    w = serving(base(aliases={"champion": "2", "previous": "1"}, tags=release_tags("2")),
                tokenizer={"target": "t", "draft": "other"})
    steps = sp.plan_serving(w)
    assert writes(steps) == ["TagVersion v2 specpair.rolled_back", "SetAlias champion=1"]
    rolled = next(s for s in steps if isinstance(s, rs.Record))
    assert (rolled.action, rolled.from_version, rolled.to_version, rolled.key) == ("RolledBack", "2", "1", "2")
    assert rolled.reason.startswith("tokenizer mismatch on pod pod0: draft tokenizer fingerprint other")
    # Without a previous release: NoPreviousRelease, Stalled, nothing moved.
    alone = serving(tokenizer={"target": "t", "draft": "other"})
    assert kinds(sp.plan_serving(alone))[-2:] == ["Condition Drifted=True NoPreviousRelease", "Report stalled Failed/NoPreviousRelease"]
    assert not [s for s in sp.plan_serving(alone) if isinstance(s, (rs.TagVersion, rs.SetAlias))]


@pytest.mark.parametrize("what, ready, reason, message", [
    ("no ready pod", (), "IdentityUnverified", "no ready engine pods"),
    ("a pod that does not answer", (EnginePod("pod0", "u", "10.0.0.1", unreachable="timed out"),),
     "IdentityUnverified", "pod pod0: model identity not verified: timed out"),
])
def test_pods_not_verified_are_reported_not_judged(what, ready, reason, message):
    steps = sp.plan_serving(dataclasses.replace(serving(), ready=ready))
    assert kinds(steps)[-1] == f"Report reconciling RollingOut/{reason}" and steps[-1].message == message
    assert not [s for s in steps if isinstance(s, (sp.RememberChampion, sp.DriftChecked))]


def test_a_pod_serving_another_release_is_caught_by_its_content_hash():
    steps = sp.plan_serving(serving(contentHash="f" * 64))
    assert steps[-1].reason == "IdentityUnverified" and "with content hash ffffffffffff" in steps[-1].message


def test_a_champion_tagged_rolled_back_has_its_rollback_finished():
    w = base(aliases={"champion": "2", "previous": "1"}, tags={**release_tags("2"), TAG_ROLLED_BACK: "drift"})
    assert writes(sp.plan_serving(w)) == ["SetAlias champion=1"]


# -- speculation per pod --------------------------------------------------------------------------

def test_a_restarted_pod_is_switched_to_the_state_drift_wants():
    off = {"engineTLS": CURRENT_TLS, "speculationEnabled": False,
           "drift": {"version": "1", "stepsTaken": 1, "since": 0.0}}
    w = serving(base(status=off), pods=2)
    w = dataclasses.replace(w, ready=(w.ready[0], dataclasses.replace(w.ready[1], info={**w.ready[1].info,
                                                                                       "speculationEnabled": False})),
                            drift=DriftMemory(checked_at=1e9))  # no drift check due
    steps = sp.plan_serving(w)
    assert [s for s in steps if isinstance(s, sp.ReconcilePodSpeculation)] == [
        sp.ReconcilePodSpeculation("pod0", "10.0.0.0:50052", False, "1")]
    assert kinds(steps)[-3:] == ["Report ready Degraded/SpeculationOff", "ReconcilePodSpeculation",
                                 "ReportSpeculation -"]


def test_a_new_champion_speculates_although_the_previous_ones_ladder_left_it_off():
    # v1's ladder turned speculation off, then v2 was promoted (a promotion keeps the field) and
    # its first drift check wrote v2's fresh state: v2's pods speculate, and status says so.
    inherited = {"engineTLS": CURRENT_TLS, "speculationEnabled": False,
                 "drift": {"version": "1", "stepsTaken": 1, "since": 0.0}}
    for drift in (inherited["drift"], {"version": "1", "stepsTaken": 0, "since": 0.0}):
        w = serving(base(status={**inherited, "drift": {**drift, "version": "1"}}), pods=1)
        w = dataclasses.replace(w, drift=DriftMemory(checked_at=1e9))
        assert serving_steps.status_speculation(w, "1") is (drift["stepsTaken"] == 0)
    w = serving(base(status={**inherited, "drift": {"version": "1", "stepsTaken": 0, "since": 0.0}}), pods=2)
    w = dataclasses.replace(w, ready=tuple(dataclasses.replace(p, info={**p.info, "speculationEnabled": False})
                                           for p in w.ready), drift=DriftMemory(checked_at=1e9))
    steps = sp.plan_serving(w)
    assert [s for s in steps if isinstance(s, sp.ReconcilePodSpeculation)] == [
        sp.ReconcilePodSpeculation(f"pod{i}", f"10.0.0.{i}:50052", True, "1") for i in range(2)]
    assert [s.fields for s in steps if isinstance(s, rs.SetStatus) and "speculationEnabled" in s.fields] \
        == [{"speculationEnabled": True}]


# -- the drift ladder ---------------------------------------------------------------------------

def counters(drafted: int, accepted: int, requests: int, uptime: float) -> dict[str, Any]:
    """GetStats of a pod that started at time 0."""
    return {"uptimeSeconds": uptime, "categories": {"code": {"drafted": drafted, "accepted": accepted,
                                                           "requests": requests}}}


def drifting(w: ServingWorld, rate: float, at: float, total: int) -> ServingWorld:
    """Every pod's counters after `total` drafted tokens at acceptance `rate`, at time `at`."""
    return dataclasses.replace(
        w, ready=tuple(dataclasses.replace(x, stats=counters(total, int(total * rate), total // 20, at)) for x in w.ready),
        drift=dataclasses.replace(w.drift, monotonic=at, wall=at))


class Cluster:
    """A small model of what the serving steps write: MLflow (aliases, tags), the engine's
    objects and pods, the pair's status and the operator's memory. The Deployment controller,
    the kubelet and the engine pods move on between passes (`tick`)."""

    def __init__(self, w: ServingWorld, tags: dict[str, dict[str, str]], rates: dict[str, float]):
        self.w, self.tags, self.rates = w, tags, rates   # rates: the live acceptance of each version
        self.history: list[tuple[str, str | None]] = []
        self.said: Counter = Counter()       # the reasons of the conditions set
        self.served: dict[str, Any] = {}       # what the Deployment's pods load: version, hash
        self.speculating = True
        self.drafts_while_off = True       # an engine that probes by itself; False: it drafts nothing
        self.drafted, self.t = 0, 100.0
        self.ready_version: str | None = None
        self.draft_tokenizer: dict[str, str] = {}   # per version, what its pods report ('d': as gated)
        self.error_rates: dict[str, float] = {}      # per version, the share of requests its pods fail
        self.errors_from = 0.0                       # ... from this time on
        self.slowdown: dict[str, float] = {}         # per version, how much slower its pods serve
        self.slow_from = 0.0                         # ... from this time on
        self.requests = {"ok": 0, "error": 0}
        self.latency = {"ttft": [0] * len(LATENCY_BUCKETS), "tpot": [0] * len(TOKEN_BUCKETS)}
        self.fetch: dict[str, str] = {}              # per version with a model cache, its fetch Job's phase

    def healthy(self) -> bool:
        """The champion serves as gated: nothing left for the ladder to do."""
        champion = self.w.aliases["champion"]
        return self.rates[champion] >= 0.7 and not self.error_rates.get(champion) and not self.slowdown.get(champion)

    def world(self) -> ServingWorld:
        champion = self.w.aliases["champion"]
        # observe: the champion's fetch Job, unless the status records its models as fetched
        models = f"models-of-v{champion}"
        fetched = tuple((self.w.status.get("modelCache") or {}).get("fetched") or ())
        phase = self.fetch.get(champion)
        return dataclasses.replace(self.w, tags=self.tags[champion], drift=dataclasses.replace(
            self.w.drift, monotonic=self.t, wall=self.t, previous_tags=self.tags.get(self.w.aliases.get("previous", "")),
            previous_verdict=GOOD), models=models, fetched=fetched,
            model_fetch=model_fetch.FetchState(phase) if phase and models not in fetched else None)

    def apply(self, step: Any, status: dict[str, Any]) -> None:
        w = self.w
        if isinstance(step, rs.SetAlias):
            self.w = dataclasses.replace(w, aliases={**w.aliases, step.alias: step.version})
        elif isinstance(step, rs.TagVersion):
            self.tags[step.version] = {**self.tags[step.version], **{k: v for k, v in step.tags.items()}}
        elif isinstance(step, sp.EnsureOwned):
            obj = mine(dict(step.manifest), step.mutable)
            if obj["kind"] == "Job":
                champion = w.aliases["champion"]
                assert self.fetch.get(champion) == model_fetch.ABSENT, f"fetch Job of v{champion} created twice"
                self.fetch[champion] = model_fetch.RUNNING
                return
            if obj["kind"] == "Deployment":
                assert self.world().model_fetch is None or self.world().model_fetch.phase == model_fetch.DONE, \
                    "rolled before the models are fetched"
                obj["metadata"]["generation"] = ((w.deployment or {}).get("metadata", {}).get("generation", 0)) + 1
                obj["status"] = (w.deployment or {}).get("status") or {}
                self.served = {"version": w.aliases["champion"],
                               "hash": release.content_hash(sp.served_release(self.world()))}
                if release.engine_kind(sp.served_release(self.world())) == "vllm":
                    # vLLM has no runtime switch: its new pods speculate as their command says.
                    self.speculating = "--no-speculation" not in obj["spec"]["template"]["spec"]["containers"][0]["command"]
            self.w = dataclasses.replace(self.w, **{{"Deployment": "deployment", "Service": "service",
                                                     "NetworkPolicy": "policy"}[obj["kind"]]: obj})
        elif isinstance(step, sp.IssueCertificate):
            status["engineTLS"] = CURRENT_TLS
        elif isinstance(step, sp.SwitchSpeculation):
            self.speculating = step.enabled
        elif isinstance(step, sp.ReconcilePodSpeculation):
            self.speculating = step.desired
        elif isinstance(step, rs.SetStatus):
            status.update(step.fields)
        elif isinstance(step, rs.Condition):
            self.said[step.reason] += 1
            # as the ledger sets it: the next pass reads the condition this one left
            status["conditions"] = conditions.set_condition(status.get("conditions"), step.type, step.status,
                                                            step.reason, step.message, 1)
        elif isinstance(step, rs.Record):
            self.history.append((step.action, step.key))
            recorded = dict(self.w.records.recorded)
            if step.key is not None:
                recorded[step.action] = recorded.get(step.action, ()) + (step.key,)
            self.w = dataclasses.replace(self.w, records=Records(recorded, True))
        elif isinstance(step, sp.RememberDrift):
            self.w = dataclasses.replace(self.w, drift=dataclasses.replace(self.w.drift, version=step.champion,
                                                                           memory=step.memory, serving=step.serving))
        elif isinstance(step, sp.ForgetDrift):
            self.w = dataclasses.replace(self.w, drift=dataclasses.replace(self.w.drift, version="",
                                                                           memory=drift.Memory(),
                                                                           serving=serving_health.ServingMemory()))

    def tick(self) -> None:
        """The Deployment controller makes the Deployment available; its pod loads what it was given
        and drafts 400 tokens at `rate` (speculating, or probing with the drafter while off)."""
        self.t += 3.0
        self.fetch = {v: model_fetch.DONE if phase == model_fetch.RUNNING else phase for v, phase in self.fetch.items()}
        dep = self.w.deployment
        if dep is not None:
            dep = copy.deepcopy(dep)
            n = dep["spec"]["replicas"]
            dep["status"] = {"observedGeneration": dep["metadata"]["generation"], "replicas": n,
                             "updatedReplicas": n, "availableReplicas": n}
            version = self.served.get("version")
            if self.ready_version != version:  # new pods: their counters start at zero
                self.ready_version, self.drafted, self.requests = version, 0, {"ok": 0, "error": 0}
                self.latency = {"ttft": [0] * len(LATENCY_BUCKETS), "tpot": [0] * len(TOKEN_BUCKETS)}
            if self.speculating or self.drafts_while_off:
                self.drafted += 400
            rate = self.rates[version]
            failed = round(20 * self.error_rates.get(version, 0.0)) if self.t >= self.errors_from else 0
            self.requests = {"ok": self.requests["ok"] + 20 - failed, "error": self.requests["error"] + failed}
            # 20 requests: TTFT 20 ms, TPOT 5 ms, times the version's slowdown once it began
            slower = self.slowdown.get(version, 1.0) if self.t >= self.slow_from else 1.0
            for metric, seconds, bounds in (("ttft", 0.02, LATENCY_BUCKETS), ("tpot", 0.005, TOKEN_BUCKETS)):
                self.latency[metric] = [c + 20 * (seconds * slower <= b) for c, b in zip(self.latency[metric], bounds)]
            n = self.requests["ok"] + self.requests["error"]
            histograms = {m: {"upperBounds": list(bounds), "counts": self.latency[m], "count": n, "sum": 0.0}
                          for m, bounds in (("ttft", LATENCY_BUCKETS), ("tpot", TOKEN_BUCKETS))}
            info = {"pair": PAIR, "releaseVersion": self.served.get("version"), "contentHash": self.served.get("hash"),
                    "tokenizer": {"target": "t", "draft": self.draft_tokenizer.get(version, "d")},
                    "speculationEnabled": self.speculating}
            self.w = dataclasses.replace(self.w, deployment=dep, ready=(EnginePod(
                "pod0", f"u{version}", "10.0.0.1", info, stats={
                    **counters(self.drafted, int(self.drafted * rate), self.drafted // 20, self.t),
                    "speculating": self.speculating,
                    "serving": {"code": {"requests": dict(self.requests), **histograms}}}),))


def whole_pass(cl: Cluster) -> tuple[Any, ...]:
    """The release's plan for the spec's release (the champion's gate long passed and recorded),
    then the champion's serving as it hands over."""
    spec_release = cl.w.desired or cl.w.aliases["champion"]
    w = cl.world()
    steps = p.plan_release(ReleaseWorld(pair=PAIR, namespace=NS, version=spec_release, digest="d" * 64,
                                        thresholds={}, aliases=w.aliases, tags=cl.tags[spec_release],
                                        records=w.records, now=NOW))
    serve = steps[-1]
    return steps[:-1] + sp.plan_serving(dataclasses.replace(w, aliases=serve.aliases, desired=serve.desired,
                                                            desired_reason=serve.reason,
                                                            while_gating=serve.while_gating))


def run_passes(cl: Cluster, most: int) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Whole passes over `cl`, none killed, each one's steps applied, the pods moving on between
    them: (its steps, the status it left) a pass, until the caller stops or `most` ran."""
    for _ in range(most):
        steps = whole_pass(cl)
        status = dict(cl.w.status)
        for step in steps:
            cl.apply(step, status)
        cl.w = dataclasses.replace(cl.w, status=status)
        yield steps, status
        cl.tick()


def converge(start: Cluster, crash_at: int | None = None, passes: int = 40,
             planner: Any = None) -> tuple[Cluster, list[Any]]:
    """Passes (the pods moving on between them) until one plans no write and no record, or
    `passes` ran. The `crash_at`-th write is the last of its pass: its status and memory are lost."""
    cl = copy.deepcopy(start)
    done: list[Any] = []
    for _ in range(passes):
        steps = whole_pass(cl) if planner is None else planner(cl.world())
        status = dict(cl.w.status)
        later: list[Any] = []
        killed = False
        for step in steps:
            if isinstance(step, sp.WRITES):
                cl.apply(step, status)
                done.append(step)
                if crash_at is not None and len(done) == crash_at + 1:
                    killed = True
                    break
            else:
                later.append(step)
        if not killed:
            for step in later:
                cl.apply(step, status)
            cl.w = dataclasses.replace(cl.w, status=status)
        if not [s for s in steps if isinstance(s, sp.WRITES + (rs.Record,))] and cl.w.deployment is not None \
                and cl.healthy():
            return cl, done
        cl.tick()
    return cl, done


def ladder_start() -> Cluster:
    """v2 serving with an n-gram drafter that accepts 0.2 on this traffic (gated at 0.8 on code);
    v1 (previous) with a draft model that does well on it."""
    tags = {"1": release_tags("1", draft={"source": "HuggingFaceTB/draft-v1"}), "2": release_tags("2")}
    w = base(aliases={"champion": "2", "previous": "1"}, tags=tags["2"], status={"engineTLS": CURRENT_TLS},
             desired="2")
    return Cluster(w, tags, {"1": 0.75, "2": 0.2})


def end_state(cl: Cluster) -> tuple[Any, ...]:
    return (dict(cl.w.aliases), {v: sorted(k for k, x in t.items() if x) for v, t in cl.tags.items()},
            Counter(action for action, _ in cl.history), cl.w.status.get("servingVersion"))


def test_the_ladder_takes_speculation_off_then_rolls_back_when_the_previous_release_does_better():
    cl, _ = converge(ladder_start())
    actions = [a for a, _ in cl.history]
    assert actions[:3] == ["RolloutStarted", "SpeculationOff", "RolledBack"], actions
    assert cl.w.aliases["champion"] == "1" and cl.tags["2"][TAG_ROLLED_BACK].startswith("drift persisted")
    assert metrics.rollback_cause(cl.tags["2"][TAG_ROLLED_BACK]) == "drift"
    assert cl.w.status["servingVersion"] == "1"


def test_rollback_would_not_help_when_the_previous_release_serves_the_same_models_gated_no_better():
    start = ladder_start()
    start.tags["1"] = release_tags("1")  # the same target and draft, gated as well as v2
    start.rates["1"] = 0.2
    cl, _ = converge(start, passes=30)
    assert [a for a, _ in cl.history] == ["RolloutStarted", "SpeculationOff"] and cl.w.aliases["champion"] == "2"
    assert cl.w.status["drift"]["stepsTaken"] == 1
    assert cl.said["RollbackWouldNotHelp"], cl.said


def test_the_champion_is_watched_while_the_specs_release_cannot_serve():
    start = ladder_start()
    start.w = dataclasses.replace(start.w, desired=None, desired_reason="gate of v3 failed: acceptance 0.200 < 0.500",
                                  spec={**SPEC, "drift": {**DRIFT, "ladder": ["SpeculationOff"]}})
    cl, _ = converge(start, passes=30, planner=sp.plan_serving)
    assert [a for a, _ in cl.history] == ["RolloutStarted", "SpeculationOff"]
    assert cl.w.status["speculationEnabled"] is False and cl.said["SpeculationOff"] == 1
    # The pair still says why the spec's release does not serve.
    last = sp.plan_serving(cl.world())[-1]
    assert (last.how, last.phase, last.reason, last.ready_reason) == ("stalled", "Degraded", "ReleaseNotServable",
                                                                      "ChampionKeepsServing")
    assert last.message == "gate of v3 failed: acceptance 0.200 < 0.500; v2 keeps serving"


def test_a_speculation_off_mark_left_by_a_dead_pass_is_adopted_and_recorded_once():
    w = serving(base(tags={**release_tags("1"), TAG_SPECULATION_OFF: "sustained drift: code 0.2 < 0.62"},
                     spec={**SPEC, "drift": {**DRIFT, "intervalSeconds": 30}}))
    w = dataclasses.replace(w, drift=DriftMemory(checked_at=w.drift.monotonic))  # no check due
    steps = sp.plan_serving(w)
    assert kinds(steps)[-6:] == ["SetStatus speculationEnabled", "SetStatus drift", "Record SpeculationOff",
                                 "Report ready Degraded/SpeculationOff", "ReconcilePodSpeculation",
                                 "ReportSpeculation -"]
    assert sp.ReconcilePodSpeculation("pod0", "10.0.0.0:50052", False, "1") in steps


def test_the_journeys_end_as_the_end_to_end_tests_see_them():
    rolled, _ = converge(mismatched_tokenizer())
    assert [a for a, _ in rolled.history] == ["RolloutStarted", "RolledBack", "RolloutStarted"]
    assert rolled.tags["2"][TAG_ROLLED_BACK].startswith("tokenizer mismatch on pod pod0")
    assert metrics.rollback_cause(rolled.tags["2"][TAG_ROLLED_BACK]) == "tokenizer"
    assert rolled.w.status["servingVersion"] == "1" and rolled.w.status["speculationEnabled"] is True


def test_an_error_rate_above_the_limit_rolls_back_without_turning_speculation_off():
    cl, _ = converge(failing_requests(), passes=60)
    assert [a for a, _ in cl.history] == ["RolloutStarted", "RolledBack", "RolloutStarted"], cl.history
    assert cl.said["ErrorRateAboveLimit"] >= 1 and cl.w.status["servingVersion"] == "1"
    assert cl.tags["2"][TAG_ROLLED_BACK].startswith("sustained drift: ") and "error rate" in cl.tags["2"][TAG_ROLLED_BACK]
    assert metrics.rollback_cause(cl.tags["2"][TAG_ROLLED_BACK]) == "latency"


def test_with_mlflow_down_only_speculation_off_is_taken_and_without_its_mark():
    start = ladder_start()
    w = serving(start.world())
    served_hash = release.content_hash(sp.served_release(w))
    start.w = dataclasses.replace(w, registry_down=True, served_hash=served_hash)
    start.served = {"version": "2", "hash": served_hash}
    cl, done = converge(start, passes=30, planner=sp.plan_watch)
    # No mark in MLflow (it is down): the status alone carries the step. The rollback waits.
    assert not [s for s in done if isinstance(s, (rs.TagVersion, rs.SetAlias))]
    assert {(type(s).__name__, s.enabled if isinstance(s, sp.SwitchSpeculation) else s.desired) for s in done} \
        <= {("SwitchSpeculation", False), ("ReconcilePodSpeculation", False)}
    assert [a for a, _ in cl.history] == ["SpeculationOff"]
    assert cl.w.aliases["champion"] == "2" and cl.w.status["speculationEnabled"] is False


# -- speculation on a vLLM pair: a rollout, said by the plan -------------------------------------

GPU = {"resources": {"limits": {"nvidia.com/gpu": 1}}}


def vllm_drifting(rollout: dict[str, Any]) -> Cluster:
    """v2 served by vLLM with an n-gram drafter that accepts 0.2 on this traffic (gated at 0.7)."""
    spec = {**SPEC, "engine": "vllm", "rollout": rollout, "drift": {**DRIFT, "ladder": ["SpeculationOff"]}}
    tags = {"2": plan_tables.release_tags({**spec, "speculation": {"k": 5}})}
    return Cluster(base(aliases={"champion": "2"}, tags=tags["2"], spec=spec, desired="2"), tags, {"2": 0.2})


def planned(cl: Cluster) -> tuple[list[Any], Any]:
    """Every step the passes planned (not only the writes), and the planner that keeps them."""
    seen: list[Any] = []

    def planner(w: ServingWorld) -> tuple[Any, ...]:
        steps = sp.plan_serving(w)
        seen.extend(steps)
        return steps
    return seen, planner


@pytest.mark.parametrize("rollout, event, words", [
    ({"replicas": 1}, "Normal", "each new pod starts beside the old ones (maxSurge 1, maxUnavailable 0), so all 1 "
     "keep serving until it is ready"),
    ({"replicas": 1, **GPU}, "Normal", "(maxSurge 1, maxUnavailable 0), so all 1 keep serving until it is ready; its "
     "pods hold GPUs and it has one replica, so it surges rather than go unserved: the new pod needs a free device and "
     "waits Pending until one is, while the old pod serves on as it was"),
    ({"replicas": 2, **GPU}, "Normal", "its pods hold GPUs, and a GPU pool rarely has a spare device, so an old pod "
     "goes before its successor starts (maxSurge 0, maxUnavailable 1): at least 1 of 2 pods serve throughout"),
    ({"replicas": 3, **GPU}, "Normal", "(maxSurge 0, maxUnavailable 1): at least 2 of 3 pods serve throughout"),
])
def test_speculation_off_on_a_vllm_pair_is_a_rollout_the_plan_says(rollout, event, words):
    seen, planner = planned(vllm_drifting(rollout))
    cl, _ = converge(vllm_drifting(rollout), passes=30, planner=planner)
    # No switch a vLLM pod cannot make is planned (its probe would do nothing with it).
    assert not [s for s in seen if isinstance(s, (sp.SwitchSpeculation, sp.ReconcilePodSpeculation))]
    rolls = [s for s in seen if isinstance(s, sp.RollSpeculation)]
    assert [(r.enabled, r.type, r.reason) for r in rolls] == [(False, event, "SpeculationRollout")]
    assert rolls[0].message.startswith("speculation off for vLLM pair v2 is a new rollout of the same release with "
                                       "speculation disabled (vLLM cannot switch it at run time): ")
    assert words in rolls[0].message and "because: sustained drift: " in rolls[0].message
    assert rolls[0].roll.unserved == (event == "Warning")
    # The roll itself: the Deployment rendered without speculation, a rollout of the same version,
    # after which its pods report speculation off and the pair says so (nothing left stuck).
    assert [a for a, _ in cl.history] == ["RolloutStarted", "SpeculationOff", "RolloutStarted"]
    assert "--no-speculation" in cl.w.deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cl.w.deployment["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": rolls[0].roll.max_surge, "maxUnavailable": rolls[0].roll.max_unavailable}
    assert kinds(sp.plan_serving(cl.world()))[-2:] == ["Report ready Degraded/SpeculationOff", "ReportSpeculation -"]


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
def test_a_vllm_speculation_roll_never_leaves_the_pair_without_a_ready_pod(replicas, gpu):
    """Whatever its size and devices, a vLLM pair switching speculation (a rollout) keeps a pod
    ready throughout, by the strategy its Deployment is rendered with (one home)."""
    from specpair_operator.desired.engine_objects import rollout_strategy
    from specpair_operator.policy.rollout_strategy import speculation_roll

    rollout = {"replicas": replicas, **(GPU if gpu else {})}
    strategy = rollout_strategy(rollout, "vllm")
    roll = speculation_roll(strategy, replicas, gpu)
    assert roll.least_ready >= 1 and not roll.unserved, (strategy, roll)
    # On GPUs a surge only where it must (one replica): a GPU pool rarely has a spare device.
    assert strategy["rollingUpdate"]["maxSurge"] == (1 if not gpu or replicas == 1 else 0)


def test_the_specpair_engine_still_switches_its_pods_in_place():
    seen, planner = planned(ladder_start())
    converge(ladder_start(), planner=planner)
    assert [s.enabled for s in seen if isinstance(s, sp.SwitchSpeculation)][:1] == [False]
    assert not [s for s in seen if isinstance(s, sp.RollSpeculation)]


def test_the_vllm_probe_refuses_a_switch_it_cannot_make():
    import asyncio

    from specpair_operator.clients.engine_probe import NoRuntimeSwitch, VllmProbe
    with pytest.raises(NoRuntimeSwitch, match="vLLM cannot switch speculation off at run time"):
        asyncio.run(VllmProbe().set_speculation("127.0.0.1:1", False, "drift"))


def test_drift_is_not_judged_between_intervals_nor_when_disabled():
    w = serving()
    due = drifting(w, 0.2, 100.0, 400)
    assert sp.DriftChecked(100.0) in sp.plan_serving(due)
    early = dataclasses.replace(due, drift=dataclasses.replace(due.drift, checked_at=90.0),
                                spec={**SPEC, "drift": {**DRIFT, "intervalSeconds": 30}})
    assert not [s for s in sp.plan_serving(early) if isinstance(s, sp.DriftChecked)]
    off = dataclasses.replace(due, spec={**SPEC, "drift": {"enabled": False}})
    assert not [s for s in sp.plan_serving(off) if isinstance(s, (sp.DriftChecked, rs.Condition))]


# -- recovery: every prefix of a serving journey, then planned again ----------------------------

def mismatched_tokenizer() -> Cluster:
    """v2's pods load a draft tokenizer other than the one its gate measured."""
    cl = ladder_start()
    cl.rates["2"], cl.draft_tokenizer["2"] = 0.75, "other"
    return cl


def failing_requests() -> Cluster:
    """v2 accepts drafts as gated, but from t=150 (after its serving baseline formed) fails 30%
    of its requests."""
    cl = ladder_start()
    cl.rates["2"], cl.error_rates["2"], cl.errors_from = 0.75, 0.3, 150.0
    return cl


def slower_requests() -> Cluster:
    """v2 accepts drafts as gated, but from t=150 (after its serving baseline formed) serves ten
    times slower; v1 recorded its baseline when it served, at v2's speed before."""
    cl = ladder_start()
    cl.rates["2"], cl.slowdown["2"], cl.slow_from = 0.75, 10.0, 150.0
    v1 = {"ttftP95": {"code": 0.01975}, "tpotP95": {"code": 0.00495}, "errorRate": 0, "load": 6.7, "requests": 200}
    cl.w = dataclasses.replace(cl.w, status={**cl.w.status, "servingHealth": {"version": "1", "baselines": {"1": v1}}})
    return cl


def test_slower_requests_turn_speculation_off_then_roll_back_to_the_release_that_was_faster():
    cl, _ = converge(slower_requests(), passes=80)
    assert [a for a, _ in cl.history] == ["RolloutStarted", "SpeculationOff", "RolledBack", "RolloutStarted"], \
        cl.history
    assert cl.said["LatencyAboveBaseline"] >= 2 and cl.w.status["servingVersion"] == "1"
    assert "v1 was faster" in cl.tags["2"][TAG_ROLLED_BACK] and "TPOT" in cl.tags["2"][TAG_ROLLED_BACK]
    assert metrics.rollback_cause(cl.tags["2"][TAG_ROLLED_BACK]) == "latency"
    assert set(cl.w.status["servingHealth"]["baselines"]) == {"1", "2"}


def test_a_slowdown_a_rollback_would_not_cure_keeps_speculation_off_without_flapping():
    """v1's latency was never measured, so no rollback; v2 stays slow, and speculation stays off
    though acceptance windows (drafts while off, as from an engine's own probes) are fine between
    the serving windows."""
    start = slower_requests()
    start.w = dataclasses.replace(start.w, status={k: v for k, v in start.w.status.items() if k != "servingHealth"})
    cl, _ = converge(start, passes=80)
    assert [a for a, _ in cl.history] == ["RolloutStarted", "SpeculationOff"], cl.history
    assert cl.said["RollbackWouldNotHelp"] >= 1 and cl.w.status["speculationEnabled"] is False


def test_a_no_rollback_verdict_of_serving_health_gives_way_to_the_probe_that_then_rolls_back():
    """The bad draft with v2 slower too, v1's latency never measured (CI, 2026-12-07): serving
    health says no rollback while the operator's probe (the engine drafts nothing while off)
    gathers the windows that roll back to v1. While the probe runs, Drifted says Probing, not
    RollbackWouldNotHelp: a reader never takes the older verdict for the decision."""
    start = slower_requests()
    start.w = dataclasses.replace(start.w, status={k: v for k, v in start.w.status.items() if k != "servingHealth"},
                                  spec={**SPEC, "drift": {**DRIFT, "probeAfterWindows": 2, "consecutiveBreaches": 2}})
    start.rates["2"], start.drafts_while_off = 0.2, False
    cl, seen = copy.deepcopy(start), []   # (probing, Drifted's reason) after each pass
    for steps, status in run_passes(cl, 80):
        drifted = conditions.get_condition(status.get("conditions"), conditions.DRIFTED) or {}
        seen.append((bool((status.get("drift") or {}).get("probing")), drifted.get("reason")))
        if any(isinstance(s, rs.Record) and s.action == "RolledBack" for s in steps):
            break
    assert [a for a, _ in cl.history] == ["RolloutStarted", "SpeculationOff", "RolledBack"], cl.history
    probing = [reason for p, reason in seen if p]
    assert "Probing" in probing and "RollbackWouldNotHelp" not in probing, seen
    assert cl.said["RollbackWouldNotHelp"] == 0 and cl.said["Probing"] >= 1, cl.said


# v2's status as the default demo left it when the learned release v3 replaced it (no previous
# release to roll back to; speculation off; its last window and the traffic shift it counted).
V2_DRIFTED = {
    "engineTLS": CURRENT_TLS, "servingVersion": "2", "previousVersion": "", "speculationEnabled": False,
    "drift": {"version": "2", "stepsTaken": 1, "streaks": {"code": 38}, "breachesInRow": 38, "fineInRow": 0,
              "since": 5.0, "probing": False},
    "live": {"acceptance": {"code": 0.0906}, "draftedTokens": {"code": 276}, "trafficShift": {"creative": 308}},
    "conditions": [{"type": "Drifted", "status": "True", "reason": "RollbackWouldNotHelp", "observedGeneration": 1,
                    "message": "no rollback: no previous release", "lastTransitionTime": "2026-12-07T20:00:00Z"}]}


def test_a_new_champion_is_not_judged_by_the_drift_verdict_of_the_release_it_replaced():
    """v3 promoted over the drifted v2 (the default demo's learned release): from v3's first pass,
    through its rollout, until a window of v3 is judged, Drifted says v3 is not judged yet, and
    the drift fields are v3's (fresh ladder, no windows, no traffic shift counted for v2). They
    read v2's RollbackWouldNotHelp, its ladder step and window until v3's first judged window."""
    tags = {"2": release_tags("2"), "3": release_tags("3")}
    cl = Cluster(base(aliases={"champion": "3", "previous": "2"}, tags=tags["3"], desired="3", status=V2_DRIFTED),
                 tags, {"2": 0.2, "3": 0.95})
    seen, said = [], []   # (Drifted's status and reason, status.drift's version and step, live's traffic shift) a pass
    for _, status in run_passes(cl, 30):
        drifted = conditions.get_condition(status.get("conditions"), conditions.DRIFTED) or {}
        said.append(drifted.get("message"))
        seen.append(((drifted.get("status"), drifted.get("reason")),
                     (status["drift"].get("version"), status["drift"].get("stepsTaken")), status["live"]["trafficShift"]))
        assert status["speculationEnabled"] is True, "v2's ladder turned speculation off, not v3's"
        if drifted.get("reason") == "WithinBaseline":
            break
    assert seen[0] == (("Unknown", "NotJudgedYet"), ("3", 0), {}), seen
    assert said[0] == "v3 serves; no drift window of it judged yet (v2's last: True RollbackWouldNotHelp)", said
    assert seen[-1][0] == ("False", "WithinBaseline") and len(seen) >= 3, seen   # rolled out, then judged
    assert all(reason == ("Unknown", "NotJudgedYet") for reason, _, _ in seen[:-1]), seen
    assert all(d == ("3", 0) and "creative" not in shift for _, d, shift in seen), seen
    assert cl.w.status["speculationEnabled"] is True and [a for a, _ in cl.history] == ["RolloutStarted"], cl.history


def test_after_a_rollback_the_acceptance_column_is_the_restored_release_s_not_the_one_rolled_back():
    """status.acceptance (the printer column: live acceptance, the gated one before traffic) read
    v2's last live window (0.2) under servingVersion 1 from the rollback until v1's first judged
    window: the serving plan resets it only when servingVersion changes, which the rollback's own
    pass had written already."""
    cl, after = ladder_start(), []
    for steps, status in run_passes(cl, 40):
        if after or any(isinstance(s, rs.Record) and s.action == "RolledBack" for s in steps):
            after.append((status["servingVersion"], status.get("acceptance"), status["drift"].get("version")))
        if len(after) == 3:
            break
    assert [v for v, _, _ in after] == ["1", "1", "1"], after
    assert after[0][1] is None and after[1][1] == GOOD["acceptanceRate"], after   # v1's gated, until it is judged


JOURNEYS = [
    ("a first rollout", lambda: Cluster(base(status={}), {"1": release_tags("1")}, {"1": 0.75})),
    ("drift: speculation off, then a rollback", ladder_start),
    ("a tokenizer mismatch on a pod: a rollback", mismatched_tokenizer),
    ("failing requests: a rollback", failing_requests),
    ("slower requests: speculation off, then a rollback", slower_requests),
    ("models fetched, rolled out, drift, a rollback to models fetched then", lambda: cached_ladder()),
]


def cached_ladder() -> Cluster:
    """The ladder with a model cache: v2's models and then v1's are fetched before their rollouts."""
    cl = ladder_start()
    cl.w = dataclasses.replace(cl.w, spec={**SPEC, "rollout": CACHE["rollout"]})
    cl.fetch = {"1": model_fetch.ABSENT, "2": model_fetch.ABSENT}
    return cl


def test_a_rollback_waits_for_the_previous_release_s_models():
    cl, done = converge(cached_ladder())
    jobs = [s.manifest["metadata"]["name"] for s in done if isinstance(s, sp.EnsureOwned) and s.manifest["kind"] == "Job"]
    assert len(jobs) == 2 and cl.w.aliases["champion"] == "1"
    assert cl.w.status["modelCache"]["fetched"] == ["models-of-v2", "models-of-v1"]
    assert [a for a, _ in cl.history][:3] == ["RolloutStarted", "SpeculationOff", "RolledBack"]


@pytest.mark.parametrize("what, start", JOURNEYS, ids=[j[0] for j in JOURNEYS])
def test_killed_after_any_write_a_serving_journey_ends_where_the_undisturbed_one_does(what, start):
    reference, done = converge(start())
    assert reference.history and max(Counter(reference.history).values()) == 1, reference.history
    for crash_at in range(len(done)):
        end, _ = converge(start(), crash_at)
        assert end_state(end) == end_state(reference), f"killed after write {crash_at}: {kinds((done[crash_at],))}"
        keyed = Counter(h for h in end.history if h[1] is not None)
        assert max(keyed.values()) == 1, f"killed after write {crash_at}: recorded twice: {keyed}"


def passes_to_speculation_off(engine: str) -> tuple[int, Any, list[str]]:
    """Drift passes, one window each, over a pair whose "code" category collapses (0.1 against
    its gated 0.8) while "chat" keeps its 0.6: how many until the ladder's SpeculationOff step
    (a switch on our engine, a roll on vLLM), the step, and the breaches said on the way."""
    spec = {**SPEC, "engine": engine, "drift": {**DRIFT, "consecutiveBreaches": 2, "ladder": ["SpeculationOff"]}}
    w = serving(base(spec=spec, tags=plan_tables.release_tags({**spec, "speculation": {"k": 4}})))
    said = []
    for n in range(1, 60):
        at, drafted = 100.0 + 2 * n, 100 * n          # a pass every 2 s: five to a 10 s window
        stats = {"uptimeSeconds": at, "speculating": True, "categories": {
            "code": {"drafted": drafted, "accepted": int(0.1 * drafted), "requests": 5 * n},
            "chat": {"drafted": drafted, "accepted": int(0.6 * drafted), "requests": 5 * n}}}
        w = dataclasses.replace(w, ready=tuple(dataclasses.replace(x, stats=stats) for x in w.ready),
                                drift=dataclasses.replace(w.drift, monotonic=at, wall=at))
        steps = sp.plan_serving(w)
        said += [s.message for s in steps if isinstance(s, sp.Condition) and s.reason == "AcceptanceBelowBaseline"]
        off = [s for s in steps if isinstance(s, (sp.SwitchSpeculation, sp.RollSpeculation)) and not s.enabled]
        if off:
            return n, off[0], said
        remembered = next(s for s in steps if isinstance(s, sp.RememberDrift))
        status = {**w.status, **{k: v for s in steps if isinstance(s, rs.SetStatus) for k, v in s.fields.items()}}
        w = dataclasses.replace(w, status=status, drift=dataclasses.replace(w.drift, version=remembered.champion,
                                                                            memory=remembered.memory))
    raise AssertionError(f"no SpeculationOff on {engine}: {said}")


def test_a_vllm_pairs_collapsing_category_is_judged_as_our_engines_is():
    """vLLM pods count per category (their companion, from vLLM's own per-request acceptance):
    the same category breaches, the other is not judged a breach, and SpeculationOff comes after
    the same number of windows on both engines (a roll instead of a switch on vLLM)."""
    ours, switch, ours_said = passes_to_speculation_off("specpair")
    theirs, roll, vllm_said = passes_to_speculation_off("vllm")
    assert ours == theirs and isinstance(switch, sp.SwitchSpeculation) and isinstance(roll, sp.RollSpeculation)
    assert vllm_said == ours_said and vllm_said and all("code" in m and "chat" not in m for m in vllm_said)


def test_a_drift_probe_is_marked_on_the_version_when_it_begins_and_ends():
    """Speculation off for drift and nothing drafted since: a probe turns it on for a while, then
    off again while acceptance stays low. Each begins and ends with a mark on the version
    (registry_contract.probe_mark, the record a reviewer reads), the mark before the switch."""
    from specpair_operator.release.registry_contract import TAG_DRIFT_PROBE
    start = ladder_start()
    start.drafts_while_off = False
    start.w = dataclasses.replace(start.w, spec={**SPEC, "drift": {**DRIFT, "probeAfterWindows": 1,
                                                                   "ladder": ["SpeculationOff"]}})
    cl, done = converge(start, passes=60)
    marks = [(i, s.tags[TAG_DRIFT_PROBE]) for i, s in enumerate(done)
             if isinstance(s, rs.TagVersion) and TAG_DRIFT_PROBE in s.tags]
    switches = [(i, s.enabled) for i, s in enumerate(done) if isinstance(s, sp.SwitchSpeculation)]
    assert len(marks) >= 2 and [m.split(" ")[0] for _, m in marks[:2]] == ["on", "over"], marks
    assert marks[0][1].startswith("on at ") and marks[1][1].startswith("over at ")
    # Each mark comes before the switch it announces, and each probe is marked once.
    for (at, mark), (switch_at, enabled) in zip(marks, [s for s in switches if s[0] > marks[0][0] - 1]):
        assert at < switch_at and enabled == mark.startswith("on")
    assert len({m for _, m in marks}) == len(marks)
    assert cl.tags["2"][TAG_DRIFT_PROBE] == marks[-1][1]
