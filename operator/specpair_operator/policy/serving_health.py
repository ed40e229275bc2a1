"""Serving health: is the serving release slower, or failing more requests, than when it started
serving? A sustained breach climbs the drift ladder (drift.py): SpeculationOff first when
speculation is what got slower, then Rollback if it persists and the previous release did better;
an error rate above the limit goes to Rollback directly. Pure; the numbers are in docs/drift.md.

Observing
    Each engine pod's GetStats carries, per category, cumulative histograms of time to first
    token (TTFT) and time per output token (TPOT), with their bucket bounds, and its requests by
    status (`stats["serving"]` of engine_probe). They are differenced per pod exactly as
    acceptance is (drift.counter_deltas: keyed by pod name and uid, a restart makes all a pod
    reports new) and summed into disjoint windows of `drift.windowSeconds`. A window closes
    once it is that old and holds `latency.minRequests` finished requests; one without them
    after `max_window_factor` windows is dropped as no evidence.

Baseline
    The release's first `baseline_windows` closed windows whose error rate is within the limit:
    per category, the 95th percentile of TTFT and of TPOT (from `minRequests` requests at least;
    a category with fewer has none), the error rate and the load (finished requests per pod and
    second). It is kept in status per release version (the newest `BASELINES_KEPT`), so a
    rollback judges the release it returns to against what it measured when it served, and a
    rollback's "would it help" compares with what the previous release measured. The gate times
    whole generations at batch 1 (its speedup), not TTFT or TPOT under serving load, so it gives
    no latency baseline.

Judging (the request is the unit)
    Latency, per category with a baseline and pooled over them ('*'): a window breaches when
    the share of requests slower than `ratio` x the category's baseline p95 is, even at its
    lower confidence bound (Wilson, z of drift.confidenceZ), above 5%: the live p95 is above
    ratio x baseline with confidence. Fine when the share itself is at most 5%; inconclusive
    otherwise. The share above a bound inside a bucket is interpolated linearly, as Prometheus's
    histogram_quantile does. Each category is held to its own threshold, so the pooled judgement
    does not move when the mix of categories does.
    Errors, per category and pooled (all categories: an error is an error): failed / finished,
    failed = the engine failed the request (status "error"), finished = ok + failed; breach when
    the lower bound is above `maxErrorRate`, fine when the rate is at most it. Cancellations,
    deadlines, invalid and refused requests are the client's or the load's, not the release's.
    Too few requests (`minRequests`) give no verdict.

Traffic shift
    Categories without a baseline are counted (`ServingDecision.shift`), never judged for
    latency. A window whose load per pod is above `LOAD_SHIFT` x the baseline's gets no latency
    breach ("load shift": queueing and larger batches slow every release alike).

Ladder (drift.decide with `serving=ServingPressure`)
    `consecutiveBreaches` breaching windows of one metric and category in a row make a pressure.
    Errors ask for Rollback; latency asks for SpeculationOff when the pods speculate and the
    breach is on TPOT or acceptance fell in its last judged window (breach or inconclusive),
    for Rollback otherwise. Rollback helps for latency when, for most breaching requests, the
    release now also breaches the previous release's recorded p95 (none recorded: it does not
    help); for errors when there is a previous release whose recorded error rate was within the
    limit (or none was recorded). Every ladder step starts the serving evidence afresh.

How the operator's plan calls it (in place of drift.decide, once per drift check):
    inputs   per ready pod, its GetStats through engine_probe: `drift.PodStats` as today and
             `serving_pod(f"{name}/{uid}", stats, started)` (started = now - uptimeSeconds);
             speculating = any pod's stats["speculating"]; previous_version = the `previous`
             alias (None when there is none); the drift inputs as today (policy, state, memory,
             gated baseline, previous baseline, same models).
    state    `status.servingHealth` (ServingState.for_release(status.get("servingHealth"),
             champion)) beside `status.drift`; in-process memory (ServingMemory) beside
             drift.Memory, per pair, reset when the champion changes (ServingMemory.for_release).
    call     outcome = serving_health.decide(drift_policy, LatencyPolicy.from_spec(spec["drift"]),
             drift_state, drift_memory, serving_state, serving_memory, now, drift_pods,
             serving_pods, baseline, previous_baseline, same_models, champion=...,
             previous_version=..., speculating=...)
    output   outcome.drift is drift.Decision, applied as today (its reason names the latency or
             error numbers when serving health took the step); write
             status.servingHealth = outcome.serving.status(); keep outcome.serving.memory;
             outcome.serving.breaches (and .message()s) for the Drifted condition (reason
             LatencyAboveBaseline / ErrorRateAboveLimit) and an Event per breach window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from specpair_operator.policy import drift
from specpair_operator.policy.drift import BREACH, FINE, INCONCLUSIVE, NO_EVIDENCE, OVERALL, ROLLBACK, SPECULATION_OFF

TTFT, TPOT, ERRORS = "ttft", "tpot", "errors"
LATENCY = (TTFT, TPOT)
SHIFTED = "load shift"
OK, FAILED = "ok", ("error",)     # request statuses (specpair_requests_total): served, failed by the engine
QUANTILE = 0.95
LOAD_SHIFT = 1.5                  # load per pod above the baseline's x this: latency not judged
BASELINES_KEPT = 3                # release versions whose baselines status keeps


@dataclass(frozen=True)
class LatencyPolicy:
    """spec.drift.latency. Defaults: the CRD's (validation.latency_defaults), their one home."""
    ttft_p95_ratio: float
    tpot_p95_ratio: float
    max_error_rate: float
    min_requests: int
    baseline_windows: int = 2      # healthy windows that make the baseline

    @classmethod
    def from_spec(cls, drift_spec: Mapping[str, Any] | None) -> "LatencyPolicy":
        from specpair_operator.crd.validation import latency_defaults

        d = {**latency_defaults(), **((drift_spec or {}).get("latency") or {})}
        return cls(ttft_p95_ratio=float(d["ttftP95Ratio"]), tpot_p95_ratio=float(d["tpotP95Ratio"]),
                   max_error_rate=float(d["maxErrorRate"]), min_requests=int(d["minRequests"]))

    def ratio(self, metric: str) -> float:
        return self.ttft_p95_ratio if metric == TTFT else self.tpot_p95_ratio


