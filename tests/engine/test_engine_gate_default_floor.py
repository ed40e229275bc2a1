"""The gate's default speedup floor: a release is no slower than target-only within the noise the
gate measured, and where it is slower it ships with speculation off instead of failing. The
decision is contract.py's pure functions (tables here); one real gate run on a draft that cannot
pay shows the gate measuring its noise and shipping speculation off."""

from __future__ import annotations

import pytest

from specpair.contract import (DEFAULT_MIN_SPEEDUP, MAX_FORGIVEN_NOISE, speculation_pays, speedup_floor,
                               threshold_failures)
from specpair.gate import run_gate
from specpair.gate.verdict import timing_noise

IDENTICAL = {"greedyIdentity": 1.0, "acceptanceRate": 0.5}


@pytest.mark.parametrize("verdict, thresholds, floor, defaulted", [
    ({"speedupNoise": 0.04}, {}, 0.96, True),
    ({"speedupNoise": 0.04}, {"minSpeedup": None}, 0.96, True),
    ({}, {}, DEFAULT_MIN_SPEEDUP, True),                       # no noise measured: none forgiven
    ({"speedupNoise": 0.7}, {}, 1.0 - MAX_FORGIVEN_NOISE, True),  # a noisy machine forgives no more
    ({"speedupNoise": -0.2}, {}, DEFAULT_MIN_SPEEDUP, True),
    ({"speedupNoise": 0.04}, {"minSpeedup": 1.2}, 1.2, False),  # a named floor is held as given
    ({"speedupNoise": 0.04}, {"minSpeedup": 0}, 0.0, False),
])
def test_the_floor_a_verdict_is_held_to(verdict, thresholds, floor, defaulted):
    got, was_default = speedup_floor(verdict, thresholds)
    assert got == pytest.approx(floor) and was_default is defaulted


@pytest.mark.parametrize("speedup, noise, thresholds, pays", [
    (1.10, 0.05, {}, True),
    (0.97, 0.05, {}, True),          # slower, but within the noise measured
    (0.94, 0.05, {}, False),         # slower beyond it
    (0.99, 0.0, {}, False),
    (None, 0.05, {}, False),         # nothing measured is no evidence that it pays
    (0.50, 0.05, {"minSpeedup": 0}, True),    # a named floor: speculation stays, the floor judges
    (0.50, 0.05, {"minSpeedup": 1.1}, True),
])
def test_whether_speculation_ships_at_batch_one(speedup, noise, thresholds, pays):
    assert speculation_pays({"speedup": speedup, "speedupNoise": noise}, thresholds) is pays


def test_a_defaulted_floor_is_met_by_speculation_shipped_off_and_a_named_one_is_not():
    slow = {**IDENTICAL, "speedup": 0.8, "speedupNoise": 0.05}
    off = {**slow, "bestSpeculation": {"k": 2, "batchSizeThreshold": 0}}
    on = {**slow, "bestSpeculation": {"k": 2, "batchSizeThreshold": 4}}
    assert threshold_failures(off, {}) == []
    # A gate that could not ship it off (the verdict still speculates) fails, in words.
    assert threshold_failures(on, {}) == [
        "speedup 0.800x < the default minSpeedup (1.0x less the 0.050 noise forgiven) 0.950x "
        "(short by 0.150x)"]
    assert threshold_failures(slow, {}) == threshold_failures(on, {})
    # A floor the pair names fails whatever the gate shipped.
    assert threshold_failures(off, {"minSpeedup": 0.9}) == [
        "speedup 0.800x < minSpeedup 0.900x (short by 0.100x)"]
    assert threshold_failures(on, {"minSpeedup": 0}) == []
    fast = {**IDENTICAL, "speedup": 0.97, "speedupNoise": 0.05, "bestSpeculation": {"batchSizeThreshold": 1}}
    assert threshold_failures(fast, {}) == []


@pytest.mark.parametrize("repeats, noise", [
    ([[1.0, 1.0, 1.0]], 0.0),
    ([[1.0, 1.2, 1.1]], 0.1 / 1.1),                 # deviations 0.1/1.1, 0.1/1.1, 0
    ([[5.0, 1.0, 1.0], [1.0, 1.02, 1.0]], 0.0),     # one slow first run moves it little
    ([[1.0, 1.1, 1.2], [2.0, 2.2, 2.4]], 0.1 / 1.1),
    ([[1.0]], 0.0),                                  # one repeat: no spread to measure
    ([], 0.0),
])
def test_the_noise_is_the_median_deviation_of_repeated_target_only_timings(repeats, noise):
    assert timing_noise(repeats) == pytest.approx(noise)


def test_a_release_that_cannot_pay_ships_with_speculation_off_and_passes(tmp_path, tiny_tokenizer, tiny_target):
    """A draft unrelated to the target (another random model) four times as deep and wide:
    three of its steps a round cost several target steps, so drafting is far slower than
    target-only beyond any noise even in a round where every draft were accepted (tiny random
    models can agree on a repeated token: a draft the target's own size once measured 1.01x).
    Under the default floor the gate passes it with speculation off; with the pair's own floor of
    1.0 the same release fails."""
    from tiny_models import make_model, save_tiny

    unrelated = make_model(tiny_tokenizer, seed=77, layers=8, hidden=256)
    release = {"pair": "tiny", "target": {"source": save_tiny(tiny_target, tmp_path / "target")},
               "draft": {"source": save_tiny(unrelated, tmp_path / "draft")},
               "speculation": {"k": 3, "dynamicK": False, "fallbackThreshold": 0.0},
               "gating": {"prompts": [{"prompt": "def foo(x):\n    return", "category": "code"},
                                      {"prompt": "The quick brown fox", "category": "qa"}],
                          "maxNewTokens": 16, "chat": False, "thresholds": {"requireGreedyIdentity": True},
                          "tuning": {"kValues": [], "batchSizes": [1, 2]}}}
    verdict, golden = run_gate(release, device="cpu", progress=lambda *_: None)
    assert verdict["passed"], verdict["reasons"]
    assert verdict["greedyIdentity"] == 1.0 and all(g["identical"] for g in golden)
    assert verdict["speedupNoise"] is not None and verdict["speedupNoise"] >= 0
    assert verdict["speedup"] < speedup_floor(verdict, {})[0], verdict
    assert verdict["bestSpeculation"] == {"batchSizeThreshold": 0}
    assert "ships with speculation off" in verdict["speculationOff"]

    release["gating"]["thresholds"]["minSpeedup"] = 1.0
    release["gating"]["tuning"]["batchSizes"] = []
    verdict, _ = run_gate(release, device="cpu", progress=lambda *_: None)
    assert not verdict["passed"] and "speculationOff" not in verdict
    assert [r for r in verdict["reasons"] if r.startswith("speedup ")] == [
        f"speedup {verdict['speedup']:.3f}x < minSpeedup 1.000x (short by {1.0 - verdict['speedup']:.3f}x)"]
