"""The rejection sampler is lossless: emitted tokens follow the target distribution p."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare as _chisquare
from tiny_models import sample_and_compare


def chisquare(observed, f_exp):
    # Rescale expectations to the observed total (float32 probabilities do not sum to exactly 1).
    f_exp = np.asarray(f_exp, dtype=np.float64)
    return _chisquare(observed, f_exp=f_exp * np.sum(observed) / f_exp.sum())

from specpair.rejection_sampler import (DrawKeys, greedy_verify, keyed_alternatives, keyed_sample,
                                        keyed_verify, mix64, process_logits, rejection_sample,
                                        seed_key, verify_tree)


def _draws(p_row, q_row, n, seed):
    """n independent single-draft rounds; returns the first emitted token of each."""
    V = p_row.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(q_row.expand(n, V), 1, replacement=True, generator=gen)   # [n, 1]
    p = p_row.view(1, 1, V).expand(n, 2, V)
    q = q_row.view(1, 1, V).expand(n, 1, V)
    gens = [torch.Generator().manual_seed(seed * 100003 + i) for i in range(n)]
    accepted, nxt = rejection_sample(p, q, draft, torch.ones(n, dtype=torch.long), gens)
    return torch.where(accepted == 1, draft.squeeze(1), nxt), accepted


@pytest.mark.parametrize("seed", [0, 1])
def test_emitted_tokens_follow_target_distribution(seed):
    torch.manual_seed(seed)
    V, n = 8, 40_000
    p = torch.rand(V).pow(2); p /= p.sum()
    q = torch.rand(V).pow(2); q /= q.sum()
    tokens, accepted = _draws(p, q, n, seed)
    counts = np.bincount(tokens.numpy(), minlength=V)
    result = chisquare(counts, f_exp=p.numpy() * n)
    assert result.pvalue > 1e-3, (counts, p * n)
    # Acceptance probability is sum_x min(p, q) (Leviathan et al.).
    expected_accept = torch.minimum(p, q).sum().item()
    assert abs(accepted.float().mean().item() - expected_accept) < 0.01
    # And it is *not* q's distribution (the test can fail).
    assert chisquare(counts, f_exp=q.numpy() * n).pvalue < 1e-6


def test_point_mass_draft_is_lossless():
    V, n = 6, 20_000
    p = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05])
    q = torch.zeros(V); q[1] = 1.0          # n-gram drafter: always proposes token 1
    tokens, accepted = _draws(p, q, n, 7)
    counts = np.bincount(tokens.numpy(), minlength=V)
    assert chisquare(counts, f_exp=p.numpy() * n).pvalue > 1e-3
    assert abs(accepted.float().mean().item() - 0.3) < 0.015


def test_full_acceptance_draws_bonus_from_last_position():
    V, n, K = 5, 12_000, 2
    p = torch.zeros(n, K + 1, V)
    p[:, :K, 0] = 1.0                       # target certain of token 0 at draft positions
    bonus = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    p[:, K] = bonus
    q = torch.zeros(n, K, V); q[..., 0] = 1.0
    drafts = torch.zeros(n, K, dtype=torch.long)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    accepted, nxt = rejection_sample(p, q, drafts, torch.full((n,), K), gens)
    assert bool((accepted == K).all())
    counts = np.bincount(nxt.numpy(), minlength=V)
    assert chisquare(counts, f_exp=bonus.numpy() * n).pvalue > 1e-3


def test_greedy_verify_longest_prefix_and_bonus():
    logits = torch.full((2, 4, 10), -5.0)
    for pos, tok in enumerate([3, 4, 5, 6]):
        logits[:, pos, tok] = 5.0
    drafts = torch.tensor([[3, 4, 9], [3, 4, 5]])
    accepted, nxt = greedy_verify(logits, drafts, torch.tensor([3, 2]))
    assert accepted.tolist() == [2, 2]
    assert nxt.tolist() == [5, 5]


def test_process_logits_filters():
    logits = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0]]]).repeat(3, 1, 1)
    probs = process_logits(logits, torch.tensor([1.0, 1.0, 0.0]), torch.tensor([2, 0, 0]),
                           torch.tensor([1.0, 0.7, 1.0]))
    assert (probs[0, 0, 2:] == 0).all() and probs[0, 0, :2].sum().item() == pytest.approx(1.0)
    kept = (probs[1, 0] > 0).sum().item()
    assert kept == 2                     # 0.64 < 0.7 needs the second token too
    assert probs[2, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_end_to_end_sampled_sequences_follow_target(tiny_target, tiny_draft):
    """Two-token sequences from the speculative engine vs the target's exact distribution."""
    from specpair.config import SpeculationConfig
    from specpair.decoding import SpeculativeEngine

    engine = SpeculativeEngine(tiny_target, draft=tiny_draft,
                               speculation=SpeculationConfig(k=2, dynamic_k=False, fallback_threshold=0,
                                                             batch_size_threshold=100_000))
    prompt = engine.encode("def foo(x):")
    top_k, temperature, n = 3, 1.5, 3000
    # Exact target distribution over the first two tokens under the same filters.
    model = tiny_target.model
    with torch.no_grad():
        ids = torch.tensor([prompt])
        first = process_logits(model(ids).logits[:, -1:], torch.tensor([temperature]),
                               torch.tensor([top_k]), torch.tensor([1.0]))[0, 0]
        support = first.nonzero().squeeze(1).tolist()
        joint = {}
        for a in support:
            nxt = process_logits(model(torch.tensor([prompt + [a]])).logits[:, -1:],
                                 torch.tensor([temperature]), torch.tensor([top_k]),
                                 torch.tensor([1.0]))[0, 0]
            for b in nxt.nonzero().squeeze(1).tolist():
                joint[(a, b)] = first[a].item() * nxt[b].item()
    seqs = sample_and_compare(engine, prompt, joint, temperature=temperature, top_k=top_k,
                              max_new_tokens=3, n=n)
    assert sum(s.stats.num_drafts for s in seqs) > 0


