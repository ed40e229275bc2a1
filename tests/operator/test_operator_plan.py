"""The release's plan (plan/release_plan.py) as tables: for each scenario the end-to-end tests drive through a
real API server and MLflow (a new pair gated, promoted and served; a failed gate; a new release
replacing the champion; a gate retried, given up; a verdict nobody reported; a rolled-back
release; a name taken by an object the pair does not own), a ReleaseWorld and the steps
plan_release returns for it.

Then recovery: a small model of the world (`apply`) runs passes until nothing is left to do,
with the operator killed after each write of the way in turn (the writes stay, the status of
that pass is lost, as when the process dies before its one status write). Every run ends where
the undisturbed one does, with each action recorded once and no gate Job started twice.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

from plan_tables import NOW, NS, PAIR, reported, step_name
from specpair_operator.gate import attempts as gate_attempts
from specpair_operator.desired import manifests, model_fetch
from specpair_operator.plan import release_steps as rs
from specpair_operator.plan import model_cache
from specpair_operator.plan import release_plan as p
from specpair_operator.plan import serving_plan as sp
from specpair_operator.observe.serving_world import Installation, ServingWorld
from specpair_operator.release import content as release_content
from specpair_operator.observe.world import GateJob, Records, ReleaseWorld

TH = {"requireGreedyIdentity": True, "minAcceptance": 0.5, "minCategoryAcceptance": {"code": 0.6}}
GOOD = {"passed": True, "reasons": [], "tokenizer": {"compatible": True, "differences": []},
        "greedyIdentity": 1.0, "acceptanceRate": 0.7, "speedup": 1.4,
        "categories": {"code": {"acceptanceRate": 0.8}, "chat": {"acceptanceRate": 0.5}}}
BAD = {**GOOD, "acceptanceRate": 0.2, "categories": {"code": {"acceptanceRate": 0.25}}}
DIGEST = "d" * 64


def job_name(attempt: int = 1) -> str:
    return manifests.gate_job_name(PAIR, DIGEST, attempt)


def world(**changes: Any) -> ReleaseWorld:
    return dataclasses.replace(ReleaseWorld(pair=PAIR, namespace=NS, version="1", digest=DIGEST, thresholds=TH,
                                            now=NOW), **changes)


def records(**keys: list[str]) -> Records:
    return Records(recorded={k: tuple(v) for k, v in keys.items()})


def kinds(steps: tuple[Any, ...]) -> list[str]:
    """Each step by its name (plan_tables.step_name), the status's own steps by their class alone:
    these tables are about the order of the writes and records."""
    return [type(s).__name__ if isinstance(s, (rs.Condition, rs.SetStatus, rs.TagVersion)) else step_name(s)
            for s in steps]


def passed_gate(version: str = "1", verdict: dict[str, Any] = GOOD, **job: Any) -> dict[str, Any]:
    """What the world holds once the release's gate Job reported `verdict`."""
    return dict(gate_status="passed" if verdict["passed"] else "failed", verdict=verdict,
                gate_jobs=(GateJob(job_name(), complete=True, started_at="2026-11-25T11:58:00Z",
                                   completed_at="2026-11-25T11:59:00Z", reports=(reported(verdict, version),), **job),),
                records=records(GateStarted=[version]))


# -- scenarios as tables ---------------------------------------------------------------------------

