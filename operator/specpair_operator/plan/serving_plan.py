"""What a pass does about the champion's serving, decided from what it observed: pure (no I/O).

`plan_serving(world)` returns the ordered steps: the engine's objects (control-listener
certificate, NetworkPolicy, Deployment, Service, autoscaler), retiring the legacy engine, a
rollback (a rollout that failed, a tokenizer that does not match the gated one, the drift
ladder's last step), the drift ladder's speculation switches, each pod's speculation, the marks
in MLflow; and what goes into the status (history entries with their Events, conditions,
fields, the report). `plan_watch(world)` is the part that still runs while MLflow is down:
identity, drift (only SpeculationOff) and speculation.

The crash marks live here, in one place:

- a rollback tags the champion `specpair.rolled_back` before the aliases move; a champion found
  with that tag has its rollback finished (the aliases moved, RolledBack recorded once);
- SpeculationOff tags the champion `specpair.drift.speculation_off` before the pods are switched;
  a mark the status does not know of is adopted as the ladder's step taken (recorded now);
- a Deployment rolled (or created) is recorded as RolloutStarted once per template
  (`version@template`), also when the pass that rolled it died before writing its status; a new
  replica count alone is scaling: an Event, no history entry;
- a certificate the pair's Secret holds for this CA and these names (marked `issued-for`) but
  status does not know of was issued by a pass that died: kept, renewed within a day.

act (reconciler.py) runs the steps in order; status steps take effect when the pass ends. This
module is also the observe stage's `ServingQuestions` (observe/serving_questions.py): the pure
reads of a world observe asks while it reads, handed in by act, so observe imports no plan.
"""

from __future__ import annotations

from specpair_operator.release import aliases as aliases_mod
from specpair_operator.policy import shadow_run
from specpair_operator.release import content as release_mod
from specpair_operator.plan.release_steps import Condition, Report, SetStatus, serving_versions
from specpair_operator.release.registry_contract import TAG_ROLLED_BACK
from specpair_operator.observe.serving_world import ServingWorld
from specpair_operator.plan.serving_steps import (address, ANN_ISSUED_FOR, ANN_TEMPLATE, champion_digest, DriftChecked,
                                                  engine_deployment, engine_selector, EnsureAutoscaler, EnsureOwned,
                                                  ExportSpeedup, ForgetDrift, identity, IssueCertificate, kind_of,
                                                  LogWarning, name_taken, ReconcilePodSpeculation, RememberChampion,
                                                  RememberDrift, ReportSpeculation, RetireLegacyEngine, RollSpeculation,
                                                  served_release, shadow_release, speculation_not_reconciled,
                                                  _Steps, SwitchSpeculation, template_fingerprint, WRITES)  # noqa: F401
from specpair_operator.plan.steps import Step  # noqa: F401
from specpair_operator.plan.serving_speculation import _speculation, _switch  # noqa: F401
from specpair_operator.plan.serving_drift import (_drift, drift_position, _rollback,
                                                  rollback_needs_previous, start_release)  # noqa: F401
from specpair_operator.plan.serving_rollout import (certificate_check, _engine, issued_for, _models_ready,
                                                    name_conflict, rollout_state)  # noqa: F401
from specpair_operator.plan.serving_shadow import _shadow, _shadow_verdict  # noqa: F401
from specpair_operator.plan.serving_canary import _canary, _retire_canary  # noqa: F401
from specpair_operator.plan.learning import plan_learning


# -- the plan ----------------------------------------------------------------------------------

