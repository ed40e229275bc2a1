"""A preallocated KV cache written in place, and the Llama step that reads and writes it.

Each batch row owns a row of the cache and a length. A step writes its tokens' keys and values
at positions length..length+n of that row and attends, under a causal mask over positions, to
everything before them; rejecting drafts only moves the length back, so whatever was written past
it is never seen again and is overwritten by the next step (gpt-fast's design). Nothing is
gathered, cropped or compacted, and the step's shapes depend only on (rows, tokens per row, cache
length), which is what lets `torch.compile` specialise it.

Rows are left-aligned: row i's n_i new tokens fill slots 0..n_i-1 and its pad slots continue the
row's positions past its end (harmless writes past the length, invisible to every real query).
Rows of very different widths (a request joining running rows with its whole prompt) run as
separate forwards, each padded only to its own widest row (`width_groups`).

The forward is written here over the Hugging Face model's own parameters (nothing is copied) for
Llama's decoder layer and the families that differ from it only inside attention (STATIC_FAMILIES:
Llama 2/3, SmolLM2, TinyLlama; Mistral; Qwen2/2.5 with q/k/v biases; Qwen3 with per-head q/k
norms; sliding windows in the mask); `supports()` says why another architecture is not, and the
engine then uses kv_cache.BatchedKVModel (`check_static_step`). Two ways through a layer:
- on the CPU in float32, a step of at most 64 tokens (decode and verify up to batch 64): one
  call per layer into cpu_kernels.c, whose per-token arithmetic does not depend on the other
  tokens, so a token's logits are bitwise the same in a decode step and in a verification;
- otherwise (prefill, large batches, or compiled on the CPU in float32): the torch operations of
  `_layer_step`, which `torch.compile` can compile (SPECPAIR_COMPILE=on; on this 2-core CPU it
  measured slower than the C layer, see README).

On CUDA and in any dtype but float32 (`fixed_step_applies`) the cache runs fixed-shape steps
instead, gpt-fast's recipe: every step of a batch runs at one padded token count per row (the
token bucket: 1 without speculation, else the bucket of k+1 or the tree's size), over every row
of the cache (rows bucketed) and its whole capacity (capacity bucketed), under a mask built on
the device from the positions. One shape means one algorithm for every matrix product, so a
token's logits in a verification equal, bitwise, its logits in a one-token step at the same
bucket; attention takes each token's own key apart from the cache's (`_attend`), so a tree's
sibling, written far from its position, sums its keys in the same order as a chain token there.
The step compiles (`fullgraph=True`) once per token bucket, rows and capacity symbolic
(`_mark_sizes`), and on CUDA records a CUDA graph per (rows, capacity) bucket: what
`StaticKVModel.warm_up` does ahead of the first request.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref

import torch
import torch._dynamo
import torch.nn.functional as F

from specpair import cpu_kernels
from specpair.errors import SpecpairError

log = logging.getLogger(__name__)

KV_KINDS = ("static", "dynamic")
COMPILE_MODES = ("off", "on")
INITIAL_POSITIONS = 256      # the smallest capacity bucket, in positions per row
# A capacity (rows or positions) shrinks once what live rows need falls to this fraction of it,
# to twice the bucket they need: far enough from the growth point that a row joining and
# leaving at a bucket's edge does not reallocate the cache every step.
SHRINK_BELOW = 4
# Prompts run as one fixed step of their own rows (`StaticKVModel._prefill_step`, recorded as a
# CUDA graph) while their rows times their bucket stays within this many tokens; longer ones are
# compute-bound and run eagerly, attending only the slots they reach.
PREFILL_STEP_TOKENS = 1024


def bucket(n: int, floor: int = 1) -> int:
    """The bucket holding n: the smallest power of two >= n and >= floor. Rows, tokens per row
    and capacity are all bucketed so (one home for the bucket sizes); a step's shape is then
    one of a few, each compiled (and on CUDA captured) once."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


