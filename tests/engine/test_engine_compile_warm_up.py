"""torch.compile on the general step (the tiny float32 pair: the C layer's kernels inside the
graph, no fixed step, no paged cache): the engine's warm-up compiles every shape a request
steps through, so the first requests compile nothing. Before, a 3-prompt generation after
warm-up compiled 2-3 more graphs (~25 CPU-s on a cold inductor cache, paid by a server's first
requests): a prompt over the C layer's tokens a call (MAX_TOKENS; a guard in the graph), and the `rows`
index at a stride warm-up never gave (an expanded [B, 1] against a wider one)."""

from __future__ import annotations

import pytest
import torch

from specpair.config import GenerationParams
from specpair.decoding import SpeculativeEngine

PROMPTS = ["def foo(x):\n    return", "The quick brown fox",
           "import os\nimport sys\n" * 8]     # 145 tokens across the batch's prefill: over MAX_TOKENS, 128


# Slow: dynamo traces the layer step at warm-up (~23 CPU-s with aot_eager).
@pytest.mark.slow
def test_a_compiled_engine_compiles_nothing_after_its_warm_up(tiny_target, tiny_draft, monkeypatch):
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setenv("SPECPAIR_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft, compile="on")
    assert engine.paged_space is None and engine.compile_mode == "on"   # the general compiled step
    warmed = counters["stats"]["unique_graphs"]
    assert warmed > 0
    params = GenerationParams(max_new_tokens=12)
    got = engine.generate(PROMPTS, params)
    assert counters["stats"]["unique_graphs"] == warmed, dict(counters["stats"])
    eager = SpeculativeEngine(tiny_target, draft=tiny_draft)
    assert [r.token_ids for r in got] == [r.token_ids for r in eager.generate(PROMPTS, params)]
    assert sum(r.stats.num_draft_tokens for r in got) > 0
