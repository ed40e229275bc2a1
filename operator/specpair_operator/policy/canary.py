"""Canary: a gated candidate's engine pods serve beside the champion's, behind the same Service,
and are judged against them on live traffic before the candidate is promoted. Pure.

`spec.rollout.strategy: {type: Canary, steps: [{replicas: N | share: S, pauseSeconds: P}, ...]}`.

Pods
    The candidate's pods are a second Deployment (`<engine>-canary`, `canary_deployment`): the
    champion's manifest rendered for the candidate's release, its pods labelled
    `specpair.io/track: canary`, so they carry the Service's selector (traffic reaches them) and
    are told apart from the champion's everywhere else. The champion keeps its replicas; a step
    gives the candidate `replicas`, or `share` of the champion's (at least one, rounded up): the
    candidate's share of the traffic is then its pods over all pods, as Argo Rollouts' setWeight
    is without a traffic router.

Evidence (the request is the unit)
    At every pass of a step, each side's pods' cumulative GetStats counters are differenced per
    pod (drift.counter_deltas: a restart starts a pod's series afresh) and summed since the step
    began: per category, TTFT and TPOT histograms and requests by status (serving_health), and
    acceptance sums (RequestMoments). The evidence is the operator's memory: a restart costs only
    what was gathered so far (the step's clock starts again with it).

Judging, candidate against champion over the same stretch of time
    - errors, per category and pooled: serving_health.judge_errors with the limit raised to the
      champion's own error rate where that is higher (the candidate must not fail more than
      `drift.latency.maxErrorRate` nor than the champion does);
    - TTFT and TPOT, per category and pooled: the champion's p95 of the stretch is the baseline
      (serving_health.Baseline.measure), and serving_health.judge_latency asks whether more than
      5% of the candidate's requests are slower than `ratio` x that p95 (Wilson bound);
    - acceptance, per category and pooled: shadow_verdict.compare on the two independent
      samples (drift's request-level standard errors); worse when the difference's upper bound
      is below -(champion x drift.tolerance + drift.noiseAllowance), the drift floor's margin.
    A breach (or worse acceptance) aborts at once. A step passes once its pause is over and the
    pooled error rate, TTFT and TPOT are each judged fine (enough requests on both sides), with
    nothing inconclusive; a short acceptance sample (speculation off, nothing drafted) does not
    hold it. A step not shown healthy `rollout.progressDeadlineSeconds` after its pause aborts.

Actions (plan/serving_canary.py wires them; the crash marks live there and in plan/release_plan.py)
    Advance: the canary Deployment to the next step's replicas (the step is also its annotation
    `specpair.io/canary-step`, so a pass that dies after the patch does not scale it back).
    Promote: the candidate's version is tagged `specpair.canary: passed: ...`; the release pass
    then promotes it as any gated release (aliases, Promoted) and the engine Deployment rolls to
    it while the canary pods keep serving; once it is available the canary is scaled to zero.
    Abort: the tag `specpair.canary: aborted: ...` first (the candidate is never promoted; a pass
    that dies after it finishes the abort), then the canary scaled to zero; the champion is
    untouched.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from specpair.stats import RequestMoments

from specpair_operator.policy import drift as drift_mod
from specpair_operator.policy import serving_health as health
from specpair_operator.policy.drift import BREACH, FINE, INCONCLUSIVE, NO_EVIDENCE, OVERALL
from specpair_operator.desired.manifests import LABEL_VERSION
from specpair_operator.desired.routes import CANARY_TRACK, TRACK_LABEL
from specpair_operator.policy.shadow_verdict import (BETTER, NOT_WORSE, SHORT, WORSE, ShadowEvidence, ShadowPolicy,
                                                     compare)

TAG_CANARY = "specpair.canary"              # on the candidate's version: "passed: ..." or "aborted: ..."
PASSED, ABORTED = "passed", "aborted"
ANN_STEP = "specpair.io/canary-step"        # on the canary Deployment: the step it was scaled for
CONDITION = "Canary"
ACCEPTANCE = "acceptance"
ABORT, ADVANCE, PROMOTE, WAIT = "Abort", "Advance", "Promote", "Wait"


# -- the spec ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    replicas: int | None = None
    share: float | None = None
    pause_seconds: float = 0.0
    weight: int | None = None      # the candidate's percent of the traffic (1-100)

    def candidate_replicas(self, champion_replicas: int, routed: bool = False) -> int:
        """The candidate's pods in this step. A weight through a gateway (`routed`) needs pods for
        weight% of the champion's load; without one, pods for that replica ratio, at most the
        champion's own count (the ratio cannot pass 50% while the champion keeps its pods)."""
        champion = max(champion_replicas, 1)
        if self.replicas is not None:
            return int(self.replicas)
        if self.weight is not None:
            w = min(max(int(self.weight), 1), 100)
            if routed:
                return max(1, math.ceil(w / 100 * champion - 1e-9))
            return champion if w >= 50 else max(1, min(champion, math.ceil(w * champion / (100 - w) - 1e-9)))
        return max(1, math.ceil(float(self.share or 0.0) * champion - 1e-9))

    def candidate_weight(self, champion_replicas: int) -> int:
        """The route's candidate weight (percent) for this step: its weight, or the replica ratio
        its replicas or share give."""
        if self.weight is not None:
            return min(max(int(self.weight), 1), 100)
        return round(100 * traffic_share(self.candidate_replicas(champion_replicas), champion_replicas))

    def describe(self) -> str:
        what = (f"weight {self.weight}%" if self.weight is not None else
                f"{self.replicas} replica(s)" if self.replicas is not None else f"share {self.share:g}")
        return f"{what}, pause {self.pause_seconds:g}s"