# -- counters -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram as counts: counts[i] observations <= upper_bounds[i] (cumulative);
    `count` all of them (the +Inf bucket). Sums and differences of histograms with other bounds
    keep the bounds both have (exact: the counts are cumulative)."""
    upper_bounds: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()
    count: int = 0
    sum: float = 0.0

    @classmethod
    def from_stats(cls, d: Mapping[str, Any] | None) -> "Histogram":
        d = d or {}
        return cls(tuple(float(b) for b in d.get("upperBounds") or ()), tuple(int(c) for c in d.get("counts") or ()),
                   int(d.get("count", 0)), float(d.get("sum", 0.0)))

    def _aligned(self, o: "Histogram") -> tuple[tuple[float, ...], tuple[int, ...], tuple[int, ...]]:
        if self.upper_bounds == o.upper_bounds:
            return self.upper_bounds, self.counts, o.counts
        if not self.upper_bounds:
            return o.upper_bounds, (0,) * len(o.counts), o.counts
        if not o.upper_bounds:
            return self.upper_bounds, self.counts, (0,) * len(self.counts)
        common = tuple(sorted(set(self.upper_bounds) & set(o.upper_bounds)))
        return common, tuple(self.counts[self.upper_bounds.index(b)] for b in common), \
            tuple(o.counts[o.upper_bounds.index(b)] for b in common)

    def __add__(self, o: "Histogram") -> "Histogram":
        bounds, a, b = self._aligned(o)
        return Histogram(bounds, tuple(x + y for x, y in zip(a, b)), self.count + o.count, self.sum + o.sum)

    def __sub__(self, o: "Histogram") -> "Histogram":
        bounds, a, b = self._aligned(o)
        return Histogram(bounds, tuple(x - y for x, y in zip(a, b)), self.count - o.count, self.sum - o.sum)

    def below(self, o: "Histogram") -> bool:
        """Some count is lower than in `o`: the process behind them started again."""
        _, a, b = self._aligned(o)
        return self.count < o.count or any(x < y for x, y in zip(a, b))

    def at_most(self, t: float) -> float | None:
        """Observations <= t, linear inside t's bucket (the first from 0); None above the last bound."""
        lower, below = 0.0, 0
        for bound, c in zip(self.upper_bounds, self.counts):
            if t <= bound:
                frac = (t - lower) / (bound - lower) if bound > lower else 1.0
                return below + max(0.0, min(1.0, frac)) * (c - below)
            lower, below = bound, c
        return float(self.count) if self.counts and self.counts[-1] == self.count else None

    def quantile(self, q: float) -> float | None:
        """histogram_quantile: linear inside the bucket that holds rank q x count; None when it is
        the +Inf bucket (slower than every bound) or there is nothing."""
        rank = q * self.count
        lower, below = 0.0, 0
        if self.count <= 0:
            return None
        for bound, c in zip(self.upper_bounds, self.counts):
            if c >= rank:
                return lower + (bound - lower) * ((rank - below) / (c - below) if c > below else 1.0)
            lower, below = bound, c
        return None


