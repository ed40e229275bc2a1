"""The paged KV cache's bookkeeping: one pool of fixed-size blocks per model, a block table per
row, prefix blocks shared by reference, and the admission rule that keeps the rows within the pool.

The C layer reads and writes keys and values through a row's block table (cpu_kernels.c,
kv_rows): position p of a row lives in block table[p // block] at p % block. This module decides
which block ids those are. A block is free, held by rows (a reference count), or cached: it holds
a full block of some prompt, named as prefix_cache.block_keys names it (a hash chained over the
model, every earlier token and its own), and no row holds it now. A new row whose prompt begins
with cached names takes those very blocks into its table (`share_prefix`): nothing is copied, and
a row never writes a block it shares, because only full blocks before its prompt's last token are
shared and a row writes from its own length on. Cached blocks are evicted least recently used,
and only when a row needs a block and none is free (`allocate`).

`plan_admission` is the rule the batch applies before a step: what each row needs next (its
tokens, and speculation's extra positions, which are blocks too) against the blocks the pool can
give. Drafting stops first, newest row first; then the newest rows are preempted (their blocks
given back; the caller recomputes them later from their prompt and the tokens they emitted, so
their output does not change). Nothing here imports torch: the rules are tested as plain values.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from specpair.errors import SpecpairError
from specpair.prefix_cache import BLOCK_TOKENS, reusable_blocks


# The most rows a batch decodes at once where a pool decides: the default max batch size is what
# the pool holds at PLANNED_ROW_POSITIONS a row (paged_cache.PagedSpace.max_rows), up to this.
MAX_BATCH_ROWS = 64
PLANNED_ROW_POSITIONS = 512


class OutOfBlocks(SpecpairError):
    """The pool cannot give a row the blocks it asks for (nothing free, nothing to evict)."""


def blocks_for(positions: int, block: int = BLOCK_TOKENS) -> int:
    """Blocks that hold `positions` positions."""
    return -(-max(0, positions) // block)


class BlockPool:
    """Block ids 0..blocks-1 of one model's pool: free, held by rows, or cached by prefix name."""

    def __init__(self, blocks: int, block: int = BLOCK_TOKENS):
        if blocks < 1 or block < 4 or block & (block - 1):
            raise SpecpairError(f"a block pool needs >= 1 block of a power of 2 (>= 4) positions, not "
                                f"{blocks} blocks of {block}")
        self.blocks, self.block = blocks, block
        self._free: list[int] = list(range(blocks - 1, -1, -1))   # pop() gives 0 first
        self._refs = [0] * blocks
        self._name: dict[int, bytes] = {}             # block -> its prefix name, once published
        self._by_name: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()   # unheld named blocks, LRU first
        self.tables: dict[object, list[int]] = {}
        self.evictions = 0
        # Free blocks that may hold written pages (given back to the system by the space that
        # owns the memory: paged_cache.PagedSpace.give_back; `take_written` hands them over).
        self._written_free: set[int] = set()

    # -- what is there ----------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Blocks a row can be given now: free ones and cached ones no row holds."""
        return len(self._free) + len(self._cached)

    def held(self, row) -> int:
        return len(self.tables.get(row, ()))

    def refs(self, block_id: int) -> int:
        return self._refs[block_id]

    def cached(self, name: bytes) -> bool:
        return name in self._by_name

    @property
    def idle(self) -> bool:
        """No row holds a block."""
        return not any(self.tables.values())

    @property
    def cached_blocks(self) -> int:
        """Named blocks no row holds (kept for later prompts, evictable)."""
        return len(self._cached)

    @property
    def written_free(self) -> int:
        """Free blocks whose pages may still be resident."""
        return len(self._written_free)

    def take_written(self) -> list[int]:
        """The free blocks that may hold written pages, ascending, now counted as given back."""
        out = sorted(self._written_free)
        self._written_free.clear()
        return out

    def evict_to(self, keep: int) -> int:
        """Evict cached blocks, least recently used first, until at most `keep` remain (their
        pages can then be given back). -> blocks evicted."""
        evicted = 0
        while len(self._cached) > max(0, keep):
            block_id, _ = self._cached.popitem(last=False)
            del self._by_name[self._name.pop(block_id)]
            self._free.append(block_id)
            self._written_free.add(block_id)
            self.evictions += 1
            evicted += 1
        return evicted

    @property
    def named(self) -> int:
        """Blocks that hold a published prefix block (held by rows or cached)."""
        return len(self._by_name)

    def need(self, row, holds: int, step: int, drafts: int = 0, draft_row=None,
             draft_positions: int = 0) -> "RowNeed":
        """The row's RowNeed for plan_admission, its blocks read from its table (and from its
        draft model's row's, `draft_row`, which holds `draft_positions` once this step drafts)."""
        table = self.tables.get(row, [])
        draft_table = self.tables.get(draft_row, []) if draft_row is not None else []
        return RowNeed(row, holds, step, drafts, blocks=len(table),
                       private=sum(self._refs[b] == 1 for b in table),
                       draft_extra=max(0, blocks_for(draft_positions, self.block) - len(draft_table))
                       if drafts else 0,
                       draft_private=sum(self._refs[b] == 1 for b in draft_table))

    def blocks_to_admit(self, names: list[bytes], positions: int) -> int:
        """Blocks a new row of `positions` prompt positions (and one more, its first token)
        takes from `free`: its blocks past the cached run of its names (share_prefix's run), and
        those of the run that no row holds now (taking them leaves fewer to give)."""
        shared = unheld = 0
        for name in names[:reusable_blocks(positions, self.block)]:
            block_id = self._by_name.get(name)
            if block_id is None:
                break
            shared += 1
            unheld += block_id in self._cached
        return blocks_for(positions + 1, self.block) - shared + unheld

    # -- rows -------------------------------------------------------------------------------

    def share_prefix(self, row, names: list[bytes], prompt_tokens: int) -> int:
        """An empty row's table starts with the longest run of its prompt's block names the pool
        holds (at most the blocks that leave a token to prefill: reusable_blocks), each taken by
        reference and touched. -> positions the row now holds."""
        if self.tables.get(row):
            raise SpecpairError(f"row {row!r} already holds {self.held(row)} blocks")
        run = []
        for name in names[:reusable_blocks(prompt_tokens, self.block)]:
            block_id = self._by_name.get(name)
            if block_id is None:
                break
            run.append(block_id)
        for block_id in run:
            self._cached.pop(block_id, None)          # held again: not evictable
            self._refs[block_id] += 1
        self.tables[row] = list(run)
        return len(run) * self.block

    def allocate(self, row, positions: int) -> list[int]:
        """The row's table grown to hold `positions` positions, from free blocks, else by evicting
        the least recently used cached blocks. All or nothing: OutOfBlocks changes nothing.
        -> the new block ids."""
        table = self.tables.setdefault(row, [])
        need = blocks_for(positions, self.block) - len(table)
        if need <= 0:
            return []
        if need > self.free:
            raise OutOfBlocks(f"row {row!r} needs {need} blocks more; {self.free} can be given")
        new = []
        for _ in range(need):
            if self._free:
                block_id = self._free.pop()
                self._written_free.discard(block_id)
            else:                                      # the least recently used cached block
                block_id, _ = self._cached.popitem(last=False)
                del self._by_name[self._name.pop(block_id)]
                self.evictions += 1
            self._refs[block_id] = 1
            new.append(block_id)
        table.extend(new)
        return new

    def publish(self, row, names: list[bytes]) -> int:
        """The row's prompt is in its blocks: name its first len(names) blocks (full blocks of the
        prompt) so later rows can share them. A name the pool already holds under another block
        (two rows prefilled the same prompt together) keeps that block; this row's stays its own.
        -> blocks newly named."""
        table = self.tables.get(row, [])
        if len(names) > len(table):
            raise SpecpairError(f"row {row!r} holds {len(table)} blocks, not {len(names)}")
        named = 0
        for name, block_id in zip(names, table):
            if name in self._by_name or block_id in self._name:
                continue
            self._by_name[name] = block_id
            self._name[block_id] = name
            named += 1
        return named

    def truncate(self, row, positions: int) -> None:
        """Give back the row's blocks past those holding its first `positions` positions
        (speculation's positions that were rejected, or a row shrunk before preemption)."""
        table = self.tables.get(row, [])
        keep = blocks_for(positions, self.block)
        for block_id in reversed(table[keep:]):
            self._unref(block_id)
        del table[keep:]

    def release(self, row) -> None:
        """The row is done (or preempted): every block it held goes back, a named block into the
        cache as its most recently used, its table deepest block first so a prefix's first block
        is the last of them evicted (a block whose predecessor is gone is never reached again)."""
        for block_id in reversed(self.tables.pop(row, [])):
            self._unref(block_id)

    def _unref(self, block_id: int) -> None:
        self._refs[block_id] -= 1
        if self._refs[block_id]:
            return
        if block_id in self._name:
            self._cached[block_id] = None
        else:
            self._free.append(block_id)
            self._written_free.add(block_id)


