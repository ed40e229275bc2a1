"""The EAGLE-3 head's layer in C (head_kernels.c): what the head's PyTorch layer computes, and a
row's result bitwise the same alone, in pieces and beside other rows (what lets the drafter run
every row's step as one call with drafts the same at any batch)."""

from __future__ import annotations

import pytest
import torch
from head_builders import eagle3_head

from specpair import head_kernels

D = 256


@pytest.fixture(scope="module")
def head(eagle3_target):
    assert eagle3_target.model.config.hidden_size == D
    head = eagle3_head(eagle3_target).model
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


# ---- the LM head's top-1 fused into the call (greedy drafting: no logits row) -----------------

def argmax_of_written_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The unfused path's draft: the logits row the small-batch kernel writes, its argmax."""
    from specpair import cpu_kernels

    return torch.cat([cpu_kernels.linear(x[a:a + 64], weight).argmax(-1)
                      for a in range(0, x.shape[0], 64)])


@torch.no_grad()
def test_the_fused_top1_is_the_argmax_of_the_logits_the_lm_head_writes(head):
    """with_top1's index for each picked token is the argmax of the logits the unfused LM head
    writes for that token's normed output (bitwise the same sums), for picks of a subset, with
    repeats and more picks than tokens; the layer's outputs are __call__'s."""
    from specpair.drafters.head import draft_vocab_logits

    run = head_kernels.Eagle3Kernel(head)
    assert run.top1_applies()
    generator = torch.Generator().manual_seed(3)
    n = 6
    embeds, hidden = torch.randn(2, n, D, generator=generator)
    rows, positions = torch.tensor([0, 0, 0, 1, 2, 2]), torch.tensor([0, 1, 2, 0, 0, 1])
    kc, vc = empty_cache(head, 3)
    out, normed = run(embeds, hidden, rows, positions, 3, kc, vc)
    logits = draft_vocab_logits(head, normed)
    for pick in (None, [2, 3, 5], [5, 5, 0, 1, 2, 3, 4, 0, 2]):
        kc, vc = empty_cache(head, 3)
        got = run.with_top1(embeds, hidden, rows, positions, 3, kc, vc,
                            None if pick is None else torch.tensor(pick))
        assert torch.equal(got[0], out) and torch.equal(got[1], normed)
        chosen = list(range(n)) if pick is None else pick
        assert torch.equal(got[2], logits[chosen].argmax(-1))
    with pytest.raises(RuntimeError, match="code -1"):      # a pick past the call's tokens
        run.with_top1(embeds, hidden, rows, positions, 3, kc, vc, torch.tensor([0, n]))


def tied_weights(V: int, I: int, ties: list[tuple[int, ...]], nan: tuple[int, ...] = ()):
    """Random rows [V, I] and x [8, I] where, for x's row r, the rows of ties[r] are all the
    same vector and score the highest (bitwise equal logits), and the rows of `nan` hold a NaN."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(V, I, generator=generator) * 0.01
    x = torch.randn(len(ties), I, generator=generator)
    for r, tie in enumerate(ties):
        for v in tie:
            weight[v] = x[r] * 0.5          # x . x / 2: above every random row's logit
    for v in nan:
        weight[v, 3] = float("nan")
    return x, weight


# Ties (disjoint, one a row of x) a block of 16 apart (15/16, 31/32), where two threads split
# the vocabulary (95/96) and three (63/64, 127/128), the first token with a later one, in the
# last partial block (V not a multiple of 16), and a tie listed high index first.
V_TIES = 200
TIES = [(15, 16), (95, 96, 104), (0, 197), (193, 199), (31, 32, 47), (3, 2), (63, 64),
        (127, 128), (150, 151)]


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_fused_top1_breaks_ties_as_torch_argmax_does(rows, threads):
    """Equal maxima (the same weight row twice): the lowest index, as torch.argmax, at a block
    edge, across the threads' shares of the vocabulary, at either end and in the last partial
    block; and at every count of rows (each tiling of the product); NaN: the first one."""
    ties = TIES[:rows]
    x, weight = tied_weights(V_TIES, D, ties)
    top = head_kernels.top1(x, weight, threads=threads)
    assert top.tolist() == [min(t) for t in ties]
    assert torch.equal(top, argmax_of_written_logits(x, weight))
    x, weight = tied_weights(V_TIES, D, ties, nan=(120, 57, 190))
    assert head_kernels.top1(x, weight, threads=threads).tolist() == [57] * rows
    assert torch.equal(torch.tensor([57] * rows), argmax_of_written_logits(x, weight))


@torch.no_grad()
@pytest.mark.parametrize("V", [1, 15, 17, 200, 1000])
def test_the_fused_top1_over_any_vocabulary_and_past_one_calls_rows(V):
    """A vocabulary of one token, under a block, a block and one, not a multiple of the block;
    and more rows than one call takes (70: two calls): each the argmax of the written logits."""
    generator = torch.Generator().manual_seed(V)
    weight = torch.randn(V, D, generator=generator)
    x = torch.randn(70, D, generator=generator)
    weight[V - 1] = x[0] * 0.5          # row 0's top: the last token, in the last partial block
    for threads in (1, 2):
        top = head_kernels.top1(x, weight, threads=threads)
        assert top[0] == V - 1
        assert torch.equal(top, argmax_of_written_logits(x, weight))
