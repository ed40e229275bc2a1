"""Which models the static step runs (`supports`) and each layer's sliding window: read from the
model's config and modules only."""

from __future__ import annotations

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
