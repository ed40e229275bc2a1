"""What a pass does about the spec's release, decided from what it observed: pure (no I/O).

`plan_release(world)` returns the ordered steps: the writes to MLflow and the API server (move an
alias, tag the version, ensure the gate's NetworkPolicy, start a gate Job, record a gate error),
what goes into the status (history entries with their Events, conditions, fields, the one
report), and last the champion's serving. The crash marks live here, in one place:

- the `candidate` alias and the gate Job come before `GateStarted` is recorded; a Job found
  without its record gets it (the pass that created it died);
- a promotion writes its mark (`specpair.promoted_at`) before the alias moves; a mark not yet
  recorded is this promotion's and is reused, so `Promoted` is recorded once;
- a rolled-back spec release whose rollback was never recorded gets its `RolledBack` entry.

Status steps take effect only when the pass ends (one write), so a pass that dies after a write
leaves the write and loses its records; the next pass finds the write and records it.
act (reconciler.py) runs the steps in order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Mapping

from specpair_operator.release import aliases as aliases_mod
from specpair_operator.crd import conditions as c
from specpair_operator.policy import canary as canary_mod
from specpair_operator.gate import attempts as gate_attempts, verdict as gate_verdict
from specpair_operator.desired import manifests, model_fetch
from specpair_operator.policy import rollout_strategy, shadow_run
from specpair_operator.gate.verdict import GateOutcome
from specpair_operator.release.registry_contract import (TAG_GATE_RUN, TAG_PROMOTED_AT, TAG_ROLLED_BACK,
                                                         TAG_SPECULATION_OFF)
from specpair_operator.observe.world import ReleaseWorld

if TYPE_CHECKING:
    from specpair_operator.plan.steps import Step   # the union of every plan's steps

TAG_RELEASE = "specpair.release"
# TAG_PROMOTED_AT and TAG_SPECULATION_OFF (registry_contract) are written before the alias moves
# they stand for, so a pass that dies after the moves leaves the mark behind and the next pass
# records the action (history, Event) it did not get to.
VERIFIED_VERDICTS_KEPT = 10
# A gate Job completes seconds after its runner wrote the verdict into MLflow; a pass reads the
# tags before the Jobs. A Job complete for longer than this whose release MLflow shows no verdict
# for: the registry lost it (the registered model or the version deleted and made again).
VERDICT_GRACE_S = 10.0
RELEASE_MISSING = "ReleaseMissing"


# -- writes ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SetAlias:
    alias: str
    version: str


@dataclass(frozen=True)
class TagVersion:
    version: str
    tags: Mapping[str, str]


@dataclass(frozen=True)
class EnsureGatePolicy:
    """The gate pods' NetworkPolicy (no ingress), before the first gate pod exists."""


@dataclass(frozen=True)
class StartGateJob:
    version: str
    attempt: int


@dataclass(frozen=True)
class StartModelFetch:
    """The Job that fills the pair's model cache with the release's models (model_fetch.py)."""
    version: str
    models: str


@dataclass(frozen=True)
class RecordGateError:
    """The gate is broken for good: GateError in the version's tags."""
    version: str
    reason: str


# -- status (written once, when the pass ends) -------------------------------------------------

@dataclass(frozen=True)
class Record:
    """A history entry with its Event; `key` makes it once-only (status.recorded)."""
    action: str
    reason: str
    from_version: str | None
    to_version: str | None
    warning: bool = False
    key: str | None = None


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool | str
    reason: str
    message: str


@dataclass(frozen=True)
class SetStatus:
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class PostEvent:
    type: str
    reason: str
    message: str


ReportHow = Literal["ready", "reconciling", "stalled", "stall"]


@dataclass(frozen=True)
class Report:
    """The pass's report through the ledger's named helper `how` (ready, reconciling, stalled or
    stall) with these arguments."""
    how: ReportHow
    phase: str
    reason: str
    message: str
    ready_message: str | None = None
    provisional: bool = False
    ready_reason: str | None = None     # stalled: Ready's reason when it is not `reason`
    replacing: bool = False             # stands over a report made earlier in the pass


