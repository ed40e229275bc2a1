"""Gating the spec's release, as steps: its Job (and a new attempt after one that ended without a
verdict), a verdict MLflow lost with the release, the gate's numbers and result in the status.

The crash marks: the `candidate` alias and the gate Job come before `GateStarted` is recorded; a
Job found without its record gets it (the pass that created it died)."""

from __future__ import annotations

import math

from specpair_operator.crd import conditions as c
from specpair_operator.desired import manifests, model_fetch
from specpair_operator.gate import attempts as gate_attempts, verdict as gate_verdict
from specpair_operator.gate.verdict import GateOutcome
from specpair_operator.observe.world import ReleaseWorld
from specpair_operator.plan.model_cache import fetched_record, models_ready
from specpair_operator.plan.release_steps import (Condition, EnsureGatePolicy, ObserveGateDuration, Record,
                                                  RecordGateError, ReleaseSteps, Report, ServeChampion, SetAlias,
                                                  SetStatus, StartGateJob, name_conflict, versions_status)
from specpair_operator.release import aliases as aliases_mod
from specpair_operator.release.registry_contract import TAG_GATE_RUN

VERIFIED_VERDICTS_KEPT = 10
# A gate Job completes seconds after its runner wrote the verdict into MLflow; a pass reads the
# tags before the Jobs. A Job complete for longer than this whose release MLflow shows no verdict
# for: the registry lost it (the registered model or the version deleted and made again).
VERDICT_GRACE_S = 10.0
RELEASE_MISSING = "ReleaseMissing"


def gate_release(out: ReleaseSteps) -> None:
    """Gate the release: its Job (a new attempt after one that ended without a verdict), then
    Gating, reported unless the champion, watched meanwhile, needs an action."""
    w = out.world
    version, digest = w.version, w.digest
    if w.aliases.get(aliases_mod.CANDIDATE) != version:
        out.add(SetAlias(aliases_mod.CANDIDATE, version))
    if w.gate_policy_owned is False:
        name_conflict(out, "NetworkPolicy", manifests.gate_policy_name(w.pair))
        return
    out.add(EnsureGatePolicy())
    jobs = w.gate_jobs
    if jobs:
        # The gate started, so its models were there; a pass that died before recording the
        # fetch leaves its completed Job, recorded now.
        if w.model_fetch is not None and w.model_fetch.phase == model_fetch.DONE:
            out.add(*fetched_record(w.model_fetch, version, w.models, w.fetched))
    elif not models_ready(out):
        return
    attempt = max(1, len(jobs))
    latest = jobs[-1] if jobs else None
    job = manifests.gate_job_name(w.pair, digest, attempt)
    if latest is not None and not latest.owned:
        name_conflict(out, "Job", job)
        return
    started = f"gating v{version} ({digest[:12]}) in Job {job}"
    waiting = w.gate_pods_waiting
    lost = release_lost(w)
    if lost:
        _release_missing(out, lost)
    if lost and latest is not None and latest.complete:
        # Its verdict is gone with the registry's copy of the release: gate the release (registered
        # again by this pass) anew, the champion's engine serving meanwhile.
        if attempt >= w.attempts.attempts:
            msg = (f"v{version}: {lost}; {attempt} gate attempt(s) used, none left: delete the pair's gate "
                   f"Jobs ({manifests.gate_job_name(w.pair, digest)}*) to gate it again")
            out.add(Condition(c.GATED, "Unknown", RELEASE_MISSING, msg),
                    Report("stalled", "Failed", RELEASE_MISSING, msg, ready_message=msg))
            return
        attempt += 1
        job = manifests.gate_job_name(w.pair, digest, attempt)
        out.add(StartGateJob(version, attempt))
        waiting = ""
    elif latest is None:
        out.add(StartGateJob(version, attempt), Record("GateStarted", started, None, version, key=version))
        waiting = ""
    elif not out.was("GateStarted", version, version):
        out.add(Record("GateStarted", started, None, version, key=version))  # its pass died after the create
    elif attempt > 1 and not jobs[-2].complete and not out.was("GateRetrying", f"{version}#{attempt}", version):
        # The pass that started this attempt died before recording it.
        out.add(_retry(w, attempt, jobs[-2].failure(version), job))
    elif latest.failed:
        # No verdict (the gate crashed, MLflow stayed unreachable, the pod was killed): not a
        # result. The release is gated again, a bounded number of times.
        failure = latest.failure(version)
        since = (c.parse_iso(w.now) - c.parse_iso(latest.failed_at)).total_seconds() if latest.failed_at else math.inf
        step, wait = gate_attempts.next_step(w.attempts, attempt, since)
        why = failure.describe()
        if step == gate_attempts.GIVE_UP:
            reason = f"{attempt} gate attempt(s) ended without a verdict; the last: {why}"
            out.add(RecordGateError(version, reason), Condition(c.GATED, False, "GateError", f"v{version}: {reason}"),
                    Report("stalled", "Failed", "GateError", f"gate of v{version}: {reason}", ready_message=reason))
            return
        if step == gate_attempts.WAIT:
            msg = (f"v{version}: gate attempt {attempt} of {w.attempts.attempts} ended without a verdict: {why}; "
                   f"attempt {attempt + 1} in {wait:.0f}s")
            out.add(Condition(c.GATED, "Unknown", "GateRetrying", msg), versions_status(w.aliases),
                    Report("reconciling", "Gating", "GateRetrying", msg, provisional=True),
                    ServeChampion(w.aliases, None, while_gating=True))
            return
        job = manifests.gate_job_name(w.pair, digest, attempt + 1)
        out.add(StartGateJob(version, attempt + 1), _retry(w, attempt + 1, failure, job))
        waiting = ""
    # An attempt after a complete one: the registry lost that one's verdict (release_lost).
    regating = attempt > 1 and len(jobs) >= attempt - 1 and jobs[attempt - 2].complete
    reason = "GatePending" if waiting else RELEASE_MISSING if regating else "Gating"
    serving = w.aliases.get(aliases_mod.CHAMPION)
    out.add(Condition(c.GATED, "Unknown", reason, f"v{version} is being gated by Job {job}"
                      + (f" ({waiting})" if waiting else "")
                      + (" again: MLflow lost the verdict of the last gate" if regating else "")),
            versions_status(w.aliases),
            Report("reconciling", "Gating", reason,
                   (f"MLflow lost v{version}'s gate verdict (the release was registered again); " if regating else "")
                   + f"gate Job {job} " + (f"waiting: {waiting}" if waiting else "running") + f" for v{version}",
                   ready_message=f"gating v{version}" + (f"; v{serving} keeps serving" if serving else ""),
                   provisional=True),
            ServeChampion(w.aliases, None, while_gating=True))


