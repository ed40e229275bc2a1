"""Verification of draft tokens: greedy matching and the lossless rejection sampler.

Sampling (Leviathan et al. 2023, Chen et al. 2023). For draft position j with draft token x_j
drawn from the draft distribution q_j, the target distribution p_j accepts it with probability
min(1, p_j(x_j) / q_j(x_j)). At the first rejection j, a token is drawn from the residual
normalize(max(0, p_j - q_j)); if every draft token is accepted, a bonus token is drawn from
p_{k}. The emitted tokens are then distributed exactly as if drawn from p one at a time.
A deterministic drafter (n-gram lookup) is the special case where q_j is a point mass on x_j.

Greedy: accept the longest prefix where x_j == argmax p_j, then emit argmax p at the first
mismatch (or after the last draft token): the target's own choice, so output equals target-only.

All functions are vectorised over rows and draft positions; rows carry their own number of draft
tokens (padded to K) and their own random generator so a row's draws do not depend on its batch.
"""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Logits -> probabilities with temperature, top-k and top-p, per row.

    logits: [B, T, V]; temperature, top_p: [B] float; top_k: [B] long (0 = off).
    Applied identically to target and draft logits, so p and q live on the same support rules.
    Rows with temperature 0 get a one-hot on the argmax (greedy as a distribution).
    Returns probabilities [B, T, V] in float32.
    """
    logits = logits.float()
    B, T, V = logits.shape
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits / temp.view(B, 1, 1)
    # top-k: keep logits >= the k-th largest value (rows with k == 0 keep everything).
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
        kth = torch.topk(scaled, int(k.max()), dim=-1).values                    # [B, T, kmax]
        idx = (k - 1).view(B, 1, 1).expand(B, T, 1)
        threshold = kth.gather(-1, idx)                                          # [B, T, 1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    # top-p: smallest prefix of the sorted distribution whose mass reaches p (always >= 1 token).
    # Only rows with top_p < 1 are filtered: float32 cumulative sums can reach 1.0 before the
    # tail ends, and a row that asked for no filter must not lose its tail to a neighbour's.
    nucleus = top_p < 1                                                          # [B]
    if bool(nucleus.any()):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs                    # [B, T, V]
        drop_sorted = (mass_before >= top_p.view(B, 1, 1).float()) & nucleus.view(B, 1, 1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = scaled.softmax(-1)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.view(B, 1, 1), onehot, probs)
    return probs


def greedy_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance.

    target_logits: [B, K+1, V] (position j scores the token after draft prefix of length j)
    draft_tokens:  [B, K] long; num_draft: [B] long, row i uses the first num_draft[i] drafts.
    Returns (num_accepted [B], next_token [B]): accepted drafts then the target's own token.
    """
    B, K = draft_tokens.shape
    target_choice = target_logits.argmax(-1)                                      # [B, K+1]
    positions = torch.arange(K, device=draft_tokens.device).view(1, K)
    matches = (target_choice[:, :K] == draft_tokens) & (positions < num_draft.view(B, 1))
    # Leading run of matches: cumprod stays 1 until the first mismatch.
    num_accepted = matches.long().cumprod(-1).sum(-1)                             # [B]
    next_token = target_choice.gather(1, num_accepted.view(B, 1)).squeeze(1)
    return num_accepted, next_token


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor,
                     num_draft: torch.Tensor, generators: list[torch.Generator | None]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling.

    p: [B, K+1, V] target probabilities; q: [B, K, V] draft probabilities (point masses for a
    deterministic drafter); draft_tokens: [B, K]; num_draft: [B]; generators: one per row.
    Returns (num_accepted [B], next_token [B]).
    """
    B, K = draft_tokens.shape
    device = p.device
    p_draft = p[:, :K].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)         # [B, K]
    q_draft = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)                # [B, K]
    # u < p/q  <=>  u * q < p, which also handles q == 0 (never proposed) safely.
    # Each row draws only as many uniforms as it has drafts, so a seeded row's random stream does
    # not depend on how many drafts the other rows of its batch have (padding is masked below).
    uniforms = torch.ones(B, K, device=device)                                    # [B, K]
    for i, (g, n) in enumerate(zip(generators, num_draft.tolist())):
        if n:
            uniforms[i, :n] = torch.rand(n, generator=g, device=device)
    accept = (uniforms * q_draft < p_draft)
    positions = torch.arange(K, device=device).view(1, K)
    accept &= positions < num_draft.view(B, 1)
    num_accepted = accept.long().cumprod(-1).sum(-1)                              # [B]

    # Distribution of the next token: residual at the first rejection, p itself after full accept.
    residual = (p[:, :K] - q).clamp_min(0.0)                                      # [B, K, V]
    residual = torch.cat([residual, p[:, K:K + 1]], dim=1)                        # [B, K+1, V]
    full = num_accepted >= num_draft
    pick = torch.where(full, num_draft, num_accepted)                             # [B]
    chosen = residual.gather(1, pick.view(B, 1, 1).expand(B, 1, residual.shape[-1])).squeeze(1)
    bonus = p.gather(1, num_draft.view(B, 1, 1).expand(B, 1, p.shape[-1])).squeeze(1)
    chosen = torch.where(full.view(B, 1), bonus, chosen)                          # [B, V]
    mass = chosen.sum(-1, keepdim=True)
    # p == q exactly leaves no residual mass; then p itself is the right distribution to draw from.
    fallback = p.gather(1, pick.view(B, 1, 1).expand(B, 1, p.shape[-1])).squeeze(1)
    chosen = torch.where(mass > 0, chosen / mass.clamp_min(1e-30), fallback)
    next_token = torch.stack([torch.multinomial(chosen[i], 1, generator=generators[i]).squeeze(0)
                              for i in range(B)])
    return num_accepted, next_token


def sample_next(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row from probs [B, V] with each row's generator."""
    return torch.stack([torch.multinomial(probs[i], 1, generator=generators[i]).squeeze(0)
                        for i in range(probs.shape[0])])


