"""What a Batch tells the observers declared on its engine (SpeculativeEngine.add_observer):
the interface the Batch calls, so that something that watches the rounds (shadow scoring,
shadow.ShadowScorer) is no attribute patched onto the engine.

An observer only reads. It is handed, after each verification, what the round decided
(`VerifiedRound`), and, where it `wants_features`, the target's features of the tokens each
row committed (the same tensor a head drafter is handed: the normed last states, or the layers
an EAGLE-3 head reads, StaticLlama.feature_layers), in position order. Nothing it does reaches
a row's tokens, caches, random streams or k (tests/engine/test_engine_shadow.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpair.drafters.base import RowSampling


@dataclass(frozen=True)
class VerifiedRound:
    """One verification of a batch, as its observers see it. Rows have their new tokens;
    finished ones are still in the batch."""

    committed: list[int]            # each row's length before the round
    first_logits: torch.Tensor      # [B, V] the target's logits at each row's first position
    sampling: RowSampling
    drafts: torch.Tensor            # [B, K] the serving drafter's drafts
    num: torch.Tensor               # [B] how many of them each row drafted
    q: torch.Tensor | None          # [B, K, V] their draft distributions (None: point masses)
    accepted: list[int]             # drafts kept per row
    # Rows whose prompt this step fed only in part (the prefill budget, Batch._prefill_caps):
    # nothing committed, their logits those of a chunk's end, not of a next token.
    prefilling: frozenset = frozenset()


class BatchObserver:
    """Interface (shadow.ShadowScorer implements it)."""

    # The Batch then asks the target for its features even where its own drafter needs none,
    # and hands them over (take_features) where a head drafter would be handed them.
    wants_features = False

    def take_features(self, batch, row: int, start: int, features: torch.Tensor) -> None:
        """The target's features [n, F] of row's tokens at positions start..start+n-1 (the
        committed ones it computed this step; a row's first step: its prompt's)."""

    def after_round(self, batch, verified: VerifiedRound) -> None:
        """After each verification (and after take_features for its tokens)."""

    def cache_bytes(self, batch) -> int:
        """Memory this observer keeps for the batch's rows that the KV budget must hold."""
        return 0
