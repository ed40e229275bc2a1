"""Which cache and step a model runs: the kind asked for (`resolve_kv_kind`), whether the static
step can run the model (`check_static_step`), the cache itself (`kv_model`) and what a step is
(`step_description`, `attention_description`: what a figure measured)."""

from __future__ import annotations

import logging
import os

import torch

from specpair import cpu_kernels
from specpair.errors import SpecpairError
from specpair.kv import fixed_step
from specpair.kv.buckets import bucket
from specpair.kv.compiling import compile_options
from specpair.kv.dynamic import BatchedKVModel
from specpair.kv.families import supports
from specpair.kv.static import StaticKVModel


log = logging.getLogger(__name__)


KV_KINDS = ("static", "dynamic")


def attention_description(device: torch.device, dtype: torch.dtype) -> str:
    """What attends in a step, chosen on purpose: the fixed step's masked math (`attend`) on
    CUDA and outside float32, never SDPA's cuDNN backend, which builds a plan per call when the
    attended length changes; torch's SDPA elsewhere (the C layer where it applies)."""
    if fixed_step.fixed_step_applies(device, dtype):
        return "masked math over the capacity bucket, own key apart (bitwise across token counts)"
    # (MAX_TOKENS is the built library's, 0 until it loads: its name then, not a stale number)
    return (f"C layer (float32 CPU, <= {cpu_kernels.MAX_TOKENS or 'MAX_TOKENS'} tokens), else torch SDPA "
            "with a boolean mask")


def resolve_kv_kind(kind: str | None = None) -> str:
    """The cache kind asked for, else SPECPAIR_KV, else static. "dynamic" is the eager fallback
    switch: the hole-masking cache and Hugging Face's own forward, as before this module."""
    kind = kind or os.environ.get("SPECPAIR_KV") or "static"
    if kind not in KV_KINDS:
        raise SpecpairError(f"KV cache kind {kind!r}: choose one of {', '.join(KV_KINDS)}")
    return kind


def check_static_step(model, kind: str | None = None) -> str | None:
    """Whether `model` runs the static step under the cache kind asked for (`kind`, else
    SPECPAIR_KV, else static): None when it does, or where the dynamic cache was asked for.
    Otherwise the static cache asked for by name (`kind` or SPECPAIR_KV) is refused with the
    reason, and by default the general path (dynamic.BatchedKVModel, Hugging Face's forward,
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
                "forward, dynamic.BatchedKVModel)", getattr(model.config, "model_type", "?"), why)
    return why


def kv_model(model, vocab_size: int | None = None, kind: str | None = None,
             compile: str | None = None, token_bucket: int | None = None):
    """The cache for this model: static where supported (unless asked for dynamic), else the
    hole-masking BatchedKVModel over Hugging Face's forward. `token_bucket`: the most tokens a
    row feeds in a step after its prompt (the fixed step's width)."""
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
    if static and fixed_step.fixed_step_applies(device, param.dtype):
        out.update(fixed_step=True, token_bucket=bucket(token_bucket or 1),
                   attention=attention_description(device, param.dtype))
        if out["compiled"]:
            out["compile"] = compile_options(device)
    if static and device.type == "cpu":
        out["cpu_kernels"] = cpu_kernels.status()
    return out