@dataclass
class RowNeed:
    """One running row, oldest first in a list: the positions it holds, those its next step adds
    for itself (a token, or its prompt), those speculation adds (k drafts and their tree's
    siblings; 0 when it does not draft), the blocks its table has, and of those the ones no other
    row holds (what preempting it gives back: BlockPool.need fills both)."""

    row: object
    holds: int
    step: int
    drafts: int = 0
    blocks: int = 0
    private: int = 0
    # A draft model's row beside it (same pool): the blocks drafting this step adds to it, and
    # those it holds alone, given back when the row stops drafting (it catches up later).
    draft_extra: int = 0
    draft_private: int = 0


@dataclass
class AdmissionPlan:
    target_only: list = field(default_factory=list)   # rows that do not draft this step
    preempt: list = field(default_factory=list)       # rows given back, newest first

    @property
    def changes(self) -> bool:
        return bool(self.target_only or self.preempt)


def plan_admission(rows: list[RowNeed], free: int, block: int = BLOCK_TOKENS) -> AdmissionPlan:
    """Which rows stop drafting, then which are preempted, so that every row left gets the blocks
    its next step writes. rows: oldest first; free: blocks the pool can give (BlockPool.free).
    A row that stops drafting gives back its draft model's row (draft_private) as well; one that
    does not draft this step but holds a draft row is stopped too, before any preemption. A
    preempted row gives back its private blocks (a prefix block other rows share stays held).
    The oldest row is never preempted: alone it must fit, or the pool is too small for it."""
    def extra(need: RowNeed, drafting: bool) -> int:
        positions = need.holds + need.step + (need.drafts if drafting else 0)
        return (max(0, blocks_for(positions, block) - need.blocks)
                + (need.draft_extra if drafting else 0))

    plan = AdmissionPlan()
    drafting = {id(n): n.drafts > 0 for n in rows}
    wanted = sum(extra(n, drafting[id(n)]) for n in rows)
    for need in reversed(rows):                       # drafting stops first, newest first
        if wanted <= free:
            return plan
        if drafting[id(need)] or need.draft_private:
            wanted -= extra(need, drafting[id(need)]) - extra(need, False)
            free += need.draft_private
            drafting[id(need)] = False
            plan.target_only.append(need.row)
    for need in reversed(rows[1:]):                   # then the newest rows wait
        if wanted <= free:
            break
        wanted -= extra(need, False)
        free += need.private
        plan.preempt.append(need.row)
    return plan
