"""Token trees (a chain with alternatives per position, verified in one target pass): the tree's
logits are bitwise the ones its paths get as chains; a kept branch moves into place; greedy output
stays identical to target-only; sampled output follows the target's exact distribution in the
verifier alone (end to end: test_engine_eagle.py's sampling test at width 3)."""

from __future__ import annotations

import pytest
import torch
from drafting_checks import assert_drafted_and_accepted
from head_builders import PARAMS, PROMPTS, assert_rows_joining_and_leaving_match, medusa_heads, mirror_head

from specpair import cpu_kernels
from specpair.config import SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.errors import SpecpairError
from specpair.rejection_sampler import verify_tree
from specpair.kv.static import StaticKVModel

PROMPT = [5, 17, 23, 42, 8, 99, 3, 61, 7, 12, 30]
# A tree after the prompt's last token x: chain c0 c1, siblings a, b of c0 (children of x) and
# d of c1 (a child of c0). Fed in this order; each path's tokens as a chain, for the reference.
TREE = [PROMPT[-1], 70, 71, 80, 81, 90]
PARENTS = [-1, -1, -1, 0, 0, 1]
PATHS = {0: [PROMPT[-1]], 1: [PROMPT[-1], 70], 2: [PROMPT[-1], 70, 71], 3: [PROMPT[-1], 80],
         4: [PROMPT[-1], 81], 5: [PROMPT[-1], 70, 90]}


def _cache(target, prefix):
    kv = StaticKVModel(target.model, vocab_size=target.embedding_rows)
    kv.add_rows(1)
    kv.extend([prefix])
    return kv


def _tree_logits(target):
    kv = _cache(target, PROMPT[:-1])
    return kv, kv.extend([TREE], last=len(TREE), parents=[PARENTS])[0]


def _path_logits(target, node):
    """The node's logits when its path is fed as a plain chain after the prompt."""
    return _cache(target, PROMPT[:-1]).extend([PATHS[node]])[0, -1]


def test_tree_logits_are_bitwise_each_paths_chain_logits(tiny_target):
    _, logits = _tree_logits(tiny_target)
    assert cpu_kernels.layer_applies(len(TREE), torch.float32, torch.device("cpu"), 16)  # C layer
    for node in range(len(TREE)):
        assert torch.equal(logits[node], _path_logits(tiny_target, node)), node


def test_the_torch_step_masks_a_tree_the_same_way(tiny_target, monkeypatch):
    """Where the C layer does not apply (CUDA, large batches), the torch step's tree mask."""
    monkeypatch.setattr(cpu_kernels, "layer_applies", lambda *a, **k: False)
    _, logits = _tree_logits(tiny_target)
    for node in range(len(TREE)):
        torch.testing.assert_close(logits[node], _path_logits(tiny_target, node), rtol=1e-5,
                                   atol=1e-5)


def test_a_kept_branch_moves_where_the_chain_would_be(tiny_target):
    kv, _ = _tree_logits(tiny_target)
    # Keep x, c0, then sibling d (slot 5 past the prompt) at depth 1 (c1's slot): move it.
    start = len(PROMPT) - 1
    kv.rollback(0, start + 3)
    kv.move([(0, start + 5, start + 2)])
    after = kv.extend([[55]])[0, -1]
    reference = _cache(tiny_target, PROMPT[:-1]).extend([[PROMPT[-1], 70, 90, 55]])[0, -1]
    assert torch.equal(after, reference)


def test_a_tree_parent_after_its_child_is_refused(tiny_target):
    kv = _cache(tiny_target, PROMPT[:-1])
    with pytest.raises(SpecpairError, match="parent"):
        kv.extend([[1, 2, 3]], parents=[[-1, 2, -1]])


def _logit_rows(*rows):
    return torch.log(torch.tensor(rows, dtype=torch.float32).clamp_min(1e-12))


