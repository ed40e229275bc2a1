"""The C layer over a paged KV cache (cpu_kernels.c, kv_rows): one pool of fixed-size blocks, a
block table per row, blocks of a shared prefix referenced by several rows. A step through the
table must be bitwise the step over a contiguous cache holding the same keys and values: every
token's output and every key and value it writes, at batch 1, 8 and 32, for chains, verifications
and token trees, with rows stepping in any order and any subset (rows joining and leaving)."""

from __future__ import annotations

import pytest
import torch
from paged_pools import BLOCK, paged_copy, read_paged

from specpair import cpu_kernels
from specpair.kv.runner import StaticLlama


def layer_inputs(model, positions: torch.Tensor, gen: torch.Generator):
    runner = StaticLlama.of(model)
    layer = model.model.layers[0]
    T = positions.numel()
    h = torch.randn(T, model.config.hidden_size, generator=gen)
    cos, sin = model.model.rotary_emb(h.view(1, T, -1), positions.view(1, T))
    return runner, runner.layer_weights(layer), h, cos[0].contiguous(), sin[0].contiguous()


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("shape", ["decode", "verify", "tree"])
@pytest.mark.parametrize("sharing", ["all", "some"])
def test_a_paged_step_is_bitwise_the_contiguous_step(tiny_target, batch, shape, sharing):
    """Rows that begin at the same blocks are attended as one group (cpu_kernels.c,
    attend_group: each key read once for all of them); `some`: every third row holds its own
    copy of the prefix instead, so groups and lone rows mix in one step."""
    assert cpu_kernels.available(), cpu_kernels.status()
    model = tiny_target.model
    gen = torch.Generator().manual_seed(batch * 7 + len(shape))
    cfg = model.config
    kv_heads = cfg.num_key_value_heads
    hd = cfg.hidden_size // cfg.num_attention_heads
    S, shared = 8 * BLOCK, 2
    rows_in_cache = batch + 3                        # rows not stepped: others of the batch
    lengths = [int(n) for n in torch.randint(shared * BLOCK, S - 12, (rows_in_cache,), generator=gen)]
    kc = torch.randn(rows_in_cache, kv_heads, S, hd, generator=gen)
    vc = torch.randn(rows_in_cache, kv_heads, S, hd, generator=gen)
    kc[:, :, :shared * BLOCK] = kc[:1, :, :shared * BLOCK]   # the shared prefix, equal in every row
    vc[:, :, :shared * BLOCK] = vc[:1, :, :shared * BLOCK]
    pool_k, pool_v, table = paged_copy(kc, vc, gen, shared)
    if sharing == "some":
        for r in range(0, rows_in_cache, 3):
            own = torch.arange(pool_k.shape[0], pool_k.shape[0] + shared)
            pool_k = torch.cat([pool_k, pool_k[table[r, :shared]]])
            pool_v = torch.cat([pool_v, pool_v[table[r, :shared]]])
            table[r, :shared] = own

    # The rows that step, in an order of their own (a batch after rows joined and left).
    stepping = torch.randperm(rows_in_cache, generator=gen)[:batch].tolist()
    rows, positions, slots, parents = [], [], [], []
    for i, r in enumerate(stepping):
        # At 32 rows, within the C layer's 64 tokens: verifications of 2, every other row a tree
        # of 3 (a token and two alternatives after it), the rest decoding.
        n = {"decode": 1, "verify": 5 if batch < 32 else 2,
             "tree": 4 if batch < 32 else (3 if i % 2 else 1)}[shape]
        base = len(rows)
        for w in range(n):
            rows.append(r)
            if shape == "tree" and w == n - 1 and n > 1:   # a sibling of the token before it
                positions.append(lengths[r] + n - 2), slots.append(lengths[r] + n - 1)
                parents.append(base + n - 3 if n > 2 else -1)
            else:
                positions.append(lengths[r] + w), slots.append(lengths[r] + w)
                parents.append(-1 if w == 0 or shape != "tree" else base + w - 1)
    assert len(rows) <= cpu_kernels.MAX_TOKENS
    rows_t, pos_t = torch.tensor(rows), torch.tensor(positions)
    slots_t = torch.tensor(slots) if shape == "tree" else None
    parents_t = torch.tensor(parents) if shape == "tree" else None
    runner, weights, h, cos, sin = layer_inputs(model, pos_t, gen)
    common = dict(weights=weights, eps=runner.eps, heads=runner.heads, kv_heads=runner.kv_heads,
                  head_dim=runner.head_dim, slots=slots_t, parents=parents_t)

    contiguous = cpu_kernels.llama_layer(h.clone(), rows_t, pos_t, cos, sin, kc, vc, **common)
    paged = cpu_kernels.llama_layer(h.clone(), rows_t, pos_t, cos, sin, pool_k, pool_v, **common,
                                    table=table)
    assert torch.equal(paged, contiguous)
    for t, r in enumerate(rows):                    # what each token wrote, where it wrote it
        at = slots[t]
        assert torch.equal(read_paged(pool_k, table, r, at), kc[r, :, at])
        assert torch.equal(read_paged(pool_v, table, r, at), vc[r, :, at])
    # The shared prefix blocks were read by every row and written by none.
    for b in range(shared):
        assert torch.equal(pool_k[table[0, b]], kc[0, :, b * BLOCK:(b + 1) * BLOCK])


