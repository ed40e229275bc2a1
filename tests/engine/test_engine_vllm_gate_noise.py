"""The vLLM gate's default speedup floor, as the engine gate's (test_engine_gate_default_floor.py):
it measures its noise (repeated target-only timings of the golden prompts on the first server) and,
where the pair names no minSpeedup, a release slower than target-only beyond that noise ships with
speculation off instead of failing: vLLM keeps the speculative config and drafts k 0 at every
batch size by its own schedule. Tables of the pure decision (gate/vllm.shipped_off), then what the
operator does with such a verdict: its check passes it, its pods are rendered with that schedule,
and MLflow's record says so. That vLLM's own parser and scheduler read the schedule as k 0 at
every batch size: test_engine_vllm_serve.py."""

from __future__ import annotations

import pytest

from specpair.contract import speculation_off_reason, threshold_failures
from specpair.gate.vllm import SPECULATION_OFF, shipped_off

IDENTICAL = {"greedyIdentity": 1.0, "greedyIdentityWithinTies": 1.0, "acceptanceRate": 0.4}
# What k by load left in the verdict before the floor is applied: a schedule (drafting stops at 4).
SCHEDULE = {"bestSpeculation": {"kByBatchSize": [[1, 3, 3], [4, 4, 0]]}}


@pytest.mark.parametrize("speedup, noise, thresholds, off", [
    (1.30, 0.05, {}, False),
    (0.97, 0.05, {}, False),                  # slower, within the noise measured
    (0.94, 0.05, {}, True),                   # slower beyond it
    (0.99, 0.00, {}, True),                   # no noise measured: none forgiven
    (0.85, 0.60, {}, True),                   # a noisy machine forgives at most 0.1
    (0.92, 0.60, {}, False),
    (None, 0.05, {}, True),                   # nothing measured is no evidence that it pays
    (0.50, 0.05, {"minSpeedup": 0}, False),   # a floor the pair names is held as given
    (0.50, 0.05, {"minSpeedup": 0.9}, False),
])
def test_a_vllm_release_slower_than_target_only_ships_speculation_off(speedup, noise, thresholds, off):
    verdict = {**IDENTICAL, **SCHEDULE, "speedup": speedup, "speedupNoise": noise}
    got = shipped_off(verdict, thresholds)
    if not off:
        assert got == {}
        return
    assert got["bestSpeculation"] == {"batchSizeThreshold": 0, "kByBatchSize": [[1, 1, 0]]}
    assert got["speculationOff"] == speculation_off_reason(verdict, thresholds)
    assert got["speculationOff"].endswith("the release ships with speculation off")
    # The default floor is met by the release shipped off: it passes instead of failing.
    verdict.update(got)
    assert threshold_failures(verdict, thresholds) == []


def test_without_shipping_off_the_same_slow_verdict_fails_and_a_named_floor_still_does():
    slow = {**IDENTICAL, **SCHEDULE, "speedup": 0.8, "speedupNoise": 0.05}
    assert threshold_failures(slow, {}) == [
        "speedup 0.800x < the default minSpeedup (1.0x less the 0.050 noise forgiven) 0.950x (short by 0.150x)"]
    assert shipped_off(slow, {"minSpeedup": 0.9}) == {}
    assert threshold_failures(slow, {"minSpeedup": 0.9}) == ["speedup 0.800x < minSpeedup 0.900x (short by 0.100x)"]


def test_the_reason_says_the_figures_it_rests_on():
    assert speculation_off_reason({"speedup": 0.8, "speedupNoise": 0.05}, {}) == (
        "speedup 0.800x at batch 1 is below 0.950x (target-only less the 0.050 noise forgiven): "
        "the release ships with speculation off")
    assert speculation_off_reason({"speedupNoise": 0.05}, {}).startswith("speedup missing at batch 1")
    assert speculation_off_reason({"speedup": 1.2, "speedupNoise": 0.0}, {}) is None


def test_each_verdict_gets_its_own_copy_of_the_schedule():
    first = shipped_off({"speedup": 0.5}, {})
    first["bestSpeculation"]["kByBatchSize"][0][2] = 3
    assert SPECULATION_OFF["kByBatchSize"] == [[1, 1, 0]]
    assert shipped_off({"speedup": 0.5}, {})["bestSpeculation"]["kByBatchSize"] == [[1, 1, 0]]


def test_the_operator_passes_records_and_serves_a_release_shipped_off():
    """The operator's verdict check passes the shipped-off verdict; the served release carries
    the schedule (plan.serving_steps.gate_tuned) and its vLLM pods get it in --speculative-config
    with the release's k (drafting 0 of them at every batch size); MLflow's description says the
    release was shipped off, and its params and metrics hold the figures."""
    from specpair.vllm_k_schedule import k_at
    from specpair.vllm_peer import speculative_config
    from specpair_operator.gate.verdict import evaluate_verdict
    from specpair_operator.plan.serving_steps import gate_tuned
    from specpair_operator.release.registry_contract import gate_description, gate_metrics

    verdict = {**IDENTICAL, **SCHEDULE, "speedup": 0.8, "speedupNoise": 0.05, "engine": "vllm",
               "categories": {}, "kSweep": [], "batchSweep": [{"batchSize": 1, "speedup": 0.8}],
               "reasons": [], "passed": True}
    verdict.update(shipped_off(verdict, {}))
    assert evaluate_verdict(verdict, {}).passed
    release = {"pair": "p", "engine": {"kind": "vllm"}, "draft": {"drafter": "ngram"},
               "speculation": {"k": 3, "dynamicK": True, "fallbackThreshold": 0.3, "batchSizeThreshold": 8}}
    served = gate_tuned(release, verdict, {})
    assert served["speculation"]["batchSizeThreshold"] == 0
    config = speculative_config(served)
    assert config["num_speculative_tokens"] == 3 and config["num_speculative_tokens_per_batch_size"] == [[1, 1, 0]]
    assert [k_at(config["num_speculative_tokens_per_batch_size"], b, 3) for b in (1, 2, 64, 1024)] == [0, 0, 0, 0]
    assert "slower: speculation shipped off" in gate_description(verdict, {"gating": {"thresholds": {}}})
    assert gate_metrics(verdict)[("speedup_noise", 0)] == 0.05


def test_the_verdicts_device_names_the_split_its_figures_were_measured_on():
    """A split target's speedups are the split's: the verdict's device says so, and the gate's
    MLflow run records it beside the release's parallelism (registry_contract.gate_params)."""
    from specpair.contract import parallelism
    from specpair.gate.vllm import device_of
    from specpair_operator.release.registry_contract import gate_params

    assert device_of("float32", parallelism({})) == "vllm (float32)"
    release = {"pair": "p", "engine": {"kind": "vllm"}, "draft": {"drafter": "ngram"},
               "parallelism": {"tensor": 2}}
    device = device_of("bfloat16", parallelism(release))
    assert device == "vllm (bfloat16, tensor parallel 2)"
    assert device_of("float32", {"tensor": 4, "pipeline": 2}) == "vllm (float32, tensor parallel 4, pipeline parallel 2)"
    params = gate_params(release, {"device": device, "bestSpeculation": None})
    assert params["device"] == device and params["parallelism.tensor"] == "2"
