"""Head engines (EAGLE-3, EAGLE, Medusa) on the paged cache (paged_cache.py): the target's keys and
values in the pool with prefix blocks shared by reference, the target's features of every written
position kept beside them (PagedSpace.features), so a row served a shared prefix hands its head
the prefix's features instead of the target computing them again; the head's own cache counted in
admission (drafters.base.Drafter.cache_bytes).

Greedy output equals target-only with drafting proven, rows joining a running batch and sharing a
system prompt (the pool's prefix blocks hit); a row served a shared prefix drafts and accepts what
it does cold; rows preempted through a small pool emit their solo output; a head scored in shadow
keeps the paged cache on, its output unchanged. Lookup-first (copies where the text repeats, a
head elsewhere) copies on the paged cache as on the contiguous one, the round at a prompt's end
included (a copy needs no features: it does not wait for the prompt's last ones). A head's own
keys and values over a shared prefix's full blocks are kept once in the pool, beside the target's
blocks (priced in a block's bytes, evicted with it), and served to the next row sharing them: it
drafts what it does cold."""

from __future__ import annotations

import pytest
from head_builders import eagle3_head, medusa_heads, mirror_head

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.paged_cache import PAGED_ENV, PagedKVModel, PagedSpace
from specpair.prefix_cache import BLOCK_TOKENS

SPEC = SpeculationConfig(k=3, k_max=3, dynamic_k=False, fallback_threshold=0,
                         batch_size_threshold=64)
SYSTEM = "You are a careful assistant. Answer in one line.\nclass A:\n  pass\n" * 2
QUESTIONS = ["def foo(x):\n    return", "The quick brown fox", "import os\nimport sys\n",
             "x = [1, 2, 3]\nfor i in x:\n", "Hello world, hello world", "class B:\n  pass\n"]
PROMPTS = [SYSTEM + q for q in QUESTIONS]
PARAMS = GenerationParams(max_new_tokens=24)


def head_engine(kind: str, request, speculation=SPEC, **options) -> SpeculativeEngine:
    if kind == "eagle3":
        target = request.getfixturevalue("eagle3_target")
        head = eagle3_head(target)
    elif kind == "eagle":
        target = request.getfixturevalue("one_layer_target")
        head = mirror_head(target, vocab_every=2)
    else:
        target = request.getfixturevalue("smooth_target")
        head = medusa_heads(target)
    return SpeculativeEngine(target, draft=head, speculation=speculation, **options)


def cold_replies(engine) -> list[list[int]]:
    """Each prompt alone, target-only, no prefix reuse: what every row must emit."""
    alone = SpeculativeEngine(engine.target, speculation=SpeculationConfig(enabled=False),
                              prefix_cache="off")
    return [alone.generate([p], PARAMS)[0].token_ids for p in PROMPTS]


def run_joining(engine):
    """The first row alone for two steps (its prompt's blocks named in the pool), then the others
    join the running batch, sharing its system prompt's blocks."""
    batch = engine.new_batch()
    seqs = [batch.add(engine.encode(PROMPTS[0]), PARAMS)]
    batch.step()
    batch.step()
    seqs += [batch.add(engine.encode(p), PARAMS) for p in PROMPTS[1:]]
    while batch.active:
        batch.step()
    return batch, [batch.result(s) for s in seqs]


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa"])
def test_a_head_engine_runs_the_paged_cache_with_shared_prefixes_and_target_only_output(
        kind, request):
    engine = head_engine(kind, request)
    assert engine.paged_unused is None and engine.paged_space is not None
    batch, results = run_joining(engine)
    assert isinstance(batch.target, PagedKVModel)
    assert [r.token_ids for r in results] == cold_replies(engine)
    drafted = sum(r.stats.num_draft_tokens for r in results)
    accepted = sum(r.stats.num_accepted_tokens for r in results)
    assert drafted > 0 and 0 < accepted < drafted           # it drafted, and was checked
    # The rows that joined were served the system prompt's blocks from the pool.
    shared = len(engine.encode(SYSTEM)) // BLOCK_TOKENS * BLOCK_TOKENS
    assert shared >= 2 * BLOCK_TOKENS
    assert all(r.cached_tokens >= shared - BLOCK_TOKENS for r in results[1:])
    assert results[0].cached_tokens == 0 and engine.prefix_stats.served > 0
    assert engine.paged_space.features is not None          # the features kept beside the keys
    pool = engine.paged_space.pool
    assert not pool.tables and pool.free == pool.blocks


