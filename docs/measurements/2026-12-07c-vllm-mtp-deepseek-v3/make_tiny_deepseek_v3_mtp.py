"""A tiny random DeepSeek-V3 with one MTP layer (num_nextn_predict_layers 1), all layers dense,
MLA at the CPU kernel's only size (kv_lora_rank 512 + rope 64), SmolLM2's tokenizer."""
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, AutoTokenizer
src = Path.home() / ".cache/specpair/smollm2-135m-instruct-f32"
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
tok = AutoTokenizer.from_pretrained(src)
L = 2
cfg = DeepseekV3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                       num_hidden_layers=L + 1, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                       n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=L + 2, n_group=1, topk_group=1,
                       kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                       max_position_embeddings=2048, rope_scaling=None, tie_word_embeddings=False,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="float32")
torch.manual_seed(0)
model = DeepseekV3ForCausalLM(cfg).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
tok.save_pretrained(out)
weights = load_file(out / "model.safetensors")
h, V = cfg.hidden_size, cfg.vocab_size
g = torch.Generator().manual_seed(1)
weights[f"model.layers.{L}.enorm.weight"] = torch.ones(h)
weights[f"model.layers.{L}.hnorm.weight"] = torch.ones(h)
weights[f"model.layers.{L}.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.02
weights[f"model.layers.{L}.shared_head.norm.weight"] = torch.ones(h)
weights[f"model.layers.{L}.shared_head.head.weight"] = weights["lm_head.weight"].clone()
save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
conf = json.loads((out / "config.json").read_text())
conf.update(num_hidden_layers=L, num_nextn_predict_layers=1, architectures=["DeepseekV3ForCausalLM"])
(out / "config.json").write_text(json.dumps(conf, indent=2))
print("ok", sum(v.numel() for v in weights.values()))