@dataclass(frozen=True)
class ServingCounts:
    """One category's latency histograms and requests by status (cumulative, or a difference)."""
    ttft: Histogram = Histogram()
    tpot: Histogram = Histogram()
    requests: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_stats(cls, d: Mapping[str, Any]) -> "ServingCounts":
        return cls(Histogram.from_stats(d.get("ttft")), Histogram.from_stats(d.get("tpot")),
                   {str(k): int(v) for k, v in (d.get("requests") or {}).items()})

    def _statuses(self, o: "ServingCounts", sign: int) -> dict[str, int]:
        return {s: self.requests.get(s, 0) + sign * o.requests.get(s, 0) for s in {*self.requests, *o.requests}}

    def __add__(self, o: "ServingCounts") -> "ServingCounts":
        return ServingCounts(self.ttft + o.ttft, self.tpot + o.tpot, self._statuses(o, 1))

    def __sub__(self, o: "ServingCounts") -> "ServingCounts":
        return ServingCounts(self.ttft - o.ttft, self.tpot - o.tpot, self._statuses(o, -1))

    def below(self, o: "ServingCounts") -> bool:
        return self.ttft.below(o.ttft) or self.tpot.below(o.tpot) or \
            any(self.requests.get(s, 0) < n for s, n in o.requests.items())

    @property
    def failed(self) -> int:
        return sum(self.requests.get(s, 0) for s in FAILED)

    @property
    def finished(self) -> int:
        return self.requests.get(OK, 0) + self.failed

    def histogram(self, metric: str) -> Histogram:
        return self.ttft if metric == TTFT else self.tpot


def _moved(d: ServingCounts) -> bool:
    return any(n > 0 for n in d.requests.values()) or d.ttft.count > 0 or d.tpot.count > 0


def pooled(counts: Mapping[str, ServingCounts]) -> ServingCounts:
    total = ServingCounts()
    for c in counts.values():
        total = total + c
    return total


@dataclass(frozen=True)
class PodServing:
    """One pod's report: `pod` is its name and uid; `started` when its process started (or None)."""
    pod: str
    categories: Mapping[str, ServingCounts]
    started: float | None = None


def serving_pod(pod: str, stats: Mapping[str, Any], started: float | None) -> PodServing:
    """A pod's probe report (engine_probe's stats()) -> its serving counters."""
    return PodServing(pod, {cat: ServingCounts.from_stats(v) for cat, v in (stats.get("serving") or {}).items()},
                      started)


# -- baselines, state and memory ----------------------------------------------------------------

