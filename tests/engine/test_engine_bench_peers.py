"""The bench's host time per step and its hf-compiled peer (Hugging Face StaticCache +
torch.compile, target-only), on the tiny pair."""

from __future__ import annotations

import time

import pytest

from specpair.bench import (HfCompiledPeer, _run_one, format_table, hf_compile_mode, host_figures,
                            run_bench)
from specpair.config import GenerationParams, SpeculationConfig
from specpair.costs import StepTiming
from specpair import decoding
from specpair.decoding import SpeculativeEngine


def test_host_time_is_the_step_less_the_device_share():
    """On CUDA the host's share is the step less the time blocked on the device; on a CPU the
    model calls run on the host, so the share reported is the time outside them."""
    t = StepTiming(steps=4, seconds=0.4, model_seconds=0.3, wait_seconds=0.1)
    cpu, gpu = host_figures(t, "cpu"), host_figures(t, "cuda:0")
    assert cpu["step_ms"] == gpu["step_ms"] == pytest.approx(100.0)
    assert cpu["host_ms"] == pytest.approx(25.0) and cpu["host_fraction"] == pytest.approx(0.25)
    assert gpu["host_ms"] == pytest.approx(75.0) and gpu["device_wait_ms"] == pytest.approx(25.0)
    assert host_figures(StepTiming(), "cpu") is None


def test_a_batch_times_its_steps_and_model_calls(tiny_target, tiny_draft, monkeypatch):
    """The time blocked in sync after a model call returns is the device's wait. A CPU has none
    to measure, so a sync that blocks a known 3 ms stands in for an asynchronous device: every
    model call's wait is counted, inside the model's time, inside the step's (a bound on a real
    CPU wait's size failed under a loaded CI's preemptions)."""
    def device_sync(device):
        time.sleep(0.003)
    monkeypatch.setattr(decoding, "sync", device_sync)
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft,
                               speculation=SpeculationConfig(k=3, fallback_threshold=0))
    ids = engine.encode("The quick brown fox")
    for speculate in (False, True):
        timing = StepTiming()
        result = _run_one(engine, ids, GenerationParams(max_new_tokens=12), speculate, timing=timing)
        assert timing.steps == result.stats.num_target_steps > 0
        # At least one model call a step, each waited for once after it returned.
        assert 0.003 * timing.steps <= timing.wait_seconds < timing.model_seconds < timing.seconds
        again = StepTiming()
        again.merge(timing)
        again.merge(timing)
        assert again.steps == 2 * timing.steps and again.seconds == pytest.approx(2 * timing.seconds)


def test_hf_compiled_peer_matches_target_only_greedy(tiny_target):
    """gpt-fast's recipe through transformers: compiled once, then every prompt at the same
    shapes; its greedy ids equal ours (fp32)."""
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    prompts = ["def foo(x):\n    return", "The quick brown fox"]
    ids = [engine.encode(p) for p in prompts]
    peer = HfCompiledPeer(tiny_target.model, max(map(len, ids)) + 12)
    assert peer.mode == hf_compile_mode(tiny_target.device) == "default"
    assert peer.warm_up(ids[0]) > 0
    for p, prompt_ids in zip(prompts, ids):
        ours = engine.generate([p], GenerationParams(max_new_tokens=12))[0].token_ids
        # The peer runs past EOS (the bench pins lengths): compare as far as ours went.
        assert peer.generate(prompt_ids, 12)[:len(ours)] == ours
    with pytest.raises(Exception, match="exceed its cache"):
        peer.generate(ids[0], 100)
    assert peer.describe()["mode"] == "default" and peer.describe()["compile_seconds"] > 0


def test_bench_reports_host_time_and_the_hf_compiled_peer(tiny_target, tiny_draft):
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft,
                               speculation=SpeculationConfig(k=3, fallback_threshold=0))
    prompts = [{"prompt": "def foo(x):\n    return", "category": "code"},
               {"prompt": "The quick brown fox", "category": "qa"}]
    report = run_bench(engine, prompts, max_new_tokens=10, runs=1, chat=False, hf_peer=False,
                       hf_compiled=True).to_dict()
    assert report["hf_compiled"]["mode"] == "default" and report["hf_compiled"]["fullgraph"]
    assert "model calls" in report["host_time"]          # the CPU's honest definition
    for row in [*report["categories"].values(), report["overall"]]:
        for mode in ("target", "spec"):
            h = row["host"][mode]
            assert h["steps"] > 0 and 0 < h["host_ms"] < h["step_ms"]
            assert h["host_ms"] + h["model_ms"] == pytest.approx(h["step_ms"], abs=2e-3)
        assert row["hf_compiled_tokens_per_s"] > 0
        assert row["hf_compiled_identical"] == row["prompts"]
        assert row["spec_vs_hf_compiled"] == pytest.approx(
            row["spec_tokens_per_s"] / row["hf_compiled_tokens_per_s"], rel=1e-2)
    table = format_table(report)
    assert "HFc tgt" in table and "speculative step" in table and "mode='default'" in table


def test_cli_takes_the_hf_compiled_peer():
    from specpair.cli import build_parser
    args = build_parser().parse_args(["bench", "--peer", "hf-compiled", "--peer", "vllm"])
    assert args.peer == ["hf-compiled", "vllm"]
