"""The fixed-shape step over a paged cache (`PagedFixedKVModel`): the GPU's step (CUDA, bf16) with
keys and values in one pool of fixed-size blocks per model instead of a (rows x capacity) tensor.

Each row holds blocks for its own positions only (block_pool.BlockPool decides which); its block
table is a row of one device tensor [rows bucket, capacity bucket / block], the rest of the row
naming the pool's null block (one block past the pool's own, never handed to a row). The step is
the contiguous cache's fixed step (static.StaticKVModel) with the cache reached through that
table (fixed_step.paged_write_read): a token's key and value are written at table[row, slot //
block], offset slot % block, and attention reads the step rows' blocks gathered into the
contiguous cache's shape, then runs the same masked math. So:

- every logit is bitwise the contiguous fixed step's at the same (rows, capacity) bucket: the
  gathered keys equal the contiguous cache's at every attended slot, and the masked ones weigh
  exactly 0 (the null block and a row's unwritten slots hold finite values, as the contiguous
  cache's stale slots do);
- the step still has one shape per bucket (the table's, not the rows' lengths), so a
  verification equals one-token steps bitwise and a CUDA graph is recorded per bucket over the
  table tensor, which the cache rewrites in place between replays (a new bucket: a new table and
  new graphs, as a new contiguous cache);
- memory follows the rows: 32 short rows beside one long one hold their own blocks, not 32
  copies of the long row's capacity. The step's reads still span the capacity bucket of the
  longest row (the price of one shape per bucket; FlexAttention's block masks or a paged decode
  kernel would skip unused blocks, at the cost of a shape or an algorithm that changes with the
  rows' lengths: docs/engine.md).

Rows leaving reorder table rows, not keys. Blocks past a row's length go back to the pool at
`trim` (after the step's verification and tree moves), not at `rollback`.
"""

from __future__ import annotations

import itertools

import torch

from specpair.block_pool import BlockPool, blocks_for
from specpair.errors import SpecpairError
from specpair.kv.layouts import chain_parented
from specpair.kv.static import StaticKVModel
from specpair.prefix_cache import BLOCK_TOKENS


