"""Qwen2, Qwen3 and Mistral on the static step: tiny random models of each family, built from
their own configs (tiny_models.make_family_model), decode what Hugging Face's greedy `generate`
decodes, speculate to the same tokens as target-only, and a token's logits in a verification equal
its one-token steps' bitwise, through the C layer (float32) and the fixed step (bf16 on the CPU).
A model the static step cannot run is refused under --kv static and served by the general path
otherwise, said once."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch

from specpair import cpu_kernels
from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.errors import SpecpairError
from specpair.kv import families, fixed_step
from specpair.kv.static import StaticKVModel

# Each family with what sets it apart from Llama switched on, and windows shorter than a
# prompt and its reply, so a step that ignored them would attend keys Hugging Face's does not.
FAMILIES = {
    "qwen2": ("qwen2", {}),                                          # q/k/v biases
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 9,
                               "max_window_layers": 1}),             # layer 1 windowed, 0 not
    "qwen3": ("qwen3", {"head_dim": 24}),                            # per-head q/k norms
    "mistral": ("mistral", {"sliding_window": 11}),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}    # the C layer; the fixed step
PROMPTS = ["def foo(x):\n    return", "Hello world, hello world, hello",
           "import os\nimport sys\nfrom pathlib import Path\n\n\ndef main():\n"]   # > 16 tokens
PARAMS = GenerationParams(max_new_tokens=20)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module", params=list(DTYPES))
def target(request, family, tiny_tokenizer):
    from tiny_models import make_family_model
    kind, options = FAMILIES[family]
    return make_family_model(tiny_tokenizer, kind, seed=3, dtype=DTYPES[request.param], **options)


def _hf_greedy(loaded, ids: list[int], n: int) -> list[int]:
    """Hugging Face's own greedy decoding (its forward, its cache, its masks), up to its eos."""
    with torch.no_grad():
        out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                                   dtype=torch.long),
                                    max_new_tokens=n, do_sample=False, top_k=None, top_p=None,
                                    temperature=None)
    return out[0, len(ids):].tolist()


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:ids.index(eos)] if eos in ids else ids


@pytest.fixture
def hf_forward_forbidden(monkeypatch):
    """Hugging Face's forward of the model's body raises: only the general path calls it (the
    static step runs the layers itself), so a test under this fixture proves the static step ran."""
    def forbidden(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__}.forward ran: the general path, not the static step")

    def forbid(model):
        monkeypatch.setattr(type(model.model), "forward", forbidden)
    return forbid


def test_each_family_runs_the_static_step(target, hf_forward_forbidden, monkeypatch):
    """The engine picks the static step for the family, and its steps run through the C layer
    (float32) or the fixed step (bf16), never through Hugging Face's forward."""
    assert families.supports(target.model) is None
    calls = {"c": 0, "fixed": 0}
    fixed_layer = fixed_step.fixed_layer

    def counting(c_call):
        def counted_c(*args, **kwargs):
            calls["c"] += 1
            return c_call(*args, **kwargs)
        return counted_c

    def counted_fixed(*args, **kwargs):
        calls["fixed"] += 1
        return fixed_layer(*args, **kwargs)

    # The C layer is reached a layer a call or all of a step's layers in one (llama_layers).
    for c_entry in ("llama_layer", "llama_layers"):
        monkeypatch.setattr(cpu_kernels, c_entry, counting(getattr(cpu_kernels, c_entry)))
    monkeypatch.setattr(fixed_step, "fixed_layer", counted_fixed)
    engine = SpeculativeEngine(target, speculation=SpeculationConfig(enabled=False), kv="static")
    step = engine.describe_step()
    assert step["kv_cache"] == "static" and "static_unsupported" not in step
    hf_forward_forbidden(target.model)
    engine.generate(PROMPTS[:1], GenerationParams(max_new_tokens=4))
    if target.dtype == torch.float32:
        assert calls["c"] > 0 and calls["fixed"] == 0
    else:
        assert step["fixed_step"] and calls["fixed"] > 0 and calls["c"] == 0


# bf16 rounds a logit of these models (about 6) by up to ~0.3 between two exact computations
# (Hugging Face's and the fixed step's), where a step that ignored a family's bias, norm or window
# moves them by ~10: two greedy choices may part at a pair of logits closer than this, no further.
BF16_TIE = 0.5


def test_greedy_equals_hugging_face_generate(target):
    """Token for token in float32; in bf16 until a step where Hugging Face's two choices are a
    rounding apart (their float32 logits within BF16_TIE), and never at a clear margin."""
    engine = SpeculativeEngine(target, speculation=SpeculationConfig(enabled=False))
    assert engine.describe_step()["kv_cache"] == "static"
    eos = target.tokenizer.eos_token_id
    results = engine.generate(PROMPTS, PARAMS)
    reference = None if target.dtype == torch.float32 else copy.deepcopy(target.model).float()
    agreed = 0
    for prompt, result in zip(PROMPTS, results):
        ids = engine.encode(prompt)
        ours = _strip_eos(result.token_ids, eos)
        want = _strip_eos(_hf_greedy(target, ids, PARAMS.max_new_tokens), eos)
        if reference is None:
            assert ours == want, prompt
            agreed += len(ours)
            continue
        same = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), None)
        if same is None:
            assert len(ours) == len(want), prompt
            agreed += len(ours)
            continue
        with torch.no_grad():
            logits = reference(torch.tensor([ids + want[:same]])).logits[0, -1]
        margin = abs(float(logits[ours[same]] - logits[want[same]]))
        assert margin < BF16_TIE, (prompt, same, margin)
        agreed += same
    # Not vacuous (a reply may end at once on eos), and past the windows (prompt and reply).
    assert agreed >= 8
    assert max(r.prompt_tokens + len(r.token_ids) for r in results) > 2 * 11


