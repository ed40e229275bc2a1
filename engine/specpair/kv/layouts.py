"""Where a step's tokens sit in the cache when some form a token tree (`TreeLayout`), and which
trees the fixed step's attention takes (`chain_parented`)."""

from __future__ import annotations

import torch

from specpair.errors import SpecpairError


def chain_parented(parents: list[list[int]]) -> bool:
    """Whether every branching token's parent continues its row (a chain token): the trees the
    fixed step's attention takes (its ancestors then sit at the slots before its position)."""
    return all(row[p] < 0 for row in parents for p in row if p >= 0)


class TreeLayout:
    """Where a step's tokens sit when some form a token tree (rejection_sampler.verify_tree).

    Tokens are written to consecutive slots past each row's length, in the order fed, as in a
    chain; a token whose parent is -1 continues the row contiguously (its position is its slot),
    any other takes its parent's position + 1 and attends to its prefix and its ancestors only.
    So a chain fed first keeps position == slot, and only the tokens after it branch.
    """

    def __init__(self, slots: torch.Tensor, parents: list[list[int]]):
        B, W = slots.shape
        self.slots = slots                                                   # [B, W]
        self.parents = torch.full((B, W), -1, dtype=torch.long)
        positions = slots.clone().cpu()
        for i, row in enumerate(parents):
            for w, parent in enumerate(row):
                if parent >= 0:
                    if parent >= w:
                        raise SpecpairError(f"tree row {i}: token {w}'s parent {parent} is not "
                                            "before it")
                    self.parents[i, w] = parent
                    positions[i, w] = positions[i, parent] + 1
        self.positions = positions.to(slots.device)

    def flat_parents(self) -> torch.Tensor:
        """Parents as indices into the step's flattened [B*W] tokens (the C layer's form)."""
        B, W = self.parents.shape
        base = torch.arange(B, dtype=torch.long).view(B, 1) * W
        return torch.where(self.parents >= 0, self.parents + base, self.parents).reshape(-1).contiguous()

    def mask(self, attend: int) -> torch.Tensor:
        """[B, 1, W, attend] which cache slots each token attends to: its contiguous prefix, its
        ancestors in this step and itself."""
        B, W = self.parents.shape
        slots, positions = self.slots.cpu(), self.positions.cpu()
        mask = torch.zeros(B, 1, W, attend, dtype=torch.bool)
        for i in range(B):
            for w in range(W):
                a = w
                while True:
                    mask[i, 0, w, int(slots[i, a])] = True
                    if self.parents[i, a] < 0:
                        break
                    a = int(self.parents[i, a])
                mask[i, 0, w, :int(positions[i, a])] = True
        return mask
