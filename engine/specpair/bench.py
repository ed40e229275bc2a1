"""`specpair bench`: speculative vs target-only decoding, measured, with the bound it should reach.

For each prompt (after a warm-up) it times target-only and speculative greedy decoding (median
of several runs), checks the outputs are token-identical, and measures on this hardware what the
speculative run's work costs at the least: the prompt's prefill P (target, and draft model if
any), one target decode step T1, one verification of k+1 tokens Tv(k+1) for every k (not one
step on a CPU), and one draft step Td (per token for a draft model, per round for n-gram lookup).

The bound is the speedup the speculative run would have had if it cost nothing beyond those
kernels, for the rounds it really ran: each round with k drafted tokens (k as used, from the
per-position counts) costs k*Td + Tv(k+1), each round where the drafter proposed nothing costs
T1, plus P; the baseline is target-only as measured. Overheads only add to the speculative run,
so the measured speedup stays at or below the bound, and the report says on how many prompts it
does. Each kernel cost is the fastest of several timings (after a warm-up), not their median: on
a shared machine a median picks up whatever else ran then, which priced the kernels above what
the speculative run paid and put measured speedups over the bound. (Leviathan's i.i.d. formula
from the acceptance rate is not a bound: n-gram acceptance comes in runs, so real rounds yield
more than it predicts.) Efficiency = measured speedup / bound. Hugging Face assisted generation runs the same
pair as the peer, so both speedups come from one run on one machine.

`--peer vllm` also runs the same prompts (as token ids: our chat template applied), the same
model directory and the same greedy max_new_tokens through a real vLLM server, target-only and
speculative with the same drafter and k (specpair.vllm_peer), after our own timings so the two
never share the CPU: vLLM's tokens/s (request wall time, prefill included, as ours), its
acceptance from its own counters, on how many prompts its greedy ids equal our target-only ids,
and ours/vLLM. vLLM drafts a fixed k and its n-gram lookup takes the earliest longest match
(ours: the latest), so acceptances may differ while outputs must not.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from specpair.config import GenerationParams
from specpair.contract import DEFAULT_CATEGORY
from specpair.costs import StepTiming, measure_step_costs, sync, timed
from specpair.decoding import SpeculativeEngine, kv_bytes_per_token
from specpair.errors import SpecpairError
from specpair.identity import first_divergence
from specpair.stats import AcceptanceStats
from specpair.vllm_peer import (DEFAULT_START_TIMEOUT, VLLM_VERSION, SpecDecodeCounters, VllmServer,
                                speculative_config)


def load_prompts(path: str | None) -> list[dict]:
    """JSON Lines of {"prompt": ..., "category": ...}; the shipped set when no path is given."""
    if path is None:
        text = resources.files("specpair").joinpath("prompts/default.jsonl").read_text()
        where = "the default prompt set"
    else:
        p = Path(path)
        if not p.is_file():
            raise SpecpairError(f"prompts file not found: {path}")
        text, where = p.read_text(), path
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecpairError(f"{where} line {n}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or not str(row.get("prompt", "")).strip():
            raise SpecpairError(f"{where} line {n}: needs a non-empty \"prompt\"")
        prompts.append({"prompt": row["prompt"], "category": str(row.get("category") or DEFAULT_CATEGORY)})
    if not prompts:
        raise SpecpairError(f"{where} holds no prompts")
    return prompts


@torch.no_grad()
def measure_memory_bandwidth(device, megabytes: int = 512, repeats: int = 5) -> dict:
    """GB/s here, measured in the same run: a large tensor copy (bytes read + written over the
    fastest time, as for the step it is the yardstick of) and a large sum (bytes read). A decode
    step only reads, and reading measured faster than copying on this CPU, so the yardstick is
    the faster of the two."""
    src = torch.empty(megabytes * (1 << 20) // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = [timed(lambda: dst.copy_(src), device)[0] for _ in range(repeats)]
    read = [timed(lambda: src.sum(), device)[0] for _ in range(repeats)]
    nbytes = src.numel() * 4
    out = {"copy_gb_s": round(2 * nbytes / min(copy) / 1e9, 3),
           "read_gb_s": round(nbytes / min(read) / 1e9, 3)}
    out["memory_gb_s"] = max(out["copy_gb_s"], out["read_gb_s"])
    return out


def step_bytes(model, context: int) -> int:
    """Bytes one decode step must read at least: every weight except the input embedding table
    (a step reads one row of it; a tied LM head reads it whole, counted once as the LM head's), and
    the keys and values of `context` cached tokens. A drafting head has no table of its own."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not getattr(model, "is_drafting_head", False):
        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        tied = head is not None and head.weight.data_ptr() == embedding.data_ptr()
        if not tied:
            weights -= embedding.numel() * embedding.element_size()
    return int(weights + kv_bytes_per_token(model) * context)


def step_figures(seconds: float, nbytes: int, bandwidth: float) -> dict:
    achieved = nbytes / seconds / 1e9 if seconds else 0.0
    return {"step_ms": round(seconds * 1e3, 3), "bytes": nbytes, "gb_s": round(achieved, 3),
            "fraction_of_bandwidth": round(achieved / bandwidth, 4) if bandwidth else None}


@torch.no_grad()
def measure_prefill(engine: SpeculativeEngine, prompt_ids: list[int], repeats: int = 3) -> float:
    """Seconds to prefill the prompt (fastest of `repeats`): the target's, plus the draft model's
    when there is one."""
    device = engine.target.device
    draft_model = engine.drafter.draft_model() if engine.drafter is not None else None
    models = [engine.target.model] + ([draft_model] if draft_model is not None else [])
    total = 0.0
    for model in models:
        times = []
        for _ in range(repeats):
            kv = engine.serving_cache(model)
            kv.add_rows(1)
            times.append(timed(lambda: kv.extend([prompt_ids]), device)[0])
        total += min(times)
    return total


def rounds_by_k(per_pos: list[int]) -> dict[int, int]:
    """How many rounds drafted exactly k tokens, from a per-position draft count
    (AcceptanceStats.num_draft_tokens_per_pos): the count at position j-1 is how many rounds
    drafted at least j."""
    counts = {k: per_pos[k - 1] - (per_pos[k] if k < len(per_pos) else 0) for k in range(1, len(per_pos) + 1)}
    return {k: n for k, n in counts.items() if n}


def round_seconds(costs: dict, k: int) -> float:
    """A round drafting k tokens at these kernels: its draft steps (one a token, or one a round),
    what the round costs beyond them (a head's catch-up, `draft_round`) and one verification
    (the nearest measured k where this one was not)."""
    verify = costs["verify"]
    v = verify[k] if k in verify else verify[min(verify, key=lambda x: abs(x - k))]
    return ((k if costs.get("draft_per_token", True) else 1) * costs["draft_step"]
            + costs.get("draft_round", 0.0) + v)


def ideal_spec_seconds(stats: AcceptanceStats, rounds_without_draft: int, costs: dict,
                       prefill_seconds: float = 0.0) -> float:
    """What the speculative run's rounds cost at their measured kernels alone (module docstring).
    Rounds that copied (lookup first) are priced at costs["copy"], the others at the drafter's."""
    seconds = prefill_seconds + rounds_without_draft * costs["target_step"]
    copied = rounds_by_k(stats.num_copied_draft_tokens_per_pos)
    for k, n in rounds_by_k(stats.num_draft_tokens_per_pos).items():
        c = copied.get(k, 0)
        seconds += (n - c) * round_seconds(costs, k)
        if c:
            seconds += c * round_seconds(costs["copy"], k)
    return seconds


def speedup_bound(stats: AcceptanceStats, rounds_without_draft: int, costs: dict,
                  target_seconds: float, prefill_seconds: float = 0.0) -> float:
    """Target-only as measured over the speculative run at its kernels' cost: an upper bound."""
    ideal = ideal_spec_seconds(stats, rounds_without_draft, costs, prefill_seconds)
    return target_seconds / ideal if ideal > 0 else 0.0


@dataclass
class PromptResult:
    category: str
    target_seconds: float
    spec_seconds: float
    tokens: int
    identical: bool
    stats: AcceptanceStats
    rounds_without_draft: int
    prefill_seconds: float = 0.0
    hf_target_seconds: float | None = None
    hf_assisted_seconds: float | None = None
    divergence: dict | None = None       # first mismatch vs target-only, with the logit margin
    target_ids: list[int] | None = None  # our target-only greedy ids (what vLLM's must equal)
    timing: dict | None = None           # {"target"|"spec": StepTiming} over all runs
    hf_compiled_seconds: float | None = None   # the hf-compiled peer, target-only (median)
    hf_compiled_identical: bool | None = None  # its greedy ids equal our target-only ids
    vllm: dict | None = None             # {"target"|"spec": {seconds, tokens, identical[, counters]}}


@dataclass
class BenchReport:
    pair: dict
    device: str
    k: int
    runs: int
    costs: dict
    prompts: list[PromptResult] = field(default_factory=list)
    vllm: dict | None = None             # the vLLM peer's setup: python, model, configs, start times
    bandwidth: dict | None = None        # memory bandwidth here and each model's step against it
    step: dict | None = None             # which cache and step ran (engine.describe_step())
    hf_compiled: dict | None = None      # the hf-compiled peer's setup (HfCompiledPeer.describe)

    def summarise(self, rows: list[PromptResult]) -> dict:
        stats = AcceptanceStats()
        for r in rows:
            stats.merge(r.stats)
        tokens = sum(r.tokens for r in rows)
        t_target = sum(r.target_seconds for r in rows)
        t_spec = sum(r.spec_seconds for r in rows)
        no_draft = sum(r.rounds_without_draft for r in rows)
        speedup = t_target / t_spec if t_spec else 0.0
        ideal = sum(ideal_spec_seconds(r.stats, r.rounds_without_draft, self.costs, r.prefill_seconds) for r in rows)
        bound = t_target / ideal if ideal else 0.0
        # The bound holds per prompt too; where timing noise still puts a measured
        # speedup above it, the report says so rather than hide it.
        above = [i for i, r in enumerate(rows) if r.spec_seconds and
                 r.target_seconds / r.spec_seconds > speedup_bound(r.stats, r.rounds_without_draft, self.costs,
                                                                   r.target_seconds, r.prefill_seconds) * 1.02]
        hf = [r for r in rows if r.hf_assisted_seconds]
        hf_speedup = (sum(r.hf_target_seconds for r in hf) / sum(r.hf_assisted_seconds for r in hf)
                      if hf else None)
        hf_tokens = sum(r.tokens for r in hf)
        # Target-only is measured for every drafter; assisted only where transformers has one.
        hf_t = [r for r in rows if r.hf_target_seconds]
        hf_target_tps = (sum(r.tokens for r in hf_t) / sum(r.hf_target_seconds for r in hf_t)
                         if hf_t else None)
        hf_assisted_tps = hf_tokens / sum(r.hf_assisted_seconds for r in hf) if hf else None
        cost_ratio = self.costs["draft_step"] / self.costs["target_step"]
        return {
            "prompts": len(rows),
            "tokens": tokens,
            "target_tokens_per_s": round(tokens / t_target, 3) if t_target else 0.0,
            "spec_tokens_per_s": round(tokens / t_spec, 3) if t_spec else 0.0,
            "speedup": round(speedup, 4),
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
            "acceptance_per_position": [round(x, 4) for x in stats.acceptance_per_position],
            "cost_ratio": round(cost_ratio, 4),
            "bound": round(bound, 4),
            "efficiency": round(speedup / bound, 4) if bound else 0.0,
            "prompts_above_bound": len(above),
            "greedy_identity": round(sum(r.identical for r in rows) / len(rows), 4),
            # Mismatches whose target logit margin is within the dtype's rounding count as ties.
            "greedy_identity_within_ties": round(sum(
                r.identical or bool(r.divergence and r.divergence.get("tie")) for r in rows) / len(rows), 4),
            "mismatches": [r.divergence for r in rows if r.divergence],
            "hf_assisted_speedup": round(hf_speedup, 4) if hf_speedup else None,
            "speedup_vs_hf": round(speedup / hf_speedup, 4) if hf_speedup else None,
            # Tokens/s side by side: the ratio users feel, not only the ratio of speedups.
            "hf_target_tokens_per_s": round(hf_target_tps, 3) if hf_t else None,
            "hf_assisted_tokens_per_s": round(hf_assisted_tps, 3) if hf else None,
            "target_vs_hf": round(tokens / t_target / hf_target_tps, 4) if hf_t and t_target else None,
            "spec_vs_hf": round(tokens / t_spec / hf_assisted_tps, 4) if hf and t_spec else None,
            "rounds_without_draft": no_draft,
            "host": {mode: host_figures(merged_timing(rows, mode), self.device)
                     for mode in ("target", "spec") if all(r.timing for r in rows)},
            **summarise_hf_compiled(rows, tokens / t_target if t_target else 0.0,
                                    tokens / t_spec if t_spec else 0.0),
            "draft_seconds": round(stats.draft_seconds, 4),
            "target_seconds": round(stats.target_seconds, 4),
            **summarise_vllm(rows, tokens / t_target if t_target else 0.0, tokens / t_spec if t_spec else 0.0),
        }

    def to_dict(self) -> dict:
        categories = {}
        for name in dict.fromkeys(r.category for r in self.prompts):
            categories[name] = self.summarise([r for r in self.prompts if r.category == name])
        overall = self.summarise(self.prompts)
        t1 = self.costs["target_step"]
        out = {"pair": self.pair, "device": self.device, "k": self.k, "runs": self.runs,
               "tree_width": self.costs.get("tree_width", 1), "step": self.step,
               "costs_seconds": {"target_step": round(t1, 6),
                                 "draft_step": round(self.costs["draft_step"], 6),
                                 "draft_round": round(self.costs.get("draft_round", 0.0), 6),
                                 "verify": {str(k): round(v, 6) for k, v in self.costs["verify"].items()}},
               # Verifying k drafts against one decode step: near 1 when a step is bandwidth-bound.
               "verify_ratio": {str(k): round(v / t1, 4) for k, v in self.costs["verify"].items()},
               "bandwidth": self.bandwidth, "host_time": host_time_basis(self.device),
               "categories": categories, "overall": overall}
        if self.hf_compiled is not None:
            out["hf_compiled"] = self.hf_compiled
        if self.vllm is not None:
            out["vllm"] = self.vllm
            out["vllm_prompts"] = [r.vllm for r in self.prompts]
        return out


def host_time_basis(device: str) -> str:
    """What `host_ms` means on this device (StepTiming)."""
    if device.startswith("cuda"):
        return ("wall time of a step less the time blocked waiting on the device after each model "
                "call: the host's Python and kernel launches")
    return ("wall time of a step less the time inside the model calls: the Python around them "
            "(on a CPU the model calls run on the host too, so this is not all the host's time)")


def host_figures(timing: StepTiming, device: str) -> dict | None:
    """Per step: its wall time, the model calls', the device wait's and the host's (host_time_basis)."""
    if not timing.steps:
        return None
    per = 1e3 / timing.steps
    device_ms = timing.wait_seconds if device.startswith("cuda") else timing.model_seconds
    host = timing.seconds - device_ms
    return {"steps": timing.steps, "step_ms": round(timing.seconds * per, 4),
            "model_ms": round(timing.model_seconds * per, 4),
            "device_wait_ms": round(timing.wait_seconds * per, 4),
            "host_ms": round(host * per, 4),
            "host_fraction": round(host / timing.seconds, 4) if timing.seconds else None}


def merged_timing(rows: list[PromptResult], mode: str) -> StepTiming:
    total = StepTiming()
    for r in rows:
        total.merge(r.timing[mode])
    return total


def summarise_hf_compiled(rows: list[PromptResult], ours_target_tps: float, ours_spec_tps: float) -> dict:
    """The hf-compiled peer's columns for these prompts (empty when it did not run)."""
    if not rows or any(r.hf_compiled_seconds is None for r in rows):
        return {}
    tps = sum(r.tokens for r in rows) / sum(r.hf_compiled_seconds for r in rows)
    return {"hf_compiled_tokens_per_s": round(tps, 3),
            "hf_compiled_identical": sum(bool(r.hf_compiled_identical) for r in rows),
            "target_vs_hf_compiled": round(ours_target_tps / tps, 4) if tps else None,
            "spec_vs_hf_compiled": round(ours_spec_tps / tps, 4) if tps else None}


def summarise_vllm(rows: list[PromptResult], ours_target_tps: float, ours_spec_tps: float) -> dict:
    """The vLLM peer's columns for these prompts (empty when it did not run)."""
    if not rows or any(r.vllm is None for r in rows):
        return {}
    out = {}
    for mode, ours in (("target", ours_target_tps), ("spec", ours_spec_tps)):
        seconds = sum(r.vllm[mode]["seconds"] for r in rows)
        tps = sum(r.vllm[mode]["tokens"] for r in rows) / seconds if seconds else 0.0
        out[f"vllm_{mode}_tokens_per_s"] = round(tps, 3)
        # Prompts whose vLLM greedy ids equal our target-only ids.
        out[f"vllm_{mode}_identical"] = sum(bool(r.vllm[mode]["identical"]) for r in rows)
        out[f"{mode}_vs_vllm"] = round(ours / tps, 4) if tps else None
    out["vllm_speedup"] = (round(out["vllm_spec_tokens_per_s"] / out["vllm_target_tokens_per_s"], 4)
                           if out["vllm_target_tokens_per_s"] else None)
    counters = sum((SpecDecodeCounters.from_dict(r.vllm["spec"]["counters"]) for r in rows),
                   SpecDecodeCounters())
    out["vllm_acceptance_rate"] = round(counters.acceptance_rate, 4)
    out["vllm_mean_acceptance_length"] = round(counters.mean_acceptance_length, 4)
    out["vllm_acceptance_per_position"] = [round(x, 4) for x in counters.acceptance_per_position]
    return out


def _hf_generate(engine: SpeculativeEngine, prompt_ids: list[int], max_new_tokens: int, k: int,
                 assisted: bool) -> None:
    """The same pair through transformers' own assisted generation (the peer)."""
    model = engine.target.model
    ids = torch.tensor([prompt_ids], device=engine.target.device)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens,
                  attention_mask=torch.ones_like(ids), pad_token_id=engine.target.tokenizer.pad_token_id
                  or engine.target.tokenizer.eos_token_id)
    if assisted:
        assistant = engine.drafter.draft_model() if engine.drafter is not None else None
        if assistant is not None:
            assistant.generation_config.num_assistant_tokens = k
            kwargs["assistant_model"] = assistant
        else:
            kwargs["prompt_lookup_num_tokens"] = k
    model.generate(ids, **kwargs)