def release_lost(w: ReleaseWorld) -> str:
    """Why the registry has lost the gate verdict of the spec's release ('' when it has not): MLflow
    shows none (`pending`) for a version whose verdict the operator verified earlier, or whose
    gate Job completed (a runner writes the verdict before it exits) VERDICT_GRACE_S ago or more.
    That is a registered model or version deleted in MLflow: the pass has registered the release
    again, under a version number MLflow chose, with none of its tags."""
    if w.gate_status != "pending":
        return ""
    if str(w.version) in w.verified_verdicts:
        return (f"MLflow has no gate verdict for v{w.version} although the operator verified one before "
                f"(the registered model or version was deleted in MLflow)")
    latest = w.gate_jobs[-1] if w.gate_jobs else None
    if latest is None or not latest.owned or not latest.complete or not latest.completed_at:
        return ""
    if (c.parse_iso(w.now) - c.parse_iso(latest.completed_at)).total_seconds() < VERDICT_GRACE_S:
        return ""
    return (f"MLflow has no gate verdict for v{w.version} although its gate Job {latest.name} completed at "
            f"{latest.completed_at} (the registered model or version was deleted in MLflow)")


def _release_missing(out: ReleaseSteps, lost: str) -> None:
    """What the status says of a lost release, once per attempt: a history entry and its Event, and
    the lost version's verified verdict dropped (the gate of the release registered again reports
    its own; a merge patch deletes a key written as null)."""
    w = out.world
    attempt = max(1, len(w.gate_jobs)) + (1 if w.gate_jobs and w.gate_jobs[-1].complete else 0)
    if not out.was(RELEASE_MISSING, f"{w.version}#{attempt}", w.version):
        out.add(Record(RELEASE_MISSING, f"{lost}; release {w.digest[:12]} registered again as v{w.version} and gated "
                       "again; the engine keeps serving its release meanwhile", None, w.version, warning=True,
                       key=f"{w.version}#{attempt}"))
    if str(w.version) in w.verified_verdicts:
        out.add(SetStatus({"verifiedVerdicts": {**w.verified_verdicts, str(w.version): None}}))


