"""Drift policy: does the serving release, on traffic its gate measured, accept fewer draft
tokens than it was gated at, and would the previous release do better on that traffic?

One pure function, `decide`, turns what the engine pods report into the ladder's next action.
The numbers behind its defaults are in docs/drift.md (bench/drift_simulation.py).

Observing
    Each pod reports cumulative counters per category (`RequestMoments`) since its process started.
    They are differenced per pod, keyed by pod name and uid: a counter going backwards or a
    later process start means the pod restarted, and everything it reports is new. Lifetime
    counters are never summed across pods, so one pod restarting cannot hide another.

Windows
    Deltas accumulate per gated category (and pooled over all gated categories, '*') in
    disjoint windows: every drafted token is judged once. A window closes once it is at least
    `window_seconds` old and holds evidence (`min_drafted` tokens and `min_requests` requests);
    one that gathers no evidence within `max_window_factor` windows is dropped as "no evidence".
    A burst is thus one window, and an idle pair, or a pair whose speculation is off, never
    produces a breach.

Judging (the request is the unit)
    live = accepted / drafted over the window (token-weighted, like the gate's number).
    Its standard error treats requests as the sampled units: with per-request sums from the
    engine (Σd², Σa², Σd·a) it is the ratio estimator's
        se² = Σ(a_i - live·d_i)² / (n (n-1) d̄²);
    without them it is bounded by live(1-live)·design_effect / n (per-request acceptance lies in
    [0, 1]), and without a request count n is taken as drafted / max_drafted_per_request.
    A window breaches when even live + z·se is below the floor
        baseline · (1 - tolerance) - noise_allowance,
    a relative tolerance, so a category gated at 0.20 that falls to 0.06 is caught as surely as
    one falling from 0.8 to 0.25. It is fine when live >= floor, and inconclusive otherwise.
    One long request or one client cannot close a window on its own (min_requests) nor narrow
    the bound (its weight enters se), and no burst decides: a breach must also hold without
    the window's busiest quarter of observations.

Traffic shift
    Categories the gate did not measure are reported (`Decision.shift`), never judged: the
    release was never promised to do well on them.

Ladder
    `consecutive` breaching windows of one category take the next step.
    SpeculationOff: the evidence starts afresh. While off, windows without drafts are "no
    evidence"; drafts (the engine probing with the drafter, or the operator turning it on for a
    probe when nothing was drafted for `probe_after_windows` windows) keep measuring.
    `consecutive` fine windows turn speculation back on (SpeculationOn).
    Rollback: only on `consecutive` fresh breaching windows, and only when the previous
    release's gated baseline on the same categories (weighted as the fresh drafts) would itself
    not be breached by what the current release does now: rolling back must help on this
    traffic. When both releases serve the same target and draft, it must also have been gated
    better than the current one, since a drop that is the traffic's would hit it the same way.
    A sustained breach of latency or errors (serving_health.py) climbs the same ladder through
    decide's `serving` input, after acceptance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from specpair.stats import RequestMoments

SPECULATION_OFF = "SpeculationOff"
ROLLBACK = "Rollback"
SPECULATION_ON = "SpeculationOn"
OVERALL = "*"
BREACH, FINE, INCONCLUSIVE, NO_EVIDENCE = "breach", "fine", "inconclusive", "no evidence"


@dataclass(frozen=True)
class DriftPolicy:
    tolerance: float = 0.2                # relative drop below the gated acceptance allowed
    noise_allowance: float = 0.02         # absolute, on top (run-to-run variation of the gate)
    min_drafted: int = 200                # drafted tokens a window needs to be judged
    min_requests: int = 20                # requests (effective) a window needs to be judged
    consecutive: int = 2                  # breaching windows of one category per ladder step
    window_seconds: float = 300.0
    max_window_factor: float = 4.0        # a window without evidence by then is dropped
    z: float = 2.33                       # one-sided confidence of the bound (99%)
    design_effect: float = 3.0            # variance inflation without per-request sums
    max_drafted_per_request: int = 256    # requests assumed without a request count
    probe_after_windows: int = 3          # speculation off and nothing drafted this long: probe
    ladder: tuple[str, ...] = (SPECULATION_OFF, ROLLBACK)

    @classmethod
    def from_spec(cls, drift: dict[str, Any] | None) -> "DriftPolicy":
        d = drift or {}
        return cls(
            tolerance=float(d.get("tolerance", cls.tolerance)),
            noise_allowance=float(d.get("noiseAllowance", cls.noise_allowance)),
            min_drafted=int(d.get("minDraftedTokens", cls.min_drafted)),
            min_requests=int(d.get("minRequests", cls.min_requests)),
            consecutive=int(d.get("consecutiveBreaches", cls.consecutive)),
            window_seconds=float(d.get("windowSeconds", cls.window_seconds)),
            z=float(d.get("confidenceZ", cls.z)),
            probe_after_windows=int(d.get("probeAfterWindows", cls.probe_after_windows)),
            ladder=tuple(d.get("ladder", cls.ladder)),
        )

    def floor(self, baseline: float) -> float:
        return baseline * (1.0 - self.tolerance) - self.noise_allowance


# -- counters ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodStats:
    """One pod's report: `pod` is its name and uid (a replaced pod is another series);
    `started` is when its serving process started (now - uptime), None if unknown."""
    pod: str
    categories: Mapping[str, RequestMoments]
    started: float | None = None


def pod_deltas(previous: Mapping[str, PodStats], at: float | None,
               pods: list[PodStats]) -> dict[str, RequestMoments]:
    """What all pods drafted since the previous observation, per category (counter_deltas)."""
    return counter_deltas(previous, at, pods, RequestMoments(), lambda d: d.drafted > 0 or (d.requests or 0) > 0)


def counter_deltas(previous: Mapping[str, Any], at: float | None, pods: list[Any], zero: Any,
                   moved: Callable[[Any], bool]) -> dict[str, Any]:
    """The growth of all pods' cumulative counters since the previous observation, per category.

    pods: values with `pod`, `categories` (cumulative counters with +, - and `below`) and
    `started` (PodStats; serving_health's PodServing); zero: a counter with nothing counted;
    moved: whether a difference counted anything.

    A pod seen for the first time contributes only its counters' growth from now on, unless its
    process started after the previous observation (then all it reports is new). A pod whose
    counters went backwards or whose process start moved restarted: all it reports is new."""
    out: dict[str, Any] = {}
    for p in pods:
        old = previous.get(p.pod)
        if old is None:
            fresh = at is not None and p.started is not None and p.started > at
            if not fresh:
                continue
            base: Mapping[str, Any] = {}
        else:
            restarted = (p.started is not None and old.started is not None and p.started > old.started + 1.0) or \
                any(p.categories.get(c, zero).below(v) for c, v in old.categories.items())
            base = {} if restarted else old.categories
        for cat, now in p.categories.items():
            d = now - base[cat] if cat in base else now
            if moved(d):
                out[cat] = out[cat] + d if cat in out else d
    return out


# -- windows and judgements ---------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    counts: RequestMoments
    expected: float      # accepted tokens the gate predicts for these drafts: Σ drafted_c · baseline_c
    opened_at: float
    parts: tuple[tuple[RequestMoments, float], ...] = ()   # (counts, expected) of each observation in it

    def add(self, d: RequestMoments, expected: float) -> "Window":
        return Window(self.counts + d, self.expected + expected, self.opened_at, self.parts + ((d, expected),))

    def without_busiest(self) -> "Window | None":
        """The window without its busiest quarter of observations (by drafted tokens)."""
        drop = math.ceil(len(self.parts) / 4)
        rest = sorted(self.parts, key=lambda p: p[0].drafted)[:len(self.parts) - drop]
        if not rest:
            return None
        counts, expected = rest[0]
        for c, e in rest[1:]:
            counts, expected = counts + c, expected + e
        return Window(counts, expected, self.opened_at, tuple(rest))

    @property
    def baseline(self) -> float:
        return self.expected / self.counts.drafted if self.counts.drafted else 0.0


@dataclass(frozen=True)
class Judgement:
    category: str
    verdict: str
    live: float
    upper: float
    baseline: float
    floor: float
    drafted: int
    requests: float

    def message(self) -> str:
        name = "overall (gated categories)" if self.category == OVERALL else f"category '{self.category}'"
        rel = "<" if self.verdict == BREACH else ">=" if self.verdict == FINE else "~"
        return (f"{name} acceptance {self.live:.3f} (upper bound {self.upper:.3f}) over {self.requests:.0f} "
                f"requests / {self.drafted} drafted tokens {rel} floor {self.floor:.3f} (gated {self.baseline:.3f})")


def standard_error(c: RequestMoments, policy: DriftPolicy) -> tuple[float, float]:
    """(live acceptance's standard error, requests it rests on), requests as the unit."""
    live = c.accepted / c.drafted
    if c.has_moments and c.requests and c.requests >= 2:
        n = float(c.requests)
        dbar = c.drafted / n
        resid = c.accepted_sq - 2 * live * c.drafted_accepted + live * live * c.drafted_sq
        return math.sqrt(max(resid, 0.0) / (n * (n - 1) * dbar * dbar)), n
    if c.requests is not None:
        n = min(float(c.requests), float(c.drafted)) / policy.design_effect
    else:
        n = c.drafted / policy.max_drafted_per_request
    n = max(n, 1e-9)
    return math.sqrt(max(live * (1 - live), 0.25 / max(n, 1.0)) / n), n


def judge(key: str, w: Window, policy: DriftPolicy, final: bool) -> Judgement | None:
    """A closed window's verdict; None while it is still gathering evidence."""
    c = w.counts
    if c.drafted <= 0:
        return Judgement(key, NO_EVIDENCE, 0.0, 0.0, w.baseline, policy.floor(w.baseline), 0, 0) if final else None
    se, n = standard_error(c, policy)
    live = c.accepted / c.drafted
    if c.drafted < policy.min_drafted or n < policy.min_requests:
        return Judgement(key, NO_EVIDENCE, live, 1.0, w.baseline, policy.floor(w.baseline), c.drafted, n) if final else None
    upper = live + policy.z * se
    floor = policy.floor(w.baseline)
    verdict = BREACH if upper < floor else FINE if live >= floor else INCONCLUSIVE
    if verdict == BREACH:
        # No burst decides: the breach must hold without the window's busiest quarter too.
        rest = w.without_busiest()
        if rest is None or rest.counts.drafted <= 0 or \
                rest.counts.accepted / rest.counts.drafted + policy.z * standard_error(rest.counts, policy)[0] \
                >= policy.floor(rest.baseline):
            verdict = INCONCLUSIVE
    return Judgement(key, verdict, live, upper, w.baseline, floor, c.drafted, n)


# -- the ladder ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DriftState:
    """What persists (in status.drift) for the serving release."""
    steps_taken: int = 0
    streaks: Mapping[str, int] = field(default_factory=dict)   # breaching windows in a row per category
    fine_in_row: int = 0                                       # passes with fine windows and no breach
    since: float = 0.0                                         # when the last ladder step was taken

    @property
    def breaches_in_row(self) -> int:
        return max(self.streaks.values(), default=0)

    def as_dict(self) -> dict[str, Any]:
        return {"breachesInRow": self.breaches_in_row, "stepsTaken": self.steps_taken,
                "streaks": dict(self.streaks), "fineInRow": self.fine_in_row, "since": self.since}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "DriftState":
        d = d or {}
        streaks = {str(k): int(v) for k, v in (d.get("streaks") or {}).items()}
        return cls(int(d.get("stepsTaken", 0)), streaks, int(d.get("fineInRow", 0)), float(d.get("since", 0.0)))


def state_for_release(stored: dict[str, Any] | None, champion: str) -> DriftState:
    """The ladder belongs to one release: a state recorded for another version starts fresh.

    (The pass that promotes a new champion can return before the drift check runs, so the old
    release's steps would otherwise be charged to the new one.)
    """
    stored = stored or {}
    if str(stored.get("version", "")) != str(champion):
        return DriftState()
    return DriftState.from_dict(stored)


@dataclass(frozen=True)
class Memory:
    """What the operator remembers between observations (in process; lost on restart, which
    only costs the evidence gathered so far)."""
    at: float | None = None
    pods: Mapping[str, PodStats] = field(default_factory=dict)
    windows: Mapping[str, Window] = field(default_factory=dict)
    last_draft_at: float | None = None
    probe_started: float | None = None
    probe_judged: int = 0
    last: Mapping[str, Judgement] = field(default_factory=dict)   # newest closed window per category


@dataclass(frozen=True)
class ServingPressure:
    """A sustained breach of serving health (latency or errors, judged in serving_health.py) for
    the ladder. first: the step it asks for (SpeculationOff when speculation is what got slower,
    Rollback otherwise: an error rate, or latency with speculation not to blame); reason: the
    numbers; rollback_helps and why: whether the previous release did better on what breaches."""
    first: str
    reason: str
    rollback_helps: bool
    why: str


@dataclass(frozen=True)
class Decision:
    state: DriftState
    memory: Memory
    action: str | None               # SpeculationOff, SpeculationOn, Rollback or None
    speculation: bool                # what the pods should be set to now (probes included)
    judged: tuple[Judgement, ...]    # windows closed by this observation
    shift: Mapping[str, int]         # drafted tokens of categories the gate did not measure
    reason: str                      # why the action (or why no rollback although asked for)

    @property
    def breaches(self) -> list[Judgement]:
        return [j for j in self.judged if j.verdict == BREACH]


def _off(state: DriftState, policy: DriftPolicy) -> bool:
    return SPECULATION_OFF in policy.ladder[:state.steps_taken]


def gated_categories(baseline: Mapping[str, float]) -> dict[str, float]:
    return {c: v for c, v in baseline.items() if c != OVERALL}


def decide(policy: DriftPolicy, state: DriftState, memory: Memory, now: float, pods: list[PodStats],
           baseline: Mapping[str, float], previous_baseline: Mapping[str, float] | None = None,
           same_models: bool = False, serving: ServingPressure | None = None) -> Decision:
    """One observation of all ready pods -> the ladder's next action.

    baseline / previous_baseline: gated acceptance per category ('*' overall) of the serving
    release and of the release a rollback would go to (None: there is none). same_models: both
    releases serve the same target and draft. serving: a sustained breach of latency or errors
    (serving_health.decide passes it); acceptance goes first, then it climbs the same ladder:
    SpeculationOff where it asks for it and that is the next step, Rollback where it asks for it
    (or speculation is off already) and the ladder still has it; while it lasts speculation is
    not turned back on."""
    gated = gated_categories(baseline)
    if not gated and OVERALL in baseline:
        gated = None   # an old verdict without categories: judge everything against the overall
    deltas = pod_deltas(memory.pods, memory.at, pods)
    opened = memory.at if memory.at is not None else now
    windows = dict(memory.windows)
    shift: dict[str, int] = {}
    drafted_now = 0
    for cat, d in deltas.items():
        drafted_now += d.drafted
        if gated is not None and cat not in gated:
            shift[cat] = d.drafted
            continue
        rate = gated[cat] if gated is not None else baseline[OVERALL]
        for key in ((cat, OVERALL) if gated is not None else (OVERALL,)):
            w = windows.get(key)
            windows[key] = Window(d, d.drafted * rate, opened, ((d, d.drafted * rate),)) if w is None else \
                w.add(d, d.drafted * rate)
    judged: list[Judgement] = []
    for key, w in sorted(windows.items()):
        age = now - w.opened_at
        if age < policy.window_seconds:
            continue
        j = judge(key, w, policy, final=age >= policy.window_seconds * policy.max_window_factor)
        if j is not None:
            judged.append(j)
            del windows[key]
    last = {**memory.last, **{j.category: j for j in judged if j.verdict != NO_EVIDENCE}}
    memory = replace(memory, at=now, pods={p.pod: p for p in pods}, windows=windows, last=last,
                     last_draft_at=now if drafted_now > 0 else memory.last_draft_at)

    counted = [j for j in judged if j.verdict in (BREACH, FINE)]
    streaks = dict(state.streaks)
    for j in judged:
        if j.verdict == BREACH:
            streaks[j.category] = streaks.get(j.category, 0) + 1
        elif j.verdict in (FINE, NO_EVIDENCE):
            streaks.pop(j.category, None)   # fine, or too little traffic since: not sustained
    breaches = [j for j in judged if j.verdict == BREACH]
    fine_in_row = 0 if breaches else state.fine_in_row + (1 if counted else 0)
    state = replace(state, streaks=streaks, fine_in_row=fine_in_row)
    if memory.probe_started is not None and counted:
        memory = replace(memory, probe_judged=memory.probe_judged + 1)

    action, reason = None, ""
    sustained = [j for j in breaches if streaks.get(j.category, 0) >= policy.consecutive]
    step = policy.ladder[state.steps_taken] if state.steps_taken < len(policy.ladder) else None
    if sustained and step == SPECULATION_OFF:
        action, reason = SPECULATION_OFF, "; ".join(j.message() for j in sustained)
    elif sustained and step == ROLLBACK:
        helps, why = rollback_helps(sustained, previous_baseline, baseline, policy, same_models)
        if helps:
            action, reason = ROLLBACK, "; ".join(j.message() for j in sustained) + "; " + why
        else:
            reason = "no rollback: " + why
    elif serving is not None:
        action, reason = _serving_step(serving, policy, state, step)
    elif _off(state, policy) and fine_in_row >= policy.consecutive:
        action, reason = SPECULATION_ON, "acceptance back within the gated baseline: " + \
            "; ".join(j.message() for j in counted)
    if action is not None:
        # Each step starts the evidence afresh: what comes next must be measured after it.
        # A step skipped to (an error rate rolls back at once) counts the ones before it as taken.
        steps = 0 if action == SPECULATION_ON else policy.ladder.index(action, state.steps_taken) + 1
        state = DriftState(steps_taken=steps, since=now)
        memory = replace(memory, windows={}, probe_started=None, probe_judged=0, last_draft_at=None)
    speculation = True
    if _off(state, policy) and action != ROLLBACK:
        memory, speculation = _probe(policy, state, memory, now)
    return Decision(state, memory, action, speculation, tuple(judged), shift, reason)


def _serving_step(serving: ServingPressure, policy: DriftPolicy, state: DriftState,
                  step: str | None) -> tuple[str | None, str]:
    """The ladder's step for a sustained serving-health breach (action or None, reason)."""
    if serving.first == SPECULATION_OFF and step == SPECULATION_OFF:
        return SPECULATION_OFF, serving.reason
    if ROLLBACK in policy.ladder[state.steps_taken:] and (serving.first == ROLLBACK or step == ROLLBACK):
        if serving.rollback_helps:
            return ROLLBACK, serving.reason + "; " + serving.why
        return None, "no rollback: " + serving.why
    return None, ""


def _probe(policy: DriftPolicy, state: DriftState, memory: Memory, now: float) -> tuple[Memory, bool]:
    """Speculation is off: turn it on for a probe when nothing was drafted for a while (an
    engine that probes by itself keeps drafting, so this never fires for it); end the probe
    once it gave `consecutive` judged windows or ran out of time."""
    if memory.probe_started is not None:
        long = now - memory.probe_started >= policy.consecutive * policy.window_seconds * policy.max_window_factor
        if memory.probe_judged >= policy.consecutive or long:
            return replace(memory, probe_started=None, probe_judged=0, last_draft_at=now), False
        return memory, True
    quiet_since = max(state.since, memory.last_draft_at or 0.0)
    if now - quiet_since >= policy.probe_after_windows * policy.window_seconds:
        return replace(memory, probe_started=now, probe_judged=0), True
    return memory, False


def rollback_helps(breaches: list[Judgement], previous: Mapping[str, float] | None, current: Mapping[str, float],
                   policy: DriftPolicy, same_models: bool) -> tuple[bool, str]:
    """Would the previous release do better on the traffic that breaches?

    Per breaching category, on the previous release's gated acceptance for it: what the current
    release does now must breach that release's floor too (upper bound below it). Rollback
    helps when that holds for most of the breaching drafts the previous release was gated on.
    The pooled '*' window decides only when no single category breached."""
    if not previous:
        return False, "no previous release with a gate verdict"
    cats = [j for j in breaches if j.category != OVERALL] or breaches
    known = [j for j in cats if j.category in previous]
    if not known:
        return False, "the previous release was not gated on " + ", ".join(sorted(j.category for j in cats))
    helped, words = 0, []
    for j in known:
        floor = policy.floor(previous[j.category])
        helps = j.upper < floor
        if helps and same_models and floor <= current.get(j.category, j.baseline):
            helps = False   # same target and draft, gated no better: the drop is the traffic's
        helped += j.drafted if helps else 0
        name = "overall" if j.category == OVERALL else j.category
        words.append(f"{name}: previous gated {previous[j.category]:.3f} (floor {floor:.3f}) "
                     f"{'>' if helps else 'not above'} this release now (upper bound {j.upper:.3f})")
    ok = helped * 2 > sum(j.drafted for j in known)
    head = "the previous release does better" if ok else "the previous release would not do better"
    return ok, head + (" (same target and draft)" if same_models else "") + ": " + "; ".join(words)


def fingerprint_mismatch(expected: dict[str, str | None], reported: dict[str, str | None]) -> list[str]:
    """Differences between the release's tokenizer fingerprints and what a pod reports.

    A side the release does not know (n-gram drafter, not yet gated) is not compared.
    """
    out = []
    for side in ("target", "draft"):
        want, got = expected.get(side), reported.get(side)
        if want and got and want != got:
            out.append(f"{side} tokenizer fingerprint {got[:12]} != released {want[:12]}")
    return out
