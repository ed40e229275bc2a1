"""The domain shift chapter's learning loop without a cluster (the full demo runs it on the
devcluster: `bash scripts/demo.sh`): the pair the demo applies opts in to spec.learning as the
operator's validation admits it, its drift policy makes the operator's own rollback rule refuse a
rollback on the shift while v2 still breaches, the loop's stages read from recorded pair statuses
(and a loop that ends short says why), the acceptance figures, and the report's section."""

import pytest

from demo import learning
from demo.chapters.releases import demo_pair, second_release
from demo.ladder import rollback_prediction
from demo.learning import (DRIFTED, GATED, PROMOTED, REGISTERED, SERVING, SHADOWED, STAGES, TRAINING_STARTED, Loop,
                           acceptance)
from demo.report import learning_section
from demo.run_demo import build_parser
from demo.traffic import Answer
from specpair_operator.crd.validation import validate_spec
from specpair_operator.desired import training_job
from specpair_operator.policy import drift as drift_rule


def verdict(**rates):
    return {"categories": {c: {"acceptanceRate": r} for c, r in rates.items()}}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize("argv", [[], ["--no-learning"], ["--draft", "DRAFT"]])
def test_the_pair_opts_in_to_learning_only_for_the_ngram_domain_shift(argv, tmp_path):
    if argv[:1] == ["--draft"]:
        (tmp_path / "draft").mkdir()
        (tmp_path / "draft" / "config.json").write_text("{}")
        argv = ["--draft", str(tmp_path / "draft")]
    args = build_parser().parse_args(argv)
    v1 = demo_pair(args)
    v2, _ = second_release(v1, args, tmp_path / "models")
    assert validate_spec(v1["spec"]) == [] and validate_spec(v2) == []
    on = not argv
    assert ("learning" in v1["spec"]) is on and ("learning" in v2) is on
    floor = v2["gating"]["thresholds"]["minCategoryAcceptance"]["extraction"] if "gating" in v2 and \
        "minCategoryAcceptance" in v2["gating"]["thresholds"] else None
    if on:
        assert v2["learning"] == v1["spec"]["learning"] == {
            "enabled": True, "persistentVolumeClaim": learning.CLAIM, "sampleRate": 1.0,
            "training": {"method": "eagle3", "steps": 300, "activeDeadlineSeconds": 1100}}
        # The bench's budget: the training loop's 660 s is the Job's deadline x TRAINING_SHARE.
        settings = training_job.TrainingSettings.from_spec(v1["spec"]["learning"])
        assert (settings.method, settings.steps, settings.max_seconds) == ("eagle3", 300, 660)
        assert v1["spec"]["rollout"]["shadow"] == learning.SHADOW
        assert floor == learning.V2_FLOOR
    else:
        assert "shadow" not in v1["spec"]["rollout"]
        assert floor in (None, 0.2)


def test_with_the_loop_the_operators_rule_refuses_a_rollback_on_the_shift_and_v2_still_breaches():
    on = demo_pair(build_parser().parse_args([]))["spec"]["drift"]
    off = demo_pair(build_parser().parse_args(["--no-learning"]))["spec"]["drift"]
    # The gates' numbers of the 2026-12-07 runs: v1 0.75 on 'extraction', v2 0.55.
    v2, v1 = verdict(extraction=0.55), verdict(extraction=0.75)
    assert rollback_prediction(off, v2, v1, "extraction")[0] is True
    possible, why = rollback_prediction(on, v2, v1, "extraction")
    assert possible is False and "0.468" in why, why
    # The operator's own rule on a breach of that size says the same (same target and drafter).
    policy = drift_rule.DriftPolicy.from_spec(on)
    breach = drift_rule.Judgement("extraction", drift_rule.BREACH, live=0.06, upper=0.25, drafted=200, requests=4,
                                  baseline=0.55, floor=policy.floor(0.55))
    helps, why = drift_rule.rollback_helps([breach], {"extraction": 0.75}, {"extraction": 0.55}, policy, True)
    assert helps is False, why
    assert drift_rule.rollback_helps([breach], {"extraction": 0.75}, {"extraction": 0.55},
                                     drift_rule.DriftPolicy.from_spec(off), True)[0] is True
    # v2's floor on the shift stays above the live upper bounds measured there (0.11-0.25).
    assert policy.floor(0.55) > 0.3


def status(*history, runs=(), learned=None, drifted="", serving="2", speculating=False):
    st = {"history": [{"action": a, "toVersion": v} for a, v in history], "servingVersion": serving,
          "speculationEnabled": speculating, "training": {"runs": list(runs)},
          "conditions": [{"type": "Drifted", "status": "True", "reason": drifted}] if drifted else []}
    if learned:
        st["learnedRelease"] = learned
    return {"status": st}


def run(phase, candidate="", message="m", version="2", category="extraction"):
    return {"version": version, "category": category, "job": "train-x" if phase != "wanted" else "", "phase": phase,
            "candidate": candidate, "message": message}