def steps_of(spec: Mapping[str, Any]) -> tuple[Step, ...]:
    """spec.rollout.strategy.steps, or the CRD's default steps when it gives none (pauseSeconds'
    default, the steps' default: the CRD's, their one home)."""
    from specpair_operator.crd.validation import canary_default_steps, canary_step_defaults

    defaults = canary_step_defaults()
    out = []
    for s in ((spec.get("rollout") or {}).get("strategy") or {}).get("steps") or canary_default_steps():
        s = {**defaults, **s}
        out.append(Step(int(s["replicas"]) if "replicas" in s else None,
                        float(s["share"]) if "share" in s else None, float(s["pauseSeconds"]),
                        int(s["weight"]) if "weight" in s else None))
    return tuple(out)


def traffic_share(candidate: int, champion: int) -> float:
    return candidate / (candidate + champion) if candidate + champion else 0.0


_ENTRY = "\nstatus.canary: "   # in the mark, before the status entry it carries


def mark(tags: Mapping[str, str]) -> tuple[str | None, str]:
    """The candidate's canary mark: (PASSED or ABORTED, its text) or (None, '')."""
    text = (tags.get(TAG_CANARY) or "").split(_ENTRY, 1)[0]
    for state in (PASSED, ABORTED):
        if text.startswith(state + ":"):
            return state, text[len(state) + 1:].strip()
    return None, ""


