"""EAGLE-3 heads as people publish them, drafting in our engine.

An EAGLE-3 head drafts from three of the target's *intermediate* hidden states (the inputs of
three layers, "auxiliary hidden states"; vLLM's default layers 2, n/2 and n-3), not from the
last normed one our EAGLE heads (heads.py) read. Per pair j (token x[j+1], target position j):

    hidden = fc(concat(aux_1[j], aux_2[j], aux_3[j]))                  target's features, once
    x      = concat(input_layernorm(embed(x[j+1])), hidden_norm(hidden))   2 * D wide
    r      = hidden_norm(hidden) if norm_before_residual else hidden
    r      = r + attention(x)          (q/k/v read the 2 * D input; keys cached per row)
    out    = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(out))        over the draft vocabulary; target id = id + d2t[id]

and a further draft feeds (embed(drafted token), out) at the next position: the head's own
pre-norm output stands for the target's features (no fc). That is vLLM's `Eagle3LlamaForCausalLM`
(model_executor/models/llama_eagle3.py), the arithmetic these heads are trained for.

Two layouts on disk, both read here:
- `speculators` (vLLM's training library; what `specpair distill --method eagle3` writes too):
  config.json with `speculators_model_type: eagle3`, the layer's Llama config under
  `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`, optionally
  `eagle_aux_hidden_state_layer_ids` and `target_hidden_size`; weights `fc.weight`,
  `layers.0.*` (q/k/v of width 2 * D, `hidden_norm`), `norm.weight`, `lm_head.weight`, `d2t`,
  `t2d` (and `embed_tokens.weight` when the head keeps a copy of the target's).
- EAGLE-3's own release: a flat Llama config (`architectures: ["LlamaForCausalLMEagle3"]`,
  `draft_vocab_size`), weights under `midlayer.*` instead of `layers.0.*`, the residual taken
  before `hidden_norm`.

A head carries no tokenizer: it embeds with the target's table and drafts target ids through
d2t; the tokenizer check takes that (tokenizer_identity.head_fingerprint).

Where it runs: the general step (float32 on the CPU, the C layer): the target hands its
auxiliary hidden states through kv.runner.StaticLlama.feature_layers, and the head runs its one
layer for every drafting row in one C call a step (head_kernels.c) over one key/value cache of
every row (drafters.eagle3.Eagle3Drafter); without the kernel, in PyTorch row by row. Where the
fixed step applies to the head (CUDA, bf16) its round runs as fixed-shape steps over one cache
of every row instead, what CUDA graphs record (eagle3_steps.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specpair.errors import SpecpairError

METHOD = "eagle3"
SPECULATORS_TYPE = "eagle3"
ORIGINAL_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"    # what speculators 0.9.0 writes


def default_aux_layers(layer_count: int) -> tuple[int, ...]:
    """vLLM's default auxiliary layers for a target of `layer_count` layers (a head's config may
    name others: `eagle_aux_hidden_state_layer_ids`)."""
    return (2, layer_count // 2, layer_count - 3)


def eagle3_layout(raw: dict) -> str | None:
    """'speculators', 'original' or None: which EAGLE-3 layout a config.json is in."""
    if raw.get("speculators_model_type") == SPECULATORS_TYPE:
        return "speculators"
    if any(a in ORIGINAL_ARCHITECTURES for a in raw.get("architectures") or []):
        return "original"
    return None


def is_eagle3_dir(path) -> bool:
    config = Path(path) / "config.json"
    try:
        return config.is_file() and eagle3_layout(json.loads(config.read_text())) is not None
    except (OSError, json.JSONDecodeError):
        return False


class Eagle3Layer(nn.Module):
    """The head's decoder layer (vLLM's EAGLE-3 Llama layer): attention over [normed embedding,
    normed hidden] (2 * D wide), the residual on the hidden alone."""

    def __init__(self, config, norm_before_residual: bool):
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        super().__init__()
        D = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or D // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * D, self.heads * self.head_dim, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * D, self.kv_heads * self.head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * D, self.kv_heads * self.head_dim, bias=bias)
        self.self_attn.o_proj = nn.Linear(self.heads * self.head_dim, D, bias=False)
        self.mlp = LlamaMLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(D, eps=eps)
        self.hidden_norm = LlamaRMSNorm(D, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(D, eps=eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds, hidden, cos, sin, past: tuple | None, mask: torch.Tensor | None):
        """embeds/hidden [B, n, D] at rotary (cos, sin) [B, n, hd]; past: (keys, values)
        [B, KV, P, hd] or None; mask [B, 1, n, P + n] bool (None: causal over these n, all of
        past). -> (pre-norm output [B, n, D], (keys, values) with these n appended)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        a = self.self_attn
        B, n, _ = embeds.shape
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        hd = self.head_dim
        q = a.q_proj(x).view(B, n, self.heads, hd).transpose(1, 2)
        k = a.k_proj(x).view(B, n, self.kv_heads, hd).transpose(1, 2)
        v = a.v_proj(x).view(B, n, self.kv_heads, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        if mask is None:
            P = k.shape[2] - n
            mask = (torch.arange(P + n, device=x.device).view(1, P + n)
                    <= torch.arange(n, device=x.device).view(n, 1) + P).view(1, 1, n, P + n)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        r = residual + a.o_proj(out.transpose(1, 2).reshape(B, n, -1))
        return r + self.mlp(self.post_attention_layernorm(r)), (k, v)


class Eagle3Head(nn.Module):
    """An EAGLE-3 head (module docstring): fc over the target's auxiliary hidden states, one
    decoder layer, a norm and an LM head over a draft vocabulary mapped to target ids by d2t."""

    is_drafting_head = True
    method = METHOD

    def __init__(self, config, *, draft_vocab_size: int, aux_layers: tuple[int, ...] | None,
                 norm_before_residual: bool, target_hidden_size: int | None = None,
                 own_embeddings: bool = False):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        if int(getattr(config, "num_hidden_layers", 1)) != 1:
            raise SpecpairError(f"EAGLE-3 heads of {config.num_hidden_layers} layers: only "
                                "one-layer heads (what speculators and EAGLE-3 publish) load")
        self.config = config
        D = config.hidden_size
        # None: vLLM's default for the target it drafts for (default_aux_layers), which the
        # drafter knows (EAGLE-3's own release names no layers).
        self.aux_layers = None if aux_layers is None else tuple(sorted(int(i) for i in aux_layers))
        if self.aux_layers is not None and len(set(self.aux_layers)) != len(self.aux_layers):
            raise SpecpairError(f"EAGLE-3 auxiliary layers {list(aux_layers)}: distinct layer "
                                "numbers needed")
        self.aux_count = len(self.aux_layers) if self.aux_layers else 3
        self.target_hidden_size = int(target_hidden_size or D)
        self.norm_before_residual = bool(norm_before_residual)
        self.fc = nn.Linear(self.aux_count * self.target_hidden_size, D, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, D) if own_embeddings else None
        self.layer = Eagle3Layer(config, self.norm_before_residual)
        self.norm = LlamaRMSNorm(D, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(D, int(draft_vocab_size), bias=False)
        self.register_buffer("d2t", torch.zeros(int(draft_vocab_size), dtype=torch.long))

    @property
    def draft_token_ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def rotary(self, x: torch.Tensor, positions: torch.Tensor):
        """(cos, sin) [B, n, hd] for positions [B, n]."""
        return self.rotary_emb(x, positions)

    def forward(self, embeds: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """Training and checking forward over whole windows (causal): embeds [B, L, D] of
        x[1..L], aux [B, L, A*T] of positions 0..L-1 -> the pre-norm outputs [B, L, D]."""
        B, L, _ = embeds.shape
        positions = torch.arange(L, device=embeds.device).view(1, L).expand(B, L)
        cos, sin = self.rotary(embeds, positions)
        return self.layer(embeds, self.fc(aux), cos, sin, None, None)[0]

    def unroll(self, embeds: torch.Tensor, aux: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """EAGLE-3's training-time test, as heads.EagleHead.unroll: step d predicts from pairs
        (x[j+d], the head's own step d-1 output at j), attending to step 1's keys at positions
        0..j and to its own chain. embeds/aux: [B, L, ...] of x[0..L-1] and positions 0..L-1.
        -> per step d the pre-norm outputs [B, L-d, D] (index j: the chain after pair j)."""
        if depth < 1:
            raise SpecpairError("depth must be >= 1")
        B, L, _ = embeds.shape
        if L - depth < 1:
            raise SpecpairError(f"a window of {L} tokens cannot be unrolled {depth} steps")
        keys, values, out = [], [], []
        previous = self.fc(aux[:, :-1])
        device = embeds.device
        for d in range(1, depth + 1):
            n = L - d
            positions = torch.arange(d - 1, d - 1 + n, device=device).view(1, n).expand(B, n)
            cos, sin = self.rotary(embeds, positions)
            blocks = [torch.arange(L - 1, device=device).unsqueeze(0)
                      <= torch.arange(n, device=device).unsqueeze(1)]
            blocks += [torch.eye(n, L - e, dtype=torch.bool, device=device) for e in range(2, d + 1)]
            mask = torch.cat(blocks, dim=1)
            # Keys of earlier steps are read (not recomputed); this step's are appended.
            past = (torch.cat(keys, dim=2), torch.cat(values, dim=2)) if keys else None
            h, (k, v) = self.layer(embeds[:, d:], previous[:, :n], cos, sin, past,
                                   mask.view(1, 1, n, -1))
            P = past[0].shape[2] if past is not None else 0
            keys.append(k[:, :, P:])
            values.append(v[:, :, P:])
            previous = h
            out.append(h)
        return out


def _llama_config(layer: dict):
    from transformers import LlamaConfig

    layer = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**layer)
    config._attn_implementation = "sdpa"
    return config


def load_eagle3_head(path, device: torch.device, dtype: torch.dtype) -> Eagle3Head:
    """A published EAGLE-3 head (either layout, module docstring), ready to draft."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    layout = eagle3_layout(raw)
    if layout == "speculators":
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise SpecpairError(f"{path}/config.json: a speculators eagle3 head without "
                                "transformer_layer_config")
        norm_before_residual = bool(raw.get("norm_before_residual", True))  # vLLM's default
    elif layout == "original":
        layer, norm_before_residual = raw, False
    else:
        raise SpecpairError(f"{path}: not an EAGLE-3 head (no speculators_model_type: eagle3, "
                            f"no architecture {ORIGINAL_ARCHITECTURES[0]})")
    for option in ("norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(option):
            raise SpecpairError(f"{path}: EAGLE-3 heads with {option} are not supported yet")
    if (raw.get("layer_type") or layer.get("model_type", "llama")) not in ("llama",):
        raise SpecpairError(f"{path}: EAGLE-3 heads with a {layer.get('model_type')!r} layer are "
                            "not supported (Llama-layer heads only)")
    if "sliding_attention" in (layer.get("layer_types") or []) and layer.get("sliding_window"):
        raise SpecpairError(f"{path}: the head's layer attends a sliding window of "
                            f"{layer['sliding_window']} tokens; sliding-window EAGLE-3 layers are "
                            "not supported yet (a head trained with full attention loads)")
    config = _llama_config(layer)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecpairError(f"{path}: no .safetensors weights (a pytorch_model.bin head: convert "
                            "it to safetensors first)")
    weights = {}
    try:
        for file in files:
            weights.update(load_file(str(file)))
    except (OSError, RuntimeError, SafetensorError) as exc:
        raise SpecpairError(f"cannot read the head's weights in {path}: {exc}") from exc
    weights = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
               for k, v in weights.items()}
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    draft_vocab = int(raw.get("draft_vocab_size") or layer.get("draft_vocab_size")
                      or config.vocab_size)
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    head = Eagle3Head(config, draft_vocab_size=draft_vocab, aux_layers=tuple(aux) if aux else None,
                      norm_before_residual=norm_before_residual,
                      target_hidden_size=raw.get("target_hidden_size"),
                      own_embeddings="embed_tokens.weight" in weights)
    state = {}
    for name, tensor in weights.items():
        if name == "t2d":
            continue                                   # the inverse map: d2t says it all
        if name.startswith("layers.0."):
            name = "layer." + name.removeprefix("layers.0.")
        state[name] = tensor
    if "d2t" not in state:
        if draft_vocab != config.vocab_size:
            raise SpecpairError(f"{path}: draft vocabulary of {draft_vocab} without d2t")
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    state["d2t"] = state["d2t"].long()
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary_emb")]
    if missing or unexpected:
        raise SpecpairError(f"{path}: EAGLE-3 weights do not match its config "
                            f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    ids = head.draft_token_ids
    if len(ids) > 1 and bool((ids[1:] <= ids[:-1]).any()):
        raise SpecpairError(f"{path}: d2t does not map the draft vocabulary to increasing ids")
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)



def build_eagle3_head(target_model, draft_token_ids: torch.Tensor,
                      aux_layers: tuple[int, ...] | None = None, seed: int = 0,
                      norm_before_residual: bool = False) -> Eagle3Head:
    """A fresh EAGLE-3 head for this target: its dimensions, one layer, `aux_layers` (default
    vLLM's, default_aux_layers), the norm copied from the target's final norm and the LM-head
    rows of the draft vocabulary from the target's. fc starts as "the hidden state is the last
    auxiliary layer's" and the layer's output projections small, so an untrained head drafts
    what the target's last auxiliary state predicts (its best guess at the next token)."""
    from transformers import LlamaConfig

    tcfg = target_model.config
    if getattr(tcfg, "model_type", None) != "llama":
        raise SpecpairError(f"EAGLE-3 heads here need a Llama-family target, not {tcfg.model_type!r}")
    layers = int(tcfg.num_hidden_layers)
    aux = tuple(sorted(aux_layers or default_aux_layers(layers)))
    ids = torch.as_tensor(draft_token_ids, dtype=torch.long)
    if ids.ndim != 1 or not len(ids) or bool((ids[1:] <= ids[:-1]).any()):
        raise SpecpairError("draft vocabulary: a non-empty, strictly increasing list of token ids")
    config = LlamaConfig(**{**tcfg.to_dict(), "num_hidden_layers": 1, "layer_types": None,
                            "architectures": None, "tie_word_embeddings": False})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    head = Eagle3Head(config, draft_vocab_size=len(ids), aux_layers=aux,
                      norm_before_residual=norm_before_residual)
    D = config.hidden_size
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, 0.02)
        head.fc.weight.zero_()
        head.fc.weight[:, (len(aux) - 1) * D:] = torch.eye(D)
        head.layer.self_attn.o_proj.weight.mul_(0.1)
        head.layer.mlp.down_proj.weight.mul_(0.1)
        head.norm.load_state_dict(target_model.model.norm.state_dict())
        weight = target_model.lm_head.weight.detach()
        head.lm_head.weight.copy_(weight[ids.to(weight.device)].float().cpu())
        head.d2t.copy_(ids - torch.arange(len(ids)))
    head.lm_head.weight.requires_grad_(False)
    return head


def save_eagle3_head(head: Eagle3Head, out, *, verifier: str = "", about: dict | None = None) -> None:
    """The `speculators` layout (module docstring), which vLLM serves: through
    --speculative-config {"method": "eagle3", "model": out} or as --model. No tokenizer (the
    target's is the head's)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layer = head.config.to_dict()
    layer.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], model_type="llama")
    for key in ("_attn_implementation", "_attn_implementation_internal", "transformers_version"):
        layer.pop(key, None)
    draft_vocab = len(head.d2t)
    config = {
        "speculators_model_type": SPECULATORS_TYPE,
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": head.norm_before_residual,
        "target_hidden_size": head.target_hidden_size,
        "speculators_config": {
            "algorithm": SPECULATORS_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        "specpair": dict(about or {}),
    }
    if head.aux_layers is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(head.aux_layers)
    # The whole vocabulary needs no map, and vLLM then has no place to load one into.
    mapped = draft_vocab != head.config.vocab_size or bool(head.d2t.any())
    weights = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("rotary_emb") or (name == "d2t" and not mapped):
            continue
        if name.startswith("layer."):
            name = "layers.0." + name.removeprefix("layer.")
        weights[name] = tensor.detach().contiguous().cpu()
    if mapped:   # t2d: which target ids the draft vocabulary holds (speculators writes it)
        t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
        t2d[head.draft_token_ids.cpu()] = True
        weights["t2d"] = t2d
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
