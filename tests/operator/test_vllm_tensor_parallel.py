"""Tensor parallel on a vLLM pair, before any vLLM starts: the target's heads must split evenly
over the ranks (vLLM's own rule, read from the target's real config.json and said by the gate as
its failure reason), and a vLLM pod or gate Job on the CPU binds each rank to its own cores
(VLLM_CPU_OMP_THREADS_BIND: vLLM's default binding refuses more ranks than NUMA nodes)."""

from __future__ import annotations


import pytest

from specpair.vllm_parallel import DEFAULT_TARGET_HEADS, OMP_BIND_ENV, model_config, tensor_parallel_refusal
from specpair_operator.desired import engine_objects, gate_objects
from specpair_operator.release import content as release
from specpair_operator.crd.validation import validate_spec

PROMPTS = [{"prompt": "def fib(n):", "category": "code"}]


@pytest.mark.parametrize("heads, kv, tensor, words", [
    (4, 2, 1, None),
    (4, 2, 2, None),     # the tiny Llama vLLM-CPU serves at tensor parallel 2
    (4, 2, 4, None),     # fewer KV heads than ranks: each replicated over 2 ranks
    (4, 1, 4, None),
    (9, 3, 2, "parallelism.tensor 2 does not divide the target's 9 attention heads: vLLM splits them evenly over "
              "its tensor-parallel ranks; use a tensor size that divides 9"),   # SmolLM2's shape
    (12, 6, 4, "parallelism.tensor 4 does not divide the target's 6 KV heads"),
    (12, 4, 6, "parallelism.tensor 6 is neither a divisor nor a multiple of the target's 4 KV heads"),
])
def test_the_heads_must_split_evenly_over_the_tensor_ranks(tmp_path, heads, kv, tensor, words):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16 * heads, num_attention_heads=heads, num_key_value_heads=kv).save_pretrained(tmp_path)
    refusal = tensor_parallel_refusal(model_config(tmp_path), tensor)
    assert refusal is None if words is None else refusal.startswith(words)


def test_a_config_without_head_counts_is_left_to_vllm(tmp_path):
    assert model_config(tmp_path) is None and tensor_parallel_refusal(None, 2) is None
    assert tensor_parallel_refusal({"model_type": "mamba"}, 2) is None
    # A multimodal config's text model is what is split.
    assert "9 attention heads" in tensor_parallel_refusal({"text_config": {"num_attention_heads": 9}}, 2)


def test_the_default_target_s_heads_are_the_embedded_model_s():
    """The one target whose heads the operator knows without a download: held to the real model."""
    from specpair.models import resolve_source

    config = model_config(resolve_source("default", progress=lambda *_: None))
    assert {k: config[k] for k in DEFAULT_TARGET_HEADS} == DEFAULT_TARGET_HEADS


@pytest.mark.parametrize("target, tensor, refused", [
    ({"source": "default"}, 2, "spec.parallelism.tensor: Invalid value: 2: parallelism.tensor 2 does not divide the "
                               "target's 9 attention heads"),
    ({"source": "default"}, 3, None),
    ({"source": "default"}, 1, None),
    ({"source": "HuggingFaceTB/SmolLM2-135M"}, 2, None),     # not known here: its gate Job reads its config
])
def test_the_operator_refuses_a_split_of_a_target_it_knows(target, tensor, refused):
    spec = {"engine": "vllm", "target": target, "draft": {"drafter": "ngram"}, "parallelism": {"tensor": tensor}}
    errors = validate_spec(spec)
    assert errors == [] if refused is None else (len(errors) == 1 and errors[0].startswith(refused))


def test_the_gate_fails_a_split_the_heads_do_not_allow_before_starting_vllm(tiny_tokenizer, tmp_path, monkeypatch):
    """A tiny target of SmolLM2's head shape (9 heads, 3 KV heads) at tensor 2: the verdict's
    reason is the split, and no vLLM server starts (the vLLM python named here does not exist)."""
    from tiny_models import make_family_model, save_tiny
    from specpair.gate import run_gate

    target = save_tiny(make_family_model(tiny_tokenizer, "qwen2", seed=4, hidden=72, heads=9, kv_heads=3),
                       tmp_path / "target")
    rel = release.build_release("tiny", "t", {"engine": "vllm", "vllm": {"dtype": "float32"},
                                              "target": {"source": target}, "draft": {"drafter": "ngram"},
                                              "parallelism": {"tensor": 2}}, PROMPTS)
    monkeypatch.setenv("SPECPAIR_VLLM_PYTHON", "/nonexistent/python")
    verdict, golden = run_gate(rel, progress=lambda *_: None)
    # The split is the only reason (a server started from the python named above would have failed
    # with its own), with no golden outputs: said before any vLLM server starts.
    assert verdict["passed"] is False and golden == []
    assert verdict["reasons"] == ["parallelism.tensor 2 does not divide the target's 9 attention heads: vLLM splits "
                                  "them evenly over its tensor-parallel ranks; use a tensor size that divides 9"]


