"""The shadow chapter's pieces without a cluster: the candidate the demo applies is one the
operator scores in shadow (its own choose_strategy on the releases it would build), the n-gram
pair's candidate draft (a layer-skip draft the engine accepts as a shadow drafter for the target),
the stages read from recorded pair statuses, the verdict in words, and the report's section."""

import pytest

from demo.chapters.releases import demo_pair, second_release
from demo.report import shadow_section
from demo.run_demo import build_parser
from merge_patch import merge_patch
from demo.shadow_chapter import (CANDIDATE_K, DECIDED, GATED, REGISTERED, SHADOW, STARTED, STAGES, Progress,
                                 candidate_spec, explain, make_layer_skip_draft, numbers_rows, shadow_traffic)
from specpair_operator.release import content as release
from specpair_operator.policy import rollout_strategy


def built(spec):
    return release.build_release("default", "specpair-demo", spec, spec["gating"]["prompts"], default_image="engine:1")


@pytest.mark.parametrize("drafter", ["ngram", "draft model"])
def test_v2_asks_for_replace_and_the_candidate_differs_only_on_its_draft_side_so_the_operator_chooses_shadow(
        drafter, tmp_path):
    argv = []
    if drafter == "draft model":
        (tmp_path / "draft").mkdir()
        (tmp_path / "draft" / "config.json").write_text("{}")
        argv = ["--draft", str(tmp_path / "draft")]
    args = build_parser().parse_args(argv)
    v1 = demo_pair(args)["spec"]
    v2, _ = second_release(demo_pair(args), args, tmp_path / "models")
    champion = built(v1)
    # v2 changes only the draft side too: left to the operator it would be scored in shadow, and
    # the drift chapter needs it serving.
    assert rollout_strategy.choose_strategy(v2, champion, built(v2)).type == rollout_strategy.REPLACE
    assert rollout_strategy.choose_strategy({}, champion, built(v2)).type == rollout_strategy.SHADOW
    # After the drift chapter v1 serves again and the spec is still v2's: the candidate patches that.
    # With n-gram lookup the candidate drafts with a draft model instead (the demo writes it).
    layer_skip = str(tmp_path / "models" / "layer-skip-draft")
    candidate = merge_patch(v2, candidate_spec(v2, args.gate_tokens, None if argv else layer_skip))
    assert candidate["draft"] == ({"source": layer_skip} if drafter == "ngram" else v2["draft"])
    assert candidate["target"] == v1["target"]
    assert candidate["speculation"]["k"] == CANDIDATE_K
    assert "minCategoryAcceptance" not in candidate["gating"]["thresholds"]
    assert "strategy" not in candidate["rollout"]
    assert candidate["rollout"]["shadow"] == SHADOW and candidate["rollout"]["progressDeadlineSeconds"] == 1200
    mine = built(candidate)
    assert release.content_hash(mine) not in {release.content_hash(champion), release.content_hash(built(v2))}
    # The draft side alone differs from what serves (draft, k), nothing the shadow cannot replay.
    assert rollout_strategy.draft_side_differs(champion, mine)
    assert rollout_strategy.serving_side_differences(champion, mine) == []
    assert rollout_strategy.shadow_refusal(champion, mine) is None
    chosen = rollout_strategy.choose_strategy(candidate, champion, mine)
    assert chosen.type == rollout_strategy.SHADOW and chosen.refused is None, chosen
    assert chosen.reason == "chosen automatically: only the draft side differs from the champion"


def test_the_shadow_is_sized_to_decide_on_evidence_well_inside_its_time_bound():
    # The verdict needs 200 scored positions a side; the n-gram champion scores ~9 per extraction
    # answer, so ~23 requests at a few seconds each plus the pods' roll: minutes, not maxSeconds.
    assert SHADOW["share"] == 1.0 and SHADOW["minRequests"] <= 23
    assert SHADOW["maxSeconds"] >= 600


def test_the_layer_skip_draft_keeps_the_targets_first_layers_and_is_a_shadow_drafter_for_it(tmp_path):
    import torch
    from tiny_models import make_model, make_tokenizer, save_tiny

    from specpair.config import ModelRef, PairSpec
    from specpair.decoding import SpeculativeEngine
    from specpair.drafters import ModelDrafter
    from specpair.models import load_model
    from specpair.shadow import Candidate, build_shadow_drafter

    target_dir = save_tiny(make_model(make_tokenizer(), seed=5, layers=3), tmp_path / "target")
    out = make_layer_skip_draft(target_dir, tmp_path / "draft", layers=1)
    target, draft = load_model(target_dir), load_model(str(out))
    assert draft.model.config.num_hidden_layers == 1 and len(draft.model.model.layers) == 1
    mine, theirs = draft.model.state_dict(), target.model.state_dict()
    assert all(torch.equal(value, theirs[name]) for name, value in mine.items())
    assert "model.layers.1.mlp.down_proj.weight" in theirs and "model.layers.1.mlp.down_proj.weight" not in mine
    # The serving engine takes it as the candidate's drafter (same tokenizer, a draft model).
    engine = SpeculativeEngine(target, drafter="ngram")
    candidate = Candidate("3", "c" * 64, PairSpec(target=ModelRef(target_dir), draft=ModelRef(str(out))))
    assert isinstance(build_shadow_drafter(candidate, engine), ModelDrafter)
    # Written once: a second call reuses the directory; a draft as deep as the target is refused.
    assert make_layer_skip_draft(target_dir, out, layers=2) == out
    assert load_model(str(out)).model.config.num_hidden_layers == 1
    with pytest.raises(ValueError, match="keeps 1..2 layers"):
        make_layer_skip_draft(target_dir, tmp_path / "too-deep", layers=3)


