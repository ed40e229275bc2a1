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

import datetime
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from specpair_operator.crd.conditions import parse_iso
from specpair_operator.desired import learning as learning_mod
from specpair_operator.desired import training_job
from specpair_operator.release import content as release_mod
from specpair_operator.release.registry_contract import TAG_RELEASE
from specpair_operator.plan.release_steps import Condition, PostEvent, Record, SetStatus
from specpair_operator.plan.serving_steps import EnsureOwned

if TYPE_CHECKING:
    from specpair_operator.plan.steps import Step   # the union of every plan's steps

LEARNING = "Learning"        # the condition
TRAININGS_KEPT = 10          # status.training.runs: the newest few (above the schedule's 8 categories a slot)
WANTED = training_job.WANTED  # recorded by the drift check, its Job not created yet
WAITING_RECORD = "TrainingWaiting"   # once per training: it waits for captured requests
TERMINAL = (training_job.DONE, training_job.FAILED, training_job.TIMED_OUT)
RECORDS = {training_job.DONE: "TrainingSucceeded", training_job.FAILED: "TrainingFailed",
           training_job.TIMED_OUT: "TrainingTimedOut"}


def breached_categories(reason: str, breaches: Iterable[Any]) -> list[str]:
    """The categories to train for from one drift decision: those whose sustained breach found no
    rollback that helps (decision.reason 'no rollback: ...'); the pooled '*' window names none."""
    if not reason.startswith("no rollback"):
        return []
    return sorted({str(j.category) for j in breaches if str(j.category) != "*"})


run_key = training_job.run_key


@dataclass(frozen=True)
class Training:
    """One (release, category) training as this pass sees it."""
    version: str
    category: str
    state: training_job.TrainingState     # its Job as observed (ABSENT when it is gone)
    slot: str = ""                        # spec.learning.schedule's slot ('' for a drift's)

    @property
    def key(self) -> str:
        return run_key(self.version, self.category, self.slot)


