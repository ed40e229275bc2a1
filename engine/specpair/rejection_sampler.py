"""Verification of draft tokens: greedy matching and the lossless rejection sampler.

Sampling (Leviathan et al. 2023, Chen et al. 2023). For draft position j with draft token x_j
drawn from the draft distribution q_j, the target distribution p_j accepts it with probability
min(1, p_j(x_j) / q_j(x_j)). At the first rejection j, a token is drawn from the residual
normalize(max(0, p_j - q_j)); if every draft token is accepted, a bonus token is drawn from
p_{k}. The emitted tokens are then distributed exactly as if drawn from p one at a time.
A deterministic drafter (n-gram lookup) is the special case where q_j is a point mass on x_j.

Greedy: accept the longest prefix where x_j == argmax p_j, then emit argmax p at the first
mismatch (or after the last draft token): the target's own choice, so output equals target-only.

Keyed (seeded rows): the token at position t (its index in prompt + reply) is the target's draw
from p_t with randomness keyed by (seed, t) alone (`keyed_sample`); a draft token is kept iff it
equals that draw (`keyed_verify`, `verify_tree`), and the token after the kept ones is the draw at
the first mismatch. Every committed token is therefore the target's own keyed draw at its
position given the tokens before it, whatever was drafted, how many, or who shared the batch: the
reply is the target-only reply for that seed, token for token, and it is lossless because each
keyed draw is an exact draw from p_t (Gumbel-max, below) with noise independent of every other
position's, so the reply's law over seeds is the target's autoregressive law. A drafter with a
distribution q draws its proposal with the same keyed noise (`sample_next` with keys), which
couples the two draws: where p and q agree, their argmaxes under shared Gumbel noise agree, so
acceptance stays near sum_x min(p, q) (Gumbel coupling: at least (1 - TV) / (1 + TV)). A
deterministic drafter (q a point mass on x) is kept with probability p_t(x), as by the rejection
rule. Greedy is the keyed rule without noise.

All functions are vectorised over rows and draft positions; rows carry their own number of draft
tokens (padded to K) and their own random generator (unseeded rows) or key (seeded rows), so a
row's draws do not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpair.config import SEED_LIMIT


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
    return accept_matching(target_logits.argmax(-1), draft_tokens, num_draft)


def accept_matching(target_choice: torch.Tensor, draft_tokens: torch.Tensor,
                    num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafts equal to the target's choice at their position, in a leading run, then the
    target's choice after them. target_choice: [B, K+1]; draft_tokens: [B, K]; num_draft: [B].
    Returns (num_accepted [B], next_token [B])."""
    B, K = draft_tokens.shape
    positions = torch.arange(K, device=draft_tokens.device).view(1, K)
    matches = (target_choice[:, :K] == draft_tokens) & (positions < num_draft.view(B, 1))
    # Leading run of matches: cumprod stays 1 until the first mismatch.
    num_accepted = matches.long().cumprod(-1).sum(-1)                             # [B]
    next_token = target_choice.gather(1, num_accepted.view(B, 1)).squeeze(1)
    return num_accepted, next_token


# -- keyed draws (seeded rows) ---------------------------------------------------------------------
#
# keyed_sample draws from p by the exponential race, Gumbel-max in another form: with E(v)
# i.i.d. standard exponential, argmax_v p(v) / E(v) = argmax_v log p(v) + G(v), G = -log E
# standard Gumbel, is distributed as p. At position t of a row with seed s, E(v) is a function of
# (s, t, v) alone: splitmix64 over the key and v, its 52 high bits a uniform u in (0, 1), E =
# -log u. Every token gets noise of its own: giving it only to the likely ones and drawing the rest
# as one block by inverse CDF is the same draw and cheaper, but it couples draft and target badly
# where the tail carries mass (draft-model acceptance on the tiny pair at temperature 0.8: 0.32,
# against 0.46 with noise for every token, and 0.46 for unseeded rejection sampling).


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor, in place, bit for bit the unsigned one:
    multiplication wraps modulo 2**64 in two's complement as it does unsigned, and each right
    shift is made logical by masking off the copies of the sign bit. Returns x."""
    x ^= (x >> 30) & ((1 << 34) - 1)
    x *= _MIX1
    x ^= (x >> 27) & ((1 << 37) - 1)
    x *= _MIX2
    x ^= (x >> 31) & ((1 << 33) - 1)
    return x


def seed_key(seed: int) -> int:
    """A request's seed in [0, 2**64) as the int64 that keys its draws."""
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return _int64(seed)


