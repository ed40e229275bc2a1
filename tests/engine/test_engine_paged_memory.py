"""The paged pool gives memory back (issue 54): pages of blocks no row holds go back to the
system once the pool is idle (prompt blocks kept for reuse beyond SPECPAIR_KV_IDLE_KEEP evicted
first), or once the free blocks' pages pass a slack while rows run. Measured as the pool arrays'
resident pages as the kernel reports them (mincore), not as bytes the pool counts and not as the
whole process's VmRSS: in a test worker, other tests' freed heap is reused by arrays under glibc's
mmap threshold, so the process's RSS rises by less than the pool wrote (CI at 6ab24e8: 140 of
188 MB). The real server's resident memory after a long prompt: tests/server/test_server_memory.py."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from specpair.block_pool import BlockPool
from specpair.config import GenerationParams
from specpair.decoding import SpeculativeEngine
from specpair.errors import SpecpairError
from specpair.paged_cache import IDLE_KEEP_ENV, PagedSpace, idle_keep_bytes
from specpair.prefix_cache import BLOCK_TOKENS


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole pages inside `tensor`'s storage the kernel holds in memory (mincore)."""
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.nbytes) // page * page
    if end <= start:
        return 0
    pages = (end - start) // page
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) * page


def pool_mb(space: PagedSpace) -> float:
    return sum(resident_bytes(k) + resident_bytes(v) for k, v in space.caches) / 2**20


def test_written_blocks_go_back_to_the_system_when_the_pool_is_idle(tiny_target, monkeypatch):
    monkeypatch.setenv(IDLE_KEEP_ENV, "0")
    space = PagedSpace(tiny_target.model, blocks=12_000, lazy=True)     # ~190 MB, untouched
    pool = space.pool
    mb = pool.blocks * space.block_bytes / 2**20
    assert mb > 150
    before = pool_mb(space)
    rows = [("r", i) for i in range(10)]
    for row in rows:
        pool.allocate(row, pool.blocks // 10 * BLOCK_TOKENS)
        ids = torch.tensor(pool.tables[row])
        for k, v in space.caches:                   # the C layer's writes, as pages see them
            k[ids] = 1.0
            v[ids] = 1.0
    written = pool_mb(space)
    assert written - before > 0.8 * mb, (before, written)
    for row in rows[:2]:                  # rows leave while others run: kept, under the slack
        pool.release(row)
    assert space.give_back() == 0 and pool.written_free == 2 * (pool.blocks // 10)
    for row in rows[2:]:
        pool.release(row)
    given = space.give_back()                       # idle: every free block's pages
    after = pool_mb(space)
    assert given > 0.95 * mb * 2**20
    assert written - after > 0.8 * mb, (before, written, after)
    assert pool.free == pool.blocks and pool.written_free == 0
    # A block given back is written again as if new (the C layer writes before it reads).
    pool.allocate(("again", 0), BLOCK_TOKENS)
    block = pool.tables[("again", 0)][0]
    assert torch.count_nonzero(space.caches[0][0][block]) == 0


def test_an_idle_pool_keeps_its_most_recent_prompt_blocks_up_to_the_keep(tiny_target, monkeypatch):
    system = "You are a careful assistant who answers briefly and never guesses. " * 8
    keep_tokens = 3 * BLOCK_TOKENS
    monkeypatch.setenv(IDLE_KEEP_ENV, str(keep_tokens))
    engine = SpeculativeEngine(tiny_target, "ngram")
    params = GenerationParams(max_new_tokens=8)
    first = engine.generate([system + "Name a colour."], params)[0]
    pool = engine.paged_space.pool
    assert pool.idle and pool.cached_blocks == keep_tokens // BLOCK_TOKENS
    assert engine.paged_space.bytes_given_back > 0 and pool.written_free == 0
    again = engine.generate([system + "Name a colour."], params)[0]
    assert again.token_ids == first.token_ids
    assert again.cached_tokens == keep_tokens           # the oldest blocks of the prompt, kept


def test_the_idle_keep_setting(tiny_target):
    per_token = PagedSpace(tiny_target.model, blocks=4).block_bytes // BLOCK_TOKENS
    assert idle_keep_bytes(tiny_target.model, setting="0") == 0
    assert idle_keep_bytes(tiny_target.model, setting="64MiB") == 64 << 20
    assert idle_keep_bytes(tiny_target.model, setting="100") == 100 * per_token
    with pytest.raises(SpecpairError, match=IDLE_KEEP_ENV):
        idle_keep_bytes(tiny_target.model, setting="lots")


def test_evicting_to_a_keep_frees_least_recently_used_blocks_first():
    pool = BlockPool(8, 4)
    for n, row in enumerate(["a", "b", "c"]):
        pool.allocate(row, 4)
        pool.publish(row, [bytes([n])])
        pool.release(row)
    assert pool.cached_blocks == 3 and pool.written_free == 0
    assert pool.evict_to(1) == 2
    assert pool.cached(bytes([2])) and not pool.cached(bytes([0]))
    assert pool.written_free == 2 and pool.take_written() == [0, 1] and pool.written_free == 0
