"""The drift chapter's pieces without a cluster: the traffic a domain shift sends, what the
rollback rule allows from the two gates, the ladder read from recorded pair statuses, and what
the report shows of it."""

import pytest

from demo import traffic
from demo.chapters.releases import demo_pair, second_release
from demo.chapters.traffic_shift import shift_prompts
from demo.learning import TOLERANCE
from demo.ladder import BREACH, DECIDED, OFF, PROBE, Ladder, domain_shift_prompts, rollback_prediction
from demo.report import drift_section
from demo.run_demo import build_parser
from demo.settings import DRIFT
from demo.timeline import Sample, Timeline


def verdict(**rates):
    return {"categories": {c: {"acceptanceRate": r} for c, r in rates.items()}}


def pair(*history, reason="", probing=False, serving="2", phase="Serving"):
    conditions = [{"type": "Drifted", "status": "True", "reason": reason, "message": f"{reason}: numbers"}] if reason else []
    return {"status": {"history": [{"action": a, "reason": f"{a} because", "fromVersion": "2", "toVersion": "1"}
                                   for a in history],
                       "conditions": conditions, "drift": {"probing": probing}, "servingVersion": serving,
                       "phase": phase}}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_domain_shift_sends_the_gated_label_with_content_that_copies_nothing():
    prompts = domain_shift_prompts("extraction")
    assert {c for c, _ in prompts} == {"extraction"}
    assert [p for _, p in prompts] == [p for _, p in traffic.CREATIVE]
    # None of it is document work: no prompt carries a text to copy from.
    assert not {p for _, p in prompts} & {p for _, p in traffic.COPYING}


def test_drift_breaches_set_the_pairs_ladder_pace_and_refuse_what_the_crd_would():
    assert demo_pair(build_parser().parse_args(["--no-learning"]))["spec"]["drift"] == DRIFT
    assert demo_pair(build_parser().parse_args(["--no-learning", "--drift-breaches", "1"]))["spec"]["drift"] == \
        {**DRIFT, "consecutiveBreaches": 1}
    # With the learning loop (the default) only the tolerance differs (tests/demo/test_demo_learning_chapter.py).
    assert demo_pair(build_parser().parse_args(["--drift-breaches", "1"]))["spec"]["drift"] == \
        {**DRIFT, "consecutiveBreaches": 1, "tolerance": TOLERANCE}
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--drift-breaches", bad])


def test_ngram_v2_is_document_work_with_a_fixed_long_k_and_keeps_creative_ungated():
    args = build_parser().parse_args([])
    v1 = demo_pair(args)
    v2, what = second_release(v1, args, None)
    assert {p["category"] for p in v1["spec"]["gating"]["prompts"]} == {"extraction", "creative"}
    assert {p["category"] for p in v2["gating"]["prompts"]} == {"extraction", "summarisation"}
    assert v2["speculation"]["k"] == 8 and v2["speculation"]["dynamicK"] is False
    assert v2["speculation"]["fallbackThreshold"] == 0.0
    assert "k 8" in what
    # Step 5's traffic shift is still a category v2 never measured.
    assert {c for c, _ in shift_prompts(v2)} == {"creative"}


def test_rollback_prediction_follows_the_rule_for_the_same_models():
    # floor(0.75) = 0.75 * 0.8 - 0.02 = 0.58 > 0.55: possible.
    ok, why = rollback_prediction(DRIFT, verdict(extraction=0.55), verdict(extraction=0.75), "extraction")
    assert ok and "0.580" in why, why
    # Gated alike: the rule reads the drop as the traffic's.
    ok, why = rollback_prediction(DRIFT, verdict(extraction=0.7), verdict(extraction=0.75), "extraction")
    assert not ok and "SpeculationOff and probes only" in why, why
    ok, why = rollback_prediction(DRIFT, verdict(extraction=0.5), verdict(creative=0.9), "extraction")
    assert not ok and "not gated" in why


def test_ladder_climbs_off_probe_rollback_and_serving_with_times():
    clock = Clock()
    ladder = Ladder(before=2, to_version="1", clock=clock)
    older = ("Promoted", "Promoted")           # before the chapter: not counted
    assert ladder.update(pair(*older)) == 0
    clock.t = 20
    assert ladder.update(pair(*older, reason="AcceptanceBelowBaseline")) == 1
    clock.t = 30
    assert ladder.update(pair(*older, "SpeculationOff", reason="SpeculationOff")) == 2
    clock.t = 45
    assert ladder.update(pair(*older, "SpeculationOff", reason="SpeculationOff", probing=True)) == 3
    assert ladder.rolled_back is None
    clock.t = 70
    assert ladder.update(pair(*older, "SpeculationOff", "RolledBack", phase="RollingOut", serving="1")) == 4
    assert ladder.rolled_back is True and ladder.decision == "RolledBack because"
    assert not ladder.done()
    clock.t = 90
    assert ladder.update(pair(*older, "SpeculationOff", "RolledBack", phase="Degraded", serving="1")) == 5
    assert ladder.done()
    assert ladder.rows() == [(20, BREACH), (30, OFF), (45, PROBE), (70, "rolled back to v1"),
                             (90, "v1 serving, identity verified")]


