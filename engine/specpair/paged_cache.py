"""A paged KV cache for the CPU's C layer: one pool of fixed-size blocks per model, a block table
per row (block_pool.BlockPool decides which blocks), attention read through the table
(cpu_kernels.c, kv_rows), so a row pays for its own length only and a prompt's shared prefix
blocks are read by reference instead of copied.

Every step runs through the C layer, whose arithmetic for a token does not depend on the other
tokens of its call: the step's real tokens (no padding) are cut into calls of at most
cpu_kernels.MAX_TOKENS, a long prompt in several calls in position order (each call sees the keys
the earlier ones wrote). So a decode or verification step is bitwise the contiguous cache's
(kv.static.StaticKVModel) over the same keys, and a row served a shared prefix computes what it
would have computed after prefilling it. A prompt longer than one call is prefilled here through
the C layer too, where the contiguous cache runs torch's step: equal to rounding, not bitwise.

The engine's target cache on the CPU's C path (`paged_applies`): one `PagedSpace` per engine
(the pool and its keys and values), shared by every Batch of it, so prefix blocks outlive a
batch; each Batch's `PagedKVModel` names its rows in it and gives them back when it is dropped.
A draft model's rows take their blocks from the same pool (`PagedSpace.draft`: the same block
ids, the draft's own keys and values), so admission counts both and drafting is what stops first
when blocks run out (block_pool.plan_admission).

A drafting head (EAGLE, EAGLE-3, Medusa) or an observer scoring one in shadow drafts from the
target's features of every committed token (StaticLlama.feature_layers: an EAGLE-3 head's layer
inputs, else the last normed state). A step asked for them (`hidden`) hands them over and writes
them beside the keys and values, in the space's feature plane (`PagedSpace.features`, one row a
position of every block): a row served a shared prefix is handed the prefix's features from there
(`stored_features`), so its head catches up on what the target did not compute again. The head's
own small cache stays the drafter's, counted against the pool (drafters.base.Drafter.cache_bytes).
Its keys and values over a prompt's full blocks are kept in the pool too (the head plane,
`store_head` / `stored_head`): head position j (the pair of token j+1 and the target's features at
j) beside the target's position j+1, whose block's chained name covers every token the pair
depends on. So they are the pool's blocks: priced in each block's bytes (admission by free blocks
sees them), evicted least recently used with the target's block they sit beside, and the next row
sharing the prefix takes them instead of its head computing them again.

Token trees (a head's chain with alternatives a depth, Batch._verify_tree): a row's tokens are
written at consecutive slots past its length as a chain's are, a sibling at its parent's
position + 1 attending its prefix and its ancestors (kv.layouts.TreeLayout's rule, the C layer's
`slots` and `parents` through the block table); a row's tokens from the first one something
branches off go in one call, and the kept branch is moved where a chain would have put it
(`move`), its features with it. Not here: the fixed step (those engines keep
kv.static.StaticKVModel).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import weakref

import torch

from specpair import cpu_kernels
from specpair.block_pool import (MAX_BATCH_ROWS, PLANNED_ROW_POSITIONS, BlockPool, OutOfBlocks,
                                 blocks_for)
from specpair.config import parse_kv_budget
from specpair.errors import SpecpairError
from specpair.prefix_cache import BLOCK_TOKENS
from specpair.kv.protocol import KVCache
from specpair.kv.runner import StaticLlama


# The pool's bytes where the engine has no KV budget (the CPU): 2 GiB holds ~46k SmolLM2-135M
# positions in float32 (46 KB each): 32 chats of 1,500 tokens each unshared, hundreds shared.
# Allocated lazily (torch.empty): a page costs memory once a block on it is written.
BYTES_WITHOUT_BUDGET = 2 << 30
PAGED_ENV = "SPECPAIR_PAGED"        # "on" (default, where it applies) or "off"
# Memory given back (issue 54): a page of the pool, once written, stays resident until given
# back. When no row holds a block (the server idle), prompt blocks kept for reuse beyond
# IDLE_KEEP (least recently used first) are evicted and every free block's pages go back to the
# system; while rows run, free blocks' pages go back once they exceed FREE_SLACK_BYTES. So the
# resident memory a long prompt took returns near where it was once it has left.
IDLE_KEEP_ENV = "SPECPAIR_KV_IDLE_KEEP"    # bytes or target tokens; 0 keeps none
# 128 MiB holds a 1,500-token system prompt of SmolLM2-135M in float32 (46 KB a position).
IDLE_KEEP_DEFAULT = "128MiB"
FREE_SLACK_BYTES = 64 << 20
_MADV_DONTNEED = 4                         # Linux: the pages read as zeros until written again
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def paged_applies(model, kv_kind: str, compile_mode: str, drafter=None, tree_width: int = 1,
                  mode: str | None = None, k_max: int = 0) -> str | None:
    """Why the paged cache cannot be this engine's target cache (None: it is): it runs the C
    layer (CPU, float32, dense weights, static kind, not compiled); a token tree's verification
    (k_max drafts of tree_width candidates after a row's last token) fits one call of it. A
    head's features are handed over and kept per position (PagedSpace.features); its own cache
    is counted in admission (drafters.base.Drafter.cache_bytes)."""
    mode = mode or os.environ.get(PAGED_ENV) or "on"
    if mode not in ("on", "off"):
        raise SpecpairError(f"paged cache must be on or off, not {mode!r} ({PAGED_ENV})")
    if mode == "off":
        return f"{PAGED_ENV}=off"
    if kv_kind != "static" or compile_mode == "on":
        return "the static kind, not compiled, only"
    if (drafter is not None and drafter.tree_capable and tree_width > 1 and cpu_kernels.available()
            and 1 + k_max * tree_width > cpu_kernels.MAX_TOKENS):
        return (f"a tree of {k_max} drafts of {tree_width} candidates is verified in one C call "
                f"of at most {cpu_kernels.MAX_TOKENS} tokens")
    draft_model = drafter.draft_model() if drafter is not None else None
    for which, runs in (("", model), ("the draft model: ", draft_model)):
        if runs is None:
            continue
        try:
            r = StaticLlama.of(runs)
        except SpecpairError as exc:
            return which + str(exc)
        if not runs_c_layer(r):
            return (f"{which}the paged cache runs the C layer: CPU, float32, dense weights, a head "
                    f"dimension of 8s up to {cpu_kernels.MAX_HEAD_DIM} ({cpu_kernels.status()})")
    return None


def runs_c_layer(r: StaticLlama) -> bool:
    """Whether the C layer runs this model's steps (what a paged cache's steps run through)."""
    return (r.device.type == "cpu" and r.dtype == torch.float32 and cpu_kernels.available()
            and r.dense and r.head_dim % 8 == 0 and r.head_dim <= cpu_kernels.MAX_HEAD_DIM)


def block_bytes(model, block: int = BLOCK_TOKENS) -> int:
    """Bytes of one block of a model's keys and values, every layer (float32)."""
    r = StaticLlama.of(model)
    return 2 * r.layer_count * r.kv_heads * r.head_dim * block * 4