def test_the_shadow_chapter_runs_unless_left_out():
    assert build_parser().parse_args([]).no_shadow is False
    assert build_parser().parse_args(["--no-shadow"]).no_shadow is True


def test_shadow_traffic_is_document_work_in_the_champions_gated_categories():
    assert {c for c, _ in shadow_traffic({"extraction", "creative"})} == {"extraction"}
    assert shadow_traffic(set()) and shadow_traffic({"poetry"})


def status(*history, candidate="3", gated=None, scored=None, shadow=None, serving="1"):
    conditions = []
    if gated:
        conditions.append({"type": "Gated", "status": gated[0], "message": gated[1]})
    if scored:
        conditions.append({"type": "ShadowScored", "status": scored[0], "reason": scored[1], "message": "numbers"})
    return {"status": {"candidateVersion": candidate, "servingVersion": serving, "conditions": conditions,
                       "history": [{"action": a} for a in history], "shadow": shadow or {}}}


def test_progress_follows_the_candidate_from_its_registration_to_the_verdict():
    older = ("Promoted", "Promoted", "SpeculationOff", "RolledBack")
    p = Progress(before_actions=len(older), before_version="2")
    assert p.update(status(*older, candidate="2", gated=("True", "v2: passed"))) == 0
    assert p.update(status(*older)) == 1 and p.version == "3"
    # v2's Gated condition (from before) says nothing about v3.
    assert p.update(status(*older, gated=("True", "v2: passed"))) == 1
    assert p.update(status(*older, gated=("True", "v3: passed"))) == 2
    assert p.update(status(*older, "ShadowStarted", gated=("True", "v3: passed"),
                           scored=("Unknown", "Scoring"), shadow={"version": "3", "result": "Undecided"})) == 3
    assert p.result is None
    # A verdict about another candidate is not this one's.
    assert p.update(status(*older, "ShadowStarted", scored=("True", "Rejected"), shadow={"version": "9"})) == 3
    assert p.update(status(*older, "ShadowStarted", "ShadowRejected", scored=("True", "Rejected"),
                           shadow={"version": "3", "result": "Rejected"})) == len(STAGES)
    assert p.result == "Rejected"
    assert STAGES == [REGISTERED, GATED, STARTED, DECIDED]


def test_progress_ends_on_a_refusal_or_a_promotion_without_shadow_and_fails_on_a_failed_gate():
    p = Progress(0, "2")
    assert p.update(status("ShadowRefused", scored=("False", "ShadowRefused"))) == len(STAGES)
    assert p.result == "ShadowRefused"
    p = Progress(0, "2")
    assert p.update(status("Promoted", serving="3")) == len(STAGES) and p.result == "PromotedWithoutShadow"
    p = Progress(0, "2")
    with pytest.raises(ValueError, match="v3 failed its gate: floors"):
        p.update(status(gated=("False", "floors")))


SHORT = {"requests": 4, "status": "short", "candidateAlpha": 0.5, "championAlpha": 0.5, "lower": -1, "upper": 1}


def test_the_verdict_in_words_follows_what_the_operator_wrote():
    timed_out = {"reason": "still undecided 121 s after its shadow started (rollout.shadow.maxSeconds 120): ..."}
    assert "maxSeconds ran out" in explain("Rejected", timed_out)
    worse = explain("Rejected", {"reason": "worse than the champion in category 'extraction'"})
    assert "live evidence" in worse and "maxSeconds" not in worse
    assert "promoted" in explain("Promoted", {}) and "refused" in explain("ShadowRefused", {})
    assert numbers_rows({"categories": {"*": SHORT}}) == [("gated traffic pooled", "0.500", "0.500", "–", "4", "short")]


def test_report_shows_the_verdict_its_numbers_and_each_step():
    page = shadow_section({
        "version": "3", "champion": "1", "result": "Rejected", "meaning": "rejected on the live evidence",
        "requests": 40, "failed": 1, "seconds": 95.0, "servingAfter": "1",
        "condition": {"status": "True", "reason": "Rejected", "message": "v3 scored in shadow: Rejected: worse"},
        "status": {"share": 1.0, "categories": {"extraction": {"candidateAlpha": 0.01, "championAlpha": 0.98,
                                                               "lower": -1.0, "upper": -0.93, "requests": 40,
                                                               "status": "worse"}}},
        "timeline": [(1.0, REGISTERED), (40.0, GATED), (41.0, STARTED), (90.0, DECIDED)]})
    for text in ("Shadow chapter", "ShadowScored=True Rejected", "0.010", "0.980", "[-1.000, -0.930]", "worse",
                 "40 requests answered, 1 failed", "90.0 s", DECIDED, "v1 serving after"):
        assert text in page, text
    assert shadow_section(None) == ""
