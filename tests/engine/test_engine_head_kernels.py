"""The EAGLE-3 head's layer in C (head_kernels.c): what the head's PyTorch layer computes, and a
row's result bitwise the same alone, in pieces and beside other rows (what lets the drafter run
every row's step as one call with drafts the same at any batch)."""

from __future__ import annotations

import pytest
import torch

from specpair import head_kernels
from specpair.eagle3 import build_eagle3_head

D = 256


@pytest.fixture(scope="module")
def head(tiny_tokenizer):
    from tiny_models import make_model

    target = make_model(tiny_tokenizer, seed=11, layers=4, hidden=D, heads=4, init_std=0.05)
    head = build_eagle3_head(target.model, torch.arange(0, 400, 2), (1, 2, 4), seed=5).eval()
    with torch.no_grad():        # away from the fresh head's identity-like start
        generator = torch.Generator().manual_seed(0)
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    assert head_kernels.applies(head), "the head's C kernel did not build"
    return head


def empty_cache(head, rows: int, capacity: int = 32):
    shape = (rows, head.layer.kv_heads, capacity, head.layer.head_dim)
    return torch.zeros(shape), torch.zeros(shape)


@pytest.mark.parametrize("norm_before_residual", [False, True])
@torch.no_grad()
def test_the_c_layer_computes_the_heads_layer(head, norm_before_residual, monkeypatch):
    monkeypatch.setattr(head.layer, "norm_before_residual", norm_before_residual)
    n = 9
    generator = torch.Generator().manual_seed(1)
    embeds, hidden = torch.randn(2, n, D, generator=generator)
    positions = torch.arange(n)
    cos, sin = head.rotary(embeds.view(1, n, D), positions.view(1, n))
    expected, (keys, values) = head.layer(embeds.view(1, n, D), hidden.view(1, n, D), cos, sin,
                                          None, None)
    kc, vc = empty_cache(head, 2)
    run = head_kernels.Eagle3Kernel(head)
    out, normed = run(embeds, hidden, torch.ones(n, dtype=torch.long), positions, n, kc, vc)
    torch.testing.assert_close(out, expected[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(normed, head.norm(expected[0]), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(kc[1, :, :n], keys[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(vc[1, :, :n], values[0], atol=2e-5, rtol=1e-5)
    assert not kc[0].any()                                   # row 0 untouched


@torch.no_grad()
def test_a_rows_result_is_bitwise_the_same_alone_in_pieces_and_beside_others(head):
    run = head_kernels.Eagle3Kernel(head)
    generator = torch.Generator().manual_seed(2)
    lengths = [5, 1, 7]
    pairs = [torch.randn(2, n, D, generator=generator) for n in lengths]
    alone = []
    for row, (embeds, hidden) in enumerate(pairs):
        kc, vc = empty_cache(head, 3)
        n = embeds.shape[0]
        alone.append(run(embeds, hidden, torch.full((n,), row), torch.arange(n), n, kc, vc))
    # every row's tokens in one call
    kc, vc = empty_cache(head, 3)
    rows = torch.cat([torch.full((n,), row) for row, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    out, normed = run(torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]), rows,
                      positions, max(lengths), kc, vc)
    assert torch.equal(out, torch.cat([a[0] for a in alone]))
    assert torch.equal(normed, torch.cat([a[1] for a in alone]))
    # row 2 in two calls (its keys read back from the cache), beside row 0's next token
    kc, vc = empty_cache(head, 3)
    embeds, hidden = pairs[2]
    first = run(embeds[:3], hidden[:3], torch.full((3,), 2), torch.arange(3), 3, kc, vc)
    extra = torch.randn(2, 1, D, generator=generator)
    second = run(torch.cat([extra[0], embeds[3:]]), torch.cat([extra[1], hidden[3:]]),
                 torch.tensor([0, 2, 2, 2, 2]), torch.tensor([0, 3, 4, 5, 6]), 7, kc, vc)
    assert torch.equal(torch.cat([first[0], second[0][1:]]), alone[2][0])


def test_tokens_of_a_row_out_of_position_order_are_refused(head):
    run = head_kernels.Eagle3Kernel(head)
    kc, vc = empty_cache(head, 1)
    embeds = torch.zeros(2, D)
    with pytest.raises(RuntimeError, match="code -3"):
        run(embeds, embeds, torch.zeros(2, dtype=torch.long), torch.tensor([3, 1]), 4, kc, vc)
    with pytest.raises(RuntimeError, match="code -2"):        # past the cache's capacity
        run(embeds[:1], embeds[:1], torch.zeros(1, dtype=torch.long), torch.tensor([40]), 41,
            kc, vc)
