"""A passed candidate beside a serving champion, as steps: scored in shadow on the champion's pods
(policy/shadow_run.py) or served beside them as a canary (policy/canary.py) before it is promoted.
The serving plans run them (serving_shadow.py, serving_canary.py) and tag their end on the
candidate; these steps read those tags back into the status, once each."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from specpair_operator.observe.world import ReleaseWorld
from specpair_operator.plan.release_steps import (Condition, Record, ReleaseSteps, ServeChampion, SetStatus,
                                                  versions_status)
from specpair_operator.policy import canary as canary_mod
from specpair_operator.policy import rollout_strategy, shadow_run
from specpair_operator.release import aliases as aliases_mod
from specpair_operator.release.registry_contract import release_of_tags

if TYPE_CHECKING:
    from specpair_operator.plan.steps import Step   # the union of every plan's steps

# -- a candidate's rollout: shadow or canary ----------------------------------------------------

def candidate_strategy(w: ReleaseWorld) -> tuple[str, dict[str, Any], rollout_strategy.Strategy] | None:
    """The champion, the candidate's release and the strategy it rolls out by, for a version that
    is a candidate beside a serving champion; None when it is not (no champion, it is the
    champion, or either release is unknown)."""
    champion = w.aliases.get(aliases_mod.CHAMPION)
    candidate = release_of_tags(w.tags)
    if not champion or champion == w.version or w.champion_release is None or candidate is None:
        return None
    rollout = dict(w.rollout)
    if w.learned is not None:
        # A learned draft (plan/learned_release.py) is promoted on shadow evidence only, whatever
        # the spec asks of its own releases: refused (vLLM), it is not promoted.
        rollout["strategy"] = {**dict(rollout.get("strategy") or {}), "type": rollout_strategy.SHADOW}
    return champion, candidate, rollout_strategy.choose_strategy({"rollout": rollout}, w.champion_release, candidate)


def plan_candidate(out: ReleaseSteps) -> bool:
    """A passed candidate beside a serving champion rolls out by its strategy: scored in shadow,
    or served as a canary, before it is promoted. True when the pass ends here; False for a
    promotion (no champion to roll out beside, a Replace, or a shadow or canary that let it by)."""
    chosen = candidate_strategy(out.world)
    if chosen is None:
        return False
    champion, candidate, strategy = chosen
    return plan_shadow(out, champion, candidate, strategy) or plan_canary(out, champion, strategy)


# -- shadow scoring (shadow_run.py) -------------------------------------------------------------

def plan_shadow(out: ReleaseSteps, champion: str, candidate: dict[str, Any],
                strategy: rollout_strategy.Strategy) -> bool:
    """A passed candidate whose strategy is Shadow (rollout_strategy.choose_strategy) is scored on
    the champion's pods before it is promoted: the serving plan marks its start on its version
    before the champion's pods roll to carry it, and tags the verdict. True when the pass
    ends here (scoring, rejected or refused); False for a promotion (no shadow, or its verdict is
    Promote)."""
    w = out.world
    version, aliases = w.version, w.aliases
    if strategy.type != rollout_strategy.SHADOW:
        return False
    if strategy.refused:
        msg = (f"v{version} cannot be scored in shadow: {strategy.refused}; v{champion} keeps serving "
               + ("(a learned draft is promoted on shadow evidence only)" if w.learned is not None else
                  "(rollout.strategy.type Replace or Canary rolls it out otherwise)"))
        out.add(Condition(shadow_run.SHADOW_SCORED, False, "ShadowRefused", msg))
        if not out.was("ShadowRefused", version, version):
            out.add(Record("ShadowRefused", msg, champion, version, warning=True, key=version))
        out.add(versions_status(aliases), ServeChampion(aliases, None, msg))
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
        out.add(versions_status(aliases),
                ServeChampion(aliases, champion, shadow=shadow_run.ShadowRun(
                    version, candidate, dict(w.verdict or {}), started, settings, started_for,
                    learned=None if w.learned is None else w.learned.target)))
        return True
    out.add(*shadow_verdict_steps(out.was, verdict, champion, version))
    if verdict["result"] == shadow_run.PROMOTE:
        return False
    out.add(versions_status(aliases), ServeChampion(aliases, None, f"v{version} was rejected by shadow scoring: "
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



def plan_canary(out: ReleaseSteps, champion: str, strategy: rollout_strategy.Strategy) -> bool:
    """A passed candidate whose strategy is Canary serves beside the champion before it is
    promoted (the serving plan runs its steps and tags its end on the candidate). True when the
    pass ends here (the canary runs, or was aborted); False for a promotion (no canary, or it
    passed)."""
    w = out.world
    version, aliases = w.version, w.aliases
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
        out.add(versions_status(aliases), ServeChampion(aliases, None, f"canary of v{version} aborted: {text}"))
        return True
    steps = canary_mod.steps_of({"rollout": w.rollout})
    if not out.was("CanaryStarted", version, version):
        out.add(Record("CanaryStarted", f"v{version} passed its gate and serves beside v{champion} in "
                       f"{len(steps)} canary step(s): " + "; ".join(s.describe() for s in steps),
                       champion, version, key=version))
    out.add(versions_status(aliases),
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
