"""A gated candidate scored in shadow on the champion's engine pods: its settings, the marks it
leaves in MLflow, and the verdict from what the pods report (pure; docs/shadow.md).

The run, from the operator's side:

1. The candidate passes its gate and its strategy is Shadow (rollout_strategy.py): it is not
   promoted. The champion's Deployment is rendered with the candidate's release file beside its
   own and `--shadow-release`/`--shadow-share` (manifests.engine_deployment); whenever that
   rolls the pods (the first time, or after the spec left the candidate and came back), its
   version is tagged `specpair.shadow.started_at` first: the evidence starts over, and so does
   the clock of `maxSeconds`. The mark names the roll it was made for (the pod template, and
   the Deployment's generation before it), so a pass that dies right after it is followed by
   one that rolls the pods, not by another mark; a later roll to the same template (the spec
   left the candidate and came back) finds the generation moved on, and marks again.
2. Each pass reads GetStats.shadow of the champion's verified pods (the probe's plain dict,
   engine_probe.shadow_stats), sums the pods that score this very candidate (its content hash)
   and judges it with shadow_verdict.judge_shadow against the champion's gated categories.
3. Promote or Rejected (Undecided past `maxSeconds` is Rejected): the verdict with its numbers
   is tagged `specpair.shadow.verdict` on the candidate first; the next pass promotes it as a
   gate pass is promoted (the aliases move, the engine rolls to it), or leaves it out of service
   and renders the champion without the shadow.

The evidence is cumulative since each pod started, and the pods start with the shadow, so it is
the evidence since the shadow started; a pod that restarts loses its share (the verdict waits
longer, never the other way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from specpair.stats import PairedSums, RequestMoments

from specpair_operator.crd import conditions as c
from specpair_operator.release.registry_contract import TAG_SHADOW_VERDICT
from specpair_operator.policy.shadow_verdict import (PROMOTE, REJECTED, UNDECIDED, LearnedTarget, ShadowEvidence,
                                                     ShadowPolicy, ShadowVerdict, judge_learned, judge_shadow)

# On the candidate's model version (crash marks: each written before what it stands for).
TAG_SHADOW_STARTED = "specpair.shadow.started_at"
SHADOW_SCORED = c.SHADOW_SCORED   # the condition


@dataclass(frozen=True)
class ShadowSettings:
    """spec.rollout.shadow with the CRD's defaults (validation.shadow_defaults, their one home)."""
    share: float
    min_requests: int
    max_seconds: float

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "ShadowSettings":
        from specpair_operator.crd.validation import shadow_defaults

        given = {**shadow_defaults(), **(((spec.get("rollout") or {}).get("shadow")) or {})}
        return cls(float(given["share"]), int(given["minRequests"]), float(given["maxSeconds"]))

    def policy(self) -> ShadowPolicy:
        return ShadowPolicy(min_requests=self.min_requests)


@dataclass(frozen=True)
class ShadowRun:
    """A candidate being scored: its version, its release and gate verdict as MLflow holds them
    (serving_plan.shadow_release makes the file the champion's pods get, tuned as it would
    serve), when its shadow started, and the pair's settings."""
    version: str
    release: Mapping[str, Any]
    verdict: Mapping[str, Any]
    started_at: str               # '' until the champion's pods first roll to carry it
    settings: ShadowSettings
    started_for: str = ""         # the roll the start was marked for (rolled_to; '' if unknown)
    # A draft trained for one drifted category (issue 58): judged there against a fixed reference
    # (shadow_verdict.judge_learned) instead of against the champion's drafts.
    learned: LearnedTarget | None = None


@dataclass(frozen=True)
class ShadowJudgement:
    result: str                   # Promote, Rejected, Undecided
    reason: str
    verdict: ShadowVerdict
    pods: int                     # pods whose counters scored this candidate
    elapsed: float                # seconds since the shadow started
    cost: float | None            # the candidate's draft seconds per committed token


def rolled_to(template: str, live: Mapping[str, Any] | None) -> str:
    """A roll of the champion's pods to carry the candidate: the pod template's fingerprint and
    the generation of the Deployment it rolls from."""
    return f"{template}@{((live or {}).get('metadata') or {}).get('generation', 0)}"


def started_mark(at: str, roll: str) -> str:
    """The TAG_SHADOW_STARTED value: when, and for which roll (rolled_to)."""
    return f"{at} {roll}"


def read_started(tags: Mapping[str, str]) -> tuple[str, str]:
    """(when the shadow started, the roll it was marked for) from the candidate's tags; a mark
    without its roll (or none) gives ''."""
    at, _, roll = (tags.get(TAG_SHADOW_STARTED) or "").partition(" ")
    return at, roll


def moments(d: Mapping[str, Any]) -> RequestMoments:
    """An AlphaSums in the probe's plain dict as RequestMoments (positions as drafted, Σ alpha as
    accepted; shadow_verdict.alpha_moments reads the message the same way)."""
    return RequestMoments(int(d.get("positions", 0)), float(d.get("alpha", 0.0)), int(d.get("requests", 0)),
                          float(d.get("positionsSq", 0.0)), float(d.get("alphaSq", 0.0)),
                          float(d.get("positionsAlpha", 0.0)))


