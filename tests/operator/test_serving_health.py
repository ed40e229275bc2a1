"""Serving health (specpair_operator.policy.serving_health): latency and error windows of the serving
release and the ladder steps they take, replayed as the operator observes the pods every 30 s.
Pure: no servers; the pods' counters use the engine's own histogram bounds."""

from __future__ import annotations

import random

import pytest

import engine_counters
from specpair_operator.policy import drift
from specpair_operator.policy import serving_health as sh

DT = 30.0
POLICY = sh.LatencyPolicy.from_spec({})
DRIFT = drift.DriftPolicy()


class Pod:
    """One engine pod's cumulative serving counters, as GetStats reports them (probe dict form)."""

    def __init__(self, name: str, started: float = 0.0, seed: int = 1):
        self.name, self.uid, self.started = name, "uid-1", started
        self.rng = random.Random(seed)
        self.cats: dict[str, dict] = {}

    def serve(self, category: str, requests: int, ttft: float = 0.2, tpot: float = 0.02,
              error_rate: float = 0.0) -> None:
        """`requests` finished requests, TTFT and TPOT log-normal around the given medians."""
        c = self.cats.setdefault(category, engine_counters.serving())
        for _ in range(requests):
            failed = self.rng.random() < error_rate
            engine_counters.finished(c, "error" if failed else "ok")
            if not failed:
                engine_counters.latencies(c, self.rng, ttft, tpot, sigma=0.25)

    def restart(self, at: float) -> None:
        self.started, self.cats = at, {}

    def report(self) -> tuple[drift.PodStats, sh.PodServing]:
        pod = f"{self.name}/{self.uid}"
        return drift.PodStats(pod, {}, self.started), sh.serving_pod(pod, {"serving": self.cats}, self.started)


class Run:
    """Replays observations through serving_health.decide (with drift's ladder); records actions."""

    def __init__(self, previous: sh.Baseline | None = None, previous_version: str | None = "1",
                 policy: sh.LatencyPolicy = POLICY, drift_policy: drift.DriftPolicy = DRIFT):
        self.policy, self.drift_policy = policy, drift_policy
        self.previous_version = previous_version
        baselines = {previous_version: previous} if previous is not None and previous_version else {}
        self.state = sh.ServingState("2", {}, baselines)
        self.memory = sh.ServingMemory("2")
        self.drift_state, self.drift_memory = drift.DriftState(), drift.Memory()
        self.now, self.speculating = 0.0, True
        self.actions: list[tuple[str, float]] = []
        self.outcomes: list[sh.Outcome] = []

    def observe(self, pods: list[Pod]) -> sh.Outcome:
        self.now += DT
        reports = [p.report() for p in pods]
        out = sh.decide(self.drift_policy, self.policy, self.drift_state, self.drift_memory, self.state,
                        self.memory, self.now, [r[0] for r in reports], [r[1] for r in reports], {"general": 0.5},
                        champion="2", previous_version=self.previous_version, speculating=self.speculating)
        # What the operator persists goes through status and back.
        self.state = sh.ServingState.for_release(out.serving.status(), "2")
        self.memory = out.serving.memory
        self.drift_state, self.drift_memory = out.drift.state, out.drift.memory
        self.speculating = out.drift.speculation
        if out.drift.action:
            self.actions.append((out.drift.action, self.now))
        self.outcomes.append(out)
        return out

    def windows(self, pods: list[Pod], count: int, traffic) -> None:
        """Observe with `traffic` before each observation until `count` windows closed."""
        for _ in range(int(count * DRIFT.max_window_factor * DRIFT.window_seconds / DT) + 1):
            if count <= 0:
                return
            traffic()
            count -= bool(self.observe(pods).serving.judged)
        raise AssertionError("the windows did not close")

    @property
    def names(self) -> list[str]:
        return [a for a, _ in self.actions]

    def judged(self, metric: str | None = None) -> list[sh.Judgement]:
        return [j for o in self.outcomes for j in o.serving.judged if metric is None or j.metric == metric]


def healthy(pods: list[Pod], category: str = "general", per_pod: int = 15, **kw):
    def traffic():
        for p in pods:
            p.serve(category, per_pod, **kw)
    return traffic


