"""The serving plan's rollback and drift: the drift ladder's position, its steps (speculation off,
rollback) and a rollback's marks in MLflow."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Mapping

from specpair.stats import RequestMoments

from specpair_operator.release import aliases as aliases_mod
from specpair_operator.crd import conditions as c
from specpair_operator.policy import drift as drift_mod
from specpair_operator.gate import verdict as gate_verdict
from specpair_operator.policy import serving_health
from specpair_operator.plan.release_steps import (Condition, PostEvent, Record, Report, SetAlias, SetStatus,
                                                  TagVersion, serving_versions)
from specpair_operator.release.registry_contract import TAG_RELEASE, TAG_SPECULATION_OFF
from specpair_operator.release.registry_contract import TAG_DRIFT_PROBE, TAG_ROLLED_BACK, TAG_TOKENIZER_DRAFT, probe_mark
from specpair_operator.observe.serving_world import EnginePod, ServingWorld
from specpair_operator.plan.serving_steps import address, DriftChecked, ForgetDrift, LogWarning, RememberDrift, _Steps
from specpair_operator.plan.serving_speculation import _switch
from specpair_operator.plan import learning
from specpair_operator.plan import learned_release


@dataclass(frozen=True)
class DriftPosition:
    """Where the champion is on the drift ladder as this pass starts."""
    policy: drift_mod.DriftPolicy
    previous: drift_mod.DriftState
    off: bool                      # SpeculationOff is among the steps taken
    adopted: bool                  # taken from the champion's mark: the pass that took it died first
    due: bool                      # an interval has passed since the last check
    next_step: str | None


ROLLBACK_WOULD_NOT_HELP = "RollbackWouldNotHelp"
PROBING = "Probing"


def drifted_without_step(no_rollback: str, from_acceptance: bool, probing: bool, off: bool, said_now: bool,
                         standing: str | None) -> tuple[bool, str, str] | None:
    """The Drifted condition (status, reason, message) a drift check that took no ladder step
    leaves, or None where the one this check said, or the standing one, is still the decision.

    no_rollback: the check's "no rollback" verdict ('' for none); from_acceptance: it rests on
    this check's sustained acceptance breaches, not on serving health's pressure; probing: a
    probe runs after this check; off: speculation is off; said_now: this check said a breach or
    WithinBaseline already; standing: the reason of the pair's Drifted condition as read.

    The condition says the current decision. While a probe runs, the acceptance ladder measures
    afresh and may still roll back: an older "no rollback" gives way to Probing, and so does
    serving health's, which that ladder can overrule (its reason stays in the message). Once the
    probe is over without a verdict, Probing gives way to SpeculationOff."""
    if no_rollback and (from_acceptance or not probing):
        return True, ROLLBACK_WOULD_NOT_HELP, no_rollback
    if probing:
        if said_now or not (no_rollback or standing == ROLLBACK_WOULD_NOT_HELP):
            return None
        return True, PROBING, "speculation off, probing with the draft for fresh acceptance windows" + \
            (f" (serving health: {no_rollback})" if no_rollback else "")
    if off and standing == PROBING and not said_now:
        return True, "SpeculationOff", "the probe ended without a verdict; serving target-only"
    return None


NOT_JUDGED = "NotJudgedYet"


def fresh_release_fields(status: Mapping[str, Any], champion: str) -> dict[str, Any]:
    """The drift fields of a release no drift check has judged yet: status.drift with its ladder
    at the start (`version` names the release the drift fields and the Drifted condition
    describe), speculation on (no step of its ladder turned it off: status_speculation), no live
    acceptance (the printer column's: serving_plan shows the gated one until a window is judged),
    no live windows or traffic shift counts, and servingHealth with its baselines (kept per
    release: a rollback compares them) but not the last release's streaks and verdicts."""
    fields: dict[str, Any] = {"drift": {**drift_mod.DriftState().as_dict(), "version": str(champion), "probing": False},
                              "speculationEnabled": True, "acceptance": None,
                              "live": {"acceptance": {}, "draftedTokens": {}, "trafficShift": {}}}
    if status.get("servingHealth"):
        fresh = serving_health.ServingState.for_release(dict(status["servingHealth"]), champion)
        fields["servingHealth"] = {**fresh.as_dict(), "live": {}}
    return fields


def new_release_status(status: Mapping[str, Any], champion: str) -> tuple[SetStatus | Condition, ...]:
    """What a champion that status.drift does not describe yet (promoted since the last check)
    starts with: fresh drift fields (fresh_release_fields), and a Drifted condition that says it
    is not judged yet where one stands. Without it the previous release's verdict
    (RollbackWouldNotHelp, SpeculationOff...), its last windows, traffic shift counts and ladder
    step (the specpair_drift_ladder_step gauge) stood for the new release until a window of it
    was judged.

    Nothing where status.drift names no release (a pair never checked has nothing stale) or this
    one: a rollback writes the fresh fields of the release it goes to, whose RolledBack condition
    says why it serves."""
    judged = str((status.get("drift") or {}).get("version") or "")
    if not judged or judged == str(champion):
        return ()
    steps: list[SetStatus | Condition] = [SetStatus(fresh_release_fields(status, champion))]
    standing = c.get_condition(status.get("conditions"), c.DRIFTED)
    if standing is not None:
        steps.append(Condition(c.DRIFTED, "Unknown", NOT_JUDGED,
                               f"v{champion} serves; no drift window of it judged yet (v{judged}'s last: "
                               f"{standing.get('status')} {standing.get('reason')})"))
    return tuple(steps)


def serving_breach_reason(judged: serving_health.Judgement) -> str:
    return "ErrorRateAboveLimit" if judged.metric == serving_health.ERRORS else "LatencyAboveBaseline"


def drift_position(w: ServingWorld, champion: str) -> DriftPosition | None:
    """None when drift is not watched (spec.drift.enabled false)."""
    spec = w.spec.get("drift") or {}
    if not spec.get("enabled", True):
        return None
    policy = drift_mod.DriftPolicy.from_spec(dict(spec))
    previous = drift_mod.state_for_release(dict(w.status.get("drift") or {}), champion)
    off = drift_mod.SPECULATION_OFF in policy.ladder[:previous.steps_taken]
    adopted = bool(w.tags.get(TAG_SPECULATION_OFF)) and not off and drift_mod.SPECULATION_OFF in policy.ladder
    if adopted:
        previous = replace(previous, steps_taken=policy.ladder.index(drift_mod.SPECULATION_OFF) + 1,
                           since=w.drift.wall)
        off = True
    due = w.drift.monotonic - w.drift.checked_at >= float(spec.get("intervalSeconds", 30))
    next_step = policy.ladder[previous.steps_taken] if previous.steps_taken < len(policy.ladder) else None
    return DriftPosition(policy, previous, off, adopted, due, next_step)


def rollback_needs_previous(w: ServingWorld, champion: str) -> bool:
    """Whether the drift check needs the facts of the release a rollback would go to."""
    pos = drift_position(w, champion)
    target = w.aliases.get(aliases_mod.PREVIOUS)
    return pos is not None and pos.due and not w.registry_down and pos.next_step == drift_mod.ROLLBACK \
        and bool(target) and target != champion


def _rollback(out: _Steps, champion: str, reason: str, marked: bool = False) -> None:
    w = out.world
    al = dict(w.aliases)
    target = aliases_mod.rollback_target(al)
    out.add(Condition(c.DRIFTED, True, "RolledBack" if target else "NoPreviousRelease", reason))
    if target is None:
        out.add(Report("stalled", "Failed", "NoPreviousRelease", f"{reason}; no previous release",
                       ready_message=f"{reason}; no previous release to roll back to"))
        return
    # The tag first: it is what keeps a restarted operator from re-promoting this version, and
    # what makes the next pass finish the alias move if this one dies before it.
    if not marked:
        out.add(TagVersion(champion, {TAG_ROLLED_BACK: reason[:4000]}))
    for move in aliases_mod.plan_rollback(al):
        out.add(SetAlias(move.alias, move.version))
    out.add(Record("RolledBack", reason, champion, target, warning=True, key=champion),
            ForgetDrift(),
            # (servingHealth as this pass left it: a baseline its check measured stays)
            SetStatus(fresh_release_fields({**w.status, **out.fields}, target)),
            SetStatus(serving_versions({**al, aliases_mod.CHAMPION: target})),
            Report("reconciling", "RollingOut", "RolledBack", f"rolling back to v{target}", ready_message=reason))


def start_release(out: _Steps, champion: str) -> bool:
    """The champion's fresh drift fields and Drifted condition where status.drift describes
    another release (new_release_status); True when so. Planned before the champion's rollout
    and drift check, so neither a rollout nor the check reads the other release's as its own."""
    steps = new_release_status(out.world.status, champion)
    out.add(*steps)
    return bool(steps)


def _drift(out: _Steps, champion: str, pods: list[EnginePod], watching: bool, renewed: bool = False) -> bool:
    """Let drift.decide pick the ladder's step from each pod's counters, and take it. True when
    this pass took a drift action or the champion serves target-only after one. `renewed`: this
    pass started the champion's drift fields (start_release), so the status as read is another
    release's."""
    w = out.world
    pos = drift_position(w, champion)
    if pos is None:
        return False
    policy, previous, off = pos.policy, pos.previous, pos.off
    if pos.adopted:
        # The pass that turned speculation off died before writing its status: adopt its step.
        out.add(SetStatus({"speculationEnabled": False}),
                SetStatus({"drift": {**previous.as_dict(), "version": str(champion), "probing": False}}),
                Record("SpeculationOff", w.tags[TAG_SPECULATION_OFF], champion, champion, warning=True))

    if not off and not w.status.get("speculationEnabled", True):
        # Left false by the previous champion's ladder (a promotion keeps the field): this
        # release's ladder has not turned speculation off, so it speculates (status_speculation).
        out.add(SetStatus({"speculationEnabled": True}))

    def degraded(extra: str = "") -> bool:
        if not watching:  # watched, the pass reports the spec's release; the Drifted condition says the rest
            out.add(Report("ready", "Degraded", "SpeculationOff", f"v{champion} serving target-only after drift{extra}"))
        return True
    if not pos.due:
        return degraded() if off else False
    out.add(DriftChecked(w.drift.monotonic))
    unreachable = next((p for p in pods if p.stats is None), None)
    if unreachable is not None:
        out.add(LogWarning(f"drift check skipped: {unreachable.stats_unreachable or 'no counters'}"))
        return degraded() if off else False
    observed = []
    for pod in pods:
        stats = pod.stats or {}
        uptime = stats.get("uptimeSeconds")
        observed.append(drift_mod.PodStats(
            f"{pod.name}/{pod.uid}",
            {cat: RequestMoments.from_stats(v) for cat, v in (stats.get("categories") or {}).items()},
            w.drift.wall - float(uptime) if uptime else None))
    memory = w.drift.memory if w.drift.version == champion else drift_mod.Memory()
    if w.registry_down and pos.next_step != drift_mod.SPECULATION_OFF:
        return off  # without MLflow only the protective first step is taken
    previous_baseline, same_models = None, False
    if rollback_needs_previous(w, champion):
        # Rolling back only helps if the previous release does better on this traffic: its gated
        # baseline per category, and whether it serves the very same models.
        prev_verdict = w.drift.previous_verdict
        previous_baseline = gate_verdict.baseline_from_verdict(dict(prev_verdict)) if prev_verdict else None
        tags_prev = w.drift.previous_tags or {}

        def models(tags: Mapping[str, str]) -> Any:
            rel = json.loads(tags.get(TAG_RELEASE) or "{}")
            return rel.get("target"), rel.get("draft"), tags.get(TAG_TOKENIZER_DRAFT)
        same_models = TAG_RELEASE in tags_prev and models(tags_prev) == models(w.tags)
    # vLLM pods count per category too (their companion, from vLLM's per-request acceptance):
    # both engines are judged against the gated baseline per category, by the same rules.
    baseline = gate_verdict.baseline_from_verdict(dict(w.verdict))
    # A learned draft's category is held to what it was promoted on, not to golden prompts the
    # traffic left (learned_release.learned_baselines).
    baseline, previous_baseline = learned_release.learned_baselines(baseline, previous_baseline, w.tags,
                                                                    w.aliases.get(aliases_mod.PREVIOUS))
    # Acceptance and serving health (latency, errors) climb the same ladder.
    serving_pods = [serving_health.serving_pod(p.pod, pod.stats or {}, p.started) for p, pod in zip(observed, pods)]
    outcome = serving_health.decide(
        policy, serving_health.LatencyPolicy.from_spec(dict(w.spec.get("drift") or {})), previous, memory,
        serving_health.ServingState.for_release(dict(w.status.get("servingHealth") or {}), champion),
        w.drift.serving, w.drift.wall, observed, serving_pods, baseline, previous_baseline, same_models,
        champion=champion, previous_version=w.aliases.get(aliases_mod.PREVIOUS),
        speculating=any(bool((pod.stats or {}).get("speculating")) for pod in pods))
    decision = outcome.drift
    if w.registry_down and decision.action and decision.action != drift_mod.SPECULATION_OFF:
        return off
    out.add(RememberDrift(champion, decision.memory, outcome.serving.memory),
            SetStatus({"servingHealth": outcome.serving.status()}))
    state = decision.state
    probing = decision.memory.probe_started is not None
    out.add(SetStatus({"drift": {**state.as_dict(), "version": str(champion), "probing": probing}}))
    last = decision.memory.last
    live = {cat: round(j.live, 4) for cat, j in last.items() if cat != drift_mod.OVERALL}
    if drift_mod.OVERALL in last:
        out.add(SetStatus({"acceptance": round(last[drift_mod.OVERALL].live, 4)}))
    shift = {} if renewed else dict((w.status.get("live") or {}).get("trafficShift") or {})
    for cat, n in decision.shift.items():
        shift[cat] = int(shift.get(cat, 0)) + n
    out.add(SetStatus({"live": {"acceptance": live,
                                "draftedTokens": {cat: j.drafted for cat, j in last.items() if cat != drift_mod.OVERALL},
                                "trafficShift": shift}}))
    messages = [j.message() for j in decision.breaches]
    slow = outcome.serving.breaches
    for judged in slow:
        out.add(PostEvent("Warning", serving_breach_reason(judged), judged.message()))
    said_now = True
    if messages:
        out.add(Condition(c.DRIFTED, True, "AcceptanceBelowBaseline", "; ".join(messages)))
    elif slow:
        out.add(Condition(c.DRIFTED, True, serving_breach_reason(slow[0]), "; ".join(j.message() for j in slow)))
    elif any(j.verdict == drift_mod.FINE for j in decision.judged) and not off:
        out.add(Condition(c.DRIFTED, False, "WithinBaseline", "live acceptance within the gated baseline"
                          + (f"; traffic shift, not judged: {', '.join(sorted(shift))}" if shift else "")))
    else:
        said_now = False
    addresses = tuple(address(w, pod) for pod in pods)
    if decision.action == drift_mod.SPECULATION_OFF:
        reason = "sustained drift: " + decision.reason
        # The mark first (see TAG_SPECULATION_OFF), then the pods. With MLflow down the status
        # alone carries the step (a crash before it is written loses it; the pods turn back on).
        if not w.registry_down:
            out.add(TagVersion(champion, {TAG_SPECULATION_OFF: reason[:4000]}))
        _switch(out, champion, addresses, False, reason)
        out.add(SetStatus({"speculationEnabled": False}),
                Condition(c.DRIFTED, True, "SpeculationOff", reason),
                Record("SpeculationOff", reason, champion, champion, warning=True),
                Report("ready", "Degraded", "SpeculationOff", f"v{champion} serving target-only: {reason}"))
        return True
    if decision.action == drift_mod.ROLLBACK:
        # Acceptance rolls back after SpeculationOff; serving health (errors) may go there directly.
        _rollback(out, champion, ("drift persisted after speculation off: " if off else "sustained drift: ")
                  + decision.reason)
        return True
    if decision.action == drift_mod.SPECULATION_ON:
        out.add(TagVersion(champion, {TAG_SPECULATION_OFF: ""}))
        _switch(out, champion, addresses, True, decision.reason)
        out.add(SetStatus({"speculationEnabled": True}),
                Condition(c.DRIFTED, False, "Recovered", decision.reason),
                Record("SpeculationOn", decision.reason, champion, champion))
        return False
    sustained = [j for j in decision.breaches if state.streaks.get(j.category, 0) >= policy.consecutive]
    # The condition says the current decision: a "no rollback" read before a probe is not it.
    standing = None if renewed else (c.get_condition(w.status.get("conditions"), c.DRIFTED) or {}).get("reason")
    drifted = drifted_without_step(decision.reason, bool(sustained), probing, off, said_now, standing)
    if drifted is not None:
        out.add(Condition(c.DRIFTED, *drifted))
    if decision.reason and w.trainings is not None:
        # spec.learning: the categories whose sustained breach no rollback helps train a new
        # draft (plan/learning.py starts the Job after this check).
        out.add(*learning.want_training({**w.status, **out.fields}, champion,
                                        learning.breached_categories(decision.reason, sustained), live))
    if off:
        # Speculation stays off but keeps being measured: probes turn it on for a while when the
        # engine drafted nothing since.
        if w.status.get("speculationEnabled", True) != decision.speculation:
            # A probe beginning or ending is a change of how the champion serves: marked on the
            # version (its record in words, registry_contract.probe_mark), the mark first as for
            # SpeculationOff. Its time comes from the drift memory, so a pass run again writes
            # the same mark.
            began = decision.memory.probe_started if decision.speculation else None
            ended = memory.probe_started is not None and not decision.speculation
            if not w.registry_down and (began is not None or ended):
                at = began if began is not None else decision.memory.last_draft_at or w.drift.wall
                out.add(TagVersion(champion, {TAG_DRIFT_PROBE: probe_mark(decision.speculation, at)}))
            _switch(out, champion, addresses, decision.speculation,
                    "drift probe" if decision.speculation else "drift probe over")
        out.add(SetStatus({"speculationEnabled": decision.speculation}))
        return degraded(" (probing with the draft)" if probing else "")
    return False