def test_speculation_equals_target_only(target):
    """A draft model of the same family (the target plus noise, also on the static step): the
    same tokens as target-only, with drafts both accepted and rejected on the way."""
    from tiny_models import perturbed_copy
    draft = perturbed_copy(target, seed=5, noise=0.05)
    plain = SpeculativeEngine(target, speculation=SpeculationConfig(enabled=False))
    want = [r.token_ids for r in plain.generate(PROMPTS, PARAMS)]
    engine = SpeculativeEngine(target, draft=draft,
                               speculation=SpeculationConfig(k=4, k_max=4, fallback_threshold=0))
    assert isinstance(engine.drafter.kv, StaticKVModel)
    results = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == want
    assert sum(r.stats.num_accepted_tokens for r in results) > 0
    assert sum(r.stats.num_draft_tokens - r.stats.num_accepted_tokens for r in results) > 0


def _one_by_one(model, fixed: bool, prompt: list[int], path: list[int]) -> torch.Tensor:
    kv = StaticKVModel(model, token_bucket=8 if fixed else None, fixed=fixed)
    kv.add_rows(1)
    kv.extend([prompt])
    return torch.stack([kv.extend([[t]])[0, -1] for t in path])


def test_a_verification_equals_one_token_steps_bitwise(target):
    """A chain of 4 and a tree (3 siblings, each off a chain token) verified at once give each
    token bitwise the logits of feeding its path a token a step, with the windows sliding across
    the verified tokens; and the logits are Hugging Face's forward's to the dtype's rounding."""
    model, fixed = target.model, target.dtype != torch.float32
    rng = random.Random(7)
    prompt = [rng.randrange(3, 300) for _ in range(13)]
    chain = [rng.randrange(3, 300) for _ in range(4)]
    siblings = [rng.randrange(3, 300) for _ in range(3)]
    kv = StaticKVModel(model, token_bucket=8 if fixed else None, fixed=fixed)
    kv.add_rows(1)
    kv.extend([prompt])
    verified = kv.extend([chain + siblings], last=7, parents=[[-1] * 4 + [0, 1, 2]])[0]
    singles = _one_by_one(model, fixed, prompt, chain)
    assert torch.equal(verified[:4], singles)
    for j, sibling in enumerate(siblings):
        path = chain[:j + 1] + [sibling]
        assert torch.equal(verified[4 + j], _one_by_one(model, fixed, prompt, path)[-1]), j
    ref = model(torch.tensor([prompt + chain])).logits[0, -4:]
    tol = 1e-4 if not fixed else 0.5
    torch.testing.assert_close(singles.float(), ref.float(), rtol=tol, atol=tol)


def test_a_model_the_static_step_cannot_run_is_refused_by_name_or_served_and_said(
        tiny_tokenizer, monkeypatch, caplog):
    """A bias on attention's output (Qwen3 with attention_bias) or another family: --kv static
    (or SPECPAIR_KV=static) refuses with the reason; by default the general path serves, said in
    one log line; --kv dynamic asks for the general path and hears nothing."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from specpair.models import wrap_model
    from tiny_models import make_family_model
    biased = make_family_model(tiny_tokenizer, "qwen3", seed=3, attention_bias=True)
    gpt2 = wrap_model(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2,
                                                 vocab_size=len(tiny_tokenizer))), tiny_tokenizer)
    off = SpeculationConfig(enabled=False)
    monkeypatch.delenv("SPECPAIR_KV", raising=False)
    for loaded, reason in ((biased, "attention_bias"), (gpt2, "model_type 'gpt2'")):
        with pytest.raises(SpecpairError, match=f"--kv static.*{reason}"):
            SpeculativeEngine(loaded, speculation=off, kv="static")
        with monkeypatch.context() as env:
            env.setenv("SPECPAIR_KV", "static")
            with pytest.raises(SpecpairError, match=reason):
                SpeculativeEngine(loaded, speculation=off)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="specpair.kv.choice"):
            engine = SpeculativeEngine(loaded, speculation=off)
        said = [r.getMessage() for r in caplog.records if r.name == "specpair.kv.choice"]
        assert len(said) == 1 and reason in said[0] and "general path" in said[0]
        assert engine.describe_step()["kv_cache"] == "dynamic"
        assert engine.generate(PROMPTS[:1], GenerationParams(max_new_tokens=3))[0].token_ids
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="specpair.kv.choice"):
            SpeculativeEngine(loaded, speculation=off, kv="dynamic")
        assert not [r for r in caplog.records if r.name == "specpair.kv.choice"]
