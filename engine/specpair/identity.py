"""Greedy identity between speculative and target-only output, with the evidence for a mismatch.

In fp32 the two agree token for token. In bf16/fp16 (the CUDA default) verifying k+1 tokens in
one pass sums in a different order than decoding them one at a time, and where the target's top
two logits are within rounding of each other the argmax can flip. Such a flip is a numerical tie,
not a wrong draft being accepted; a real bug shows a clear margin. So each mismatch is reported
with the target's logit margin at the first differing position, and counted as a tie only when
that margin is within the rounding of the model's dtype.
"""

from __future__ import annotations

import torch

# Mantissa bits: rounding is about 2^-bits of the largest logit; a few roundings accumulate.
_MANTISSA = {torch.float32: 23, torch.float64: 52, torch.bfloat16: 7, torch.float16: 10}


def tie_tolerance(dtype: torch.dtype, logits: torch.Tensor) -> float:
    bits = _MANTISSA.get(dtype, 23)
    return float(logits.abs().max()) * 2.0 ** -(bits - 3)


@torch.no_grad()
def first_divergence(target, prompt_ids: list[int], reference: list[int], candidate: list[int]) -> dict | None:
    """None when identical; else where they differ and the target's margin there."""
    if reference == candidate:
        return None
    n = min(len(reference), len(candidate))
    index = next((i for i in range(n) if reference[i] != candidate[i]), n)
    if index == n:      # one is a prefix of the other (e.g. a stop rule fired at another point)
        return {"index": index, "margin": None, "tie": False}
    ids = torch.tensor([prompt_ids + reference[:index]], device=target.device)
    logits = target.model(input_ids=ids).logits[0, -1].float()
    a, b = reference[index], candidate[index]
    margin = float(logits[a] - logits[b])
    tol = tie_tolerance(target.dtype, logits)
    return {"index": index, "reference_token": a, "candidate_token": b, "margin": round(margin, 6),
            "tolerance": round(tol, 6), "tie": abs(margin) <= tol}
