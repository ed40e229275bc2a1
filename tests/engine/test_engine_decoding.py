"""Greedy speculative decoding is token-identical to target-only decoding."""

from __future__ import annotations

import pytest
from drafting_checks import assert_drafted_and_accepted

from specpair.config import GenerationParams, SpeculationConfig
from specpair.costs import RequestAudit
from specpair.decoding import SpeculativeEngine
from specpair.drafters import NgramDrafter

PROMPTS = ["def foo(x):\n    return", "The quick brown fox", "import os\nimport sys\n",
           "class A:\n  pass\n" * 3, "x = [1, 2, 3]\nfor i in x:\n", "while True:",
           "Hello world, hello world, hello", "# a comment about json"]
PARAMS = GenerationParams(max_new_tokens=32)


@pytest.fixture(scope="module")
def reference(tiny_target):
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    # One prompt at a time: the reference is plain single-sequence target-only decoding.
    return [engine.generate([p], PARAMS)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("k", range(1, 9))
def test_model_draft_identity_every_k_batched_and_single(tiny_target, tiny_draft, reference, k):
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft,
                               speculation=SpeculationConfig(k=k, dynamic_k=False, fallback_threshold=0))
    batched = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in batched] == reference
    singles = [engine.generate([p], PARAMS)[0] for p in PROMPTS[:3]]
    assert [r.token_ids for r in singles] == reference[:3]
    stats = [r.stats for r in batched]
    # Partial acceptance: some drafts accepted, some rejected -> cache cut-backs happened.
    assert sum(s.num_accepted_tokens for s in stats) > 0
    assert sum(s.num_draft_tokens - s.num_accepted_tokens for s in stats) > 0
    for s in stats:
        assert s.num_accepted_tokens <= s.num_draft_tokens
        assert all(n <= k for n in [len(s.num_draft_tokens_per_pos)])


def test_dynamic_k_and_ngram_identity(tiny_target, tiny_draft, reference):
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft,
                               speculation=SpeculationConfig(k=2, dynamic_k=True, fallback_threshold=0))
    dynamic = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in dynamic] == reference
    assert_drafted_and_accepted([r.stats for r in dynamic], "dynamic k")
    # k moved from its start (2): some round drafted past position 2.
    assert max(len(r.stats.num_draft_tokens_per_pos) for r in dynamic) > 2
    ngram = SpeculativeEngine(tiny_target, drafter=NgramDrafter(),
                              speculation=SpeculationConfig(k=4, fallback_threshold=0))
    results = ngram.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == reference
    assert_drafted_and_accepted([r.stats for r in results], "n-gram")


def test_self_draft_accepts_everything(tiny_target, reference):
    engine = SpeculativeEngine(tiny_target, draft=tiny_target,
                               speculation=SpeculationConfig(k=4, dynamic_k=False))
    results = engine.generate(PROMPTS[:4], PARAMS)
    assert [r.token_ids for r in results] == reference[:4]
    for r in results:
        assert r.stats.acceptance_rate == 1.0
        # Every round: k accepted + 1 bonus, except where max_new_tokens capped k.
        assert r.stats.mean_acceptance_length > 4.0


def test_continuous_batching_join_and_cancel(tiny_target, tiny_draft, reference):
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft,
                               speculation=SpeculationConfig(k=3, fallback_threshold=0))
    batch = engine.new_batch()
    first = batch.add(engine.encode(PROMPTS[0]), PARAMS)
    doomed = batch.add(engine.encode(PROMPTS[1]), PARAMS)
    batch.step(); batch.step()
    later = batch.add(engine.encode(PROMPTS[2]), PARAMS)     # joins a running batch
    batch.step()
    batch.cancel(doomed.request_id)
    late2 = batch.add(engine.encode(PROMPTS[3]), PARAMS)
    while batch.active:
        batch.step()
    assert first.generated == reference[0]
    assert later.generated == reference[2]
    assert late2.generated == reference[3]
    assert doomed.finish_reason == "cancelled"


def test_fallback_to_target_only_and_probe(tiny_target, tiny_tokenizer, reference):
    from tiny_models import make_model
    bad = make_model(tiny_tokenizer, seed=99)           # unrelated draft: acceptance ~0
    config = SpeculationConfig(k=4, dynamic_k=False, fallback_threshold=0.5, fallback_window=8,
                               probe_interval=6)
    engine = SpeculativeEngine(tiny_target, draft=bad, speculation=config)
    # The fallback's window reads audited requests (costs.RequestAudit): here every one.
    engine.audit = RequestAudit(1.0)
    results = engine.generate(PROMPTS[:2], PARAMS)
    assert [r.token_ids for r in results] == reference[:2]
    assert engine.controller.fallback_events >= 2          # fell back, probed, fell back again
    assert sum(r.stats.fallback_events for r in results) == engine.controller.fallback_events
    # While falling back, rounds run without drafts.
    assert any(r.stats.num_target_steps > r.stats.num_drafts for r in results)