def test_a_row_served_a_shared_prefix_drafts_what_it_drafts_cold(request):
    """EAGLE-3: a row handed its prefix's features from the pool catches its head up on them and
    then drafts and keeps, round for round, what the same row drafts with no prefix reuse."""
    def alone(engine, prompt):
        batch = engine.new_batch()
        seq = batch.add(engine.encode(prompt), PARAMS)
        while batch.active:
            batch.step()
        return batch.result(seq)

    cold = head_engine("eagle3", request, prefix_cache="off")
    warm = head_engine("eagle3", request)
    alone(warm, PROMPTS[0])                   # names the system prompt's blocks
    for prompt in PROMPTS[1:3]:
        expected, got = alone(cold, prompt), alone(warm, prompt)
        assert got.cached_tokens > 0 and expected.cached_tokens == 0
        assert got.token_ids == expected.token_ids
        assert got.stats.num_accepted_tokens > 0
        assert (got.stats.num_draft_tokens, got.stats.num_accepted_tokens) == \
            (expected.stats.num_draft_tokens, expected.stats.num_accepted_tokens)


def run_all(engine):
    """Every prompt in one batch; -> the batch, its rows, and the most pool blocks the head's own
    cache was counted at."""
    batch = engine.new_batch()
    seqs = [batch.add(engine.encode(p), PARAMS) for p in PROMPTS]
    head_blocks = 0
    while batch.active:
        batch.step()
        head_blocks = max(head_blocks, batch._shadow_blocks())
    return batch, seqs, head_blocks


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_rows_preempted_with_a_head_emit_their_solo_output(kind, request):
    """A pool that holds the head's cache and half the rows' positions: rows wait for blocks
    and are recomputed (their head rows too, handed their prompts' features again)."""
    engine = head_engine(kind, request)
    solo = cold_replies(engine)
    _, _, head_blocks = run_all(engine)
    row_blocks = sum(-(-(len(engine.encode(p)) + PARAMS.max_new_tokens) // BLOCK_TOKENS)
                     for p in PROMPTS)
    engine.paged_space = PagedSpace(engine.target.model, blocks=head_blocks + row_blocks // 2)
    batch, seqs, _ = run_all(engine)
    assert batch.preemptions > 0
    assert [batch.result(s).token_ids for s in seqs] == solo
    assert sum(batch.result(s).stats.num_accepted_tokens for s in seqs) > 0
    pool = engine.paged_space.pool
    assert not pool.tables and pool.free == pool.blocks


def test_the_heads_own_cache_is_counted_in_admission(request):
    """The head's keys and values live beside the pool: a batch reserves the pool's blocks for
    them (Drafter.cache_bytes), beside a block at least for each row's next step."""
    engine = head_engine("eagle3", request)
    batch = engine.new_batch()
    batch.add(engine.encode(PROMPTS[0]), PARAMS)
    batch.step()
    batch.step()
    assert batch.drafter.cache_bytes() > 0
    head_blocks = batch._shadow_blocks()
    assert head_blocks > 0
    per_position = batch.target.pool.block * engine._target_kv
    assert head_blocks == -(-batch.drafter.cache_bytes() // per_position)
    assert batch._blocks_reserved() >= head_blocks + 1


def test_lookup_first_copies_on_the_paged_cache_as_on_the_contiguous_one(one_layer_target,
                                                                         monkeypatch):
    """Lookup-first went paged with the heads and then never copied: a head row waited for its
    prompt's last features before drafting, and the copy at the prompt's end (its last token
    found earlier in it) waited with it. Paged now copies, row-round for row-round, as the
    contiguous cache does, with rows joining and sharing the system prompt's blocks."""
    def engine(paged: str) -> SpeculativeEngine:
        monkeypatch.setenv(PAGED_ENV, paged)
        return SpeculativeEngine(one_layer_target, draft=mirror_head(one_layer_target, vocab_every=2),
                                 speculation=SpeculationConfig(
                                     k=3, k_max=3, dynamic_k=False, fallback_threshold=0,
                                     batch_size_threshold=64, lookup_min_match=1))
    contiguous, paged = engine("off"), engine("on")
    assert contiguous.paged_space is None
    assert paged.paged_unused is None and paged.paged_space is not None
    runs = {}
    for name, eng in (("contiguous", contiguous), ("paged", paged)):
        batch, results = run_joining(eng)
        runs[name] = (batch, results, dict(eng.drafter.rounds))
    _, cont_results, cont_rounds = runs["contiguous"]
    batch, results, rounds = runs["paged"]
    assert isinstance(batch.target, PagedKVModel)
    assert [r.token_ids for r in results] == [r.token_ids for r in cont_results] == \
        cold_replies(paged)
    assert rounds["copied"] > 0 and rounds["head"] > 0, rounds
    # (rounds["head"] counts asks: the contiguous cache asks its head at a prompt's end, where
    # it has no features yet and drafts nothing; the paged cache does not ask.)
    assert rounds["copied"] == cont_rounds["copied"]
    # Row by row: the same drafts, kept and copied, round for round.
    def per_row(rs):
        return [(r.stats.num_draft_tokens, r.stats.num_accepted_tokens,
                 r.stats.num_copied_draft_tokens_per_pos) for r in rs]
    assert per_row(results) == per_row(cont_results)
    assert all(r.cached_tokens > 0 for r in results[1:])      # the prefix was served


@pytest.mark.parametrize("kind", ["eagle3", "eagle3-row-by-row", "eagle"])
def test_a_heads_own_keys_over_a_shared_prefix_are_served_not_computed_again(kind, request):
    """A row sharing the system prompt's blocks takes its head's keys and values over them from
    the prefix store (the first row's head computed them): its head holds those positions before
    any step, then drafts and keeps, round for round, what the same row does cold. EAGLE-3 in
    its C kernel's cache of every row (the CPU's default) and row by row in PyTorch."""
    def alone(engine, prompt):
        batch = engine.new_batch()
        seq = batch.add(engine.encode(prompt), PARAMS)
        held = batch.drafter.prefix_positions(0)
        while batch.active:
            batch.step()
        return seq, held, batch.result(seq)

    cold = head_engine(kind.split("-")[0], request, prefix_cache="off")
    warm = head_engine(kind.split("-")[0], request)
    if kind == "eagle3-row-by-row":
        from specpair.drafters.eagle3 import Eagle3Drafter
        for engine in (cold, warm):
            engine.drafter = Eagle3Drafter(engine.drafter.loaded, engine.target.model,
                                           engine.vocab_size, kernel=False)
    solo = cold_replies(warm)
    first, held, _ = alone(warm, PROMPTS[0])          # stores the system prompt's blocks
    assert first.head_saved and first.head_cached == 0 and held == 0
    shared = len(warm.encode(SYSTEM)) // BLOCK_TOKENS * BLOCK_TOKENS
    for n, prompt in enumerate(PROMPTS[1:3], start=1):
        seq, held, got = alone(warm, prompt)
        _, _, expected = alone(cold, prompt)
        assert kind == "eagle" or warm.new_batch().drafter.kernel == (kind == "eagle3")
        # Every shared block of the head's, up to the block whose pairs reach past the system
        # prompt (pair j reads token j+1), was served: held before the row's first step.
        assert held == seq.head_cached >= shared - BLOCK_TOKENS > 0
        assert got.cached_tokens > 0 and expected.cached_tokens == 0
        assert got.token_ids == expected.token_ids == solo[n]
        assert got.stats.num_accepted_tokens > 0
        assert (got.stats.num_draft_tokens, got.stats.num_accepted_tokens) == \
            (expected.stats.num_draft_tokens, expected.stats.num_accepted_tokens)


TREE = SpeculationConfig(k=3, k_max=3, dynamic_k=False, fallback_threshold=0,
                         batch_size_threshold=64, tree_width=3)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_token_trees_run_on_the_paged_cache_as_on_the_contiguous_one(kind, request, monkeypatch):
    """A head drafting trees (3 candidates a depth) keeps the paged cache: its tree is fed through
    the block table (slots and parents in the C layer), a kept sibling moved where the chain
    would have put it. With rows joining a running batch (served the system prompt's blocks)
    and leaving as they end, every row drafts and keeps, round for round, what it does on the
    contiguous cache, and both emit target-only's tokens."""
    moved = []
    move = PagedKVModel.move
    monkeypatch.setattr(PagedKVModel, "move",
                        lambda self, moves: (moved.extend(moves), move(self, moves))[1])
    runs = {}
    for paged in ("off", "on"):
        monkeypatch.setenv(PAGED_ENV, paged)
        engine = head_engine(kind, request, speculation=TREE)
        assert (engine.paged_space is not None) == (paged == "on"), engine.paged_unused
        batch, results = run_joining(engine)
        assert isinstance(batch.target, PagedKVModel) == (paged == "on")
        runs[paged] = results
    solo = cold_replies(engine)
    for paged, results in runs.items():
        assert [r.token_ids for r in results] == solo, paged
        assert sum(r.stats.num_accepted_tokens for r in results) > 0, paged

    def per_row(rs):
        return [(r.stats.num_drafts, r.stats.num_target_steps, r.stats.num_draft_tokens,
                 r.stats.num_accepted_tokens) for r in rs]
    assert per_row(runs["on"]) == per_row(runs["off"])
    assert moved, "no sibling was kept on the paged cache"     # the tree mattered
    assert all(r.cached_tokens > 0 for r in runs["on"][1:])
    pool = engine.paged_space.pool
    assert not pool.tables and pool.free == pool.blocks
