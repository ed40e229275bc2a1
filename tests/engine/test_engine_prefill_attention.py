"""A prompt's chunk through the paged C layer (cpu_kernels.c): one row's many tokens in one call
are attended as a group (attend_group: keys eight at a time outer and the chunk's tokens inner,
two tokens' scores from one read of each key, four tokens' sums of a 64-position value tile from
one read of each value), cut into one part a thread at equal work. The contiguous cache's
one-row path (attend_run) is the reference: every token's output, and every key and value the
call writes, must be bitwise that path's. Any slip a tiling can make (a causal mask one key too
long or short, a tile's sums given to the wrong token, a block edge or a 64-position tile edge
read one position off, a part of the chunk attended twice or not at all) changes bits."""

from __future__ import annotations

import pytest
import torch
from paged_pools import BLOCK, paged_copy, unpaged

from specpair import cpu_kernels
from specpair.paged_cache import PagedKVModel

D, H, KV_HEADS, HD, FFN = 128, 4, 2, 64, 256      # SmolLM2's head dimension: the fast paths run


def weights(gen: torch.Generator) -> list[torch.Tensor]:
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    return [r(H * HD, D) * 0.1, r(KV_HEADS * HD, D) * 0.1, r(KV_HEADS * HD, D) * 0.1,
            r(D, H * HD) * 0.1, r(FFN, D) * 0.1, r(FFN, D) * 0.1, r(D, FFN) * 0.1,
            1 + 0.1 * r(D), 1 + 0.1 * r(D)]