def test_a_rows_distribution_does_not_depend_on_its_neighbours():
    """top_p = 1.0 next to top_p < 1 (and every other mix): each row as if it were alone."""
    torch.manual_seed(0)
    V = 4096
    # A confident head and a long tail of tiny probabilities: float32 cumulative sums reach 1.0
    # before the tail ends.
    logits = torch.randn(6, 2, V) * 2
    logits[:, :, :3] += torch.tensor([14.0, 12.0, 10.0])
    temperature = torch.tensor([1.0, 1.0, 0.7, 1.3, 0.0, 1.0])
    top_k = torch.tensor([0, 0, 50, 0, 0, 7])
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.95, 1.0, 0.3])
    batched = process_logits(logits, temperature, top_k, top_p)
    for i in range(6):
        alone = process_logits(logits[i:i + 1], temperature[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])
        assert torch.equal(batched[i], alone[0]), (i, int((batched[i] > 0).sum()), int((alone[0] > 0).sum()))
    # The unfiltered row keeps its whole tail.
    assert bool((batched[0] > 0).all())


# -- keyed draws (seeded rows) ---------------------------------------------------------------------

def _splitmix64(x: int) -> int:
    """splitmix64's finaliser on Python's unbounded ints: the reference mix64 must equal."""
    mask = (1 << 64) - 1
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & mask
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_mix64_is_splitmix64_bit_for_bit():
    """int64 tensors wrap and shift as uint64 would: keyed draws are the same on every machine."""
    rng = np.random.default_rng(3)
    values = [int(v) for v in rng.integers(0, 2 ** 63, 500, dtype=np.uint64)]
    values += [v | (1 << 63) for v in values[:250]] + [0, 1, (1 << 64) - 1, 1 << 63]
    mixed = mix64(torch.tensor([seed_key(v) for v in values])).tolist()
    assert [m & ((1 << 64) - 1) for m in mixed] == [_splitmix64(v) for v in values]
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
            seed_key(bad)


