"""The general torch step over a preallocated cache: one decoder layer under a boolean mask
(`layer_step`), for prompts, large batches and token trees the fixed step does not take, on the
CPU beside the C layer (cpu_kernels.c). `torch.compile` can compile it with dynamic shapes
(`compiled_step`, SPECPAIR_COMPILE=on; on the 2-core CPU it measured slower than the C layer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpair import cpu_kernels
from specpair.kv.ops import rms_norm


def rotate_half_cat(x: torch.Tensor) -> torch.Tensor:
    """The same values as `_rotate_half`, bitwise, written as Hugging Face writes them (a cat):
    the general step's (`layer_step`, compiled on the CPU). Inductor's C++ backend compiles the
    roll's index arithmetic slower: the CPU compile test took 132.7 s on a cold cache with the
    roll against 81.7-91.3 s with the cat, and the CPU step is not bound by its kernel count."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def layer_step(h, cos, sin, mask, rows, positions, kc, vc, wq, wk, wv, wo, wg, wu, wd, n1, n2,
                eps: float, heads: int, kv_heads: int, head_dim: int, kv_rows=None,
                bq=None, bk=None, bv=None, qn=None, kn=None):
    """One decoder layer over [B, W] tokens; writes their keys/values into kc/vc [B*, Hkv, S, D].
    The tokens belong to the cache's rows 0..B-1, or to `kv_rows` [B] when given. bq/bk/bv: q, k
    and v's biases (Qwen2); qn/kn: the norms of each head's q and k (Qwen3); a sliding window is
    in `mask`."""
    B, W, _ = h.shape
    x = rms_norm(h, n1, eps)
    q, k, v = cpu_kernels.linears(x, wq, wk, wv)
    if bq is not None:
        q, k, v = q + bq, k + bk, v + bv
    q = q.view(B, W, heads, head_dim)
    k = k.view(B, W, kv_heads, head_dim)
    if qn is not None:                    # over the head dimension, before the rotation
        q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.view(B, W, kv_heads, head_dim)
    q = q * cos + rotate_half_cat(q) * sin
    k = k * cos + rotate_half_cat(k) * sin
    kc[rows, :, positions] = k.transpose(1, 2)
    vc[rows, :, positions] = v
    L = mask.shape[-1]
    keys, values = ((kc[:B, :, :L], vc[:B, :, :L]) if kv_rows is None else
                    (kc[kv_rows, :, :L], vc[kv_rows, :, :L]))
    # A branch, not enable_gqa=heads != kv_heads: compiled with dynamic=True the head counts are
    # symbolic, SDPA takes only a Python bool there, and the SymBool broke the graph in two
    # (every compile twice over); a branch on it is guarded once and stays in the graph.
    if heads != kv_heads:
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    else:
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    h = h + cpu_kernels.linear(att.transpose(1, 2).reshape(B, W, heads * head_dim), wo)
    x = rms_norm(h, n2, eps)
    gate, up = cpu_kernels.linears(x, wg, wu)
    return h + cpu_kernels.linear(F.silu(gate) * up, wd)


_compiled_layer_step = None


def compiled_step():
    """The layer step compiled once for every layer (same shapes, different weights) and every
    (rows, tokens, cache length) (dynamic shapes): one compile, not one per k and batch size."""
    global _compiled_layer_step
    if _compiled_layer_step is None:
        _compiled_layer_step = torch.compile(layer_step, dynamic=True)
    return _compiled_layer_step
