"""A learned draft takes the usual road (issue 58): gated, scored in shadow on its category, promoted
on evidence, speculation back on; pure.

A training Job (plan/learning.py) registers a version that changes only the draft side of the
champion, tagged with its lineage (`specpair.lineage.release`, `.category`) and named in
status.training.runs (phase done, `candidate`). Such a version is a release like any other (its
`specpair.release` tag is its release contract, whose target side equals the champion's), so the
release plan (plan/release_plan.py) drives it, in place of the spec's release, while the spec's
release serves (itself, or through drafts learned from it):

- **gated** by the same gate Job as any release, on that version's contract (the `candidate`
  alias points at it meanwhile); a failed or broken gate ends the try;
- **scored in shadow** on the champion's pods whatever spec.rollout.strategy says, judged on the
  category it was trained for against a fixed reference, max(the category's floor, the drifted
  release's live acceptance there when training was wanted + a gain, shadow_verdict.LEARNED_GAIN:
  matching the release that drifted is not learning) (shadow_verdict.judge_learned: the
  champion usually serves that category target-only, so its own side of the shadow is empty);
- **promoted** on a Promote verdict as any shadowed candidate is (the aliases move; the serving
  plan swaps the draft into the running pods, or rolls them where it cannot); the new champion's
  drift ladder starts from its first step, so speculation is on again for the category;
- a try that ends otherwise (gate failed or broken, shadow refused or rejected, rolled back
  later) leaves the champion serving as it was; the spec's release is driven again.

Level-triggered and crash-safe: which version a pass drives is `driven_release`, a function of
the aliases, the versions' tags and the status (the records a try ends with are the history
entries the usual road writes, keyed by version, so a pass killed after any write redoes the
rest and records each once). Each try's stage is `status.learnedRelease`, the `Learning`
condition and, once, LearnedDraftPromoted or LearnedDraftRejected in history with its Event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from specpair_operator.desired import training_job
from specpair_operator.gate import verdict as gate_verdict
from specpair_operator.observe.world import ReleaseWorld
from specpair_operator.plan.learning import LEARNING
from specpair_operator.plan.release_steps import Condition, Record, ServeChampion, SetAlias, SetStatus
from specpair_operator.policy import shadow_run
from specpair_operator.policy.shadow_verdict import LearnedTarget
from specpair_operator.release import aliases as aliases_mod
from specpair_operator.release.registry_contract import (TAG_LINEAGE_CATEGORY, TAG_LINEAGE_RELEASE, TAG_ROLLED_BACK,
                                                         release_of_tags)

if TYPE_CHECKING:
    from specpair_operator.plan.steps import Step   # the union of every plan's steps

LINEAGE_DEPTH = 32             # drafts learned from drafts: how far back a champion's lineage is followed
# The usual road's records that end a try (each keyed by the version, as the release plan writes them).
ENDED = ("GateFailed", gate_verdict.GATE_ERROR, "ShadowRefused", "ShadowRejected", "CanaryAborted")
GATING, SHADOW, PROMOTED, REJECTED = "gating", "shadow", "promoted", "rejected"
STATUS_FIELD = "learnedRelease"
PROMOTED_RECORD, REJECTED_RECORD = "LearnedDraftPromoted", "LearnedDraftRejected"


@dataclass(frozen=True)
class LearnedCandidate:
    """A version a training Job registered: what it was trained for and must show."""
    version: str
    parent: str                   # the release whose draft was retrained
    category: str
    target: LearnedTarget
    job: str = ""                 # the training Job that made it


@dataclass(frozen=True)
class Drive:
    """The version this pass's release plan drives, with its learned facts when it is one."""
    version: str
    learned: LearnedCandidate | None = None


def lineage(tags_of: Callable[[str], Mapping[str, str]], version: str) -> list[str]:
    """`version` and the releases its draft was learned from, newest first."""
    chain = [str(version)]
    while len(chain) < LINEAGE_DEPTH:
        parent = str(tags_of(chain[-1]).get(TAG_LINEAGE_RELEASE) or "")
        if not parent or parent in chain:
            break
        chain.append(parent)
    return chain


def floor_of(thresholds: Mapping[str, Any], category: str) -> float:
    """The release's acceptance floor for `category` (its own, else the overall one)."""
    cats = thresholds.get("minCategoryAcceptance") or {}
    value = cats.get(category, thresholds.get("minAcceptance", 0.0))
    return float(value or 0.0)


