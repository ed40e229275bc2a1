"""The prefill token budget on the paged cache (decoding.Batch._prefill_caps): a long prompt is
fed what a budget of positions a step leaves beside the rows already decoding, which keep
emitting every step, and every row's tokens equal its solo output with the whole prompt fed in one step
(greedy and seeded sampling; speculating with n-gram drafts and with a draft model); prompts
arriving together share the budget, oldest first; with no row decoding a step feeds far more
(PREFILL_IDLE_TOKEN_BUDGET)."""

from __future__ import annotations

import pytest

from specpair.config import (PREFILL_IDLE_TOKEN_BUDGET, PREFILL_PROMPT_SHARE, PREFILL_TOKEN_BUDGET,
                             GenerationParams, SpeculationConfig)
from specpair.decoding import SpeculativeEngine

SPEC = SpeculationConfig(k=2, k_max=2, batch_size_threshold=64)   # <= 3 tokens a row a step
LONG = "The cluster keeps every release it promoted, and the operator reads them back. " * 6
SHORT = ["Name a colour.", "What is two and two?"]


def engine_for(tiny_target, tiny_draft, drafter: str, budget: int | None) -> SpeculativeEngine:
    engine = (SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=SPEC) if drafter == "draft"
              else SpeculativeEngine(tiny_target, "ngram", speculation=SPEC))
    assert engine.paged_space is not None         # the CPU's C path: the budget applies
    engine.prefill_budget = budget
    return engine


def test_engines_start_with_the_default_budget(tiny_target):
    assert PREFILL_TOKEN_BUDGET > 0
    assert SpeculativeEngine(tiny_target).prefill_budget == PREFILL_TOKEN_BUDGET


@pytest.mark.parametrize("drafter,params", [
    ("ngram", GenerationParams(max_new_tokens=24)),
    ("draft", GenerationParams(max_new_tokens=24, temperature=0.8, seed=3))],
    ids=["greedy-ngram", "seeded-draft"])
def test_a_long_prompt_in_chunks_beside_decoding_rows_emits_its_solo_tokens(
        tiny_target, tiny_draft, drafter, params):
    solo_engine = engine_for(tiny_target, tiny_draft, drafter, None)
    solo = {p: solo_engine.generate([p], params)[0].token_ids for p in [*SHORT, LONG]}

    engine = engine_for(tiny_target, tiny_draft, drafter, None)
    long_ids = engine.encode(LONG)
    budget = len(long_ids) // 4 + 1               # the long prompt takes four steps
    engine.prefill_budget = budget
    batch = engine.new_batch()
    rows = [batch.add(engine.encode(p), params) for p in SHORT]
    batch.step()                                  # the short prompts fit the budget together
    assert all(r.num_generated >= 1 for r in rows)
    late = batch.add(long_ids, params)
    chunks = []
    while late.num_generated == 0:
        before = [r.num_generated for r in rows]
        fed = batch.target.lengths[-1]
        batch.step()
        chunks.append(batch.target.lengths[-1] - fed if late.num_generated == 0 else None)
        # the decoding rows were not held back: each emitted this step
        assert all(r.num_generated > n for r, n in zip(rows, before)), (before, rows)
    # the budget counts the two decoding rows' tokens too (a step feeds `budget` positions)
    assert len(chunks) >= 4 and chunks[:3] == [budget - 2] * 3, chunks
    while batch.active:
        batch.step()
    assert [batch.result(r).token_ids for r in rows] == [solo[p] for p in SHORT]
    assert batch.result(late).token_ids == solo[LONG]


def test_prompts_arriving_together_share_the_budget_oldest_first(tiny_target, tiny_draft):
    params = GenerationParams(max_new_tokens=6)
    decoding = GenerationParams(max_new_tokens=40, speculation_k=0)   # one token a step
    prompts = [f"Request {i}: " + LONG for i in range(3)]
    solo_engine = engine_for(tiny_target, tiny_draft, "ngram", None)
    solo_engine.eos_ids = frozenset()             # the first row decodes through the test
    solo = [solo_engine.generate([p], params)[0].token_ids for p in prompts]
    first_solo = solo_engine.generate([SHORT[0]], decoding)[0].token_ids
    engine = engine_for(tiny_target, tiny_draft, "ngram", 40)
    engine.eos_ids = frozenset()
    batch = engine.new_batch()
    first = batch.add(engine.encode(SHORT[0]), decoding)
    batch.step()
    assert first.num_generated == 1
    seqs = [batch.add(engine.encode(p), params) for p in prompts]
    assert all(len(s.prompt_ids) > 40 for s in seqs)
    assert [o.request_id for o in batch.step()] == [first.request_id]   # the prompts emit nothing yet
    # the oldest prompt took what the decoding row's token left of the budget
    assert batch.target.lengths[1:] == [39, 0, 0]
    steps = 1
    while batch.active:
        batch.step()
        steps += 1
    assert steps >= sum(len(s.prompt_ids) for s in seqs) // 40
    assert [batch.result(s).token_ids for s in seqs] == solo
    assert batch.result(first).token_ids == first_solo