@dataclass(frozen=True)
class ObserveGateDuration:
    result: str          # passed or failed
    seconds: float


# -- then --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServeChampion:
    """Roll the engine to the champion and judge it. `desired` None: the spec's release is not
    (yet) servable and the champion carries on; `while_gating`: a gate runs meanwhile, and the
    champion reports only an action of its own; `shadow`: the champion's pods also score this
    candidate (shadow_run.ShadowRun)."""
    aliases: Mapping[str, str]
    desired: str | None
    reason: str = ""
    while_gating: bool = False
    shadow: Any = None
    canary: Any = None      # canary.CanaryRun: the candidate's pods serve beside the champion's


WRITES = (SetAlias, TagVersion, EnsureGatePolicy, StartModelFetch, StartGateJob, RecordGateError)
FETCHED_KEPT = 5   # status.modelCache.fetched: the models digests of the last few fetches


@dataclass
class _Steps:
    world: ReleaseWorld
    steps: list[Step] = field(default_factory=list)

    def add(self, *steps: Step) -> None:
        self.steps.extend(steps)

    def was(self, action: str, key: str, version: str) -> bool:
        """Recorded already: in the status, or by a step planned earlier in this pass."""
        return self.world.records.was(action, key, version) or any(
            isinstance(s, Record) and s.action == action and s.key == key for s in self.steps)


def plan_release(world: ReleaseWorld) -> tuple[Step, ...]:
    """The steps of one pass for the spec's release `world.version`, in the order act runs them."""
    out = _Steps(world)
    version, aliases, tags = world.version, world.aliases, world.tags
    champion = aliases.get(aliases_mod.CHAMPION)
    if tags.get(TAG_ROLLED_BACK):
        # This release was rolled back; it stays out of service until the spec changes.
        if champion and champion != version and not out.was("RolledBack", version, champion):
            # The pass that rolled it back died before writing its status.
            out.add(Record("RolledBack", tags[TAG_ROLLED_BACK], version, champion, warning=True, key=version))
        out.add(ServeChampion(aliases, None, f"v{version} was rolled back: {tags[TAG_ROLLED_BACK]}"))
        return tuple(out.steps)
    if champion == version:
        if world.verdict is not None:
            outcome = gate_verdict.evaluate_verdict(dict(world.verdict), dict(world.thresholds))
            _gate_numbers(out, outcome)
            _gate_started_late(out)
            # The pass that promoted may have died before its status: the gate's result and the
            # promotion are recorded now (each once).
            _gate_result(out, outcome)
            _promoted(out, tags, aliases, outcome)
        out.add(ServeChampion(aliases, version))
        return tuple(out.steps)
    if world.gate_status == "pending":
        _gate(out)
        return tuple(out.steps)
    _gate_started_late(out)
    if world.gate_status == "error":
        msg = f"gate of v{version} errored: {world.gate_message}"
        out.add(Condition(c.GATED, False, "GateError", msg))
        if not out.was("GateError", version, version):
            out.add(Record("GateError", msg, None, version, warning=True, key=version))
        out.add(ServeChampion(aliases, None, msg))
        return tuple(out.steps)
    outcome = gate_verdict.evaluate_verdict(dict(world.verdict or {}), dict(world.thresholds))
    if outcome.passed:
        # A pass is promoted only if it is the verdict the gate Job reported (MLflow tags can be
        # written by anyone with MLflow access); a failure promotes nothing.
        reported = _reported_digest(out)
        unverified = gate_verdict.verify_verdict(dict(world.verdict or {}), version, reported)
        if unverified is not None and reported is None:
            latest = world.gate_jobs[-1] if world.gate_jobs else None
            if latest is None or not latest.finished:
                # No Job reported this verdict and none is left to (its TTL ran out, or the verdict
                # was written into MLflow by hand), or the Job still runs: gate it (again).
                if latest is None:
                    out.add(PostEvent("Warning", "Regating", f"v{version}: MLflow says it passed, but no gate "
                                      "Job reported that verdict; gating it again"))
                _gate(out)
                return tuple(out.steps)
            job = manifests.gate_job_name(world.pair, world.digest)
            unverified = replace(unverified, message=f"{unverified.message}: Job {job} finished without a report "
                                 f"(its pod is gone); delete the Job to gate v{version} again")
        if unverified is not None:
            if not out.was(unverified.reason, version, version):
                out.add(Record(unverified.reason, unverified.message, None, version, warning=True, key=version))
            outcome = unverified
    _gate_numbers(out, outcome)
    _gate_result(out, outcome)
    if not outcome.passed:
        out.add(ServeChampion(aliases, None, f"gate of v{version} failed: {outcome.message}"))
        return tuple(out.steps)
    if _shadow(out) or _canary(out):
        return tuple(out.steps)
    moves = aliases_mod.plan_promotion(dict(aliases), version)
    tags, after = dict(tags), dict(aliases)
    if moves:
        at = tags.get(TAG_PROMOTED_AT)
        if not at or out.was("Promoted", f"{version}@{at}", version):
            # No mark, or the mark of an earlier promotion: this one gets its own. (A mark not yet
            # recorded is this promotion's, left by a pass that died: reuse it.)
            tags[TAG_PROMOTED_AT] = world.now
            out.add(TagVersion(version, {TAG_PROMOTED_AT: world.now}))
        for move in moves:
            out.add(SetAlias(move.alias, move.version))
            after[move.alias] = move.version
    _promoted(out, tags, after, outcome)
    out.add(ServeChampion(after, version))
    return tuple(out.steps)