class PagedFixedKVModel(StaticKVModel):
    """A causal LM plus its block pool, stepped by the fixed step through block tables; the
    interface of StaticKVModel (the cache protocol, protocol.KVCache)."""

    # A prompt's blocks shared between rows is the pool's (BlockPool.share_prefix); this cache
    # does not offer it yet, so prompts are prefilled.
    reuses_prefixes = False

    def __init__(self, model, blocks: int, block: int = BLOCK_TOKENS,
                 vocab_size: int | None = None, compile: str | None = None,
                 token_bucket: int | None = None):
        self.pool = BlockPool(blocks, block)
        self.block = block
        self.null_block = blocks                     # the pools' last block, never a row's
        self.keys: list[int] = []                    # each batch row's name in the pool
        self._names = itertools.count()
        super().__init__(model, vocab_size=vocab_size, compile=compile,
                         token_bucket=token_bucket, fixed=True)
        if self._position_floor % block:
            raise SpecpairError(f"a block of {block} positions does not divide the smallest "
                                f"capacity bucket ({self._position_floor})")

    # -- storage ------------------------------------------------------------------------------

    def _pools(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        r = self.runner
        shape = (self.pool.blocks + 1, r.kv_heads, self.block, r.head_dim)
        return [(torch.zeros(shape, dtype=r.dtype, device=self.device),
                 torch.zeros(shape, dtype=r.dtype, device=self.device))
                for _ in range(r.layer_count)]

    @property
    def capacity(self) -> tuple[int, int]:
        rows, blocks = self.table.shape
        return int(rows), int(blocks) * self.block

    @property
    def cache_bytes(self) -> int:
        """The pools' bytes (every block, held or not) and the tables'."""
        return sum(k.nbytes + v.nbytes for k, v in self.caches) + self.table.nbytes

    @property
    def held_bytes(self) -> int:
        """Bytes of the blocks rows hold now: what the rows' keys and values take."""
        held = self.pool.blocks - self.pool.free
        return sum(k[0].nbytes + v[0].nbytes for k, v in self.caches) * held

    def _allocate(self, rows: int, positions: int) -> None:
        """A block table for the (rows, capacity) bucket: the pools stay, only the table (and so
        the CUDA graphs recorded over it) is new."""
        if not self.caches:
            self.caches = self._pools()
        if positions % self.block:
            raise SpecpairError(f"capacity {positions} is not whole blocks of {self.block}")
        self.table = torch.full((rows, positions // self.block), self.null_block,
                                dtype=torch.long, device=self.device)
        self.graphs = {}
        self._sync_table()

    def _scratch(self, shape: tuple):
        """Warming a bucket up: this cache's own pools (a step compiled over another pool's shape
        would compile again) and a table of the bucket's shape naming only the null block, so the
        warm-up writes and reads nothing a row holds."""
        rows, _, positions, _ = shape
        return self.caches, torch.full((rows, positions // self.block), self.null_block,
                                       dtype=torch.long, device=self.device)

    def _sync_table(self) -> None:
        """The device table rewritten in place from the pool's tables (graphs read it where it
        is); rows past the batch and blocks past a row's own name the null block."""
        rows, width = self.table.shape
        host = torch.full((rows, width), self.null_block, dtype=torch.long)
        for i, key in enumerate(self.keys):
            blocks = self.pool.tables.get(key, [])
            if len(blocks) > width:
                raise SpecpairError(f"row {i} holds {len(blocks)} blocks; the table has {width}")
            if blocks:
                host[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        self.table.copy_(host)

    def _reserve(self, rows: int, positions: int) -> None:
        """The table's bucket as the contiguous cache's capacity, then each row's blocks for the
        positions it holds (its length: what a step writes past it lands in the null block or
        in its own last block, and is never attended before it is written again)."""
        super()._reserve(rows, positions)
        for key, length in zip(self.keys, self.lengths):
            self.pool.allocate(key, length)
        self._sync_table()

    # -- batch membership and rollback ----------------------------------------------------------

    def add_rows(self, count: int) -> None:
        if count <= 0:
            return
        self.keys += [next(self._names) for _ in range(count)]
        super().add_rows(count)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows: the others' blocks go back to the pool; the kept rows' table rows
        move up (their keys stay where they are)."""
        for i, key in enumerate(self.keys):
            if i not in rows:
                self.pool.release(key)
        self.keys = [self.keys[i] for i in rows]
        self.lengths = [self.lengths[i] for i in rows]
        self._sync_table()
        self._shrink()

    def trim(self) -> None:
        """Blocks past each row's length (rejected drafts) back to the pool, then the bucket
        shrinks where live rows need a quarter of it (as the contiguous cache)."""
        for key, length in zip(self.keys, self.lengths):
            if self.pool.held(key) > blocks_for(length, self.block):
                self.pool.truncate(key, length)
        self._sync_table()
        self._shrink()

    def move(self, moves: list[tuple[int, int, int]]) -> None:
        """A tree's kept branch copied to where a chain would have written it, through the
        table: (row, from slot, to slot)."""
        if not moves:
            return
        rows, src, dst = (torch.tensor(c, dtype=torch.long, device=self.device)
                          for c in zip(*moves))
        b = self.block
        src_block, dst_block = self.table[rows, src // b], self.table[rows, dst // b]
        for kc, vc in self.caches:
            kc[dst_block, :, dst % b] = kc[src_block, :, src % b]
            vc[dst_block, :, dst % b] = vc[src_block, :, src % b]

    def extend(self, rows: list[list[int]], last: int | list[int] = 1, hidden: bool = False,
               parents: list[list[int]] | None = None):
        if parents is not None and not self._takes_tree(rows, parents):
            raise SpecpairError("the paged fixed step takes chains and trees whose branches hang "
                                "off the chain (TreeLayout); a branch off a branch needs the "
                                "general step, which reads a contiguous cache")
        return super().extend(rows, last, hidden=hidden, parents=parents)

    def _takes_tree(self, rows, parents) -> bool:
        return chain_parented(parents) and max(map(len, rows)) <= self.token_bucket

    # -- prefix reuse: not through this cache yet (reuses_prefixes) ------------------------------

    def read_blocks(self, row: int, starts: list[int], width: int):
        raise SpecpairError("the paged fixed step shares prefixes through its pool, not copies")

    def load_blocks(self, row: int, blocks) -> int:
        raise SpecpairError("the paged fixed step shares prefixes through its pool, not copies")