def feature_width(model) -> int:
    """Floats per position of the features a step of the target hands over now: the inputs of
    its feature_layers (an EAGLE-3 head's), else the last normed state."""
    r = StaticLlama.of(model)
    return model.config.hidden_size * (len(r.feature_layers) if r.feature_layers else 1)


class PagedLayers:
    """One model's keys and values over a pool's block ids, [blocks, kv heads, block, head dim]
    a layer, and the runner of its layers."""

    def __init__(self, model, blocks: int, block: int, lazy: bool):
        self.runner = r = StaticLlama.of(model)
        if not runs_c_layer(r):
            raise SpecpairError("the paged cache runs the C layer: CPU, float32, dense weights, a "
                                f"head dimension of 8s up to {cpu_kernels.MAX_HEAD_DIM} "
                                f"({cpu_kernels.status()})")
        shape = (blocks, r.kv_heads, block, r.head_dim)
        # The C layer reads a row's positions only once they are written, so an unwritten block
        # is never read: `lazy` leaves the pages untouched until then.
        make = torch.empty if lazy else torch.zeros
        self.caches = [(make(shape), make(shape)) for _ in range(r.layer_count)]
        self._stack: cpu_kernels.LayerStack | None = None

    def stack(self) -> cpu_kernels.LayerStack:
        """The layers and caches as one C call runs them all (cpu_kernels.llama_layers): built
        once, and again only where a weight's storage moved since."""
        if self._stack is None or not self._stack.current():
            r = self.runner
            self._stack = cpu_kernels.LayerStack(
                [r.layer_weights(layer) for layer in r.model.model.layers], r.options, r.windows,
                self.caches)
        return self._stack