def _retry(w: ReleaseWorld, attempt: int, failure: gate_attempts.Failure, job: str) -> Record:
    return Record("GateRetrying", f"v{w.version}: gate attempt {attempt - 1} of {w.attempts.attempts} ended without "
                  f"a verdict: {failure.describe()}; attempt {attempt} in Job {job}", None, w.version, warning=True,
                  key=f"{w.version}#{attempt}")


def reported_digest(out: ReleaseSteps) -> str | None:
    """The digest of the verdict the release's gate Job reported: kept in status once seen, read
    from the gate pods' termination messages (written by the kubelet) before that."""
    w = out.world
    kept = w.verified_verdicts.get(str(w.version))
    if kept:
        return str(kept)
    for job in reversed(w.gate_jobs):   # the latest attempt's: an earlier one may be of a lost release
        digest = job.verdict_digest(w.version)
        if digest is not None:
            kept_all = {**w.verified_verdicts, str(w.version): digest}
            # The last few versions; written whatever else the pass says.
            ordered = sorted(kept_all.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0)
            out.add(SetStatus({"verifiedVerdicts": dict(ordered[-VERIFIED_VERDICTS_KEPT:])}))
            return digest
    return None


def gate_started_late(out: ReleaseSteps) -> None:
    """A gate Job can finish while the operator that created it is down (it died right after the
    create): its GateStarted, or for a later attempt its GateRetrying, still belongs in history,
    once."""
    w = out.world
    jobs = w.gate_jobs
    if not jobs or not jobs[-1].owned:
        return
    if not out.was("GateStarted", w.version, w.version):
        out.add(Record("GateStarted", f"gating v{w.version} ({w.digest[:12]}) in Job "
                       f"{manifests.gate_job_name(w.pair, w.digest)}", None, w.version, key=w.version))
    attempt = len(jobs)
    if attempt > 1 and not jobs[-2].complete and not out.was("GateRetrying", f"{w.version}#{attempt}", w.version):
        out.add(_retry(w, attempt, jobs[-2].failure(w.version), jobs[-1].name))


def gate_numbers(out: ReleaseSteps, outcome: GateOutcome) -> None:
    """The gate's result in conditions and status.lastGate."""
    w = out.world
    verdict = gate_verdict.usable_verdict(dict(w.verdict or {}))  # an unusable one reports no numbers
    out.add(Condition(c.GATED, outcome.passed, outcome.reason, f"v{w.version}: {outcome.message}"))
    if outcome.tokenizer_compatible is not None:
        out.add(Condition(c.TOKENIZER_COMPATIBLE, outcome.tokenizer_compatible,
                          "Identical" if outcome.tokenizer_compatible else "Mismatch", outcome.tokenizer_message))
    out.add(SetStatus({"lastGate": {
        "version": w.version, "passed": outcome.passed, "message": outcome.message,
        "acceptanceRate": verdict.get("acceptanceRate"), "speedup": verdict.get("speedup"),
        "greedyIdentity": verdict.get("greedyIdentity"),
        "categories": {k: (v or {}).get("acceptanceRate") for k, v in (verdict.get("categories") or {}).items()},
        "bestSpeculation": verdict.get("bestSpeculation"),
        "runId": w.tags.get(TAG_GATE_RUN, verdict.get("mlflowRunId")),
    }}))


def gate_result(out: ReleaseSteps, outcome: GateOutcome) -> None:
    """A gate's result is an Event and a history entry, once per release, and its Job's run time
    goes to specpair_gate_duration_seconds."""
    w = out.world
    action = "GatePassed" if outcome.passed else \
        gate_verdict.GATE_ERROR if outcome.reason == gate_verdict.GATE_ERROR else "GateFailed"
    if out.was(action, w.version, w.version):
        return
    job = w.gate_jobs[-1] if w.gate_jobs else None
    if job is not None and job.owned and job.started_at:
        # The verdict lands just before the gate pod exits: without a completion time yet, now is
        # when the gate finished.
        end = c.parse_iso(job.completed_at or w.now)
        out.add(ObserveGateDuration("passed" if outcome.passed else "failed",
                                    (end - c.parse_iso(job.started_at)).total_seconds()))
    out.add(Record(action, f"v{w.version}: {outcome.message}", None, w.version, warning=not outcome.passed,
                   key=w.version))