def _keyed(p_rows: torch.Tensor, seeds, position: int) -> torch.Tensor:
    """Keyed draws from one distribution per seed: p_rows [V] expanded, or [n, V]."""
    seeds = torch.tensor([seed_key(s) for s in seeds])
    probs = p_rows.expand(len(seeds), -1) if p_rows.dim() == 1 else p_rows
    return keyed_sample(probs, seeds, torch.full((len(seeds),), position))


def test_keyed_draws_follow_p_independently_at_each_position():
    """Over seeds, the draws at positions 7 and 8 are distributed as p7 x p8 (independent, each
    exact), tokens of probability 0 are never drawn, and the same key gives the same token."""
    torch.manual_seed(4)
    V, n = 6, 36_000
    p7 = torch.rand(V).pow(2); p7[2] = 0; p7 /= p7.sum()
    p8 = torch.rand(V); p8[5] = 0; p8 /= p8.sum()
    seeds = range(n)
    first, second = _keyed(p7, seeds, 7), _keyed(p8, seeds, 8)
    assert int((first == 2).sum()) == 0 and int((second == 5).sum()) == 0
    pairs = np.bincount((first * V + second).numpy(), minlength=V * V)
    joint = torch.outer(p7, p8).flatten().double().numpy()
    support = joint > 0
    assert chisquare(pairs[support], f_exp=joint[support] * n).pvalue > 1e-3
    # The test can fail: a draw that ignored its position would pair each token with itself.
    same = _keyed(p7, seeds, 8)
    assert not torch.equal(same, first)
    assert torch.equal(_keyed(p7, seeds, 7), first)


def test_a_keyed_draw_depends_on_its_own_row_alone():
    torch.manual_seed(5)
    probs = torch.rand(5, 3000).pow(8).softmax(-1)
    seeds, positions = torch.tensor([11, 12, 13, 11, seed_key(2 ** 64 - 1)]), torch.tensor([40, 3, 9, 41, 0])
    batched = keyed_sample(probs, seeds, positions)
    alone = [int(keyed_sample(probs[i:i + 1], seeds[i:i + 1], positions[i:i + 1])) for i in range(5)]
    assert batched.tolist() == alone
    # Other seeds draw other tokens (not one fixed answer).
    others = keyed_sample(probs[:1].expand(50, -1), torch.arange(50), positions[:1].expand(50))
    assert len(set(others.tolist())) > 10


def _position_probs(n: int, K: int, V: int, seed: int) -> torch.Tensor:
    """[n, K+1, V]: a different distribution at each position (sharp enough to repeat draws)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, K + 1, V, generator=gen) * 2).softmax(-1).expand(n, K + 1, V)


def test_keyed_verification_rejects_at_any_position_as_target_only_draws():
    """Drafts equal to the target's own keyed draws up to position m, then another token: exactly
    m are kept and the next token is the target's draw at m, for every m (and every num)."""
    K, V, n = 5, 50, 40
    p = _position_probs(n, K, V, seed=1)
    seeds = torch.arange(n) * 7919
    start = torch.arange(n) + 20
    draws = torch.stack([keyed_sample(p[:, j], seeds, start + j) for j in range(K + 1)], dim=1)
    for m in range(K + 1):
        drafts = draws[:, :K].clone()
        if m < K:
            drafts[:, m] = (drafts[:, m] + 1) % V                   # rejected at m
        for num in {m, K}:
            accepted, nxt = keyed_verify(p, drafts, torch.full((n,), num), seeds, start)
            assert accepted.tolist() == [min(m, num)] * n
            assert torch.equal(nxt, draws[:, min(m, num)])


