"""The paged cache as the engine's live target cache on the CPU's C path (decoding.Batch over
paged_cache.PagedKVModel, one pool per engine): a prompt whose prefix blocks come from the pool by
reference emits exactly what it emits cold; rows preempted when the pool runs out, and recomputed
later, emit exactly their solo output (greedy and seeded sampling); requests are admitted by free
blocks; a request the whole pool cannot hold is refused by name; a dropped batch gives its blocks
back."""

from __future__ import annotations

import gc

import pytest

from specpair.config import GenerationParams, ModelRef, PairSpec, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import ModelDrafter
from specpair.errors import SpecpairError
from specpair.paged_cache import PagedKVModel, PagedSpace
from specpair.prefix_cache import BLOCK_TOKENS
from specpair.shadow import Candidate, ShadowScorer

SPEC = SpeculationConfig(k=4, batch_size_threshold=64)
SYSTEM = "You are a careful assistant who answers briefly and never guesses. " * 4


def ngram_engine(tiny_target, **options) -> SpeculativeEngine:
    return SpeculativeEngine(tiny_target, "ngram", speculation=SPEC, **options)


def test_the_paged_cache_is_the_target_cache_where_the_c_layer_runs(tiny_target, tiny_draft,
                                                                   monkeypatch):
    engine = ngram_engine(tiny_target)
    assert engine.paged_unused is None and isinstance(engine.new_batch().target, PagedKVModel)
    assert engine.paged_space.max_rows == 64            # 2 GiB holds 64 rows of a tiny model
    target_only = SpeculativeEngine(tiny_target)
    assert isinstance(target_only.new_batch().target, PagedKVModel)
    # A draft model's rows take their blocks from the same pool (test_engine_paged_draft.py).
    with_draft = SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=SPEC)
    assert with_draft.paged_unused is None and with_draft.paged_space.draft is not None
    assert with_draft.paged_space.max_rows == 64
    monkeypatch.setenv("SPECPAIR_PAGED", "off")
    assert SpeculativeEngine(tiny_target).paged_space is None


@pytest.mark.parametrize("params", [GenerationParams(max_new_tokens=20),
                                    GenerationParams(max_new_tokens=20, temperature=0.8, seed=7)],
                         ids=["greedy", "seeded"])
def test_a_prompt_served_from_shared_blocks_emits_what_it_emits_cold(tiny_target, params):
    first, second = SYSTEM + "Name a colour.", SYSTEM + "What is two and two?"
    warm = ngram_engine(tiny_target)
    warm.generate([first], params)
    served = warm.generate([second], params)[0]
    cold = ngram_engine(tiny_target).generate([second], params)[0]
    assert cold.cached_tokens == 0
    assert served.cached_tokens >= 3 * BLOCK_TOKENS and served.cached_tokens % BLOCK_TOKENS == 0
    assert served.token_ids == cold.token_ids
    stats = warm.prefix_stats
    assert stats.served == served.cached_tokens and stats.looked_up > stats.served
    # The served row read the very blocks the first prompt wrote: held by no row now, cached.
    pool = warm.paged_space.pool
    assert pool.free == pool.blocks and pool.evictions == 0


def test_rows_preempted_for_blocks_and_recomputed_emit_their_solo_output(tiny_target):
    prompts = [f"Question {i}: " + "what comes after %d? " % (i * 7) * (2 + i % 4) for i in range(12)]
    params = [GenerationParams(max_new_tokens=24) if i % 3 else
              GenerationParams(max_new_tokens=24, temperature=0.9, seed=i) for i in range(12)]
    solo_engine = ngram_engine(tiny_target)
    solo = [solo_engine.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]

    engine = ngram_engine(tiny_target)
    engine.paged_space = PagedSpace(tiny_target.model, blocks=20)     # 320 positions for 12 rows
    batch = engine.new_batch()
    seqs = [batch.add(engine.encode(p), q) for p, q in zip(prompts, params)]
    peak = 0
    while batch.active:
        batch.step()
        peak = max(peak, len(batch.preempted))
    assert batch.preemptions > 0 and engine.paged_space.preemptions == batch.preemptions and peak
    assert sum(s.preemptions for s in seqs) == batch.preemptions
    assert [batch.result(s).token_ids for s in seqs] == solo
    assert all(batch.result(s).finish_reason == "length" for s in seqs)
    pool = engine.paged_space.pool
    assert pool.free == pool.blocks and not pool.tables          # every block came back


def test_admission_is_by_free_blocks_and_a_request_past_the_pool_is_refused(tiny_target):
    engine = ngram_engine(tiny_target)
    engine.paged_space = PagedSpace(tiny_target.model, blocks=8)       # 128 positions
    batch = engine.new_batch()
    long_prompt = engine.encode("count with me: " + "one two three four " * 6)
    assert 64 < len(long_prompt) < 100
    with pytest.raises(SpecpairError, match="the pool holds 8"):
        batch.add(long_prompt, GenerationParams(max_new_tokens=64))
    assert batch.has_room(long_prompt)                                 # empty: it fits
    batch.add(long_prompt, GenerationParams(max_new_tokens=8))
    batch.step()
    other = engine.encode("a different prompt, " * 3)                 # 3 blocks
    assert not batch.has_room(other)         # the running row holds 6 of 8 blocks
    while batch.active:
        batch.step()
    assert batch.has_room(other)


def test_a_dropped_batch_gives_its_blocks_back(tiny_target):
    engine = ngram_engine(tiny_target)
    pool = engine.paged_space.pool
    batch = engine.new_batch()
    batch.add(engine.encode("a prompt that will never finish " * 4), GenerationParams(max_new_tokens=50))
    batch.step()
    assert pool.tables and pool.free < pool.blocks
    del batch
    gc.collect()
    assert not pool.tables and pool.free == pool.blocks
    replaced = engine.new_batch()          # a batch the server's worker replaces after a failure
    replaced.add(engine.encode("another prompt that will not finish " * 4),
                 GenerationParams(max_new_tokens=50))
    replaced.step()
    assert pool.tables
    replaced.release()                     # given back at once, while the batch is still alive
    assert not pool.tables and pool.free == pool.blocks


def test_a_shadow_candidates_draft_cache_counts_against_the_pool(tiny_target, tiny_draft):
    engine = ngram_engine(tiny_target)
    engine.paged_space = PagedSpace(tiny_target.model, blocks=64)
    batch = engine.new_batch()
    prompt = engine.encode("a prompt to shadow, " * 3)
    batch.add(prompt, GenerationParams(max_new_tokens=8))
    batch.step()
    assert batch._shadow_blocks() == 0
    candidate = Candidate(version="7", content_hash="c" * 64,
                          pair=PairSpec(target=ModelRef("tiny"), drafter="ngram", speculation=SPEC))
    engine.add_observer(ShadowScorer(ModelDrafter(tiny_draft, vocab_size=engine.vocab_size),
                                     candidate, share=1.0, seed=0, batch_size_threshold=64))
    batch.add(engine.encode("another prompt, " * 3), GenerationParams(max_new_tokens=8))
    batch.step()                    # the shadow takes the rows and drafts: its cache is allocated
    shadow = batch._shadow_blocks()
    draft_kv = engine.shadow._batches[batch].drafter.kv
    assert shadow > 0 and shadow * BLOCK_TOKENS * engine._target_kv >= draft_kv.cache_bytes
    assert batch._blocks_reserved() >= shadow + batch.active
    while batch.active:
        batch.step()