def ended(was: Callable[[str, str, str], bool], version: str, tags: Mapping[str, str]) -> str:
    """The record that ended a try of `version` ('' while it goes on); a rolled-back one ended too."""
    for action in ENDED:
        if was(action, version, version):
            return action
    return "RolledBack" if tags.get(TAG_ROLLED_BACK) else ""


def _learned(run: Mapping[str, Any], version: str, parent: str, tags: Mapping[str, str]) -> LearnedCandidate | None:
    release = release_of_tags(tags)
    if release is None:
        return None
    category = str(tags.get(TAG_LINEAGE_CATEGORY) or run.get("category") or "")
    thresholds = (release.get("gating") or {}).get("thresholds") or {}
    drifted = run.get("acceptance")
    target = LearnedTarget(category, floor_of(thresholds, category),
                           float(drifted) if isinstance(drifted, (int, float)) and not isinstance(drifted, bool)
                           else 0.0)
    return LearnedCandidate(str(version), str(parent), category, target, str(run.get("job") or ""))


def driven_release(spec_version: str, aliases: Mapping[str, str], tags_of: Callable[[str], Mapping[str, str]],
                   status: Mapping[str, Any], was: Callable[[str, str, str], bool]) -> Drive:
    """Which version the release plan drives this pass (module docstring):
    - the spec's release, unless it serves (as champion, or through drafts learned from it);
    - while it serves: the newest learned version of the champion whose try has not ended;
    - else the champion (a learned champion keeps its learned facts for the status)."""
    champion = aliases.get(aliases_mod.CHAMPION)
    if not champion:
        return Drive(spec_version)
    chain = lineage(tags_of, champion)
    if str(spec_version) not in chain:
        return Drive(spec_version)     # a changed spec: its release goes the usual road
    runs = training_job.recorded_runs(status)
    for run in reversed(runs):
        candidate = str(run.get("candidate") or "")
        if str(run["version"]) != champion or run.get("phase") != training_job.DONE or not candidate \
                or candidate == champion or was(REJECTED_RECORD, candidate, candidate):
            continue    # (an ended try said so: its tags are not read again on every pass)
        tags = tags_of(candidate)
        if str(tags.get(TAG_LINEAGE_RELEASE) or "") != champion:
            continue
        # An ended try not said yet (ended in the serving plan of a pass: a shadow's rejection) is
        # driven once more, which serves the champion as it was and records the end.
        learned = _learned(run, candidate, champion, tags)
        if learned is not None:
            return Drive(candidate, learned)
    if champion == str(spec_version):
        return Drive(champion)
    # A learned champion: its facts from the training that made it, while the status keeps it.
    parent = chain[1]
    run = next((r for r in reversed(runs) if str(r.get("candidate") or "") == champion
                and str(r["version"]) == parent), {})
    return Drive(champion, _learned(run, champion, parent, tags_of(champion)))


def _recorded(world: ReleaseWorld, steps: list[Step], action: str, version: str) -> Record | None:
    """This pass's record of `action` for `version`, if it makes one."""
    return next((s for s in steps if isinstance(s, Record) and s.action == action and s.key == version), None)


def _was(world: ReleaseWorld, steps: list[Step], action: str, version: str) -> bool:
    return world.records.was(action, version, version) or _recorded(world, steps, action, version) is not None


def stage_of(world: ReleaseWorld, steps: list[Step]) -> tuple[str, str]:
    """(stage, the action that put it there) of the learned version `world.version`, from what the
    status recorded and this pass's steps."""
    version = world.version

    def was(action: str, key: str, _v: str) -> bool:
        return _was(world, steps, action, key)
    end = ended(was, version, world.tags)
    if end:
        return REJECTED, end
    moved = any(isinstance(s, SetAlias) and s.alias == aliases_mod.CHAMPION and s.version == version for s in steps)
    if moved or world.aliases.get(aliases_mod.CHAMPION) == version:
        return PROMOTED, "Promoted"
    for action in ("ShadowPromoted", "ShadowStarted"):
        if _was(world, steps, action, version):
            return SHADOW, action
    return GATING, "GatePassed" if _was(world, steps, "GatePassed", version) else "GateStarted"