def plan_serving(w: ServingWorld) -> tuple[Step, ...]:
    """Roll the engine to the champion and judge it; `w.desired` None means the spec's release is
    not servable (failed gate, rolled back) and the champion carries on. The champion's drift is
    watched either way. While a gate runs (`w.while_gating`) the pass's report stays the gate's
    unless the champion needs an action."""
    out = _Steps(w)
    aliases = w.aliases
    champion = aliases.get(aliases_mod.CHAMPION)
    out.add(SetStatus(serving_versions(aliases)))
    if champion is None:
        if not w.while_gating:
            out.add(Report("stalled", "Failed", "NoRelease", w.desired_reason or "no release has passed the gate"))
        return tuple(out.steps)
    if w.tags.get(TAG_ROLLED_BACK):
        # Rolled back, but the pass that tagged it died before moving the alias: finish it.
        _rollback(out, champion, w.tags[TAG_ROLLED_BACK], marked=True)
        return tuple(out.steps)
    renewed = start_release(out, champion)
    served = served_release(w)
    verdict = w.verdict
    if isinstance(verdict.get("speedup"), (int, float)):
        out.add(SetStatus({"speedup": float(verdict["speedup"])}))
    out.add(ExportSpeedup(champion, verdict))
    # Until live traffic has been measured, the printer column shows the gated acceptance (a
    # rollback leaves none: serving_drift.fresh_release_fields).
    if isinstance(verdict.get("acceptanceRate"), (int, float)) and \
            (w.status.get("servingVersion") != champion or w.status.get("acceptance") is None):
        out.add(SetStatus({"acceptance": float(verdict["acceptanceRate"])}))
    state, msg = _engine(out, w, served)
    if state == "conflict":
        return tuple(out.steps)     # _engine planned the NameConflict report
    if state == "fetching":
        return tuple(out.steps)   # the fetch's steps said so
    if state == "failed" and w.shadow is not None:
        # The pods that carry the candidate's drafter do not come up: the candidate is rejected
        # and the champion is rendered without it, not rolled back.
        out.add(_shadow_verdict(out, champion, shadow_run.REJECTED, f"the pods of v{champion} scoring it did not "
                                f"become available: {msg}", {}))
        return tuple(out.steps)
    if state == "failed":
        _rollback(out, champion, f"rollout of v{champion} failed: {msg}")
        return tuple(out.steps)
    if state != "available":
        if not w.while_gating:
            out.add(Report("reconciling", "RollingOut", "RollingOut", f"rolling out v{champion}: {msg}", ready_message=msg))
        return tuple(out.steps)
    digest = release_mod.content_hash(served)
    ok, why, verified = identity(w, champion, digest)
    if ok:
        out.add(RememberChampion(champion, dict(w.tags), dict(verdict), digest))
    if why.startswith("tokenizer"):
        _rollback(out, champion, why)
        return tuple(out.steps)
    if not ok:
        if not w.while_gating:
            out.add(Report("reconciling", "RollingOut", "IdentityUnverified", why))
        return tuple(out.steps)
    # The champion is watched whatever the spec's release is doing (gated, failed, rolled back).
    watching = w.while_gating or w.desired is None
    drifted = _drift(out, champion, verified, watching, renewed)
    plan_learning(out, champion)     # spec.learning: the trainings the drift check wants
    stuck = _speculation(out, champion, verified)
    if w.canary_run is None:
        _retire_canary(out, champion)
    if w.while_gating or (w.desired is None and drifted and out.reported):
        return tuple(out.steps)  # nothing to say beyond what a drift action this pass already said
    if w.desired is None:
        out.add(Report("stalled", "Degraded", "ReleaseNotServable", f"{w.desired_reason}; v{champion} keeps serving",
                       ready_reason="ChampionKeepsServing"))
        return tuple(out.steps)
    shadowing = _shadow(out, champion, verified) if w.shadow is not None else None
    canarying = _canary(out, champion, verified) if w.canary_run is not None else None
    # A pod not yet at the speculation state drift wants is what this pass reports, over the
    # drift step it took.
    serving = None if drifted else shadowing or canarying or Report("ready", "Serving", "Serving",
                                                       f"v{champion} serving on {len(w.ready)} pod(s), identity verified")
    out.add(ReportSpeculation(out.speculation(champion), champion, tuple(stuck), serving))
    return tuple(out.steps)


def plan_watch(w: ServingWorld) -> tuple[Step, ...]:
    """MLflow is down, serving is not: keep judging the champion's drift on what MLflow said
    last (`w.registry_down`). Only the protective first step (SpeculationOff) can be taken;
    promotion, rollback and SpeculationOn wait for MLflow."""
    out = _Steps(w)
    champion = w.aliases[aliases_mod.CHAMPION]
    renewed = start_release(out, champion)
    ok, _, verified = identity(w, champion, w.served_hash)
    if ok:
        _drift(out, champion, verified, watching=False, renewed=renewed)
        _speculation(out, champion, verified)
    return tuple(out.steps)
