"""The drift decision (specpair_operator.policy.drift.decide) on the traffic that fooled the previous
policy: each scenario is a list of observations of the engine pods, replayed as the operator
would every 30 s. Pure: no servers."""

from __future__ import annotations

import random

import pytest
from specpair.stats import RequestMoments

from specpair_operator.policy import drift

DT = 30.0
BASE = {drift.OVERALL: 0.5, "code": 0.5, "creative": 0.2, "extraction": 0.6}
PREVIOUS = {drift.OVERALL: 0.5, "code": 0.5, "creative": 0.2, "extraction": 0.6}


class Pod:
    """One engine pod's cumulative counters (per category: drafted, accepted, requests and the
    per-request sums), as GetStats would report them."""

    def __init__(self, name: str, uid: str = "uid-1", started: float = 0.0, moments: bool = True):
        self.name, self.uid, self.started, self.moments = name, uid, started, moments
        self.cats: dict[str, RequestMoments] = {}
        self.speculating = True

    def serve(self, category: str, requests: int, drafted_each: int, acceptance: float, jitter: float = 0.1,
              rng: random.Random | None = None) -> None:
        rng = rng or random.Random(7)
        self.cats.setdefault(category, RequestMoments.zero())
        for _ in range(requests):
            if not self.speculating:
                continue
            d = drafted_each
            a = round(d * min(1.0, max(0.0, acceptance + rng.uniform(-jitter, jitter))))
            self.cats[category] += RequestMoments.of_request(d, a)

    def restart(self, at: float) -> None:
        self.started, self.cats = at, {}

    def stats(self) -> drift.PodStats:
        cats = {k: v if self.moments else RequestMoments(v.drafted, v.accepted) for k, v in self.cats.items()}
        return drift.PodStats(f"{self.name}/{self.uid}", cats, self.started)


class Run:
    """Replays observations through the new decision; records the actions."""

    def __init__(self, policy: drift.DriftPolicy | None = None, baseline=BASE, previous=PREVIOUS, same_models=False):
        self.policy = policy or drift.DriftPolicy()
        self.baseline, self.previous, self.same_models = baseline, previous, same_models
        self.state, self.memory = drift.DriftState(), drift.Memory()
        self.now = 0.0
        self.actions: list[tuple[str, float]] = []
        self.decisions: list[drift.Decision] = []

    def observe(self, pods: list[Pod]) -> drift.Decision:
        self.now += DT
        d = drift.decide(self.policy, self.state, self.memory, self.now, [p.stats() for p in pods],
                         self.baseline, self.previous, self.same_models)
        self.state, self.memory = d.state, d.memory
        for p in pods:
            p.speculating = d.speculation
        if d.action:
            self.actions.append((d.action, self.now))
        self.decisions.append(d)
        return d

    @property
    def names(self) -> list[str]:
        return [a for a, _ in self.actions]


def steady(run: Run, pods: list[Pod], minutes: float, traffic) -> None:
    for _ in range(int(minutes * 60 / DT)):
        traffic(run.now)
        run.observe(pods)


# -- the defects of the previous policy --------------------------------------------------------------

def test_one_burst_is_one_window_and_never_a_rollback():
    # Before: a 300 s window re-judged every 30 s counted one 30 s burst ten times
    # (SpeculationOff at +60 s, Rollback at +150 s).
    pod, run = Pod("engine-0"), Run()
    run.observe([pod])
    pod.serve("code", 60, 40, 0.10)                 # one 30 s burst of bad requests, then idle
    steady(run, [pod], 30, lambda t: None)
    assert run.actions == []


def test_one_long_request_on_an_idle_pair_decides_nothing():
    pod, run = Pod("engine-0"), Run()
    run.observe([pod])
    pod.serve("code", 1, 250, 0.10, jitter=0)
    steady(run, [pod], 60, lambda t: None)
    assert run.actions == []
    # Kept waiting for evidence, then dropped as "no evidence": never a breach.
    verdicts = [j.verdict for d in run.decisions for j in d.judged]
    assert drift.BREACH not in verdicts and drift.NO_EVIDENCE in verdicts


