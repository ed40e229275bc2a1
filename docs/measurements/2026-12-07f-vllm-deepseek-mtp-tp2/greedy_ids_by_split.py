import json, os, sys, time, urllib.request
sys.path.insert(0, "/work/main/tests")
from vllm_test_env import VLLM_TEST_ENV
from specpair.vllm_peer import VllmServer, default_python
from tiny_models import make_tokenizer
model, tp, mp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ids = make_tokenizer()("Hello there")["input_ids"]
env = {**VLLM_TEST_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": mp}; args = []
if tp > 1:
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"; args = ["--tensor-parallel-size", str(tp)]
t0 = time.monotonic()
with VllmServer(default_python(), model, start_timeout=1200, max_model_len=512, log_path=f"diag3_tp{tp}_mp{mp}.log",
                extra_env=env, extra_args=args) as server:
    print("start", round(time.monotonic() - t0, 1), os.getloadavg(), flush=True)
    body = json.dumps({"model": server.served_model_name, "prompt": ids, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{server.base_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        print("tp", tp, "mp", mp, json.load(r)["choices"][0]["token_ids"], flush=True)
