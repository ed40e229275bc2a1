"""The canary's decisions (specpair_operator.policy.canary) as tables: candidate pods judged against
champion pods on errors, TTFT, TPOT and acceptance, step by step, as the operator observes them
every pass. Pure: no servers; the pods' counters use the engine's own histogram bounds."""

from __future__ import annotations

import random

import pytest

import engine_counters
from specpair_operator.policy import canary
from specpair_operator.desired import engine_objects
from specpair_operator.policy.drift import BREACH, FINE, OVERALL

DT = 10.0
POLICY = canary.Policy.from_spec({})
STEPS = (canary.Step(replicas=1, pause_seconds=30), canary.Step(share=1.0, pause_seconds=30))
DEADLINE = 600.0


class Pod:
    """One engine pod's cumulative counters as GetStats reports them (the probe's dict form)."""

    def __init__(self, name: str, seed: int, started: float = 0.0):
        self.name, self.started = name, started
        self.rng = random.Random(seed)
        self.errors = random.Random(seed + 1000)     # its own stream: failures independent of the rest
        self.serving: dict[str, dict] = {}
        self.acceptance: dict[str, dict] = {}

    def _cat(self, category: str) -> dict:
        self.acceptance.setdefault(category, engine_counters.acceptance())
        return self.serving.setdefault(category, engine_counters.serving())

    def serve(self, category: str, requests: int, ttft: float = 0.2, tpot: float = 0.02, error_rate: float = 0.0,
              acceptance: float = 0.6, drafted: int = 30) -> None:
        c = self._cat(category)
        for _ in range(requests):
            failed = self.errors.random() < error_rate
            engine_counters.finished(c, "error" if failed else "ok")
            if failed:
                continue
            engine_counters.latencies(c, self.rng, ttft, tpot, sigma=0.25)
            engine_counters.drafted(self.acceptance[category], self.rng, acceptance, drafted)

    def report(self, now: float) -> canary.PodReport:
        return canary.PodReport.from_stats(f"{self.name}/uid", {"categories": self.acceptance, "serving": self.serving,
                                                                "uptimeSeconds": now - self.started}, now)


def run(candidate: dict, passes: int, *, per_pass: int = 12, step: int = 0, champion: dict | None = None,
        start: float = 1000.0) -> list[canary.Decision]:
    """Two champion pods and one candidate pod serving `per_pass` requests each per pass (the
    Service's round robin), observed every DT seconds; the decision after each pass."""
    champs = [Pod("champion-a", 1), Pod("champion-b", 2)]
    cand = Pod("candidate", 3, started=start - 5)
    memory = canary.Memory().for_step("2", step)
    out = []
    for i in range(passes + 1):
        now = start + i * DT
        if i:
            for p in champs:
                p.serve("code", per_pass, **(champion or {}))
            cand.serve("code", per_pass, **candidate)
        memory = canary.observe(memory, now, [p.report(now) for p in champs], [cand.report(now)])
        if i:
            out.append(canary.decide(POLICY, STEPS, step, canary.judge(POLICY, memory), now - memory.since, DEADLINE))
    return out


def test_a_healthy_candidate_waits_out_its_pause_then_advances_and_at_the_last_step_is_promoted():
    decisions = run({}, 6)
    assert [d.action for d in decisions[:2]] == [canary.WAIT, canary.WAIT]   # 10 s, 20 s of a 30 s pause
    assert decisions[-1].action == canary.ADVANCE, decisions[-1].reason
    judged = {j.key: j for j in decisions[-1].judged}
    assert judged[f"errors:{OVERALL}"].verdict == FINE and judged[f"ttft:{OVERALL}"].verdict == FINE
    assert judged[f"acceptance:{OVERALL}"].verdict == FINE
    assert "TTFT" in decisions[-1].reason and "the champion's p95" in decisions[-1].reason
    last = run({}, 6, step=1)
    assert last[-1].action == canary.PROMOTE and last[-1].reason.startswith("all 2 step(s) healthy")


@pytest.mark.parametrize("candidate, metric", [
    ({"ttft": 1.5}, "ttft"),                    # a target seven times slower to first token
    ({"tpot": 0.08}, "tpot"),                   # ... or per output token
    ({"error_rate": 0.3}, "errors"),            # a third of its requests failed by the engine
    ({"acceptance": 0.2}, "acceptance"),        # its draft accepted far less than the champion's
])
def test_a_worse_candidate_is_aborted_before_its_pause_is_over_with_the_numbers(candidate, metric):
    # drift.latency.minRequests (50) by the third pass: the first pass finds the pods warm (their
    # baseline), the next two count 30 each.
    decisions = run(candidate, 3, per_pass=30)
    abort = next(d for d in decisions if d.action == canary.ABORT)
    assert decisions.index(abort) < 3            # before the 30 s pause ended
    assert abort.reason.startswith("candidate worse than the champion: category 'code'")
    breached = [j for j in abort.judged if j.verdict == BREACH]
    assert {j.metric for j in breached} == {metric}, abort.reason
    j = next(j for j in breached if j.category == "code")
    assert j.candidate is not None and j.champion is not None and j.requests >= 20
    if metric == "ttft":
        assert j.candidate > 2 * j.champion and "TTFT p95" in j.message and "champion p95" in j.message