def test_one_long_request_among_healthy_traffic_cannot_make_a_breach():
    pod, run = Pod("engine-0"), Run()
    run.observe([pod])

    def traffic(t):
        pod.serve("code", 3, 40, 0.5)
        if int(t) % 300 == 0:
            pod.serve("code", 1, 4000, 0.02, jitter=0)   # token-weighted, it would pull code to ~0.2
    steady(run, [pod], 60, traffic)
    assert run.actions == []


def test_after_speculation_off_windows_without_drafts_are_no_evidence():
    # Before: once off, every undrafted window counted as a breach: rollback was unconditional.
    pod, run = Pod("engine-0"), Run()
    run.observe([pod])
    steady(run, [pod], 15, lambda t: pod.serve("code", 5, 40, 0.10))
    assert run.names == [drift.SPECULATION_OFF]
    # Speculation is off and the engine does not probe by itself; the operator's probes find
    # no traffic either (the pair went idle): nothing is judged, nothing is rolled back.
    steady(run, [pod], 120, lambda t: None)
    assert run.names == [drift.SPECULATION_OFF]
    assert all(j.verdict == drift.NO_EVIDENCE for d in run.decisions[30:] for j in d.judged)


def test_rollback_needs_fresh_evidence_after_speculation_off():
    pod, run = Pod("engine-0"), Run()
    run.observe([pod])
    steady(run, [pod], 15, lambda t: pod.serve("code", 5, 40, 0.10))
    off_at = run.actions[0][1]
    probes = []

    def traffic(t):
        pod.serve("code", 5, 40, 0.10)   # drafts only while speculation is on (a probe)
        probes.append(pod.speculating)
    steady(run, [pod], 60, traffic)
    assert run.names == [drift.SPECULATION_OFF, drift.ROLLBACK]
    rollback = next(d for d in run.decisions if d.action == drift.ROLLBACK)
    assert "previous release does better" in rollback.reason
    # the evidence came from a probe, after a quiet stretch of probe_after_windows windows
    assert run.actions[1][1] - off_at >= run.policy.probe_after_windows * run.policy.window_seconds
    assert False in probes and True in probes


def test_speculation_comes_back_when_the_probe_finds_acceptance_recovered():
    pod, run = Pod("engine-0"), Run()
    run.observe([pod])
    steady(run, [pod], 15, lambda t: pod.serve("code", 5, 40, 0.10))
    steady(run, [pod], 60, lambda t: pod.serve("code", 5, 40, 0.50))
    assert run.names == [drift.SPECULATION_OFF, drift.SPECULATION_ON]
    assert run.decisions[-1].speculation is True and run.state.steps_taken == 0


def test_an_engine_that_probes_by_itself_is_never_probed_by_the_operator():
    pod, run = Pod("engine-0"), Run()
    run.observe([pod])
    steady(run, [pod], 15, lambda t: pod.serve("code", 5, 40, 0.10))

    def engine_probe(t):   # a few requests drafted although speculation is off
        was = pod.speculating
        pod.speculating = True
        pod.serve("code", 5, 40, 0.10)
        pod.speculating = was
    steady(run, [pod], 20, engine_probe)
    assert run.names == [drift.SPECULATION_OFF, drift.ROLLBACK]
    off = next(i for i, d in enumerate(run.decisions) if d.action == drift.SPECULATION_OFF)
    rollback = next(i for i, d in enumerate(run.decisions) if d.action == drift.ROLLBACK)
    assert not any(d.speculation for d in run.decisions[off:rollback])