def test_stop_strings_eos_and_length(tiny_target, tiny_draft):
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft)
    full = engine.generate([PROMPTS[0]], GenerationParams(max_new_tokens=24))[0]
    assert full.finish_reason in ("length", "stop") and len(full.token_ids) <= 24
    if full.finish_reason == "length":
        assert len(full.token_ids) == 24
    import re
    # A printable stop string from the middle of the output (random models emit odd bytes).
    match = re.search(r"[A-Za-z ]{2}", full.text[3:])
    assert match, full.text
    stop = match.group(0)
    stopped = engine.generate([PROMPTS[0]], GenerationParams(max_new_tokens=24, stop=(stop,)))[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and full.text.startswith(stopped.text)
    assert full.text.index(stop) == len(stopped.text)


def test_chat_prompt_uses_template(tiny_target):
    engine = SpeculativeEngine(tiny_target)
    ids = engine.encode([{"role": "user", "content": "hi"}])
    text = tiny_target.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith("assistant\n")


def test_cost_aware_k_follows_acceptance_and_costs():
    from specpair.costs import CostModel, DynamicK
    config = SpeculationConfig(k=4, k_max=8)
    cheap = CostModel(draft=0.01, verify={k: 1.0 + 0.01 * k for k in range(1, 9)})
    dear = CostModel(draft=0.2, verify={k: 1.0 + 0.2 * k for k in range(1, 9)})
    # The k chosen while drafting (the per-row back-off, which would rest `bad` at k 0, is
    # test_engine_row_backoff.py's).
    good, bad = DynamicK(config, cheap, back_off=False), DynamicK(config, dear, back_off=False)
    for _ in range(20):
        good.update(good.k, good.k)          # everything accepted
        bad.update(bad.k, 0)                 # nothing accepted
    assert good.k == 8
    assert bad.k == 1
    # Cheap drafts with middling acceptance still speculate deeper than dear ones.
    import random
    rng = random.Random(0)
    mid_cheap, mid_dear = DynamicK(config, cheap, back_off=False), DynamicK(config, dear, back_off=False)
    for _ in range(60):
        for d in (mid_cheap, mid_dear):
            accepted = 0
            while accepted < d.k and rng.random() < 0.6:    # i.i.d. acceptance 0.6
                accepted += 1
            d.update(d.k, accepted)
    assert mid_cheap.k >= 4 and mid_dear.k <= 2, (mid_cheap.k, mid_dear.k)
    # A round's own cost (a head's catch-up) is paid once whatever k: deeper rounds amortise it.
    for acceptance in (0.5, 0.6, 0.7):
        lean, heavy = (DynamicK(config, CostModel(draft=0.1, verify=cheap.verify, draft_round=r))
                       for r in (0.0, 2.0))
        lean.position_acceptance = [acceptance] * config.k_max
        heavy.position_acceptance = [acceptance] * config.k_max
        assert heavy.best_k() >= lean.best_k()
    assert heavy.best_k() > lean.best_k(), (heavy.best_k(), lean.best_k())


def test_calibrated_engine_stays_exact(tiny_target, tiny_draft, reference):
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft,
                               speculation=SpeculationConfig(k=4, fallback_threshold=0))
    costs = engine.calibrate()
    assert costs["target_step"] > 0 and set(costs["verify"]) == set(range(1, 9))
    assert engine.cost_model is not None
    results = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == reference
    # The cost model may choose any k, target-only included: it chose to draft here.
    assert_drafted_and_accepted([r.stats for r in results], "calibrated engine")


def test_a_long_lived_batch_keeps_no_finished_rows(tiny_target):
    """The server's batch lives for the whole process: finished and cancelled rows must go."""
    import gc
    import weakref
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    batch = engine.new_batch()
    refs = []
    for i in range(40):
        seq = batch.add(engine.encode(PROMPTS[i % len(PROMPTS)]), GenerationParams(max_new_tokens=3),
                        request_id=f"r{i}")
        refs.append(weakref.ref(seq))
        del seq
        if i % 4 == 3:
            batch.cancel(f"r{i}")
        while batch.active:
            batch.step()
    batch.step()      # an idle step: what finished before it is no longer the batch's business
    gc.collect()
    assert [r() for r in refs if r() is not None] == []


def test_empty_prompt_is_refused_at_add(tiny_target):
    from specpair.errors import SpecpairError
    engine = SpeculativeEngine(tiny_target)
    batch = engine.new_batch()
    with pytest.raises(SpecpairError, match="empty prompt"):
        batch.add([], GenerationParams(max_new_tokens=4))
    assert batch.active == 0
    seq = batch.add(engine.encode(PROMPTS[0]), GenerationParams(max_new_tokens=4))
    while batch.active:
        batch.step()
    assert len(seq.generated) == 4