def previous_baseline(**kw) -> sh.Baseline:
    """What v1 measured when it served the same healthy traffic."""
    pods = [Pod("a", seed=11), Pod("b", seed=12)]
    run = Run(previous_version=None)
    run.windows(pods, 2, healthy(pods, **kw))
    return run.state.baseline


def two_healthy_windows(run: Run | None = None) -> tuple[list[Pod], Run]:
    """Two pods, and `run` (v2 after v1's baseline, unless given) past two windows of healthy traffic."""
    pods = [Pod("a"), Pod("b", seed=2)]
    run = run or Run(previous_baseline())
    run.windows(pods, 2, healthy(pods))
    return pods, run


# -- histograms ----------------------------------------------------------------------------------

def test_histogram_quantile_and_share_interpolate_inside_buckets_like_prometheus():
    h = sh.Histogram((0.1, 0.2, 0.4), (10, 60, 100), 100, 20.0)
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.1 * 40 / 50)
    assert h.quantile(0.95) == pytest.approx(0.2 + 0.2 * 35 / 40)
    assert h.at_most(0.05) == pytest.approx(5.0)          # the first bucket from 0
    assert h.at_most(0.3) == pytest.approx(60 + 40 * 0.5)
    assert h.at_most(1.0) == 100                           # nothing in +Inf: all below
    slow = sh.Histogram((0.1, 0.2), (1, 2), 10, 9.0)
    assert slow.quantile(0.95) is None and slow.at_most(1.0) is None   # the +Inf bucket: cannot tell
    assert sh.Histogram().quantile(0.95) is None


def test_histograms_with_other_bounds_add_over_the_bounds_both_have():
    a = sh.Histogram((0.1, 0.2, 0.4), (1, 2, 3), 4, 1.0)
    b = sh.Histogram((0.2, 0.4, 0.8), (5, 6, 7), 8, 2.0)
    assert a + b == sh.Histogram((0.2, 0.4), (7, 9), 12, 3.0)
    assert (a + b) - b == sh.Histogram((0.2, 0.4), (2, 3), 4, 1.0)
    assert sh.Histogram() + a == a and a - sh.Histogram() == a
    assert a.below(sh.Histogram((0.1, 0.2, 0.4), (1, 3, 3), 4, 1.0)) and not a.below(a)


def test_wilson_lower_bound():
    assert sh.wilson_lower(0, 100, 2.33) == 0.0
    assert 0.05 < sh.wilson_lower(15, 100, 2.33) < 0.15
    assert sh.wilson_lower(1, 1, 2.33) < 0.2          # one request proves little


# -- baseline and verdicts ------------------------------------------------------------------------

def test_the_first_healthy_windows_make_the_baseline_kept_in_status():
    pods = [Pod("a"), Pod("b", seed=2)]
    run = Run(previous_baseline())
    run.windows(pods, 1, healthy(pods))
    assert run.state.baseline is None and run.memory.forming_windows == 1
    run.windows(pods, 1, healthy(pods))
    base = run.state.baseline
    assert base is not None and run.state.baselines.keys() == {"1", "2"}
    # lognormal(sigma 0.25) p95 = 1.51 x the median, as histogram_quantile reads it: inside its bucket
    assert 0.25 < base.p95[sh.TTFT]["general"] <= 0.5 and 0.02 < base.p95[sh.TPOT]["general"] <= 0.04
    assert base.error_rate == 0.0 and base.load == pytest.approx(15 / DT, rel=0.1)
    # Healthy traffic after it: fine windows, no action.
    run.windows(pods, 3, healthy(pods))
    assert run.names == []
    assert {j.verdict for j in run.judged(sh.TTFT)} == {drift.FINE}


def test_a_window_with_too_few_requests_gets_no_verdict():
    pods, run = two_healthy_windows()
    # A trickle, ten times slower: after 4 windows still under minRequests, dropped unjudged.
    run.windows(pods, 4, healthy(pods, per_pod=0))
    trickle = healthy(pods, per_pod=1, ttft=2.0, tpot=0.2)
    for i in range(int(4 * DRIFT.window_seconds / DT)):
        if i % 4 == 0:
            trickle()
        run.observe(pods)
    late = [j for o in run.outcomes[-40:] for j in o.serving.judged]
    assert late and {j.verdict for j in late} == {drift.NO_EVIDENCE}
    assert run.names == [] and not run.state.streaks


