"""Choosing draft tokens from a drafter's logits, shared by the model and head drafters: greedy or
sampled under the rows' settings (the q the verifier needs), a tree's siblings, the stacked q."""

from __future__ import annotations

import torch

from specpair.drafters.base import RowSampling
from specpair.rejection_sampler import keyed_alternatives, process_logits, sample_next


def choose_draft_tokens(logits: torch.Tensor, j: int, ks: list[int], sampling: RowSampling
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft position j's tokens from logits [B, V] and their distributions q (None when every
    row is greedy: greedy verification never reads q). Greedy rows take the argmax; the others
    draw from q with their own generator, and only while still drafting, so a row's random
    stream does not depend on the other rows' k; seeded rows draw with the key of position j,
    the noise the target's draw there uses, so the two draws agree where p and q do."""
    if sampling.all_greedy:
        return logits.argmax(-1), None
    q = process_logits(logits.unsqueeze(1), sampling.temperature, sampling.top_k,
                       sampling.top_p).squeeze(1)
    gens = [g if j < k else None for g, k in zip(sampling.generators, ks)]
    drafting = torch.tensor([j < k for k in ks], device=logits.device)
    sampled = torch.where(drafting, sample_next(q, gens, sampling.keys, j), logits.argmax(-1))
    greedy = sampling.temperature.to(logits.device) <= 0
    return torch.where(greedy, logits.argmax(-1), sampled), q


def choose_siblings(logits: torch.Tensor, chosen: torch.Tensor, q: torch.Tensor | None, j: int,
                    ks: list[int], sampling: RowSampling, count: int) -> torch.Tensor:
    """`count` alternatives [B, count] to position j's chosen tokens, for a token tree: a greedy
    row's next most likely tokens; a sampled row's further independent draws from q (what keeps
    the tree's sampler exact, rejection_sampler.verify_tree), with its own generator and only
    while it drafts; a seeded row's next ranked tokens under its keyed noise. Rows past their k
    get zeros (never verified)."""
    B = logits.shape[0]
    out = torch.zeros(B, count, dtype=torch.long, device=logits.device)
    greedy = (sampling.temperature <= 0).tolist()
    if any(greedy):
        masked = logits.scatter(-1, chosen.view(B, 1), float("-inf"))
        top = masked.topk(count, dim=-1).indices
        rows = torch.tensor(greedy, device=logits.device).view(B, 1)
        out = torch.where(rows, top, out)
    keys = sampling.keys
    keyed = keys.rows if keys is not None else []
    for i, g in enumerate(sampling.generators):
        if not greedy[i] and j < ks[i] and i not in keyed:
            out[i] = torch.multinomial(q[i], count, replacement=True, generator=g)
    at = [r for r, i in enumerate(keyed) if j < ks[i]]
    if at:
        rows = [keyed[r] for r in at]
        out[rows] = keyed_alternatives(q[rows], keys.seeds[at], keys.start[at] + j, chosen[rows], count)
    return out


def stack_draft_probs(steps: list, K: int) -> torch.Tensor | None:
    """q of each drafted position [B, K, V]; positions a row never reached repeat the last one
    (the verifier reads only each row's first num[i]). None when all rows were greedy."""
    if not steps or steps[0] is None:
        return None
    probs = torch.stack(steps, dim=1)
    if probs.shape[1] < K:
        probs = torch.cat([probs, probs[:, -1:].expand(probs.shape[0], K - probs.shape[1], -1)], dim=1)
    return probs
