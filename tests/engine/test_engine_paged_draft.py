"""A draft model's cache in the engine's block pool (paged_cache.PagedSpace.draft): the draft's
rows take blocks from the same pool as the target's, so admission counts both, and under pressure
drafting stops (its draft row given back) before any row is preempted.

Greedy output equals target-only with drafting proven; rows preempted through a pool too small
for them all emit their solo output; a pool that holds the target's rows but not the drafts
stops drafting instead of preempting; the draft's prompt blocks are shared by reference too."""

from __future__ import annotations

from specpair.block_pool import RowNeed, plan_admission
from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.paged_cache import PagedKVModel, PagedSpace
from specpair.prefix_cache import BLOCK_TOKENS

SPEC = SpeculationConfig(k=4, batch_size_threshold=64)
PROMPTS = [f"Question {i}: " + "what comes after %d? " % (i * 7) * (2 + i % 4) for i in range(10)]
SYSTEM = "You are a careful assistant who answers briefly and never guesses. " * 4


def draft_engine(tiny_target, tiny_draft, **options) -> SpeculativeEngine:
    return SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=SPEC, **options)


def test_greedy_with_a_paged_draft_model_equals_target_only_and_drafts(tiny_target, tiny_draft):
    params = GenerationParams(max_new_tokens=24)
    reference = SpeculativeEngine(tiny_target).generate(PROMPTS, params)
    engine = draft_engine(tiny_target, tiny_draft)
    batch = engine.new_batch()
    assert isinstance(batch.target, PagedKVModel) and isinstance(batch.drafter.kv, PagedKVModel)
    assert batch.drafter.kv.pool is batch.target.pool
    seqs = [batch.add(engine.encode(p), params) for p in PROMPTS]
    draft_blocks_seen = 0
    while batch.active:
        batch.step()
        draft_blocks_seen = max(draft_blocks_seen, sum(
            batch.target.pool.held(key) for key in batch.drafter.kv.keys))
    results = [batch.result(s) for s in seqs]
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    drafted = sum(r.stats.num_draft_tokens for r in results)
    accepted = sum(r.stats.num_accepted_tokens for r in results)
    assert drafted > 0 and 0 < accepted < drafted            # it drafted, and was checked
    assert draft_blocks_seen >= len(PROMPTS)                 # the draft's rows were in the pool
    pool = engine.paged_space.pool
    assert not pool.tables and pool.free == pool.blocks      # both models' blocks came back


def test_rows_preempted_with_a_draft_model_emit_their_solo_output(tiny_target, tiny_draft):
    params = [GenerationParams(max_new_tokens=24) if i % 3 else
              GenerationParams(max_new_tokens=24, temperature=0.9, seed=i) for i in range(10)]
    solo_engine = draft_engine(tiny_target, tiny_draft)
    solo = [solo_engine.generate([p], q)[0].token_ids for p, q in zip(PROMPTS, params)]

    engine = draft_engine(tiny_target, tiny_draft)
    engine.paged_space = PagedSpace(tiny_target.model, blocks=24, draft_model=tiny_draft.model)
    batch = engine.new_batch()
    seqs = [batch.add(engine.encode(p), q) for p, q in zip(PROMPTS, params)]
    while batch.active:
        batch.step()
    assert batch.preemptions > 0 and engine.memory_fallbacks > 0   # drafting stopped, then rows waited
    assert [batch.result(s).token_ids for s in seqs] == solo
    assert sum(batch.result(s).stats.num_draft_tokens for s in seqs) > 0
    pool = engine.paged_space.pool
    assert not pool.tables and pool.free == pool.blocks


def test_drafting_stops_before_any_row_is_preempted(tiny_target, tiny_draft):
    """Two rows whose target positions fit the pool but not with their draft rows: the draft
    rows give way, nobody is preempted, and the output is target-only's."""
    params = GenerationParams(max_new_tokens=40)
    prompts = PROMPTS[:2]
    reference = SpeculativeEngine(tiny_target).generate(prompts, params)
    engine = draft_engine(tiny_target, tiny_draft)
    lengths = [len(engine.encode(p)) for p in prompts]
    target_blocks = sum(-(-(n + 40 + SPEC.k) // BLOCK_TOKENS) for n in lengths)
    engine.paged_space = PagedSpace(tiny_target.model, blocks=target_blocks + 1,
                                    draft_model=tiny_draft.model)
    batch = engine.new_batch()
    seqs = [batch.add(engine.encode(p), params) for p in prompts]
    while batch.active:
        batch.step()
    assert batch.preemptions == 0 and engine.memory_fallbacks > 0
    assert [batch.result(s).token_ids for s in seqs] == [r.token_ids for r in reference]


def test_the_draft_models_prompt_blocks_are_shared_by_reference(tiny_target, tiny_draft):
    params = GenerationParams(max_new_tokens=12)
    warm = draft_engine(tiny_target, tiny_draft)
    warm.generate([SYSTEM + "Name a colour."], params)
    batch = warm.new_batch()
    seq = batch.add(warm.encode(SYSTEM + "What is two and two?"), params)
    assert seq.cached_tokens >= 3 * BLOCK_TOKENS
    assert batch.drafter.kv.lengths[0] == seq.cached_tokens    # the draft's blocks too
    while batch.active:
        batch.step()
    cold = draft_engine(tiny_target, tiny_draft).generate([SYSTEM + "What is two and two?"],
                                                          params)[0]
    assert batch.result(seq).token_ids == cold.token_ids


def test_a_stopped_rows_draft_blocks_count_before_preemption():
    """plan_admission: a row not drafting this step that holds a draft row gives it back
    before any row is preempted; a drafting row's draft blocks are wanted only while it drafts."""
    rows = [RowNeed("a", holds=16, step=1, blocks=2, private=2),
            RowNeed("b", holds=16, step=1, drafts=0, blocks=2, private=2, draft_private=2),
            RowNeed("c", holds=16, step=1, drafts=3, blocks=2, private=2, draft_extra=1,
                    draft_private=1)]
    assert not plan_admission(rows, free=1, block=BLOCK_TOKENS).changes
    plan = plan_admission(rows, free=0, block=BLOCK_TOKENS)
    assert plan.target_only == ["c"] and plan.preempt == []
    plan = plan_admission([RowNeed("a", 16, 1, blocks=1, private=1),
                           RowNeed("b", 16, 1, blocks=1, private=1, draft_private=2),
                           RowNeed("c", 16, 1, blocks=1, private=1)], free=2, block=BLOCK_TOKENS)
    assert plan.target_only == ["b"] and plan.preempt == []     # c fits once b's draft row is back