def test_keyed_speculation_is_lossless_and_couples_draft_and_target():
    """A draft drawn from q with the target's keyed noise, verified by keyed_verify: the first
    emitted token follows p (and not q), and the draft is kept as often as the Gumbel coupling
    says, between (1 - TV) / (1 + TV) and 1 - TV, far more than an independent draw of q would
    be (sum p q). A point-mass draft is kept with probability p(x)."""
    torch.manual_seed(6)
    V, n = 8, 40_000
    p = torch.rand(V).pow(2); p /= p.sum()
    q = (p + 0.15 * torch.rand(V)); q /= q.sum()
    seeds, start = torch.arange(n), torch.full((n,), 3)
    drafts = keyed_sample(q.expand(n, V), seeds, start).unsqueeze(1)               # [n, 1]
    target = p.view(1, 1, V).expand(n, 2, V)
    accepted, nxt = keyed_verify(target, drafts, torch.ones(n, dtype=torch.long), seeds, start)
    first = torch.where(accepted == 1, drafts.squeeze(1), nxt)
    counts = np.bincount(first.numpy(), minlength=V)
    assert chisquare(counts, f_exp=p.numpy() * n).pvalue > 1e-3
    assert chisquare(counts, f_exp=q.numpy() * n).pvalue < 1e-6
    assert torch.equal(first, keyed_sample(p.expand(n, V), seeds, start))     # target-only's draw
    tv = 0.5 * (p - q).abs().sum().item()
    rate = accepted.float().mean().item()
    assert (1 - tv) / (1 + tv) - 0.01 < rate < 1 - tv + 0.01, (rate, tv)
    assert rate > (p * q).sum().item() + 0.2
    point = torch.full((n, 1), 3)
    accepted, _ = keyed_verify(target, point, torch.ones(n, dtype=torch.long), seeds, start)
    assert abs(accepted.float().mean().item() - p[3].item()) < 0.01


def test_keyed_tree_verification_takes_the_targets_draw_among_the_siblings():
    """verify_tree on keyed rows: the emitted path is the target's keyed draws, a sibling is kept
    where the draw lands on one (siblings ranked by the draft's keyed race), and the first token
    follows p."""
    torch.manual_seed(7)
    V, n, width = 6, 6000, 3
    p = torch.rand(V).pow(2); p /= p.sum()
    q = torch.rand(V); q /= q.sum()
    seeds = torch.arange(n)
    start = torch.full((n,), 9)
    chain = keyed_sample(q.expand(n, V), seeds, start)
    siblings = keyed_alternatives(q.expand(n, V), seeds, start, chain, width - 1)
    assert not bool((siblings == chain.unsqueeze(1)).any())
    logits = torch.log(p).expand(n, 2, V).clone()
    keys = DrawKeys(rows=list(range(n)), seeds=seeds, start=start)
    accepted, branch, nxt = verify_tree(
        logits, logits[:, :1].unsqueeze(2).expand(n, 1, width - 1, V), chain.unsqueeze(1),
        siblings.unsqueeze(1), torch.ones(n, dtype=torch.long), torch.ones(n),
        torch.zeros(n, dtype=torch.long), torch.ones(n), q.expand(n, 1, V), [None] * n, keys)
    first = [int(chain[i]) if a and b < 0 else int(siblings[i, b]) if a else t
             for i, (a, b, t) in enumerate(zip(accepted, branch, nxt))]
    assert first == keyed_sample(p.expand(n, V), seeds, start).tolist()
    counts = np.bincount(first, minlength=V)
    assert chisquare(counts, f_exp=p.numpy() * n).pvalue > 1e-3
    assert any(b >= 0 for b in branch) and any(a and b < 0 for a, b in zip(accepted, branch))
    # After a kept token the next is the target's draw one position on.
    kept = [i for i, a in enumerate(accepted) if a]
    assert [nxt[i] for i in kept] == keyed_sample(p.expand(len(kept), V), seeds[kept], start[kept] + 1).tolist()
