"""The serving plan's shadow: a gated candidate scored in shadow on the champion's pods, and its verdict."""

from __future__ import annotations

from typing import Any, Mapping

from specpair_operator.gate import verdict as gate_verdict
from specpair_operator.policy import shadow_run
from specpair_operator.release import content as release_mod
from specpair_operator.plan.release_candidate import shadow_verdict_steps
from specpair_operator.plan.release_steps import Condition, Record, Report, SetStatus, TagVersion
from specpair_operator.observe.serving_world import EnginePod
from specpair_operator.plan.serving_steps import shadow_release, _Steps


def _learned(run: shadow_run.ShadowRun) -> dict[str, Any]:
    """A learned draft's reference beside its numbers: its 'championAlpha' there is the reference."""
    t = run.learned
    return {} if t is None else {"learned": {"category": t.category, "floor": t.floor, "driftedAcceptance": t.drifted,
                                             "reference": round(t.reference, 4)}}


def _shadow(out: _Steps, champion: str, pods: list[EnginePod]) -> Report:
    """Judge the candidate scored in shadow on the champion's verified pods (their GetStats) in
    the champion's gated categories; a verdict is tagged on the candidate (the mark: the next
    pass promotes it, or renders the champion without it) and recorded. Returns the report."""
    w = out.world
    run = w.shadow
    gated = gate_verdict.baseline_from_verdict(dict(w.verdict))
    judged = shadow_run.judge(run, release_mod.content_hash(shadow_release(w)), [p.stats for p in pods], gated, w.now)
    # A verdict's mark goes in a pass that records nothing else: killed right after the mark, a
    # pass loses what it recorded, and the passes after act on the mark (the rollout that carried
    # the shadow would never be recorded).
    if judged.result == shadow_run.UNDECIDED or any(isinstance(s, Record) for s in out.steps):
        msg = (f"v{run.version} scored in shadow on {judged.pods} pod(s) of v{champion} for {judged.elapsed:.0f} s: "
               f"{judged.reason}")
        out.add(Condition(shadow_run.SHADOW_SCORED, "Unknown", "Scoring", msg),
                SetStatus({"shadow": {"version": run.version, "champion": champion, "result": judged.result,
                                      "reason": judged.reason, "startedAt": run.started_at,
                                      "share": run.settings.share, **{**shadow_run.numbers(judged), **_learned(run)}}}))
        return Report("reconciling", "Shadowing", "ShadowScoring", msg,
                      ready_message=f"v{champion} serving; v{run.version} scored in shadow")
    return _shadow_verdict(out, champion, judged.result, judged.reason, {**shadow_run.numbers(judged), **_learned(run)})


def _shadow_verdict(out: _Steps, champion: str, result: str, reason: str, numbers: Mapping[str, Any]) -> Report:
    """Tag the verdict on the candidate (first: what the next pass acts on), then say so."""
    w = out.world
    run = w.shadow
    verdict = {"result": result, "reason": reason, "at": w.now, "startedAt": run.started_at,
               "share": run.settings.share, **numbers}
    out.add(TagVersion(run.version, {shadow_run.TAG_SHADOW_VERDICT: shadow_run.verdict_tag(verdict)}),
            *shadow_verdict_steps(out.was, verdict, champion, run.version))
    message = shadow_run.describe(run.version, verdict)
    if result == shadow_run.PROMOTE:
        return Report("reconciling", "Promoting", "ShadowPromoted", message,
                      ready_message=f"v{run.version} promoted by shadow scoring; rolling out")
    return Report("stalled", "Degraded", "ShadowRejected", f"{message}; v{champion} keeps serving",
                  ready_reason="ChampionKeepsServing")
