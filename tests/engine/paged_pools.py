"""Paged copies of a contiguous KV cache for the C layer's bitwise tests
(test_engine_paged_kernel.py, test_engine_prefill_attention.py): a pool of fixed-size blocks at
shuffled places and each row's block table, and the way back."""

from __future__ import annotations

import torch

BLOCK = 16


def paged_copy(kc: torch.Tensor, vc: torch.Tensor, gen: torch.Generator, shared: int = 0):
    """A pool and block tables holding what the contiguous cache [rows, kv heads, S, hd] holds:
    each row's blocks at shuffled places in the pool (a few blocks never used), the first
    `shared` blocks of every row the very blocks of row 0 (a prefix all rows share by reference;
    the contiguous rows hold equal values there)."""
    rows, kv_heads, S, hd = kc.shape
    per_row = S // BLOCK
    pool_blocks = shared + rows * (per_row - shared) + 3
    order = torch.randperm(pool_blocks, generator=gen)
    table = torch.empty(rows, per_row, dtype=torch.long)
    table[:, :shared] = order[:shared]
    table[:, shared:] = order[shared:shared + rows * (per_row - shared)].view(rows, -1)
    pool_k = torch.full((pool_blocks, kv_heads, BLOCK, hd), float("nan"))
    pool_v = pool_k.clone()
    for r in range(rows):
        for b in range(per_row):
            pool_k[table[r, b]] = kc[r, :, b * BLOCK:(b + 1) * BLOCK]
            pool_v[table[r, b]] = vc[r, :, b * BLOCK:(b + 1) * BLOCK]
    return pool_k, pool_v, table


def read_paged(pool: torch.Tensor, table: torch.Tensor, row: int, position: int) -> torch.Tensor:
    return pool[table[row, position // BLOCK], :, position % BLOCK]


def unpaged(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The pool's contents as a contiguous cache [rows, kv heads, S, hd]."""
    return torch.stack([torch.cat([pool[b] for b in row.tolist()], dim=1) for row in table])