def test_the_loop_follows_training_gate_shadow_promotion_and_serving_with_times():
    clock = Clock()
    loop = Loop("2", "extraction", clock)
    assert loop.update(status(drifted="SpeculationOff")) == 0
    clock.t = 1
    assert loop.update(status(drifted="RollbackWouldNotHelp", runs=[run("wanted")])) == 1
    clock.t = 5
    # Another release's or category's training is not this loop's.
    assert loop.update(status(drifted="RollbackWouldNotHelp",
                              runs=[run("done", "9", version="1"), run("running", category="creative")])) == 1
    assert loop.update(status(drifted="RollbackWouldNotHelp", runs=[run("running")])) == 2
    clock.t = 300
    done = [run("done", "3")]
    assert loop.update(status(("TrainingSucceeded", "3"), runs=done,
                              learned={"version": "3", "stage": "gating"})) == 3
    assert loop.candidate == "3"
    clock.t = 400
    assert loop.update(status(("GatePassed", "3"), runs=done, learned={"version": "3", "stage": "gating"})) == 4
    clock.t = 410
    assert loop.update(status(("GatePassed", "3"), ("ShadowStarted", "3"), runs=done,
                              learned={"version": "3", "stage": "shadow"})) == 5
    clock.t = 500
    # Promoted, the pods not yet on it: speculation comes back with the new champion's ladder.
    assert loop.update(status(runs=done, learned={"version": "3", "stage": "promoted"}, serving="3")) == 6
    clock.t = 520
    assert loop.update(status(runs=done, learned={"version": "3", "stage": "promoted"}, serving="3",
                              speculating=True)) == 7
    assert not loop.failed
    assert loop.rows() == [(1, DRIFTED), (5, TRAINING_STARTED), (300, REGISTERED), (400, GATED), (410, SHADOWED),
                           (500, PROMOTED), (520, SERVING)]
    assert [s for _, s in loop.rows()] == STAGES


@pytest.mark.parametrize("phase", ["failed", "timed-out"])
def test_a_training_that_ends_short_says_why(phase):
    loop = Loop("2", "extraction")
    assert loop.update(status(runs=[run(phase, message="DeadlineExceeded")])) == 2
    assert loop.failed == f"training {phase}: DeadlineExceeded"


def test_a_rejected_learned_draft_says_the_operators_reason():
    loop = Loop("2", "extraction")
    obj = status(("GatePassed", "3"), ("ShadowStarted", "3"), runs=[run("done", "3")],
                 learned={"version": "3", "stage": "rejected"})
    obj["status"]["conditions"].append({"type": "Learning", "status": "False", "message": "worse than 0.12"})
    assert loop.update(obj) == 5
    assert loop.failed == "v3 rejected: worse than 0.12"


def answer(category, drafts, first, drafted, accepted, error=""):
    a = Answer(category, "p")
    a.drafts, a.first_accepted, a.drafted, a.accepted, a.error = drafts, first, drafted, accepted, error
    return a


def test_acceptance_counts_the_category_first_position_and_drafted_tokens():
    got = acceptance([answer("extraction", 10, 4, 40, 8), answer("extraction", 6, 2, 24, 4),
                      answer("creative", 10, 10, 10, 10), answer("extraction", 9, 9, 9, 9, error="gone"),
                      answer("extraction", 0, 0, 0, 0)], "extraction")
    assert (got.requests, got.drafts, got.first, got.drafted, got.accepted) == (3, 16, 6, 64, 12)
    assert got.first_position == 6 / 16 and got.tokens == 12 / 64
    assert "first position 0.38 (6 of 16 rounds)" in got.words()
    assert acceptance([], "extraction").first_position is None
    assert "nothing drafted" in acceptance([answer("extraction", 0, 0, 0, 0)], "extraction").words()


def test_report_shows_the_loops_steps_events_and_the_three_figures():
    page = learning_section({
        "version": "2", "category": "extraction", "candidate": "3", "timeline": [(1.0, DRIFTED), (5.0, TRAINING_STARTED)],
        "training": {"message": "v3 registered"}, "learnedRelease": {"stage": "promoted", "reference": 0.12},
        "events": {"TrainingStarted": 1, "LearnedDraftPromoted": 1},
        "before": {"firstPosition": 0.8, "drafts": 10, "tokens": 0.6, "drafted": 50, "requests": 2},
        "during": {"firstPosition": 0.1, "drafts": 30, "tokens": 0.06, "drafted": 200, "requests": 16},
        "after": {"firstPosition": 0.45, "drafts": 40, "tokens": 0.3, "drafted": 100, "requests": 6}})
    for text in ("Learning loop", "v3", "promoted", "TrainingStarted x1", "LearnedDraftPromoted x1", DRIFTED,
                 "before the shift", "during the shift", "after the new release", "0.80", "0.10", "0.45"):
        assert text in page, text
    assert learning_section(None) == ""