@dataclass(frozen=True)
class Baseline:
    """What a release measured over its first healthy windows."""
    p95: Mapping[str, Mapping[str, float]]   # metric (ttft, tpot) -> category -> seconds
    error_rate: float
    load: float                              # finished requests per pod and second
    requests: int

    @classmethod
    def measure(cls, counts: Mapping[str, ServingCounts], pod_seconds: float, policy: LatencyPolicy) -> "Baseline":
        p95: dict[str, dict[str, float]] = {m: {} for m in LATENCY}
        for cat, c in counts.items():
            for m in LATENCY:
                h = c.histogram(m)
                q = h.quantile(QUANTILE) if h.count >= policy.min_requests else None
                if q is not None:
                    p95[m][cat] = q
        total = pooled(counts)
        return cls(p95, total.failed / total.finished if total.finished else 0.0,
                   total.finished / pod_seconds if pod_seconds > 0 else 0.0, total.finished)

    def as_dict(self) -> dict[str, Any]:
        return {"ttftP95": {c: round(v, 6) for c, v in self.p95[TTFT].items()},
                "tpotP95": {c: round(v, 6) for c, v in self.p95[TPOT].items()},
                "errorRate": round(self.error_rate, 6), "load": round(self.load, 6), "requests": self.requests}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Baseline":
        return cls({TTFT: {str(c): float(v) for c, v in (d.get("ttftP95") or {}).items()},
                    TPOT: {str(c): float(v) for c, v in (d.get("tpotP95") or {}).items()}},
                   float(d.get("errorRate", 0.0)), float(d.get("load", 0.0)), int(d.get("requests", 0)))


@dataclass(frozen=True)
class ServingState:
    """What persists in status.servingHealth: the serving release's breach streaks (per metric and
    category, "ttft:code") and the baselines of the newest releases that served."""
    version: str = ""
    streaks: Mapping[str, int] = field(default_factory=dict)
    baselines: Mapping[str, Baseline] = field(default_factory=dict)

    @property
    def baseline(self) -> Baseline | None:
        return self.baselines.get(self.version)

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "streaks": dict(self.streaks),
                "baselines": {v: b.as_dict() for v, b in self.baselines.items()}}

    @classmethod
    def for_release(cls, stored: Mapping[str, Any] | None, champion: str) -> "ServingState":
        """The stored state; streaks belong to one release, baselines are kept per release."""
        stored = stored or {}
        baselines = {str(v): Baseline.from_dict(b) for v, b in (stored.get("baselines") or {}).items()}
        same = str(stored.get("version", "")) == str(champion)
        streaks = {str(k): int(v) for k, v in (stored.get("streaks") or {}).items()} if same else {}
        return cls(str(champion), streaks, baselines)

    def with_baseline(self, baseline: Baseline) -> "ServingState":
        # The newest by version number, not by key order: status comes back from the API server
        # with its keys sorted as strings ("10" before "9").
        older = sorted((v for v in self.baselines if v != self.version), key=_version_order)
        kept = older[-(BASELINES_KEPT - 1):] if BASELINES_KEPT > 1 else []
        return replace(self, baselines={**{v: self.baselines[v] for v in kept}, self.version: baseline})


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)


@dataclass(frozen=True)
class Window:
    counts: Mapping[str, ServingCounts]
    opened_at: float
    pod_seconds: float = 0.0          # Σ observation interval x pods reporting: the load's denominator

    def add(self, deltas: Mapping[str, ServingCounts], pod_seconds: float) -> "Window":
        counts = dict(self.counts)
        for cat, d in deltas.items():
            counts[cat] = counts[cat] + d if cat in counts else d
        return Window(counts, self.opened_at, self.pod_seconds + pod_seconds)


@dataclass(frozen=True)
class ServingMemory:
    """Between observations, in process (a restart costs only the evidence gathered so far)."""
    version: str = ""
    at: float | None = None
    pods: Mapping[str, PodServing] = field(default_factory=dict)
    window: Window | None = None
    forming: Window | None = None     # healthy windows gathered towards the baseline
    forming_windows: int = 0
    last: Mapping[str, "Judgement"] = field(default_factory=dict)   # newest verdict per key

    def for_release(self, champion: str) -> "ServingMemory":
        return self if self.version == str(champion) else ServingMemory(version=str(champion))


# -- judgements ---------------------------------------------------------------------------------

def wilson_lower(successes: float, n: float, z: float) -> float:
    """Lower bound of a binomial proportion (Wilson score interval)."""
    if n <= 0:
        return 0.0
    p = successes / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0))
    return max(0.0, (centre - spread) / (1 + z * z / n))


