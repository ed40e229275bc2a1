"""The arithmetic both torch steps share (the general step, general_step.py, and the fixed step,
fixed_step.py), written once so they stay the same bits."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As Hugging Face's LlamaRMSNorm: statistics in float32, scaled in the input dtype.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
