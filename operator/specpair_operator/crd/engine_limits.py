"""What a pair's engine cannot do, refused by the operator's own check (validation.validate_spec
calls `refusals` once the spec passes the CRD's schema), in the API server's wording so that a
pair past the CRD is Stalled with InvalidSpec and the reason, before anything is gated or served:

- an autoscaling metric the pair's engine does not export (autoscaling_signals.metric_refusal);
- a vLLM pair whose `parallelism.tensor` does not split its target's heads evenly, where the
  operator knows the target's heads without downloading it (the embedded default target);
  any other target is checked by its gate Job from its config.json (specpair.vllm_parallel).
"""

from __future__ import annotations

from typing import Any

from specpair.contract import parallelism
from specpair.vllm_parallel import known_config, tensor_parallel_refusal

from specpair_operator.crd.autoscaling_signals import spec_refusals


def refusals(spec: Any) -> list[str]:
    if not isinstance(spec, dict):
        return []
    return spec_refusals(spec) + tensor_refusals(spec)


def tensor_refusals(spec: dict[str, Any]) -> list[str]:
    if spec.get("engine") != "vllm":
        return []   # the specpair engine serves one device (the CRD refuses a split there)
    tensor = parallelism(spec)["tensor"]
    why = tensor_parallel_refusal(known_config((spec.get("target") or {}).get("source")), tensor)
    return [f"spec.parallelism.tensor: Invalid value: {tensor}: {why}"] if why else []
