"""The fixed-shape step: one decoder layer (`fixed_layer`) whose shapes depend only on the
bucket, never on the tokens.

On CUDA and in any dtype but float32 (`fixed_step_applies`) the cache runs fixed-shape steps
instead, gpt-fast's recipe: every step of a batch runs at one padded token count per row (the
token bucket: 1 without speculation, else the bucket of k+1 or the tree's size), over every row
of the cache (rows bucketed) and its whole capacity (capacity bucketed), under a mask built on
the device from the positions. One shape means one algorithm for every matrix product, so a
token's logits in a verification equal, bitwise, its logits in a one-token step at the same
bucket; attention takes each token's own key apart from the cache's (`attend`), so a tree's
sibling, written far from its position, sums its keys in the same order as a chain token there.
The step compiles (`fullgraph=True`) once per token bucket, rows and capacity symbolic
(`mark_sizes`), and on CUDA records a CUDA graph per (rows, capacity) bucket: what
`StaticKVModel.warm_up` does ahead of the first request.
"""

from __future__ import annotations

import torch
import torch._dynamo
import torch.nn.functional as F

from specpair.kv.compiling import compiled_function
from specpair.kv.ops import rms_norm


def fixed_step_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the cache runs fixed-shape steps (module docstring): on CUDA and in every dtype
    but float32, where the C layer (bitwise exact already, and faster on the CPU) does not run."""
    return device.type != "cpu" or dtype != torch.float32


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[-x2, x1] for x = [x1, x2] (Hugging Face's rotate_half) in the fixed step, as the halves
    swapped by an index remap and the first negated by a sign: the same values bitwise (a
    negation is exact). Written with a cat (`rotate_half_cat`), inductor gave the fixed step's
    layer two layout copies more at 2+ tokens a row than at one (532 kernels a SmolLM2 step
    against 442, measured on an H100); with the roll, 472 (docs/gpu.md)."""
    half = x.shape[-1] // 2
    sign = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    sign[:half] = -1
    return x.roll(half, -1) * sign


def mark_sizes(rows: int, inputs, caches=(), tables=()) -> None:
    """Compile the fixed step's layer over symbolic capacity (dimension 2 of each cache tensor)
    and rows (dimension 0 of every input and cache; above one row only, as dynamo specialises a
    size of 1): one compile then serves every bucket, and a CUDA graph is recorded per bucket's
    concrete shape (cheap) instead of inductor compiling each (minutes for 28 buckets). The
    cache's rows are the step's, or more (a prompt's step of some rows: its own size). A paged
    cache's pools never change shape; its block `tables` [rows, blocks] are symbolic instead."""
    for t in tables:
        torch._dynamo.maybe_mark_dynamic(t, 1)
        if t.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    for t in caches:
        torch._dynamo.maybe_mark_dynamic(t, 2)
        if t.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    if rows > 1:
        for t in inputs:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def attend(q, k_own, v_own, keys, values, positions, window: int | None = None):
    """Attention of q [B, H, W, D] to the cache's slots before each query's position (within a
    sliding `window` of positions, its own included, where given) and to its own key and value
    (k_own/v_own [B, Hkv, W, D]), taken apart: keys/values [B, Hkv, C, D], positions [B, W]. A chain token's earlier keys sit at the slots before its position, and so
    do a tree sibling's (its ancestors are chain tokens); only its own key is elsewhere. Summed
    apart, the own key enters every softmax and every product the same way wherever it was
    written, so a sibling's logits equal the one-token step's bitwise. Scores and softmax in
    float32, the products in the cache's dtype (as Hugging Face's eager attention)."""
    B, H, W, D = q.shape
    kv_heads, C = keys.shape[1], keys.shape[2]
    G = H // kv_heads                      # query heads per key/value head (grouped-query)
    scale = D ** -0.5
    grouped = q.reshape(B, kv_heads, G * W, D)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float().view(B, kv_heads, G, W, C)
    slots, at = torch.arange(C, device=q.device).view(1, 1, 1, 1, C), positions.view(B, 1, 1, W, 1)
    before = slots < at
    if window is not None:
        before = before & (slots > at - window)
    scores = scores.masked_fill(~before, float("-inf")) * scale
    own = (q.float().view(B, kv_heads, G, W, D) * k_own.float().unsqueeze(2)).sum(-1) * scale
    top = torch.maximum(scores.amax(-1), own)                 # finite: the own score always is
    e = torch.exp(scores - top.unsqueeze(-1))                 # 0 where masked
    e_own = torch.exp(own - top)
    total = e.sum(-1) + e_own
    p = (e / total.unsqueeze(-1)).to(values.dtype).view(B, kv_heads, G * W, C)
    out = (torch.matmul(p, values).float().view(B, kv_heads, G, W, D)
           + (e_own / total).unsqueeze(-1) * v_own.float().unsqueeze(2))
    return out.to(q.dtype).view(B, H, W, D)


