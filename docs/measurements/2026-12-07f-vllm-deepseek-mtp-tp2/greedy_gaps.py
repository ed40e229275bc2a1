import sys, torch
sys.path.insert(0, "tests")
from tiny_models import make_tokenizer, save_tiny_deepseek_v3_mtp
from transformers import DeepseekV3ForCausalLM
tok = make_tokenizer()
PROMPTS = ["one two three one two three one two", "abc abc abc abc abc", "Hello there"]
def path_gaps(m, ids, n):
    x = torch.tensor([ids]); gaps = []; out = []
    with torch.no_grad():
        for _ in range(n):
            lg = m(x).logits[0, -1]; top = torch.topk(lg, 2)
            gaps.append(float(top.values[0] - top.values[1])); nxt = int(top.indices[0]); out.append(nxt)
            if nxt == tok.eos_token_id: break
            x = torch.cat([x, torch.tensor([[nxt]])], 1)
    return gaps, out
for std in [float(a) for a in sys.argv[1:]]:
    for seed in (0, 1):
        d = save_tiny_deepseek_v3_mtp(tok, f"/tmp/w11-C/cand-{std}-{seed}", seed=seed, init_std=std)
        m = DeepseekV3ForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
        res = []
        for p in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            g, o = path_gaps(m, ids, 12); res.append((min(g), len(o)))
        g, o = path_gaps(m, tok("Hello there")["input_ids"], 24); res.append((min(g), len(o)))
        lg = m(torch.tensor([[5, 6, 7]])).logits[0, -1]
        print(std, seed, "logit std %.3f" % lg.std(), [(round(a, 4), b) for a, b in res], flush=True)
