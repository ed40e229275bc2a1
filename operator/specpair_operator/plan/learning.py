"""Drafts that learn (issue 58): when to train a new draft for a drifted category, as steps.

The drift ladder ends where no rollback helps (`Drifted: RollbackWouldNotHelp`): the traffic of a
category moved to work no draft of an earlier release did better on. With `spec.learning`
enabled (capture on, a PVC named), that category's captured traffic trains a new draft: one
training Job per (release, category) (desired/training_job.py), started once, whose runner
registers a new version of the pair's model that changes only the draft side, with its lineage.

Level-triggered: status.training lists the trainings wanted and where each stands (the Job
itself is deleted by its TTL a day after it ends; the status keeps its outcome, so a finished
training is never started again for the same release and category). Each step of a training is a
history entry with its Event, once (keyed `version/category`): TrainingStarted,
TrainingSucceeded (the version registered), TrainingFailed or TrainingTimedOut, after which the
pair is as it was. The condition `Learning` says where the newest training stands.

Pure: decisions from values; the serving plan calls `training_steps` and act carries them out
(EnsureOwned creates the Job; Record, Condition and SetStatus are the status's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from specpair_operator.desired import training_job
from specpair_operator.release import content as release_mod
from specpair_operator.release.registry_contract import TAG_RELEASE
from specpair_operator.plan.release_steps import Condition, Record, SetStatus
from specpair_operator.plan.serving_steps import EnsureOwned

if TYPE_CHECKING:
    from specpair_operator.plan.steps import Step   # the union of every plan's steps

LEARNING = "Learning"        # the condition
TRAININGS_KEPT = 10          # status.training.runs: the newest few
WANTED = "wanted"            # recorded by the drift check, its Job not created yet
TERMINAL = (training_job.DONE, training_job.FAILED, training_job.TIMED_OUT)
RECORDS = {training_job.DONE: "TrainingSucceeded", training_job.FAILED: "TrainingFailed",
           training_job.TIMED_OUT: "TrainingTimedOut"}


def breached_categories(reason: str, breaches: Iterable[Any]) -> list[str]:
    """The categories to train for from one drift decision: those whose sustained breach found no
    rollback that helps (decision.reason 'no rollback: ...'); the pooled '*' window names none."""
    if not reason.startswith("no rollback"):
        return []
    return sorted({str(j.category) for j in breaches if str(j.category) != "*"})


def run_key(version: str, category: str) -> str:
    return f"{version}/{category}"


@dataclass(frozen=True)
class Training:
    """One (release, category) training as this pass sees it."""
    version: str
    category: str
    state: training_job.TrainingState     # its Job as observed (ABSENT when it is gone)


def wanted_trainings(status: Mapping[str, Any], champion: str, breached: Iterable[str]) -> list[tuple[str, str]]:
    """(version, category) pairs this pass follows: those status.training records for the
    champion, then the champion's newly breached categories (a training that ended, however,
    is not started again for the same release and category)."""
    wanted = [(str(r["version"]), str(r["category"])) for r in training_job.recorded_runs(status)
              if str(r["version"]) == champion]
    for category in breached:
        if (champion, category) not in wanted:
            wanted.append((champion, category))
    return wanted


def training_steps(pair: str, spec: Mapping[str, Any], status: Mapping[str, Any],
                   trainings: list[Training], was: Callable[[str, str, str], bool],
                   job: Callable[[str, str], dict[str, Any]]) -> list[Step]:
    """The steps for the champion's trainings (`trainings`: wanted_trainings with their Jobs as
    observed); nothing when learning is off (then no Job is ever started, whatever drifts).
    `job(version, category)` renders the Job (desired_training_job with the installation's settings)."""
    if not training_job.learning_enabled(spec) or not trainings:
        return []
    recorded = {run_key(r["version"], r["category"]): r for r in training_job.recorded_runs(status)}
    steps: list[Step] = []
    runs: dict[str, dict[str, Any]] = dict(recorded)
    newest: tuple[str, bool, str, str] | None = None   # the condition: reason, status, message
    for t in trainings:
        key = run_key(t.version, t.category)
        before = recorded.get(key) or {}
        name = training_job.training_job_name(pair, t.version, t.category)
        phase, message, candidate = t.state.phase, t.state.message, t.state.candidate
        if before.get("phase") in TERMINAL:
            # Ended: the status keeps what it did (its Job is deleted by its TTL, and its pods'
            # reports are not read again).
            phase, message, candidate = before["phase"], str(before.get("message") or ""), \
                str(before.get("candidate") or "")
        else:
            started = f"training a new draft for category '{t.category}' of v{t.version} on its captured traffic"
            if phase == training_job.ABSENT:
                manifest = job(t.version, t.category)
                steps.append(EnsureOwned(manifest, None, mutable=False))
                phase = training_job.RUNNING
                message = f"{started} (Job {name}, at most {manifest['spec']['activeDeadlineSeconds']} s)"
            if not was("TrainingStarted", key, t.version):
                # Also for a Job found without the record: the pass that created it died first.
                steps.append(Record("TrainingStarted", f"{started} (Job {name})", t.version, t.version, key=key))
            if phase in TERMINAL and not was(RECORDS[phase], key, t.version):
                steps.append(Record(RECORDS[phase], message + ("" if phase == training_job.DONE else
                                                               f"; v{t.version} keeps serving as it was"),
                                    t.version, candidate or t.version, warning=phase != training_job.DONE, key=key))
        runs.pop(key, None)     # re-inserted last: the newest at the end
        # Kept: what the drift check wrote with the want (the drifted release's live acceptance on
        # the category: the learned draft's reference, plan/learned_release.py).
        runs[key] = {**before, "version": t.version, "category": t.category, "job": name,
                     "phase": phase, "candidate": candidate, "message": message}
        if before.get("phase") not in TERMINAL:
            # An ended training's condition was said when it ended; after that the learned
            # draft's road (plan/learned_release.py) says where the newest try stands.
            newest = _condition(phase, t, message, candidate)
    kept = list(runs.values())[-TRAININGS_KEPT:]
    steps.append(SetStatus({"training": {"runs": kept}}))
    if newest is not None:
        reason, ok, text = newest
        steps.append(Condition(LEARNING, ok, reason, text))
    return steps


def _condition(phase: str, t: Training, message: str, candidate: str) -> tuple[str, bool, str]:
    if phase == training_job.DONE:
        return "CandidateRegistered", True, (f"v{candidate} trained for category '{t.category}' of v{t.version} "
                                             f"and registered: {message}")
    if phase == training_job.TIMED_OUT:
        return "TrainingTimedOut", False, message + f"; v{t.version} keeps serving as it was"
    if phase == training_job.FAILED:
        return "TrainingFailed", False, message + f"; v{t.version} keeps serving as it was"
    return "Training", True, message


def want_training(status: Mapping[str, Any], champion: str, categories: list[str],
                  live: Mapping[str, float] | None = None) -> list[Step]:
    """The drift check found `categories` breaching with no rollback that helps: recorded as
    trainings wanted (status.training.runs, phase 'wanted') for `plan_learning` to start, unless
    the champion has one for that category already (running or ended). `live`: the champion's
    live acceptance per category, kept with the want as what a learned draft must beat."""
    runs = training_job.recorded_runs(status)
    have = {(str(r["version"]), str(r["category"])) for r in runs}
    new = [{"version": champion, "category": cat, "job": "", "phase": WANTED, "candidate": "", "message": "",
            **({"acceptance": float(live[cat])} if live and cat in live else {})}
           for cat in categories if (champion, cat) not in have]
    return [SetStatus({"training": {"runs": (runs + new)[-TRAININGS_KEPT:]}})] if new else []


def plan_learning(out: Any, champion: str) -> None:
    """The champion's trainings (after its drift check, which wants them through `want_training`),
    as `training_steps`; nothing while observe has not read the pair's training Jobs this pass
    (w.trainings None: learning off, or a pass that stopped before)."""
    w = out.world
    if w.trainings is None:
        return
    status = {**w.status, **{k: v for k, v in out.fields.items() if k == "training"}}
    # A Job the status does not know of (the pass that created it died before its status) is
    # followed all the same.
    adopted = sorted(key.partition("/")[2] for key in w.trainings if key.partition("/")[0] == champion)
    wanted = wanted_trainings(status, champion, adopted)
    if not wanted:
        return
    released = json.loads(w.tags.get(TAG_RELEASE) or "null")
    if not isinstance(released, dict):
        return
    inst = w.installation

    def job(version: str, category: str) -> dict[str, Any]:
        release = release_mod.with_mlflow(released, inst.tracking_uri, w.model, version)
        return training_job.desired_training_job(w.pair, w.namespace, release, dict(w.rollout),
                                                 dict(w.spec.get("learning") or {}), version, category, w.model,
                                                 inst.tracking_uri, inst.credentials, inst.pods)

    trainings = [Training(v, cat, w.trainings.get(run_key(v, cat)) or training_job.TrainingState(training_job.ABSENT))
                 for v, cat in wanted]
    out.add(*training_steps(w.pair, w.spec, status, trainings, out.was, job))
