"""The paged cache at the model level (paged_cache.PagedKVModel) against the contiguous cache
(static.StaticKVModel): bitwise the same logits through prompts, decode steps,
verifications, rejections, rows leaving and joining, at batch 1, 8 and 32; a prefix shared by
reference gives a row exactly what prefilling it gives; a pool too small refuses a step and
changes nothing; blocks go back as rows roll back and leave."""

from __future__ import annotations

import pytest
import torch

from specpair import cpu_kernels
from specpair.block_pool import OutOfBlocks
from specpair.paged_cache import PagedKVModel
from specpair.prefix_cache import block_keys
from specpair.kv.static import StaticKVModel


def tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=gen).tolist()


@pytest.mark.parametrize("batch,prompt", [(1, 40), (8, 8), (32, 2)])
def test_paged_equals_contiguous_bitwise_through_every_operation(tiny_target, batch, prompt):
    """Every step here is at most 64 tokens, so both caches run the C layer."""
    assert cpu_kernels.available(), cpu_kernels.status()
    model = tiny_target.model
    gen = torch.Generator().manual_seed(batch)
    paged, contiguous = PagedKVModel(model, blocks=8 * batch + 8), StaticKVModel(model)

    def both(rows, last=1):
        got, expected = paged.extend(rows, last), contiguous.extend(rows, last)
        assert torch.equal(got, expected)
        assert paged.lengths == contiguous.lengths

    def each(op, *args):
        getattr(paged, op)(*args)
        getattr(contiguous, op)(*args)

    each("add_rows", batch)
    both([tokens(gen, prompt) for _ in range(batch)])
    for _ in range(3):
        both([tokens(gen, 1) for _ in range(batch)])
    verify = 5 if batch < 32 else 2
    both([tokens(gen, verify) for _ in range(batch)], last=verify)     # verification
    for i in range(0, batch, 2):
        each("rollback", i, contiguous.lengths[i] - 1)                  # a rejected draft
    both([tokens(gen, 1) for _ in range(batch)])
    keep = list(range(batch - 1, -1, -2))                              # half leave, reordered
    held = paged.pool.free
    each("select", keep)
    assert batch == 1 or paged.pool.free > held                        # their blocks came back
    each("add_rows", 1)                                                # a row joins
    both([tokens(gen, 1) for _ in keep] + [tokens(gen, 1 if batch == 32 else 6)])
    both([tokens(gen, 1) for _ in range(len(keep) + 1)])


def test_a_prefix_shared_by_reference_gives_what_prefilling_it_gives(tiny_target):
    cpu_kernels.available()
    model = tiny_target.model
    gen = torch.Generator().manual_seed(3)
    system = tokens(gen, 48)                            # three full blocks
    first, second = system + tokens(gen, 7), system + tokens(gen, 9)
    paged = PagedKVModel(model, blocks=16)
    paged.add_rows(1)
    paged.extend([first])
    assert paged.publish(0, block_keys("m", first)) == 3
    paged.add_rows(1)
    assert paged.share_prefix(1, block_keys("m", second), len(second)) == 48
    shared = paged.pool.tables[paged.keys[1]][:3]
    assert shared == paged.pool.tables[paged.keys[0]][:3]          # the same blocks, not copies
    served = paged.extend([[], second[48:]])[1]
    alone = PagedKVModel(model, blocks=16)
    alone.add_rows(1)
    assert torch.equal(served, alone.extend([second])[0])
    # The first row's prompt blocks were read, never written, by the second.
    assert torch.equal(paged.extend([[5], [6]])[1], alone.extend([[6]])[0])


def test_a_long_prompt_runs_in_calls_of_the_c_layer_and_agrees_to_rounding(tiny_target):
    model = tiny_target.model
    gen = torch.Generator().manual_seed(4)
    prompt = tokens(gen, 150)                           # three calls of at most 64 tokens
    paged, contiguous = PagedKVModel(model, blocks=16), StaticKVModel(model)
    for kv in (paged, contiguous):
        kv.add_rows(1)
    torch.testing.assert_close(paged.extend([prompt], last=4), contiguous.extend([prompt], last=4),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(paged.extend([[7]]), contiguous.extend([[7]]), rtol=1e-4, atol=1e-4)


def test_a_pool_too_small_refuses_the_step_and_changes_nothing(tiny_target):
    model = tiny_target.model
    paged = PagedKVModel(model, blocks=3)               # 48 positions in all
    paged.add_rows(2)
    paged.extend([list(range(3, 33)), [4]])            # 2 blocks + 1 block
    lengths, free = list(paged.lengths), paged.pool.free
    with pytest.raises(OutOfBlocks):
        paged.extend([list(range(3, 6)), [5]])          # row 0 needs a third block
    assert paged.lengths == lengths and paged.pool.free == free
    paged.rollback(0, 10)                               # a block back
    assert paged.pool.free == 1
    paged.extend([[5], [6]])
