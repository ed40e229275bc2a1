"""Tensor parallel 2 and MTP through real vLLM on the real control plane, in one release (issue
53): a pair with `draft.method: mtp` and `parallelism.tensor: 2` on a tiny random MiMo whose
checkpoint carries one MTP layer (tiny_models.save_tiny_mimo_mtp: a Qwen2 body of 2 heads and
2 KV heads of 64, one to a rank; vLLM's MiMoForCausalLM and MiMoMTPModel). The operator (real
Kopf) gates it in a Job that runs the golden prompts through two real vLLM servers, each split
over two CPU ranks (target-only, then drafting with the MTP layer): greedy identity 1.0, vLLM's
own counters saw MTP drafts, and the gate's golden outputs are our engine's target-only output,
unsplit (the reference the split does not share: the gate itself compares the split server with
itself). It promotes the release and rolls out one engine pod whose vLLM runs split in two (each
rank bound to a core of its own, VLLM_CPU_OMP_THREADS_BIND "0|1"), drafting with the same MTP
layer, behind the pod's companion; the operator verifies the pod's identity. That pod's greedy
replies to the golden prompts, through vLLM's OpenAI API, are our engine's target-only ids, id for
id: tensor parallel 2 and MTP answer as the target alone on one device does.

A split target with multi-head latent attention (DeepSeek-V3's MLA) is refused on the CPU before
any vLLM starts (test_vllm_tensor_parallel.py): vLLM-CPU 0.32 answered one split otherwise than
unsplit (docs/measurements/2026-12-07f-vllm-deepseek-mtp-tp2.md).

No autoscaling here (test_operator_vllm.py has it at tensor parallel 1): a split pair is gated
and one pod serves it. Three vLLM starts at tensor parallel 2 (the gate's two, then the pod's);
by hand one took 76 s at load 1-10 (32 CPU-s with its two replies).

Marked `vllm`: skipped where scripts/setup-vllm.sh has not run, unless SPECPAIR_REQUIRE_VLLM is
set (CI).
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import pytest
from kopf.testing import KopfRunner

from cluster_env import OPERATOR, model_name
from vllm_cluster import (MAX_NEW_TOKENS, PROMPTS, cond, gate_record_of_vllm_v1, start_seconds,  # noqa: F401 (a fixture)
                          vllm_image, vllm_pair)

TENSOR_PARALLEL = 2


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> str:
    """The tiny MiMo with its MTP layer, on the tests' tokenizer. Weights drawn wide (std 0.3):
    its logits spread, so its greedy ids are decided by every layer's arithmetic, the split's
    included, and not by a near tie between vLLM's kernels and transformers'."""
    from tiny_models import make_tokenizer, save_tiny_mimo_mtp
    return save_tiny_mimo_mtp(make_tokenizer(), tmp_path_factory.mktemp("vllm-mtp-tp2") / "target", seed=1)


@pytest.mark.vllm
# Three vLLM starts at tensor parallel 2 in a row (the gate's two, the pod's), each of 3 processes
# (the API server, the engine core with rank 0, rank 1): 76 s by hand at load 1-10; the Llama
# pair's starts at tensor parallel 2 took 5-10 min each at load 20-85. The deadlines below are the
# start budgets (600 s a rank).
@pytest.mark.timeout(4200)
def test_an_mtp_release_at_tensor_parallel_2_is_gated_and_served_by_real_vllm_as_unsplit(
        vllm_image, mtp_target, operator_env, ns, mlflow_server, tmp_path):
    import openai

    from specpair.gate.vllm import golden_requests
    from specpair.vllm_parallel import start_budget_seconds
    from specpair.vllm_peer import parse_spec_decode_metrics
    from specpair.vllm_serve import parse_identity_name

    from transformers import AutoTokenizer

    # The reference first (our engine, before any vLLM starts: one heavy thing at a time).
    ours = our_engine_target_only(mtp_target, [p["prompt"] for p in PROMPTS])
    assert all(ours), ours
    name = f"mtp-{uuid.uuid4().hex[:5]}"
    # The MTP layer lives in the target's own checkpoint: the draft's source is the target.
    pair = vllm_pair(name, mtp_target, {"source": mtp_target, "method": "mtp"})
    pair["spec"]["parallelism"] = {"tensor": TENSOR_PARALLEL}
    # vLLM's MiMo MTP drafts one token ("mimo_mtp only support predict one token now").
    pair["spec"]["speculation"] = {"k": 1}
    # One load point (batch 1): the k-by-load sweep is test_operator_vllm.py's; here each point is
    # more runs of every prompt through split servers.
    pair["spec"]["gating"]["tuning"] = {"batchSizes": [1]}
    # A pod's start is allowed its startup probe's budget (600 s a rank); the rollout's deadline
    # is past it.
    budget = start_budget_seconds({"parallelism": {"tensor": TENSOR_PARALLEL}})
    pair["spec"]["rollout"]["progressDeadlineSeconds"] = budget + 600
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(pair)
        # The gate's two starts and the pod's, each within its budget, and the golden runs.
        obj = ns.wait_for("v1 serving on vLLM at tensor parallel 2", lambda: (o := ns.pair(name)) and
                          (o.get("status") or {}).get("phase") == "Serving" and o, timeout=3 * budget + 300)
        st = obj["status"]
        assert st["servingVersion"] == "1" and st["lastGate"]["passed"] and st["lastGate"]["greedyIdentity"] == 1.0
        assert "identity verified" in cond(obj, "Ready")["message"]
        gate, golden = the_gate_judged_split_mtp_vllm(mlflow_server.url, model_name(ns, name), tmp_path)
        # The gate's golden outputs (vLLM split in two, target-only) are our engine's target-only
        # output on one device: the reference the split does not share.
        assert [g["token_ids"] for g in golden] == ours, (golden, ours)

        (pod,) = [p for p in ns.pods(f"specpair.io/pair={name},specpair.io/role=engine")
                  if not p["metadata"].get("deletionTimestamp")]
        vllm, companion = pod["spec"]["containers"]
        assert vllm["command"][:3] == ["python", "-m", "specpair.vllm_serve"] and "--uds" in vllm["command"]
        assert companion["command"][:3] == ["python", "-m", "specpair.vllm_companion"]
        # The pod serves the release as gated: MTP (vLLM's own method name) over two CPU ranks,
        # each bound to a core of its own.
        served = json.loads(pod["metadata"]["annotations"]["specpair.io/release"])
        assert served["draft"]["method"] == "mtp" and served["parallelism"]["tensor"] == TENSOR_PARALLEL, served
        assert {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0|1"} in vllm["env"], vllm["env"]
        # vLLM ran split, drafting with the checkpoint's MTP layer: the command vllm_serve ran, a
        # second rank's worker logging as vLLM names it, and the MTP model vLLM resolved.
        log = ns.cluster.pod_log(ns.name, pod["metadata"]["name"], vllm["name"])
        assert f"--tensor-parallel-size {TENSOR_PARALLEL}" in log and "Worker_TP1" in log, log[-3000:]
        assert "MiMoMTPModel" in log and "method='mtp'" in log, log[-3000:]

        ip = pod["status"]["podIP"]
        client = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", timeout=300)
        identity = next(i for m in client.models.list().data if (i := parse_identity_name(m.id)))
        assert identity["pair"] == name and identity["version"] == "1" and identity["speculating"], identity
        # The split pod's greedy replies, drafting with MTP, to the golden prompts (as the gate
        # tokenizes them: chat template, ids) are our engine's target-only ids, id for id.
        replies = []
        for request in golden_requests(AutoTokenizer.from_pretrained(mtp_target), PROMPTS, chat=True):
            reply = client.completions.create(model=name, prompt=request.ids, max_tokens=MAX_NEW_TOKENS,
                                              temperature=0, extra_body={"return_token_ids": True})
            replies.append(reply.choices[0].model_extra["token_ids"])
        assert replies == ours, (replies, ours)
        # ... while the MTP layer drafted (vLLM's own counters on the pod): k 1, one draft token a
        # step, so the replies' steps drafted at least half their tokens.
        with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=60) as r:
            counters = parse_spec_decode_metrics(r.read().decode())
        assert counters.draft_tokens >= sum(map(len, ours)) // 2 - len(ours) and counters.drafts > 0, counters
    assert runner.exception is None
    print(json.dumps(st["lastGate"]), f"gate's vLLM starts {gate['vllmStartSeconds']} s; pod {start_seconds(pod)} s",
          sep="\n")


def our_engine_target_only(target: str, prompts: list[str]) -> list[list[int]]:
    """Our engine's greedy ids for the golden prompts (chat template, MAX_NEW_TOKENS), target
    alone on one device: it loads MiMo's Qwen2 body (model_type qwen2), the MTP weights left over."""
    from specpair.config import GenerationParams
    from specpair.decoding import SpeculativeEngine
    from specpair.models import load_model

    engine = SpeculativeEngine(load_model(target, device="cpu", progress=lambda *_: None))
    return [engine.generate([p], GenerationParams(max_new_tokens=MAX_NEW_TOKENS), chat=True,
                            speculate=False)[0].token_ids for p in prompts]


def the_gate_judged_split_mtp_vllm(mlflow_url: str, model: str, workdir: Path) -> tuple[dict, list[dict]]:
    """What the gate Job recorded with v1 (MLflow artifacts of its run): the golden prompts went
    through vLLM split over two ranks, drafting with MTP emitted exactly what target-only did
    (fp32 greedy) while vLLM's counters saw drafts, and the run says the split it was measured on."""
    client, run_id, verdict, golden = gate_record_of_vllm_v1(mlflow_url, model, workdir)
    assert verdict["device"] == f"vllm (float32, tensor parallel {TENSOR_PARALLEL})", verdict["device"]
    params = client.get_run(run_id).data.params
    assert params["parallelism.tensor"] == str(TENSOR_PARALLEL) and params["device"] == verdict["device"], params
    return verdict, golden