def paired(d: Mapping[str, Any] | None) -> PairedSums | None:
    if d is None:
        return None
    return PairedSums(int(d.get("requests", 0)), float(d.get("acceptedBoth", 0.0)), float(d.get("acceptedDrafted", 0.0)),
                      float(d.get("draftedAccepted", 0.0)), float(d.get("draftedBoth", 0.0)))


def evidence(pod_stats: Iterable[Mapping[str, Any] | None], digest: str) -> tuple[dict[str, ShadowEvidence], int, float, int]:
    """Per category, the evidence of the pods scoring the candidate with content hash `digest`
    (GetStats in the probe's plain dict), summed; and how many pods, draft seconds and committed
    tokens that is."""
    out: dict[str, ShadowEvidence] = {}
    pods, seconds, tokens = 0, 0.0, 0
    for stats in pod_stats:
        shadow = (stats or {}).get("shadow") or {}
        if not shadow or shadow.get("candidateHash") != digest:
            continue
        pods += 1
        for cat, v in (shadow.get("categories") or {}).items():
            one = ShadowEvidence(moments(v.get("candidateAlpha") or {}), moments(v.get("championAlpha") or {}),
                                 paired(v.get("alphaPaired")))
            out[cat] = out[cat] + one if cat in out else one
            seconds += float(v.get("draftSeconds", 0.0))
            tokens += int(v.get("committedTokens", 0))
    return out, pods, seconds, tokens


def judge(run: ShadowRun, digest: str, pod_stats: Iterable[Mapping[str, Any] | None], gated: Iterable[str],
          now: str) -> ShadowJudgement:
    """The candidate's verdict on the evidence so far of the pods scoring its release file (content
    hash `digest`), judged in the champion's `gated` categories; Undecided past `maxSeconds` is
    Rejected."""
    found, pods, seconds, tokens = evidence(pod_stats, digest)
    verdict = judge_shadow(found, gated, (), run.settings.policy()) if run.learned is None else \
        judge_learned(found, gated, run.learned, run.settings.policy())
    elapsed = max(0.0, (c.parse_iso(now) - c.parse_iso(run.started_at or now)).total_seconds())
    result, reason = verdict.result, verdict.reason
    if result == UNDECIDED and elapsed >= run.settings.max_seconds:
        result, reason = REJECTED, (f"still undecided {elapsed:.0f} s after its shadow started "
                                    f"(rollout.shadow.maxSeconds {run.settings.max_seconds:g}): {verdict.reason}")
    return ShadowJudgement(result, reason, verdict, pods, elapsed, seconds / tokens if tokens else None)


def numbers(j: ShadowJudgement) -> dict[str, Any]:
    """The judgement's numbers as status.shadow and the verdict tag carry them: per category the
    candidate's and the champion's alpha, the bounds of their difference, the requests, what it
    says."""
    cats = {cmp.category: {"candidateAlpha": round(cmp.candidate, 4), "championAlpha": round(cmp.champion, 4),
                           "lower": round(cmp.lower, 4), "upper": round(cmp.upper, 4), "requests": cmp.requests,
                           "status": cmp.status}
            for cmp in j.verdict.comparisons}
    return {"categories": cats, "trafficShift": list(j.verdict.shift), "pods": j.pods,
            "elapsedSeconds": round(j.elapsed, 1),
            "draftSecondsPerToken": None if j.cost is None else round(j.cost, 6)}


def verdict_tag(verdict: Mapping[str, Any]) -> str:
    """The TAG_SHADOW_VERDICT value: the result, its reason and numbers (MLflow tags hold 5000
    characters: a long reason is cut)."""
    text = json.dumps(dict(verdict), sort_keys=True, separators=(",", ":"))
    if len(text) > 4900:
        text = json.dumps({**verdict, "reason": str(verdict.get("reason", ""))[:500]}, sort_keys=True,
                          separators=(",", ":"))
    return text


def describe(version: str, verdict: Mapping[str, Any]) -> str:
    """A verdict (as tagged) in words, with its numbers per category."""
    parts = [f"v{version} scored in shadow: {verdict.get('result')}: {verdict.get('reason', '')}"]
    for cat, n in sorted((verdict.get("categories") or {}).items()):
        name = "gated traffic pooled" if cat == "*" else cat
        parts.append(f"{name}: candidate {n.get('candidateAlpha')} vs champion {n.get('championAlpha')} over "
                     f"{n.get('requests')} requests, difference in [{n.get('lower'):+}, {n.get('upper'):+}] "
                     f"({n.get('status')})" if n.get("status") != "short" else
                     f"{name}: {n.get('requests')} shadowed requests, too few to judge")
    return "; ".join(parts)


def read_verdict(tags: Mapping[str, str]) -> dict[str, Any] | None:
    """The verdict a pass tagged on the candidate (None: none yet, or not one the operator wrote)."""
    try:
        verdict = json.loads(tags.get(TAG_SHADOW_VERDICT) or "null")
    except ValueError:
        return None
    if not isinstance(verdict, dict) or verdict.get("result") not in (PROMOTE, REJECTED):
        return None
    return verdict


__all__ = ["TAG_SHADOW_STARTED", "TAG_SHADOW_VERDICT", "SHADOW_SCORED", "ShadowSettings", "ShadowRun",
           "ShadowJudgement", "rolled_to", "started_mark", "read_started", "evidence", "judge", "numbers", "verdict_tag", "read_verdict", "describe",
           "PROMOTE", "REJECTED", "UNDECIDED"]