SCENARIOS = [
    ("a new pair: candidate, the gate's policy and Job, GateStarted, Gating while nothing serves",
     world(),
     ["SetAlias candidate=1", "EnsureGatePolicy", "StartGateJob 1", "Record GateStarted", "Condition", "SetStatus",
      "Report reconciling Gating/Gating", "ServeChampion - while gating"]),
    ("its gate runs: nothing is written, Gating again",
     world(aliases={"candidate": "1"}, gate_jobs=(GateJob(job_name()),), records=records(GateStarted=["1"])),
     ["EnsureGatePolicy", "Condition", "SetStatus", "Report reconciling Gating/Gating", "ServeChampion - while gating"]),
    ("its gate pod cannot start: GatePending with the kubelet's words",
     world(aliases={"candidate": "1"}, gate_jobs=(GateJob(job_name()),), records=records(GateStarted=["1"]),
           gate_pods_waiting="pod x cannot start: ErrImagePull: nope"),
     ["EnsureGatePolicy", "Condition", "SetStatus", "Report reconciling Gating/GatePending",
      "ServeChampion - while gating"]),
    ("a pass died after creating the Job: GateStarted is recorded, no second Job",
     world(aliases={"candidate": "1"}, gate_jobs=(GateJob(job_name()),)),
     ["EnsureGatePolicy", "Record GateStarted", "Condition", "SetStatus", "Report reconciling Gating/Gating",
      "ServeChampion - while gating"]),
    ("the gate passed with the verdict its Job reported: recorded, marked, promoted, served",
     world(aliases={"candidate": "1"}, **passed_gate()),
     ["SetStatus", "Condition", "Condition", "SetStatus", "ObserveGateDuration", "Record GatePassed", "TagVersion",
      "SetAlias champion=1", "Record Promoted", "ServeChampion 1"]),
    ("a new release replacing the champion: previous before champion",
     world(version="2", aliases={"candidate": "2", "champion": "1"},
           **{**passed_gate("2"), "records": records(GateStarted=["2"])}),
     ["SetStatus", "Condition", "Condition", "SetStatus", "ObserveGateDuration", "Record GatePassed", "TagVersion",
      "SetAlias previous=1", "SetAlias champion=2", "Record Promoted", "ServeChampion 2"]),
    ("a failed gate: GateFailed, the champion keeps serving",
     world(version="2", aliases={"candidate": "2", "champion": "1"},
           **{**passed_gate("2", BAD), "records": records(GateStarted=["2"])}),
     ["Condition", "Condition", "SetStatus", "ObserveGateDuration", "Record GateFailed", "ServeChampion -"]),
    ("a gate that errored (recorded by the runner)",
     world(version="2", aliases={"candidate": "2", "champion": "1"}, gate_status="error", gate_message="boom",
           gate_jobs=(GateJob(job_name(), complete=True),), records=records(GateStarted=["2"])),
     ["Condition", "Record GateError", "ServeChampion -"]),
    ("a gate attempt failed a moment ago: wait for the next one",
     world(aliases={"candidate": "1"}, records=records(GateStarted=["1"]),
           gate_jobs=(GateJob(job_name(), failed=True, failure_message="BackoffLimitExceeded",
                              failed_at="2026-11-25T11:59:50Z"),)),
     ["EnsureGatePolicy", "Condition", "SetStatus", "Report reconciling Gating/GateRetrying",
      "ServeChampion - while gating"]),
    ("a gate attempt failed long ago: the next attempt, GateRetrying",
     world(aliases={"candidate": "1"}, records=records(GateStarted=["1"]),
           gate_jobs=(GateJob(job_name(), failed=True, failure_message="BackoffLimitExceeded",
                              failed_at="2026-11-25T11:00:00Z"),)),
     ["EnsureGatePolicy", "StartGateJob 2", "Record GateRetrying", "Condition", "SetStatus",
      "Report reconciling Gating/Gating", "ServeChampion - while gating"]),
    ("a pass died after starting attempt 2: GateRetrying recorded, no third Job",
     world(aliases={"candidate": "1"}, records=records(GateStarted=["1"]),
           gate_jobs=(GateJob(job_name(), failed=True, failed_at="2026-11-25T11:00:00Z"), GateJob(job_name(2)))),
     ["EnsureGatePolicy", "Record GateRetrying", "Condition", "SetStatus", "Report reconciling Gating/Gating",
      "ServeChampion - while gating"]),
    ("every attempt failed: GateError in MLflow, Stalled",
     world(aliases={"candidate": "1"}, records=records(GateStarted=["1"], GateRetrying=["1#2", "1#3"]),
           gate_jobs=(GateJob(job_name(), failed=True), GateJob(job_name(2), failed=True),
                      GateJob(job_name(3), failed=True, failed_at="2026-11-25T11:00:00Z"))),
     ["EnsureGatePolicy", "RecordGateError", "Condition", "Report stalled Failed/GateError"]),
    ("MLflow says passed, but no Job reported it and none is left: gated again",
     world(aliases={"candidate": "1"}, gate_status="passed", verdict=GOOD, records=records(GateStarted=["1"])),
     ["Event Regating", "EnsureGatePolicy", "StartGateJob 1", "Record GateStarted", "Condition", "SetStatus",
      "Report reconciling Gating/Gating", "ServeChampion - while gating"]),
    ("the verdict is in MLflow before its gate pod exits, and GateStarted was never recorded: recorded once",
     world(aliases={"candidate": "1"}, gate_status="passed", verdict=GOOD, gate_jobs=(GateJob(job_name()),)),
     ["Record GateStarted", "EnsureGatePolicy", "Condition", "SetStatus", "Report reconciling Gating/Gating",
      "ServeChampion - while gating"]),
    ("the verdict in MLflow is not the one the Job reported: VerdictMismatch, not promoted",
     world(aliases={"candidate": "1"}, **{**passed_gate(), "verdict": {**GOOD, "speedup": 9.0}}),
     ["SetStatus", "Record VerdictMismatch", "Condition", "SetStatus", "ObserveGateDuration", "Record GateFailed",
      "ServeChampion -"]),
    ("a rolled-back release stays out of service; its rollback recorded when its pass died",
     world(version="2", aliases={"candidate": "2", "champion": "1", "previous": "1"},
           tags={"specpair.rolled_back": "drift"}),
     ["Record RolledBack", "ServeChampion -"]),
    ("the champion is the spec's release: its numbers, then serving",
     world(aliases={"candidate": "1", "champion": "1"},
           **{**passed_gate(), "records": records(GateStarted=["1"], GatePassed=["1"], Promoted=["1@t"])},
           tags={"specpair.promoted_at": "t"}),
     ["Condition", "Condition", "SetStatus", "ServeChampion 1"]),
    ("a pass died after moving champion: the gate's result and the promotion recorded now",
     world(aliases={"candidate": "1", "champion": "1"}, **passed_gate(), tags={"specpair.promoted_at": "t"}),
     ["Condition", "Condition", "SetStatus", "ObserveGateDuration", "Record GatePassed", "Record Promoted",
      "ServeChampion 1"]),
    ("attempt 2 passed while the pass that started it was dead: GateRetrying recorded",
     world(aliases={"candidate": "1"}, records=records(GateStarted=["1"]), gate_status="passed", verdict=GOOD,
           gate_jobs=(GateJob(job_name(), failed=True), GateJob(job_name(2), complete=True, reports=(reported(GOOD, "1"),)))),
     ["Record GateRetrying", "SetStatus", "Condition", "Condition", "SetStatus", "Record GatePassed", "TagVersion",
      "SetAlias champion=1", "Record Promoted", "ServeChampion 1"]),
    ("a gate Job of our name that another owns: NameConflict, nothing written",
     world(gate_jobs=(GateJob(job_name(), owned=False),)),
     ["SetAlias candidate=1", "EnsureGatePolicy", "Report stall Failed/NameConflict"]),
    ("the gate's NetworkPolicy name taken: NameConflict before any gate object",
     world(aliases={"candidate": "1"}, gate_policy_owned=False),
     ["Report stall Failed/NameConflict"]),
]

