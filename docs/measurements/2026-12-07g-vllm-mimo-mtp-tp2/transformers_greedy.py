"""transformers' greedy ids (our engine's general path, target alone) for the prompts of serve_mimo_mtp_tp.py."""
import sys, torch
sys.path.insert(0, "/work/main/tests")
from tiny_models import make_tokenizer
from transformers import AutoModelForCausalLM
tok = make_tokenizer()
a = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=True)
a = list(a["input_ids"]) if hasattr(a, "keys") else list(a)
b = tok("one two three one two three one two")["input_ids"]
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
for p in (a, b):
    ids, out = torch.tensor([p]), []
    with torch.no_grad():
        for _ in range(24):
            t = int(m(ids).logits[0, -1].argmax()); out.append(t); ids = torch.cat([ids, torch.tensor([[t]])], 1)
    print(out)