def wanted_trainings(status: Mapping[str, Any], champion: str,
                     adopted: Iterable[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """(version, category, slot) of the trainings this pass follows: those status.training
    records for the champion, then the champion's Jobs the status does not know of (`adopted`: the
    pass that created one died before its status)."""
    wanted = [(str(r["version"]), str(r["category"]), str(r.get("slot") or ""))
              for r in training_job.recorded_runs(status) if str(r["version"]) == champion]
    for run in adopted:
        if run not in wanted:
            wanted.append(run)
    return wanted


NOT_READ = "not read"     # captured_counts: the pods' counters were not read this pass


def captured_counts(stats: Iterable[Mapping[str, Any] | None]) -> dict[str, int] | None | str:
    """Captured requests per category in the complete shards of the pair's capture folder, from the
    pods' GetStats (`stats`: each ready pod's, None where not read). Every pod lists the same
    folder (every pod's shards: what the training Job reads), so the largest count is the newest.
    NOT_READ when no pod's were read this pass (a training then waits for a pass that reads them);
    None when no pod reports a capture count (an engine that does not: its training is not held
    back)."""
    read = [st for st in stats if st is not None]
    if not read:
        return NOT_READ
    reporting = [st["captured"] for st in read if isinstance(st.get("captured"), Mapping)]
    if not reporting:
        return None
    total: dict[str, int] = {}
    for counts in reporting:
        for category, n in counts.items():
            total[str(category)] = max(total.get(str(category), 0), int(n))
    return total


def pods_captured(spec: Mapping[str, Any], release: Mapping[str, Any],
                  stats: Iterable[Mapping[str, Any] | None]) -> dict[str, int] | None | str:
    """captured_counts of the pods' GetStats, or None where the release's pods capture nothing
    (learning_mod.pods_capture: vLLM's). Their probe reads an empty count (proto3 has no absent
    map), as it does from our engine before its first shard closes: only a pod that captures holds
    a training back."""
    return captured_counts(stats) if learning_mod.pods_capture(spec, release) else None


def capture_wait(category: str, minimum: int, captured: Mapping[str, int] | None | str) -> str:
    """Why a wanted training does not start yet ('' : it starts now). It trains on the category's
    captured requests in closed shards: fewer than `minimum` (spec.learning.training.
    minCapturedRequests) train a draft that cannot draft the traffic (the demo's head trained on 2
    requests accepted 0.08 where the lookup it replaced accepted 0.16)."""
    if captured is None or minimum <= 0:
        return ""
    if isinstance(captured, str):
        return f"waiting for the engine pods' capture counts of '{category}' (not read this pass)"
    have = int(captured.get(category, 0))
    if have >= minimum:
        return ""
    return (f"waiting for captured requests of '{category}': {have} of {minimum} in closed capture shards "
            f"(spec.learning.training.minCapturedRequests)")


def training_steps(pair: str, spec: Mapping[str, Any], status: Mapping[str, Any],
                   trainings: list[Training], was: Callable[[str, str, str], bool],
                   job: Callable[[str, str, str], dict[str, Any]],
                   captured: Mapping[str, int] | None | str = None) -> list[Step]:
    """The steps for the champion's trainings (`trainings`: wanted_trainings with their Jobs as
    observed); nothing when learning is off (then no Job is ever started, whatever drifts).
    `job(version, category, slot)` renders the Job (desired_training_job with the installation's settings).
    `captured`: captured_counts of this pass; a training whose Job is not created yet waits until
    its category has spec.learning.training.minCapturedRequests (capture_wait), said in the
    Learning condition (reason WaitingForCapture, with the counts) and once as TrainingWaiting."""
    if not training_job.learning_enabled(spec) or not trainings:
        return []
    minimum = training_job.TrainingSettings.from_spec(spec.get("learning")).min_captured
    recorded = {run_key(r["version"], r["category"], r.get("slot") or ""): r for r in training_job.recorded_runs(status)}
    steps: list[Step] = []
    runs: dict[str, dict[str, Any]] = dict(recorded)
    newest: tuple[str, bool, str] | None = None   # the condition: reason, status, message
    for t in trainings:
        key = t.key
        before = recorded.get(key) or {}
        name = training_job.training_job_name(pair, t.version, t.category, t.slot)
        phase, message, candidate = t.state.phase, t.state.message, t.state.candidate
        if before.get("phase") in TERMINAL:
            # Ended: the status keeps what it did (its Job is deleted by its TTL, and its pods'
            # reports are not read again).
            phase, message, candidate = before["phase"], str(before.get("message") or ""), \
                str(before.get("candidate") or "")
        else:
            started = (f"training a new draft for category '{t.category}' of v{t.version} on its captured traffic"
                       + (f" (scheduled at {t.slot})" if t.slot else ""))
            wait = capture_wait(t.category, minimum, captured) if phase == training_job.ABSENT else ""
            if wait:
                # No Job yet: the operator's periodic pass looks again (no loop of its own).
                if not isinstance(captured, str) and not was(WAITING_RECORD, key, t.version):
                    steps.append(Record(WAITING_RECORD, f"{started}: {wait}", t.version, t.version, key=key))
                runs.pop(key, None)
                runs[key] = {**before, "version": t.version, "category": t.category,
                             **({"slot": t.slot} if t.slot else {}), "job": "", "phase": WANTED,
                             "candidate": "", "message": wait}
                newest = ("WaitingForCapture", True, f"{started}: {wait}")
                continue
            if phase == training_job.ABSENT:
                manifest = job(t.version, t.category, t.slot)
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
        runs[key] = {**before, "version": t.version, "category": t.category, **({"slot": t.slot} if t.slot else {}),
                     "job": name, "phase": phase, "candidate": candidate, "message": message}
        if before.get("phase") not in TERMINAL:
            # An ended training's condition was said when it ended; after that the learned
            # draft's road (plan/learned_release.py) says where the newest try stands.
            newest = _condition(phase, t, message, candidate)
    kept = list(runs.values())[-TRAININGS_KEPT:]
    # The whole of status.training (the schedule's mark too): a pass's SetStatus replaces the field.
    steps.append(SetStatus({"training": {**dict(status.get("training") or {}), "runs": kept}}))
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
    the champion has one for that category already (running or ended, on drift or on schedule:
    the schedule trains it again at its next slot). `live`: the champion's live acceptance per
    category, kept with the want as what a learned draft must beat."""
    runs = training_job.recorded_runs(status)
    have = {(str(r["version"]), str(r["category"])) for r in runs}
    new = [_want(champion, cat, live) for cat in categories if (champion, cat) not in have]
    return [SetStatus({"training": {**dict(status.get("training") or {}),
                                    "runs": (runs + new)[-TRAININGS_KEPT:]}})] if new else []


def _want(champion: str, category: str, live: Mapping[str, float] | None, slot: str = "") -> dict[str, Any]:
    return {"version": champion, "category": category, **({"slot": slot} if slot else {}), "job": "",
            "phase": WANTED, "candidate": "", "message": "",
            **({"acceptance": float(live[category])} if live and category in live else {})}


# -- on a schedule (spec.learning.schedule) ------------------------------------------------------

SCHEDULE = "schedule"        # status.training.schedule: {last, next, message}
BUSY = (WANTED, training_job.RUNNING)
ON_THE_ROAD = ("gating", "shadow")     # status.learnedRelease.stage while a learned draft is tried


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds(stamp: str) -> float | None:
    try:
        return parse_iso(stamp).timestamp()
    except (TypeError, ValueError):
        return None


def scheduled_trainings(spec: Mapping[str, Any], status: Mapping[str, Any], champion: str, now: str,
                        live: Mapping[str, float] | None = None,
                        running: Iterable[tuple[str, str]] = ()) -> tuple[dict[str, Any] | None, list[Step]]:
    """spec.learning.schedule ({intervalSeconds, categories}): status.training as it becomes this
    pass (None: unchanged) and the Event that says a slot's outcome.

    Level-triggered on status.training.schedule.last, the newest slot handled (trained or skipped):
    the first pass that sees the schedule marks now as its start (nothing captured yet to train on),
    and a slot is due every intervalSeconds after it. A due slot is the newest one past (an
    operator down for several intervals trains once, not once per slot missed), so every pass
    until its status is written computes the same slot, and the same Job name: no double run
    across restarts. It wants a training of the champion for each category, keyed by the slot,
    with the champion's live acceptance there as what the learned draft must beat; a category
    whose training is still wanted or running skips the slot, and so does every category while a
    learned draft is being gated or shadowed (a newer one would take its place on the road).
    `running`: (category, slot) of the champion's training Jobs observed running (one the status
    does not know of yet counts too; the due slot's own, made by a pass that died before its
    status, does not)."""
    schedule = dict((spec.get("learning") or {}).get("schedule") or {})
    if not training_job.learning_enabled(spec) or not schedule.get("categories"):
        return None, []
    interval = max(1, int(schedule.get("intervalSeconds") or 0))
    training = dict(status.get("training") or {})
    mark = dict(training.get(SCHEDULE) or {})
    now_s, last_s = _seconds(now), _seconds(str(mark.get("last") or ""))
    if now_s is None:
        return None, []
    if last_s is None:
        first = _iso(now_s + interval)
        return {**training, SCHEDULE: {"last": _iso(now_s), "next": first,
                                       "message": f"schedule started; the first training at {first}"}}, []
    if now_s < last_s + interval:
        if mark.get("next") != _iso(last_s + interval):     # the interval changed
            return {**training, SCHEDULE: {**mark, "next": _iso(last_s + interval)}}, []
        return None, []
    slot_s = last_s + interval * int((now_s - last_s) // interval)
    slot = _iso(slot_s)
    runs = training_job.recorded_runs(status)
    busy = {str(r["category"]) for r in runs if str(r["version"]) == champion and r.get("phase") in BUSY
            and str(r.get("slot") or "") != slot} | {c for c, at in running if at != slot}
    stage = str((status.get("learnedRelease") or {}).get("stage") or "")
    categories = list(dict.fromkeys(str(c) for c in schedule["categories"]))   # each once, in order
    if stage in ON_THE_ROAD:
        trained, skipped = [], categories
        why = f"the learned draft v{(status.get('learnedRelease') or {}).get('version')} is in {stage}"
    else:
        trained = [c for c in categories if c not in busy]
        skipped = [c for c in categories if c in busy]
        why = "a training of it is still running"
    have = {(str(r["version"]), str(r["category"]), str(r.get("slot") or "")) for r in runs}
    new = [_want(champion, c, live, slot) for c in trained if (champion, c, slot) not in have]
    said = (f"slot {slot}: " + (f"training v{champion} for {', '.join(repr(c) for c in trained)}" if trained else "")
            + ("; " if trained and skipped else "")
            + (f"skipped {', '.join(repr(c) for c in skipped)} ({why})" if skipped else ""))
    return ({**training, "runs": (runs + new)[-TRAININGS_KEPT:],
             SCHEDULE: {"last": slot, "next": _iso(slot_s + interval), "message": said}},
            [PostEvent("Normal", "TrainingScheduled" if trained else "ScheduledTrainingSkipped", said)])


def plan_learning(out: Any, champion: str) -> None:
    """The champion's trainings (after its drift check, which wants them through `want_training`,
    and the schedule's, `scheduled_trainings`), as `training_steps`; nothing while observe has not
    read the pair's training Jobs this pass (w.trainings None: learning off, or a pass that stopped
    before)."""
    w = out.world
    if w.trainings is None:
        return
    status = {**w.status, **{k: v for k, v in out.fields.items() if k in ("training", "live")}}
    live = (status.get("live") or {}).get("acceptance") or {}
    running = [state.run[1:] for state in w.trainings.values()
               if state.run[0] == champion and state.phase == training_job.RUNNING]
    training, said = scheduled_trainings(w.spec, status, champion, w.now, live, running)
    if training is not None:
        status = {**status, "training": training}
        out.add(SetStatus({"training": training}), *said)
    # A Job the status does not know of (the pass that created it died before its status) is
    # followed all the same.
    adopted = sorted(state.run for state in w.trainings.values() if state.run[0] == champion)
    wanted = wanted_trainings(status, champion, adopted)
    if not wanted:
        return
    released = json.loads(w.tags.get(TAG_RELEASE) or "null")
    if not isinstance(released, dict):
        return
    inst = w.installation

    def job(version: str, category: str, slot: str) -> dict[str, Any]:
        release = release_mod.with_mlflow(released, inst.tracking_uri, w.model, version)
        return training_job.desired_training_job(w.pair, w.namespace, release, dict(w.rollout),
                                                 dict(w.spec.get("learning") or {}), version, category, w.model,
                                                 inst.tracking_uri, inst.credentials, inst.pods, slot)

    trainings = [Training(v, cat, w.trainings.get(run_key(v, cat, slot)) or training_job.TrainingState(training_job.ABSENT),
                          slot) for v, cat, slot in wanted]
    captured = pods_captured(w.spec, released, [pod.stats for pod in w.ready])
    out.add(*training_steps(w.pair, w.spec, status, trainings, out.was, job, captured))
