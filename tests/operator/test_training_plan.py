"""The training Job (issue 58), pure: when a drifted category that no rollback helps trains a new
draft (plan/learning.py), what the Job is (desired/training_job.py), and where it stands from the
Job and its pod as the API server reports them. No servers: decisions from values."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections import Counter
from dataclasses import dataclass

import pytest

from specpair_operator.crd.conditions import parse_iso
from specpair_operator.desired import training_job as tj
from specpair_operator.desired.manifests import LABEL_ROLE
from specpair_operator.plan import learning
from specpair_operator.plan.release_steps import Condition, Record, SetStatus
from specpair_operator.plan.serving_steps import EnsureOwned

from test_operator_serving_plan import Cluster, converge, ladder_start, release_tags   # its model of a cluster

SPEC = {"learning": {"enabled": True, "persistentVolumeClaim": "captures",
                     "training": {"activeDeadlineSeconds": 600}},
        "rollout": {"resources": {"limits": {"nvidia.com/gpu": 1, "memory": "16Gi"}}}}
RELEASE = {"target": {"source": "default"}, "draft": {"drafter": "ngram"},
           "gating": {"prompts": [{"prompt": "hi", "category": "extraction"}]}}


@dataclass(frozen=True)
class Judged:
    category: str


def _job(version: str, category: str, slot: str = "", spec=SPEC) -> dict:
    return tj.desired_training_job("chat", "llm", RELEASE, dict(spec["rollout"]), spec["learning"], version, category,
                                   "llm.chat", "http://mlflow:5000", slot=slot)


def _steps(trainings, status=None, spec=SPEC, recorded=()):
    return learning.training_steps("chat", spec, status or {}, trainings,
                                   lambda action, key, version: (action, key) in recorded, _job)


def _finished(job: dict, condition: str, reason: str = "", message: dict | str = "") -> tuple[dict, list[dict]]:
    name = job["metadata"]["name"]
    job = {**job, "status": {"conditions": [{"type": condition, "status": "True", "reason": reason}]}}
    text = json.dumps(message) if isinstance(message, dict) else message
    pod = {"metadata": {"name": name + "-x", "labels": {"job-name": name}},
           "status": {"containerStatuses": [{"state": {"terminated": {"message": text, "finishedAt": "t"}}}]}}
    return job, [pod]


def test_a_category_that_no_rollback_helps_is_what_trains():
    breaches = [Judged("extraction"), Judged("*"), Judged("code")]
    assert learning.breached_categories("no rollback: the previous release would not do better", breaches) \
        == ["code", "extraction"]
    assert learning.breached_categories("sustained drift: ...", breaches) == []
    status = {"training": {"runs": [{"version": "2", "category": "qa", "phase": "done"},
                                    {"version": "3", "category": "code", "phase": "running"}]}}
    # The champion's recorded trainings first, then its Jobs the status does not know of; v2's is history.
    assert learning.wanted_trainings(status, "3", [("3", "extraction", ""), ("3", "code", "")]) == \
        [("3", "code", ""), ("3", "extraction", "")]
    # The drift check wants each breached category of the champion once (the status is what it writes).
    wants = learning.want_training(status, "3", ["extraction", "code"], {"extraction": 0.21})
    runs = wants[0].fields["training"]["runs"]
    assert [(r["category"], r["phase"], r.get("acceptance")) for r in runs[2:]] == [("extraction", "wanted", 0.21)]


def test_learning_off_never_starts_a_job():
    absent = tj.TrainingState(tj.ABSENT)
    off = {**SPEC, "learning": {**SPEC["learning"], "enabled": False}}
    assert _steps([learning.Training("3", "extraction", absent)], spec=off) == []
    no_claim = {**SPEC, "learning": {"enabled": True}}
    assert _steps([learning.Training("3", "extraction", absent)], spec=no_claim) == []


def test_a_drifted_category_starts_one_job_once_and_follows_it_to_a_registered_candidate():
    steps = _steps([learning.Training("3", "extraction", tj.training_state(None))])
    created = [s for s in steps if isinstance(s, EnsureOwned)]
    assert len(created) == 1 and created[0].live is None and created[0].mutable is False
    name = tj.training_job_name("chat", "3", "extraction")
    assert created[0].manifest["metadata"]["name"] == name
    started = [s for s in steps if isinstance(s, Record)]
    assert [(r.action, r.key, r.warning) for r in started] == [("TrainingStarted", "3/extraction", False)]
    run = next(s for s in steps if isinstance(s, SetStatus)).fields["training"]["runs"][-1]
    assert run["phase"] == tj.RUNNING and run["job"] == name
    cond = next(s for s in steps if isinstance(s, Condition))
    assert (cond.type, cond.status, cond.reason) == ("Learning", True, "Training")
    # A pass that died after creating it: the Job is there, running; not created again.
    status = {"training": {"runs": [run]}}
    job = _job("3", "extraction")
    again = _steps([learning.Training("3", "extraction", tj.training_state(job, []))], status,
                   recorded={("TrainingStarted", "3/extraction")})
    assert not [s for s in again if isinstance(s, (EnsureOwned, Record))]
    # Done: the runner's report names the version it registered.
    state = tj.training_state(*_finished(job, "Complete", message={"version": "4", "summary": "acceptance 0.1 -> 0.4"}))
    assert (state.phase, state.candidate) == (tj.DONE, "4")
    done = _steps([learning.Training("3", "extraction", state)], status, recorded={("TrainingStarted", "3/extraction")})
    rec = [s for s in done if isinstance(s, Record)]
    assert [(r.action, r.from_version, r.to_version, r.warning) for r in rec] == \
        [("TrainingSucceeded", "3", "4", False)]
    cond = next(s for s in done if isinstance(s, Condition))
    assert (cond.status, cond.reason) == (True, "CandidateRegistered") and "v4" in cond.message
    # Its Job deleted by the TTL later: the status keeps the outcome, and nothing starts again.
    kept = next(s for s in done if isinstance(s, SetStatus)).fields
    later = _steps([learning.Training("3", "extraction", tj.training_state(None))], kept,
                   recorded={("TrainingStarted", "3/extraction"), ("TrainingSucceeded", "3/extraction")})
    assert not [s for s in later if isinstance(s, (EnsureOwned, Record))]
    assert next(s for s in later if isinstance(s, SetStatus)).fields["training"]["runs"][-1]["candidate"] == "4"


def test_the_captured_requests_the_pods_report_are_the_newest_listing_and_unread_or_unreported_say_so():
    # Each pod lists the whole folder (every pod's complete shards): the largest count is the newest.
    assert learning.captured_counts([{"captured": {"extraction": 40, "qa": 3}}, None,
                                     {"captured": {"extraction": 30}}]) == {"extraction": 40, "qa": 3}
    assert learning.captured_counts([None, None]) == learning.NOT_READ == learning.captured_counts([])
    # Stats without a capture count: not held back (pods_captured says which pods those are).
    assert learning.captured_counts([{"categories": {}}]) is None
    assert learning.capture_wait("extraction", 64, None) == "" == learning.capture_wait("extraction", 0, {})
    assert learning.capture_wait("extraction", 64, {"extraction": 64}) == ""
    assert "2 of 64 in closed capture shards" in learning.capture_wait("extraction", 64, {"extraction": 2, "qa": 900})
    assert "0 of 64" in learning.capture_wait("extraction", 64, {})
    assert "not read" in learning.capture_wait("extraction", 64, learning.NOT_READ)


def test_only_pods_that_capture_hold_a_training_back():
    """vLLM's pods capture nothing, and their companion's GetStats has an empty `captured` map,
    which the probe (GrpcEngineProbe.stats) reads as {} just as it reads our engine's before its
    first shard closes. The plan took that {} for "0 captured" and held a vLLM pair's training
    back for good ("0 of 64"); the docs say such an engine is not waited for."""
    probed = [{"categories": {}, "speculating": True, "uptimeSeconds": 30.0, "captured": {}}]  # GetStats as read
    vllm = {**RELEASE, "engine": {"kind": "vllm"}}
    assert learning.pods_captured(SPEC, vllm, probed) is None
    assert learning.pods_captured(SPEC, RELEASE, probed) == {}
    assert learning.pods_captured({**SPEC, "learning": {"enabled": False}}, RELEASE, probed) is None
    wanted = {"training": {"runs": [{"version": "3", "category": "extraction", "phase": "wanted", "job": "",
                                     "candidate": "", "message": "", "acceptance": 0.08}]}}
    absent = [learning.Training("3", "extraction", tj.training_state(None))]
    for release, starts in ((vllm, True), (RELEASE, False)):
        steps = learning.training_steps("chat", SPEC, wanted, absent, lambda *a: False, _job,
                                        learning.pods_captured(SPEC, release, probed))
        assert bool([s for s in steps if isinstance(s, EnsureOwned)]) is starts, release
        if not starts:
            assert "0 of 64" in next(s for s in steps if isinstance(s, Condition)).message


def test_a_training_waits_for_its_minimum_of_captured_requests_then_starts():
    """The default demo's head was trained on 2 captured requests and accepted 0.08, below the
    lookup it replaced: the Job waits for spec.learning.training.minCapturedRequests (default 64)."""
    assert tj.training_defaults()["minCapturedRequests"] == 64
    assert tj.TrainingSettings.from_spec(SPEC["learning"]).min_captured == 64
    wanted = {"training": {"runs": [{"version": "3", "category": "extraction", "phase": "wanted", "job": "",
                                     "candidate": "", "message": "", "acceptance": 0.08}]}}
    absent = [learning.Training("3", "extraction", tj.training_state(None))]
    assert tj.waits_for_capture(wanted, "3") and not tj.waits_for_capture(wanted, "4")

    def steps(captured, status=wanted, recorded=()):
        return learning.training_steps("chat", SPEC, status, absent,
                                       lambda action, key, version: (action, key) in recorded, _job, captured)
    short = steps({"extraction": 12, "qa": 500})
    assert not [s for s in short if isinstance(s, EnsureOwned)]
    said = [s for s in short if isinstance(s, Record)]
    assert [(r.action, r.key, r.warning) for r in said] == [("TrainingWaiting", "3/extraction", False)]
    assert "12 of 64" in said[0].reason
    run = next(s for s in short if isinstance(s, SetStatus)).fields["training"]["runs"][-1]
    assert run["phase"] == "wanted" and run["job"] == "" and "12 of 64" in run["message"] and run["acceptance"] == 0.08
    cond = next(s for s in short if isinstance(s, Condition))
    assert (cond.type, cond.status, cond.reason) == ("Learning", True, "WaitingForCapture") and "12 of 64" in cond.message
    # The next passes: the counts move in the status, the Event is not said again.
    waiting = next(s for s in short if isinstance(s, SetStatus)).fields
    later = steps({"extraction": 40}, waiting, {("TrainingWaiting", "3/extraction")})
    assert not [s for s in later if isinstance(s, (EnsureOwned, Record))]
    assert "40 of 64" in next(s for s in later if isinstance(s, SetStatus)).fields["training"]["runs"][-1]["message"]
    # A pass that did not read the pods' counters starts nothing and says nothing new.
    unread = steps(learning.NOT_READ, waiting, {("TrainingWaiting", "3/extraction")})
    assert not [s for s in unread if isinstance(s, (EnsureOwned, Record))]
    # Enough: the Job starts, once.
    enough = steps({"extraction": 64}, waiting, {("TrainingWaiting", "3/extraction")})
    assert len([s for s in enough if isinstance(s, EnsureOwned)]) == 1
    assert [r.action for r in enough if isinstance(r, Record)] == ["TrainingStarted"]
    assert next(s for s in enough if isinstance(s, SetStatus)).fields["training"]["runs"][-1]["phase"] == tj.RUNNING
    # A minimum the pair sets; the CRD bounds it.
    low = {**SPEC, "learning": {**SPEC["learning"], "training": {"minCapturedRequests": 2}}}
    assert [s for s in learning.training_steps("chat", low, wanted, absent, lambda *a: False, _job, {"extraction": 2})
            if isinstance(s, EnsureOwned)]
    from specpair_operator.crd.validation import validate_spec
    bad = validate_spec({"learning": {"enabled": True, "persistentVolumeClaim": "c",
                                      "training": {"minCapturedRequests": -1}}})
    assert any("minCapturedRequests" in e for e in bad), bad


def test_a_training_that_times_out_or_fails_changes_nothing_but_says_so():
    job = _job("3", "extraction")
    timed_out = tj.training_state(*_finished(job, "Failed", "DeadlineExceeded", ""))
    assert timed_out.phase == tj.TIMED_OUT and "ran out of time" in timed_out.message
    steps = _steps([learning.Training("3", "extraction", timed_out)], recorded={("TrainingStarted", "3/extraction")})
    assert not [s for s in steps if isinstance(s, EnsureOwned)]
    rec = next(s for s in steps if isinstance(s, Record))
    assert (rec.action, rec.warning, rec.to_version) == ("TrainingTimedOut", True, "3")
    assert "v3 keeps serving as it was" in rec.reason
    cond = next(s for s in steps if isinstance(s, Condition))
    assert (cond.status, cond.reason) == (False, "TrainingTimedOut")
    # Only conditions, history and status: no alias, tag or speculation step anywhere.
    assert {type(s) for s in steps} <= {Record, Condition, SetStatus}
    failed = tj.training_state(*_finished(job, "Failed", "BackoffLimitExceeded",
                                          {"error": "no captured requests of category 'extraction'"}))
    assert failed.phase == tj.FAILED and "no captured requests" in failed.message
    rec = next(s for s in _steps([learning.Training("3", "extraction", failed)]) if isinstance(s, Record)
               and s.action != "TrainingStarted")
    assert rec.action == "TrainingFailed" and rec.warning
    # Complete without a version named: a failure, not a candidate.
    assert tj.training_state(*_finished(job, "Complete", message="done")).phase == tj.FAILED


def test_the_training_job_manifest():
    job = _job("3", "extraction")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"]) == (0, 600)
    assert job["metadata"]["annotations"][tj.ANN_CATEGORY] == "extraction"
    # One Job per (release, category); a category's name is any string (hashed into the name).
    assert len({tj.training_job_name("chat", v, c) for v in ("3", "4") for c in ("qa", "QA", "a b")}) == 6
    container = pod["containers"][0]
    # The runner tags its draft's lineage with the Job's name (its pod's HOSTNAME is the pod's).
    assert {"name": tj.JOB_ENV, "value": job["metadata"]["name"]} in container["env"]
    cmd = container["command"]
    assert cmd[:3] == ["python", "-m", "specpair_operator.gate.training_runner"]
    assert cmd[cmd.index("--category") + 1] == "extraction" and cmd[cmd.index("--max-seconds") + 1] == "360"
    assert cmd[cmd.index("--device") + 1] == "cpu" and cmd[cmd.index("--version") + 1] == "3"
    # On the CPU it holds no GPU, though the engine pods' resources name one.
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "capture")
    assert mount == {"name": "capture", "mountPath": "/var/lib/specpair/capture", "readOnly": True}
    assert cmd[cmd.index("--capture-dir") + 1] == "/var/lib/specpair/capture/chat"   # the pair's own folder
    volume = next(v for v in pod["volumes"] if v["name"] == "capture")
    assert volume["persistentVolumeClaim"] == {"claimName": "captures", "readOnly": True}
    gpu = {**SPEC, "learning": {**SPEC["learning"], "training": {"gpu": True}}}
    gpu_job = _job("3", "extraction", spec=gpu)
    gpu_container = gpu_job["spec"]["template"]["spec"]["containers"][0]
    assert gpu_container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu_container["command"][gpu_container["command"].index("--device") + 1] == "cuda"
    assert gpu_job["spec"]["activeDeadlineSeconds"] == tj.training_defaults()["activeDeadlineSeconds"] == 1800


# -- through the serving plan: the drift ladder to RollbackWouldNotHelp, then the training ------

class LearningCluster(Cluster):
    """test_operator_serving_plan's Cluster (its model of what the serving steps write) with the
    pair's training Jobs: observe reports them (w.trainings), a created one runs for a pass and
    then ends as `outcome` says (DONE: it registered v9)."""
    outcome = tj.DONE

    def world(self):
        return dataclasses.replace(super().world(), trainings={
            key: tj.TrainingState(phase, f"Job {key} {phase}", "9" if phase == tj.DONE else "", self.runs[key])
            for key, phase in self.jobs.items()})

    def apply(self, step, status):
        manifest = getattr(step, "manifest", None) or {}
        if manifest.get("kind") == "Job" and manifest["metadata"]["labels"].get(LABEL_ROLE) == tj.ROLE:
            run = tj.job_run(manifest)
            key = tj.run_key(*run)
            assert key not in self.jobs, f"training Job {key} created twice"
            assert manifest["metadata"]["name"] not in self.names, f"training Job name {key} taken twice"
            self.jobs[key], self.runs[key] = tj.RUNNING, run
            self.names.add(manifest["metadata"]["name"])
            return
        super().apply(step, status)

    def tick(self):
        super().tick()
        self.jobs = {k: self.outcome if phase == tj.RUNNING else phase for k, phase in self.jobs.items()}


def no_rollback_helps(outcome: str) -> LearningCluster:
    """test_operator_serving_plan's ladder where v1 serves the same models gated no better than v2
    (no rollback helps), with learning on."""
    start = ladder_start()
    start.tags["1"] = release_tags("1")
    start.rates["1"] = 0.2
    cl = LearningCluster(dataclasses.replace(start.w, spec={**start.w.spec, **SPEC_LEARNING}), start.tags,
                         start.rates)
    cl.jobs, cl.runs, cl.names, cl.outcome = {}, {}, set(), outcome
    return cl


SPEC_LEARNING = {"learning": {"enabled": True, "persistentVolumeClaim": "captures"}}


@pytest.mark.parametrize("outcome,ended", [(tj.DONE, "TrainingSucceeded"), (tj.TIMED_OUT, "TrainingTimedOut")])
def test_rollback_would_not_help_trains_the_category_once_even_when_killed_after_any_write(outcome, ended):
    reference, done = converge(no_rollback_helps(outcome), passes=30)
    actions = [a for a, _ in reference.history]
    assert actions == ["RolloutStarted", "SpeculationOff", "TrainingStarted", ended], actions
    assert reference.said["RollbackWouldNotHelp"] and list(reference.jobs) == ["2/code"]
    assert reference.w.aliases["champion"] == "2"     # nothing else changed: v2 serves as it was
    # Killed after each write of the way in turn: one Job, each training step recorded once.
    for crash_at in range(len(done)):
        end, _ = converge(no_rollback_helps(outcome), crash_at, passes=30)
        keyed = Counter((a, k) for a, k in end.history if a.startswith("Training"))
        assert list(end.jobs) == ["2/code"] and set(keyed) == {("TrainingStarted", "2/code"), (ended, "2/code")}, \
            (crash_at, keyed)
        assert max(keyed.values()) == 1, (crash_at, keyed)


# -- on a schedule (spec.learning.schedule) -------------------------------------------------------

SCHEDULED = {**SPEC, "learning": {**SPEC["learning"], "schedule": {"intervalSeconds": 3600,
                                                                  "categories": ["code", "qa", "code"]}}}


def _scheduled(status, now, running=(), spec=SCHEDULED, live=None):
    return learning.scheduled_trainings(spec, status, "3", now, live or {"code": 0.31}, running)


def test_a_schedule_marks_its_start_then_trains_each_category_once_a_slot():
    # Off, or no schedule: nothing, whatever the time.
    assert _scheduled({}, "2026-12-07T10:00:00Z", spec=SPEC) == (None, [])
    off = {**SCHEDULED, "learning": {**SCHEDULED["learning"], "enabled": False}}
    assert _scheduled({}, "2026-12-07T10:00:00Z", spec=off) == (None, [])
    # First seen: its start marked, nothing trained (nothing captured under it yet).
    started, said = _scheduled({}, "2026-12-07T10:00:07Z")
    assert said == [] and started["schedule"]["last"] == "2026-12-07T10:00:07Z"
    assert started["schedule"]["next"] == "2026-12-07T11:00:07Z" and "runs" not in started
    status = {"training": started}
    assert _scheduled(status, "2026-12-07T11:00:06Z") == (None, [])          # not due yet
    # Due: one training of the champion per category (listed twice, trained once), keyed by the slot.
    due, said = _scheduled(status, "2026-12-07T11:00:30Z")
    slot = "2026-12-07T11:00:07Z"
    assert [(r["version"], r["category"], r["slot"], r["phase"], r.get("acceptance")) for r in due["runs"]] == \
        [("3", "code", slot, "wanted", 0.31), ("3", "qa", slot, "wanted", None)]
    assert due["schedule"]["last"] == slot and due["schedule"]["next"] == "2026-12-07T12:00:07Z"
    assert [(e.type, e.reason) for e in said] == [("Normal", "TrainingScheduled")] and "'code', 'qa'" in said[0].message
    # A pass that died before writing it decides the same, later: the same slot, so the same Jobs.
    assert _scheduled(status, "2026-12-07T11:59:59Z")[0]["runs"] == due["runs"]
    names = {tj.training_job_name("chat", "3", r["category"], r["slot"]) for r in due["runs"]}
    assert len(names | {tj.training_job_name("chat", "3", "code"), tj.training_job_name("chat", "3", "qa")}) == 4
    # Written: nothing more until the next slot.
    assert _scheduled({"training": due}, "2026-12-07T12:00:06Z") == (None, [])
    # An operator down for three intervals trains once, at the newest slot past (the last ones ended).
    ended = {**due, "runs": [{**r, "phase": tj.DONE} for r in due["runs"]]}
    late, _ = _scheduled({"training": ended}, "2026-12-07T15:30:00Z")
    assert [r["slot"] for r in late["runs"][2:]] == ["2026-12-07T15:00:07Z"] * 2
    assert late["schedule"]["last"] == "2026-12-07T15:00:07Z"


def test_a_slot_skips_a_category_still_training_and_everything_while_a_learned_draft_is_tried():
    mark = {"last": "2026-12-07T10:00:00Z", "next": "2026-12-07T11:00:00Z"}
    running = {"version": "3", "category": "code", "slot": "2026-12-07T10:00:00Z", "phase": "running"}
    status = {"training": {"schedule": mark, "runs": [running]}}
    due, said = _scheduled(status, "2026-12-07T11:00:01Z")
    assert [(r["category"], r.get("slot")) for r in due["runs"]] == [("code", "2026-12-07T10:00:00Z"),
                                                                     ("qa", "2026-12-07T11:00:00Z")]
    assert "skipped 'code' (a training of it is still running)" in said[0].message
    # A Job the status does not know of counts as running too; the due slot's own does not.
    status = {"training": {"schedule": mark}}
    due, said = _scheduled(status, "2026-12-07T11:00:01Z", running=[("qa", "2026-12-07T10:00:00Z")])
    assert [r["category"] for r in due["runs"]] == ["code"] and "skipped 'qa'" in said[0].message
    own, _ = _scheduled(status, "2026-12-07T11:00:01Z", running=[("qa", "2026-12-07T11:00:00Z")])
    assert [r["category"] for r in own["runs"]] == ["code", "qa"]
    # A learned draft being gated or shadowed: the whole slot is skipped (and said), not postponed.
    for stage in ("gating", "shadow"):
        busy = {**status, "learnedRelease": {"version": "4", "stage": stage}}
        skipped, said = _scheduled(busy, "2026-12-07T11:00:01Z")
        assert skipped["runs"] == [] and skipped["schedule"]["last"] == "2026-12-07T11:00:00Z"
        assert [e.reason for e in said] == ["ScheduledTrainingSkipped"] and f"v4 is in {stage}" in said[0].message
    # Promoted or rejected: the road is free.
    free, _ = _scheduled({**status, "learnedRelease": {"version": "4", "stage": "promoted"}}, "2026-12-07T11:00:01Z")
    assert len(free["runs"]) == 2
    # A longer interval set meanwhile moves the next slot; a shorter one can make it due at once.
    longer = {**SCHEDULED, "learning": {**SCHEDULED["learning"], "schedule": {"intervalSeconds": 7200,
                                                                             "categories": ["code"]}}}
    moved, said = _scheduled(status, "2026-12-07T10:30:00Z", spec=longer)
    assert moved["schedule"]["next"] == "2026-12-07T12:00:00Z" and said == []


class ScheduledCluster(LearningCluster):
    """The learning cluster with a healthy champion (no drift: only the schedule trains) and a
    wall clock: each pass is 20 minutes after the one before (an interval of an hour is a slot
    every three passes)."""

    def world(self):
        return dataclasses.replace(super().world(), now=learning._iso(1_796_637_600 + self.t * 400))

    def healthy(self):
        return False      # run every pass: a pass with nothing to write is not the end here


def scheduled_start() -> ScheduledCluster:
    start = ladder_start()
    start.rates["2"] = 0.8
    spec = {**start.w.spec, "learning": {**SPEC_LEARNING["learning"],
                                         "schedule": {"intervalSeconds": 3600, "categories": ["code"]}}}
    cl = ScheduledCluster(dataclasses.replace(start.w, spec=spec), start.tags, start.rates)
    cl.jobs, cl.runs, cl.names, cl.outcome = {}, {}, set(), tj.DONE
    return cl


def test_a_schedule_trains_once_a_slot_even_when_killed_after_any_write():
    reference, done = converge(scheduled_start(), passes=16)
    slots = sorted(run[2] for run in reference.runs.values())
    # 16 passes of 20 minutes: the start marked at the first serving one, a slot every hour after it.
    assert len(slots) == 4 and all(run[:2] == ("2", "code") for run in reference.runs.values()), reference.runs
    hours = [parse_iso(s).timestamp() for s in slots]
    assert [b - a for a, b in zip(hours, hours[1:])] == [3600.0] * 3
    keyed = Counter((a, k) for a, k in reference.history if a.startswith("Training"))
    assert set(keyed) == {(a, tj.run_key("2", "code", s)) for s in slots for a in ("TrainingStarted", "TrainingSucceeded")}
    assert reference.w.status["training"]["schedule"]["last"] == slots[-1]
    assert reference.w.aliases["champion"] == "2" and not reference.said["RollbackWouldNotHelp"]
    # Killed after each write in turn: never a second Job for a slot, each step recorded once.
    for crash_at in range(len(done)):
        end, _ = converge(scheduled_start(), crash_at, passes=16)
        keyed = Counter((a, k) for a, k in end.history if a.startswith("Training"))
        assert max(keyed.values()) == 1, (crash_at, keyed)
        # A status lost with the kill may start the schedule a pass later: a slot fewer at most.
        assert 3 <= len(end.runs) <= 4, (crash_at, end.runs)
        assert {k for a, k in keyed if a == "TrainingStarted"} == set(end.jobs), (crash_at, keyed)
