"""The drafter interface the engine speaks (Drafter) and what crosses it: a round's Proposal and
the rows' sampling settings (RowSampling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpair.rejection_sampler import DrawKeys


@dataclass
class Proposal:
    tokens: torch.Tensor            # [B, K] long, row i valid up to num[i]
    num: torch.Tensor               # [B] long
    probs: torch.Tensor | None      # [B, K, V] draft distributions q, None when deterministic
    siblings: torch.Tensor | None = None   # [B, K, S] alternatives to tokens[:, j] (a token tree,
                                           # rejection_sampler.verify_tree); None: a chain
    copied: list[bool] | None = None       # per row: drafted by copying (LookupFirstDrafter)
    host: list[list[int]] | None = None    # per row its drafted tokens, where the drafter made


@dataclass
class RowSampling:
    """Per-row sampling settings as tensors, shared by draft and target so p and q match."""

    temperature: torch.Tensor       # [B]
    top_k: torch.Tensor             # [B]
    top_p: torch.Tensor             # [B]
    generators: list                # [B] torch.Generator or None
    greedy: bool | None = None      # every row greedy, when the caller knows it without the device
    keys: DrawKeys | None = None    # seeded rows: they draw by (seed, position) instead, the
                                    # draft as the target does (rejection_sampler.keyed_sample)

    @property
    def all_greedy(self) -> bool:
        if self.greedy is not None:
            return self.greedy
        return bool((self.temperature <= 0).all())


class Drafter:
    """Interface. `deterministic` drafters propose point masses (q = one-hot). Drafters that
    `wants_features` are handed the target's features of every committed token (`observe`)."""

    name = "drafter"
    deterministic = True
    wants_features = False
    tree_capable = False     # proposes alternatives per position (siblings) when width > 1
    copies = False           # drafts some rows' rounds by copying, each round saying which
                             # (Proposal.copied): those rounds keep a k of their own (copy_ks)
    # This round's rows' grammars (grammar.RowGrammar, None for a free row), set by the Batch
    # before propose: a drafter that can propose within them does (ModelDrafter); the others'
    # drafts are cut where the grammar refuses them before verification (Batch.step).
    grammars: list | None = None

    def for_batch(self) -> "Drafter":
        """The drafter a new batch uses: itself when it keeps no per-row state."""
        return self

    def trim(self) -> None:
        """End of a round: release what rejected drafts left behind."""

    def observe(self, row: int, start: int, features: torch.Tensor) -> None:
        """The target's features [n, D] of row's committed tokens at positions start..start+n-1."""

    def add_rows(self, count: int) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        pass

    def propose(self, sequences: list[list[int]], ks: list[int], sampling: RowSampling,
                width: int = 1) -> Proposal:
        """Up to ks[i] draft tokens for each row. `width`: candidates per position for a
        `tree_capable` drafter (the release's tree width; 1 is a chain); others draft chains."""
        raise NotImplementedError

    def accepted(self, row: int, committed_before: int, num_accepted: int) -> None:
        """Row's sequence was `committed_before` tokens long; `num_accepted` drafts were kept."""

    def describe(self) -> dict:
        return {"kind": self.name}