def _gate(out: _Steps) -> None:
    """Gate the release: its Job (a new attempt after one that ended without a verdict), then
    Gating, reported unless the champion, watched meanwhile, needs an action."""
    w = out.world
    version, digest = w.version, w.digest
    if w.aliases.get(aliases_mod.CANDIDATE) != version:
        out.add(SetAlias(aliases_mod.CANDIDATE, version))
    if w.gate_policy_owned is False:
        _name_conflict(out, "NetworkPolicy", manifests.gate_network_policy(w.pair, w.namespace)["metadata"]["name"])
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
        _name_conflict(out, "Job", job)
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
            out.add(Condition(c.GATED, "Unknown", "GateRetrying", msg), _versions(w.aliases),
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
            _versions(w.aliases),
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


def _release_missing(out: _Steps, lost: str) -> None:
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


def fetch_steps(state: Any, version: str, models: str, fetched: tuple[str, ...], was_failed: bool,
                serving: str | None, phase: str) -> tuple[bool, list[Step]]:
    """Where the release's models stand in the model cache (model_fetch.fetch_state, or None
    when it needs no fetch): whether its pods may start (the models are there), and the steps
    that say so. Shared by the gate (release_plan.py) and the engine's rollout (serving_rollout.py)."""
    if state is None:
        return True, []
    keeps = f"; v{serving} keeps serving" if serving else ""
    if state.phase == model_fetch.DONE:
        return True, fetched_record(state, version, models, fetched)
    if state.phase == model_fetch.FAILED:
        steps: list[Step] = [Report("stalled", "Failed", model_fetch.MODEL_FETCH_FAILED, state.message,
                                    ready_message=f"the models of v{version} could not be fetched{keeps}")]
        if not was_failed:
            steps.insert(0, Record(model_fetch.MODEL_FETCH_FAILED, f"v{version}: {state.message}", None, version,
                                   warning=True, key=models))
        return False, steps
    steps = []
    if state.phase == model_fetch.ABSENT:
        steps = [StartModelFetch(version, models),
                 PostEvent("Normal", "ModelFetchStarted", f"fetching the models of v{version} into the model cache")]
        message = f"fetching the models of v{version} into the model cache"
    else:
        message = state.message
    return False, steps + [Report("reconciling", phase, model_fetch.MODELS_FETCHING, message,
                                  ready_message=f"fetching the models of v{version}{keeps}", provisional=True)]


def fetched_record(state: Any, version: str, models: str, fetched: tuple[str, ...]) -> list[Step]:
    """A completed fetch into status.modelCache.fetched (the last few), with its Event: later
    passes need no Job for these models, so its TTL may delete it."""
    kept = [d for d in fetched if d != models][-(FETCHED_KEPT - 1):] + [models]
    return [SetStatus({"modelCache": {"fetched": kept}}),
            PostEvent("Normal", "ModelsFetched", f"v{version}: {state.message}")]


def models_ready(out: _Steps) -> bool:
    """The release's models are in the model cache (or it has none): else the fetch's steps,
    the champion watched meanwhile."""
    w = out.world
    ready, steps = fetch_steps(w.model_fetch, w.version, w.models, w.fetched,
                               out.was(model_fetch.MODEL_FETCH_FAILED, w.models, w.version),
                               w.aliases.get(aliases_mod.CHAMPION), "Gating")
    out.add(*steps)
    if not ready:
        out.add(_versions(w.aliases))
        if w.model_fetch.phase != model_fetch.FAILED:
            # A stalled report is final for the pass; as after a gate given up, the champion's
            # Deployment stays as it is.
            out.add(ServeChampion(w.aliases, None, while_gating=True))
    return ready


def _retry(w: ReleaseWorld, attempt: int, failure: gate_attempts.Failure, job: str) -> Record:
    return Record("GateRetrying", f"v{w.version}: gate attempt {attempt - 1} of {w.attempts.attempts} ended without "
                  f"a verdict: {failure.describe()}; attempt {attempt} in Job {job}", None, w.version, warning=True,
                  key=f"{w.version}#{attempt}")


def name_conflict_message(namespace: str, pair: str, kind: str, name: str) -> str:
    return (f"{kind} {namespace}/{name} exists and is not owned by SpecModelPair {pair}; "
            f"rename or delete it (the operator never changes objects it does not own)")


def _name_conflict(out: _Steps, kind: str, name: str) -> None:
    """An object with our child's name that this pair does not own: never touched."""
    out.add(Report("stall", "Failed", "NameConflict", name_conflict_message(out.world.namespace, out.world.pair,
                                                                            kind, name)))


def serving_versions(aliases: Mapping[str, str]) -> dict[str, str]:
    """status.servingVersion and previousVersion as the aliases say."""
    return {"servingVersion": aliases.get(aliases_mod.CHAMPION, ""), "previousVersion": aliases.get(aliases_mod.PREVIOUS, "")}


def _versions(aliases: Mapping[str, str]) -> SetStatus:
    return SetStatus(serving_versions(aliases))


def _reported_digest(out: _Steps) -> str | None:
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


def _gate_started_late(out: _Steps) -> None:
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


def _gate_numbers(out: _Steps, outcome: GateOutcome) -> None:
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


def _gate_result(out: _Steps, outcome: GateOutcome) -> None:
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


def _promoted(out: _Steps, tags: Mapping[str, str], aliases: Mapping[str, str], outcome: GateOutcome) -> None:
    """Promoted goes into history and Events once per promotion (keyed by its mark), also when
    the pass that moved the aliases died before writing its status."""
    version = out.world.version
    at = tags.get(TAG_PROMOTED_AT)
    if not at or aliases.get(aliases_mod.CHAMPION) != version or out.was("Promoted", f"{version}@{at}", version):
        return
    # The shadow verdict or canary that let it through, when every pass since its mark died
    # before its status: recorded with the promotion (once), as the undisturbed pass does.
    previous = aliases.get(aliases_mod.PREVIOUS) or ""
    verdict = shadow_run.read_verdict(out.world.tags)
    if verdict is not None and verdict["result"] == shadow_run.PROMOTE and not out.was("ShadowPromoted", version, version):
        out.add(*shadow_verdict_steps(out.was, verdict, previous, version))
    if canary_mod.mark(out.world.tags)[0] == canary_mod.PASSED and not out.was("CanaryPassed", version, version):
        out.add(*canary_decided_steps(out.was, out.world.tags, previous, version))
    out.add(Record("Promoted", f"v{version} passed the gate ({outcome.message}) and is champion",
                   aliases.get(aliases_mod.PREVIOUS), version, key=f"{version}@{at}"))



# -- a candidate's rollout: shadow or canary ----------------------------------------------------

def _candidate_strategy(w: ReleaseWorld) -> tuple[str, dict[str, Any], rollout_strategy.Strategy] | None:
    """The champion, the candidate's release and the strategy it rolls out by, for a version that
    is a candidate beside a serving champion; None when it is not (no champion, it is the
    champion, or either release is unknown)."""
    champion = w.aliases.get(aliases_mod.CHAMPION)
    candidate = release_of_tags(w.tags)
    if not champion or champion == w.version or w.champion_release is None or candidate is None:
        return None
    return champion, candidate, rollout_strategy.choose_strategy({"rollout": w.rollout}, w.champion_release,
                                                                 candidate)


# -- shadow scoring (shadow_run.py) -------------------------------------------------------------

def _shadow(out: _Steps) -> bool:
    """A passed candidate whose strategy is Shadow (rollout_strategy.choose_strategy) is scored on
    the champion's pods before it is promoted: the serving plan marks its start on its version
    before the champion's pods roll to carry it, and tags the verdict. True when the pass
    ends here (scoring, rejected or refused); False for a promotion (no shadow, or its verdict is
    Promote)."""
    w = out.world
    version, aliases = w.version, w.aliases
    chosen = _candidate_strategy(w)
    if chosen is None:
        return False
    champion, candidate, strategy = chosen
    if strategy.type != rollout_strategy.SHADOW:
        return False
    if strategy.refused:
        msg = (f"v{version} cannot be scored in shadow: {strategy.refused}; v{champion} keeps serving "
               f"(rollout.strategy.type Replace or Canary rolls it out otherwise)")
        out.add(Condition(shadow_run.SHADOW_SCORED, False, "ShadowRefused", msg))
        if not out.was("ShadowRefused", version, version):
            out.add(Record("ShadowRefused", msg, champion, version, warning=True, key=version))
        out.add(_versions(aliases), ServeChampion(aliases, None, msg))
        return True
    verdict = shadow_run.read_verdict(w.tags)
    if verdict is not None and not out.was("ShadowStarted", version, version):
        # Every pass from the pods' roll to the verdict's mark died before its status.
        out.add(Record("ShadowStarted", f"v{version} passed its gate and was scored in shadow on the pods of "
                       f"v{champion} ({strategy.reason})", champion, version, key=version))
    if verdict is None:
        settings = shadow_run.ShadowSettings.from_spec({"rollout": w.rollout})
        # Marked by the serving plan when the champion's pods roll to carry it ('' until then).
        started, started_for = shadow_run.read_started(w.tags)
        if not out.was("ShadowStarted", version, version):
            out.add(Record("ShadowStarted", f"v{version} passed its gate and is scored in shadow on the pods of "
                           f"v{champion} ({strategy.reason}), on {settings.share:g} of requests", champion, version,
                           key=version))
        out.add(_versions(aliases),
                ServeChampion(aliases, champion, shadow=shadow_run.ShadowRun(version, candidate, dict(w.verdict or {}),
                                                                             started, settings, started_for)))
        return True
    out.add(*shadow_verdict_steps(out.was, verdict, champion, version))
    if verdict["result"] == shadow_run.PROMOTE:
        return False
    out.add(_versions(aliases), ServeChampion(aliases, None, f"v{version} was rejected by shadow scoring: "
                                              f"{verdict.get('reason', '')}"))
    return True


def shadow_verdict_steps(was: Any, verdict: Mapping[str, Any], champion: str, version: str) -> list[Step]:
    """A shadow verdict (as tagged on the candidate) in the status: ShadowScored, status.shadow and
    its history entry with its Event, once per candidate (also when the pass that tagged it died
    before its status)."""
    promoted = verdict["result"] == shadow_run.PROMOTE
    action = "ShadowPromoted" if promoted else "ShadowRejected"
    message = shadow_run.describe(version, verdict)
    steps: list[Step] = [Condition(shadow_run.SHADOW_SCORED, True, "Promoted" if promoted else "Rejected", message),
                         SetStatus({"shadow": {**verdict, "version": version, "champion": champion}})]
    if not was(action, version, version):
        steps.append(Record(action, message, champion, version, warning=not promoted, key=version))
    return steps


def release_of_tags(tags: Mapping[str, str]) -> dict[str, Any] | None:
    """A version's release from its specpair.release tag (None: none, or not a release)."""
    try:
        release = json.loads(tags.get(TAG_RELEASE) or "null")
    except ValueError:
        return None
    return release if isinstance(release, dict) else None


# -- canary (canary.py) -------------------------------------------------------------------------

def _canary(out: _Steps) -> bool:
    """A passed candidate whose strategy is Canary serves beside the champion before it is
    promoted (the serving plan runs its steps and tags its end on the candidate). True when the
    pass ends here (the canary runs, or was aborted); False for a promotion (no canary, or it
    passed)."""
    w = out.world
    version, aliases = w.version, w.aliases
    chosen = _candidate_strategy(w)
    if chosen is None:
        return False
    champion, _, strategy = chosen
    state, text = canary_mod.mark(w.tags)
    # An aborted candidate stays out whatever the strategy says now (as a rolled-back release
    # does): a changed release is a new version, and gets a canary of its own.
    if strategy.type != rollout_strategy.CANARY and state != canary_mod.ABORTED:
        return False
    if state == canary_mod.PASSED:
        out.add(*canary_decided_steps(out.was, w.tags, champion, version))
        return False
    if state == canary_mod.ABORTED:
        out.add(*canary_decided_steps(out.was, w.tags, champion, version))
        out.add(_versions(aliases), ServeChampion(aliases, None, f"canary of v{version} aborted: {text}"))
        return True
    steps = canary_mod.steps_of({"rollout": w.rollout})
    if not out.was("CanaryStarted", version, version):
        out.add(Record("CanaryStarted", f"v{version} passed its gate and serves beside v{champion} in "
                       f"{len(steps)} canary step(s): " + "; ".join(s.describe() for s in steps),
                       champion, version, key=version))
    out.add(_versions(aliases),
            ServeChampion(aliases, champion, canary=canary_mod.CanaryRun(version, dict(w.tags), dict(w.verdict or {}),
                                                                         steps)))
    return True


def canary_decided_steps(was: Any, tags: Mapping[str, str], champion: str, version: str) -> list[Step]:
    """A canary's end (as marked on the candidate) in the status: the Canary condition, the
    status.canary entry the mark carries, and CanaryPassed or CanaryAborted with its Event, once
    (also when the pass that marked it died before its status)."""
    state, text = canary_mod.mark(tags)
    passed = state == canary_mod.PASSED
    msg = f"canary of v{version} {'passed' if passed else 'aborted'}: {text}"
    steps: list[Step] = [Condition(canary_mod.CONDITION, passed, "Passed" if passed else "Aborted", msg)]
    entry = canary_mod.marked_entry(tags, version)
    if entry is not None:
        steps.append(SetStatus({"canary": entry}))
    action = "CanaryPassed" if passed else "CanaryAborted"
    if not was(action, version, version):
        steps.append(Record(action, msg, champion, version, warning=not passed, key=version))
    return steps