def test_ladder_counts_a_probe_it_did_not_see_when_a_rollback_followed_speculation_off():
    clock = Clock()
    ladder = Ladder(before=0, to_version="1", clock=clock)
    clock.t = 5
    assert ladder.update(pair("SpeculationOff", "RolledBack", serving="1")) == 5
    assert [stage for _, stage in ladder.rows()][:3] == [BREACH, OFF, PROBE]


def test_ladder_ends_without_a_rollback_when_the_operator_says_it_would_not_help():
    clock = Clock()
    ladder = Ladder(before=0, to_version="1", clock=clock)
    # RollbackWouldNotHelp before any probe cannot end it (it would be an older verdict).
    assert ladder.update(pair("SpeculationOff", reason="RollbackWouldNotHelp")) == 2
    clock.t = 12
    assert ladder.update(pair("SpeculationOff", reason="SpeculationOff", probing=True)) == 3
    clock.t = 40
    assert ladder.update(pair("SpeculationOff", reason="RollbackWouldNotHelp", probing=True)) == 5
    assert ladder.rolled_back is False and ladder.decision == "RollbackWouldNotHelp: numbers"
    # The last stage the chapter's wait prints is this road's (it printed "v1 serving, identity
    # verified" here, a label of the rollback road, in the default demo of 2026-12-07).
    assert ladder.stages[-1] == "v2 keeps serving target-only on the shifted traffic (no rollback)"
    rows = [stage for _, stage in ladder.rows()]
    assert rows == [BREACH, OFF, PROBE, "no rollback (Drifted: RollbackWouldNotHelp)"]
    assert DECIDED not in rows and not any("serving" in r for r in rows)


def test_ladder_expecting_a_rollback_waits_for_the_probe_before_a_no_rollback_verdict():
    # CI, 2026-12-07: a serving-latency RollbackWouldNotHelp set a second before SpeculationOff
    # stayed on the Drifted condition while the probe ran; the operator rolled back 4 s later.
    clock = Clock()
    ladder = Ladder(before=0, to_version="1", clock=clock, rollback_expected=True)
    clock.t = 12
    assert ladder.update(pair("SpeculationOff", reason="RollbackWouldNotHelp", probing=True)) == 3
    assert ladder.rolled_back is None
    clock.t = 16
    assert ladder.update(pair("SpeculationOff", "RolledBack", reason="RollbackWouldNotHelp", serving="1")) == 5
    assert ladder.rolled_back is True
    # The probe over without a rollback: that is the decision, expected or not.
    ended = Ladder(before=0, to_version="1", clock=clock, rollback_expected=True)
    assert ended.update(pair("SpeculationOff", reason="SpeculationOff", probing=True)) == 3
    assert ended.update(pair("SpeculationOff", reason="RollbackWouldNotHelp", probing=False)) == 5
    assert ended.rolled_back is False


def test_report_shows_the_domain_shift_and_every_ladder_step():
    page = drift_section({"policy": DRIFT, "domainShift": {"category": "extraction", "gatedV2": 0.55, "gatedV1": 0.75,
                                                           "prediction": "a rollback is possible: numbers"},
                          "ladder": {"chapter": "domain shift", "requests": 30, "drafted": 400, "acceptance": 0.1,
                                     "decision": "the previous release does better",
                                     "timeline": [(20, BREACH), (30, OFF), (45, PROBE), (70, "rolled back to v1")]}})
    assert "Domain shift" in page and "55%" in page and "75%" in page and "a rollback is possible" in page
    for step in (BREACH, OFF, PROBE, "rolled back to v1"):
        assert step in page
    assert "45.0 s" in page and "the previous release does better" in page


def test_speculation_off_spans_skip_unreachable_samples():
    def s(t, spec, version="2"):
        return Sample(t, version, spec, {}, "Serving", "2", None)
    tl = Timeline(samples=[s(0, True), s(1, False), s(2, None, ""), s(3, False), s(4, True), s(5, False), s(6, False)])
    assert tl.speculation_off_spans() == [(1, 4), (5, 6)]


@pytest.mark.parametrize("judged", [True, False])
def test_report_says_whether_a_gated_window_was_judged_beside_the_traffic_shift(judged):
    page = drift_section({"policy": DRIFT, "trafficShift": {
        "category": "translation", "requests": 40, "seconds": 30.0, "trafficShift": {"translation": 120},
        "liveAcceptance": {"code": 0.7} if judged else None, "actions": [], "windowJudged": judged}})
    assert "Traffic shift" in page and "operator actions: none" in page
    assert ("a gated window was judged meanwhile" in page) is judged
    assert ("no gated window was judged meanwhile" in page) is not judged