def test_a_slower_time_to_first_token_sustained_rolls_back_when_the_previous_release_was_faster():
    pods, run = two_healthy_windows()
    run.windows(pods, 1, healthy(pods, ttft=0.8))
    assert run.names == [] and run.state.streaks == {"ttft:general": 1, "ttft:*": 1}
    run.windows(pods, 1, healthy(pods, ttft=0.8))
    # TTFT alone, acceptance not fallen: not speculation's doing, so straight to the rollback.
    assert run.names == [drift.ROLLBACK]
    reason = run.outcomes[-1].drift.reason
    assert "TTFT" in reason and "v1 was faster" in reason
    assert not run.state.streaks   # the step starts the evidence afresh


def test_slower_tokens_while_speculating_turn_speculation_off_then_roll_back_if_it_persists():
    pods, run = two_healthy_windows()
    run.windows(pods, 2, healthy(pods, tpot=0.06))
    assert run.names == [drift.SPECULATION_OFF] and not run.speculating
    assert "TPOT" in run.outcomes[-1].drift.reason
    run.windows(pods, 2, healthy(pods, tpot=0.06))    # target-only and still slow
    assert run.names == [drift.SPECULATION_OFF, drift.ROLLBACK]


def test_slower_tokens_that_speculation_off_cures_stay_off_without_rollback():
    pods, run = two_healthy_windows()
    run.windows(pods, 2, healthy(pods, tpot=0.06))
    run.windows(pods, 2, healthy(pods))
    assert run.names == [drift.SPECULATION_OFF]


def test_a_transient_slowdown_takes_no_step():
    pods, run = two_healthy_windows()
    for _ in range(3):
        run.windows(pods, 1, healthy(pods, ttft=0.8, tpot=0.06))
        run.windows(pods, 1, healthy(pods))
    assert run.names == []
    assert sum(j.verdict == drift.BREACH for j in run.judged(sh.TTFT)) == 6   # breached, never twice in a row


def test_no_latency_rollback_without_a_measured_previous_release():
    pods = [Pod("a"), Pod("b", seed=2)]
    run = Run(previous=None)
    run.windows(pods, 4, lambda: healthy(pods)() if run.state.baseline is None else healthy(pods, ttft=0.8)())
    assert run.names == []
    assert "v1's latency was not measured" in run.outcomes[-1].drift.reason


def test_a_sustained_breach_is_heard_between_windows_until_a_window_says_otherwise():
    pods, run = two_healthy_windows(Run(previous=None))
    run.windows(pods, 2, healthy(pods, ttft=0.8))      # sustained; v1 not measured: no step
    between = run.observe(pods)                        # no window closes
    assert not between.serving.judged and between.serving.pressure is not None
    assert run.names == [] and "v1's latency was not measured" in between.drift.reason
    run.windows(pods, 1, healthy(pods))                # a fine window ends it
    assert run.observe(pods).serving.pressure is None


@pytest.mark.parametrize("previous_ttft, helps", [(0.2, True), (0.8, False)])
def test_rollback_helps_only_when_the_previous_release_was_faster(previous_ttft, helps):
    pods, run = two_healthy_windows(Run(previous_baseline(ttft=previous_ttft)))
    run.windows(pods, 2, healthy(pods, ttft=0.8))
    assert run.names == ([drift.ROLLBACK] if helps else [])
    if not helps:
        assert "no rollback: v1 was not faster" in run.outcomes[-1].drift.reason


# -- errors ----------------------------------------------------------------------------------------

def test_a_sustained_error_rate_rolls_back_directly():
    pods, run = two_healthy_windows()
    run.windows(pods, 2, healthy(pods, error_rate=0.15))
    assert run.names == [drift.ROLLBACK]               # no SpeculationOff first
    assert run.drift_state.steps_taken == len(DRIFT.ladder)
    assert "error rate" in run.outcomes[-1].drift.reason and "v1 failed 0.000" in run.outcomes[-1].drift.reason


def test_errors_are_judged_before_there_is_a_latency_baseline_and_need_a_release_to_go_back_to():
    pods = [Pod("a"), Pod("b", seed=2)]
    run = Run(previous_version=None)
    run.windows(pods, 2, healthy(pods, error_rate=0.15))
    assert run.state.baseline is None                   # unhealthy windows make no baseline
    assert [j.verdict for j in run.judged(sh.ERRORS) if j.category == drift.OVERALL] == [drift.BREACH] * 2
    assert run.names == [] and "no previous release" in run.outcomes[-1].drift.reason


