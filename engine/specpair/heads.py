"""Drafting heads that learn from the target: EAGLE-style (one decoder layer over its features)
and Medusa (independent heads on the last feature).

The target already computes, for every token it verifies, the vector its LM head reads (the
normed last hidden state, the "feature"). An EAGLE head predicts the target's *next* feature
from the current one and the embedding of the token that follows it:

    f_hat[j+1] = norm(layer(fc([embed(x[j+1]), f[j]])))        (pair j sits at position j)

and drafts the token its LM head gives for f_hat. Drafting more than one token feeds the head its
own predictions (f_hat, drafted token). A head step is one small decoder layer plus a
projection onto a *draft vocabulary*: the target's most frequent tokens, whose LM-head rows are
copied from the target. On a CPU that matters: SmolLM2's full vocabulary projection is 113 MB of
a 540 MB target step, so a full-vocabulary head would cost a fifth of a target step per token.

On disk a head is a model directory kept close to what vLLM loads for its EAGLE methods:
`config.json` (a Llama config with one layer, `architectures: ["EagleLlamaForCausalLM"]`,
`draft_vocab_size`), `model.safetensors` with `fc.weight`, `layers.0.*`, `norm.weight`,
`lm_head.weight` and `d2t` (draft id -> target id offsets, as EAGLE-3 checkpoints store them), plus the target's
tokenizer, so a release registers and fingerprints it like any draft. One deviation: layer 0
keeps its input norm (vLLM's EAGLE-1 Llama drops it); specpair's layer step always has one.

Medusa heads draft all k tokens at once from the feature of the token before the last one:
head m maps it through a residual block (x + SiLU(W x)) to a vector the shared LM head reads as
the token m+1 places past the last committed one. No recurrence and no cache: cheaper per round
than EAGLE, weaker after the first position (head m never sees the drafts before it). Saved as
`architectures: ["MedusaModel"]` with `blocks.{m}.layers.0.weight` as vLLM names them; one
shared draft-vocabulary `lm_head` and `d2t` instead of vLLM's per-head LM heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specpair.errors import SpecpairError

HEAD_KEY = "specpair_head"                  # config.json: marks a directory as a drafting head
ARCHITECTURES = {"eagle": "EagleLlamaForCausalLM", "medusa": "MedusaModel"}   # vLLM's names
METHODS = tuple(ARCHITECTURES)


class DraftVocabHead(nn.Module):
    """What every head shares: a frozen LM head over a draft vocabulary (rows of the target's)
    and the map from draft ids to target ids."""

    is_drafting_head = True
    method = "head"

    def __init__(self, config, draft_token_ids: torch.Tensor):
        super().__init__()
        self.config = config
        ids = torch.as_tensor(draft_token_ids, dtype=torch.long)
        if ids.ndim != 1 or not len(ids) or bool((ids[1:] <= ids[:-1]).any()):
            raise SpecpairError("draft vocabulary: a non-empty, strictly increasing list of token ids")
        self.lm_head = nn.Linear(config.hidden_size, len(ids), bias=False)
        # Stored as EAGLE-3 does: target id = draft id + d2t[draft id].
        self.register_buffer("d2t", ids - torch.arange(len(ids)))

    @property
    def draft_token_ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t


class EagleHead(DraftVocabHead):
    """fc over [embedding, feature] -> decoder layer(s) -> next feature; LM head on a draft
    vocabulary. Shaped like a Llama model (config, model.layers, model.rotary_emb) so the static
    cache runs its layer with the same step (and C layer) as the target's."""

    method = "eagle"

    def __init__(self, config, draft_token_ids: torch.Tensor):
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm,
                                                              LlamaRotaryEmbedding)

        config._attn_implementation = "sdpa"    # a standalone layer: name its attention kernel
        super().__init__(config, draft_token_ids)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.model.rotary_emb = LlamaRotaryEmbedding(config)
        # The target's features are normed (its LM head reads them after its final norm): the
        # head's predictions pass through a norm of their own, as EAGLE-3 heads do.
        self.model.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def inputs(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The layer's input for pairs (embedding of x[j+1], feature f[j])."""
        return self.fc(torch.cat([embeds, features], dim=-1))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Training forward over whole windows [B, L, D] (causal): predicted next features."""
        x = self.inputs(embeds, features)
        L = x.shape[1]
        positions = torch.arange(L, device=x.device).unsqueeze(0)
        cos_sin = self.model.rotary_emb(x, positions)
        # An explicit causal mask: whatever attention implementation the config names.
        mask = torch.full((L, L), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        for layer in self.model.layers:
            x = layer(x, attention_mask=mask.view(1, 1, L, L), position_ids=positions,
                      position_embeddings=cos_sin)
        return self.model.norm(x)

    def unroll(self, embeds: torch.Tensor, features: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Drafting `depth` tokens from every position of a window at once, as a round does:
        EAGLE-3's "training-time test". embeds/features: [B, L, D] of x[0..L-1] and f[0..L-1].

        Step 1 is `forward`: pair j (x[j+1], f[j]) predicts f[j+1]. Step d feeds, at position
        j+d-1, the pair (x[j+d], step d-1's prediction for it) and predicts f[j+d]. It attends,
        as it would while drafting after pair j, to step 1's keys at positions 0..j (the pairs
        built on real features) and to its own chain: steps 2..d at index j. The real token
        x[j+d] stands for the drafted one: a chain counts only while its drafts were right, and
        then they are equal. Returns [B, L-d, D] per step d (index j: the chain after pair j).
        """
        if depth < 1:
            raise SpecpairError("depth must be >= 1")
        L = embeds.shape[1]
        if L - depth < 1:
            raise SpecpairError(f"a window of {L} tokens cannot be unrolled {depth} steps")
        layer = self._only_layer()
        keys, values, out = [], [], []
        previous = features[:, :-1]
        for d in range(1, depth + 1):
            n = L - d
            x = self.inputs(embeds[:, d:], previous[:, :n])
            positions = torch.arange(d - 1, d - 1 + n, device=x.device).unsqueeze(0)
            blocks = [torch.arange(L - 1, device=x.device).unsqueeze(0)
                      <= torch.arange(n, device=x.device).unsqueeze(1)]      # step 1: causal
            blocks += [torch.eye(n, L - e, dtype=torch.bool, device=x.device)
                       for e in range(2, d + 1)]                                # own chain: diagonal
            previous = self.model.norm(_layer_with_keys(layer, x, positions, self.model.rotary_emb,
                                                        keys, values, torch.cat(blocks, dim=1)))
            out.append(previous)
        return out

    def _only_layer(self):
        if len(self.model.layers) != 1:
            raise SpecpairError("unrolled drafting needs a one-layer head")
        return self.model.layers[0]


def _layer_with_keys(layer, x: torch.Tensor, positions: torch.Tensor, rotary, keys: list,
                     values: list, allowed: torch.Tensor) -> torch.Tensor:
    """A Llama decoder layer whose attention also reads the keys/values of earlier calls (kept
    in `keys`/`values`, this call's appended). allowed: [n, all keys] which keys each query may
    read. Same weights and arithmetic as the layer's own forward."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    B, n, _ = x.shape
    hd = attn.head_dim
    cos, sin = rotary(x, positions)
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(B, n, -1, hd).transpose(1, 2)
    k = attn.k_proj(h).view(B, n, -1, hd).transpose(1, 2)
    v = attn.v_proj(h).view(B, n, -1, hd).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    keys.append(k)
    values.append(v)
    k_all, v_all = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, float("-inf"))
    a = torch.nn.functional.scaled_dot_product_attention(
        q, k_all, v_all, attn_mask=mask, enable_gqa=q.shape[1] != k_all.shape[1])
    x = x + attn.o_proj(a.transpose(1, 2).reshape(B, n, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


class ResidualBlock(nn.Module):
    """Medusa's block: x + SiLU(W x), W starting at zero (the head starts as the identity)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden, bias=False)])
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(DraftVocabHead):
    """`medusa_num_heads` residual blocks over one feature; head m drafts the token m+1 places
    past the last committed one."""

    method = "medusa"

    def __init__(self, config, draft_token_ids: torch.Tensor):
        super().__init__(config, draft_token_ids)
        self.blocks = nn.ModuleList(ResidualBlock(config.hidden_size)
                                    for _ in range(int(config.medusa_num_heads)))

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, features: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """[..., D] -> [..., count, D]: the first `count` heads' vectors for the LM head."""
        return torch.stack([block(features) for block in self.blocks[:count]], dim=-2)


def _head_config(target_model, method: str, draft_token_ids: torch.Tensor, **extra):
    from transformers import LlamaConfig

    tcfg = target_model.config
    if getattr(tcfg, "model_type", None) != "llama":
        raise SpecpairError(f"drafting heads need a Llama-family target, not {tcfg.model_type!r}")
    config = LlamaConfig(**{**tcfg.to_dict(), "num_hidden_layers": 1, "layer_types": None,
                            "architectures": [ARCHITECTURES[method]], "tie_word_embeddings": False})
    config.draft_vocab_size = int(len(draft_token_ids))
    for key, value in extra.items():
        setattr(config, key, value)
    return config


def _copy_target_rows(head: DraftVocabHead, target_model, draft_token_ids: torch.Tensor) -> None:
    with torch.no_grad():
        weight = target_model.lm_head.weight.detach()
        head.lm_head.weight.copy_(weight[draft_token_ids.to(weight.device)].float().cpu())
    head.lm_head.weight.requires_grad_(False)   # the target's own rows: the head's logits are its


def build_medusa_heads(target_model, draft_token_ids: torch.Tensor, num_heads: int,
                       seed: int = 0) -> MedusaHeads:
    """Fresh Medusa heads: blocks at zero (each head starts predicting what the target's own
    next-token distribution says), LM-head rows copied from the target's."""
    if num_heads < 1:
        raise SpecpairError("Medusa needs at least one head")
    config = _head_config(target_model, "medusa", draft_token_ids, medusa_num_heads=num_heads,
                          num_hidden_layers=0)
    torch.manual_seed(seed)
    heads = MedusaHeads(config, draft_token_ids)
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block.layers:
                layer.weight.zero_()
    _copy_target_rows(heads, target_model, draft_token_ids)
    return heads


def build_eagle_head(target_model, draft_token_ids: torch.Tensor, seed: int = 0) -> EagleHead:
    """A fresh head for this target: its dimensions, one layer and the norm initialised from the
    target's last layer and final norm (they work in the same feature space), fc starting as
    "the next feature is the current one", and LM-head rows copied from the target's for the
    draft vocabulary."""
    config = _head_config(target_model, "eagle", draft_token_ids)
    torch.manual_seed(seed)
    head = EagleHead(config, draft_token_ids)
    hidden = config.hidden_size
    with torch.no_grad():
        head.model.layers[0].load_state_dict(target_model.model.layers[-1].state_dict())
        head.model.norm.load_state_dict(target_model.model.norm.state_dict())
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.fc.weight[:, :hidden].normal_(0.0, 0.02)
    _copy_target_rows(head, target_model, draft_token_ids)
    return head


def is_head_dir(path) -> bool:
    """Whether `path` holds a drafting head: one `specpair distill` wrote, or a published
    EAGLE-3 head (eagle3.py: the speculators layout or EAGLE-3's own)."""
    from specpair.eagle3 import eagle3_layout

    config = Path(path) / "config.json"
    try:
        raw = json.loads(config.read_text()) if config.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return False
    return HEAD_KEY in raw or eagle3_layout(raw) is not None


def save_head(head: DraftVocabHead, out, tokenizer, about: dict) -> None:
    """config.json + model.safetensors (vLLM's names) + the target's tokenizer."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    config["architectures"] = [ARCHITECTURES[head.method]]
    config["draft_vocab_size"] = len(head.d2t)
    config[HEAD_KEY] = {"method": head.method, **about}
    weights = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("model.rotary_emb"):
            continue                                   # recomputed from the config
        weights[name.removeprefix("model.")] = tensor.detach().contiguous().cpu()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save_pretrained(out)


def load_head(path, device: torch.device, dtype: torch.dtype) -> DraftVocabHead:
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    from specpair.eagle3 import eagle3_layout, load_eagle3_head

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    if eagle3_layout(raw) is not None:
        return load_eagle3_head(path, device, dtype)
    method = raw.get(HEAD_KEY, {}).get("method")
    if method not in METHODS:
        raise SpecpairError(f"{path}: unknown drafting head method {method!r} "
                            f"(known: {', '.join(METHODS)})")
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != HEAD_KEY})
    from safetensors import SafetensorError

    try:
        weights = load_file(str(path / "model.safetensors"))
    except (OSError, RuntimeError, SafetensorError) as exc:
        raise SpecpairError(f"cannot read the head's weights in {path}: {exc}") from exc
    if "d2t" not in weights:
        raise SpecpairError(f"{path}/model.safetensors has no d2t (draft vocabulary)")
    d2t = weights["d2t"].long()
    kind = EagleHead if method == "eagle" else MedusaHeads
    head = kind(config, torch.arange(len(d2t)) + d2t)
    state = {("model." if k.startswith(("layers.", "norm.")) else "") + k: v for k, v in weights.items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("model.rotary_emb")]
    if missing or unexpected:
        raise SpecpairError(f"{path}: head weights do not match its config "
                            f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    head.lm_head.weight.requires_grad_(False)
    return head.to(device=device, dtype=dtype).eval()


def draft_vocabulary(samples: list[torch.Tensor], size: int, always: list[int]) -> torch.Tensor:
    """The `size` tokens most frequent across `samples` (each weighed as a whole, whatever its
    length: e.g. the corpus, and the target's own greedy predictions over it), plus `always`
    (e.g. end-of-sequence ids), as increasing ids."""
    rows = max([int(s.max()) + 1 for s in samples if s.numel()] + [max(always, default=0) + 1])
    weight = torch.zeros(rows, dtype=torch.float64)
    for sample in samples:
        if sample.numel():
            counts = torch.bincount(sample.flatten(), minlength=rows).double()
            weight += counts / counts.sum()
    chosen = set(int(i) for i in always)
    seen = int((weight > 0).sum())
    for i in torch.argsort(weight, descending=True, stable=True)[:seen].tolist():
        if len(chosen) >= size:
            break
        chosen.add(i)
    return torch.tensor(sorted(chosen), dtype=torch.long)
