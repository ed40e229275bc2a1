"""The serving-health watch on a vLLM pair: the operator's vLLM probe reads a real vLLM server's
/metrics (0.32, CPU) into the same serving counters GetStats gives for specpair's engine."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.timeout(420)
def test_a_real_vllm_servers_latency_and_finishes_reach_the_serving_watch(tmp_path):
    from specpair.vllm_peer import VllmServer, default_python, speculative_config
    from tiny_models import make_model, make_tokenizer, save_tiny

    from specpair_operator import serving_health
    from specpair_operator.engine_probe import VllmProbe

    tok = make_tokenizer()
    model_dir = save_tiny(make_model(tok, seed=3, hidden=64, heads=2), tmp_path / "target")
    prompts = [tok(text)["input_ids"] for text in ("def add(a, b):\n    return a + b\n", "import json\nimport",
                                                   "The quick brown fox")]
    spec = speculative_config({"draft": {"drafter": "ngram"}, "speculation": {"k": 4}})
    with VllmServer(default_python(), model_dir, speculative=spec, start_timeout=180) as server:
        probe = VllmProbe()
        before = serving_health.serving_pod("p/u", asyncio.run(probe.stats(f"127.0.0.1:{server.port}")), None)
        outs = [server.complete_greedy(ids, 12) for ids in prompts]
        after = serving_health.serving_pod("p/u", asyncio.run(probe.stats(f"127.0.0.1:{server.port}")), None)
    counts = after.categories["all"] - before.categories.get("all", serving_health.ServingCounts())
    assert (counts.finished, counts.failed) == (3, 0)
    assert counts.ttft.count == 3 and counts.ttft.upper_bounds and counts.ttft.counts[-1] == 3
    assert counts.tpot.count == sum(len(o.token_ids) > 1 for o in outs)
    # A first token comes no later than the whole reply: the p95 lies at or below the bucket
    # of the slowest request as the client timed it.
    slowest = max(o.seconds for o in outs)
    assert 0 < counts.ttft.quantile(0.95) <= min(b for b in counts.ttft.upper_bounds if b >= slowest)
    assert counts.ttft.sum <= sum(o.seconds for o in outs)