def hf_compile_mode(device: torch.device) -> str:
    """torch.compile's mode for the hf-compiled peer: "reduce-overhead" (CUDA graphs) on CUDA;
    elsewhere there are no graphs to capture, so inductor's "default"."""
    return "reduce-overhead" if device.type == "cuda" else "default"


class HfCompiledPeer:
    """Hugging Face's StaticCache and torch.compile, target-only greedy (gpt-fast's recipe): the
    prompt in one eager forward, then each token in one compiled forward of fixed shape over a
    cache allocated once at `max_cache_len` (reset between prompts, so nothing recompiles)."""

    def __init__(self, model, max_cache_len: int, mode: str | None = None):
        from transformers import StaticCache

        self.model = model
        self.device = next(model.parameters()).device
        self.mode = mode or hf_compile_mode(self.device)
        self.max_cache_len = max_cache_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        # transformers renamed the forward's past_key_values to cache; either names the cache
        import inspect
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.step = torch.compile(self._decode_one, mode=self.mode, fullgraph=True)
        self.used = False
        self.warm_seconds: float | None = None

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, cache_position=positions, position_ids=positions.view(1, -1),
                         use_cache=True, **{self.cache_arg: self.cache})
        return out.logits[:, -1].argmax(-1, keepdim=True)                 # [1, 1]

    def _decode_one(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self._forward(token, position)

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy ids, exactly max_new_tokens of them (EOS does not stop it, as the bench pins)."""
        n = len(prompt_ids)
        if n + max_new_tokens > self.max_cache_len:
            raise SpecpairError(f"hf-compiled peer: {n} + {max_new_tokens} tokens exceed its cache "
                                f"of {self.max_cache_len}")
        if self.used:
            self.cache.reset()
        self.used = True
        token = self._forward(torch.tensor([prompt_ids], device=self.device),
                              torch.arange(n, device=self.device))
        position = torch.tensor([n], device=self.device)
        tokens = [token]
        for _ in range(max_new_tokens - 1):
            # clone: a CUDA graph's output is overwritten by its next replay
            token = self.step(token, position).clone()
            tokens.append(token)
            position = position + 1
        return torch.cat(tokens, dim=1)[0].tolist()

    def warm_up(self, prompt_ids: list[int]) -> float:
        """Compile (and on CUDA capture) the step; returns the seconds it took."""
        start = time.perf_counter()
        self.generate(prompt_ids, 4)
        sync(self.device)
        self.warm_seconds = time.perf_counter() - start
        return self.warm_seconds

    def describe(self) -> dict:
        return {"recipe": "transformers StaticCache + torch.compile, target-only greedy",
                "mode": self.mode, "fullgraph": True, "max_cache_len": self.max_cache_len,
                "compile_seconds": round(self.warm_seconds, 3) if self.warm_seconds is not None else None}


def run_bench(engine: SpeculativeEngine, prompts: list[dict], *, max_new_tokens: int = 64,
              runs: int = 3, chat: bool = True, hf_peer: bool = True, progress=None,
              vllm_python: str | None = None, vllm_start_timeout: float | None = None,
              note=None, hf_compiled: bool = False) -> BenchReport:
    k = engine.config.k
    encoded = [(p["category"], engine.encode(p["prompt"], chat=chat)) for p in prompts]
    # Warm-up: first calls allocate and pick kernels; never time them.
    warm = GenerationParams(max_new_tokens=4)
    engine.generate([prompts[0]["prompt"]], warm, chat=chat, speculate=False)
    engine.generate([prompts[0]["prompt"]], warm, chat=chat)
    ks = sorted({max(1, k - 2), k, min(engine.config.k_max, k + 2)} | set(range(1, engine.config.k_max + 1)))
    costs = measure_step_costs(engine, encoded[0][1], ks)
    target = engine.target
    memory = measure_memory_bandwidth(target.device)
    bandwidth = memory["memory_gb_s"]
    context = len(encoded[0][1])     # the cost prompt's length: the cache each timed step read
    figures = {**memory, "context": context,
               "target": step_figures(costs["target_step"], step_bytes(target.model, context), bandwidth)}
    step_model = engine.drafter.step_model() if engine.drafter is not None else None
    if step_model is not None:
        figures["draft"] = step_figures(costs["draft_step"], step_bytes(step_model, context), bandwidth)
    report = BenchReport(pair={"target": target.source,
                               "drafter": engine.drafter.describe() if engine.drafter else None,
                               "target_parameters": target.num_parameters,
                               "target_bytes": target.weight_bytes},
                         device=str(target.device), k=k, runs=runs, costs=costs,
                         bandwidth=figures, step=engine.describe_step())
    if getattr(engine, "captures", None):      # compiled: the start-up capture (buckets, s, memory)
        report.step["captures"] = engine.captures
    # Pin generation length: EOS early would make runs incomparable across modes.
    params = GenerationParams(max_new_tokens=max_new_tokens)
    for n, (category, ids) in enumerate(encoded):
        t_times, s_times, hf_t, hf_a = [], [], [], []
        timing = {"target": StepTiming(), "spec": StepTiming()}
        spec_result = base_result = None
        for _ in range(runs):
            seconds, base = timed(lambda: _run_one(engine, ids, params, speculate=False,
                                                    timing=timing["target"]), target.device)
            t_times.append(seconds)
            engine.controller.reset()   # each run starts from the same fallback state
            seconds, spec = timed(lambda: _run_one(engine, ids, params, speculate=True,
                                                    timing=timing["spec"]), target.device)
            s_times.append(seconds)
            base_result, spec_result = base, spec
            if hf_peer:
                hf_t.append(timed(lambda: _hf_generate(engine, ids, len(base.token_ids), k, False),
                                   target.device)[0])
                if not engine.drafter.wants_features:   # transformers has no EAGLE or Medusa
                    hf_a.append(timed(lambda: _hf_generate(engine, ids, len(base.token_ids), k, True),
                                       target.device)[0])
        rounds = spec_result.stats.num_target_steps
        prefill = measure_prefill(engine, ids)
        divergence = first_divergence(engine.target, ids, base_result.token_ids, spec_result.token_ids)
        report.prompts.append(PromptResult(
            category=category, target_seconds=statistics.median(t_times),
            spec_seconds=statistics.median(s_times), tokens=len(spec_result.token_ids),
            identical=spec_result.token_ids == base_result.token_ids, stats=spec_result.stats,
            rounds_without_draft=rounds - spec_result.stats.num_drafts, prefill_seconds=prefill,
            hf_target_seconds=statistics.median(hf_t) if hf_t else None,
            hf_assisted_seconds=statistics.median(hf_a) if hf_a else None, divergence=divergence,
            target_ids=list(base_result.token_ids), timing=timing))
        if progress:
            progress(n + 1, len(encoded), category)
    if hf_compiled:
        # After all of ours: torch's CUDA-graph trees (reduce-overhead) and the graphs our engine
        # records itself do not share a process safely once theirs have replayed (docs/gpu.md).
        compiled = HfCompiledPeer(target.model, max(len(ids) for _, ids in encoded) + max_new_tokens)
        if note:
            note(f"hf-compiled peer: compiling the step (torch.compile mode={compiled.mode!r})")
        compiled.warm_up(encoded[0][1])
        report.hf_compiled = compiled.describe()
        for row, (_, ids) in zip(report.prompts, encoded):
            times = []
            for _ in range(runs):
                seconds, compiled_ids = timed(lambda: compiled.generate(ids, len(row.target_ids)),
                                              target.device)
                times.append(seconds)
            row.hf_compiled_seconds = statistics.median(times)
            row.hf_compiled_identical = compiled_ids == row.target_ids
    if engine.drafter is not None:     # again, with what it counted while drafting (lookup first)
        report.pair["drafter"] = engine.drafter.describe()
    if vllm_python:
        report.vllm = run_vllm_peer(engine, [ids for _, ids in encoded], report.prompts,
                                    python=vllm_python, max_new_tokens=max_new_tokens, runs=runs,
                                    start_timeout=vllm_start_timeout, note=note)
    return report


def run_vllm_peer(engine: SpeculativeEngine, encoded: list[list[int]], rows: list[PromptResult], *,
                  python: str, max_new_tokens: int, runs: int, start_timeout: float | None = None,
                  note=None) -> dict:
    """The same prompts through vLLM, target-only then speculative (one server each, started
    after our timings); fills each row's `vllm` and returns the setup for the report."""
    note = note or (lambda msg: None)
    target = engine.target
    model_dir = target.resolved_path or target.source
    if not (Path(model_dir) / "config.json").is_file():
        raise SpecpairError(f"--peer vllm needs the target as a local model directory; {target.source!r} "
                            f"resolved to {model_dir!r}")
    spec = speculative_config(engine.drafter.describe() if engine.drafter else None, k=engine.config.k)
    dtype = str(target.dtype).replace("torch.", "")
    setup = {"version": VLLM_VERSION, "python": str(python), "model": str(model_dir), "dtype": dtype,
             "speculative_config": spec, "threads": 1, "ours_threads": torch.get_num_threads(),
             "start_seconds": {}}
    for mode, config in (("target", None), ("spec", spec)):
        note(f"starting vLLM ({'target-only' if config is None else 'speculative ' + json.dumps(config)})")
        with VllmServer(python, model_dir, speculative=config, dtype=dtype,
                        start_timeout=start_timeout or DEFAULT_START_TIMEOUT) as server:
            setup["start_seconds"][mode] = round(server.start_seconds, 1)
            note(f"vLLM {mode} server healthy in {server.start_seconds:.1f} s; timing {len(encoded)} prompts")
            server.complete_greedy(encoded[0], 4)                     # warm-up, never timed
            for ids, row in zip(encoded, rows):
                before = server.spec_decode_counters()
                times, out = [], None
                for _ in range(runs):
                    out = server.complete_greedy(ids, max_new_tokens)
                    times.append(out.seconds)
                result = {"seconds": round(statistics.median(times), 4), "tokens": len(out.token_ids),
                          "identical": out.token_ids == row.target_ids}
                if not result["identical"]:
                    at = next((i for i, (a, b) in enumerate(zip(out.token_ids, row.target_ids)) if a != b),
                              min(len(out.token_ids), len(row.target_ids)))
                    result["first_difference"] = at
                if config is not None:   # over all `runs` runs of the prompt (rates unchanged)
                    result["counters"] = (server.spec_decode_counters() - before).to_dict()
                row.vllm = {**(row.vllm or {}), mode: result}
    return setup


def _run_one(engine: SpeculativeEngine, ids: list[int], params: GenerationParams, speculate: bool,
             timing: StepTiming | None = None):
    """One request to completion; its steps' timing is added to `timing` when given."""
    batch = engine.new_batch()
    batch.speculate = speculate
    seq = batch.add(ids, params)
    while batch.active:
        batch.step()
    if timing is not None:
        timing.merge(batch.timing)
    return batch.result(seq)


def format_table(report: dict) -> str:
    cols = ["target_tokens_per_s", "spec_tokens_per_s", "speedup", "acceptance_rate",
            "mean_acceptance_length", "cost_ratio", "bound", "efficiency", "greedy_identity",
            "hf_assisted_speedup", "speedup_vs_hf", "hf_target_tokens_per_s", "hf_assisted_tokens_per_s",
            "target_vs_hf", "spec_vs_hf"]
    short = ["tgt tok/s", "spec tok/s", "speedup", "accept", "mean len", "c", "bound", "eff",
             "identity", "HF spdup", "vs HF", "HF tgt", "HF asst", "tgt/HF", "spec/HF"]
    if "hf_compiled" in report:
        cols += ["hf_compiled_tokens_per_s", "hf_compiled_identical", "target_vs_hf_compiled",
                 "spec_vs_hf_compiled"]
        short += ["HFc tgt", "=HFc", "tgt/HFc", "spec/HFc"]
    if "vllm" in report:
        # vLLM's tokens/s and acceptance, prompts whose greedy ids equal our target-only ids,
        # and ours / vLLM's tokens/s.
        cols += ["vllm_target_tokens_per_s", "vllm_spec_tokens_per_s", "vllm_acceptance_rate",
                 "vllm_target_identical", "vllm_spec_identical", "target_vs_vllm", "spec_vs_vllm"]
        short += ["vLLM tgt", "vLLM spec", "vLLM acc", "=vLLM tgt", "=vLLM spec", "tgt/vLLM", "spec/vLLM"]
    lines = [f"{'category':<15}" + "".join(f"{h:>11}" for h in short)]
    rows = list(report["categories"].items()) + [("OVERALL", report["overall"])]
    for name, row in rows:
        cells = []
        for c in cols:
            v = row.get(c)
            if c.endswith("_identical") and v is not None:
                v = f"{v}/{row['prompts']}"
            cells.append(f"{'-' if v is None else (f'{v:.3f}' if isinstance(v, float) else v):>11}")
        lines.append(f"{name:<15}" + "".join(cells))
    costs = report["costs_seconds"]
    verify = ", ".join(f"k={k}: {v * 1e3:.1f}" for k, v in costs["verify"].items())
    width = report.get("tree_width", 1)
    if width > 1:
        lines.append(f"\ntoken tree: {width} candidates per draft position, 1 + k*{width} tokens "
                     "a verification (the verify costs below)")
    lines.append(f"\ndevice {report['device']}; step {json.dumps(report.get('step'))}; target step "
                 f"{costs['target_step'] * 1e3:.1f} ms; draft step {costs['draft_step'] * 1e3:.2f} ms"
                 + (f" (and {costs['draft_round'] * 1e3:.2f} ms a round)" if costs.get("draft_round")
                    else "") + f"; verify (ms) {verify}")
    lines.append("verify(k+1)/step: " + ", ".join(f"k={k}: {v:.2f}" for k, v in report["verify_ratio"].items()))
    for mode, name in (("target", "target-only"), ("spec", "speculative")):
        h = report["overall"].get("host", {}).get(mode)
        if h:
            lines.append(f"{name} step {h['step_ms']:.2f} ms: host {h['host_ms']:.2f} ms, model calls "
                         f"{h['model_ms']:.2f} ms, device wait {h['device_wait_ms']:.2f} ms "
                         f"({h['steps']} steps)")
    if report.get("host_time"):
        lines.append(f"host time: {report['host_time']}")
    if "hf_compiled" in report:
        c = report["hf_compiled"]
        lines.append(f"hf-compiled peer: {c['recipe']}, torch.compile mode={c['mode']!r}, cache "
                     f"{c['max_cache_len']} tokens, compiled in {c['compile_seconds']} s")
    bw = report.get("bandwidth")
    if bw:
        for name in ("target", "draft"):
            if name in bw:
                f = bw[name]
                lines.append(f"{name} step: {f['bytes'] / 1e6:.0f} MB read in {f['step_ms']:.1f} ms = "
                             f"{f['gb_s']:.1f} GB/s, {f['fraction_of_bandwidth']:.0%} of the {bw['memory_gb_s']:.1f} "
                             f"GB/s measured here (read {bw.get('read_gb_s')}, copy {bw.get('copy_gb_s')}) "
                             f"at a {bw['context']}-token context")
    for m in report["overall"]["mismatches"]:
        lines.append(f"mismatch at token {m['index']}: target margin {m['margin']} "
                     f"(tolerance {m.get('tolerance')}) -> {'numerical tie' if m['tie'] else 'REAL DIFFERENCE'}")
    overall = report["overall"]
    lines.append(f"bound >= measured speedup on {overall['prompts'] - overall.get('prompts_above_bound', 0)}"
                 f"/{overall['prompts']} prompts (2% allowed for timing noise)")
    per_pos = report["overall"]["acceptance_per_position"]
    lines.append("acceptance per position: " + " ".join(f"{x:.2f}" for x in per_pos))
    if "vllm" in report:
        v = report["vllm"]
        lines.append(f"vLLM {v['version']} peer ({v['dtype']}, {v['threads']} thread; ours "
                     f"{v['ours_threads']}): speculative config {json.dumps(v['speculative_config'])}; "
                     f"servers healthy in " + ", ".join(f"{m} {s} s" for m, s in v["start_seconds"].items()))
        per_pos = overall.get("vllm_acceptance_per_position") or []
        lines.append("vLLM acceptance per position: " + " ".join(f"{x:.2f}" for x in per_pos)
                     + f"; vLLM speculative speedup {overall.get('vllm_speedup')}")
    return "\n".join(lines)