class PagedSpace:
    """One engine's block pool and the keys and values of its blocks: the target's, and a draft
    model's over the same block ids (`draft`: a block a draft row holds is written in the draft's
    arrays only, so a block costs each model's bytes only where that model wrote it). Shared by
    every PagedKVModel over it (an engine's batches)."""

    def __init__(self, model, blocks: int, block: int = BLOCK_TOKENS, lazy: bool = False,
                 draft_model=None, head_bytes: int = 0):
        """head_bytes: bytes a position of a head drafter's own keys and values takes (its
        plane's, priced in `block_bytes`); 0: no head keeps them here."""
        self.pool = BlockPool(blocks, block)
        # The target's features of every written position ([blocks, block, width]), for the
        # layout a step hands over (feature_plane): made on the first step asked for them.
        self.features: torch.Tensor | None = None
        self.feature_layout: tuple[int, ...] | str | None = None
        # A head's keys and values over prompt prefixes ([blocks, block, floats a position]),
        # the head they are of, one position's shape, and the blocks whose every position holds
        # them (a block taken anew holds none: PagedKVModel.extend).
        self.head_plane: torch.Tensor | None = None
        self.head_identity: str | None = None
        self.head_shape: tuple[int, ...] | None = None
        self.head_written: set[int] = set()
        self._lazy = lazy
        self.target = PagedLayers(model, blocks, block, lazy)
        self.runner, self.caches = self.target.runner, self.target.caches
        self.draft = (PagedLayers(draft_model, blocks, block, lazy)
                      if draft_model is not None else None)
        self.owners = itertools.count()
        self.preemptions = 0          # rows given back for want of blocks, ever (Batch counts)
        self._model, self._head_bytes = model, head_bytes
        # What the pool may take, in bytes (for_budget's budget; None: what its planes take now),
        # and the features priced into each block there: a draft plane swapped in is held to it.
        self.budget_bytes: int | None = None
        self.feature_block_bytes = 0
        # Draft planes installed so far (a swap makes a new one): part of the draft's block names
        # (decoding.Batch._draft_identity), so a block the old plane wrote is never read as the
        # new one's.
        self.draft_generation = 0
        self._price_blocks()
        self.bytes_given_back = 0     # pages handed back to the system, ever

    def _price_blocks(self) -> None:
        """block_bytes: one block id's bytes in every plane; idle_keep_blocks from it."""
        self.block_bytes = sum(k[0].nbytes + v[0].nbytes for layers in (self.target, self.draft)
                               if layers is not None for k, v in layers.caches) + self._head_bytes * self.pool.block
        self.idle_keep_blocks = idle_keep_bytes(self._model, self.pool.block) // self.block_bytes

    def draft_plane_refusal(self, draft_model) -> str | None:
        """Why a draft model's plane over this pool's block ids cannot replace the serving draft
        plane (a draft swapped in place: server/draft_swap.py), None where it can: the C layer
        must run it, and every block priced at the new draft's bytes must stay within the
        pool's budget (draft_plane_fits)."""
        try:
            r = StaticLlama.of(draft_model)
        except SpecpairError as exc:
            return f"the new draft model cannot run on the paged pool: {exc}"
        if not runs_c_layer(r):
            return (f"the new draft model cannot run on the paged pool, which runs the C layer: CPU, "
                    f"float32, dense weights, a head dimension of 8s up to {cpu_kernels.MAX_HEAD_DIM}")
        old = (sum(k[0].nbytes + v[0].nbytes for k, v in self.draft.caches)
               if self.draft is not None else 0)
        others = self.block_bytes - old + self.feature_block_bytes
        budget = (self.budget_bytes if self.budget_bytes is not None
                  else self.pool.blocks * (self.block_bytes + self.feature_block_bytes))
        return draft_plane_fits(self.pool.blocks, others, block_bytes(draft_model, self.pool.block), old,
                                budget, f"{r.layer_count} layers x {r.kv_heads} kv heads x head dim {r.head_dim}")

    def new_draft_plane(self, draft_model) -> PagedLayers:
        """A draft model's plane over this pool's block ids, holding nothing yet (lazy: its pages
        cost memory once written). Made off the step loop; install_draft_plane puts it in."""
        return PagedLayers(draft_model, self.pool.blocks, self.pool.block, self._lazy)

    def install_draft_plane(self, plane: PagedLayers) -> None:
        """The draft plane every draft row's keys and values go to from now on; the old one's
        arrays go once no batch's cache holds them (decoding.Batch.replace_drafter moves the
        rows first). Blocks are priced at the new draft's bytes."""
        self.draft = plane
        self.draft_generation += 1
        self._price_blocks()

    def give_back(self) -> int:
        """After rows left: idle, evict cached prompt blocks beyond the idle keep and give every
        free block's pages back; busy, give them back once they pass FREE_SLACK_BYTES. Free
        blocks are never read before they are written again, so their pages may go.
        -> bytes given back now."""
        pool = self.pool
        if pool.idle:
            pool.evict_to(self.idle_keep_blocks)
        elif pool.written_free * self.block_bytes <= FREE_SLACK_BYTES:
            return 0
        given = 0
        for first, last in _runs(pool.take_written()):
            for layers in (self.target, self.draft):
                for pair in (layers.caches if layers is not None else ()):
                    for tensor in pair:
                        given += _dont_need(tensor, first, last)
            for plane in (self.features, self.head_plane):
                if plane is not None:
                    given += _dont_need(plane, first, last)
        self.bytes_given_back += given
        return given

    def feature_plane(self, layout, width: int) -> torch.Tensor:
        """The feature plane for what a step hands over now (`layout`: the target's
        feature_layers, None the normed state; `width` floats a position). Made again when the
        layout changes (a head of other layers declared): what the old one held is never read,
        as block names carry the layout (decoding.Batch._names_identity)."""
        if (self.features is None or self.feature_layout != (layout or "normed")
                or self.features.shape[-1] != width):
            make = torch.empty if self._lazy else torch.zeros
            self.features = make(self.pool.blocks, self.pool.block, width)
            self.feature_layout = layout or "normed"
        return self.features

    def head_plane_for(self, identity: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The head plane for this head (`identity`: Drafter.prefix_identity; `shape`: one
        position's keys and values), made again, holding nothing, for another head."""
        if self.head_plane is None or self.head_identity != identity or self.head_shape != shape:
            width = 1
            for n in shape:
                width *= n
            make = torch.empty if self._lazy else torch.zeros
            self.head_plane = make(self.pool.blocks, self.pool.block, width)
            self.head_identity, self.head_shape = identity, tuple(shape)
            self.head_written.clear()
        return self.head_plane

    @classmethod
    def for_budget(cls, model, budget_bytes: int | None, block: int = BLOCK_TOKENS,
                   draft_model=None, features: int = 0, head_bytes: int = 0) -> "PagedSpace":
        """The pool the budget holds (BYTES_WITHOUT_BUDGET without one), allocated lazily; with a
        draft model a block is priced at both models' bytes, so the two together stay within it;
        with `features` (floats a position a head's features take) and `head_bytes` (bytes a
        position of a head's own keys and values takes: the head plane) at those too."""
        per_block = block_bytes(model, block) + features * block * 4 + head_bytes * block
        if draft_model is not None:
            per_block += block_bytes(draft_model, block)
        budget = budget_bytes or BYTES_WITHOUT_BUDGET
        blocks = max(1, budget // per_block)
        space = cls(model, blocks, block, lazy=True, draft_model=draft_model, head_bytes=head_bytes)
        space.budget_bytes, space.feature_block_bytes = budget, features * block * 4
        return space

    @property
    def max_rows(self) -> int:
        """The default max batch size: rows the pool holds at PLANNED_ROW_POSITIONS each (a
        shared prefix holds more; a draft model's row as much again), at least 1, at most
        MAX_BATCH_ROWS."""
        per_row = blocks_for(PLANNED_ROW_POSITIONS, self.pool.block) * (2 if self.draft else 1)
        return max(1, min(MAX_BATCH_ROWS, self.pool.blocks // per_row))


def draft_plane_fits(blocks: int, other_bytes: int, new_bytes: int, old_bytes: int, budget: int,
                     shape: str = "") -> str | None:
    """Whether a new draft plane fits the pool (None) or why not: `blocks` block ids, each
    priced at `other_bytes` (the target's keys and values, features, a head's) plus the draft's
    (`new_bytes` a block for the new draft, `old_bytes` the serving one's), within `budget`.
    The block count stays (rows hold block ids), so a draft larger a block than the pool has
    room for is refused rather than the pool shrunk under the running rows."""
    need = blocks * (other_bytes + new_bytes)
    if need <= budget:
        return None
    return (f"the new draft's keys and values take {new_bytes} bytes a block{f' ({shape})' if shape else ''}, "
            f"the serving draft's {old_bytes}: the pool's {blocks} blocks would take {need} bytes, past its "
            f"KV budget of {budget} bytes (a larger KV budget, or new pods sized for this draft)")


def idle_keep_bytes(model, block: int = BLOCK_TOKENS, setting: str | None = None) -> int:
    """Bytes of cached prompt blocks an idle pool keeps (SPECPAIR_KV_IDLE_KEEP: bytes with a
    unit, or a count of the target's tokens; 0 keeps none)."""
    setting = setting if setting is not None else os.environ.get(IDLE_KEEP_ENV) or IDLE_KEEP_DEFAULT
    if str(setting).strip() == "0":
        return 0
    try:
        amount, unit = parse_kv_budget(setting)
    except SpecpairError as exc:
        raise SpecpairError(f"{IDLE_KEEP_ENV}: {exc}") from None
    return amount * (block_bytes(model, block) // block) if unit == "tokens" else amount


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Ascending block ids as runs of consecutive ids, (first, last) each."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


_libc = None


def _dont_need(tensor: torch.Tensor, first: int, last: int) -> int:
    """Give back the whole pages inside blocks first..last of a pool array [blocks, ...]
    (madvise MADV_DONTNEED: anonymous memory reads as zeros until written again). -> bytes."""
    global _libc
    if not sys.platform.startswith("linux"):
        return 0
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    per = tensor[0].nbytes
    start = tensor.data_ptr() + first * per
    end = tensor.data_ptr() + (last + 1) * per
    start = -(-start // _PAGE) * _PAGE
    end = end // _PAGE * _PAGE
    if end <= start or _libc.madvise(start, end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start


class PagedKVModel(KVCache):
    """A causal LM plus its block pool; extend/rollback/select/add_rows as StaticKVModel."""

    # Prefix blocks are shared by reference (share_prefix, publish), not loaded from the copying
    # prefix store, which is what the cache protocol's flag asks.
    reuses_prefixes = False
    fixed = False
    token_bucket = 1

    def __init__(self, model, blocks: int | None = None, block: int = BLOCK_TOKENS,
                 vocab_size: int | None = None, space: PagedSpace | None = None,
                 draft: bool = False):
        """draft: this cache is the draft model's rows in `space` (PagedSpace.draft)."""
        self.model = model
        self.space = space or PagedSpace(model, blocks, block)
        layers = self.space.draft if draft else self.space.target
        if layers is None:
            raise SpecpairError("this block pool holds no draft model's keys and values")
        self.runner = layers.runner
        self.plane = layers
        self.vocab_size = vocab_size
        self.pool = self.space.pool
        self.caches = layers.caches
        self.device = self.runner.device
        self.lengths: list[int] = []
        self.keys: list[tuple[int, int]] = []   # each batch row's name in the pool
        self._names = itertools.count()
        self._owner = next(self.space.owners)
        # A batch dropped with rows still in it (a failed step's batch) gives their blocks back.
        weakref.finalize(self, _release_owner, self.pool, self._owner)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)

    def add_rows(self, count: int) -> None:
        for _ in range(max(0, count)):
            self.keys.append((self._owner, next(self._names)))
            self.lengths.append(0)

    def share_prefix(self, row: int, names: list[bytes], prompt_tokens: int) -> int:
        """An empty row takes the pool's blocks of its prompt's longest cached run of names
        (prefix_cache.block_keys), by reference. -> positions it now holds."""
        if self.lengths[row]:
            raise SpecpairError(f"row {row} already holds {self.lengths[row]} positions")
        self.lengths[row] = self.pool.share_prefix(self.keys[row], names, prompt_tokens)
        return self.lengths[row]

    def publish(self, row: int, names: list[bytes]) -> int:
        """Name the row's full prompt blocks (once it holds them) for later rows to share."""
        return self.pool.publish(self.keys[row], names)

    def stored_features(self, row: int, count: int) -> torch.Tensor:
        """The target's features of row's first `count` positions [count, width], as the steps
        that wrote them handed them over (a shared prefix's: its first writer's)."""
        plane, block = self.space.features, self.pool.block
        if count == 0:
            return torch.zeros(0, plane.shape[-1] if plane is not None else 0)
        if plane is None:
            raise SpecpairError("no step of this pool has kept features")
        positions = torch.arange(count)
        table = torch.tensor(self.pool.tables[self.keys[row]], dtype=torch.long)
        return plane[table[positions // block], positions % block]

    def store_head(self, row: int, identity: str, blocks: int, read) -> int:
        """Keep a head's keys and values over row's first `blocks` blocks (full prompt blocks)
        in the head plane, where no row has kept them yet: head position j beside the target's
        position j+1 (block 0 holds positions 0..block-2, block b positions b*block-1 ..
        b*block+block-2). `read(start, width)`: the head's keys and values of those positions
        [2, layers, kv heads, width, head dim] (Drafter.read_prefix's). -> blocks written."""
        table, block, space = self.pool.tables.get(self.keys[row], []), self.pool.block, self.space
        if blocks > len(table):
            raise SpecpairError(f"row {row} holds {len(table)} blocks, not {blocks}")
        written = 0
        for b in range(blocks):
            if table[b] in space.head_written:
                continue
            start = max(0, b * block - 1)
            span = read(start, b * block + block - 1 - start)       # [2, L, KV, n, hd]
            n = int(span.shape[3])
            plane = space.head_plane_for(identity, tuple(span.shape[:3]) + tuple(span.shape[4:]))
            plane[table[b], start + 1 - b * block:] = span.movedim(3, 0).reshape(n, -1).to(plane.dtype)
            space.head_written.add(table[b])
            written += 1
        return written

    def stored_head(self, row: int, identity: str, held: int) -> torch.Tensor | None:
        """The head's keys and values the plane holds over row's shared prefix (its first
        `held` positions), [2, layers, kv heads, n, head dim] for head positions 0..n-1: the
        leading run of its blocks kept for this head (m blocks: n = m * block - 1); None:
        none."""
        space, block = self.space, self.pool.block
        if space.head_plane is None or space.head_identity != identity:
            return None
        table = self.pool.tables.get(self.keys[row], [])[:held // block]
        m = 0
        while m < len(table) and table[m] in space.head_written:
            m += 1
        if m == 0:
            return None
        positions = torch.arange(1, m * block)                # the target's, one past the head's
        ids = torch.tensor(table[:m], dtype=torch.long)
        span = space.head_plane[ids[positions // block], positions % block]     # [n, floats]
        return span.view(len(positions), *space.head_shape).movedim(0, 3).clone()

    @torch.no_grad()
    def extend(self, rows: list[list[int]], last: int | list[int] = 1, hidden: bool = False,
               parents=None):
        """Feed each row its new tokens; -> the logits of each row's last `last` tokens,
        [B, L, V] right-aligned (as StaticKVModel.extend). With `hidden`, also the target's
        features of every fed token, [B, W, F] left-aligned (as StaticKVModel.extend), written
        into the space's feature plane too. `parents` makes the tokens a tree (per row, each
        token's parent index among the row's fed tokens, or -1: kv.layouts.TreeLayout's rule);
        after verification `move` puts the kept branch in place. Refused with OutOfBlocks,
        changing nothing, when the pool cannot hold the new positions."""
        if parents is not None and not any(p >= 0 for row in parents for p in row):
            parents = None                     # a chain in a tree's form
        B = len(rows)
        assert B == self.batch_size, (B, self.batch_size)
        counts = [len(t) for t in rows]
        if not any(counts):
            raise ValueError("extend() called with no tokens")
        pool = self.pool
        need = sum(max(0, blocks_for(self.lengths[i] + n, pool.block) - pool.held(self.keys[i]))
                   for i, n in enumerate(counts))
        if need > pool.free:
            raise OutOfBlocks(f"a step needs {need} blocks more; {pool.free} can be given")
        for i, n in enumerate(counts):
            # A block taken anew holds no head positions (it may have held another prompt's).
            self.space.head_written.difference_update(
                pool.allocate(self.keys[i], self.lengths[i] + n))
        width = max(pool.held(k) for k in self.keys)
        table = torch.zeros(B, max(width, 1), dtype=torch.long)
        for i, key in enumerate(self.keys):
            held = pool.tables.get(key, [])
            table[i, :len(held)] = torch.tensor(held, dtype=torch.long)

        # (row, slot, position, token, parent's index in `tokens` or -1); a chain's slot is its
        # position, a tree token's position its parent's + 1.
        tokens = []
        for i, toks in enumerate(rows):
            first = len(tokens)
            for w, t in enumerate(toks):
                p = parents[i][w] if parents is not None else -1
                if p >= w:
                    raise SpecpairError(f"tree row {i}: token {w}'s parent {p} is not before it")
                position = self.lengths[i] + w if p < 0 else tokens[first + p][2] + 1
                tokens.append((i, self.lengths[i] + w, position, t, first + p if p >= 0 else -1))
        body, r = self.model.model, self.runner
        layers = r.feature_layers if hidden else None
        plane = (self.space.feature_plane(layers, feature_width(self.model)) if hidden
                 else None)
        outs, handed = [], []
        for start, end in _calls(tokens, parents, cpu_kernels.MAX_TOKENS):
            part = tokens[start:end]
            T = len(part)
            row_t = torch.tensor([p[0] for p in part], dtype=torch.long)
            slot_t = torch.tensor([p[1] for p in part], dtype=torch.long)
            pos_t = torch.tensor([p[2] for p in part], dtype=torch.long)
            slots = parent_t = None
            if parents is not None:      # the C layer's tree: slots, parents within this call
                slots = slot_t
                parent_t = torch.tensor([p[4] - start if p[4] >= 0 else -1 for p in part],
                                        dtype=torch.long)
            h = body.embed_tokens(torch.tensor([[p[3] for p in part]])).reshape(T, -1).contiguous()
            cos, sin = body.rotary_emb(h.view(1, T, -1), pos_t.view(1, T))
            cos, sin = cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous()
            reach = int(slot_t.max()) + 1
            scratch = cpu_kernels.layer_scratch(T, h.shape[1], r.heads, r.kv_heads, r.head_dim,
                                                body.layers[0].mlp.gate_proj.weight.shape[0], reach)
            if cpu_kernels.layers_apply():
                # Every layer in one C call and one parallel region (issue 51): a layer's fork
                # and join become one barrier, and no Python runs between layers. The inputs of
                # an EAGLE-3 head's layers are copied out on the way.
                h, taken = cpu_kernels.llama_layers(
                    h, row_t, pos_t, cos, sin, self.plane.stack(), r.eps, r.heads, r.kv_heads,
                    r.head_dim, reach, scratch, slots=slots, parents=parent_t, table=table,
                    capture=layers)
            else:      # a bench's build of an older kernel, with a layer a call only
                taken = []
                for index, (layer, (kc, vc), options, window) in enumerate(
                        zip(body.layers, self.caches, r.options, r.windows)):
                    if layers and index in layers:
                        taken.append(h.clone())          # the C layer writes h in place
                    cpu_kernels.llama_layer(h, row_t, pos_t, cos, sin, kc, vc,
                                            r.layer_weights(layer), r.eps, r.heads, r.kv_heads,
                                            r.head_dim, reach, scratch, slots=slots,
                                            parents=parent_t, options=options, window=window,
                                            table=table)
            outs.append(h)
            if hidden:     # as the contiguous cache hands them (kv.runner._with_features)
                part = (torch.cat(taken + ([h] if r.layer_count in layers else []), dim=-1)
                        if layers else body.norm(h))
                plane[table[row_t, slot_t // pool.block], slot_t % pool.block] = part
                handed.append(part)
        for i, n in enumerate(counts):
            self.lengths[i] += n
        states = torch.cat(outs)                                    # [tokens, D], in feed order

        n_last = max(last) if isinstance(last, list) else last
        first = [0] * B
        at = 0
        for i, n in enumerate(counts):
            first[i] = at
            at += n
        # Each row's last n_last tokens, right-aligned (a short row repeats its first, as
        # StaticKVModel's gather clamps at 0; a row that fed nothing reads its first slot's).
        index = torch.tensor([[first[i] + max(0, counts[i] - n_last + t) if counts[i] else 0
                               for t in range(n_last)] for i in range(B)], dtype=torch.long)
        picked = body.norm(states[index.view(-1)].view(B, n_last, -1))
        logits = cpu_kernels.linear(picked, self.model.lm_head.weight)
        if self.vocab_size is not None and logits.shape[-1] > self.vocab_size:
            logits = logits[..., : self.vocab_size]
        if not hidden:
            return logits
        handed = torch.cat(handed)
        features = handed.new_zeros(B, max(counts), handed.shape[-1])
        for i, n in enumerate(counts):
            features[i, :n] = handed[first[i]:first[i] + n]
        return logits, features

    def move(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy keys and values (row, from slot, to slot) in every layer, and the features kept
        there: a tree's kept branch goes where a chain would have written it, so later steps
        (and a row sharing the blocks) see plain positions. The slots are the row's own: it
        writes only past its length, never into a prefix block it shares."""
        if not moves:
            return
        block = self.pool.block

        def places(which: int) -> tuple[torch.Tensor, torch.Tensor]:
            ids = [self.pool.tables[self.keys[m[0]]][m[which] // block] for m in moves]
            return (torch.tensor(ids, dtype=torch.long),
                    torch.tensor([m[which] % block for m in moves], dtype=torch.long))
        (src, src_at), (dst, dst_at) = places(1), places(2)
        for kc, vc in self.caches:              # [blocks, kv heads, block, head dim]
            kc[dst, :, dst_at] = kc[src, :, src_at]
            vc[dst, :, dst_at] = vc[src, :, src_at]
        if self.space.features is not None:
            self.space.features[dst, dst_at] = self.space.features[src, src_at]

    def rollback(self, row: int, keep: int) -> None:
        """Forget row's tokens beyond its first `keep`: the length moves back and the blocks past
        it go back to the pool."""
        if keep < self.lengths[row]:
            self.lengths[row] = keep
            self.pool.truncate(self.keys[row], keep)

    def trim(self) -> None:
        """Nothing to crop: blocks are given back as rows roll back and leave."""

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order; the others' blocks go back (named prefix blocks
        into the pool's cache)."""
        kept = set(rows)
        for i, key in enumerate(self.keys):
            if i not in kept:
                self.pool.release(key)
        left = len(self.keys) > len(rows)
        self.keys = [self.keys[i] for i in rows]
        self.lengths = [self.lengths[i] for i in rows]
        if left:
            self.space.give_back()


def _calls(tokens: list[tuple], parents, width: int) -> list[tuple[int, int]]:
    """The step's tokens cut into C calls of at most `width`, in order: a tree row's tokens from
    the first one another branches off stay in one call (the C layer reads a token's parent in
    its own call). -> (start, end) of each call."""
    units: list[tuple[int, int]] = []          # runs that may not be cut
    at = 0
    while at < len(tokens):
        row, end = tokens[at][0], at + 1
        while end < len(tokens) and tokens[end][0] == row:
            end += 1
        joined = min((t[4] for t in tokens[at:end] if t[4] >= 0), default=end)
        units += [(a, a + 1) for a in range(at, joined)] + ([(joined, end)] if joined < end else [])
        at = end
    calls: list[tuple[int, int]] = []
    for a, b in units:
        if b - a > width:
            raise SpecpairError(f"a tree of {b - a} tokens does not fit one C call of {width}")
        if calls and b - calls[-1][0] <= width:
            calls[-1] = (calls[-1][0], b)
        else:
            calls.append((a, b))
    return calls


def _release_owner(pool: BlockPool, owner: int) -> None:
    for key in [k for k in pool.tables if isinstance(k, tuple) and k[0] == owner]:
        pool.release(key)