def test_greedy_tree_verification_takes_a_sibling_where_the_chain_fails():
    V = 6
    onehot = lambda t: [1.0 if i == t else 0.0 for i in range(V)]   # noqa: E731
    # Target: after the prefix 2, after the chain's 2 then 4 (the chain drafted 3 at depth 1).
    chain = _logit_rows(onehot(2), onehot(4), onehot(0)).unsqueeze(0)          # [1, 3, V]
    siblings = torch.tensor([[[1], [4]]])                                      # [1, 2, 1]
    sibling_logits = _logit_rows(onehot(0), onehot(5)).view(1, 2, 1, V)
    accepted, branch, nxt = verify_tree(
        chain, sibling_logits, torch.tensor([[2, 3]]), siblings, torch.tensor([2]),
        torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1), None, [None])
    assert (accepted, branch, nxt) == ([2], [0], [5])     # 2, then sibling 4, then 5 after it
    # No candidate matches at depth 1: the target's own token, nothing from the siblings.
    accepted, branch, nxt = verify_tree(
        chain, sibling_logits, torch.tensor([[2, 3]]), torch.tensor([[[1], [1]]]),
        torch.tensor([2]), torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1), None,
        [None])
    assert (accepted, branch, nxt) == ([1], [-1], [4])


@pytest.mark.parametrize("width", [2, 3])
def test_sampled_tree_verification_emits_the_targets_distribution(width):
    """Candidates drawn independently from q, tried in turn against the running residual: the
    first emitted token is distributed as p whatever q (chi-square over many rows)."""
    import numpy as np
    from scipy.stats import chisquare

    V, rows = 6, 6000
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.0])
    q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])      # disagrees, and covers token 5
    draw = torch.Generator().manual_seed(1)
    candidates = torch.multinomial(q.expand(rows, V), width, replacement=True, generator=draw)
    logits = torch.log(p.clamp_min(1e-30)).expand(rows, 2, V).clone()
    accepted, branch, nxt = verify_tree(
        logits, logits[:, :1].unsqueeze(2).expand(rows, 1, width - 1, V), candidates[:, :1],
        candidates[:, 1:].unsqueeze(1), torch.ones(rows, dtype=torch.long), torch.ones(rows),
        torch.zeros(rows, dtype=torch.long), torch.ones(rows), q.expand(rows, 1, V),
        [torch.Generator().manual_seed(100 + i) for i in range(rows)])
    first = [int(candidates[i, 0 if b < 0 else b + 1]) if a else n
             for i, (a, b, n) in enumerate(zip(accepted, branch, nxt))]
    counts = np.bincount(first, minlength=V)
    assert counts[5] == 0
    expected = p[:5].double().numpy()
    assert chisquare(counts[:5], f_exp=expected / expected.sum() * counts[:5].sum()).pvalue > 1e-3
    assert any(b >= 0 for b in branch)                  # siblings were taken, not only the chain


@pytest.mark.parametrize("width", [2, 3])
def test_eagle_tree_keeps_greedy_identity_and_accepts_more(one_layer_target, reference, width):
    spec = dict(k=3, dynamic_k=False, fallback_threshold=0)
    chain = SpeculativeEngine(one_layer_target, draft=mirror_head(one_layer_target, vocab_every=2),
                              speculation=SpeculationConfig(**spec))
    tree = SpeculativeEngine(one_layer_target, draft=mirror_head(one_layer_target, vocab_every=2),
                             speculation=SpeculationConfig(**spec, tree_width=width))
    chain_results, tree_results = chain.generate(PROMPTS, PARAMS), tree.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in tree_results] == reference
    steps = lambda results: sum(r.stats.num_target_steps for r in results)   # noqa: E731
    assert steps(tree_results) < steps(chain_results)   # more tokens a target pass
    assert_rows_joining_and_leaving_match(tree, reference)


def test_medusa_tree_keeps_greedy_identity(smooth_target):
    reference = SpeculativeEngine(smooth_target, speculation=SpeculationConfig(enabled=False))
    expected = [reference.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    engine = SpeculativeEngine(smooth_target, draft=medusa_heads(smooth_target, scramble=0.3),
                               speculation=SpeculationConfig(k=3, dynamic_k=False,
                                                             fallback_threshold=0, tree_width=3))
    results = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == expected
    assert_drafted_and_accepted([r.stats for r in results], "Medusa tree of 3")


def test_tree_width_is_bounded():
    with pytest.raises(SpecpairError, match="tree_width"):
        SpeculationConfig(tree_width=0)
    with pytest.raises(SpecpairError, match="tree_width"):
        SpeculationConfig(tree_width=5)


def test_a_tree_width_for_a_chain_drafter_is_said_not_silently_dropped(tiny_target, tiny_draft):
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft,
                               speculation=SpeculationConfig(tree_width=2))
    assert any("tree_width 2 applies to drafting heads" in w for w in engine.warnings)
