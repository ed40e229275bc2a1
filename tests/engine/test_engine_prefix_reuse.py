"""Prefix reuse: the store's block, name and eviction rules as plain values, and a request whose
prompt's first blocks come from the store emitting exactly the tokens it emits cold, on the C
layer's float32 path and on the fixed step (bf16 on the CPU), with and without speculation."""

from __future__ import annotations

import pytest
import torch

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import NgramDrafter
from specpair.errors import SpecpairError
from specpair.kv.dynamic import BatchedKVModel
from specpair.prefix_cache import (BLOCK_TOKENS, BYTES_WITHOUT_BUDGET, KV_BUDGET_SHARE, PrefixStore,
                                   block_keys, capacity_bytes, resolve_mode, reusable_blocks)
from specpair.kv.static import StaticKVModel

# -- the store, as values -------------------------------------------------------------------------


def test_a_blocks_name_covers_everything_before_it_and_the_model():
    a = list(range(40))
    b = a[:16] + [999] + a[17:]            # differs in the second block only
    ka, kb = block_keys("m", a, 16), block_keys("m", b, 16)
    assert len(ka) == 2                    # full blocks only: 40 tokens, two of 16
    assert ka[0] == kb[0] and ka[1] != kb[1]
    c = [999] + a[1:]                      # differs in the first block: every later name differs
    assert all(x != y for x, y in zip(block_keys("m", c, 16), ka))
    assert block_keys("other model", a, 16)[0] != ka[0]
    assert block_keys("m", a[:15], 16) == []


def test_the_last_prompt_token_is_never_served():
    assert [reusable_blocks(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 0, 0, 1, 1, 2]
    store = PrefixStore(capacity=10**6, block=4)
    tokens = list(range(8))                # exactly two blocks
    keys = store.keys("m", tokens)
    store.insert(keys, {0: ("b0", 1), 1: ("b1", 1)})
    assert store.lookup(keys, len(tokens)) == ["b0"]           # 7 tokens may come, 4 do
    longer = store.keys("m", tokens + [8])
    assert store.lookup(longer, 9) == ["b0", "b1"]


def test_lookup_serves_the_longest_stored_run_from_the_start():
    store = PrefixStore(capacity=100, block=2)
    keys = store.keys("m", list(range(10)))
    store.insert(keys, {0: ("b0", 1), 2: ("b2", 1)})            # block 1 missing
    assert store.lookup(keys, 10) == ["b0"]
    assert store.missing(keys) == [1, 3, 4]


def test_eviction_takes_the_least_recently_used_and_a_chain_from_its_end():
    store = PrefixStore(capacity=4, block=1)
    first = store.keys("m", [1, 2, 3])
    store.insert(first, {i: (f"a{i}", 1) for i in range(3)})
    second = store.keys("m", [7, 8])
    store.insert(second, {0: ("b0", 1), 1: ("b1", 1)})          # 5 bytes > 4: one goes
    assert store.bytes == 4 and store.evictions == 1
    # The first prefix's deepest block went, not its first: its first two still serve.
    assert store.lookup(first, 4) == ["a0", "a1"]
    store.insert(store.keys("m", [5]), {0: ("c0", 3)})           # the second prefix is oldest now
    assert store.lookup(second, 3) == [] and store.lookup(first, 4) == ["a0"]
    store.insert(store.keys("m", [6]), {0: ("huge", 5)})         # larger than the store: not kept
    assert store.bytes <= store.capacity and store.lookup(store.keys("m", [6]), 2) == []


def test_the_stores_size_is_a_share_of_the_kv_budget_and_bad_settings_are_refused(monkeypatch):
    assert capacity_bytes(1000) == int(1000 * KV_BUDGET_SHARE)
    assert capacity_bytes(None) == BYTES_WITHOUT_BUDGET
    monkeypatch.setenv("SPECPAIR_PREFIX_CACHE", "off")
    assert resolve_mode() == "off" and resolve_mode("on") == "on"
    with pytest.raises(SpecpairError, match="on or off"):
        resolve_mode("maybe")
    with pytest.raises(SpecpairError):
        PrefixStore(capacity=-1)


# -- the caches ---------------------------------------------------------------------------------------


def test_blocks_read_from_one_row_load_into_another(tiny_target):
    kv = StaticKVModel(tiny_target.model)
    kv.add_rows(2)
    prompt = list(range(5, 5 + 2 * BLOCK_TOKENS + 3))
    kv.extend([prompt[:4], prompt])
    blocks = kv.read_blocks(1, [0, BLOCK_TOKENS], BLOCK_TOKENS)
    assert blocks[0].shape[:4] == (tiny_target.model.config.num_hidden_layers, 2,
                                   kv.caches[0][0].shape[1], BLOCK_TOKENS)
    fresh = StaticKVModel(tiny_target.model)
    fresh.add_rows(2)
    assert fresh.load_blocks(1, blocks) == 2 * BLOCK_TOKENS
    assert fresh.lengths == [0, 2 * BLOCK_TOKENS]
    for (k, v), (k0, v0) in zip(fresh.caches, kv.caches):
        assert torch.equal(k[1, :, :2 * BLOCK_TOKENS], k0[1, :, :2 * BLOCK_TOKENS])
        assert torch.equal(v[1, :, :2 * BLOCK_TOKENS], v0[1, :, :2 * BLOCK_TOKENS])
    warm = fresh.extend([prompt[:1], prompt[2 * BLOCK_TOKENS:]])[1]
    cold = tiny_target.model(torch.tensor([prompt])).logits[0, -1:]
    torch.testing.assert_close(warm, cold, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="already holds"):
        fresh.load_blocks(1, blocks)
    with pytest.raises(ValueError, match="holds 4 positions"):
        kv.read_blocks(0, [0], BLOCK_TOKENS)
    assert not BatchedKVModel.reuses_prefixes


# -- whole requests: cold and served from the store -----------------------------------------------------


def _run(engine, prompts, params):
    batch = engine.new_batch()
    seqs = [batch.add(p, params) for p in prompts]
    while batch.active:
        batch.step()
    return [batch.result(s) for s in seqs]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["c-layer", "fixed-step"])