def test_a_table_that_does_not_cover_a_step_is_refused(tiny_target):
    cpu_kernels.available()
    model = tiny_target.model
    gen = torch.Generator().manual_seed(5)
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    pool = torch.zeros(4, cfg.num_key_value_heads, BLOCK, hd)
    pos = torch.tensor([2 * BLOCK])                  # needs a third block
    runner, weights, h, cos, sin = layer_inputs(model, pos, gen)
    common = dict(weights=weights, eps=runner.eps, heads=runner.heads, kv_heads=runner.kv_heads,
                  head_dim=runner.head_dim)
    with pytest.raises(RuntimeError, match="code -2"):           # the table is two blocks wide
        cpu_kernels.llama_layer(h, torch.tensor([0]), pos, cos, sin, pool, pool.clone(), **common,
                                table=torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="code -2"):           # a block the pool lacks
        cpu_kernels.llama_layer(h, torch.tensor([0]), pos, cos, sin, pool, pool.clone(), **common,
                                table=torch.tensor([[0, 1, 4]]))
    odd = torch.zeros(4, cfg.num_key_value_heads, 12, hd)        # blocks of 12: not a power of 2
    with pytest.raises(RuntimeError, match="code -4"):
        cpu_kernels.llama_layer(h, torch.tensor([0]), torch.tensor([3]), cos, sin, odd, odd.clone(),
                                **common, table=torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="int64"):
        cpu_kernels.llama_layer(h, torch.tensor([0]), pos, cos, sin, pool, pool.clone(), **common,
                                table=torch.tensor([[0, 1, 2]], dtype=torch.int32))


@pytest.mark.parametrize("batch", [8, 32])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_shared_prefix_at_head_dim_64_is_bitwise_the_contiguous_step(batch, threads):
    """SmolLM2's head dimension (64) over a prefix of many blocks that every row shares: the
    grouped kernel's fast paths run here and nowhere in the tiny model's steps (head dim 16,
    two shared blocks): scores eight keys at a time (dot8), two rows' sums of a 64-position tile
    from one load of each value (accumulate_values_pair, where both rows' tables name the same
    blocks), a group cut in one part per thread. Each must be bitwise the contiguous cache's
    one-row path (attend_run), with one thread and with two; a verification of 3 tokens and a
    row holding its own copy of the prefix mix in."""
    assert cpu_kernels.available(), cpu_kernels.status()
    gen = torch.Generator().manual_seed(batch + threads)
    D, H, kv_heads, hd, F_ = 128, 4, 2, 64, 256
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    weights = [r(H * hd, D) * 0.1, r(kv_heads * hd, D) * 0.1, r(kv_heads * hd, D) * 0.1,
               r(D, H * hd) * 0.1, r(F_, D) * 0.1, r(F_, D) * 0.1, r(D, F_) * 0.1,
               1 + 0.1 * r(D), 1 + 0.1 * r(D)]
    shared, S = 11, 14 * BLOCK                       # 176 shared positions: two full tiles
    kc, vc = r(batch, kv_heads, S, hd), r(batch, kv_heads, S, hd)
    kc[:, :, :shared * BLOCK] = kc[:1, :, :shared * BLOCK]
    vc[:, :, :shared * BLOCK] = vc[:1, :, :shared * BLOCK]
    lengths = [shared * BLOCK + int(n) for n in torch.randint(0, 2 * BLOCK, (batch,), generator=gen)]
    pool_k, pool_v, table = paged_copy(kc, vc, gen, shared)
    own = torch.arange(pool_k.shape[0], pool_k.shape[0] + shared)     # row 3: its own copy
    pool_k = torch.cat([pool_k, pool_k[table[3, :shared]]])
    pool_v = torch.cat([pool_v, pool_v[table[3, :shared]]])
    table[3, :shared] = own
    rows, positions = [], []
    for i in range(batch):
        for w in range(3 if i == 1 else 1):          # row 1 verifies 3 tokens
            rows.append(i), positions.append(lengths[i] + w)
    rows_t, pos_t = torch.tensor(rows), torch.tensor(positions)
    h, cos, sin = r(len(rows), D), r(len(rows), hd), r(len(rows), hd)
    common = dict(weights=weights, eps=1e-5, heads=H, kv_heads=kv_heads, head_dim=hd)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        contiguous = cpu_kernels.llama_layer(h.clone(), rows_t, pos_t, cos, sin, kc, vc, **common)
        paged = cpu_kernels.llama_layer(h.clone(), rows_t, pos_t, cos, sin, pool_k, pool_v,
                                        **common, table=table)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(paged, contiguous)
    # and both are the layer's arithmetic (a fault in a part both paths share shows here)
    expected = reference_layer(h, rows, positions, cos, sin, kc, vc, weights, H, kv_heads, hd)
    torch.testing.assert_close(contiguous, expected, rtol=1e-4, atol=1e-4)