def draw_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One key per (seed, position): seeds [N] int64 (seed_key), positions [N] long -> [N] int64.
    Mixed twice, so neighbouring positions and seeds give unrelated keys."""
    return mix64(mix64(seeds + _GOLDEN) + positions)     # `+` makes new tensors: mixed in place


def keyed_exponentials(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard exponentials [N, vocab], float64, one per key [N] and token: -log u with u from
    the 52 high bits of splitmix64(key + token * golden ratio), (k + 0.5) / 2**52: exact in a
    double and strictly inside (0, 1), so E is finite and positive. In place where it can: this
    is most of a keyed draw's cost (measured: 1.2 ms a position at a 49,152-token vocabulary
    on one CPU core, some twenty softmaxes over the same values)."""
    x = mix64(keys.unsqueeze(-1) + torch.arange(vocab, device=keys.device) * _GOLDEN)
    x >>= 12
    x &= (1 << 52) - 1
    return x.double().add_(0.5).mul_(2.0 ** -52).log_().neg_()


def _race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each token's p / E [N, V]: the keyed draw is its argmax (0 where p is 0, never drawn)."""
    return probs.double().div_(keyed_exponentials(draw_keys(seeds, positions), probs.shape[-1]))


def keyed_sample(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One keyed draw per row from probs [N, V]: seeds [N] int64 (seed_key), positions [N] long
    (the drawn token's index in its sequence) -> tokens [N] long. Exactly distributed as probs
    over seeds (see above), and the same token for the same (probs, seed, position) whatever
    else is drawn beside it."""
    return _race(probs, seeds, positions).argmax(-1)


def keyed_alternatives(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                       chosen: torch.Tensor, count: int) -> torch.Tensor:
    """`count` alternatives [N, count] to keyed draws `chosen` [N] for a token tree: the tokens
    that come next in the same race (Gumbel top-k), where the target's draw most likely lands
    when it is not the chosen one."""
    race = _race(probs, seeds, positions).scatter(-1, chosen.unsqueeze(-1), -1.0)
    return race.topk(count, dim=-1).indices


@dataclass(frozen=True)
class DrawKeys:
    """A round's keyed rows: which rows of the batch draw keyed (seeded, temperature > 0), their
    seeds as keys, and where each one's round starts (the position of its next token). Draft
    position j of such a row draws at start + j, in the drafter and in verification alike."""

    rows: list[int]             # batch rows, ascending
    seeds: torch.Tensor         # [R] int64 (seed_key)
    start: torch.Tensor         # [R] long

    def sample(self, probs: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The keyed rows' draws [R] from the batch's probs [B, V] at start + offset."""
        return keyed_sample(probs[self.rows], self.seeds, self.start + offset)


def keyed_verify(p: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor,
                 seeds: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keyed acceptance: greedy_verify's rule with the target's keyed draws in place of its argmax.

    p: [N, K+1, V] target probabilities; draft_tokens: [N, K]; num_draft: [N]; seeds: [N] int64
    (seed_key); start: [N] long, the position the first draft token would take.
    Returns (num_accepted [N], next_token [N]): the drafts equal to the target's draw at their
    position, in a leading run, then the target's draw at the first mismatch (or after the last
    draft). Every emitted token is the target's keyed draw given the tokens before it, so the
    reply equals target-only keyed sampling token for token and is distributed as p (module
    docstring); a draft token x is kept with probability p(x) for a point-mass drafter and, for a
    drafter that drew x with the same keyed noise from q, with the Gumbel coupling's probability.
    """
    N = p.shape[0]
    drafts, nums = draft_tokens.tolist(), num_draft.tolist()
    accepted, nexts = [0] * N, [0] * N
    # Position by position, only for the rows whose drafts still match: a draw is the step's
    # costliest sampling work (keyed_exponentials), and most rounds end at their first mismatch.
    live, j = list(range(N)), 0
    while live:
        draws = keyed_sample(p[live, j], seeds[live], start[live] + j).tolist()
        matching = []
        for i, token in zip(live, draws):
            if j < nums[i] and token == drafts[i][j]:
                accepted[i] += 1
                matching.append(i)
            else:
                nexts[i] = token
        live, j = matching, j + 1
    return (torch.tensor(accepted, device=p.device), torch.tensor(nexts, device=p.device))


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


def sample_next(probs: torch.Tensor, generators: list[torch.Generator | None],
                keys: DrawKeys | None = None, offset: int = 0) -> torch.Tensor:
    """Draw one token per row from probs [B, V]: a keyed row (keys.rows) by its key at position
    keys.start + offset, every other row with its generator."""
    keyed = set(keys.rows) if keys is not None else set()
    out = torch.stack([torch.multinomial(probs[i], 1, generator=generators[i]).squeeze(0)
                       if i not in keyed else torch.zeros((), dtype=torch.long, device=probs.device)
                       for i in range(probs.shape[0])])
    if keyed:
        out[keys.rows] = keys.sample(probs, offset)
    return out


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
# parent is taken if it is among them. Output equals target-only, as for chains. Keyed rows
# follow the same rule with the target's keyed draw in place of its argmax (the candidates then
# are the draft's keyed draw and the tokens ranked after it under the same noise), so they too
# equal target-only, and are lossless for the reason keyed chains are.
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
                generators: list, keys: DrawKeys | None = None
                ) -> tuple[list[int], list[int], list[int]]:
    """Verify a chain with alternatives (see above), row by row.

    chain_logits: [B, K+1, V] the target's logits at the parent of each depth and after the last
    draft; sibling_logits: [B, K, S, V] its logits at each sibling; drafts: [B, K]; siblings:
    [B, K, S]; num_draft: [B] depths row i drafted; q: [B, K, V] (None when every row is greedy);
    keys: the keyed rows, whose depth j draws at keys.start + j.
    Returns per row (accepted, branch, next_token): `accepted` drafted tokens are kept, the last
    of them sibling `branch` of its depth (-1: all from the chain), then next_token.
    """
    B, K = drafts.shape
    accepted, branches, nexts = [], [], []
    greedy_rows = (temperature <= 0).tolist()
    choice = chain_logits.argmax(-1).tolist()                                     # [B, K+1]
    drafts_l, sib_l, num_l = drafts.tolist(), siblings.tolist(), num_draft.tolist()
    keyed = keys.rows if keys is not None else []
    for i in range(B):
        n = num_l[i]
        row = lambda logits: process_logits(logits.view(1, 1, -1), temperature[i:i + 1],  # noqa: E731
                                            top_k[i:i + 1], top_p[i:i + 1])[0, 0]
        if greedy_rows[i] or i in keyed:
            # The target's own choice decides: its argmax, or its keyed draw at the position
            # (the token after depth j's is at keys.start + j + 1).
            if greedy_rows[i]:
                at_chain = lambda a: choice[i][a]                                      # noqa: E731
                at_sibling = lambda a, b: int(sibling_logits[i, a, b].argmax())        # noqa: E731
            else:
                r = keyed.index(i)
                draw = lambda logits, depth: int(keyed_sample(                         # noqa: E731
                    row(logits).unsqueeze(0), keys.seeds[r:r + 1], keys.start[r:r + 1] + depth))
                at_chain = lambda a: draw(chain_logits[i, a], a)                       # noqa: E731
                at_sibling = lambda a, b: draw(sibling_logits[i, a, b], a + 1)         # noqa: E731
            a, branch = 0, -1
            nxt = at_chain(0)
            while a < n and drafts_l[i][a] == nxt:
                a += 1
                nxt = at_chain(a)
            if a < n and nxt in sib_l[i][a]:
                branch = sib_l[i][a].index(nxt)
                nxt = at_sibling(a, branch)
                a += 1
            accepted.append(a), branches.append(branch), nexts.append(nxt)
            continue
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