MLA = {"model_type": "deepseek_v3", "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 512}


@pytest.mark.parametrize("config, tensor, on_cpu, refused", [
    (MLA, 2, True, True),                                      # the finding: split MLA on vLLM-CPU
    (MLA, 1, True, False),                                     # unsplit: served (MTP included)
    (MLA, 2, False, False),                                    # on GPUs: vLLM's own MLA kernels, left to the gate
    ({"text_config": MLA}, 2, True, True),                     # a multimodal config's text model
    ({**MLA, "kv_lora_rank": None}, 2, True, False),           # DeepSeek-V2-Lite-style config without MLA
    ({"model_type": "qwen2", "num_attention_heads": 2, "num_key_value_heads": 2}, 2, True, False),  # MiMo's body
    (None, 2, True, False),                                    # no config: vLLM decides
])
def test_a_split_of_multi_head_latent_attention_is_refused_on_the_cpu(config, tensor, on_cpu, refused):
    from specpair.vllm_parallel import split_latent_attention_refusal

    why = split_latent_attention_refusal(config, tensor, on_cpu)
    if not refused:
        assert why is None
        return
    kind = "the target" if "text_config" in config else "deepseek_v3"
    assert why == (f"parallelism.tensor 2 on the CPU splits {kind}'s multi-head latent attention (MLA, "
                   "kv_lora_rank 512): vLLM-CPU 0.32 answers an MLA target split over ranks otherwise than "
                   "unsplit, from the prompt's first token on, and the gate, comparing the split server with "
                   "itself, cannot see it; serve it at parallelism.tensor 1 on the CPU, or split on GPUs"), why


def test_the_gate_fails_a_split_mla_target_on_the_cpu_before_starting_vllm(tiny_tokenizer, tmp_path, monkeypatch):
    """The tiny DeepSeek-V3 with its MTP layer (the checkpoint vLLM-CPU answered otherwise at
    tensor parallel 2 than at 1), as an MTP pair at tensor 2: the verdict's reason is the split
    MLA, and no vLLM server starts (the vLLM python named here does not exist). The heads split
    evenly (2 over 2): only the MLA rule refuses it."""
    from tiny_models import save_tiny_deepseek_v3_mtp
    from specpair.gate import run_gate
    from specpair.gate.vllm import vllm_runs_on_cpu

    assert vllm_runs_on_cpu()       # this machine: vLLM's CPU build, no CUDA device
    target = save_tiny_deepseek_v3_mtp(tiny_tokenizer, tmp_path / "target")
    rel = release.build_release("tiny", "t", {"engine": "vllm", "vllm": {"dtype": "float32"},
                                              "target": {"source": target},
                                              "draft": {"source": target, "method": "mtp"},
                                              "speculation": {"k": 1}, "parallelism": {"tensor": 2}}, PROMPTS)
    monkeypatch.setenv("SPECPAIR_VLLM_PYTHON", "/nonexistent/python")
    verdict, golden = run_gate(rel, progress=lambda *_: None)
    assert verdict["passed"] is False and golden == []
    (reason,) = verdict["reasons"]
    assert reason.startswith("parallelism.tensor 2 on the CPU splits deepseek_v3's multi-head latent attention "
                             "(MLA, kv_lora_rank 512)"), reason


def _binding(spec_change: dict, rollout: dict) -> tuple[str | None, str | None]:
    """VLLM_CPU_OMP_THREADS_BIND in the engine Deployment's and the gate Job's container env."""
    spec = {"engine": "vllm", "target": {"source": "t"}, "draft": {"drafter": "ngram"}, **spec_change}
    rel = release.build_release("chat", "team", spec, PROMPTS)
    dep = engine_objects.engine_deployment("chat", "team", rel, "d" * 64, "1", rollout, "http://mlflow")
    job = gate_objects.gate_job("chat", "team", rel, "d" * 64, "1", rollout, "http://mlflow")

    def env(obj: dict) -> str | None:
        container = obj["spec"]["template"]["spec"]["containers"][0]       # vLLM's (beside it: its companion)
        return next((e["value"] for e in container["env"] if e["name"] == OMP_BIND_ENV), None)
    return env(dep), env(job)


@pytest.mark.parametrize("spec_change, rollout, bind", [
    ({"parallelism": {"tensor": 2}}, {}, "0|1"),                                   # as verified on vLLM-CPU
    ({"parallelism": {"tensor": 2}}, {"resources": {"limits": {"cpu": "4"}}}, "0-1|2-3"),
    ({"parallelism": {"tensor": 2}}, {"resources": {"requests": {"cpu": "5"}}}, "0-1|2-3"),
    ({"parallelism": {"tensor": 2}}, {"resources": {"limits": {"cpu": "500m"}}}, "0|1"),
    ({"parallelism": {"tensor": 2, "pipeline": 2}}, {"resources": {"limits": {"cpu": "8"}}}, "0-1|2-3|4-5|6-7"),
    ({"parallelism": {"tensor": 2}}, {"resources": {"limits": {"nvidia.com/gpu": 2}}}, None),   # GPUs: not bound
    ({}, {}, None),                                                                # one rank: vLLM's default
])
def test_a_vllm_pod_on_the_cpu_binds_each_rank_to_its_own_cores(spec_change, rollout, bind):
    assert _binding(spec_change, rollout) == (bind, bind)
