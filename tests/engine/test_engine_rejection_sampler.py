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

from specpair.rejection_sampler import greedy_verify, process_logits, rejection_sample


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