MODELS = "m" * 64
FETCH_JOB = model_fetch.fetch_job_name(PAIR, MODELS)


# A pair with a model cache on a claim, its release, and where the installation's MLflow is: what
# the fetch Job is rendered from.
CACHED = {"modelCache": {"persistentVolumeClaim": "hub"}}
CACHED_RELEASE = release_content.build_release(
    PAIR, NS, {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "abc"}, "draft": {"drafter": "ngram"},
               "rollout": CACHED}, [{"prompt": "x", "category": "code"}])
INSTALLATION = Installation("http://mlflow.example:5000")
WITH_CACHE = {"rollout": CACHED, "model": "team-chat", "release": CACHED_RELEASE, "installation": INSTALLATION}


def fetching(phase: str, message: str = "", **changes: Any) -> ReleaseWorld:
    """A release whose models the pair's model cache does not hold yet, its fetch Job at `phase`."""
    return world(aliases={"candidate": "1", "champion": "0"}, models=MODELS,
                 model_fetch=model_fetch.FetchState(phase, message=message), **{**WITH_CACHE, **changes})


FETCH_SCENARIOS = [
    ("no fetch Job yet: it is started with an Event, ModelsFetching, no gate Job, the champion serves",
     fetching(model_fetch.ABSENT),
     ["EnsureGatePolicy", "EnsureOwned Job", "Event ModelFetchStarted", "Report reconciling Gating/ModelsFetching",
      "SetStatus", "ServeChampion - while gating"]),
    ("the fetch runs: ModelsFetching again, nothing is written",
     fetching(model_fetch.RUNNING, "fetching (Job x); pod y cannot start: CreateContainerConfigError"),
     ["EnsureGatePolicy", "Report reconciling Gating/ModelsFetching", "SetStatus", "ServeChampion - while gating"]),
    ("the fetch failed: Stalled ModelFetchFailed with its words, recorded once, no gate",
     fetching(model_fetch.FAILED, "model fetch Job x failed: models:/t/3: 404"),
     ["EnsureGatePolicy", "Record ModelFetchFailed", "Report stalled Failed/ModelFetchFailed", "SetStatus"]),
    ("the fetch failed, recorded already: no second Event",
     fetching(model_fetch.FAILED, "model fetch Job x failed: models:/t/3: 404",
              records=records(ModelFetchFailed=[MODELS])),
     ["EnsureGatePolicy", "Report stalled Failed/ModelFetchFailed", "SetStatus"]),
    ("the fetch is done: recorded in status, then the gate starts",
     fetching(model_fetch.DONE, "models fetched by Job x"),
     ["EnsureGatePolicy", "SetStatus", "Event ModelsFetched", "StartGateJob 1", "Record GateStarted", "Condition",
      "SetStatus", "Report reconciling Gating/Gating", "ServeChampion - while gating"]),
    ("a pass died after starting the gate, before recording the fetch: recorded now, no second Job",
     fetching(model_fetch.DONE, gate_jobs=(GateJob(job_name()),), records=records(GateStarted=["1"])),
     ["EnsureGatePolicy", "SetStatus", "Event ModelsFetched", "Condition", "SetStatus",
      "Report reconciling Gating/Gating", "ServeChampion - while gating"]),
    ("no model cache (needs_fetch false, nothing observed): gated as before",
     world(aliases={"candidate": "1", "champion": "0"}, models=MODELS),
     ["EnsureGatePolicy", "StartGateJob 1", "Record GateStarted", "Condition", "SetStatus",
      "Report reconciling Gating/Gating", "ServeChampion - while gating"]),
]


