#!/usr/bin/env python
"""A request without speculation on a speculating engine against the same request on a
target-only engine, in one process on one random-weight model: where the gap between a
speculating server's target-only requests and a target-only server's comes from (docs/gpu.md).

The speculating engine steps at its token bucket while its batch may speculate
(`SpeculativeEngine.step_bucket`); the target-only engine at one token. Each turn decodes the same
prompt on both, in alternation, and reports per engine the loop's milliseconds per token, the
model's share (StepTiming: model calls, the wait on the device) and the rest (the host's loop),
then cProfile's function-call counts per step for both. Benchmark output, not a test.

    python bench/no_spec_beside_spec.py --device cuda --out out/no_spec_beside_spec.json

Figures: docs/measurements/gpu_h100_39a4377_no_spec_beside_spec.json; read in docs/gpu.md.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/: gpu_step_bench (the step builder) lives beside this file and gpu_measure.sh, which runs it
sys.path[:0] = [str(ROOT / "engine"), str(ROOT / "tests"), str(ROOT / "bench")]

import torch  # noqa: E402

from gpu_step_bench import build  # noqa: E402
from specpair.config import GenerationParams, SpeculationConfig  # noqa: E402
from specpair.decoding import SpeculativeEngine  # noqa: E402
from specpair.drafters import NgramDrafter  # noqa: E402
from tiny_models import make_tokenizer, wrap_model  # noqa: E402


def decode(engine: SpeculativeEngine, ids: list[int], params: GenerationParams) -> dict:
    """One request through a batch of its own, stepped to the end: tokens and the loop's split."""
    batch = engine.new_batch()
    row = batch.add(list(ids), params)
    started = time.perf_counter()
    while batch.active:
        batch.step()
    wall = time.perf_counter() - started
    return {"tokens": len(row.generated), "wall": wall, "steps": batch.timing.steps,
            "model": batch.timing.model_seconds, "wait": batch.timing.wait_seconds,
            "generated": list(row.generated)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile", choices=["on", "off"], default=None)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    model = build(args.shape, device, getattr(torch, args.dtype), real_smollm2=False)
    # The tiny tokenizer: ids past its 400 decode to nothing, which the loop's detokenizer takes.
    target = wrap_model(model, make_tokenizer(), source=f"random-{args.shape}")
    target.device = device
    engines = {
        "speculating engine, request k=0": (
            SpeculativeEngine(target, drafter=NgramDrafter(device=args.device),
                              speculation=SpeculationConfig(k=4, batch_size_threshold=8),
                              compile=args.compile),
            GenerationParams(max_new_tokens=args.max_new_tokens, speculation_k=0)),
        "target-only engine": (
            SpeculativeEngine(target, speculation=SpeculationConfig(enabled=False),
                              compile=args.compile),
            GenerationParams(max_new_tokens=args.max_new_tokens)),
    }
    ids = [(7 * i) % 390 + 5 for i in range(40)]
    for engine, params in engines.values():
        decode(engine, ids, params)                    # warm: the shelf's cache and its graphs
    runs = {name: [] for name in engines}
    for _ in range(args.turns):
        for name, (engine, params) in engines.items():
            runs[name].append(decode(engine, ids, params))
    calls = {}
    for name, (engine, params) in engines.items():
        profile = cProfile.Profile()
        profile.enable()
        out = decode(engine, ids, params)
        profile.disable()
        stats = pstats.Stats(profile)
        calls[name] = round(sum(v[1] for v in stats.stats.values()) / max(out["steps"], 1), 1)
    report = {"device": str(device), "shape": args.shape, "dtype": args.dtype,
              "torch": torch.__version__, "turns": args.turns,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "engines": {}}
    outputs = [r[0]["generated"] for r in runs.values()]
    for name, (engine, _) in engines.items():
        rs = runs[name]
        per_token = [r["wall"] / r["tokens"] * 1e3 for r in rs]
        model_ms = [r["model"] / r["steps"] * 1e3 for r in rs]
        wait_ms = [r["wait"] / r["steps"] * 1e3 for r in rs]
        host_ms = [(r["wall"] - r["wait"]) / r["steps"] * 1e3 for r in rs]
        report["engines"][name] = {
            "describe_step": engine.describe_step(),
            "ms_per_token": round(statistics.median(per_token), 4),
            "model_ms_per_step": round(statistics.median(model_ms), 4),
            "device_wait_ms_per_step": round(statistics.median(wait_ms), 4),
            "host_ms_per_step": round(statistics.median(host_ms), 4),
            "python_calls_per_step": calls[name]}
        e = report["engines"][name]
        print(f"{name}: {e['ms_per_token']:.3f} ms a token (step at {e['describe_step']['token_bucket']}"
              f" tokens; model {e['model_ms_per_step']:.3f} ms of it, device wait "
              f"{e['device_wait_ms_per_step']:.3f}, host {e['host_ms_per_step']:.3f}; "
              f"{e['python_calls_per_step']} Python calls a step)")
    a, b = (report["engines"][n]["ms_per_token"] for n in engines)
    report["ratio"] = round(b / a, 4)    # tokens/s: the k=0 request's over the target-only engine's
    report["identical"] = outputs[0] == outputs[1]
    print(f"the speculating engine's k=0 request / the target-only engine, tokens/s: {report['ratio']:.3f};"
          f" identical replies: {report['identical']} (different buckets: equal to rounding only)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