def test_an_error_rate_within_the_limit_is_never_a_breach_and_a_burst_is_not_sustained():
    pods, run = two_healthy_windows()
    run.windows(pods, 6, healthy(pods, error_rate=0.015))    # below maxErrorRate 0.02, noisy
    assert drift.BREACH not in {j.verdict for j in run.judged(sh.ERRORS)}
    run.windows(pods, 1, healthy(pods, error_rate=0.3))      # one bad window
    run.windows(pods, 2, healthy(pods))
    assert run.names == []
    assert [j.verdict for j in run.judged(sh.ERRORS) if j.category == drift.OVERALL][-3:] == \
        [drift.BREACH, drift.FINE, drift.FINE]


# -- traffic shift and restarts ----------------------------------------------------------------------

def test_traffic_shift_a_new_category_and_a_new_mix_are_not_breaches():
    pods = [Pod("a"), Pod("b", seed=2)]
    run = Run(previous_baseline())

    def mixed(slow_share: int, fast_share: int, new: int = 0):
        def traffic():
            for p in pods:
                p.serve("chat", fast_share, ttft=0.1, tpot=0.01)
                p.serve("summarise", slow_share, ttft=1.0, tpot=0.05)
                if new:
                    p.serve("agents", new, ttft=5.0, tpot=0.2)
        return traffic
    run.windows(pods, 2, mixed(5, 10))
    base = run.state.baseline
    assert set(base.p95[sh.TTFT]) == {"chat", "summarise"}
    # Mostly the slow category now, and a category never seen: each category against its own baseline.
    run.windows(pods, 4, mixed(12, 2, new=3))
    assert run.names == []
    assert {j.verdict for j in run.judged(sh.TTFT) if j.category == drift.OVERALL} == {drift.FINE}
    assert "agents" not in {j.category for j in run.judged(sh.TTFT)}
    assert run.outcomes[-1].serving.shift == {"agents": 6}


def test_a_load_shift_is_reported_not_judged():
    pods, run = two_healthy_windows()
    run.windows(pods, 3, healthy(pods, per_pod=45, ttft=0.8))   # three times the load, queueing
    assert run.names == []
    assert {j.verdict for j in run.judged(sh.TTFT)[-6:]} == {sh.SHIFTED}
    assert "load shift" in run.judged(sh.TTFT)[-1].message()


def test_a_pod_restart_counts_only_what_it_served_since():
    pods, run = two_healthy_windows()
    traffic = healthy(pods)
    for i in range(int(2 * DRIFT.window_seconds / DT)):
        if i == 5:
            pods[0].restart(run.now + 1.0)      # counters start again from zero
        traffic()
        run.observe(pods)
    assert run.names == []
    errors = [j for j in run.judged(sh.ERRORS) if j.category == drift.OVERALL]
    assert all(j.requests > 0 for j in errors)
    # Every request served after the baseline was counted once, the restarted pod's included.
    assert sum(j.requests for j in errors[2:]) == 2 * 15 * 20
    assert {j.verdict for j in run.judged(sh.TTFT)} == {drift.FINE}


def test_a_slow_pod_beside_a_restarting_one_is_still_caught():
    pods, run = two_healthy_windows()
    for i in range(int(2 * DRIFT.window_seconds / DT)):
        if i % 4 == 0:
            pods[1].restart(run.now + 1.0)
        pods[0].serve("general", 15, ttft=1.2)
        pods[1].serve("general", 15)
        run.observe(pods)
    assert run.names == [drift.ROLLBACK]


# -- state, policy and the ladder's other inputs ---------------------------------------------------

def test_state_round_trips_through_status_and_keeps_the_newest_baselines():
    b = sh.Baseline({sh.TTFT: {"code": 0.25}, sh.TPOT: {"code": 0.03}}, 0.01, 1.5, 600)
    state = sh.ServingState("4", {"ttft:code": 1}, {"1": b, "2": b, "3": b})
    assert sh.ServingState.for_release(state.as_dict(), "4") == state
    promoted = sh.ServingState.for_release(state.as_dict(), "5")
    assert promoted.streaks == {} and promoted.baseline is None and set(promoted.baselines) == {"1", "2", "3"}
    assert set(promoted.with_baseline(b).baselines) == {"2", "3", "5"}   # BASELINES_KEPT newest
    # A rollback to 3 judges it against what it measured when it served.
    assert sh.ServingState.for_release(state.as_dict(), "3").baseline == b