@dataclass(frozen=True)
class Judgement:
    metric: str                    # ttft, tpot or errors
    category: str
    verdict: str
    requests: int                  # observations judged
    share: float                   # requests above the threshold (latency), failed (errors)
    lower: float                   # its lower confidence bound
    limit: float                   # the share allowed: 1 - 0.95, or maxErrorRate
    live: float | None = None      # latency: live p95, seconds
    baseline: float | None = None  # latency: the baseline's p95, seconds
    threshold: float | None = None  # latency: ratio x baseline p95, seconds
    beyond_previous: bool | None = None  # latency: also breaches the previous release's threshold

    @property
    def key(self) -> str:
        return f"{self.metric}:{self.category}"

    def message(self) -> str:
        name = "overall" if self.category == OVERALL else f"category '{self.category}'"
        rel = ">" if self.verdict == BREACH else "<=" if self.verdict == FINE else "~"
        if self.metric == ERRORS:
            return (f"{name} error rate {self.share:.3f} (lower bound {self.lower:.3f}) over {self.requests} "
                    f"requests {rel} max {self.limit:.3f}")
        what = "TTFT" if self.metric == TTFT else "TPOT"
        p95 = f"p95 {self.live * 1000:.1f} ms" if self.live is not None else "p95 above the largest bucket"
        against = (f"baseline p95 {self.baseline * 1000:.1f} ms, threshold {self.threshold * 1000:.1f} ms"
                   if self.baseline is not None else "each category against its own baseline")
        return (f"{name} {what} {p95} ({against}): {self.share:.1%} of {self.requests} requests above the "
                f"threshold (lower bound {self.lower:.1%}) {rel} {self.limit:.0%}" +
                (" (load shift: not judged)" if self.verdict == SHIFTED else ""))


def _verdict(above: float, n: int, limit: float, policy: LatencyPolicy, z: float) -> tuple[str, float, float]:
    if n < policy.min_requests or n <= 0:
        return NO_EVIDENCE, above / n if n else 0.0, 0.0
    share, lower = above / n, wilson_lower(above, n, z)
    return (BREACH if lower > limit else FINE if share <= limit else INCONCLUSIVE), share, lower


def _exceeding(metric: str, counts: Mapping[str, ServingCounts], p95: Mapping[str, float],
               ratio: float) -> tuple[float, int]:
    """(requests above ratio x their category's p95, requests judged) over categories with one."""
    above, n = 0.0, 0
    for cat, c in counts.items():
        h = c.histogram(metric)
        if cat not in p95 or h.count <= 0:
            continue
        at_most = h.at_most(ratio * p95[cat])
        if at_most is None:      # the threshold is above every bound: cannot tell
            continue
        above, n = above + h.count - at_most, n + h.count
    return above, n


def judge_latency(metric: str, category: str, counts: Mapping[str, ServingCounts], baseline: Baseline,
                  previous: Baseline | None, policy: LatencyPolicy, z: float, load: float) -> Judgement:
    """One metric's verdict for a category (counts: just it) or pooled ('*': all of them)."""
    ratio, p95 = policy.ratio(metric), baseline.p95[metric]
    above, n = _exceeding(metric, counts, p95, ratio)
    verdict, share, lower = _verdict(above, n, 1 - QUANTILE, policy, z)
    if verdict == BREACH and baseline.load > 0 and load > LOAD_SHIFT * baseline.load:
        verdict = SHIFTED
    beyond = None
    if previous is not None and any(c in previous.p95[metric] for c in counts):
        prev_above, prev_n = _exceeding(metric, counts, previous.p95[metric], ratio)
        beyond = prev_n > 0 and wilson_lower(prev_above, prev_n, z) > 1 - QUANTILE
    live = pooled(counts).histogram(metric).quantile(QUANTILE)
    base = p95.get(category)
    return Judgement(metric, category, verdict, n, share, lower, 1 - QUANTILE, live, base,
                     ratio * base if base is not None else None, beyond)


def judge_errors(category: str, c: ServingCounts, policy: LatencyPolicy, z: float) -> Judgement:
    verdict, share, lower = _verdict(c.failed, c.finished, policy.max_error_rate, policy, z)
    return Judgement(ERRORS, category, verdict, c.finished, share, lower, policy.max_error_rate)