def target(request, tiny_tokenizer):
    from tiny_models import make_model
    return make_model(tiny_tokenizer, seed=1, dtype=request.param)


@pytest.mark.parametrize("speculation", ["off", "ngram", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_a_prompt_served_from_the_store_emits_what_it_emits_cold(target, speculation, temperature):
    from tiny_models import perturbed_copy
    kwargs = {"off": {"speculation": SpeculationConfig(enabled=False)},
              "ngram": {"drafter": NgramDrafter()},
              "draft": {"draft": perturbed_copy(target, seed=5, noise=0.03)}}[speculation]
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(5, 300, (5 * BLOCK_TOKENS + 3,), generator=gen).tolist()
    prompts = [system + torch.randint(5, 300, (n,), generator=gen).tolist() for n in (6, 21)]
    params = GenerationParams(max_new_tokens=16, temperature=temperature, seed=7)
    cold_engine = SpeculativeEngine(target, prefix_cache="off", **kwargs)
    cold = [_run(cold_engine, [p], params)[0] for p in prompts]
    engine = SpeculativeEngine(target, prefix_cache="on", **kwargs)
    warm = [_run(engine, [p], params)[0] for p in prompts]
    assert fixed_or_not(engine) == (target.model.dtype == torch.bfloat16)
    assert [r.cached_tokens for r in cold] == [0, 0]
    # The first request fills the store; the second takes the shared system prompt's full blocks.
    assert [r.cached_tokens for r in warm] == [0, 5 * BLOCK_TOKENS]
    assert engine.prefix_stats.served == 5 * BLOCK_TOKENS
    assert engine.prefix_stats.looked_up == sum(map(len, prompts))
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    if speculation == "draft":     # the draft model's blocks are stored and served too
        kept = (len(engine.prefix_store) if engine.paged_space is None    # or named in the pool
                else engine.paged_space.pool.named)
        assert kept == 2 * (len(prompts[1]) // BLOCK_TOKENS)
    if speculation != "off":       # speculation ran: otherwise target-only output passes this
        assert sum(r.stats.num_draft_tokens for r in warm + cold) > 0


def fixed_or_not(engine) -> bool:
    return engine.new_batch().target.fixed


def test_prefix_reuse_can_be_switched_off(tiny_target, monkeypatch):
    monkeypatch.setenv("SPECPAIR_PREFIX_CACHE", "off")
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    prompt = list(range(5, 5 + 3 * BLOCK_TOKENS))
    params = GenerationParams(max_new_tokens=2)
    assert [r.cached_tokens for r in _run(engine, [prompt, prompt], params)] == [0, 0]
    assert engine.prefix_store is None