def test_the_newest_baselines_are_kept_by_version_number_as_status_sorts_its_keys_as_strings():
    b = sh.Baseline({sh.TTFT: {"code": 0.25}, sh.TPOT: {"code": 0.03}}, 0.01, 1.5, 600)
    # Status as the API server returns it: an object's keys sorted as strings (Go's encoding/json).
    stored = sh.ServingState("10", {}, {"10": b, "8": b, "9": b}).as_dict()
    promoted = sh.ServingState.for_release(stored, "11").with_baseline(b)
    assert set(promoted.baselines) == {"9", "10", "11"}   # v10, the rollback target, is kept


def test_latency_defaults_come_from_the_crd_and_the_spec_overrides_them():
    from specpair_operator.crd.validation import latency_defaults
    d = latency_defaults()
    assert (POLICY.ttft_p95_ratio, POLICY.tpot_p95_ratio, POLICY.max_error_rate, POLICY.min_requests) == \
        (d["ttftP95Ratio"], d["tpotP95Ratio"], d["maxErrorRate"], d["minRequests"])
    assert sh.LatencyPolicy.from_spec({"latency": {"tpotP95Ratio": 3}}).tpot_p95_ratio == 3.0


@pytest.mark.parametrize("latency, refused", [
    ({}, False),
    ({"ttftP95Ratio": 1.5, "tpotP95Ratio": 1.2, "maxErrorRate": 0.0, "minRequests": 10}, False),
    ({"ttftP95Ratio": 1.0}, True),
    ({"tpotP95Ratio": 0.5}, True),
    ({"maxErrorRate": 1.0}, True),
    ({"minRequests": 5}, True),
])
def test_the_operator_refuses_latency_thresholds_the_crd_refuses(latency, refused):
    from specpair_operator.crd.validation import validate_spec
    errors = validate_spec({"target": {"source": "default"}, "draft": {"drafter": "ngram"},
                            "drift": {"latency": latency}})
    assert bool(errors) == refused, errors


def test_acceptance_that_fell_puts_a_ttft_breach_on_speculation():
    b = sh.Baseline({sh.TTFT: {"general": 0.3}, sh.TPOT: {"general": 0.03}}, 0.0, 1.0, 600)
    breach = sh.Judgement(sh.TTFT, "general", drift.BREACH, 300, 0.4, 0.3, 0.05, 0.9, 0.3, 0.6, True)
    state = sh.ServingState("2", {}, {"1": b, "2": b})
    kw = dict(previous_version="1")
    assert sh._pressure([breach], state, POLICY, speculating=True, acceptance_fell=True, **kw).first == \
        drift.SPECULATION_OFF
    assert sh._pressure([breach], state, POLICY, speculating=True, acceptance_fell=False, **kw).first == drift.ROLLBACK
    assert sh._pressure([breach], state, POLICY, speculating=False, acceptance_fell=True, **kw).first == drift.ROLLBACK


def test_acceptance_drift_goes_before_serving_pressure_and_none_changes_nothing():
    pressure = drift.ServingPressure(drift.ROLLBACK, "errors", True, "v1 did better")
    # No observation, nothing sustained: the serving pressure alone decides.
    d = drift.decide(DRIFT, drift.DriftState(), drift.Memory(), 30.0, [], {"general": 0.5}, serving=pressure)
    assert d.action == drift.ROLLBACK and d.state.steps_taken == 2
    off = drift.ServingPressure(drift.SPECULATION_OFF, "tpot", True, "v1 did better")
    d = drift.decide(DRIFT, drift.DriftState(), drift.Memory(), 30.0, [], {"general": 0.5}, serving=off)
    assert d.action == drift.SPECULATION_OFF and d.state.steps_taken == 1
    ladder_off_only = drift.DriftPolicy(ladder=(drift.SPECULATION_OFF,))
    d = drift.decide(ladder_off_only, drift.DriftState(), drift.Memory(), 30.0, [], {"general": 0.5}, serving=pressure)
    assert d.action is None
    assert drift.decide(DRIFT, drift.DriftState(), drift.Memory(), 30.0, [], {"general": 0.5}).action is None