def judge_window(w: Window, state: ServingState, policy: LatencyPolicy, z: float,
                 previous: Baseline | None) -> list[Judgement]:
    """Errors per category and pooled; latency (once there is a baseline) per category that has
    one and pooled. previous: the baseline of the release a rollback would go to."""
    counts = dict(w.counts)
    out = [judge_errors(cat, c, policy, z) for cat, c in sorted(counts.items())]
    out.append(judge_errors(OVERALL, pooled(counts), policy, z))
    baseline = state.baseline
    if baseline is None:
        return out
    total = pooled(counts)
    load = total.finished / w.pod_seconds if w.pod_seconds > 0 else 0.0
    for metric in LATENCY:
        for cat in sorted(c for c in counts if c in baseline.p95[metric]):
            out.append(judge_latency(metric, cat, {cat: counts[cat]}, baseline, previous, policy, z, load))
        out.append(judge_latency(metric, OVERALL, counts, baseline, previous, policy, z, load))
    return out


# -- the decision -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServingDecision:
    state: ServingState
    memory: ServingMemory
    judged: tuple[Judgement, ...]            # verdicts of the window closed by this observation
    shift: Mapping[str, int]                 # finished requests of categories without a baseline
    pressure: drift.ServingPressure | None   # a sustained breach, for the ladder

    @property
    def breaches(self) -> list[Judgement]:
        return [j for j in self.judged if j.verdict == BREACH]

    def status(self) -> dict[str, Any]:
        """status.servingHealth: the state, and the newest verdict per metric and category."""
        return {**self.state.as_dict(), "live": {
            k: {"verdict": j.verdict, "requests": j.requests, "share": round(j.share, 4),
                **({"p95": round(j.live, 6)} if j.live is not None else {})}
            for k, j in sorted(self.memory.last.items())}}


def observe(policy: LatencyPolicy, drift_policy: drift.DriftPolicy, state: ServingState, memory: ServingMemory,
            now: float, pods: list[PodServing], *, speculating: bool, acceptance_fell: bool,
            previous_version: str | None) -> ServingDecision:
    """One observation of all ready pods -> verdicts of a closed window, the state, and the
    pressure a sustained breach puts on the ladder."""
    deltas = drift.counter_deltas(memory.pods, memory.at, pods, ServingCounts(), _moved)
    pod_seconds = (now - memory.at) * len(pods) if memory.at is not None else 0.0
    window = memory.window or Window({}, memory.at if memory.at is not None else now)
    window = window.add(deltas, pod_seconds)
    baseline = state.baseline
    shift = {cat: d.finished for cat, d in deltas.items()
             if baseline is not None and not any(cat in baseline.p95[m] for m in LATENCY)}
    judged: list[Judgement] = []
    forming, forming_windows = memory.forming, memory.forming_windows
    age = now - window.opened_at
    enough = pooled(window.counts).finished >= policy.min_requests
    if age >= drift_policy.window_seconds and (enough or age >= drift_policy.window_seconds * drift_policy.max_window_factor):
        previous = state.baselines.get(previous_version) if previous_version else None
        judged = judge_window(window, state, policy, drift_policy.z, previous)
        overall_errors = next(j for j in judged if j.key == f"{ERRORS}:{OVERALL}")
        if baseline is None and overall_errors.verdict == FINE:
            forming = window if forming is None else forming.add(window.counts, window.pod_seconds)
            forming_windows += 1
            if forming_windows >= policy.baseline_windows:
                state = state.with_baseline(Baseline.measure(forming.counts, forming.pod_seconds, policy))
                forming, forming_windows = None, 0
        window = None
    streaks = dict(state.streaks)
    for j in judged:
        if j.verdict == BREACH:
            streaks[j.key] = streaks.get(j.key, 0) + 1
        elif j.verdict != INCONCLUSIVE:
            streaks.pop(j.key, None)       # fine, no evidence or load shift: not sustained
    state = replace(state, streaks=streaks)
    last = {**memory.last, **{j.key: j for j in judged if j.verdict != NO_EVIDENCE}}
    memory = replace(memory, at=now, pods={p.pod: p for p in pods}, window=window, forming=forming,
                     forming_windows=forming_windows, last=last)
    # A sustained breach lasts until a window of its own says otherwise: between windows the
    # ladder still hears it, so speculation is not turned back on under it (acceptance windows,
    # an engine's own probes, close more often than serving ones).
    newest = judged or list(last.values())
    sustained = [j for j in newest if j.verdict == BREACH and streaks.get(j.key, 0) >= drift_policy.consecutive]
    pressure = _pressure(sustained, state, policy, speculating=speculating, acceptance_fell=acceptance_fell,
                         previous_version=previous_version)
    return ServingDecision(state, memory, tuple(judged), shift, pressure)


