"""The step function over one Llama-shaped model's weights (`StaticLlama`), shared by every
cache of that model.

The forward is written here over the Hugging Face model's own parameters (nothing is copied) for
Llama's decoder layer and the families that differ from it only inside attention (STATIC_FAMILIES:
Llama 2/3, SmolLM2, TinyLlama; Mistral; Qwen2/2.5 with q/k/v biases; Qwen3 with per-head q/k
norms; sliding windows in the mask); `supports()` says why another architecture is not, and the
engine then uses dynamic.BatchedKVModel (`check_static_step`). Two ways through a layer:
- on the CPU in float32, a step of at most cpu_kernels.MAX_TOKENS tokens (128; decode and verify
  up to batch 64): every layer in one call into cpu_kernels.c (llama_layers; a layer a call for a
  kernel without it), whose per-token arithmetic does not depend on the other tokens, so a
  token's logits are bitwise the same in a decode step and in a verification;
- otherwise (prefill, large batches, or compiled on the CPU in float32): the torch operations of
  `layer_step`, which `torch.compile` can compile (SPECPAIR_COMPILE=on; on this 2-core CPU it
  measured slower than the C layer, see README).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from specpair import cpu_kernels
from specpair.errors import SpecpairError
from specpair.kv import fixed_step
from specpair.kv.families import layer_windows, supports
from specpair.kv.general_step import compiled_step, layer_step
from specpair.kv.layouts import TreeLayout
from specpair.kv.shelf import CacheShelf


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
        # (drafters.eagle3.Eagle3Drafter: the union of the layers its heads read); the general
        # step and the fixed step (fixed_step's third result) alike.
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
        if compiled:    # one stride at every width (an expanded [B, 1] is (1, 1), a wider one (1, 0)): one graph
            rows = rows.contiguous()
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
            if cpu_kernels.layers_apply():
                # Every layer in one C call and one parallel region (issue 51), as the paged
                # cache's step: a layer's fork and join become one barrier, and no Python runs
                # between layers (30 calls' argument conversion was the engine thread's alone).
                # The stack's pointer arrays are built each call (~0.14 ms for 30 layers), not
                # kept: a stack holds its caches, and a batch's caches are replaced or dropped.
                stack = cpu_kernels.LayerStack([self.layer_weights(layer) for layer in body.layers],
                                               self.options, self.windows, caches)
                flat, taken = cpu_kernels.llama_layers(
                    flat, rows_t, pos_t, cos_t, sin_t, stack, self.eps, self.heads, self.kv_heads,
                    self.head_dim, reach, scratch, slots=slots_t, parents=parents_t,
                    capture=features)
                return _with_features(flat.view(B, W, -1), [t.view(B, W, -1) for t in taken],
                                      features, self.layer_count)
            # a bench's build of an older kernel, with a layer a call only
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
        step = compiled_step() if compiled else layer_step
        for index, (layer, (kc, vc), options, window) in enumerate(
                zip(body.layers, caches, self.options, self.windows)):
            if features and index in features:
                taken.append(h)
            h = step(h, cos, sin, masks[window], rows, slots, kc, vc, *self.layer_weights(layer),
                     eps=self.eps, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                     kv_rows=kv_rows, **options)
        return _with_features(h, taken, features, self.layer_count)

    def fixed_layers(self, h, positions, slots, caches, kv_rows=None, reach: int | None = None,
                     compiled: bool = False, table=None,
                     features: tuple[int, ...] | None = None):
        """The fixed step's decoder layers over input vectors h [B, W, D] (module docstring):
        tokens at `positions` [B, W], written at `slots` [B, W] of the cache's rows 0..B-1 (or
        `kv_rows` [B]); -> the last layer's output [B, W, D] (before the norm). No host reads.
        `compiled`: each layer through `compiled_fixed_layer`. `table` [R, blocks]: `caches` are
        block pools read and written through it (fixed_step.paged_write_read). With
        `features` (layer numbers, as `feature_layers`): -> (that output, those layers' inputs
        concatenated), as run_layers."""
        body = self.model.model
        B, W = positions.shape
        cos, sin = body.rotary_emb(h, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                          # [B, 1, W, D]
        if kv_rows is not None:     # one stride whatever it was cut from: one compiled graph
            kv_rows = kv_rows.clone(memory_format=torch.contiguous_format)
        rows = (torch.arange(B, device=h.device) if kv_rows is None else kv_rows).view(B, 1)
        rows = rows.expand(B, W)
        run_layer = (fixed_step.compiled_fixed_layer(h.device) if compiled
                     else fixed_step.fixed_layer)
        if compiled and table is None:
            fixed_step.mark_sizes(B, [cos, sin, rows, positions, slots]
                                  + ([] if kv_rows is None else [kv_rows]),
                                  [t for pair in caches for t in pair])
        elif compiled:   # a pool's shape never changes; the table's rows and blocks do
            fixed_step.mark_sizes(B, [cos, sin, rows, positions, slots]
                                  + ([] if kv_rows is None else [kv_rows]), tables=[table])
        taken = []
        for index, ((weights, options), (kc, vc)) in enumerate(zip(self.fixed_weights(), caches)):
            if features and index in features:
                taken.append(h)
            if compiled:
                fixed_step.mark_sizes(B, [h])
            h = run_layer(h, cos, sin, rows, positions, slots, kc, vc, *weights,
                          eps=self.eps, heads=self.heads, kv_heads=self.kv_heads,
                          head_dim=self.head_dim, kv_rows=kv_rows, reach=reach, table=table,
                          **options)
        return _with_features(h, taken, features, self.layer_count)

    def fixed_step(self, ids, positions, slots, caches, compiled: bool = False,
                   head: bool = True, kv_rows=None, table=None):
        """One fixed-shape step over every row of `caches` and every slot of ids [R, W]: ->
        (logits [R, W, V], normed last hidden states [R, W, D]). Every slot's logits, so the LM
        head's product has one shape whichever slots the caller reads. What a CUDA graph records
        (`CapturedStep`); `compiled`: its layers compiled (`compiled_fixed_layer`). Without
        `head` (a prompt, whose logits but the last are never read) the logits are None;
        `kv_rows` [R]: the step's rows are these rows of the cache (prompts run apart); `table`:
        a paged cache's block tables (fixed_layers). With `feature_layers` set (an EAGLE-3
        head's), a third: those layers' inputs [R, W, len * D], what extend(hidden=True) hands
        the head instead of the normed states."""
        body = self.model.model
        features = self.feature_layers
        out = self.fixed_layers(body.embed_tokens(ids), positions, slots, caches,
                                kv_rows=kv_rows, compiled=compiled, table=table,
                                features=features)
        h = body.norm(out[0] if features else out)
        logits = F.linear(h, self.model.lm_head.weight) if head else None
        return (logits, h, out[1]) if features else (logits, h)

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
