"""How a gated candidate reaches the engine pods: Replace, Shadow or Canary (pure).

- **Replace**: the candidate is promoted and replaces every engine pod (a rolling update).
- **Shadow**: the champion keeps serving; its pods also carry the candidate's drafter and score it
  on a share of live requests (docs/shadow.md). Only a candidate that drafts for the champion's
  own target, on the same engine, can be scored this way: the scoring reads the target's logits.
- **Canary**: the candidate's pods serve beside the champion's, a growing share.

`spec.rollout.strategy.type` picks one; the user's explicit choice always wins. Left out, it is
chosen by what changed, riskiest first:
- the target (model and revision, which bring the tokenizer) or the engine (image, kind): Canary, on the CRD's
  default steps unless the spec gives steps (a new target changes every reply, so it earns live
  evidence on a small share before it takes everything; Argo Rollouts and Flagger do the same);
- only the draft side (the draft, `k`, dynamic k, tree width, n-gram lookup), where it can be
  shadowed: Shadow (the replies stay the champion's, only speed changes);
- anything else (parallelism, the serving speculation settings, a head of the other feature
  kind than the champion's, an MTP head): Replace.
With no champion serving there is nothing to compare against:
every strategy is a Replace then, and so it is for a candidate that serves exactly as the champion
does (a new release for its golden prompts alone).

Releases are the dicts `release.build_release` writes (as stored in the registry); keys the
serving never reads (pair, namespace, gating, mlflow, version) are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

REPLACE, SHADOW, CANARY = "Replace", "Shadow", "Canary"
STRATEGIES = (REPLACE, SHADOW, CANARY)

# Speculation settings that belong to the drafter: the shadow replays the candidate's rounds
# with them. The others (fallbackThreshold, batchSizeThreshold) change how the engine serves
# and are not replayed in shadow, so a candidate changing them is a Replace.
DRAFT_SIDE_SPECULATION = ("k", "dynamicK", "treeWidth", "lookupMinMatch")
# Release blocks that decide what the pods serve, apart from the draft and speculation.
SERVING_BLOCKS = ("target", "engine", "parallelism")
# Of those, the ones that change what the pair answers, not only how fast: a canary by default.
CANARY_BLOCKS = ("target", "engine")
# Drafting heads draft from the target's features of the committed tokens, which the engine also
# hands its shadow scorer (engine/specpair/shadow.py). One target step hands one kind: the last
# normed state (EAGLE, Medusa) or the inputs of the layers an EAGLE-3 head reads, so a head is
# scored in shadow only beside a champion that reads the same kind (or no features at all).
HEAD_FEATURES = {"eagle": "the last normed state", "medusa": "the last normed state",
                 "eagle3": "three layers' inputs"}
# Heads the specpair engine does not draft with (vLLM's MTP): never in shadow.
UNSHADOWED_METHODS = ("mtp",)


@dataclass(frozen=True)
class Strategy:
    """The strategy for one candidate, and why. `refused` says why the type the spec asks for
    cannot run for this candidate (the candidate is then neither promoted nor shadowed)."""

    type: str
    reason: str
    refused: str | None = None


def requested_type(spec: Mapping[str, Any]) -> str | None:
    """spec.rollout.strategy.type, or None when the pair leaves the choice to the operator."""
    strategy = ((spec.get("rollout") or {}).get("strategy") or {})
    return strategy.get("type") or None


def _speculation(release: Mapping[str, Any], draft_side: bool) -> dict[str, Any]:
    block = release.get("speculation") or {}
    return {key: value for key, value in block.items() if (key in DRAFT_SIDE_SPECULATION) == draft_side}


def draft_side_differs(champion: Mapping[str, Any], candidate: Mapping[str, Any]) -> bool:
    return ((champion.get("draft") or {}) != (candidate.get("draft") or {})
            or _speculation(champion, True) != _speculation(candidate, True))


def serving_side_differences(champion: Mapping[str, Any], candidate: Mapping[str, Any]) -> list[str]:
    """The release fields outside the draft side on which the two differ."""
    changed = [block for block in SERVING_BLOCKS if (champion.get(block) or {}) != (candidate.get(block) or {})]
    mine, theirs = _speculation(champion, False), _speculation(candidate, False)
    changed += [f"speculation.{key}" for key in sorted(set(mine) | set(theirs)) if mine.get(key) != theirs.get(key)]
    return changed


def canary_worthy(champion: Mapping[str, Any], candidate: Mapping[str, Any]) -> list[str]:
    """The changed release blocks that earn a canary by default (CANARY_BLOCKS), [] when none."""
    return [block for block in CANARY_BLOCKS if (champion.get(block) or {}) != (candidate.get(block) or {})]


def shadow_refusal(champion: Mapping[str, Any], candidate: Mapping[str, Any]) -> str | None:
    """Why the candidate cannot be scored in shadow on the champion's pods, or None when it can."""
    changed = serving_side_differences(champion, candidate)
    if changed:
        return f"the candidate differs from the champion beyond its draft side ({', '.join(changed)})"
    if str((candidate.get("engine") or {}).get("kind") or "specpair") != "specpair":
        return "shadow scoring runs in the specpair engine, not vLLM"
    draft = candidate.get("draft") or {}
    if not draft.get("drafter") and not draft.get("source"):
        return "the candidate has no draft to score"
    method = draft.get("method")
    if method in UNSHADOWED_METHODS:
        return f"a {method} head does not draft in the specpair engine"
    theirs = (champion.get("draft") or {}).get("method")
    if method in HEAD_FEATURES and theirs in HEAD_FEATURES \
            and HEAD_FEATURES[method] != HEAD_FEATURES[theirs]:
        return (f"a {method} head drafts from {HEAD_FEATURES[method]}, the champion's {theirs} "
                f"head from {HEAD_FEATURES[theirs]}: one target step hands one kind of features")
    return None