def _pressure(sustained: list[Judgement], state: ServingState, policy: LatencyPolicy, *, speculating: bool,
              acceptance_fell: bool, previous_version: str | None) -> drift.ServingPressure | None:
    """The step a sustained breach asks for, and whether rolling back would help."""
    if not sustained:
        return None
    # Categories before the pooled judgement, as acceptance does: '*' speaks when none breached alone.
    errors = [j for j in sustained if j.metric == ERRORS]
    errors = [j for j in errors if j.category != OVERALL] or errors
    previous = state.baselines.get(previous_version) if previous_version else None
    if errors:
        reason = "; ".join(j.message() for j in errors)
        if not previous_version:
            return drift.ServingPressure(ROLLBACK, reason, False, "no previous release to roll back to")
        if previous is not None and previous.error_rate > policy.max_error_rate:
            return drift.ServingPressure(ROLLBACK, reason, False, f"v{previous_version} failed "
                                         f"{previous.error_rate:.3f} of its requests too")
        measured = (f"v{previous_version} failed {previous.error_rate:.3f} of its requests" if previous is not None
                    else f"v{previous_version}'s error rate was not measured")
        return drift.ServingPressure(ROLLBACK, reason, True, measured)
    latency = [j for j in sustained if j.category != OVERALL] or sustained
    reason = "; ".join(j.message() for j in latency)
    speculation = speculating and (acceptance_fell or any(j.metric == TPOT for j in latency))
    first = SPECULATION_OFF if speculation else ROLLBACK
    if not previous_version:
        return drift.ServingPressure(first, reason, False, "no previous release to roll back to")
    if previous is None:
        return drift.ServingPressure(first, reason, False, f"v{previous_version}'s latency was not measured")
    helped = sum(j.requests for j in latency if j.beyond_previous)
    helps = helped * 2 > sum(j.requests for j in latency)
    return drift.ServingPressure(first, reason, helps, (f"v{previous_version} was faster" if helps else
                                 f"v{previous_version} was not faster") + " on the traffic that breaches "
                                 "(its recorded p95 x the ratio is breached too)" * helps)


def settle(d: ServingDecision, action: str | None) -> ServingDecision:
    """After the ladder acted: every step starts the serving evidence afresh."""
    if action is None:
        return d
    return replace(d, state=replace(d.state, streaks={}), memory=replace(d.memory, window=None))


def acceptance_fell(memory: drift.Memory) -> bool:
    """The newest acceptance window of some category was below its floor (breach or inconclusive)."""
    return any(j.verdict in (BREACH, INCONCLUSIVE) for j in memory.last.values())


@dataclass(frozen=True)
class Outcome:
    drift: drift.Decision
    serving: ServingDecision


def decide(drift_policy: drift.DriftPolicy, policy: LatencyPolicy, drift_state: drift.DriftState,
           drift_memory: drift.Memory, state: ServingState, memory: ServingMemory, now: float,
           drift_pods: list[drift.PodStats], serving_pods: list[PodServing], baseline: Mapping[str, float],
           previous_baseline: Mapping[str, float] | None = None, same_models: bool = False, *,
           champion: str, previous_version: str | None, speculating: bool) -> Outcome:
    """One drift check: acceptance (drift.decide) and serving health on the same ladder."""
    memory = memory.for_release(champion)
    if state.version != str(champion):
        state = ServingState.for_release(state.as_dict(), champion)
    serving = observe(policy, drift_policy, state, memory, now, serving_pods, speculating=speculating,
                      acceptance_fell=acceptance_fell(drift_memory), previous_version=previous_version)
    decision = drift.decide(drift_policy, drift_state, drift_memory, now, drift_pods, baseline, previous_baseline,
                            same_models, serving=serving.pressure)
    return Outcome(decision, settle(serving, decision.action))