def test_a_category_the_gate_never_saw_is_a_traffic_shift_not_a_regression():
    pod, run = Pod("engine-0"), Run()
    run.observe([pod])

    def traffic(t):
        pod.serve("code", 2, 40, 0.5)
        pod.serve("poetry", 20, 60, 0.05)
    steady(run, [pod], 60, traffic)
    assert run.actions == []
    assert run.decisions[-1].shift["poetry"] > 0


def test_more_traffic_of_a_hard_gated_category_is_not_drift():
    pod, run = Pod("engine-0"), Run()
    run.observe([pod])
    steady(run, [pod], 60, lambda t: pod.serve("creative", 20, 40, 0.2))
    assert run.actions == []


def test_a_low_baseline_category_falling_from_020_to_006_is_caught():
    # Before: an absolute allowance of 0.15 left a floor of 0.05 under a category gated at 0.20.
    pod, run = Pod("engine-0"), Run()
    run.observe([pod])

    def traffic(t):
        pod.serve("code", 5, 40, 0.5)
        pod.serve("creative", 5, 40, 0.06, jitter=0.05)
    steady(run, [pod], 60, traffic)
    assert run.names == [drift.SPECULATION_OFF, drift.ROLLBACK]
    first = next(d for d in run.decisions if d.action == drift.SPECULATION_OFF)
    assert "category 'creative'" in first.reason and "category 'code'" not in first.reason


def test_a_drifted_pod_is_seen_while_a_healthy_pod_flaps():
    # Before: lifetime counters were summed over the ready pods. A healthy pod dropping out of
    # the ready set made the sum go backwards (read as a restart); coming back, it added its
    # whole lifetime of good acceptance to the window, which hid the drifted pod.
    bad, flappy, run = Pod("engine-0", "a"), Pod("engine-1", "b"), Run()
    flappy.serve("code", 2000, 40, 0.5)
    steps = iter(range(10_000))

    def observe_flapping():
        run.now_pods = [bad, flappy] if next(steps) % 2 else [bad]
    for _ in range(int(30 * 60 / DT)):
        bad.serve("code", 5, 40, 0.05)
        flappy.serve("code", 1, 40, 0.5)
        observe_flapping()
        run.observe(run.now_pods)
    assert run.names[:1] == [drift.SPECULATION_OFF]
    # and one restart of a pod never makes a window of its lifetime counters
    d = drift.pod_deltas({"engine-1/b": drift.PodStats("engine-1/b", {"code": RequestMoments(10, 5)}, 0.0)}, 100.0,
                         [drift.PodStats("engine-1/b", {"code": RequestMoments(5, 5)}, 0.0)])
    assert d["code"] == RequestMoments(5, 5)


def test_counters_are_per_pod_and_restarts_start_a_series_afresh():
    a = drift.PodStats("engine-0/a", {"code": RequestMoments(1000, 500, 10)}, started=100.0)
    b = drift.PodStats("engine-1/b", {"code": RequestMoments(5000, 2500, 50)}, started=100.0)
    prev = {p.pod: p for p in (a, b)}
    # b restarted (its counters went backwards): everything it reports now is new
    b2 = drift.PodStats("engine-1/b", {"code": RequestMoments(40, 4, 1)}, started=100.0)
    a2 = drift.PodStats("engine-0/a", {"code": RequestMoments(1100, 550, 11)}, started=100.0)
    assert drift.pod_deltas(prev, 200.0, [a2, b2])["code"] == RequestMoments(140, 54, 2)
    # a restarted and already passed its old counts: its start time tells
    a3 = drift.PodStats("engine-0/a", {"code": RequestMoments(1200, 100, 12)}, started=250.0)
    assert drift.pod_deltas(prev, 200.0, [a3])["code"] == RequestMoments(1200, 100, 12)
    # a replaced pod (new uid) started after the last look: all of it is new; one seen for the
    # first time that started earlier only counts from now on
    c = drift.PodStats("engine-0/c", {"code": RequestMoments(30, 3, 1)}, started=210.0)
    d = drift.PodStats("engine-2/d", {"code": RequestMoments(900, 90, 9)}, started=50.0)
    assert drift.pod_deltas(prev, 200.0, [c, d]) == {"code": RequestMoments(30, 3, 1)}


