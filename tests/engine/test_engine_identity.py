"""Mismatch evidence: a real difference shows a clear margin; ties are judged by the dtype."""

from __future__ import annotations

import torch

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.identity import first_divergence, tie_tolerance


def test_real_difference_has_a_margin_and_identical_is_none(tiny_target):
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    prompt = engine.encode("def foo(x):")
    ref = engine.generate(["def foo(x):"], GenerationParams(max_new_tokens=8))[0].token_ids
    assert first_divergence(tiny_target, prompt, ref, list(ref)) is None
    with torch.no_grad():
        logits = tiny_target.model(torch.tensor([prompt + ref[:3]])).logits[0, -1]
    worst = int(logits.argmin())
    wrong = ref[:3] + [worst] + ref[4:]
    d = first_divergence(tiny_target, prompt, ref, wrong)
    assert d["index"] == 3 and d["candidate_token"] == worst
    assert d["margin"] > 1.0 and d["tie"] is False


def test_tie_tolerance_scales_with_dtype():
    logits = torch.tensor([10.0, -3.0])
    assert tie_tolerance(torch.bfloat16, logits) > 1000 * tie_tolerance(torch.float32, logits)
    assert 0.1 < tie_tolerance(torch.bfloat16, logits) < 1.0
