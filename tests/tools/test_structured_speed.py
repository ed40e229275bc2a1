"""bench/structured_speed.py still runs, on the tiny pair: four modes, each speculative reply
equal to its target-only one (free and constrained), constrained replies checked."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from structured_speed import PROMPTS, run  # noqa: E402

from specpair.decoding import SpeculativeEngine  # noqa: E402


def test_structured_speed_runs_every_mode_on_the_tiny_pair(tiny_target, tiny_draft):
    result = run(SpeculativeEngine(tiny_target, draft=tiny_draft), PROMPTS[:2], max_new_tokens=24, rounds=1)
    modes = result["modes"]
    assert set(modes) == {"free", "free+spec", "json", "json+spec"}
    assert all(m["tokens"] > 0 and m["tokens_per_s"] > 0 for m in modes.values())
    assert result["speculative_equal_to_target_only"] == "4/4"
    assert 0 <= modes["json+spec"]["acceptance_rate"] <= 1 and modes["free+spec"]["mean_acceptance_length"] >= 1
    valid, asked = map(int, result["schema_valid"].split("/"))
    assert asked == 2 and 0 <= valid <= asked
    assert result["json_spec_vs_free_spec"] > 0 and result["json_spec_vs_json_target_only"] > 0