def test_errors_are_judged_against_the_champions_rate_when_it_fails_more_than_the_limit():
    # Both fail 20%: not the candidate's fault, so no abort (the limit is the champion's rate then).
    decisions = run({"error_rate": 0.2}, 6, champion={"error_rate": 0.2})
    assert all(d.action != canary.ABORT for d in decisions), [d.reason for d in decisions]


def test_a_new_pods_first_requests_are_not_judged():
    """A candidate of the champion's very speed whose first requests are slow (a new pod's lazy
    loads; CI once aborted such a canary on TTFT p95 122 ms against 8.6 ms, judged from 10
    requests) passes; slow requests after its warm-up are judged and breach."""
    policy = canary.Policy.from_spec({"drift": {"latency": {"minRequests": 10}}})

    def judged(cold: int, at: int) -> canary.Decision:
        champs, cand = [Pod("champion-a", 1), Pod("champion-b", 2)], Pod("candidate", 3, started=995.0)
        for p in champs:
            p.serve("code", 100)          # warm long ago
        memory = canary.Memory().for_step("2", 0)
        for i in range(6):
            now = 1000.0 + i * DT
            for p in champs:
                p.serve("code", 10)
            if i == at:
                cand.serve("code", cold, ttft=3.0)
            cand.serve("code", 3 if i else 0)
            memory = canary.observe(memory, now, [p.report(now) for p in champs], [cand.report(now)])
        return canary.decide(policy, STEPS, 0, canary.judge(policy, memory), now - memory.since, DEADLINE)
    first = judged(cold=canary.WARM_UP_REQUESTS, at=1)
    assert first.action == canary.ADVANCE, first.reason
    late = judged(cold=2 * canary.WARM_UP_REQUESTS, at=3)
    assert late.action == canary.ABORT and "TTFT" in late.reason, late.reason


def test_too_little_traffic_waits_and_a_step_never_shown_healthy_aborts_after_the_deadline():
    decisions = run({}, 4, per_pass=1)
    assert all(d.action == canary.WAIT for d in decisions)
    assert "not yet judged fine" in decisions[-1].reason
    memory = canary.Memory(version="2", step=0, since=0.0)
    late = canary.decide(POLICY, STEPS, 0, canary.judge(POLICY, memory), 30 + DEADLINE, DEADLINE)
    assert late.action == canary.ABORT and "not shown healthy 600s after its pause" in late.reason


def test_a_restarted_candidate_pod_starts_its_series_afresh():
    champ, cand = Pod("champion", 1), Pod("candidate", 2)
    memory = canary.Memory().for_step("2", 0)
    for i, now in enumerate((100.0, 110.0, 120.0)):
        if i == 2:
            cand = Pod("candidate", 4, started=115.0)   # the process restarted: its counters begin again
        champ.serve("code", 10)
        cand.serve("code", 10)
        memory = canary.observe(memory, now, [champ.report(now)], [cand.report(now)])
    # First sight counts nothing; then 10; then the restarted pod's 10, not a negative difference.
    assert memory.candidate.finished == 20 and memory.champion.finished == 20
    assert memory.for_step("2", 0) is memory and memory.for_step("2", 1).candidate.finished == 0


@pytest.mark.parametrize("step, champion_replicas, expected", [
    (canary.Step(replicas=2), 5, 2),
    (canary.Step(share=0.2), 5, 1),
    (canary.Step(share=0.25), 5, 2),       # rounded up
    (canary.Step(share=0.1), 1, 1),        # at least one pod
    (canary.Step(share=1.0), 3, 3),
])
def test_a_step_gives_the_candidate_replicas_or_a_share_of_the_champions(step, champion_replicas, expected):
    assert step.candidate_replicas(champion_replicas) == expected
    assert canary.traffic_share(expected, champion_replicas) == pytest.approx(expected / (expected + champion_replicas))


def test_steps_come_from_the_spec_with_the_crds_default_pause():
    spec = {"rollout": {"strategy": {"type": "Canary", "steps": [{"replicas": 1}, {"share": 0.5, "pauseSeconds": 5}]}}}
    steps = canary.steps_of(spec)
    assert steps[0].replicas == 1 and steps[0].share is None and steps[0].pause_seconds == 60
    assert steps[1] == canary.Step(None, 0.5, 5.0)
    # None given: the CRD's default steps, by weight.
    assert [s.weight for s in canary.steps_of({})] == [5, 25, 50, 100]


@pytest.mark.parametrize("tag, expected", [
    ("passed: all 2 step(s) healthy", (canary.PASSED, "all 2 step(s) healthy")),
    ("aborted: candidate worse", (canary.ABORTED, "candidate worse")),
    ("", (None, "")),
])
def test_the_candidates_mark(tag, expected):
    assert canary.mark({canary.TAG_CANARY: tag} if tag else {}) == expected
    if tag:
        state, text = expected
        assert canary.mark(canary.mark_tag(state, text)) == expected


