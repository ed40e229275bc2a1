import json, sys, torch
from transformers import AutoTokenizer, DeepseekV3ForCausalLM
m = sys.argv[1]
tok = AutoTokenizer.from_pretrained(m)
model = DeepseekV3ForCausalLM.from_pretrained(m, torch_dtype=torch.float32).eval()
out = []
for p in ["def add(a, b):\n    return", "The quick brown fox jumps over the lazy"]:
    ids = tok(p, return_tensors="pt").input_ids
    with torch.no_grad():
        g = model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    out.append(g[0, ids.shape[1]:].tolist())
print(json.dumps(out))