def fixed_step_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the cache runs fixed-shape steps (module docstring): on CUDA and in every dtype
    but float32, where the C layer (bitwise exact already, and faster on the CPU) does not run."""
    return device.type != "cpu" or dtype != torch.float32


def compile_options(device: torch.device) -> dict:
    """torch.compile's settings for the fixed step's layer: inductor, or SPECPAIR_COMPILE_BACKEND
    (the tests use aot_eager: the same graphs and guards without inductor's minutes on 2 cores).
    No mode="reduce-overhead": on CUDA the engine records the whole step as one CUDA graph itself
    (`CapturedStep`), which replays without dynamo's guards or the graph trees' bookkeeping, the
    0.9-1.1 ms a call that reduce-overhead cost on every shape (docs/gpu.md)."""
    return {"backend": os.environ.get("SPECPAIR_COMPILE_BACKEND") or "inductor"}


def attention_description(device: torch.device, dtype: torch.dtype) -> str:
    """What attends in a step, chosen on purpose: the fixed step's masked math (`_attend`) on
    CUDA and outside float32, never SDPA's cuDNN backend, which builds a plan per call when the
    attended length changes; torch's SDPA elsewhere (the C layer where it applies)."""
    if fixed_step_applies(device, dtype):
        return "masked math over the capacity bucket, own key apart (bitwise across token counts)"
    return (f"C layer (float32 CPU, <= {cpu_kernels.MAX_TOKENS or 64} tokens), else torch SDPA "
            "with a boolean mask")


def resolve_kv_kind(kind: str | None = None) -> str:
    """The cache kind asked for, else SPECPAIR_KV, else static. "dynamic" is the eager fallback
    switch: the hole-masking cache and Hugging Face's own forward, as before this module."""
    kind = kind or os.environ.get("SPECPAIR_KV") or "static"
    if kind not in KV_KINDS:
        raise SpecpairError(f"KV cache kind {kind!r}: choose one of {', '.join(KV_KINDS)}")
    return kind


def resolve_compile(mode: str | None = None, device: torch.device | None = None) -> str:
    """Whether the static step is compiled: asked for, else SPECPAIR_COMPILE, else on for CUDA
    (CUDA graphs: 2.17 ms a SmolLM2 step on an H100 where the eager step took 38 ms; docs/gpu.md)
    and off elsewhere (on this 2-core CPU the compiled step measured slower than the eager one)."""
    default = "on" if device is not None and torch.device(device).type == "cuda" else "off"
    mode = mode or os.environ.get("SPECPAIR_COMPILE") or default
    if mode not in COMPILE_MODES:
        raise SpecpairError(f"compile mode {mode!r}: choose one of {', '.join(COMPILE_MODES)}")
    return mode


def cuda_graphs_wanted() -> bool:
    """Whether a compiled fixed step on CUDA replays recorded graphs (`CapturedStep`): yes unless
    SPECPAIR_CUDA_GRAPHS=off, which runs the same compiled layers call by call (a way to tell a
    fault in recording from one in the step)."""
    value = os.environ.get("SPECPAIR_CUDA_GRAPHS", "on")
    if value not in ("on", "off"):
        raise SpecpairError(f"SPECPAIR_CUDA_GRAPHS={value!r}: choose on or off")
    return value == "on"


# The model types whose decoder layer is Llama's but for options inside attention, each read
# from the model's own modules (StaticLlama.layer_options): Qwen2's q/k/v biases, Qwen3's RMSNorm
# over each head's q and k before the rotary embedding, Mistral's and Qwen's sliding windows
# (layer_windows). Their attention scales by head_dim ** -0.5 and their rotary embedding is the
# model's own module, as Llama's.
STATIC_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LAYER_TYPES = ("full_attention", "sliding_attention")


def supports(model) -> str | None:
    """None when the static step can run this model; otherwise why not."""
    cfg = model.config
    family = getattr(cfg, "model_type", None)
    if family not in STATIC_FAMILIES:
        return f"model_type {family!r} (the static step runs {', '.join(STATIC_FAMILIES)})"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    body = getattr(model, "model", None)
    if not hasattr(body, "rotary_emb"):
        return "no rotary embedding module"
    other = sorted(set(getattr(cfg, "layer_types", None) or ()) - set(LAYER_TYPES))
    if other:
        return f"layer types {other} (the static step runs {', '.join(LAYER_TYPES)})"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        return f"sliding_window {window!r}"
    for layer in body.layers:
        if getattr(layer.self_attn.o_proj, "bias", None) is not None:
            return "a bias on attention's output projection (attention_bias)"
    return None


def layer_windows(config, layers: int) -> list[int | None]:
    """Each layer's sliding window in positions (None: full attention), as each family's
    attention reads it: Mistral's sliding_window in every layer; Qwen2/3's in the layers their
    layer_types marks sliding (their configs set sliding_window only with use_sliding_window). A
    token at position p then attends positions p-window+1..p (Hugging Face's
    sliding_window_overlay)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * layers
    if getattr(config, "model_type", None) == "mistral":
        return [window] * layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    return [window if kind == "sliding_attention" else None for kind in types]


def check_static_step(model, kind: str | None = None) -> str | None:
    """Whether `model` runs the static step under the cache kind asked for (`kind`, else
    SPECPAIR_KV, else static): None when it does, or where the dynamic cache was asked for.
    Otherwise the static cache asked for by name (`kind` or SPECPAIR_KV) is refused with the
    reason, and by default the general path (kv_cache.BatchedKVModel, Hugging Face's forward,
    3x slower a step on the CPU) serves it, said in one log line; -> the reason."""
    if resolve_kv_kind(kind) != "static":
        return None
    why = supports(model)
    if why is None:
        return None
    if (kind or os.environ.get("SPECPAIR_KV")) == "static":
        raise SpecpairError(f"the static KV cache (--kv static) cannot run this model: {why}; "
                            "--kv dynamic serves it through Hugging Face's forward")
    log.warning("the static step cannot run %s: %s; served by the general path (Hugging Face's "
                "forward, kv_cache.BatchedKVModel)", getattr(model.config, "model_type", "?"), why)
    return why


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As Hugging Face's LlamaRMSNorm: statistics in float32, scaled in the input dtype.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[-x2, x1] for x = [x1, x2] (Hugging Face's rotate_half) in the fixed step, as the halves
    swapped by an index remap and the first negated by a sign: the same values bitwise (a
    negation is exact). Written with a cat (`_rotate_half_cat`), inductor gave the fixed step's
    layer two layout copies more at 2+ tokens a row than at one (532 kernels a SmolLM2 step
    against 442, measured on an H100); with the roll, 472 (docs/gpu.md)."""
    half = x.shape[-1] // 2
    sign = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    sign[:half] = -1
    return x.roll(half, -1) * sign


def _rotate_half_cat(x: torch.Tensor) -> torch.Tensor:
    """The same values as `_rotate_half`, bitwise, written as Hugging Face writes them (a cat):
    the general step's (`_layer_step`, compiled on the CPU). Inductor's C++ backend compiles the
    roll's index arithmetic slower: the CPU compile test took 132.7 s on a cold cache with the
    roll against 81.7-91.3 s with the cat, and the CPU step is not bound by its kernel count."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _layer_step(h, cos, sin, mask, rows, positions, kc, vc, wq, wk, wv, wo, wg, wu, wd, n1, n2,
                eps: float, heads: int, kv_heads: int, head_dim: int, kv_rows=None,
                bq=None, bk=None, bv=None, qn=None, kn=None):
    """One decoder layer over [B, W] tokens; writes their keys/values into kc/vc [B*, Hkv, S, D].
    The tokens belong to the cache's rows 0..B-1, or to `kv_rows` [B] when given. bq/bk/bv: q, k
    and v's biases (Qwen2); qn/kn: the norms of each head's q and k (Qwen3); a sliding window is
    in `mask`."""
    B, W, _ = h.shape
    x = _rms_norm(h, n1, eps)
    q, k, v = cpu_kernels.linears(x, wq, wk, wv)
    if bq is not None:
        q, k, v = q + bq, k + bk, v + bv
    q = q.view(B, W, heads, head_dim)
    k = k.view(B, W, kv_heads, head_dim)
    if qn is not None:                    # over the head dimension, before the rotation
        q, k = _rms_norm(q, qn, eps), _rms_norm(k, kn, eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.view(B, W, kv_heads, head_dim)
    q = q * cos + _rotate_half_cat(q) * sin
    k = k * cos + _rotate_half_cat(k) * sin
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
    x = _rms_norm(h, n2, eps)
    gate, up = cpu_kernels.linears(x, wg, wu)
    return h + cpu_kernels.linear(F.silu(gate) * up, wd)


def _mark_sizes(rows: int, inputs, caches=()) -> None:
    """Compile the fixed step's layer over symbolic capacity (dimension 2 of each cache tensor)
    and rows (dimension 0 of every input and cache; above one row only, as dynamo specialises a
    size of 1): one compile then serves every bucket, and a CUDA graph is recorded per bucket's
    concrete shape (cheap) instead of inductor compiling each (minutes for 28 buckets). The
    cache's rows are the step's, or more (a prompt's step of some rows: its own size)."""
    for t in caches:
        torch._dynamo.maybe_mark_dynamic(t, 2)
        if t.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    if rows > 1:
        for t in inputs:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def _attend(q, k_own, v_own, keys, values, positions, window: int | None = None):
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


def _fixed_layer(h, cos, sin, rows, positions, slots, kc, vc, wqkv, wo, wgu, wd, n1, n2,
                 eps: float, heads: int, kv_heads: int, head_dim: int, kv_rows=None,
                 reach: int | None = None, bqkv=None, qn=None, kn=None,
                 window: int | None = None):
    """One decoder layer of the fixed step over [B, W] tokens: keys/values written at `slots`
    of the cache rows `rows` [B, W], attention by `_attend` over the cache's rows 0..B-1 (or
    `kv_rows`) and its whole capacity (or its first `reach` slots: a prefill run apart).
    wqkv: q, k and v's weights joined; wgu: gate's and up's (`StaticLlama.fixed_weights`);
    bqkv: their biases joined (Qwen2); qn/kn: each head's q and k norms (Qwen3); window: a
    sliding window in positions (Mistral)."""
    B, W, _ = h.shape
    x = _rms_norm(h, n1, eps)
    q, k, v = F.linear(x, wqkv, bqkv).split([heads * head_dim, kv_heads * head_dim,
                                              kv_heads * head_dim], dim=-1)
    q = q.reshape(B, W, heads, head_dim)
    k = k.reshape(B, W, kv_heads, head_dim)
    if qn is not None:                    # over the head dimension, before the rotation
        q, k = _rms_norm(q, qn, eps), _rms_norm(k, kn, eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.reshape(B, W, kv_heads, head_dim).transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    kc[rows, :, slots] = k.transpose(1, 2)
    vc[rows, :, slots] = v.transpose(1, 2)
    keys, values = (kc, vc) if reach is None else (kc[:, :, :reach], vc[:, :, :reach])
    if kv_rows is not None:      # a copy of these rows' first `reach` slots, not their capacity
        keys, values = keys[kv_rows], values[kv_rows]
    att = _attend(q, k, v, keys, values, positions, window)
    h = h + F.linear(att.transpose(1, 2).reshape(B, W, heads * head_dim), wo)
    x = _rms_norm(h, n2, eps)
    gate, up = F.linear(x, wgu).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, wd)


def _join_biases(*linears) -> torch.Tensor | None:
    """The biases of these linear layers joined as `_join` joins their weights (each bias made a
    view into it), or None where none has one (zeros stand in for a missing one)."""
    if all(linear.bias is None for linear in linears):
        return None
    joined = torch.cat([linear.weight.new_zeros(linear.weight.shape[0]) if linear.bias is None
                        else linear.bias.detach() for linear in linears])
    at = 0
    for linear in linears:
        n = linear.weight.shape[0]
        if linear.bias is not None:
            linear.bias.data = joined[at:at + n]
        at += n
    return joined


def _join(*linears) -> torch.Tensor:
    """The weights of these linear layers stacked into one matrix, and each layer's weight made a
    view into it: one product instead of several, and no second copy of the weights (Hugging
    Face's forward and the CPU layer read the views). Views already joined are joined again
    (one copy, the old matrix freed)."""
    joined = torch.cat([linear.weight.detach() for linear in linears])
    at = 0
    for linear in linears:
        n = linear.weight.shape[0]
        linear.weight.data = joined[at:at + n]
        at += n
    return joined


_compiled_layer_step = None
_compiled_functions: dict = {}


def compiled_function(function, device: torch.device):
    """`function` compiled with fullgraph=True (compile_options), once per process and device
    type (the fixed step's layer, Medusa's heads)."""
    key = (function, torch.device(device).type)
    if key not in _compiled_functions:
        # A few graphs per model and token bucket (one row, several rows: _mark_sizes), each
        # model one more entry: past dynamo's default of 8 in a server with a target, a draft
        # and a head.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        use_compile_cache()
        _compiled_functions[key] = torch.compile(function, fullgraph=True,
                                                 **compile_options(torch.device(key[1])))
    return _compiled_functions[key]


def compiled_fixed_layer(device: torch.device):
    """`_fixed_layer` compiled (compiled_function): every layer of every model runs through it
    (same code, other weights and shapes), so a cold start compiles one layer's graph (seconds),
    not a whole step unrolled over its layers (45-113 s per graph for SmolLM2 on an H100). What
    is lost is fusion across a layer's edge, one kernel a layer; the CUDA graph removes the
    calls' host cost."""
    return compiled_function(_fixed_layer, device)


def _compiled_step():
    """The layer step compiled once for every layer (same shapes, different weights) and every
    (rows, tokens, cache length) (dynamic shapes): one compile, not one per k and batch size."""
    global _compiled_layer_step
    if _compiled_layer_step is None:
        _compiled_layer_step = torch.compile(_layer_step, dynamic=True)
    return _compiled_layer_step


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on the device in one copy: through pinned memory and without waiting
    on CUDA (the copy is ordered on the stream before the step that reads it), as is elsewhere."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def use_compile_cache() -> None:
    """Keep inductor's compiled kernels in the model cache (SPECPAIR_CACHE/inductor) unless
    TORCHINDUCTOR_CACHE_DIR says otherwise: a cold compile of the fixed step took 147 s on an
    H100 and a warm one 30 s (docs/gpu.md), so an engine restarted on the same volume starts warm.
    A cache it cannot write (a read-only volume) is left to inductor's default under /tmp."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return
    from specpair.models import cache_root

    folder = cache_root() / "inductor"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    if os.access(folder, os.W_OK):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


class CapturedGraph:
    """A step over static device buffers recorded once as a CUDA graph: a replay is one launch,
    no dynamo guards, no Python per layer. The outputs are the graph's own buffers, overwritten
    by the next replay: callers copy what they keep. `state`: input buffers the step itself
    updates in place (a drafting head's next token, feature and position): the run before
    recording changes them, so they are put back after it, and the first replay computes what
    that run did (its cache writes are the same writes again)."""

    def __init__(self, device: torch.device, step, state=()):
        saved = [t.clone() for t in state]
        # Run once outside the graph first (compiles the layer for this shape if it has not
        # been, and lets cuBLAS and the allocator set up): capture may not allocate lazily. The
        # run is a real step on these inputs: recording only records, and the replay that
        # follows writes the same keys and values again. Both on a side stream, as capture
        # needs; capture_begin/end directly, not torch.cuda.graph(), whose gc.collect() and
        # empty_cache() per recording cost more than the recording.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        self.graph = torch.cuda.CUDAGraph()
        # No garbage collection while recording: a collection that frees another graph (a
        # released cache's) destroys it mid-capture, which CUDA forbids, and the recording is
        # lost ("operation not permitted when stream is capturing", seen on an H100 with old
        # engines' graphs awaiting collection). torch.cuda.graph() collects before each recording
        # instead, which costs more than the recording.
        collecting = gc.isenabled()
        try:
            with torch.cuda.stream(side):
                step()
                gc.disable()
                # thread_local: the server's other threads may touch CUDA while this one records.
                self.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.outputs = step()
                finally:
                    self.graph.capture_end()
        finally:          # (a failed recording too: the step then runs uncaptured from them)
            if collecting:
                gc.enable()
            torch.cuda.current_stream(device).wait_stream(side)
            for t, before in zip(state, saved):
                t.copy_(before)

    def replay(self):
        self.graph.replay()
        return self.outputs


class CapturedStep(CapturedGraph):
    """The fixed step recorded once as a CUDA graph at one (rows, tokens) shape over one cache's
    tensors (its capacity is theirs). A call copies the step's ids, positions and slots into the
    graph's own input buffer (one copy from pinned memory) and replays it. A new cache (grown or
    shrunk) gets new graphs (`StaticKVModel._allocate`): recording one costs a few replays."""

    def __init__(self, runner: "StaticLlama", host: torch.Tensor, caches, compiled: bool,
                 head: bool = True):
        device = runner.device
        self.inputs = torch.empty(host.shape, dtype=torch.long, device=device)
        self.inputs.copy_(host)
        self.pinned = torch.empty(host.shape, dtype=torch.long, pin_memory=True)
        self.copied = torch.cuda.Event()
        ids, positions, slots = self.inputs[:3]
        # A fourth plane: the cache row of each step row (a prompt's step, run apart).
        kv_rows = self.inputs[3, :, 0] if host.shape[0] == 4 else None

        def step():
            return runner.fixed_step(ids, positions, slots, caches, compiled=compiled, head=head,
                                     kv_rows=kv_rows)

        super().__init__(device, step)

    def __call__(self, host: torch.Tensor):
        # Through a pinned buffer of its own (pinning a new tensor every step cost ~30 us); the
        # event keeps the next call from overwriting it before this copy has left.
        self.copied.synchronize()           # at once when never recorded
        self.pinned.copy_(host)
        self.inputs.copy_(self.pinned, non_blocking=True)
        self.copied.record()
        return self.replay()


def capture_graph(owner, step, state=()) -> CapturedGraph | None:
    """`step`, a function of device buffers, recorded as a CUDA graph (CapturedGraph, `state` as
    there) where `owner` records graphs (its `captures_graphs`, on its `device`); None where it
    does not, or where recording fails: reported once in the owner's `capture_error`, and its
    steps run uncaptured from then on. The owner's `recorded` counts graphs and seconds."""
    if not (owner.captures_graphs and owner.capture_error is None):
        return None
    started = time.perf_counter()
    try:
        graph = CapturedGraph(owner.device, step, state)
    except Exception as exc:     # noqa: BLE001 - any capture failure: run uncaptured
        owner.capture_error = f"{type(exc).__name__}: {exc}"
        log.warning("CUDA graph capture failed, the step runs uncaptured: %s", owner.capture_error)
        return None
    owner.recorded["graphs"] += 1
    owner.recorded["seconds"] += time.perf_counter() - started
    return graph


class StepGraphs:
    """Steps kept by key with the CUDA graphs recorded of them (`capture_graph`), for steps that
    read no cache (Medusa's heads): one per model, shared by every batch that runs it."""

    def __init__(self, device: torch.device, captures_graphs: bool):
        self.device, self.captures_graphs = device, captures_graphs
        self.capture_error: str | None = None
        self.recorded = {"graphs": 0, "seconds": 0.0}
        self.steps: dict = {}

    def capture(self, step, state=()) -> CapturedGraph | None:
        return capture_graph(self, step, state)


class CacheShelf:
    """One model's most recently released small cache, kept with the CUDA graphs recorded over it,
    for the next batch that needs that shape. Every `generate()` is a batch of its own (the bench,
    the gate, the CLI), and a fresh cache records fresh graphs: measured on an H100, recording at
    every request was most of the loop's host time for SmolLM2 (docs/gpu.md). Only small caches
    are kept (KEEP_ROWS rows, KEEP_POSITIONS positions: one-request batches) and only one, so
    memory still follows live rows; a kept cache holds stale keys, which no row ever attends (a
    row attends only the slots before its positions, all written by itself)."""

    KEEP_ROWS = 2
    KEEP_POSITIONS = 2 * INITIAL_POSITIONS

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: tuple | None = None        # (shape, caches, graphs)

    def take(self, shape: tuple) -> tuple | None:
        with self._lock:
            if self._kept is not None and self._kept[0] == shape:
                kept, self._kept = self._kept, None
                return kept[1], kept[2]
        return None

    def give(self, shape: tuple, caches, graphs) -> None:
        if caches and shape[0] <= self.KEEP_ROWS and shape[2] <= self.KEEP_POSITIONS:
            with self._lock:
                self._kept = (shape, caches, graphs)


class CacheLease:
    """The cache a StaticKVModel holds, handed back to its model's shelf when the cache is
    replaced (grown or shrunk) or its batch is gone (weakref.finalize)."""

    def __init__(self, shelf: CacheShelf):
        self.shelf = shelf
        self.shape: tuple | None = None
        self.caches: list = []
        self.graphs: dict = {}

    def release(self) -> None:
        if self.shape is not None:
            self.shelf.give(self.shape, self.caches, self.graphs)
        self.shape, self.caches, self.graphs = None, [], {}


class StaticLlama:
    """The step function over one Llama-shaped model's weights (STATIC_FAMILIES; shared by every
    batch of that model)."""

    _by_model: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model) -> "StaticLlama":
        runner = cls._by_model.get(model)
        if runner is None or runner.layer_count != len(model.model.layers):
            runner = cls._by_model[model] = cls(model)
        return runner

    def __init__(self, model):
        why = supports(model)
        if why:
            raise SpecpairError(f"static KV cache unsupported: {why}")
        cfg = model.config
        self.model = model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = float(cfg.rms_norm_eps)
        self.layer_count = len(model.model.layers)
        self.windows = layer_windows(cfg, self.layer_count)
        # Found once: looking a layer's tensors up through its modules every step cost 0.4 ms a
        # 30-layer step. The parameters themselves, so a model moved or reloaded in place (new
        # .data, same parameter) is read where it is now.
        self.options = [self.layer_options(layer) for layer in model.model.layers]
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cpu":
            cpu_kernels.available()
        # The C layer reads raw pointers: every weight it is handed must be dense.
        self.dense = all(w.is_contiguous() for layer in model.model.layers
                         for w in self.layer_weights(layer)) and all(
            t.is_contiguous() for options in self.options for t in options.values())
        self.shelf = CacheShelf()
        self._fixed_weights: list | None = None
        # What a step's `hidden` returns as the features a head drafts from: None, the normed
        # last hidden state; else these layers' inputs, concatenated in increasing order (an
        # EAGLE-3 head's auxiliary hidden states, numbered as vLLM does: layer L's input, the
        # layer count for the last one's output). Set by the drafter that reads them
        # (eagle3_drafter.Eagle3Drafter: the union of the layers its heads read); the general
        # step only (the fixed step refuses such heads).
        self.feature_layers: tuple[int, ...] | None = None

    def fixed_weights(self) -> list[tuple]:
        """Per layer, the fixed step's weights: (q|k|v, o, gate|up, down, the two norms), with q,
        k and v joined into one matrix and gate and up into another (`_join`). On a GPU a small
        model's step is bound by its kernels, not its bytes: three products a layer fewer, and
        the joined products wide enough to fill the GPU where k's and v's alone are not (on an
        H100, SmolLM2's step went from 532 kernels to 442, a Llama-8B shape's from 727 to 535
        and 7.07 ms to 6.76). Joined on first use, so a model
        that never runs the fixed step keeps its weights as loaded."""
        q = self.model.model.layers[0].self_attn.q_proj.weight
        if self._fixed_weights is None or q.data_ptr() != self._fixed_weights[0][0][0].data_ptr():
            # (again where the model's weights were replaced since: moved, reloaded)
            weights = []
            for layer, window in zip(self.model.model.layers, self.windows):
                a, m = layer.self_attn, layer.mlp
                # A family's options only where it has them: a Llama layer's call stays as it was.
                options = {"bqkv": _join_biases(a.q_proj, a.k_proj, a.v_proj), "window": window,
                           "qn": getattr(getattr(a, "q_norm", None), "weight", None),
                           "kn": getattr(getattr(a, "k_norm", None), "weight", None)}
                weights.append(((_join(a.q_proj, a.k_proj, a.v_proj), a.o_proj.weight,
                                 _join(m.gate_proj, m.up_proj), m.down_proj.weight,
                                 layer.input_layernorm.weight,
                                 layer.post_attention_layernorm.weight),
                                {name: v for name, v in options.items() if v is not None}))
            self._fixed_weights = weights
        return self._fixed_weights

    def layer_weights(self, layer):
        a, m = layer.self_attn, layer.mlp
        return (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
                m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight,
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight)

    @staticmethod
    def layer_options(layer) -> dict:
        """The layer's tensors beyond Llama's (cpu_kernels.LAYER_OPTIONS), only those it has:
        q/k/v biases (Qwen2), the norms of each head's q and k (Qwen3)."""
        a = layer.self_attn
        options = {"bq": a.q_proj.bias, "bk": a.k_proj.bias, "bv": a.v_proj.bias,
                   "qn": getattr(getattr(a, "q_norm", None), "weight", None),
                   "kn": getattr(getattr(a, "k_norm", None), "weight", None)}
        return {name: t for name, t in options.items() if t is not None}

    @torch.no_grad()
    def run_layers(self, h, positions, caches, attend: int, compiled: bool,
                   tree: "TreeLayout | None" = None, rows: torch.Tensor | None = None,
                   features: tuple[int, ...] | None = None):
        """The decoder layers over input vectors h [B, W, D] at `positions` [B, W], writing their
        keys and values into `caches`; -> the last layer's output [B, W, D] (before the norm).
        A token tree (`tree`) gives each token its own position apart from the slot it is
        written to, and its ancestors as the keys past its prefix. The vectors belong to the
        cache's rows 0..B-1, or to `rows` [B] (a part of the batch run apart). With `features`
        (layer numbers, as `feature_layers`): -> (that output, those layers' inputs
        concatenated [B, W, len(features) * D])."""
        taken = []
        body = self.model.model
        B, W = positions.shape
        slots = positions if tree is None else tree.slots
        positions = positions if tree is None else tree.positions
        cos, sin = body.rotary_emb(h, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                          # [B, 1, W, D]
        kv_rows = rows
        if rows is None:
            rows = torch.arange(B, device=self.device)
        rows = rows.view(B, 1).expand(B, W)
        if not compiled and self.dense and cpu_kernels.layer_applies(B * W, h.dtype, self.device,
                                                                     self.head_dim):
            # A few tokens on the CPU: one C call per layer (cpu_kernels.c says why).
            flat = h.reshape(B * W, -1).contiguous()
            cos_t, sin_t = (c.reshape(B * W, -1).contiguous() for c in (cos, sin))
            rows_t, pos_t = rows.reshape(-1).contiguous(), positions.reshape(-1).contiguous()
            slots_t = parents_t = None
            if tree is not None:
                slots_t = slots.reshape(-1).contiguous()
                parents_t = tree.flat_parents().to(self.device)
            reach = int(slots.max()) + 1
            scratch = cpu_kernels.layer_scratch(
                B * W, flat.shape[1], self.heads, self.kv_heads, self.head_dim,
                body.layers[0].mlp.gate_proj.weight.shape[0], reach)
            for index, (layer, (kc, vc), options, window) in enumerate(
                    zip(body.layers, caches, self.options, self.windows)):
                if features and index in features:
                    taken.append(flat.clone().view(B, W, -1))   # the C layer writes flat in place
                cpu_kernels.llama_layer(flat, rows_t, pos_t, cos_t, sin_t, kc, vc,
                                        self.layer_weights(layer), self.eps, self.heads,
                                        self.kv_heads, self.head_dim, reach, scratch,
                                        slots=slots_t, parents=parents_t, options=options,
                                        window=window)
            return _with_features(flat.view(B, W, -1), taken, features, self.layer_count)
        keys = torch.arange(attend, device=self.device).view(1, 1, 1, attend)
        if tree is None:
            mask = keys <= positions.view(B, 1, W, 1)                         # causal, by position
        else:
            mask = tree.mask(attend).to(self.device)
        # A sliding window: the slots past each token's position minus the window (a chain's slot
        # is its position; a tree's tokens past the prefix sit at slots past their positions).
        masks = {window: mask if window is None else mask & (keys > positions.view(B, 1, W, 1)
                                                             - window)
                 for window in set(self.windows)}
        step = _compiled_step() if compiled else _layer_step
        for index, (layer, (kc, vc), options, window) in enumerate(
                zip(body.layers, caches, self.options, self.windows)):
            if features and index in features:
                taken.append(h)
            h = step(h, cos, sin, masks[window], rows, slots, kc, vc, *self.layer_weights(layer),
                     eps=self.eps, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                     kv_rows=kv_rows, **options)
        return _with_features(h, taken, features, self.layer_count)

    def fixed_layers(self, h, positions, slots, caches, kv_rows=None, reach: int | None = None,
                     compiled: bool = False):
        """The fixed step's decoder layers over input vectors h [B, W, D] (module docstring):
        tokens at `positions` [B, W], written at `slots` [B, W] of the cache's rows 0..B-1 (or
        `kv_rows` [B]); -> the last layer's output [B, W, D] (before the norm). No host reads.
        `compiled`: each layer through `compiled_fixed_layer`."""
        body = self.model.model
        B, W = positions.shape
        cos, sin = body.rotary_emb(h, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                          # [B, 1, W, D]
        if kv_rows is not None:     # one stride whatever it was cut from: one compiled graph
            kv_rows = kv_rows.clone(memory_format=torch.contiguous_format)
        rows = (torch.arange(B, device=h.device) if kv_rows is None else kv_rows).view(B, 1)
        rows = rows.expand(B, W)
        layer_step = compiled_fixed_layer(h.device) if compiled else _fixed_layer
        if compiled:
            _mark_sizes(B, [cos, sin, rows, positions, slots] + ([] if kv_rows is None else [kv_rows]),
                        [t for pair in caches for t in pair])
        for (weights, options), (kc, vc) in zip(self.fixed_weights(), caches):
            if compiled:
                _mark_sizes(B, [h])
            h = layer_step(h, cos, sin, rows, positions, slots, kc, vc, *weights,
                           eps=self.eps, heads=self.heads, kv_heads=self.kv_heads,
                           head_dim=self.head_dim, kv_rows=kv_rows, reach=reach, **options)
        return h

    def fixed_step(self, ids, positions, slots, caches, compiled: bool = False,
                   head: bool = True, kv_rows=None):
        """One fixed-shape step over every row of `caches` and every slot of ids [R, W]: ->
        (logits [R, W, V], normed last hidden states [R, W, D]). Every slot's logits, so the LM
        head's product has one shape whichever slots the caller reads. What a CUDA graph records
        (`CapturedStep`); `compiled`: its layers compiled (`compiled_fixed_layer`). Without
        `head` (a prompt, whose logits but the last are never read) the logits are None;
        `kv_rows` [R]: the step's rows are these rows of the cache (prompts run apart)."""
        body = self.model.model
        h = body.norm(self.fixed_layers(body.embed_tokens(ids), positions, slots, caches,
                                        kv_rows=kv_rows, compiled=compiled))
        return (F.linear(h, self.model.lm_head.weight) if head else None), h

    @torch.no_grad()
    def forward(self, ids, positions, gather, caches, attend: int, compiled: bool,
                hidden: bool = False, tree: "TreeLayout | None" = None,
                rows: torch.Tensor | None = None):
        """ids/positions [B, W]; gather [B, G] slots whose logits to return; -> [B, G, V], and with
        `hidden` also the normed last hidden state of every slot [B, W, D] (what a head drafts
        from; the LM head reads exactly these vectors). `rows`: as run_layers."""
        body = self.model.model
        B = ids.shape[0]
        features = self.feature_layers if hidden else None
        out = self.run_layers(body.embed_tokens(ids), positions, caches, attend, compiled, tree,
                              rows, features=features)
        h, states = (body.norm(out[0]), out[1]) if features else (body.norm(out), None)
        states = h if states is None else states
        picked = h.gather(1, gather.unsqueeze(-1).expand(B, gather.shape[1], h.shape[-1]))
        logits = cpu_kernels.linear(picked, self.model.lm_head.weight)
        return (logits, states) if hidden else logits


def _with_features(h: torch.Tensor, taken: list, features, layer_count: int):
    """run_layers' result: h alone, or with the inputs of the `features` layers taken on the way
    (h itself for `layer_count`: the last layer's output), concatenated."""
    if not features:
        return h
    return h, torch.cat(taken + ([h] if layer_count in features else []), dim=-1)


GROUP_CALL_TOKENS = 16   # what one more forward costs, in padded tokens: layer calls, launches


def width_groups(counts: list[int]) -> list[list[int]]:
    """Rows of a step grouped so that each group is padded only to its own widest row: a
    request that joins a running batch feeds its whole prompt while the others feed one token
    and their drafts, and one padded forward would run every row at the prompt's width (16 rows
    joined by a 300-token prompt: 4,800 tokens of work for 315). Rows sorted by width are cut
    where the padding saved pays for the extra forward (GROUP_CALL_TOKENS); -> row indices per
    group, widest first (one group: no cut pays)."""
    order = sorted(range(len(counts)), key=lambda i: -counts[i])
    widths = [max(1, counts[i]) for i in order]     # a row feeding nothing still takes a slot
    n = len(widths)
    if n * (widths[0] if n else 0) - sum(widths) <= GROUP_CALL_TOKENS:
        return [list(range(n))] if n else []     # all the padding would not pay for one cut
    # best[j]: least cost of the first j rows (sorted); a group order[i:j] costs (j-i)*widths[i].
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * widths[i] + (GROUP_CALL_TOKENS if i else 0)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], n
    while j:
        bounds.append((cut[j], j))
        j = cut[j]
    return [sorted(order[i:j]) for i, j in reversed(bounds)]


def _chain_parented(parents: list[list[int]]) -> bool:
    """Whether every branching token's parent continues its row (a chain token): the trees the
    fixed step's attention takes (its ancestors then sit at the slots before its position)."""
    return all(row[p] < 0 for row in parents for p in row if p >= 0)


class TreeLayout:
    """Where a step's tokens sit when some form a token tree (rejection_sampler.verify_tree).

    Tokens are written to consecutive slots past each row's length, in the order fed, as in a
    chain; a token whose parent is -1 continues the row contiguously (its position is its slot),
    any other takes its parent's position + 1 and attends to its prefix and its ancestors only.
    So a chain fed first keeps position == slot, and only the tokens after it branch.
    """

    def __init__(self, slots: torch.Tensor, parents: list[list[int]]):
        B, W = slots.shape
        self.slots = slots                                                   # [B, W]
        self.parents = torch.full((B, W), -1, dtype=torch.long)
        positions = slots.clone().cpu()
        for i, row in enumerate(parents):
            for w, parent in enumerate(row):
                if parent >= 0:
                    if parent >= w:
                        raise SpecpairError(f"tree row {i}: token {w}'s parent {parent} is not "
                                            "before it")
                    self.parents[i, w] = parent
                    positions[i, w] = positions[i, parent] + 1
        self.positions = positions.to(slots.device)

    def flat_parents(self) -> torch.Tensor:
        """Parents as indices into the step's flattened [B*W] tokens (the C layer's form)."""
        B, W = self.parents.shape
        base = torch.arange(B, dtype=torch.long).view(B, 1) * W
        return torch.where(self.parents >= 0, self.parents + base, self.parents).reshape(-1).contiguous()

    def mask(self, attend: int) -> torch.Tensor:
        """[B, 1, W, attend] which cache slots each token attends to: its contiguous prefix, its
        ancestors in this step and itself."""
        B, W = self.parents.shape
        slots, positions = self.slots.cpu(), self.positions.cpu()
        mask = torch.zeros(B, 1, W, attend, dtype=torch.bool)
        for i in range(B):
            for w in range(W):
                a = w
                while True:
                    mask[i, 0, w, int(slots[i, a])] = True
                    if self.parents[i, a] < 0:
                        break
                    a = int(self.parents[i, a])
                mask[i, 0, w, :int(positions[i, a])] = True
        return mask


class StaticKVModel:
    """A causal LM plus its preallocated per-row cache; the interface of kv_cache.BatchedKVModel.

    Capacity (rows, positions) doubles when exceeded (one copy, amortised) and shrinks back once
    live rows need a quarter of it (SHRINK_BELOW), so memory follows the longest live row rather
    than the model's whole context or the longest row ever seen.

    `fixed` (default: fixed_step_applies) runs the fixed-shape step (module docstring) at
    `token_bucket` tokens per row (bucketed); capacity is then bucketed too, and the step runs
    over all of it.
    """

    def __init__(self, model, vocab_size: int | None = None, compile: str | None = None,
                 token_bucket: int | None = None, fixed: bool | None = None):
        self.model = model
        self.runner = StaticLlama.of(model)
        self.device = self.runner.device
        self.vocab_size = vocab_size
        self.compiled = resolve_compile(compile, self.device) == "on"
        self.fixed = (fixed_step_applies(self.device, self.runner.dtype) if fixed is None
                      else fixed)
        self.token_bucket = bucket(token_bucket or 1)
        self.prefill_step_tokens = PREFILL_STEP_TOKENS
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        self.lengths: list[int] = []
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # CUDA graphs of the fixed step over the current cache, by input shape (CapturedStep),
        # and the steps other code records over it (a drafting head's, drafters.EagleDraftStep),
        # by their own keys; why capture failed, if it did (the step then runs uncaptured).
        self.graphs: dict[tuple, object] = {}
        self.recorded = {"graphs": 0, "seconds": 0.0}
        self._lease = CacheLease(self.runner.shelf)
        weakref.finalize(self, self._lease.release)
        self.capture_error: str | None = None
        self.captures_graphs = (self.fixed and self.compiled and self.device.type == "cuda"
                                and cuda_graphs_wanted())
        self._allocate(rows=1, positions=self._position_floor)

    @property
    def _position_floor(self) -> int:
        # The fixed step's capacity is a bucket; otherwise a short context needs no more.
        return INITIAL_POSITIONS if self.fixed else min(INITIAL_POSITIONS, self.max_positions)

    @property
    def cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def columns(self) -> int:
        return max(self.lengths, default=0)

    @property
    def capacity(self) -> tuple[int, int]:
        kc = self.caches[0][0]
        return int(kc.shape[0]), int(kc.shape[2])

    def _zero_caches(self, shape: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A key and a value tensor of `shape` per layer, zeroed."""
        r = self.runner
        return [(torch.zeros(shape, dtype=r.dtype, device=self.device),
                 torch.zeros(shape, dtype=r.dtype, device=self.device))
                for _ in range(r.layer_count)]

    def _allocate(self, rows: int, positions: int) -> None:
        r = self.runner
        shape = (rows, r.kv_heads, positions, r.head_dim)
        # The old cache goes first where it need not be copied: peak memory stays one cache.
        if not self.caches or not self.lengths:
            self.caches = []
            self._lease.release()
        kept = r.shelf.take(shape)
        if kept is not None:         # a released cache of this shape, with its graphs
            new, graphs = kept
        else:
            new, graphs = self._zero_caches(shape), {}
        if self.caches:
            old_rows, old_pos = self.capacity
            keep_rows, keep_pos = min(old_rows, rows), min(old_pos, positions)
            for (nk, nv), (ok, ov) in zip(new, self.caches):
                nk[:keep_rows, :, :keep_pos] = ok[:keep_rows, :, :keep_pos]
                nv[:keep_rows, :, :keep_pos] = ov[:keep_rows, :, :keep_pos]
            self._lease.release()
        self.caches, self.graphs = new, graphs
        self._lease.shape, self._lease.caches, self._lease.graphs = shape, new, graphs

    def _reserve(self, rows: int, positions: int) -> None:
        have_rows, have_pos = self.capacity
        if rows <= have_rows and positions <= have_pos:
            return
        if self.fixed:
            self._allocate(max(have_rows, bucket(rows)),
                           max(have_pos, bucket(positions, self._position_floor)))
            return
        if positions > have_pos:
            need = max(positions, have_pos * 2)
            # Pad slots may run past the context; the cache may too (they are never attended).
            have_pos = need
        while have_rows < rows:
            have_rows *= 2
        self._allocate(have_rows, have_pos)

    def _shrink(self) -> None:
        """Give memory back once live rows need a quarter of the capacity (SHRINK_BELOW): down
        to twice the bucket they need, so a row joining and leaving does not reallocate again."""
        have_rows, have_pos = self.capacity
        live_rows = max(1, self.batch_size)
        # The fixed step writes a token bucket past each row's length.
        live_pos = max(self.lengths, default=0) + (self.token_bucket if self.fixed else 0)
        rows, positions = have_rows, have_pos
        if live_rows * SHRINK_BELOW <= have_rows:
            rows = 2 * bucket(live_rows)
        if live_pos * SHRINK_BELOW <= have_pos:
            positions = max(self._position_floor, 2 * bucket(live_pos))
        if (rows, positions) != (have_rows, have_pos):
            self._allocate(min(rows, have_rows), min(positions, have_pos))

    def _advance(self, counts: list[int]) -> tuple[torch.Tensor, int]:
        """Positions [B, W] for rows feeding `counts` new tokens (pads continue each row's
        positions), the rows' lengths moved on, and the cache grown to hold them."""
        B = len(counts)
        assert B == self.batch_size, (B, self.batch_size)
        width = max(counts, default=0)
        if width == 0:
            raise ValueError("extend() called with no tokens")
        start = torch.tensor(self.lengths, dtype=torch.long).view(B, 1)
        positions = start + torch.arange(width, dtype=torch.long).view(1, width)
        for i, n in enumerate(counts):
            self.lengths[i] += n
        attend = int(positions.max()) + 1
        self._reserve(B, attend)
        return positions.to(self.device), attend

    @torch.no_grad()
    def extend(self, rows: list[list[int]], last: int | list[int] = 1, hidden: bool = False,
               parents: list[list[int]] | None = None):
        """Feed each row its new tokens; return the logits of each row's last `last` tokens,
        [B, L, V] right-aligned (as BatchedKVModel.extend). With `hidden`, also the normed last
        hidden state of every fed token, [B, W, D] left-aligned (row i's first len(rows[i])).
        `parents` makes the tokens a tree (TreeLayout): per row, each token's parent index among
        the row's fed tokens, or -1; after verification `move` puts the kept branch in place."""
        if self.fixed and (parents is None or (_chain_parented(parents) and
                                               max(map(len, rows)) <= self.token_bucket)):
            return self._extend_fixed(rows, last, hidden, parents)
        # Any other tree: the general step below (exact to rounding, not bitwise).
        B = len(rows)
        width = max((len(r) for r in rows), default=0)
        n_last = max(last) if isinstance(last, list) else last
        ids = torch.zeros(B, width, dtype=torch.long)
        gather = torch.zeros(B, n_last, dtype=torch.long)
        for i, toks in enumerate(rows):
            n = len(toks)
            if n:
                ids[i, :n] = torch.tensor(toks, dtype=torch.long)
            gather[i] = (torch.arange(n_last) + (n - n_last)).clamp(min=0)
        counts = [len(r) for r in rows]
        positions, attend = self._advance(counts)
        tree = TreeLayout(positions, parents) if parents is not None else None
        ids, gather = ids.to(self.device), gather.to(self.device)
        groups = width_groups(counts) if tree is None and not self.compiled else [list(range(B))]
        if len(groups) == 1:
            out = self.runner.forward(ids, positions, gather, self.caches, attend, self.compiled,
                                      hidden=hidden, tree=tree)
            logits, states = out if hidden else (out, None)
        else:
            logits, states = self._extend_apart(groups, counts, ids, positions, gather, hidden)
        if self.vocab_size is not None and logits.shape[-1] > self.vocab_size:
            logits = logits[..., : self.vocab_size]   # padded embedding rows are never real tokens
        return (logits, states) if hidden else logits

    def _extend_fixed(self, rows, last, hidden: bool, parents=None, vectors: bool = False):
        """extend() (or, with `vectors`, extend_vectors()) through fixed-shape steps: rows
        feeding more than the token bucket (a prompt) first run apart at their own bucket (a
        fixed step of only those rows, `_prefill_step`; eagerly when long, or for vectors); then
        one step of every cache row at the token bucket feeds the rest, padding
        slots continuing each row's positions past its length (written, never attended)."""
        B, W = len(rows), self.token_bucket
        counts = [int(r.shape[0]) if vectors else len(r) for r in rows]
        if max(counts, default=0) == 0:
            raise ValueError("extend() called with no tokens")
        assert B == self.batch_size, (B, self.batch_size)
        starts = list(self.lengths)
        wide = [i for i in range(B) if counts[i] > W]
        wide_width = bucket(max((counts[i] for i in wide), default=1))
        for i, n in enumerate(counts):
            self.lengths[i] += n
        self._reserve(B, max([max(self.lengths) + W] + [starts[i] + wide_width for i in wide]))
        r, dim = self.runner, self.model.config.hidden_size
        n_last = max(last) if isinstance(last, list) else last
        width = max(counts)
        out = states = None
        if wide and not vectors and len(wide) * wide_width <= self.prefill_step_tokens:
            h = self._prefill_step(rows, wide, starts, counts, wide_width)
            out, states = self._place(out, states, h, wide, list(range(len(wide))), counts,
                                      n_last, width, vectors, hidden)
        elif wide:    # long prompts (compute-bound) or vectors, at their own width
            starts_wide = torch.tensor([starts[i] for i in wide], dtype=torch.long).view(-1, 1)
            pos = starts_wide + torch.arange(wide_width).view(1, -1)
            if vectors:
                h = torch.zeros(len(wide), wide_width, dim, dtype=r.dtype, device=self.device)
                for n, i in enumerate(wide):
                    h[n, :counts[i]] = rows[i]
            else:
                ids = torch.zeros(len(wide), wide_width, dtype=torch.long)
                for n, i in enumerate(wide):
                    ids[n, :counts[i]] = torch.tensor(rows[i], dtype=torch.long)
                h = self.model.model.embed_tokens(ids.to(self.device))
            # A head's vectors, compiled: as a prompt's step runs (`_step_uncaptured`: its planes,
            # the rows' whole capacity), so they take the graphs `_warm_prefill` compiled. Else
            # eagerly, attending only the slots reached.
            compiled = self.compiled and vectors
            kv_rows = torch.tensor(wide, dtype=torch.long).view(-1, 1).expand(len(wide), wide_width)
            planes = to_device(torch.stack((pos, pos, pos, kv_rows)), self.device)
            reach = None if compiled else int(pos.max()) + 1
            h = r.fixed_layers(h, planes[1], planes[2], self.caches, kv_rows=planes[3, :, 0],
                               reach=reach, compiled=compiled)
            out, states = self._place(out, states, h, wide, list(range(len(wide))), counts,
                                      n_last, width, vectors, hidden)
        narrow = [i for i in range(B) if 0 < counts[i] <= W]
        if narrow:
            R = self.capacity[0]
            fed = [0 if i in wide else counts[i] for i in range(B)]
            start = torch.zeros(R, 1, dtype=torch.long)
            start[:B, 0] = torch.tensor([self.lengths[i] - fed[i] for i in range(B)])
            slots = start + torch.arange(W).view(1, W)
            positions = slots.clone()
            for i, row in enumerate(parents or []):
                for w, parent in enumerate(row):
                    if parent >= 0:
                        positions[i, w] = slots[i, parent] + 1
            if vectors:
                slots, positions = slots.to(self.device), positions.to(self.device)
                h = torch.zeros(R, W, dim, dtype=r.dtype, device=self.device)
                for i in narrow:
                    h[i, :counts[i]] = rows[i]
                h = r.fixed_layers(h, positions, slots, self.caches, compiled=self.compiled)
            else:
                # ids, positions and slots go over in one copy: from pageable memory each copy
                # waits for the stream, and the GPU step is short enough that three such waits
                # were a visible share of it (docs/gpu.md).
                pad = [0] * W
                ids = torch.tensor([list(rows[i]) + pad[counts[i]:] if fed[i] else pad
                                    for i in range(B)] + [pad] * (R - B), dtype=torch.long)
                host = torch.stack((ids, positions, slots))
                if self.captures_graphs and self.capture_error is None:
                    h = self._replay(host)
                else:
                    h = self._step_uncaptured(host, self.caches)
            out, states = self._place(out, states, h, narrow, narrow, counts, n_last, width,
                                      vectors, hidden)
        if vectors:
            return out
        if self.vocab_size is not None and out.shape[-1] > self.vocab_size:
            out = out[..., : self.vocab_size]   # padded embedding rows are never real tokens
        return (out, states) if hidden else out

    def _prefill_step(self, rows, wide, starts, counts, width: int):
        """The prompts of rows `wide` as one fixed step of those rows at their bucket `width`
        (no LM head: _place applies it to the slots asked for): on CUDA one replay of a recorded
        graph, where the same layers run eagerly cost ~34 ms a SmolLM2 prompt in kernel launches
        (docs/gpu.md). The step writes only these rows, reads their whole capacity (the
        graph's shape cannot follow the prompt's reach) and its pad slots continue each row's
        positions past its new length, never attended. Rows are not bucketed: a padded row
        would have to write somewhere, and a full cache has no row to spare."""
        ids = torch.zeros(len(wide), width, dtype=torch.long)
        for n, i in enumerate(wide):
            ids[n, :counts[i]] = torch.tensor(rows[i], dtype=torch.long)
        slots = (torch.tensor([starts[i] for i in wide], dtype=torch.long).view(-1, 1)
                 + torch.arange(width).view(1, width))
        kv_rows = torch.tensor(wide, dtype=torch.long).view(-1, 1).expand(len(wide), width)
        host = torch.stack((ids, slots, slots, kv_rows))
        if self.captures_graphs and self.capture_error is None:
            return self._replay(host, head=False)
        return self._step_uncaptured(host, self.caches, head=False)

    def _replay(self, host: torch.Tensor, head: bool = True):
        """The fixed step through this cache's CUDA graph for the inputs' shape, recorded on first
        use. A graph that cannot be recorded is reported once and the step runs uncaptured."""
        key = (tuple(host.shape), head)
        graph = self.graphs.get(key)
        if graph is None:
            started = time.perf_counter()
            try:
                graph = CapturedStep(self.runner, host.to(self.device), self.caches, self.compiled,
                                     head=head)
            except Exception as exc:     # noqa: BLE001 - any capture failure: run uncaptured
                self.capture_error = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed, the fixed step runs uncaptured: %s",
                            self.capture_error)
                return self._step_uncaptured(host, self.caches, head)
            self.graphs[key] = graph
            self.recorded["graphs"] += 1
            self.recorded["seconds"] += time.perf_counter() - started
        return graph(host)      # recording computes nothing: even a new graph replays now

    def capture(self, step, state=()) -> CapturedGraph | None:
        """`step`, a function of device buffers over this cache, recorded (`capture_graph`)."""
        return capture_graph(self, step, state)

    def make_room(self, slots: int) -> None:
        """Capacity for every row to write `slots` slots past its length (a fixed step writes
        every row; what a row writes past its length is never attended)."""
        self._reserve(self.batch_size, max(self.lengths, default=0) + slots)

    def buckets(self, max_rows: int, max_positions: int, rows_from: int = 1
                ) -> list[tuple[int, int]]:
        """Every (rows, capacity) bucket a batch of rows_from to max_rows rows of up to
        max_positions positions can run the fixed step at."""
        rows = [bucket(1 << i) for i in range(bucket(max_rows).bit_length())
                if 1 << i >= rows_from]
        top = bucket(max_positions + self.token_bucket, self._position_floor)
        floor = self._position_floor
        positions = [floor << i for i in range((top // floor).bit_length())]
        return [(r, c) for r in rows for c in positions]

    @torch.no_grad()
    def warm_up(self, max_rows: int, max_positions: int, rows_from: int = 1) -> dict:
        """Compile the fixed step's layer and, on CUDA, record the step's graph at every bucket
        (`buckets`) on scratch caches of those shapes, so no request pays a compile and every
        shape is proven to record; -> the buckets, the seconds, the graphs recorded and on CUDA
        the most memory one bucket's graph reserved (only the graph of the cache in use is held
        while serving: a real cache records its own in a few replays' time, `_replay`)."""
        r = self.runner
        cuda = self.device.type == "cuda"
        started = time.perf_counter()
        shapes = self.buckets(max_rows, max_positions, rows_from)
        W = self.token_bucket
        graph_bytes, recorded, seconds = 0, 0, []
        for rows, positions in shapes:
            bucket_started = time.perf_counter()
            shape = (rows, r.kv_heads, positions, r.head_dim)
            caches = self._zero_caches(shape)
            slots = torch.arange(W).view(1, W).expand(rows, W)
            host = torch.stack((torch.zeros(rows, W, dtype=torch.long), slots, slots))
            capturing = self.captures_graphs and self.capture_error is None
            before = torch.cuda.memory_reserved(self.device) if capturing else 0
            recorded += self._warm_shape(host, caches)
            if capturing:
                torch.cuda.synchronize(self.device)
                graph_bytes = max(graph_bytes, torch.cuda.memory_reserved(self.device) - before)
            del caches
            seconds.append(round(time.perf_counter() - bucket_started, 3))
        prefill_started = time.perf_counter()
        recorded += self._warm_prefill(max_rows, rows_from)
        if cuda:
            torch.cuda.synchronize(self.device)
        # Where a cold start goes: a bucket that compiles a new graph class stands out from the
        # ones that only record (the start-up target is a figure of these).
        report = {"token_bucket": W, "buckets": shapes, "graphs": recorded,
                  "seconds": round(time.perf_counter() - started, 3), "bucket_seconds": seconds,
                  "prefill_seconds": round(time.perf_counter() - prefill_started, 3)}
        if cuda:
            report["graph_memory_bytes"] = graph_bytes
        if self.capture_error:
            report["capture_error"] = self.capture_error
        slowest_seconds, slowest = max(zip(seconds, shapes), default=(0.0, "-"))
        log.info("fixed step warmed: %d buckets (rows, capacity) at %d tokens a row in %.1f s "
                 "(the slowest %s in %.1f s, the prompt's step %.1f s), %d CUDA graphs recorded%s",
                 len(shapes), W, report["seconds"], slowest, slowest_seconds,
                 report["prefill_seconds"], recorded,
                 f", at most {graph_bytes / 2**20:.0f} MiB each" if cuda else "")
        return report

    def _warm_prefill(self, max_rows: int, rows_from: int = 1) -> int:
        """Compile the prompt's step (`_prefill_step`) ahead of the first request: it reads its
        rows through an index (another graph than the bucket's step) at a token count that
        differs from the bucket's, and the second count seen makes dynamo compile the layer with
        the count symbolic, which then serves every prompt bucket. One row and several, in a cache
        of one row and of several, compile apart (`_mark_sizes`): the three that occur. On CUDA
        each recorded once, to prove it records (a real cache records its own graphs in a few
        replays' time). -> graphs recorded."""
        if not self.compiled or rows_from > 1:   # (past speculation: the same graphs)
            return 0
        r, width, recorded = self.runner, bucket(self.token_bucket + 1), 0
        # (prompt rows, cache rows): a prompt beside none, beside others, several together.
        for rows, cache_rows in ((1, 1), (1, 2), (2, 2)):
            if rows * width > self.prefill_step_tokens or cache_rows > bucket(max_rows):
                continue
            shape = (cache_rows, r.kv_heads, bucket(width, self._position_floor), r.head_dim)
            caches = self._zero_caches(shape)
            slots = torch.arange(width).view(1, width).expand(rows, width)
            kv_rows = torch.arange(rows).view(rows, 1).expand(rows, width)
            host = torch.stack((torch.zeros(rows, width, dtype=torch.long), slots, slots, kv_rows))
            recorded += self._warm_shape(host, caches, head=False)
        return recorded

    def _warm_shape(self, host: torch.Tensor, caches, head: bool = True) -> bool:
        """The fixed step once at this input shape on scratch `caches`: compiled (when it is), and
        on CUDA recorded as a graph and replayed, to prove it records. A recording that fails is
        reported once and serving runs uncaptured. -> whether a graph was recorded."""
        if not (self.captures_graphs and self.capture_error is None):
            self._step_uncaptured(host, caches, head)
            return False
        try:
            CapturedStep(self.runner, host.to(self.device), caches, self.compiled, head=head)(host)
            return True
        except Exception as exc:     # noqa: BLE001 - reported; serving runs uncaptured
            self.capture_error = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed at inputs %s: %s", tuple(host.shape),
                        self.capture_error)
            return False

    def _step_uncaptured(self, host: torch.Tensor, caches, head: bool = True):
        """The fixed step on host planes (ids, positions, slots, and for a prompt's step the
        cache row of each row) without a CUDA graph: compiled or eager."""
        planes = to_device(host, self.device)
        return self.runner.fixed_step(*planes[:3], caches, compiled=self.compiled, head=head,
                                      kv_rows=planes[3, :, 0] if len(planes) == 4 else None)

    def _place(self, out, states, h, which: list[int], at: list[int], counts, n_last: int,
               width: int, vectors: bool, hidden: bool):
        """Put one forward's results for the batch rows `which` (found at rows `at` of h) where
        extend() returns them. h: a fixed step's (logits, normed states) over every cache row,
        or the layers' output (vectors: returned as is; tokens: normed, then the LM head over
        only the slots asked for: a prompt's every slot would be its length times the vocabulary)."""
        B = len(counts)
        if isinstance(h, tuple):
            logits, normed = h
        else:
            logits, normed = None, h if vectors else self.model.model.norm(h)
        if vectors:
            if out is None:
                out = normed.new_zeros(B, max(width, 1), normed.shape[-1])
            for i, a in zip(which, at):
                out[i, :counts[i]] = normed[a, :counts[i]]
            return out, None
        first = counts[which[0]] - n_last
        if logits is not None and at == list(range(len(at))) and first >= 0 and all(
                counts[i] - n_last == first for i in which):
            # Rows 0..n-1 each feeding as many tokens (every decode step without per-row k): a
            # slice, copied out of the step's output (a CUDA graph's buffers are overwritten by
            # its next replay), with no index tensors to build and send.
            part = logits[:len(at), first:first + n_last].clone()
        else:
            index = torch.tensor(at, dtype=torch.long, device=self.device).view(-1, 1)
            gather = torch.tensor([[max(0, counts[i] - n_last + t) for t in range(n_last)]
                                   for i in which], dtype=torch.long, device=self.device)
            part = (logits[index, gather] if logits is not None
                    else F.linear(normed[index, gather], self.model.lm_head.weight))
        if out is None and len(which) == B:      # every row from this forward, in order
            out = part
        else:
            if out is None:
                out = part.new_zeros(B, n_last, part.shape[-1])
            out[torch.tensor(which, device=self.device)] = part
        if hidden:
            if states is None:
                states = normed.new_zeros(B, width, normed.shape[-1])
            for i, a in zip(which, at):
                states[i, :counts[i]] = normed[a, :counts[i]]
        return out, states

    def _extend_apart(self, groups, counts, ids, positions, gather, hidden):
        """One forward per group of rows, each padded only to its own widest row; the results
        land where one padded forward would have put them."""
        logits = states = None
        for group in groups:
            index = torch.tensor(group, dtype=torch.long, device=self.device)
            w = max(1, max(counts[i] for i in group))
            pos = positions[index, :w]
            kv_rows = None if group == list(range(len(group))) else index
            out = self.runner.forward(ids[index, :w], pos, gather[index], self.caches,
                                      int(pos.max()) + 1, self.compiled, hidden=hidden,
                                      rows=kv_rows)
            part, part_states = out if hidden else (out, None)
            if logits is None:
                logits = part.new_empty((len(counts),) + tuple(part.shape[1:]))
            logits[index] = part
            if hidden:
                if states is None:
                    states = part_states.new_zeros(len(counts), ids.shape[1], part_states.shape[-1])
                states[index, :w] = part_states
        return logits, states

    @torch.no_grad()
    def extend_vectors(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Feed each row new input vectors [n_i, D] instead of token ids (a drafting head's
        inputs); -> the last layer's output for every slot, [B, W, D] left-aligned."""
        if self.fixed:
            return self._extend_fixed(rows, 1, False, vectors=True)
        B = len(rows)
        width = max((int(r.shape[0]) for r in rows), default=0)
        r = self.runner
        dim = self.model.config.hidden_size
        h = torch.zeros(B, max(width, 1), dim, dtype=r.dtype, device=self.device)
        for i, vectors in enumerate(rows):
            if vectors.shape[0]:
                h[i, :vectors.shape[0]] = vectors
        positions, attend = self._advance([int(v.shape[0]) for v in rows])
        return r.run_layers(h, positions, self.caches, attend, self.compiled)

    def move(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy keys and values (row, from slot, to slot) in every layer: a tree's kept branch
        goes where a chain would have written it, so later steps see plain positions."""
        if not moves:
            return
        rows, src, dst = (torch.tensor(c, dtype=torch.long, device=self.device) for c in zip(*moves))
        for kc, vc in self.caches:
            kc[rows, :, dst] = kc[rows, :, src]
            vc[rows, :, dst] = vc[rows, :, src]

    def rollback(self, row: int, keep: int) -> None:
        """Forget row's tokens beyond its first `keep`: the length moves back, nothing else."""
        if keep < self.lengths[row]:
            self.lengths[row] = keep

    def trim(self) -> None:
        """Nothing to crop (positions past a row's length are simply overwritten later); memory
        no live row needs goes back (_shrink)."""
        self._shrink()

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, moved to the front of the cache (rows leave at step boundaries)."""
        used = max((self.lengths[i] for i in rows), default=0)
        if used and rows != list(range(len(rows))):
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            for kc, vc in self.caches:
                kc[:len(rows), :, :used] = kc[index, :, :used]
                vc[:len(rows), :, :used] = vc[index, :, :used]
        self.lengths = [self.lengths[i] for i in rows]
        self._shrink()

    def add_rows(self, count: int) -> None:
        if count <= 0:
            return
        self.lengths += [0] * count
        self._reserve(len(self.lengths), self.capacity[1])

    # -- prefix reuse (prefix_cache.py) ---------------------------------------------------------

    reuses_prefixes = True

    def read_blocks(self, row: int, starts: list[int], width: int) -> list[torch.Tensor]:
        """Copies of `row`'s keys and values at slots start..start+width-1, for each start: one
        tensor [layers, 2, kv heads, width, head dim] a block (what the prefix store keeps)."""
        if not starts:
            return []
        lo, hi = min(starts), max(starts) + width
        if hi > self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} positions, not {hi}")
        span = torch.stack([torch.stack((k[row, :, lo:hi], v[row, :, lo:hi]))
                            for k, v in self.caches])
        return [span[:, :, :, s - lo:s - lo + width].clone() for s in starts]

    def load_blocks(self, row: int, blocks: list[torch.Tensor]) -> int:
        """Write consecutive blocks (read_blocks' tensors) at an empty row's first slots; the row
        then holds them as if its prompt's first tokens had been fed. -> positions now held."""
        if self.lengths[row]:
            raise ValueError(f"row {row} already holds {self.lengths[row]} positions")
        if not blocks:
            return 0
        span = torch.cat(blocks, dim=3).to(self.device)
        n = int(span.shape[3])
        self._reserve(self.batch_size, n + (self.token_bucket if self.fixed else 0))
        for layer, (kc, vc) in enumerate(self.caches):
            kc[row, :, :n] = span[layer, 0]
            vc[row, :, :n] = span[layer, 1]
        self.lengths[row] = n
        return n


def kv_model(model, vocab_size: int | None = None, kind: str | None = None,
             compile: str | None = None, token_bucket: int | None = None):
    """The cache for this model: static where supported (unless asked for dynamic), else the
    hole-masking BatchedKVModel over Hugging Face's forward. `token_bucket`: the most tokens a
    row feeds in a step after its prompt (the fixed step's width)."""
    from specpair.kv_cache import BatchedKVModel

    if resolve_kv_kind(kind) == "static" and supports(model) is None:
        return StaticKVModel(model, vocab_size=vocab_size, compile=compile,
                             token_bucket=token_bucket)
    return BatchedKVModel(model, vocab_size=vocab_size)


def step_description(model, kind: str, compile: str, token_bucket: int | None = None) -> dict:
    """What runs a step of this model: the cache, whether compiled, the CPU kernel's state, and
    where the fixed step runs, its token bucket and its attention (attention_description)."""
    why = supports(model) if kind == "static" else None
    static = kind == "static" and why is None
    param = next(model.parameters())
    device = param.device
    out = {"kv_cache": "static" if static else "dynamic",
           "compiled": static and compile == "on"}
    if why:
        out["static_unsupported"] = why
    if static and fixed_step_applies(device, param.dtype):
        out.update(fixed_step=True, token_bucket=bucket(token_bucket or 1),
                   attention=attention_description(device, param.dtype))
        if out["compiled"]:
            out["compile"] = compile_options(device)
    if static and device.type == "cpu":
        out["cpu_kernels"] = cpu_kernels.status()
    return out
