"""`specpair gate`: golden-prompt gating of one pair release, ending in a machine-readable verdict.

Order matters: the tokenizers are compared first, from tokenizer files alone, so a mismatched
draft fails before any model weights are loaded (no GPU time spent). Then the golden prompts run
target-only and speculative (greedy): outputs must be identical, and acceptance, mean acceptance
length and speedup are measured per category. A small sweep over k and over batch sizes finds the
settings that pay on *this* hardware; the release records them.

The verdict (JSON, contract in docs) is written to --out; the golden outputs go beside it as
golden_outputs.json. Recording in MLflow is the gate runner's job (operator side).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

from specpair.config import GenerationParams, Release, SpeculationConfig, read_release_file
from specpair.contract import DEFAULT_CATEGORY, gate_tuning, speculation_off_reason, threshold_failures
from specpair.errors import SpecpairError
from specpair.identity import first_divergence
from specpair.gate.structured import golden_ask, golden_chat, judged, prepared
from specpair.gate.verdict import (NOISE_REPEATS, PromptRow, check_release, new_verdict, prompt_figures,
                                   timing_noise, tokenizer_check)


def _timed_generate(engine, prompts, params, *, speculate: bool, chat: bool):
    """(seconds, results) of one generation from a fresh controller (each timing starts alike)."""
    from specpair.costs import timed

    engine.controller.reset()
    return timed(lambda: engine.generate(prompts, params, chat=chat, speculate=speculate), engine.target.device)


def run_gate(release: dict, *, device: str | None = None, progress=print,
             k_sweep: list[int] | None = None, batch_sizes: list[int] | None = None,
             runs: int = 1) -> tuple[dict, list[dict]]:
    """Returns (verdict, golden outputs)."""
    if (release.get("engine") or {}).get("kind", "specpair") == "vllm":
        from specpair.gate.vllm import run_gate_vllm  # the same verdict, from real vLLM servers
        return run_gate_vllm(release, progress=progress)
    from specpair.costs import RequestAudit
    from specpair.pair import load_pair
    from specpair.stats import AcceptanceStats

    check_release(release)
    pair = dataclasses.replace(Release.from_dict(release).pair, device=device)
    gating = release.get("gating") or {}
    thresholds = gating.get("thresholds") or {}
    prompts = gating["prompts"]
    chat = bool(gating.get("chat", True))
    max_new = int(gating.get("maxNewTokens", 32))
    verdict = new_verdict()

    progress("checking tokenizers before loading any model")
    tok = tokenizer_check(release, progress)
    verdict["tokenizer"] = tok
    if not tok["compatible"]:
        verdict["reasons"] = ["tokenizer mismatch: " + "; ".join(tok["differences"])]
        return verdict, []

    spec = pair.speculation
    engine = load_pair(pair, progress=progress)     # as the engine pods will run it
    # ... but every request drafts every round: the acceptance measured here is what live
    # acceptance (the pods' audited requests, costs.RequestAudit) is judged against.
    engine.audit = RequestAudit(1.0)
    target = engine.target
    verdict["device"] = str(target.device)
    texts = [p["prompt"] for p in prompts]
    categories = [str(p.get("category") or DEFAULT_CATEGORY) for p in prompts]
    params = GenerationParams(max_new_tokens=max_new)
    # Each prompt as the server decodes it: a response_format's grammar, tools rendered by the
    # chat template (a forced call through the grammar); checked in check_release.
    asks = [golden_ask(p, i, golden_chat(p, chat)) for i, p in enumerate(prompts)]
    decoded = [prepared(target.tokenizer, text, ask, golden_chat(p, chat))
               for p, text, ask in zip(prompts, texts, asks)]

    # Warm-up, then one prompt at a time (batch 1: the latency case speculation is for).
    engine.generate(texts[:1], GenerationParams(max_new_tokens=2), chat=chat)
    engine.generate(texts[:1], GenerationParams(max_new_tokens=2), chat=chat, speculate=False)
    golden, per_prompt = [], []
    # Target-only is timed NOISE_REPEATS times at least: the spread of those repeats is the noise
    # the default minSpeedup forgives (contract.speedup_floor). Speculative decoding is timed as
    # often, each run right after a target-only one, and each side's median is taken: one
    # speculative run against three target-only ones let a single burst of other work decide
    # (a tiny pair gated at 0.73x under CI load, 1.48x alone; speculation then shipped off).
    base_repeats = []
    for text, category, ask, (decode, decode_chat, structure) in zip(texts, categories, asks, decoded):
        one = dataclasses.replace(params, structure=structure)
        started_at = time.time()    # when this prompt's timings began: its trace's start in MLflow
        base_times, spec_times = [], []
        for _ in range(max(runs, NOISE_REPEATS)):
            seconds, res = _timed_generate(engine, [decode], one, speculate=False, chat=decode_chat)
            base_times.append(seconds)
            base = res[0]
            seconds, res = _timed_generate(engine, [decode], one, speculate=True, chat=decode_chat)
            spec_times.append(seconds)
            spec_res = res[0]
        base_repeats.append(base_times)
        t_base = statistics.median(base_times)
        divergence = first_divergence(target, engine.encode(decode, chat=decode_chat), base.token_ids,
                                      spec_res.token_ids)
        identical = divergence is None
        t_spec = statistics.median(spec_times)
        # The reply served is the speculative one: it is the one judged.
        verdicts = judged(target.tokenizer, ask, spec_res.text)
        per_prompt.append(PromptRow(category, t_base, t_spec, spec_res.stats, identical,
                                    identical or bool(divergence and divergence["tie"]),
                                    verdicts["schema_valid"], verdicts["tool_call_parsed"]))
        golden.append({"prompt": text, "category": category, "target_only": base.text,
                       "speculative": spec_res.text, "identical": identical, "divergence": divergence,
                       "token_ids": base.token_ids, "output_tokens": len(spec_res.token_ids),
                       "speedup": round(t_base / t_spec, 4) if t_spec else 0.0,
                       "seconds": {"target_only": round(t_base, 6), "speculative": round(t_spec, 6)},
                       "started_at": round(started_at, 3),
                       **({} if ask.plain else verdicts),
                       **{k: v for k, v in spec_res.stats.to_dict().items()
                          if k in ("acceptance_rate", "mean_acceptance_length")}})

    def summarise(rows: list[PromptRow]) -> tuple[AcceptanceStats, dict]:
        stats = AcceptanceStats()
        for r in rows:
            stats.merge(r.acceptance)
        return stats, prompt_figures(rows, stats)

    overall_stats, overall = summarise(per_prompt)
    verdict.update(overall)
    verdict["speedupNoise"] = round(timing_noise(base_repeats), 4)
    verdict["acceptancePerPosition"] = [round(x, 4) for x in overall_stats.acceptance_per_position]
    for cat in dict.fromkeys(categories):
        verdict["categories"][cat] = summarise([r for r in per_prompt if r.category == cat])[1]

    # Tune on this hardware: k (batch 1, fixed k) and the batch size where speculation stops paying.
    # Each point is the median of paired runs (target-only then speculative, back to back), so a
    # noisy neighbour slows both sides of a ratio rather than one.
    def paired_speedup(batches: list[list[str]]) -> float:
        ratios = []
        for _ in range(max(3, runs)):
            t_off = sum(_timed_generate(engine, b, params, speculate=False, chat=chat)[0] for b in batches)
            t_on = sum(_timed_generate(engine, b, params, speculate=True, chat=chat)[0] for b in batches)
            ratios.append(t_off / t_on if t_on else 0.0)
        return statistics.median(ratios)

    # The release's sweeps (gating.tuning), unless the caller names its own. An empty one is
    # skipped, and what it would have tuned is not reported: serving keeps the spec's setting.
    tuning = gate_tuning(release)
    k_values = tuning["kValues"] if k_sweep is None else list(k_sweep)
    sizes = tuning["batchSizes"] if batch_sizes is None else list(batch_sizes)
    best: dict[str, int] = {}
    best_k, best_speed = spec.k, -1.0
    for k in sorted(set(k_values) | {spec.k}) if k_values else []:
        engine.config = SpeculationConfig(**{**spec.to_dict(), "k": k, "dynamic_k": False,
                                             "k_max": max(spec.k_max, k)})
        speed = paired_speedup([[text] for text in texts])
        verdict["kSweep"].append({"k": k, "speedup": round(speed, 4)})
        if speed > best_speed:
            best_k, best_speed = k, speed
    if k_values:
        best["k"] = best_k
    engine.config = SpeculationConfig(**{**spec.to_dict(), "k": best_k, "batch_size_threshold": 10_000})
    threshold, paying = 0, True
    for size in sizes:
        speed = paired_speedup([(texts * size)[:size]])
        verdict["batchSweep"].append({"batchSize": size, "speedup": round(speed, 4)})
        # Speculation stays on up to the largest batch size of an unbroken run that pays.
        paying = paying and speed > 1.0
        if paying:
            threshold = size
    engine.config = spec
    # Batch 1 is what speculation is for: whether it pays there is the minSpeedup threshold's
    # call, so tuning never switches speculation off for good (a threshold of 0 would).
    if sizes:
        best["batchSizeThreshold"] = max(1, threshold)
    off = speculation_off_reason(verdict, thresholds)
    if off:
        # Under the default floor a release slower than target-only (beyond the noise) ships
        # with speculation off rather than failing: serving it target-only is no slowdown.
        best["batchSizeThreshold"] = 0
        verdict["speculationOff"] = off
    verdict["bestSpeculation"] = best or None

    verdict["reasons"] = threshold_failures(verdict, thresholds)
    verdict["passed"] = not verdict["reasons"]
    return verdict, golden


def run_gate_file(release_path: str, out_path: str, *, device: str | None = None,
                  progress=print) -> dict:
    release = read_release_file(release_path, "--release")
    verdict, golden = run_gate(release, device=device, progress=progress)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if golden:
        (out.parent / "golden_outputs.json").write_text(json.dumps(golden, indent=2))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(verdict, indent=2))
    tmp.replace(out)       # the runner never reads half a verdict
    return verdict