def test_rows_sharing_prefix_blocks_are_each_bitwise_the_row_alone():
    """Ten rows whose tables name the same 11 prefix blocks (176 positions), each with its own
    query and its own tail: the grouped kernel scores two rows' queries from one read of each
    eight keys (dot8_pair) and sums four rows' values from one read of each value
    (accumulate_values_quad). Each row's output must be bitwise that row stepped alone (one
    row: attend_run, no grouping): a sum or a score given to the wrong row of its group, or
    two rows' sums mixed, changes that row's output."""
    assert cpu_kernels.available(), cpu_kernels.status()
    gen = torch.Generator().manual_seed(51)
    batch, D, H, kv_heads, hd, F_ = 10, 128, 4, 2, 64, 256
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    weights = [r(H * hd, D) * 0.1, r(kv_heads * hd, D) * 0.1, r(kv_heads * hd, D) * 0.1,
               r(D, H * hd) * 0.1, r(F_, D) * 0.1, r(F_, D) * 0.1, r(D, F_) * 0.1,
               1 + 0.1 * r(D), 1 + 0.1 * r(D)]
    shared, S = 11, 14 * BLOCK
    kc, vc = r(batch, kv_heads, S, hd), r(batch, kv_heads, S, hd)
    kc[:, :, :shared * BLOCK] = kc[:1, :, :shared * BLOCK]
    vc[:, :, :shared * BLOCK] = vc[:1, :, :shared * BLOCK]
    lengths = [shared * BLOCK + int(n) for n in torch.randint(0, 2 * BLOCK, (batch,), generator=gen)]
    pool_k, pool_v, table = paged_copy(kc, vc, gen, shared)
    rows, pos = torch.arange(batch), torch.tensor(lengths)
    h, cos, sin = r(batch, D), r(batch, hd), r(batch, hd)
    common = dict(weights=weights, eps=1e-5, heads=H, kv_heads=kv_heads, head_dim=hd)
    before = torch.get_num_threads()
    torch.set_num_threads(1)                         # one group: every row in one attend_group
    try:
        together = cpu_kernels.llama_layer(h.clone(), rows, pos, cos, sin, pool_k, pool_v,
                                           **common, table=table)
        alone = [cpu_kernels.llama_layer(h[i:i + 1].clone(), rows[i:i + 1], pos[i:i + 1],
                                         cos[i:i + 1], sin[i:i + 1], pool_k, pool_v, **common,
                                         table=table)
                 for i in range(batch)]
    finally:
        torch.set_num_threads(before)
    for i in range(batch):
        assert torch.equal(together[i], alone[i][0]), f"row {i} differs from itself alone"
    # the rows differ from each other (a mix-up could not hide behind equal rows)
    assert not torch.equal(together[0], together[1])


def reference_layer(h, rows, positions, cos, sin, kc, vc, weights, H, kv_heads, hd, eps=1e-5):
    """The Llama layer in plain torch over the contiguous cache as the kernel left it (each
    token's key and value written at its position), token by token."""
    wq, wk, wv, wo, wg, wu, wd, n1, n2 = weights
    norm = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731

    def rope(x):                                   # [heads, hd], Hugging Face's half split
        half = hd // 2
        rotated = torch.cat([-x[:, half:], x[:, :half]], dim=-1)
        return x * cos[t] + rotated * sin[t]

    out = []
    for t, (r, p) in enumerate(zip(rows, positions)):
        x = norm(h[t], n1)
        q = rope((x @ wq.T).view(H, hd))
        keys, values = kc[r, :, :p + 1], vc[r, :, :p + 1]    # [kv heads, p + 1, hd]
        group = H // kv_heads
        att = torch.stack([torch.softmax(keys[j // group] @ q[j] / hd ** 0.5, -1)
                           @ values[j // group] for j in range(H)]).reshape(-1)
        y = h[t] + att @ wo.T
        z = norm(y, n2)
        out.append(y + (torch.nn.functional.silu(z @ wg.T) * (z @ wu.T)) @ wd.T)
    return torch.stack(out)