# -- rollback only when it helps -------------------------------------------------------------------

def drive_to_rollback_decision(run: Run) -> None:
    pod = Pod("engine-0")
    run.observe([pod])
    steady(run, [pod], 80, lambda t: pod.serve("code", 5, 40, 0.20))


def test_no_rollback_when_the_previous_release_was_gated_no_better_than_what_serves_now():
    run = Run(previous={"code": 0.25, drift.OVERALL: 0.25})
    drive_to_rollback_decision(run)
    assert run.names == [drift.SPECULATION_OFF]
    assert any("would not do better" in d.reason for d in run.decisions)


def test_no_rollback_to_the_same_target_and_draft_gated_no_better():
    run = Run(previous={"code": 0.5, drift.OVERALL: 0.5}, same_models=True)
    drive_to_rollback_decision(run)
    assert run.names == [drift.SPECULATION_OFF]
    assert any("same target and draft" in d.reason for d in run.decisions)


def test_no_rollback_without_a_previous_verdict_and_on_categories_it_was_not_gated_on():
    run = Run(previous=None)
    drive_to_rollback_decision(run)
    assert run.names == [drift.SPECULATION_OFF]
    run = Run(previous={"extraction": 0.9})
    drive_to_rollback_decision(run)
    assert run.names == [drift.SPECULATION_OFF]
    assert any("not gated on code" in d.reason for d in run.decisions)


def test_rollback_when_the_previous_release_does_better_on_the_same_traffic():
    run = Run()
    drive_to_rollback_decision(run)
    assert run.names == [drift.SPECULATION_OFF, drift.ROLLBACK]


# -- statistics and configuration ----------------------------------------------------------------

def test_without_per_request_sums_the_bound_is_wider():
    full = RequestMoments(drafted=4000, accepted=1000, requests=100, drafted_sq=100 * 40.0 ** 2,
                          accepted_sq=100 * 10.0 ** 2, drafted_accepted=100 * 400.0)
    se_full, n_full = drift.standard_error(full, drift.DriftPolicy())
    se_req, n_req = drift.standard_error(RequestMoments(4000, 1000, 100), drift.DriftPolicy())
    se_none, n_none = drift.standard_error(RequestMoments(4000, 1000), drift.DriftPolicy())
    assert se_full < se_req < se_none and n_full == 100 and n_req < 100 and n_none < n_req


def test_a_breach_is_judged_against_a_relative_floor():
    policy = drift.DriftPolicy()
    assert policy.floor(0.2) == pytest.approx(0.2 * (1 - policy.tolerance) - policy.noise_allowance)
    assert policy.floor(0.8) == pytest.approx(0.8 * (1 - policy.tolerance) - policy.noise_allowance)


def test_ladder_with_rollback_only_and_speculation_off_only():
    run = Run(policy=drift.DriftPolicy(ladder=(drift.ROLLBACK,)))
    drive_to_rollback_decision(run)
    assert run.names == [drift.ROLLBACK]
    run = Run(policy=drift.DriftPolicy(ladder=(drift.SPECULATION_OFF,)))
    drive_to_rollback_decision(run)
    assert run.names == [drift.SPECULATION_OFF]


def test_policy_from_spec_and_state_round_trip():
    p = drift.DriftPolicy.from_spec({"tolerance": 0.25, "minRequests": 5, "windowSeconds": 60, "consecutiveBreaches": 3})
    assert (p.tolerance, p.min_requests, p.window_seconds, p.consecutive) == (0.25, 5, 60.0, 3)
    st = drift.DriftState(1, {"code": 2}, 1, 123.0)
    assert drift.DriftState.from_dict(st.as_dict()) == st
    assert st.as_dict()["breachesInRow"] == 2 and st.as_dict()["stepsTaken"] == 1