def fixed_layer(h, cos, sin, rows, positions, slots, kc, vc, wqkv, wo, wgu, wd, n1, n2,
                 eps: float, heads: int, kv_heads: int, head_dim: int, kv_rows=None,
                 reach: int | None = None, bqkv=None, qn=None, kn=None,
                 window: int | None = None, table=None):
    """One decoder layer of the fixed step over [B, W] tokens: keys/values written at `slots`
    of the cache rows `rows` [B, W], attention by `attend` over the cache's rows 0..B-1 (or
    `kv_rows`) and its whole capacity (or its first `reach` slots: a prefill run apart).
    wqkv: q, k and v's weights joined; wgu: gate's and up's (`StaticLlama.fixed_weights`);
    bqkv: their biases joined (Qwen2); qn/kn: each head's q and k norms (Qwen3); window: a
    sliding window in positions (Mistral). table: the cache is paged (`paged_write_read`): kc/vc
    are a block pool and table [R, blocks] each cache row's block ids."""
    B, W, _ = h.shape
    x = rms_norm(h, n1, eps)
    q, k, v = F.linear(x, wqkv, bqkv).split([heads * head_dim, kv_heads * head_dim,
                                              kv_heads * head_dim], dim=-1)
    q = q.reshape(B, W, heads, head_dim)
    k = k.reshape(B, W, kv_heads, head_dim)
    if qn is not None:                    # over the head dimension, before the rotation
        q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.reshape(B, W, kv_heads, head_dim).transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    if table is not None:
        keys, values = paged_write_read(kc, vc, table, k, v, rows, slots, kv_rows, reach)
    else:
        kc[rows, :, slots] = k.transpose(1, 2)
        vc[rows, :, slots] = v.transpose(1, 2)
        keys, values = (kc, vc) if reach is None else (kc[:, :, :reach], vc[:, :, :reach])
        if kv_rows is not None:      # a copy of these rows' first `reach` slots, not their capacity
            keys, values = keys[kv_rows], values[kv_rows]
    att = attend(q, k, v, keys, values, positions, window)
    h = h + F.linear(att.transpose(1, 2).reshape(B, W, heads * head_dim), wo)
    x = rms_norm(h, n2, eps)
    gate, up = F.linear(x, wgu).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, wd)



def paged_write_read(kc, vc, table, k, v, rows, slots, kv_rows=None, reach: int | None = None):
    """The fixed layer's cache access through block tables (paged_fixed.py): write each token's
    key and value k/v [B, Hkv, W, D] at slot s of cache row r, in block table[r, s // block] at
    s % block of the pools kc/vc [blocks, Hkv, block, D]; -> the keys and values of the step's
    rows (rows 0..B-1 of `table`, or `kv_rows`) gathered from their blocks into the contiguous
    cache's shape, [B, Hkv, capacity, D] (or the first `reach` slots).

    Why gathered blocks and then the same masked math (`attend`), not a paged kernel or
    FlexAttention's block masks: the gathered tensor has the contiguous cache's shape and, at
    every slot a query attends, its values, so attention runs the same products in the same
    order: logits bitwise the contiguous cache's, and one shape per (rows, capacity) bucket, so a
    verification still equals one-token steps bitwise and a CUDA graph is recorded per bucket. A
    row's unused table entries name the pool's null block: memory follows each row's own length;
    the step's reads still span the bucket, as the contiguous step's do."""
    block = kc.shape[2]
    blocks = table[rows, slots // block]
    kc[blocks, :, slots % block] = k.transpose(1, 2)
    vc[blocks, :, slots % block] = v.transpose(1, 2)
    read = table if kv_rows is None else table[kv_rows]
    if reach is not None:
        read = read[:, :-(-reach // block)]
    B, n = read.shape
    keys = kc[read].transpose(1, 2).reshape(B, kc.shape[1], n * block, kc.shape[3])
    values = vc[read].transpose(1, 2).reshape(B, vc.shape[1], n * block, vc.shape[3])
    if reach is not None:
        keys, values = keys[:, :, :reach], values[:, :, :reach]
    return keys, values

def compiled_fixed_layer(device: torch.device):
    """`fixed_layer` compiled (compiled_function): every layer of every model runs through it
    (same code, other weights and shapes), so a cold start compiles one layer's graph (seconds),
    not a whole step unrolled over its layers (45-113 s per graph for SmolLM2 on an H100). What
    is lost is fusion across a layer's edge, one kernel a layer; the CUDA graph removes the
    calls' host cost."""
    return compiled_function(fixed_layer, device)
