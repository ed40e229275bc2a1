"""The one cache protocol: what the decoder (decoding.Batch), the drafters and the prefix store
ask of a model's KV cache, whichever path runs its steps.

Three paths implement it: static.StaticKVModel on the CPU's C layer (float32) or on the torch
fixed step (CUDA, bf16: `fixed`), dynamic.BatchedKVModel over Hugging Face's forward (the other
architectures), and paged_cache.PagedKVModel over a block pool. The decoder reads `fixed` and
`token_bucket` from every cache instead of asking whether the cache has them: a cache that runs no
fixed-shape step says so by inheriting the defaults here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCache(Protocol):
    """A causal LM plus its batched cache: rows join (`add_rows`) and leave (`select`) between
    steps, each row advances by its own count of tokens (`extend`) and rejected drafts are
    forgotten (`rollback`)."""

    # Whether `extend` runs fixed-shape steps, every row padded to `token_bucket` tokens (the
    # decoder then sets the bucket per batch size and feeds a new row's prompt apart first).
    fixed: bool = False
    token_bucket: int = 1
    # Whether a row's prompt may begin at keys and values loaded from the prefix store
    # (prefix_cache.py) rather than be prefilled.
    reuses_prefixes: bool = False
    lengths: list[int]          # valid positions per row (= each row's next position)

    @property
    def batch_size(self) -> int:
        """Rows in the cache."""
        ...

    def extend(self, rows: list[list[int]], last: int | list[int] = 1) -> torch.Tensor:
        """Feed each row its new tokens (a row may feed none); -> the logits of each row's last
        `last` tokens, [B, L, V] right-aligned."""
        ...

    def rollback(self, row: int, keep: int) -> None:
        """Forget row's tokens beyond its first `keep` (rejected drafts)."""
        ...

    def trim(self) -> None:
        """Housekeeping between steps (crop, compact or shrink: the cache's own)."""
        ...

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (finished or cancelled requests leave)."""
        ...

    def add_rows(self, count: int) -> None:
        """Append `count` empty rows; their prompts come through `extend`."""
        ...
