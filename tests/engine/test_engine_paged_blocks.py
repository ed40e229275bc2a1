"""The paged cache's bookkeeping (block_pool.py) as plain values: blocks given and taken back,
prefix blocks shared by reference and evicted least recently used only when nothing is free,
and the admission rule (drafting stops first, newest first; then the newest rows are preempted)."""

from __future__ import annotations

import pytest

from specpair.block_pool import (BlockPool, OutOfBlocks, RowNeed, blocks_for, plan_admission)
from specpair.errors import SpecpairError
from specpair.prefix_cache import block_keys

B = 16


def names(tokens: list[int]) -> list[bytes]:
    return block_keys("model", tokens, B)


def test_blocks_are_given_and_taken_back_all_or_nothing():
    pool = BlockPool(6, B)
    assert blocks_for(0, B) == 0 and blocks_for(1, B) == 1 and blocks_for(16, B) == 1
    assert blocks_for(17, B) == 2
    assert pool.allocate("a", 40) == [0, 1, 2]
    assert pool.allocate("a", 48) == []                  # 48 positions fit in the same 3 blocks
    assert pool.allocate("b", 20) == [3, 4]
    assert pool.free == 1
    with pytest.raises(OutOfBlocks):
        pool.allocate("c", 33)                           # 3 blocks: refused, nothing taken
    assert pool.free == 1 and pool.held("c") == 0
    pool.truncate("a", 17)                               # rejected positions give blocks back
    assert pool.held("a") == 2 and pool.free == 2
    pool.release("b")
    assert pool.free == 4 and pool.held("b") == 0
    with pytest.raises(SpecpairError):
        BlockPool(4, 12)                                 # the C layer finds a key's block by a shift


def test_a_prefix_is_shared_by_reference_and_never_written_by_its_sharers():
    pool = BlockPool(10, B)
    system = list(range(100, 148))                       # three full blocks
    first = system + [1, 2, 3]
    pool.allocate("first", len(first))
    assert pool.publish("first", names(first)) == 3      # its three full blocks, named
    second = system + [7, 8]
    assert pool.share_prefix("second", names(second), len(second)) == 48
    assert pool.tables["second"] == pool.tables["first"][:3]      # the same blocks: no copy
    assert all(pool.refs(b) == 2 for b in pool.tables["first"][:3])
    pool.allocate("second", len(second) + 1)             # its own tokens go to a block of its own
    assert pool.tables["second"][3] not in pool.tables["first"]
    # A prompt that is exactly the shared blocks leaves its last token to prefill.
    assert pool.share_prefix("third", names(system), len(system)) == 32
    # A name the pool already holds keeps its block when another row prefilled it too.
    pool.allocate("twin", len(first))
    assert pool.publish("twin", names(first)) == 0


def test_cached_blocks_outlive_their_rows_and_are_evicted_least_recently_used():
    pool = BlockPool(4, B)
    old, new = list(range(32)), list(range(500, 532))     # two full blocks each
    for row, prompt in (("old", old), ("new", new)):
        pool.allocate(row, len(prompt))
        pool.publish(row, names(prompt))
        pool.release(row)
    assert pool.free == 4 and pool.evictions == 0          # cached blocks can still be given
    assert all(pool.cached(n) for n in names(old) + names(new))
    assert pool.share_prefix("again", names(new + [9]), 33) == 32     # touched: most recent
    pool.allocate("again", 34)                           # nothing free: the LRU block goes,
    assert pool.evictions == 1                           # the old prompt's deepest first
    assert pool.cached(names(old)[0]) and not pool.cached(names(old)[1])
    assert all(pool.cached(n) for n in names(new))
    pool.release("again")                                # its own block is free again
    pool.allocate("x", 16)
    assert pool.evictions == 1                           # a free block before any eviction
    # A held block is never evicted: with every block held, a row is refused.
    pool.allocate("y", 48)
    assert pool.evictions == 4 and pool.free == 0
    with pytest.raises(OutOfBlocks):
        pool.allocate("z", 1)


def test_drafting_stops_first_newest_first_then_the_newest_rows_are_preempted():
    # Three rows of 31 positions (2 blocks each, the second with one position left).
    rows = [RowNeed(r, holds=31, step=1, drafts=4, blocks=2, private=2) for r in "abc"]
    # Each needs nothing more for its own token; speculation needs a third block each.
    assert not plan_admission(rows, free=3, block=B).changes
    plan = plan_admission(rows, free=2, block=B)
    assert plan.target_only == ["c"] and plan.preempt == []
    plan = plan_admission(rows, free=0, block=B)
    assert plan.target_only == ["c", "b", "a"] and plan.preempt == []
    # Each row's own next token needs a new block: drafting off is not enough.
    full = [RowNeed(r, holds=32, step=1, drafts=4, blocks=2, private=2) for r in "abc"]
    plan = plan_admission(full, free=1, block=B)
    assert plan.target_only == ["c", "b", "a"] and plan.preempt == ["c"]
    # A preempted row whose blocks are all shared gives nothing back: the next one goes too.
    shared = [RowNeed("a", 32, 1, blocks=2, private=2), RowNeed("b", 32, 1, blocks=2, private=2),
              RowNeed("c", 32, 1, blocks=2, private=0)]
    assert plan_admission(shared, free=0, block=B).preempt == ["c", "b"]
    # The oldest row is never preempted.
    assert plan_admission(full[:1], free=0, block=B).preempt == []


def test_a_rows_need_is_read_from_the_pool():
    pool = BlockPool(8, B)
    prompt = list(range(40))
    pool.allocate("a", 41)
    pool.publish("a", names(prompt))
    pool.share_prefix("b", names(prompt), len(prompt))
    pool.allocate("b", 41)
    need = pool.need("b", holds=40, step=1, drafts=8)
    assert (need.blocks, need.private) == (3, 1)          # two shared, one its own


def test_a_new_row_costs_its_uncached_blocks_and_the_cached_ones_no_row_holds():
    pool = BlockPool(10, B)
    prompt = list(range(3, 3 + 50))                      # 3 full blocks, all 3 shareable
    assert pool.blocks_to_admit(names(prompt), 50) == 4  # nothing cached: 51 positions, 4 blocks
    pool.allocate("a", 50)
    pool.publish("a", names(prompt))
    # Held by "a": the 3 shareable blocks come by reference and cost nothing free.
    assert pool.blocks_to_admit(names(prompt), 50) == 1
    pool.release("a")                                    # cached, held by none: taking them counts
    assert pool.blocks_to_admit(names(prompt), 50) == 4
    other = [7] + prompt[1:]                             # differs in the first block: no run
    assert pool.blocks_to_admit(names(other), 50) == 4