def choose_strategy(spec: Mapping[str, Any], champion_release: Mapping[str, Any] | None,
                    candidate_release: Mapping[str, Any]) -> Strategy:
    """The strategy for rolling `candidate_release` out over `champion_release` (None: nothing
    serves yet)."""
    asked = requested_type(spec)
    if champion_release is None:
        return Strategy(REPLACE, "no champion serves yet")
    if asked == REPLACE:
        return Strategy(REPLACE, "spec.rollout.strategy.type is Replace")
    if asked == CANARY:
        return Strategy(CANARY, "spec.rollout.strategy.type is Canary")
    if not draft_side_differs(champion_release, candidate_release) and \
            not serving_side_differences(champion_release, candidate_release):
        return Strategy(REPLACE, "the candidate serves exactly as the champion does: nothing to score")
    refusal = shadow_refusal(champion_release, candidate_release)
    if asked == SHADOW:
        if refusal:
            return Strategy(SHADOW, "spec.rollout.strategy.type is Shadow", refused=refusal)
        return Strategy(SHADOW, "spec.rollout.strategy.type is Shadow")
    risky = canary_worthy(champion_release, candidate_release)
    if risky:
        return Strategy(CANARY, f"chosen automatically: the candidate changes {', '.join(risky)}, which changes "
                                f"what the pair answers")
    if refusal:
        return Strategy(REPLACE, f"chosen automatically: {refusal}")
    return Strategy(SHADOW, "chosen automatically: only the draft side differs from the champion")


# -- speculation switched on a vLLM pair: a rollout of the same release ---------------------------

@dataclass(frozen=True)
class SpeculationRoll:
    """How a vLLM pair's engine Deployment rolls when the drift ladder switches speculation (vLLM
    cannot switch it at run time: the pods are replaced by ones started with or without it), and
    what that leaves serving. `least_ready`: the fewest ready pods at any moment of the roll."""

    max_surge: int
    max_unavailable: int
    replicas: int
    least_ready: int
    gpu: bool = False

    @property
    def unserved(self) -> bool:
        return self.least_ready < 1

    def describe(self, version: str, enabled: bool) -> str:
        what = (f"speculation {'on' if enabled else 'off'} for vLLM pair v{version} is a new rollout of the same "
                f"release with speculation {'enabled' if enabled else 'disabled'} (vLLM cannot switch it at run time)")
        if self.max_unavailable == 0:
            said = (f"{what}: each new pod starts beside the old ones (maxSurge {self.max_surge}, maxUnavailable 0), "
                    f"so all {self.replicas} keep serving until it is ready")
            if self.gpu:
                # One replica on GPUs: the surge is taken anyway (engine_objects.rollout_strategy).
                said += ("; its pods hold GPUs and it has one replica, so it surges rather than go unserved: the new "
                         "pod needs a free device and waits Pending until one is, while the old pod serves on as it "
                         "was")
            return said
        how = (f"its pods hold GPUs, and a GPU pool rarely has a spare device, so an old pod goes before its "
               f"successor starts (maxSurge {self.max_surge}, maxUnavailable {self.max_unavailable})")
        if self.unserved:
            return (f"{what}: {how}: the pair has no ready pod until the new one is ready; rollout.replicas >= "
                    f"{self.max_unavailable + 1} keeps one serving through the switch")
        return f"{what}: {how}: at least {self.least_ready} of {self.replicas} pods serve throughout"


def speculation_roll(strategy: Mapping[str, Any], replicas: int, gpu: bool = False) -> SpeculationRoll:
    """The roll a Deployment `strategy` (engine_objects.rollout_strategy: its one home) gives `replicas`
    pods (`gpu`: they hold accelerators)."""
    rolling = strategy.get("rollingUpdate") or {}
    surge, unavailable = int(rolling.get("maxSurge", 0)), int(rolling.get("maxUnavailable", 0))
    return SpeculationRoll(surge, unavailable, replicas, max(replicas - unavailable, 0), gpu)