# -- token trees ----------------------------------------------------------------------------------
#
# The tree a drafter proposes here is a chain with alternatives: at each depth j, the chain's
# token x_j and C-1 siblings, which are leaves (their parent is the chain's token j-1). The
# target scores every node in one pass. A row keeps the chain while it matches; at the first
# depth where the chain's token fails, one sibling may still be taken, and the target's token
# at that sibling ends the round. Drafting a sibling costs nothing (it is read off the same
# draft distribution), verifying it one more token in the target's pass.
#
# Greedy: the candidates at depth j are the draft's top C tokens; the target's argmax at the
# parent is taken if it is among them. Output equals target-only, as for chains.
#
# Sampling stays exact by SpecInfer's multi-candidate rule (Miao et al. 2024): the C candidates
# at depth j are drawn independently from the same q_j; they are tried in turn, candidate m
# accepted with probability min(1, r_m(x_m) / q_j(x_m)) where r_1 = p_j and, after each
# rejection, r_{m+1} = normalise(max(r_m - q_j, 0)). If all are rejected the token is drawn from
# the last residual. Each step emits min(q, r_m) and passes on exactly r_m's unmatched mass, so
# by induction the token at depth j is distributed as p_j (the chain's proof, applied C times).
# After an accepted sibling the next token is drawn from p at that sibling, the target's own
# distribution given the accepted path.


def verify_tree(chain_logits: torch.Tensor, sibling_logits: torch.Tensor, drafts: torch.Tensor,
                siblings: torch.Tensor, num_draft: torch.Tensor, temperature: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor, q: torch.Tensor | None,
                generators: list) -> tuple[list[int], list[int], list[int]]:
    """Verify a chain with alternatives (see above), row by row.

    chain_logits: [B, K+1, V] the target's logits at the parent of each depth and after the last
    draft; sibling_logits: [B, K, S, V] its logits at each sibling; drafts: [B, K]; siblings:
    [B, K, S]; num_draft: [B] depths row i drafted; q: [B, K, V] (None when every row is greedy).
    Returns per row (accepted, branch, next_token): `accepted` drafted tokens are kept, the last
    of them sibling `branch` of its depth (-1: all from the chain), then next_token.
    """
    B, K = drafts.shape
    accepted, branches, nexts = [], [], []
    greedy_rows = (temperature <= 0).tolist()
    choice = chain_logits.argmax(-1).tolist()                                     # [B, K+1]
    drafts_l, sib_l, num_l = drafts.tolist(), siblings.tolist(), num_draft.tolist()
    for i in range(B):
        n = num_l[i]
        if greedy_rows[i]:
            a, branch = 0, -1
            while a < n and drafts_l[i][a] == choice[i][a]:
                a += 1
            nxt = choice[i][a]
            if a < n and nxt in sib_l[i][a]:
                branch = sib_l[i][a].index(nxt)
                nxt = int(sibling_logits[i, a, branch].argmax())
                a += 1
            accepted.append(a), branches.append(branch), nexts.append(nxt)
            continue
        row = lambda logits: process_logits(logits.view(1, 1, -1), temperature[i:i + 1],  # noqa: E731
                                            top_k[i:i + 1], top_p[i:i + 1])[0, 0]
        g = generators[i]
        a, branch, nxt = 0, -1, None
        while a < n and nxt is None:
            r, qj = row(chain_logits[i, a]), q[i, a].float()
            for m, x in enumerate([drafts_l[i][a]] + sib_l[i][a]):
                u = float(torch.rand(1, generator=g, device=qj.device))
                if u * float(qj[x]) < float(r[x]):
                    if m:      # a sibling: the path ends there, the target's token follows
                        branch = m - 1
                        nxt = int(sample_next(row(sibling_logits[i, a, branch]).unsqueeze(0), [g]))
                    break
                residual = (r - qj).clamp_min(0.0)
                mass = float(residual.sum())
                r = residual / mass if mass > 0 else r     # r == q exactly: nothing is left over
            else:
                nxt = int(sample_next(r.unsqueeze(0), [g]))   # every candidate rejected
                break
            a += 1
        if nxt is None:                                          # the whole chain kept
            nxt = int(sample_next(row(chain_logits[i, n]).unsqueeze(0), [g]))
        accepted.append(a), branches.append(branch), nexts.append(nxt)
    return accepted, branches, nexts