@pytest.mark.parametrize("what, w, expected", FETCH_SCENARIOS, ids=[s[0] for s in FETCH_SCENARIOS])
def test_the_gate_waits_for_the_models(what, w, expected):
    assert kinds(p.plan_release(w)) == expected


def test_the_fetch_messages_and_the_record():
    failed = p.plan_release(fetching(model_fetch.FAILED, "model fetch Job x failed: models:/t/3: 404"))
    report = next(s for s in failed if isinstance(s, rs.Report))
    assert report.message == "model fetch Job x failed: models:/t/3: 404"
    assert report.ready_message == "the models of v1 could not be fetched; v0 keeps serving"
    assert next(s for s in failed if isinstance(s, rs.Record)).key == MODELS
    done = p.plan_release(fetching(model_fetch.DONE, fetched=tuple(f"{i}" * 64 for i in range(6))))
    kept = next(s for s in done if isinstance(s, rs.SetStatus) and "modelCache" in s.fields).fields
    assert kept["modelCache"]["fetched"][-1] == MODELS and len(kept["modelCache"]["fetched"]) == model_cache.FETCHED_KEPT
    started = next(s for s in p.plan_release(fetching(model_fetch.ABSENT)) if isinstance(s, sp.EnsureOwned))
    # The Job a rollout of the same release would plan (model_cache.fetch_job, the one place both
    # plans build it): the release as its pods get it, the pair's claim, the installation's MLflow.
    gated = release_content.with_mlflow(CACHED_RELEASE, INSTALLATION.tracking_uri, "team-chat", "1")
    assert started.manifest == model_cache.fetch_job(PAIR, NS, gated, CACHED, INSTALLATION)
    assert started.manifest["metadata"]["name"] == model_fetch.fetch_job_name(PAIR, model_fetch.models_digest(gated))
    assert (started.live, started.mutable) == (None, False)
    env = {e["name"]: e.get("value") for e in started.manifest["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.example:5000"


def test_a_pair_without_a_claim_never_fetches():
    release = {"target": {"source": "models:/target/3"}, "draft": {"source": "HuggingFaceTB/SmolLM2-135M"}}
    assert not model_fetch.needs_fetch(release, {})
    assert not model_fetch.needs_fetch(release, {"modelCache": {"sizeLimit": "1Gi"}})
    assert model_fetch.needs_fetch(release, {"modelCache": {"persistentVolumeClaim": "hub"}})


@pytest.mark.parametrize("what, w, expected", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_plan_release(what, w, expected):
    assert kinds(p.plan_release(w)) == expected


def test_a_promotion_mark_left_by_a_dead_pass_is_reused_and_recorded_once():
    w = world(aliases={"candidate": "1", "champion": "1"}, tags={"specpair.promoted_at": "2026-11-25T11:00:00Z"},
              **passed_gate())
    steps = p.plan_release(w)
    (promoted,) = [s for s in steps if isinstance(s, rs.Record) and s.action == "Promoted"]
    assert promoted.key == "1@2026-11-25T11:00:00Z"
    assert not [s for s in steps if isinstance(s, rs.TagVersion)]
    # The mark of an earlier promotion (recorded) is not reused: this promotion gets its own.
    again = world(version="1", aliases={"candidate": "1", "champion": "2", "previous": "1"},
                  tags={"specpair.promoted_at": "old"},
                  **{**passed_gate(), "records": records(GateStarted=["1"], Promoted=["1@old"])})
    assert rs.TagVersion("1", {"specpair.promoted_at": NOW}) in p.plan_release(again)


def test_the_gate_messages_say_what_a_person_needs():
    failed = p.plan_release(SCENARIOS[6][1])
    serve = failed[-1]
    assert serve.reason.startswith("gate of v2 failed: ") and "minAcceptance 0.500" in serve.reason
    retry = next(s for s in p.plan_release(SCENARIOS[9][1]) if isinstance(s, rs.Record))
    assert retry.reason == (f"v1: gate attempt 1 of 3 ended without a verdict: gate Job failed: BackoffLimitExceeded; "
                            f"attempt 2 in Job {job_name(2)}") and retry.key == "1#2"
    conflict = p.plan_release(SCENARIOS[-2][1])[-1]
    assert conflict.message.startswith(f"Job {NS}/{job_name()} exists and is not owned by SpecModelPair {PAIR}")
    waiting = next(s for s in p.plan_release(SCENARIOS[8][1]) if isinstance(s, rs.Report))
    assert waiting.message.endswith("attempt 2 in 20s")


def test_a_draft_with_another_tokenizer_fails_the_gate_and_nothing_serves():
    verdict = {**GOOD, "passed": False, "reasons": ["tokenizers differ"],
               "tokenizer": {"compatible": False, "differences": ["vocab size 49152 vs 32000"]}}
    steps = p.plan_release(world(aliases={"candidate": "1"}, **passed_gate(verdict=verdict)))
    conditions = {s.type: s for s in steps if isinstance(s, rs.Condition)}
    assert conditions["Gated"].reason == "TokenizerMismatch" and conditions["TokenizerCompatible"].status is False
    assert conditions["TokenizerCompatible"].message == "tokenizers differ: vocab size 49152 vs 32000"
    serve = steps[-1]
    assert isinstance(serve, rs.ServeChampion) and serve.desired is None
    # Nothing serves yet: no engine object is written and the pair is Failed, saying why.
    serving = sp.plan_serving(ServingWorld(pair=PAIR, namespace=NS, uid="u", model="m", aliases=serve.aliases,
                                           desired=None, desired_reason=serve.reason))
    assert not [s for s in serving if isinstance(s, sp.WRITES)]
    report = serving[-1]
    assert (report.how, report.phase, report.reason) == ("stalled", "Failed", "NoRelease")
    assert report.message == "gate of v1 failed: tokenizers differ: vocab size 49152 vs 32000"


def test_the_plan_is_a_value_of_its_world():
    w = world(aliases={"candidate": "1"}, **passed_gate())
    assert p.plan_release(w) == p.plan_release(w)


# -- recovery: every prefix of the way, then planned again ---------------------------------------

STATUS_STEPS = (rs.Record, rs.SetStatus)


def apply(w: ReleaseWorld, step: Any) -> ReleaseWorld:
    """What one step does to the world (a model: MLflow, the API server and the status)."""
    if isinstance(step, rs.SetAlias):
        return dataclasses.replace(w, aliases={**w.aliases, step.alias: step.version})
    if isinstance(step, rs.TagVersion):
        return dataclasses.replace(w, tags={**w.tags, **step.tags})
    if isinstance(step, rs.EnsureGatePolicy):
        return dataclasses.replace(w, gate_policy_owned=True)
    if isinstance(step, sp.EnsureOwned) and step.manifest["kind"] == "Job":
        assert w.model_fetch.phase == model_fetch.ABSENT, "fetch Job started twice"
        return dataclasses.replace(w, model_fetch=model_fetch.FetchState(model_fetch.RUNNING))
    if isinstance(step, rs.StartGateJob):
        assert w.model_fetch is None or w.model_fetch.phase == model_fetch.DONE, "gated before the models are there"
        assert len(w.gate_jobs) == step.attempt - 1, f"attempt {step.attempt} started twice"
        return dataclasses.replace(w, gate_jobs=w.gate_jobs + (GateJob(job_name(step.attempt), started_at=w.now),))
    if isinstance(step, rs.RecordGateError):
        return dataclasses.replace(w, gate_status="error", gate_message=step.reason)
    if isinstance(step, rs.Record):
        recorded = dict(w.records.recorded)
        if step.key is not None:
            recorded[step.action] = recorded.get(step.action, ()) + (step.key,)
        history = w.records.history + ({"action": step.action, "toVersion": step.to_version, "key": step.key},)
        return dataclasses.replace(w, records=Records(recorded, True, history))
    if isinstance(step, rs.SetStatus) and "verifiedVerdicts" in step.fields:
        return dataclasses.replace(w, verified_verdicts=dict(step.fields["verifiedVerdicts"]))
    if isinstance(step, rs.SetStatus) and "modelCache" in step.fields:
        # observe: a recorded digest needs no fetch (model_fetch.needs_fetch)
        fetched = tuple(step.fields["modelCache"]["fetched"])
        return dataclasses.replace(w, fetched=fetched, model_fetch=None if w.models in fetched else w.model_fetch)
    return w


def fetch_runs(w: ReleaseWorld) -> ReleaseWorld:
    """The fetch Job, once started, completes by the next pass."""
    if w.model_fetch is not None and w.model_fetch.phase == model_fetch.RUNNING:
        return dataclasses.replace(w, model_fetch=model_fetch.FetchState(model_fetch.DONE))
    return w


def gate_runs(w: ReleaseWorld, verdicts: list[dict[str, Any] | None]) -> ReleaseWorld:
    """The latest gate Job moves on: its verdict lands in MLflow (the next of `verdicts`) while its
    pod still runs, and the Job completes with its report the next time; or (None) the Job
    fails without a verdict."""
    if not w.gate_jobs or w.gate_jobs[-1].finished:
        return w
    latest = w.gate_jobs[-1]
    if w.gate_status == "pending":
        verdict = verdicts.pop(0)
        if verdict is None:
            ended = dataclasses.replace(latest, failed=True, failure_message="BackoffLimitExceeded", failed_at=w.now)
            return dataclasses.replace(w, gate_jobs=w.gate_jobs[:-1] + (ended,))
        return dataclasses.replace(w, verdict=verdict, gate_status="passed" if verdict["passed"] else "failed")
    if w.gate_status == "error":
        return w
    ended = dataclasses.replace(latest, complete=True, reports=(reported(dict(w.verdict or {}), w.version),))
    return dataclasses.replace(w, gate_jobs=w.gate_jobs[:-1] + (ended,))


# The release plan's writes: its own, and the fetch Job it plans as the serving plan does (EnsureOwned).
RELEASE_WRITES = (*rs.WRITES, sp.EnsureOwned)


def converge(w: ReleaseWorld, verdicts: list[dict[str, Any] | None],
             crash_at: int | None = None) -> tuple[ReleaseWorld, list[Any]]:
    """Passes until one plans no write and no record. The `crash_at`-th write (counting from 0
    over the whole run) is the last of its pass: that pass's status steps are lost. Returns the
    end world and every write done."""
    done: list[Any] = []
    for hour in range(30):
        steps = p.plan_release(w)
        if not [s for s in steps if isinstance(s, RELEASE_WRITES + (rs.Record,))]:
            return w, done
        status_steps = []
        for step in steps:
            if isinstance(step, RELEASE_WRITES):
                w = apply(w, step)
                done.append(step)
                if crash_at is not None and len(done) == crash_at + 1:
                    status_steps = None  # killed: this pass writes no status
                    break
            elif isinstance(step, STATUS_STEPS):
                status_steps.append(step)
        for step in status_steps or ():
            w = apply(w, step)
        # Time passes between passes (a retry's delay included); the gate Job ends meanwhile.
        w = gate_runs(fetch_runs(dataclasses.replace(w, now=f"2026-11-26T{hour:02d}:00:00Z")), verdicts)
    raise AssertionError(f"no end after 30 passes: {p.plan_release(w)}")


def actions(w: ReleaseWorld) -> Counter:
    """Each recorded action by what it is about (a promotion's key less its mark's time)."""
    return Counter((h["action"], (h["key"] or "").split("@")[0]) for h in w.records.history)


def end_state(w: ReleaseWorld) -> tuple[Any, ...]:
    return dict(w.aliases), sorted(w.tags), len(w.gate_jobs), w.gate_status, actions(w), w.fetched


JOURNEYS = [
    ("a new pair gated, promoted", world(), [GOOD]),
    ("a new release replacing the champion", world(version="2", aliases={"candidate": "1", "champion": "1"}), [GOOD]),
    ("a failed gate", world(version="2", aliases={"candidate": "1", "champion": "1"}), [BAD]),
    ("a gate that crashed once, then passed", world(), [None, GOOD]),
    ("a gate that never gives a verdict", world(), [None, None, None]),
    ("a release whose models are fetched first, then gated and promoted",
     world(models=MODELS, model_fetch=model_fetch.FetchState(model_fetch.ABSENT), **WITH_CACHE), [GOOD]),
]


@pytest.mark.parametrize("what, start, verdicts", JOURNEYS, ids=[j[0] for j in JOURNEYS])
def test_killed_after_any_write_a_journey_ends_where_the_undisturbed_one_does(what, start, verdicts):
    reference, writes = converge(start, list(verdicts))
    history = actions(reference)
    assert history and max(history.values()) == 1, history
    for crash_at in range(len(writes)):
        end, _ = converge(start, list(verdicts), crash_at)
        assert end_state(end) == end_state(reference), f"killed after write {crash_at}: {writes[crash_at]}"


def test_the_journeys_end_as_the_end_to_end_tests_see_them():
    promoted, _ = converge(world(), [GOOD])
    assert promoted.aliases == {"candidate": "1", "champion": "1"}
    assert [h["action"] for h in promoted.records.history] == ["GateStarted", "GatePassed", "Promoted"]
    failed, _ = converge(world(version="2", aliases={"candidate": "1", "champion": "1"}), [BAD])
    assert failed.aliases == {"candidate": "2", "champion": "1"}
    fetched, writes = converge(world(models=MODELS, model_fetch=model_fetch.FetchState(model_fetch.ABSENT), **WITH_CACHE),
                               [GOOD])
    assert fetched.fetched == (MODELS,) and fetched.aliases == {"candidate": "1", "champion": "1"}
    assert [step_name(s) for s in writes][:3] == ["SetAlias candidate=1", "EnsureGatePolicy", "EnsureOwned Job"]
    broken, _ = converge(world(), [None, None, None])
    assert broken.gate_status == "error" and len(broken.gate_jobs) == gate_attempts.Policy().attempts
    assert Counter(h["action"] for h in broken.records.history)["GateRetrying"] == 2
