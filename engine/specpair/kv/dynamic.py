"""A batched KV cache whose rows advance by different amounts: the state continuous batching needs.

Hugging Face caches are rectangular: every row has the same number of columns. Speculation makes
rows accept different numbers of tokens, so rejected columns become *holes*: they stay in the
tensor but are masked out of attention (attention_mask 0) and positions come from each row's own
count of valid tokens, so RoPE never sees a gap. Columns that every row rejected are cropped off
the end at once (for one row, that is every rejection: a plain cut-back, never a recompute); when
holes grow past half the cache, rows are compacted by a gather.

Rows can be added (a new request's prefill, left-padded into the batch) and removed (finished or
cancelled requests) between steps.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specpair.kv.protocol import KVCache


class BatchedKVModel(KVCache):
    """A causal LM plus its batched cache, mask and per-row token bookkeeping."""

    # Rows are right-aligned into columns shared by the batch: a new row's prompt cannot begin
    # at stored keys and values without moving every row, so prompts are always prefilled here
    # (prefix_cache.py serves the static cache).
    reuses_prefixes = False

    def __init__(self, model, vocab_size: int | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = vocab_size
        self.cache = DynamicCache()
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)   # [B, T]
        self.lengths: list[int] = []        # valid tokens per row (= next position id)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def columns(self) -> int:
        return int(self.mask.shape[1])

    # -- forward -----------------------------------------------------------------------------

    @torch.no_grad()
    def extend(self, rows: list[list[int]], last: int | list[int] = 1) -> torch.Tensor:
        """Feed each row its new tokens (rows may differ in count); return logits of the last ones.

        rows: one token list per cache row (all rows; an empty list is allowed for a row that
        has nothing to add this step). last: how many trailing logits to return per row.
        Returns [B, L, V] where L = max(last); row i's logits are right-aligned.
        """
        B = len(rows)
        assert B == self.batch_size, (B, self.batch_size)
        width = max(len(r) for r in rows)
        if width == 0:
            raise ValueError("extend() called with no tokens")
        pad = 0
        ids = torch.full((B, width), pad, dtype=torch.long)
        new_mask = torch.zeros(B, width, dtype=torch.long)
        positions = torch.zeros(B, width, dtype=torch.long)
        for i, toks in enumerate(rows):
            n = len(toks)
            if n:
                # Right-align new tokens: left pads sit before them and are masked as keys.
                ids[i, width - n:] = torch.tensor(toks, dtype=torch.long)
                new_mask[i, width - n:] = 1
                positions[i, width - n:] = torch.arange(self.lengths[i], self.lengths[i] + n)
                self.lengths[i] += n
            # Pad queries still need a legal position; they attend to the row's past and are
            # ignored (never a key: mask 0), so their value does not matter.
        ids, new_mask, positions = (t.to(self.device) for t in (ids, new_mask, positions))
        key_valid = torch.cat([self.mask, new_mask], dim=1)                    # [B, Tk]
        attention_mask = self._attention_bias(key_valid, new_mask)
        out = self.model(input_ids=ids, attention_mask=attention_mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        logits = out.logits
        if self.vocab_size is not None and logits.shape[-1] > self.vocab_size:
            logits = logits[..., : self.vocab_size]   # padded embedding rows are never real tokens
        n_last = max(last) if isinstance(last, list) else last
        return logits[:, -n_last:]

    def _attention_bias(self, key_valid: torch.Tensor, new_mask: torch.Tensor) -> torch.Tensor:
        """Additive 4D mask [B, 1, Q, Tk]: causal, holes and pads masked.

        A pad query may have no valid key at all (a new row's left padding); softmax over nothing
        is NaN, and a NaN hidden state poisons that column's keys in later layers even though the
        column itself is masked. So each pad query may attend to its own column, which no real
        query ever sees.
        """
        B, Q = new_mask.shape
        Tk = key_valid.shape[1]
        past = Tk - Q
        q_col = torch.arange(past, Tk, device=self.device).view(1, Q, 1)
        k_col = torch.arange(Tk, device=self.device).view(1, 1, Tk)
        allowed = (k_col <= q_col) & key_valid.bool().view(B, 1, Tk)
        allowed |= (k_col == q_col) & ~new_mask.bool().view(B, Q, 1)
        dtype = next(self.model.parameters()).dtype
        bias = torch.zeros(B, 1, Q, Tk, dtype=dtype, device=self.device)
        return bias.masked_fill(~allowed.view(B, 1, Q, Tk), torch.finfo(dtype).min)

    # -- rollback and housekeeping -----------------------------------------------------------

    def rollback(self, row: int, keep: int) -> None:
        """Forget row's tokens beyond its first `keep` valid ones (rejected drafts)."""
        drop = self.lengths[row] - keep
        if drop <= 0:
            return
        valid = self.mask[row].nonzero().squeeze(1)
        self.mask[row, valid[-drop:]] = 0
        self.lengths[row] = keep

    def trim(self) -> None:
        """Crop trailing columns no row uses; compact when holes dominate."""
        if self.columns == 0:
            return
        used = self.mask.any(0).nonzero()
        last_used = int(used[-1]) + 1 if len(used) else 0
        excess = self.columns - last_used
        if excess > 0:
            if last_used > 0:
                # transformers >= 5 takes the count of tokens to remove, as a negative number.
                self.cache.crop(-excess)
            else:
                self._reset_columns()
            self.mask = self.mask[:, :last_used]
        if self.columns > 32 and self.columns > 2 * max(self.lengths, default=0):
            self._compact()

    def _reset_columns(self) -> None:
        self.cache = DynamicCache()

    def _compact(self) -> None:
        """Move each row's valid columns to the right end (left padding) with one gather."""
        width = max(self.lengths)
        B = self.batch_size
        index = torch.zeros(B, width, dtype=torch.long, device=self.device)
        new_mask = torch.zeros(B, width, dtype=torch.long, device=self.device)
        for i in range(B):
            valid = self.mask[i].nonzero().squeeze(1)
            n = valid.numel()
            if n:
                index[i, width - n:] = valid
                new_mask[i, width - n:] = 1
        for layer in self.cache.layers:
            gather = index.view(B, 1, width, 1).expand(B, layer.keys.shape[1], width,
                                                       layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.mask = new_mask

    # -- batch membership --------------------------------------------------------------------

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished or cancelled requests leave at step boundaries)."""
        if not rows:
            self.cache = DynamicCache()
            self.mask = self.mask[:0, :0]
            self.lengths = []
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)
        self.mask = self.mask.index_select(0, index)
        self.lengths = [self.lengths[i] for i in rows]
        self.trim()

    def add_rows(self, count: int) -> None:
        """Append empty rows (no tokens yet); their prefill comes through extend()."""
        if count <= 0:
            return
        zeros = torch.zeros(count, self.columns, dtype=torch.long, device=self.device)
        self.mask = torch.cat([self.mask, zeros], dim=0)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                shape = (count,) + tuple(layer.keys.shape[1:])
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(shape)], dim=0)
                layer.values = torch.cat([layer.values, layer.values.new_zeros(shape)], dim=0)
        self.lengths += [0] * count