# (the prompt row's first position in the call, its tokens in the call): a chunk straddling
# block edges and the 64-position value tile edge from an odd start; a whole call (64 tokens, no
# other row) at a long prefix (several full value tiles and key tiles before it); a chunk of the
# fewest tokens that is grouped (16) from position 0; a short last chunk.
CHUNKS = [(37, 60), (203, 64), (0, 16), (261, 23)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("start,length", CHUNKS)
def test_a_prompt_chunk_is_bitwise_the_one_row_path(threads, start, length):
    """Row 0 prefills `length` prompt tokens from `start` beside row 1's decode token and row
    2's 3-token verification where the call has room (each row its own blocks, so the prompt's
    chunk is a group of its own): the paged call (prompt chunk grouped, cut per thread) against the contiguous one
    (every run through attend_run), outputs and written caches bitwise, and both the layer's
    arithmetic in plain torch."""
    assert cpu_kernels.available(), cpu_kernels.status()
    gen = torch.Generator().manual_seed(1000 * start + length + threads)
    w = weights(gen)
    S = 19 * BLOCK                                   # 304 positions a row
    kc, vc = torch.randn(3, KV_HEADS, S, HD, generator=gen), torch.randn(3, KV_HEADS, S, HD, generator=gen)
    pool_k, pool_v, table = paged_copy(kc, vc, gen)
    others = length + 4 <= cpu_kernels.MAX_TOKENS
    rows = [0] * length + ([1] + [2] * 3 if others else [])
    positions = list(range(start, start + length)) + ([150] + [40, 41, 42] if others else [])
    rows_t, pos_t = torch.tensor(rows), torch.tensor(positions)
    h = torch.randn(len(rows), D, generator=gen)
    cos, sin = torch.randn(len(rows), HD, generator=gen), torch.randn(len(rows), HD, generator=gen)
    common = dict(weights=w, eps=1e-5, heads=H, kv_heads=KV_HEADS, head_dim=HD)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        contiguous = cpu_kernels.llama_layer(h.clone(), rows_t, pos_t, cos, sin, kc, vc, **common)
        # working memory of NaNs: a token the paged call never attends keeps NaN (a fresh
        # torch.empty could hand back the contiguous call's memory, its outputs in place)
        scratch = cpu_kernels.layer_scratch(len(rows), D, H, KV_HEADS, HD, FFN,
                                            max(positions) + 1).fill_(float("nan"))
        paged = cpu_kernels.llama_layer(h.clone(), rows_t, pos_t, cos, sin, pool_k, pool_v,
                                        **common, table=table, scratch=scratch)
    finally:
        torch.set_num_threads(before)
    for i in range(len(rows)):
        assert torch.equal(paged[i], contiguous[i]), f"token {i} (row {rows[i]}, position {positions[i]})"
    assert torch.equal(unpaged(pool_k, table), kc) and torch.equal(unpaged(pool_v, table), vc)
    # the one-row path is itself the layer's arithmetic (a fault both paths shared shows here)
    from test_engine_paged_kernel import reference_layer
    expected = reference_layer(h, rows, positions, cos, sin, kc, vc, w, H, KV_HEADS, HD)
    torch.testing.assert_close(contiguous, expected, rtol=1e-4, atol=1e-4)


def test_a_prompt_prefilled_in_whole_calls_is_bitwise_the_prompt_fed_15_at_a_time(tiny_target):
    """The whole tiny model on the paged cache: a 150-token prompt in one extend (the cache cuts
    it into C calls of MAX_TOKENS (128) and 22 tokens, each a grouped chunk) against the same prompt fed
    15 tokens an extend (runs under PROMPT_RUN, 16: each through attend_run, the one-row path):
    the last position's logits, and the greedy tokens decoded after it from each cache, bitwise.
    (Logits at every position are not compared: a 150-row LM head is torch's product, a 15-row
    one the C kernel's, which round differently whatever the attention.)"""
    assert cpu_kernels.available(), cpu_kernels.status()
    model = tiny_target.model
    gen = torch.Generator().manual_seed(51)
    prompt = torch.randint(3, 300, (150,), generator=gen).tolist()
    whole, fed = PagedKVModel(model, blocks=16), PagedKVModel(model, blocks=16)
    for kv in (whole, fed):
        kv.add_rows(1)
    got = whole.extend([prompt])[0]
    for a in range(0, len(prompt), 15):
        expected = fed.extend([prompt[a:a + 15]])[0]
    assert torch.equal(got, expected)
    token = int(got[-1].argmax())
    for _ in range(4):                               # decoding reads what each prefill wrote
        a, b = whole.extend([[token]])[0], fed.extend([[token]])[0]
        assert torch.equal(a, b)
        token = int(a[-1].argmax())


@pytest.mark.parametrize("width", [64, 40])
def test_a_prompt_in_calls_of_max_tokens_is_bitwise_the_prompt_in_smaller_calls(tiny_target, monkeypatch,
                                                                                width):
    """Issue 51: a prompt's C calls take MAX_TOKENS (128) tokens, where they took 64. No token's
    keys, values or hidden state may depend on how many tokens share its call: a 300-token prompt
    in calls of 128 (128, 128, 44) against the same prompt in calls of `width` (64: the old calls;
    40: calls that end inside the products' 8-row passes and the attention's 16-token groups),
    every layer's keys and values bitwise, the last position's logits, and the greedy tokens
    decoded after from each cache."""
    from specpair import paged_cache

    assert cpu_kernels.available(), cpu_kernels.status()
    assert cpu_kernels.MAX_TOKENS == 128                 # the library's own (cpu_kernels.c)
    model = tiny_target.model
    prompt = torch.randint(3, 300, (300,), generator=torch.Generator().manual_seed(52)).tolist()
    big, small = PagedKVModel(model, blocks=24), PagedKVModel(model, blocks=24)
    for kv in (big, small):
        kv.add_rows(1)
    cut, sizes = paged_cache._calls, []

    def calls(tokens, parents, most):                    # the calls each extend made
        out = cut(tokens, parents, most)
        sizes.append([b - a for a, b in out])
        return out

    monkeypatch.setattr(paged_cache, "_calls", calls)
    got = big.extend([prompt])[0]
    monkeypatch.setattr(cpu_kernels, "MAX_TOKENS", width)
    expected = small.extend([prompt])[0]
    monkeypatch.setattr(cpu_kernels, "MAX_TOKENS", 128)
    assert sizes == [[128, 128, 44], [width] * (300 // width) + [300 % width]]
    assert torch.equal(got, expected)
    for layer, ((kb, vb), (ks, vs)) in enumerate(zip(big.caches, small.caches)):
        assert torch.equal(kb, ks) and torch.equal(vb, vs), f"layer {layer}'s keys or values"
    token = int(got[-1].argmax())
    for _ in range(4):                                   # decoding reads what each prefill wrote
        a, b = big.extend([[token]])[0], small.extend([[token]])[0]
        assert torch.equal(a, b)
        token = int(a[-1].argmax())
