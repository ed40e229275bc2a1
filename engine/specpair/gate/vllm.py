"""`specpair gate` for a release that vLLM serves (release.engine.kind == "vllm").

The verdict has the same contract as for our engine (gate/engine.py), so the operator judges and
promotes both alike; what differs is who decodes. The tokenizers are compared first, from their
files, exactly as gate/engine.py does. Then the golden prompts are run greedy through two real vLLM
servers, one after the other: target-only, then with the release's speculative config. The
prompts are tokenized by us (chat template included) and sent as token ids, so both servers and
our engine see the same prompt tokens; the generated ids must be identical. Acceptance comes
from vLLM's own spec-decode counters (read before and after each prompt, so each category gets
its own), speedup from the requests' wall times. Golden prompts that ask for structure (a
`response_format`, `structured_outputs`, `tools` / `tool_choice`) are sent with vLLM's
`structured_outputs` (tools rendered by the chat template, a forced call as its grammar) and
judged as our engine's gate judges them (gate/structured.py): schema validity and tool-call
parse rates per category, held to the same floors.

k by load: each server also runs the golden prompts at the concurrencies the release will serve
(its gating.tuning.batchSizes), that many requests in flight at once, and the speedup at each
(target-only wall time over speculative, median of LOAD_RUNS) becomes vLLM's batch-size
schedule for k (vllm_k_schedule: the release's k where drafting pays, 0 from where it stops),
shipped as bestSpeculation.kByBatchSize beside the batchSweep it rests on.

Noise and speculation off, as gate/engine.py: each golden prompt runs target-only NOISE_REPEATS
times on the first server, and the median deviation of those timings is the verdict's
speedupNoise. Where the pair names no minSpeedup, a release slower than target-only beyond that
noise (contract.speculation_off_reason) does not fail: it ships with speculation off
(SPECULATION_OFF, recorded in MLflow as the engine gate's is). vLLM cannot start drafting later
without a restart, so its pods keep the speculative config and draft k 0 at every batch size by
vLLM's own schedule.

Not measured here: the k sweep (vLLM cannot change k while it runs: each k would be a server
start; the release's k is what gets served), and identity "within ties" (that needs the target's
logits: it equals identity).
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from specpair.config import Release
from specpair.contract import (DEFAULT_CATEGORY, gate_tuning, parallelism, speculation_off_reason,
                               threshold_failures)
from specpair.errors import SpecpairError
from specpair.gate.structured import GoldenAsk, golden_ask, golden_chat, judged, prepared, vllm_structured_outputs
from specpair.gate.verdict import (NOISE_REPEATS, PromptRow, check_release, new_verdict, prompt_figures,
                                   timing_noise, tokenizer_check)
from specpair.vllm_parallel import (model_config, split_latent_attention_refusal, start_budget_seconds,
                                    tensor_parallel_refusal)
from specpair.vllm_peer import K_BY_BATCH_SIZE

ENGINE_KIND = "vllm"
# Timed runs per concurrency on each server; the median is the figure (a neighbour's burst slows
# one run, not the middle one). The two servers run one after the other, so a ratio's sides are
# not back to back as our engine's gate pairs them.
LOAD_RUNS = 3
# A release shipped with speculation off: k 0 from batch 1 on (vLLM's batch-size schedule, the
# last range carried past its end), and the batch threshold 0 by which both engines' verdicts say
# so (contract.shipped_target_only; our engine drafts at no batch size with it).
SPECULATION_OFF = {"batchSizeThreshold": 0, K_BY_BATCH_SIZE: [[1, 1, 0]]}


def load_seconds(server, prompts: list[list[int]], concurrency: int, max_new: int, runs: int = LOAD_RUNS) -> float:
    """Median wall time for `concurrency` greedy requests in flight at once (the golden prompts
    in turn), each generating `max_new` tokens (ignore_eos: both servers do the same work)."""
    batch = [prompts[i % len(prompts)] for i in range(concurrency)]
    seconds = []
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(runs):
            started = time.perf_counter()
            list(pool.map(lambda p: server.complete_greedy(p, max_new, ignore_eos=True), batch))
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


@dataclass(frozen=True)
class GoldenRequest:
    """One golden prompt as the vLLM gate sends it: its prompt ids (tools rendered by the chat
    template, as our gate and server render them), what it asks beyond its text, and vLLM's
    `structured_outputs` field for its structure (None: free text)."""

    ids: list[int]
    ask: GoldenAsk
    structured_outputs: dict | None


def golden_requests(tokenizer, prompts: list[dict], chat: bool) -> list[GoldenRequest]:
    """The golden prompts as vLLM requests (gate/structured.py reads their response_format,
    structured_outputs, tools and tool_choice as our engine's gate does; a forced tool call is
    its grammar)."""
    from specpair.decoding import encode_prompt

    out = []
    for index, prompt in enumerate(prompts):
        ask = golden_ask(prompt, index, golden_chat(prompt, chat))
        text, text_chat, structure = prepared(tokenizer, prompt["prompt"], ask, golden_chat(prompt, chat))
        out.append(GoldenRequest(encode_prompt(tokenizer, text, text_chat), ask,
                                 vllm_structured_outputs(structure)))
    return out


def vllm_python() -> str:
    """The python that runs vLLM: SPECPAIR_VLLM_PYTHON, else scripts/setup-vllm.sh's virtualenv
    when it exists, else this one (an image with vLLM and specpair in one environment)."""
    from specpair.vllm_peer import default_python

    explicit = os.environ.get("SPECPAIR_VLLM_PYTHON")
    if explicit:
        return explicit
    venv = default_python()
    return str(venv) if venv.exists() else sys.executable


def vllm_runs_on_cpu() -> bool:
    """Whether the gate's vLLM servers run on the CPU: no CUDA device is visible here (a gate Job's
    pod holds the GPUs its vLLM servers use; vLLM's CPU build, as the gate Job on a CPU node, sees
    none)."""
    import torch

    return not torch.cuda.is_available()


def dtype_of(release: dict) -> str:
    return str((release.get("engine") or {}).get("dtype") or "float32")


def device_of(dtype: str, sizes: dict[str, int]) -> str:
    """What the verdict (and the gate's MLflow run, as "device") says measured it: vLLM, the dtype,
    and the split where the target is split, as its figures are the split's."""
    split = [f"{name} parallel {sizes[name]}" for name in ("tensor", "pipeline") if sizes.get(name, 1) > 1]
    return f"vllm ({', '.join([dtype, *split])})"


def run_gate_vllm(release: dict, *, progress=print, python: str | None = None,
                  start_timeout: float | None = None) -> tuple[dict, list[dict]]:
    """Returns (verdict, golden outputs), as gate.run_gate."""
    from transformers import AutoTokenizer

    from specpair.models import resolve_source
    from specpair.vllm_head_check import head_tokenizer_check
    from specpair.vllm_peer import (SpecDecodeCounters, VllmServer, flags_argv, serving_flags,
                                    speculative_config)

    check_release(release)
    pair = Release.from_dict(release).pair     # what the release serves, read as the engine reads it
    gating = release.get("gating") or {}
    prompts = gating["prompts"]
    chat = bool(gating.get("chat", True))
    max_new = int(gating.get("maxNewTokens", 32))
    verdict = new_verdict(engine=ENGINE_KIND)

    progress("checking tokenizers before starting vLLM")
    # An EAGLE-3 head has no tokenizer of its own: its vocabulary mapping is checked instead.
    tok = head_tokenizer_check(release, progress) or tokenizer_check(release, progress)
    verdict["tokenizer"] = tok
    if not tok["compatible"]:
        verdict["reasons"] = ["tokenizer mismatch: " + "; ".join(tok["differences"])]
        return verdict, []

    target_dir = resolve_source(pair.target.source, progress)
    if not Path(str(target_dir)).is_dir():
        raise SpecpairError(f"vLLM needs the target as a local model directory; {target_dir!r} is not one")
    config, tensor = model_config(target_dir), parallelism(release)["tensor"]
    split = (tensor_parallel_refusal(config, tensor)
             or split_latent_attention_refusal(config, tensor, on_cpu=vllm_runs_on_cpu()))
    if split:  # said before a vLLM server starts (vLLM says the first minutes into one; the second, never)
        verdict["reasons"] = [split]
        return verdict, []
    # vLLM's speculative config reads the release's draft block (method, tensor parallel size) with
    # the draft model where vLLM can load it.
    draft = dict(release.get("draft") or {})
    if pair.draft is not None:
        draft["source"] = str(resolve_source(pair.draft.source, progress))
    speculative = speculative_config({**release, "draft": draft, "speculation": {
        **(release.get("speculation") or {}), "enabled": True}})
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    texts = [p["prompt"] for p in prompts]
    categories = [str(p.get("category") or DEFAULT_CATEGORY) for p in prompts]
    requests = golden_requests(tokenizer, prompts, chat)
    ids = [r.ids for r in requests]
    python = python or vllm_python()
    # A hang guard only (the gate Job's activeDeadlineSeconds bounds the whole gate): a real model's
    # weights take minutes to load, and each rank of a split target is a process of its own that
    # loads vLLM and torch first (on a CPU they share the pod's cores). Tensor parallel 2 of a tiny
    # model took 231 s to start beside other jobs at load 14, and over 360 s at load 28.
    sizes = parallelism(release)
    timeout = start_timeout or float(start_budget_seconds(release))
    dtype = dtype_of(release)
    # Both servers run the target as the release serves it (parallel sizes, memory, quantization);
    # without a context length of its own, VllmServer caps the model's to keep start-up small.
    flags = serving_flags(release)
    max_len = flags.pop("--max-model-len", None)
    server_args = {"dtype": dtype, "start_timeout": timeout, "extra_args": flags_argv(flags),
                   "max_model_len": int(max_len) if max_len else None}
    verdict["device"] = device_of(dtype, sizes)

    concurrencies = gate_tuning(release)["batchSizes"]
    progress(f"vLLM target-only: {len(ids)} golden prompts, then at concurrencies {concurrencies}")
    with VllmServer(python, target_dir, **server_args) as base_server:
        base_server.complete_greedy(ids[0], 2)   # warm-up
        base, base_repeats, started_at = [], [], []
        for r in requests:
            started_at.append(time.time())    # when this prompt's timings began: its MLflow trace's start
            runs = [base_server.complete_greedy(r.ids, max_new, structured_outputs=r.structured_outputs)
                    for _ in range(NOISE_REPEATS)]
            base.append(runs[0])
            base_repeats.append([run.seconds for run in runs])
        base_load = [load_seconds(base_server, ids, c, max_new) for c in concurrencies]
    progress(f"vLLM speculative ({speculative.get('method') or 'draft model'}, "
             f"k={speculative['num_speculative_tokens']})")
    spec_runs, deltas = [], []
    with VllmServer(python, target_dir, speculative=speculative, **server_args) as spec_server:
        spec_server.complete_greedy(ids[0], 2)
        for r in requests:
            before = spec_server.spec_decode_counters()
            spec_runs.append(spec_server.complete_greedy(r.ids, max_new, structured_outputs=r.structured_outputs))
            deltas.append(spec_server.spec_decode_counters() - before)
        spec_load = [load_seconds(spec_server, ids, c, max_new) for c in concurrencies]

    golden, rows = [], []
    for text, category, r, b, s, d, began in zip(texts, categories, requests, base, spec_runs, deltas, started_at):
        identical = b.token_ids == s.token_ids
        # The reply served is the speculative one: it is the one judged (as gate/engine.py does).
        verdicts = judged(tokenizer, r.ask, s.text)
        # vLLM reports no logits: a tie cannot be told from a divergence, so identity within ties is identity.
        rows.append(PromptRow(category, b.seconds, s.seconds, d, identical, identical,
                              verdicts["schema_valid"], verdicts["tool_call_parsed"]))
        golden.append({"prompt": text, "category": category, "target_only": b.text, "speculative": s.text,
                       "identical": identical, "token_ids": b.token_ids, "draft_tokens": d.draft_tokens,
                       **({} if r.ask.plain else verdicts),
                       "output_tokens": len(s.token_ids),
                       "speedup": round(b.seconds / s.seconds, 4) if s.seconds else 0.0,
                       "seconds": {"target_only": round(b.seconds, 6), "speculative": round(s.seconds, 6)},
                       "started_at": round(began, 3),
                       "acceptance_rate": round(d.acceptance_rate, 4),
                       "mean_acceptance_length": round(d.mean_acceptance_length, 4)})

    def summarise(part: list[PromptRow]) -> tuple[SpecDecodeCounters, dict]:
        total = SpecDecodeCounters()
        for r in part:
            total = total + r.acceptance
        return total, prompt_figures(part, total)

    total, overall = summarise(rows)
    verdict.update(overall)
    verdict["speedupNoise"] = round(timing_noise(base_repeats), 4)
    verdict["acceptancePerPosition"] = [round(x, 4) for x in total.acceptance_per_position]
    for cat in dict.fromkeys(categories):
        verdict["categories"][cat] = summarise([r for r in rows if r.category == cat])[1]
    verdict.update(k_by_load(concurrencies, base_load, spec_load, int(speculative["num_speculative_tokens"])))
    # How long each vLLM took to start (the gate's cost beyond its prompts; CI's budget).
    verdict["vllmStartSeconds"] = {"targetOnly": round(base_server.start_seconds or 0.0, 1),
                                   "speculative": round(spec_server.start_seconds or 0.0, 1)}
    thresholds = gating.get("thresholds") or {}
    verdict.update(shipped_off(verdict, thresholds))
    verdict["reasons"] = threshold_failures(verdict, thresholds)
    verdict["passed"] = not verdict["reasons"]
    return verdict, golden


def shipped_off(verdict: dict, thresholds: dict) -> dict:
    """What the verdict gets where the release ships with speculation off (bestSpeculation
    SPECULATION_OFF in place of any k schedule, and speculationOff saying why); {} where
    speculation pays at batch 1 or the pair names its own minSpeedup (held as given)."""
    off = speculation_off_reason(verdict, thresholds)
    if off is None:
        return {}
    return {"bestSpeculation": copy.deepcopy(SPECULATION_OFF), "speculationOff": off}


def k_by_load(concurrencies: list[int], base_seconds: list[float], spec_seconds: list[float], k: int) -> dict:
    """The verdict's batchSweep (the speedup at each concurrency measured) and bestSpeculation
    (vLLM's k schedule from them, or None where drafting pays at every one: k serves throughout)."""
    from specpair.vllm_k_schedule import LoadPoint, k_by_batch_size

    # Rounded as recorded, so the schedule follows from the figures beside it.
    points = [LoadPoint(c, round(b / s, 4) if s else 0.0)
              for c, b, s in zip(concurrencies, base_seconds, spec_seconds, strict=True)]
    schedule = k_by_batch_size(points, k)
    return {"batchSweep": [{"batchSize": p.concurrency, "speedup": p.speedup} for p in points],
            "bestSpeculation": {K_BY_BATCH_SIZE: schedule} if schedule else None}