def test_the_canary_deployment_is_the_candidates_engine_behind_the_same_service_apart_from_the_champions():
    release = {"target": {"source": "default"}, "draft": {"drafter": "ngram"}, "speculation": {"k": 3},
               "gating": {}, "pair": "p", "version": "2"}
    champion = engine_objects.engine_deployment("p", "ns", release, "d" * 64, "2", {"replicas": 3}, "http://mlflow")
    dep = canary.canary_deployment(champion, "p-engine-canary", 2, 1)
    assert dep["metadata"]["name"] == "p-engine-canary" and dep["spec"]["replicas"] == 2
    assert dep["metadata"]["annotations"][canary.ANN_STEP] == "1"
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    service = engine_objects.engine_service("p", "ns", {})
    assert service["spec"]["selector"].items() <= pod_labels.items()          # the Service reaches its pods
    canary_selector = dep["spec"]["selector"]["matchLabels"]
    assert canary_selector.items() <= pod_labels.items()
    assert not canary_selector.items() <= champion["spec"]["template"]["metadata"]["labels"].items()
    assert canary.is_canary_pod({"metadata": {"labels": pod_labels}})
    assert not canary.is_canary_pod({"metadata": {"labels": champion["spec"]["template"]["metadata"]["labels"]}})
    assert champion["spec"]["replicas"] == 3 and champion["metadata"]["name"] == "p-engine"   # untouched
    live = {**dep, "metadata": {**dep["metadata"], "labels": {**dep["metadata"]["labels"]}}}
    assert canary.live_step(live, "2") == 1 and canary.live_step(live, "3") == -1
    assert canary.live_step({**live, "spec": {**live["spec"], "replicas": 0}}, "2") == -1


@pytest.mark.parametrize("strategy, message", [
    ({"type": "Canary", "steps": [{"replicas": 1}, {"share": 0.5, "pauseSeconds": 30}]}, None),
    ({"type": "Canary", "steps": [{"replicas": 1, "share": 0.5}]}, "a canary step gives one of replicas, share or weight"),
    ({"type": "Canary", "steps": [{"pauseSeconds": 30}]}, "a canary step gives one of replicas, share or weight"),
    ({"type": "Canary", "steps": [{"share": 0.0}]}, "a canary step's share is above 0 and at most 1"),
    ({"type": "Canary", "steps": [{"share": 1.5}]}, "a canary step's share is above 0 and at most 1"),
    ({"type": "Canary", "steps": [{"weight": 20}, {"weight": 100, "pauseSeconds": 30}]}, None),
    ({"type": "Canary", "steps": [{"weight": 20, "share": 0.2}]}, "a canary step gives one of replicas, share or weight"),
    ({"type": "Canary"}, "rollout.strategy.type Canary needs rollout.strategy.steps"),
    ({"type": "Canary", "steps": []}, "rollout.strategy.type Canary needs rollout.strategy.steps"),
    ({"type": "Replace"}, None),
])
def test_the_operators_check_of_canary_steps_words_them_as_the_crd_does(strategy, message):
    from specpair_operator.crd.validation import validate_spec

    errors = validate_spec({"target": {"source": "default"}, "draft": {"drafter": "ngram"},
                            "rollout": {"strategy": strategy}})
    assert (errors == []) if message is None else any(e.endswith(f"Invalid value: {message}") for e in errors), errors


def test_the_status_entry_writes_null_over_what_an_earlier_judgement_left():
    judged = (canary.Judged("ttft", "code", FINE, 0.02, 0.02, 50, "m"),)
    earlier = canary.status_entry("2", "1", "Progressing", 0, STEPS, 1, 1, "m", judged, "2026-11-26T00:00:00Z")
    now = canary.status_entry("3", "2", "Progressing", 0, STEPS, 1, 1, "m", previous=earlier)
    assert now["judged"] == {"ttft:code": None} and now["stepStartedAt"] is None and now["version"] == "3"
    assert earlier["judged"]["ttft:code"] == {"verdict": "fine", "requests": 50, "candidate": 0.02, "champion": 0.02}


@pytest.mark.parametrize("tpot, action", [(0.002, canary.ADVANCE), (0.0035, canary.ABORT)])
def test_at_a_gpus_step_times_tpot_tells_a_healthy_candidate_from_a_slower_one(tpot, action):
    """The champion's TPOT around 2 ms, as a GPU decodes: a candidate as fast advances, one 1.75x
    slower is aborted on TPOT at the default 1.5x (the engine's buckets lie 1.2-1.5x apart there;
    with bounds at 1, 2.5 and 5 ms both read alike)."""
    decisions = run({"tpot": tpot}, 6, champion={"tpot": 0.002}, per_pass=24)
    decided = next(d for d in decisions if d.action != canary.WAIT)
    assert decided.action == action, decided.reason
    if action == canary.ABORT:
        assert {j.metric for j in decided.judged if j.verdict == BREACH} == {"tpot"}, decided.reason