def test_a_prompt_with_no_row_decoding_is_fed_in_one_step(tiny_target, tiny_draft):
    """The budget bounds decoding rows' time between tokens; with none decoding (a cold prompt
    alone, prompts arriving at an idle server) a step feeds PREFILL_IDLE_TOKEN_BUDGET, not the
    budget: a prompt ten times the budget is fed in one step (it took ten before), and emits its
    solo tokens."""
    params = GenerationParams(max_new_tokens=8)
    solo_engine = engine_for(tiny_target, tiny_draft, "ngram", None)
    solo = solo_engine.generate([LONG], params)[0].token_ids
    engine = engine_for(tiny_target, tiny_draft, "ngram", None)
    ids = engine.encode(LONG)
    engine.prefill_budget = len(ids) // 10
    assert PREFILL_IDLE_TOKEN_BUDGET >= len(ids) > 10 * engine.prefill_budget - 10
    batch = engine.new_batch()
    seq = batch.add(ids, params)
    batch.step()
    assert batch._prefill_cap == {} and batch.target.lengths[0] >= len(ids)
    assert seq.num_generated >= 1
    while batch.active:
        batch.step()
    assert batch.result(seq).token_ids == solo


def test_with_no_row_decoding_prompts_share_the_idle_budget_then_the_budget(
        tiny_target, tiny_draft, monkeypatch):
    """Several prompts and no row decoding: the oldest are fed PREFILL_IDLE_TOKEN_BUDGET
    positions; once a row decodes, the step is back to the budget (less the decoding rows'
    tokens). Every row emits its solo tokens."""
    from specpair import decoding

    params = GenerationParams(max_new_tokens=6, speculation_k=0)
    prompts = [f"Request {i}: " + LONG for i in range(3)]
    solo_engine = engine_for(tiny_target, tiny_draft, "ngram", None)
    solo = [solo_engine.generate([p], params)[0].token_ids for p in prompts]
    engine = engine_for(tiny_target, tiny_draft, "ngram", 16)
    batch = engine.new_batch()
    seqs = [batch.add(engine.encode(p), params) for p in prompts]
    n = len(seqs[0].prompt_ids)
    idle = n + 20                                 # the first prompt whole, 20 of the second
    assert all(len(s.prompt_ids) > 16 + 20 for s in seqs)
    monkeypatch.setattr(decoding, "PREFILL_IDLE_TOKEN_BUDGET", idle)
    # the first prompt whole (its first token emitted), 20 positions of the second
    assert [o.request_id for o in batch.step()] == [seqs[0].request_id]
    assert batch.target.lengths == [n, 20, 0]
    assert [o.request_id for o in batch.step()] == [seqs[0].request_id]   # it decodes now
    assert batch.target.lengths[1:] == [20 + 15, 0]                       # 16 less its token
    while batch.active:
        batch.step()
    assert [batch.result(s).token_ids for s in seqs] == solo


def test_no_budget_feeds_each_prompt_whole(tiny_target, tiny_draft):
    engine = engine_for(tiny_target, tiny_draft, "ngram", None)
    batch = engine.new_batch()
    ids = engine.encode(LONG)
    seq = batch.add(ids, GenerationParams(max_new_tokens=3))
    batch.step()
    assert seq.num_generated >= 1 and batch.target.lengths[0] >= len(ids)


def test_more_rows_decoding_than_the_budget_leave_a_prompt_its_share(tiny_target, tiny_draft):
    """The rows decoding take their tokens first; with more of them than the budget a prompt is
    still fed PREFILL_PROMPT_SHARE of it a step (the step feeds over the budget), not the one
    position left before (a 4,000-row batch fed a prompt a position or two a step), and every
    row emits its solo tokens."""
    params = GenerationParams(max_new_tokens=24, speculation_k=0)   # one token a row a step
    budget = 12
    share = max(1, int(budget * PREFILL_PROMPT_SHARE))
    assert 1 < share < budget
    prompts = [f"Request {i}: {SHORT[i % 2]}" for i in range(budget + 4)]
    solo_engine = engine_for(tiny_target, tiny_draft, "ngram", None)
    solo_engine.eos_ids = frozenset()             # every row decodes to its max_new_tokens
    solo = {p: solo_engine.generate([p], params)[0].token_ids for p in [*prompts, LONG]}
    engine = engine_for(tiny_target, tiny_draft, "ngram", None)
    engine.eos_ids = frozenset()
    batch = engine.new_batch()
    rows = [batch.add(engine.encode(p), params) for p in prompts]
    batch.step()                                  # fed whole: the budget is set after them
    assert all(r.num_generated >= 1 for r in rows)
    engine.prefill_budget = batch.prefill_budget = budget
    late = batch.add(engine.encode(LONG), params)
    chunks = []
    while late.num_generated == 0:
        fed = batch.target.lengths[-1]
        batch.step()
        chunks.append(batch.target.lengths[-1] - fed if late.num_generated == 0 else None)
        if len(chunks) <= 3:                      # more rows than the budget still decode
            assert all(r.num_generated < params.max_new_tokens for r in rows)
    assert len(chunks) >= 4 and chunks[:3] == [share] * 3, chunks
    while batch.active:
        batch.step()
    assert [batch.result(r).token_ids for r in rows] == [solo[p] for p in prompts]
    assert batch.result(late).token_ids == solo[LONG]
