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
act (act/carry_out.py) runs the steps in order. The steps are release_steps.py; the gate's are
release_gate.py, the models' fetch model_cache.py, a candidate's shadow or canary release_candidate.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Mapping

from specpair_operator.crd import conditions as c
from specpair_operator.gate import verdict as gate_verdict
from specpair_operator.gate.verdict import GateOutcome
from specpair_operator.desired import manifests
from specpair_operator.observe.world import ReleaseWorld
from specpair_operator.plan.release_candidate import canary_decided_steps, plan_candidate, shadow_verdict_steps
from specpair_operator.plan.release_gate import (gate_numbers, gate_release, gate_result, gate_started_late,
                                                 reported_digest)
from specpair_operator.plan.release_steps import (Condition, PostEvent, Record, ReleaseSteps, ServeChampion, SetAlias,
                                                  TagVersion)
from specpair_operator.policy import canary as canary_mod
from specpair_operator.policy import shadow_run
from specpair_operator.release import aliases as aliases_mod
from specpair_operator.release.registry_contract import TAG_PROMOTED_AT, TAG_ROLLED_BACK

if TYPE_CHECKING:
    from specpair_operator.plan.steps import Step   # the union of every plan's steps

# TAG_PROMOTED_AT and TAG_SPECULATION_OFF (registry_contract) are written before the alias moves
# they stand for, so a pass that dies after the moves leaves the mark behind and the next pass
# records the action (history, Event) it did not get to.


def plan_release(world: ReleaseWorld) -> tuple[Step, ...]:
    """The steps of one pass for the spec's release `world.version`, in the order act runs them."""
    out = ReleaseSteps(world)
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
            gate_numbers(out, outcome)
            gate_started_late(out)
            # The pass that promoted may have died before its status: the gate's result and the
            # promotion are recorded now (each once).
            gate_result(out, outcome)
            _promoted(out, tags, aliases, outcome)
        out.add(ServeChampion(aliases, version))
        return tuple(out.steps)
    if world.gate_status == "pending":
        gate_release(out)
        return tuple(out.steps)
    gate_started_late(out)
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
        reported = reported_digest(out)
        unverified = gate_verdict.verify_verdict(dict(world.verdict or {}), version, reported)
        if unverified is not None and reported is None:
            latest = world.gate_jobs[-1] if world.gate_jobs else None
            if latest is None or not latest.finished:
                # No Job reported this verdict and none is left to (its TTL ran out, or the verdict
                # was written into MLflow by hand), or the Job still runs: gate it (again).
                if latest is None:
                    out.add(PostEvent("Warning", "Regating", f"v{version}: MLflow says it passed, but no gate "
                                      "Job reported that verdict; gating it again"))
                gate_release(out)
                return tuple(out.steps)
            job = manifests.gate_job_name(world.pair, world.digest)
            unverified = replace(unverified, message=f"{unverified.message}: Job {job} finished without a report "
                                 f"(its pod is gone); delete the Job to gate v{version} again")
        if unverified is not None:
            if not out.was(unverified.reason, version, version):
                out.add(Record(unverified.reason, unverified.message, None, version, warning=True, key=version))
            outcome = unverified
    gate_numbers(out, outcome)
    gate_result(out, outcome)
    if not outcome.passed:
        out.add(ServeChampion(aliases, None, f"gate of v{version} failed: {outcome.message}"))
        return tuple(out.steps)
    if plan_candidate(out):
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


def _promoted(out: ReleaseSteps, tags: Mapping[str, str], aliases: Mapping[str, str], outcome: GateOutcome) -> None:
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


