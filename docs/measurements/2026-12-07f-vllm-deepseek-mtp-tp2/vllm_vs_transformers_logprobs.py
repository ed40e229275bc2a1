import json, os, sys, time, urllib.request
sys.path.insert(0, "/work/main/tests")
import torch
from vllm_test_env import VLLM_TEST_ENV
from specpair.vllm_peer import VllmServer, default_python
from tiny_models import make_tokenizer
from transformers import DeepseekV3ForCausalLM
model, tp = sys.argv[1], int(sys.argv[2])
tok = make_tokenizer()
PROMPTS = ["one two three one two three one two", "abc abc abc abc abc", "Hello there"]
reqs = []
for p in PROMPTS:
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
    reqs.append((ids["input_ids"] if not isinstance(ids, list) else ids, 12))
reqs.append((tok("Hello there")["input_ids"], 24))
env = {**VLLM_TEST_ENV}; args = []
if tp > 1:
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"; args = ["--tensor-parallel-size", "2"]
m = DeepseekV3ForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
t0 = time.monotonic()
with VllmServer(default_python(), model, start_timeout=1200, max_model_len=512,
                log_path=f"diag2_tp{tp}.log", extra_env=env, extra_args=args) as server:
    print("start", round(time.monotonic() - t0, 1), os.getloadavg(), flush=True)
    for ids, n in reqs:
        body = json.dumps({"model": server.served_model_name, "prompt": ids, "max_tokens": n, "temperature": 0,
                           "logprobs": 5, "return_token_ids": True, "return_tokens_as_token_ids": True}).encode()
        req = urllib.request.Request(f"{server.base_url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            ch = json.load(r)["choices"][0]
        out = ch["token_ids"]
        x = torch.tensor([ids + out])
        with torch.no_grad():
            lp = torch.log_softmax(m(x).logits[0], -1)
        worst, hf_path = 0.0, []
        for i, top in enumerate(ch["logprobs"]["top_logprobs"]):
            row = lp[len(ids) - 1 + i]
            hf_path.append(int(row.argmax()))
            for key, v in top.items():
                tid = int(key.split(":")[1])
                worst = max(worst, abs(v - float(row[tid])))
        print("n", len(out), "equal HF argmax on vLLM's path:", hf_path == out, "max |dlogprob| %.2e" % worst, flush=True)