def mark_tag(state: str, reason: str, entry: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The mark, with the status.canary entry of the pass that decided (its numbers; the message is
    the mark's own text): one tag, one write, so a pass killed right after it leaves the numbers
    for the next pass to report."""
    text = f"{state}: {reason}"[:2000]
    if entry:
        carried = json.dumps({k: v for k, v in entry.items() if k != "message"}, sort_keys=True,
                             separators=(",", ":"))
        if len(text) + len(carried) < 4800:
            text += _ENTRY + carried
    return {TAG_CANARY: text}


def marked_entry(tags: Mapping[str, str], version: str) -> dict[str, Any] | None:
    """The status.canary entry the mark carries (mark_tag), its message the mark's; None when it
    carries none."""
    state, reason = mark(tags)
    _, found, carried = (tags.get(TAG_CANARY) or "").partition(_ENTRY)
    try:
        entry = json.loads(carried) if found else None
    except ValueError:
        return None
    if not isinstance(entry, dict):
        return None
    return {**entry, "message": f"canary of v{version} {'passed' if state == PASSED else 'aborted'}: {reason}"[:2000]}


# -- evidence -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PodReport:
    """One ready pod's counters: serving health and acceptance, keyed by name/uid."""
    serving: health.PodServing
    acceptance: drift_mod.PodStats

    @classmethod
    def from_stats(cls, pod: str, stats: Mapping[str, Any], wall: float) -> "PodReport":
        uptime = stats.get("uptimeSeconds")
        started = wall - float(uptime) if uptime else None
        return cls(health.serving_pod(pod, stats, started),
                   drift_mod.PodStats(pod, {cat: RequestMoments.from_stats(v)
                                            for cat, v in (stats.get("categories") or {}).items()}, started))


@dataclass(frozen=True)
class Side:
    """One side's evidence since the step began."""
    serving: Mapping[str, health.ServingCounts] = field(default_factory=dict)
    acceptance: Mapping[str, RequestMoments] = field(default_factory=dict)
    pod_seconds: float = 0.0

    def add(self, serving: Mapping[str, health.ServingCounts], acceptance: Mapping[str, RequestMoments],
            pod_seconds: float) -> "Side":
        s, a = dict(self.serving), dict(self.acceptance)
        for cat, d in serving.items():
            s[cat] = s[cat] + d if cat in s else d
        for cat, d in acceptance.items():
            a[cat] = a[cat] + d if cat in a else d
        return Side(s, a, self.pod_seconds + pod_seconds)

    @property
    def finished(self) -> int:
        return health.pooled(self.serving).finished


@dataclass(frozen=True)
class Memory:
    """In process, per pair: the evidence of the canary step under way."""
    version: str = ""
    step: int = -1
    since: float | None = None                 # wall time the step's evidence began
    at: float | None = None
    serving_pods: Mapping[str, health.PodServing] = field(default_factory=dict)
    acceptance_pods: Mapping[str, drift_mod.PodStats] = field(default_factory=dict)
    champion: Side = field(default_factory=Side)
    candidate: Side = field(default_factory=Side)
    carried: int = 0      # of the champion's requests, those of the step before (a routed 100% step)

    def for_step(self, version: str, step: int) -> "Memory":
        return self if (self.version, self.step) == (str(version), step) else Memory(str(version), step)


# A pod's first requests are not judged: a new pod's first answers pay for what it does once
# (lazy loads, first allocations, caches filling), which a warm champion paid long ago. Seen in
# CI: a candidate of the champion's very weights aborted on TTFT p95 122 ms against 8.6 ms.
WARM_UP_REQUESTS = 3


def warm(report: PodReport) -> bool:
    """The pod has finished its first WARM_UP_REQUESTS requests."""
    return health.pooled(report.serving.categories).finished >= WARM_UP_REQUESTS


def observe(memory: Memory, now: float, champion: list[PodReport], candidate: list[PodReport]) -> Memory:
    """Both sides' counters of this pass added to the step's evidence. The step's evidence starts
    at the first pass that finds every candidate pod warm (`warm`), for both sides at once (the
    same stretch of time; the step's clock starts at its first pass). A pod counts from the first
    pass that finds it warm: what it reports then is its baseline, whenever its process started,
    so no warm-up request is judged."""
    if not all(warm(p) for p in candidate):
        # The step's clock runs all the same: a candidate that never warms (no traffic) meets
        # rollout.progressDeadlineSeconds.
        return replace(memory, since=memory.since if memory.since is not None else now)
    sides = []
    champion = [p for p in champion if warm(p)]
    for pods, side in ((champion, memory.champion), (candidate, memory.candidate)):
        known = [p for p in pods if p.serving.pod in memory.serving_pods]
        serving = drift_mod.counter_deltas(memory.serving_pods, memory.at, [p.serving for p in known],
                                           health.ServingCounts(), health._moved)
        acceptance = drift_mod.pod_deltas(memory.acceptance_pods, memory.at, [p.acceptance for p in known])
        sides.append(side.add(serving, acceptance, (now - memory.at) * len(pods) if memory.at is not None else 0.0))
    everyone = champion + candidate
    return replace(memory, since=memory.since if memory.since is not None else now, at=now,
                   serving_pods={p.serving.pod: p.serving for p in everyone},
                   acceptance_pods={p.acceptance.pod: p.acceptance for p in everyone},
                   champion=sides[0], candidate=sides[1])


# -- judging ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Policy:
    latency: health.LatencyPolicy
    drift: drift_mod.DriftPolicy

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "Policy":
        d = dict(spec.get("drift") or {})
        return cls(health.LatencyPolicy.from_spec(d), drift_mod.DriftPolicy.from_spec(d))


@dataclass(frozen=True)
class Judged:
    """One metric and category, candidate against champion."""
    metric: str                  # acceptance, ttft, tpot, errors
    category: str
    verdict: str                 # drift's BREACH, FINE, INCONCLUSIVE, NO_EVIDENCE, or serving_health.SHIFTED
    candidate: float | None      # acceptance, p95 seconds, error rate
    champion: float | None
    requests: int                # the candidate's requests judged
    message: str

    @property
    def key(self) -> str:
        return f"{self.metric}:{self.category}"

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "requests": self.requests,
                **({"candidate": round(self.candidate, 6)} if self.candidate is not None else {}),
                **({"champion": round(self.champion, 6)} if self.champion is not None else {})}


def _rate(c: health.ServingCounts) -> float:
    return c.failed / c.finished if c.finished else 0.0


def _errors(policy: Policy, cat: str, cand: health.ServingCounts, champ: health.ServingCounts) -> Judged:
    limit = max(policy.latency.max_error_rate, _rate(champ))
    j = health.judge_errors(cat, cand, replace(policy.latency, max_error_rate=limit), policy.drift.z)
    return Judged(health.ERRORS, cat, j.verdict, j.share if cand.finished else None,
                  _rate(champ) if champ.finished else None, j.requests,
                  f"{j.message()} (champion {_rate(champ):.3f} over {champ.finished})")


def _latency(policy: Policy, metric: str, cat: str, cand: Mapping[str, health.ServingCounts],
             baseline: health.Baseline, load: float) -> Judged:
    j = health.judge_latency(metric, cat, cand, baseline, None, policy.latency, policy.drift.z, load)
    return Judged(metric, cat, j.verdict, j.live, j.baseline, j.requests,
                  j.message().replace("baseline p95", "champion p95").replace("its own baseline", "the champion's p95"))


def _acceptance(policy: Policy, cat: str, cand: RequestMoments, champ: RequestMoments) -> Judged:
    champion = champ.accepted / champ.drafted if champ.drafted else 0.0
    margin = champion * policy.drift.tolerance + policy.drift.noise_allowance
    sp = ShadowPolicy(z=policy.drift.z, margin=margin, min_requests=policy.drift.min_requests,
                      min_positions=policy.drift.min_drafted)
    c = compare(cat, ShadowEvidence(cand, champ), sp)
    verdict = {WORSE: BREACH, BETTER: FINE, NOT_WORSE: FINE, SHORT: NO_EVIDENCE}.get(c.status, INCONCLUSIVE)
    name = "overall" if cat == OVERALL else f"category '{cat}'"
    text = (f"{name} acceptance: {c.requests} request(s), too few to judge" if c.status == SHORT else
            f"{name} acceptance {c.candidate:.3f} vs champion {c.champion:.3f} over {c.requests} requests, "
            f"difference in [{c.lower:+.3f}, {c.upper:+.3f}] (margin {margin:.3f}): {c.status}")
    return Judged(ACCEPTANCE, cat, verdict, c.candidate if c.status != SHORT else None,
                  c.champion if c.status != SHORT else None, c.requests, text)


def judge(policy: Policy, memory: Memory) -> tuple[Judged, ...]:
    """Every judgement of the step's evidence so far: errors, TTFT and TPOT (against the
    champion's p95 of the same stretch, where it has one), acceptance; per category seen and
    pooled ('*')."""
    champ, cand = memory.champion, memory.candidate
    cats = sorted(set(cand.serving) | set(champ.serving))
    zero = health.ServingCounts()
    out = [_errors(policy, cat, cand.serving.get(cat, zero), champ.serving.get(cat, zero)) for cat in cats]
    out.append(_errors(policy, OVERALL, health.pooled(cand.serving), health.pooled(champ.serving)))
    baseline = health.Baseline.measure(champ.serving, champ.pod_seconds, policy.latency)
    load = cand.finished / cand.pod_seconds if cand.pod_seconds > 0 else 0.0
    for metric in health.LATENCY:
        judged = sorted(c for c in cand.serving if c in baseline.p95[metric])
        for cat in judged:
            out.append(_latency(policy, metric, cat, {cat: cand.serving[cat]}, baseline, load))
        if judged:
            out.append(_latency(policy, metric, OVERALL, dict(cand.serving), baseline, load))
    zero_m = RequestMoments.zero()
    pooled_cand, pooled_champ = zero_m, zero_m
    for cat in sorted(set(cand.acceptance) | set(champ.acceptance)):
        a, b = cand.acceptance.get(cat, zero_m), champ.acceptance.get(cat, zero_m)
        pooled_cand, pooled_champ = pooled_cand + a, pooled_champ + b
        out.append(_acceptance(policy, cat, a, b))
    out.append(_acceptance(policy, OVERALL, pooled_cand, pooled_champ))
    return tuple(out)


@dataclass(frozen=True)
class Decision:
    action: str                  # Abort, Advance, Promote, Wait
    reason: str
    judged: tuple[Judged, ...] = ()


REQUIRED = tuple(f"{m}:{OVERALL}" for m in (health.ERRORS, *health.LATENCY))


def decide(policy: Policy, steps: tuple[Step, ...], step: int, judged: tuple[Judged, ...], elapsed: float,
           deadline: float) -> Decision:
    """The step's outcome so far. step: 0-based; elapsed: seconds since its evidence began;
    deadline: how long after its pause a step may stay unproven (rollout.progressDeadlineSeconds)."""
    breaches = [j for j in judged if j.verdict == BREACH]
    if breaches:
        # Categories before the pooled judgement, as drift does: '*' speaks when none breached alone.
        named = [j for j in breaches if j.category != OVERALL] or breaches
        return Decision(ABORT, "candidate worse than the champion: " + "; ".join(j.message for j in named), judged)
    pause = steps[step].pause_seconds
    by_key = {j.key: j for j in judged}
    missing = [k for k in REQUIRED if by_key.get(k) is None or by_key[k].verdict != FINE]
    unsure = [j for j in judged if j.verdict in (INCONCLUSIVE, health.SHIFTED)]
    healthy = not missing and not unsure
    where = f"step {step + 1} of {len(steps)} ({steps[step].describe()})"
    if elapsed < pause:
        return Decision(WAIT, f"{where}: {elapsed:.0f}s of its {pause:g}s pause", judged)
    if healthy:
        fine = "; ".join(by_key[k].message for k in REQUIRED)
        if step + 1 < len(steps):
            return Decision(ADVANCE, f"{where} healthy: {fine}", judged)
        return Decision(PROMOTE, f"all {len(steps)} step(s) healthy: {fine}", judged)
    why = "; ".join([j.message for j in unsure] +
                    [f"{k.replace(':', ' ')} not yet judged fine" + (f" ({by_key[k].message})" if k in by_key else "")
                     for k in missing if by_key.get(k) is None or by_key[k].verdict != INCONCLUSIVE])
    if elapsed >= pause + deadline:
        return Decision(ABORT, f"{where} not shown healthy {deadline:g}s after its pause: {why}", judged)
    return Decision(WAIT, f"{where}: waiting for evidence: {why}", judged)


# -- what it writes -----------------------------------------------------------------------------

def canary_deployment(dep: Mapping[str, Any], name: str, replicas: int, step: int) -> dict[str, Any]:
    """The candidate's engine Deployment (`dep`: the champion's manifest rendered for the
    candidate's release) as the canary: its own name, replicas and track label (in its selector
    too, so the two Deployments' pods stay apart), the Service's labels kept."""
    out = copy.deepcopy(dict(dep))
    meta, spec = out["metadata"], out["spec"]
    meta["name"] = name
    meta["labels"] = {**meta.get("labels", {}), TRACK_LABEL: CANARY_TRACK}
    meta.setdefault("annotations", {})[ANN_STEP] = str(step)
    spec["replicas"] = int(replicas)
    spec["selector"] = {"matchLabels": {**spec["selector"]["matchLabels"], TRACK_LABEL: CANARY_TRACK}}
    tmeta = spec["template"]["metadata"]
    tmeta["labels"] = {**tmeta.get("labels", {}), TRACK_LABEL: CANARY_TRACK}
    return out


def is_canary_pod(pod: Mapping[str, Any]) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(TRACK_LABEL) == CANARY_TRACK


def live_step(deployment: Mapping[str, Any] | None, version: str) -> int:
    """The step the canary Deployment was last scaled for, when it runs `version` (else -1)."""
    if not deployment or not (deployment.get("spec") or {}).get("replicas"):
        return -1
    meta = deployment.get("metadata") or {}
    if str((meta.get("labels") or {}).get(LABEL_VERSION)) != str(version):
        return -1
    try:
        return int((meta.get("annotations") or {}).get(ANN_STEP, -1))
    except ValueError:
        return -1


def scale_down_patch() -> dict[str, Any]:
    """Zero replicas, and a manifest fingerprint no render has: the next canary patches it."""
    from specpair_operator.desired.ownership import ANN_MANIFEST

    return {"metadata": {"annotations": {ANN_MANIFEST: "scaled-down"}}, "spec": {"replicas": 0}}


@dataclass(frozen=True)
class ScaleDown:
    """Scale the canary Deployment to zero (its pods go; the object stays for the next canary)."""
    name: str


@dataclass(frozen=True)
class RememberCanary:
    memory: Memory


# status.canary.shareBasis: what the share rests on.
SHARE_BY_WEIGHT = "gateway weight: the route splits every request"
SHARE_BY_REPLICAS = ("approximate: replica ratio (no Gateway: a keep-alive HTTP or gRPC client stays on the pod it "
                     "reached, so one client can put 0% or 100% on the candidate)")


def observed_share(memory: Memory) -> float | None:
    """The candidate's share of the requests both sides finished in the step so far (None: none)."""
    cand, champ = memory.candidate.finished, memory.champion.finished - memory.carried
    return cand / (cand + champ) if cand + champ else None


def status_entry(version: str, champion: str, phase: str, step: int, steps: tuple[Step, ...], replicas: int,
                 champion_replicas: int, message: str, judged: tuple[Judged, ...] = (),
                 started: str = "", previous: Mapping[str, Any] | None = None, weight: int | None = None,
                 observed: float | None = None) -> dict[str, Any]:
    """status.canary: where the canary stands, with the numbers of its last judgement. The status
    is written as a merge patch, so what `previous` (the entry status holds) has and this one does
    not is written as null: no number of an earlier judgement or canary is left behind.
    `weight`: the route's candidate weight when a Gateway splits the traffic (the share is then
    that weight, else the replica ratio, approximate); `observed`: observed_share."""
    share = weight / 100 if weight is not None else traffic_share(replicas, champion_replicas)
    entry: dict[str, Any] = {
        "version": str(version), "champion": str(champion), "phase": phase, "step": step + 1,
        "steps": len(steps), "replicas": replicas, "trafficShare": round(share, 4),
        **({"weight": weight} if weight is not None else {}),
        "shareBasis": SHARE_BY_WEIGHT if weight is not None else SHARE_BY_REPLICAS,
        **({"observedShare": round(observed, 4)} if observed is not None else {}),
        **({"stepStartedAt": started} if started else {}), "message": message[:2000],
        "judged": {j.key: j.as_dict() for j in judged if j.verdict != NO_EVIDENCE}}
    previous = previous or {}
    entry["judged"] = {**{k: None for k in previous.get("judged") or {}}, **entry["judged"]}
    return {**{k: None for k in previous}, **entry}


@dataclass(frozen=True)
class CanaryRun:
    """The candidate a pass runs a canary for: its version, tags (release, content hash,
    tokenizer fingerprints) and gate verdict (its tuning), and the spec's steps."""
    version: str
    tags: Mapping[str, str]
    verdict: Mapping[str, Any]
    steps: tuple[Step, ...]
