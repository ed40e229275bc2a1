"""The demo's releases keep speculation on whatever the gate times (their chapters need drafted
tokens), by naming a speedup floor the gate's own rule reads (contract.speculation_pays), and a
chapter that needs drafts stops at once, saying why, where a gate shipped v2 target-only."""

from types import SimpleNamespace

import pytest

from demo.chapters.releases import check_speculating, demo_pair, second_release
from demo.run_demo import build_parser
from demo.settings import DemoFailed
from demo.shadow_chapter import candidate_spec
from specpair.contract import speculation_off_reason, speculation_pays, threshold_failures


@pytest.mark.parametrize("argv", [[], ["--draft", "DRAFT"]])
def test_every_demo_release_keeps_speculation_on_when_its_gate_times_drafting_slower(argv, tmp_path):
    if argv:
        (tmp_path / "draft").mkdir()
        argv = ["--draft", str(tmp_path / "draft")]
    args = build_parser().parse_args(argv)
    v1 = demo_pair(args)["spec"]
    v2, _ = second_release(demo_pair(args), args, tmp_path / "models")
    candidate = candidate_spec(v2, args.gate_tokens)
    # The CI run's figure (2f32033, v2 under load), with no noise to forgive.
    slower = {"speedup": 0.73, "speedupNoise": 0.0, "greedyIdentity": 1.0, "acceptanceRate": 1.0,
              "categories": {c: {"acceptanceRate": 1.0} for c in ("extraction", "creative", "summarisation")}}
    for spec in (v1, v2, candidate):
        thresholds = spec["gating"]["thresholds"]
        assert speculation_pays(slower, thresholds) and speculation_off_reason(slower, thresholds) is None
        assert threshold_failures(slower, thresholds) == []
    # Without the named floor the same verdict would ship target-only (the product's default).
    assert speculation_off_reason(slower, {"requireGreedyIdentity": True}) is not None


def test_a_chapter_needing_drafts_stops_at_once_where_v2_shipped_target_only():
    off = {"bestSpeculation": {"k": 4, "batchSizeThreshold": 0},
           "speculationOff": "speedup 0.730x at batch 1 is below 0.900x"}
    demo = SimpleNamespace(facts={"verdicts": {"2": off}})
    with pytest.raises(DemoFailed, match="speculation off, so the chapter has no drafts: speedup 0.730x"):
        check_speculating(demo, "the chapter has no drafts")
    check_speculating(SimpleNamespace(facts={"verdicts": {"2": {"bestSpeculation": {"batchSizeThreshold": 1}}}}),
                      "the chapter has no drafts")
