"""A paged KV cache for the CPU's C layer: one pool of fixed-size blocks per model, a block table
per row (block_pool.BlockPool decides which blocks), attention read through the table
(cpu_kernels.c, kv_rows), so a row pays for its own length only and a prompt's shared prefix
blocks are read by reference instead of copied.

Every step runs through the C layer, whose arithmetic for a token does not depend on the other
tokens of its call: the step's real tokens (no padding) are cut into calls of at most
cpu_kernels.MAX_TOKENS, a long prompt in several calls in position order (each call sees the keys
the earlier ones wrote). So a decode or verification step is bitwise the contiguous cache's
(static_cache.StaticKVModel) over the same keys, and a row served a shared prefix computes what it
would have computed after prefilling it. A prompt longer than one call is prefilled here through
the C layer too, where the contiguous cache runs torch's step: equal to rounding, not bitwise.

Not yet the engine's cache (issue 51): the Batch still runs StaticKVModel; this class is the
model-level half (tested against it), without token trees, the fixed step or a drafting head's
vectors.
"""

from __future__ import annotations

import itertools

import torch

from specpair import cpu_kernels
from specpair.block_pool import BlockPool, OutOfBlocks, blocks_for
from specpair.errors import SpecpairError
from specpair.prefix_cache import BLOCK_TOKENS
from specpair.static_cache import StaticLlama


class PagedKVModel:
    """A causal LM plus its block pool; extend/rollback/select/add_rows as StaticKVModel."""

    reuses_prefixes = True

    def __init__(self, model, blocks: int, block: int = BLOCK_TOKENS, vocab_size: int | None = None):
        self.model = model
        self.runner = r = StaticLlama.of(model)
        if not (r.device.type == "cpu" and r.dtype == torch.float32 and cpu_kernels.available()
                and r.dense and r.head_dim % 8 == 0 and r.head_dim <= cpu_kernels.MAX_HEAD_DIM):
            raise SpecpairError("the paged cache runs the C layer: CPU, float32, dense weights, a "
                                f"head dimension of 8s up to {cpu_kernels.MAX_HEAD_DIM} "
                                f"({cpu_kernels.status()})")
        self.vocab_size = vocab_size
        self.pool = BlockPool(blocks, block)
        shape = (blocks, r.kv_heads, block, r.head_dim)
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(r.layer_count)]
        self.lengths: list[int] = []
        self.keys: list[int] = []            # each batch row's name in the pool
        self._names = itertools.count()

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)

    def add_rows(self, count: int) -> None:
        for _ in range(max(0, count)):
            self.keys.append(next(self._names))
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

    @torch.no_grad()
    def extend(self, rows: list[list[int]], last: int | list[int] = 1) -> torch.Tensor:
        """Feed each row its new tokens; -> the logits of each row's last `last` tokens,
        [B, L, V] right-aligned (as StaticKVModel.extend). Refused with OutOfBlocks, changing
        nothing, when the pool cannot hold the new positions."""
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
            pool.allocate(self.keys[i], self.lengths[i] + n)
        width = max(pool.held(k) for k in self.keys)
        table = torch.zeros(B, max(width, 1), dtype=torch.long)
        for i, key in enumerate(self.keys):
            held = pool.tables.get(key, [])
            table[i, :len(held)] = torch.tensor(held, dtype=torch.long)

        tokens = [(i, self.lengths[i] + w, t) for i, toks in enumerate(rows)
                  for w, t in enumerate(toks)]
        body, r = self.model.model, self.runner
        outs = []
        step = cpu_kernels.MAX_TOKENS
        for start in range(0, len(tokens), step):
            part = tokens[start:start + step]
            T = len(part)
            row_t = torch.tensor([p[0] for p in part], dtype=torch.long)
            pos_t = torch.tensor([p[1] for p in part], dtype=torch.long)
            h = body.embed_tokens(torch.tensor([[p[2] for p in part]])).reshape(T, -1).contiguous()
            cos, sin = body.rotary_emb(h.view(1, T, -1), pos_t.view(1, T))
            cos, sin = cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous()
            reach = int(pos_t.max()) + 1
            scratch = cpu_kernels.layer_scratch(T, h.shape[1], r.heads, r.kv_heads, r.head_dim,
                                                body.layers[0].mlp.gate_proj.weight.shape[0], reach)
            for layer, (kc, vc), options, window in zip(body.layers, self.caches, r.options,
                                                        r.windows):
                cpu_kernels.llama_layer(h, row_t, pos_t, cos, sin, kc, vc, r.layer_weights(layer),
                                        r.eps, r.heads, r.kv_heads, r.head_dim, reach, scratch,
                                        options=options, window=window, table=table)
            outs.append(h)
        for i, n in enumerate(counts):
            self.lengths[i] += n
        hidden = torch.cat(outs)                                    # [tokens, D], in feed order

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
        picked = body.norm(hidden[index.view(-1)].view(B, n_last, -1))
        logits = cpu_kernels.linear(picked, self.model.lm_head.weight)
        if self.vocab_size is not None and logits.shape[-1] > self.vocab_size:
            logits = logits[..., : self.vocab_size]
        return logits

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
        self.keys = [self.keys[i] for i in rows]
        self.lengths = [self.lengths[i] for i in rows]