def _why(world: ReleaseWorld, steps: list[Step], action: str) -> str:
    """The reason of the record `action` of this pass or of the status's history."""
    made = _recorded(world, steps, action, world.version)
    if made is not None:
        return made.reason
    # Else from where the end is kept for good (history keeps only the last entries).
    if action == "RolledBack":
        return str(world.tags.get(TAG_ROLLED_BACK) or "")
    if action == "ShadowRejected":
        verdict = shadow_run.read_verdict(world.tags)
        if verdict is not None:
            return shadow_run.describe(world.version, verdict)
    if action in ("GateFailed", gate_verdict.GATE_ERROR):
        outcome = gate_verdict.evaluate_verdict(dict(world.verdict or {}), dict(world.thresholds))
        return world.gate_message if action == gate_verdict.GATE_ERROR and world.gate_message else outcome.message
    entry = next((h for h in reversed(world.records.history) if h.get("action") == action
                  and str(h.get("toVersion")) == world.version), None)
    return str((entry or {}).get("reason") or "")


def learned_steps(world: ReleaseWorld, planned: tuple[Step, ...]) -> tuple[Step, ...]:
    """The release plan's steps for a learned version (`world.learned`) with the loop's own:
    status.learnedRelease, the Learning condition, and LearnedDraftPromoted or
    LearnedDraftRejected once; placed before the champion's serving, which may say more."""
    learned: LearnedCandidate | None = world.learned
    if learned is None:
        return planned
    steps = list(planned)
    stage, action = stage_of(world, steps)
    what = (f"v{learned.version} (a draft trained for category '{learned.category}' of v{learned.parent}, "
            f"reference acceptance {learned.target.reference:.3f})")
    why = _why(world, steps, action)
    mine: list[Step] = []
    key = learned.version
    if stage == REJECTED:
        ended_how = "was rolled back" if action == "RolledBack" else "was not promoted"
        message = f"{what} {ended_how} ({action}: {why}); v{learned.parent} keeps serving as it was"
        mine.append(Condition(LEARNING, False, REJECTED_RECORD, message))
        if not world.records.was(REJECTED_RECORD, key, key):
            mine.append(Record(REJECTED_RECORD, message, learned.parent, learned.version, warning=True,
                               key=key))
    elif stage == PROMOTED:
        message = (f"{what} is champion; speculation is on again for '{learned.category}' (its drift ladder starts "
                   f"over)")
        mine.append(Condition(LEARNING, True, PROMOTED_RECORD, message))
        if not world.records.was(PROMOTED_RECORD, key, key):
            mine.append(Record(PROMOTED_RECORD, message, learned.parent, learned.version, key=key))
    elif stage == SHADOW:
        message = f"{what} passed its gate and is scored in shadow on '{learned.category}'"
        mine.append(Condition(LEARNING, True, "LearnedDraftShadow", message))
    else:
        message = f"{what} is being gated"
        mine.append(Condition(LEARNING, True, "LearnedDraftGating", message))
    mine.append(SetStatus({STATUS_FIELD: {
        "version": learned.version, "parent": learned.parent, "category": learned.category, "stage": stage,
        "reference": round(learned.target.reference, 4), "floor": learned.target.floor,
        "driftedAcceptance": learned.target.drifted, "gain": learned.target.gain, "job": learned.job,
        "message": message[:1500]}}))
    at = next((i for i, s in enumerate(steps) if isinstance(s, ServeChampion)), len(steps))
    return tuple(steps[:at] + mine + steps[at:])


def learned_baselines(baseline: Mapping[str, float], previous: Mapping[str, float] | None,
                      champion_tags: Mapping[str, str], previous_version: str | None
                      ) -> tuple[dict[str, float], dict[str, float] | None]:
    """The drift ladder's baselines for a champion promoted as a learned draft. Its category's gated
    figure comes from the golden prompts, whose text the drifted traffic left: judged against it,
    a draft that beat its reference on the live traffic would drift at once, and rolling back to
    its parent would look like it helps (the parent's golden figure is high too, though the parent
    drifted on this very traffic). So on that category the champion is held to the reference it
    was promoted on (when lower than its gated figure), and its parent, as the previous release,
    to what it did live there when it drifted."""
    base, prev = dict(baseline), None if previous is None else dict(previous)
    verdict = shadow_run.read_verdict(champion_tags)
    learned = (verdict or {}).get("learned") if (verdict or {}).get("result") == shadow_run.PROMOTE else None
    if not isinstance(learned, Mapping) or not learned.get("category"):
        return base, prev
    category = str(learned["category"])
    reference, drifted = learned.get("reference"), learned.get("driftedAcceptance")
    if isinstance(reference, (int, float)):
        base[category] = min(float(base.get(category, reference)), float(reference))
    parent = str(champion_tags.get(TAG_LINEAGE_RELEASE) or "")
    if prev is not None and parent and parent == str(previous_version or "") and category in prev \
            and isinstance(drifted, (int, float)):
        prev[category] = min(prev[category], float(drifted))
    return base, prev
