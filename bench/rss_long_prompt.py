"""Does memory taken for one long prompt come back after it leaves? The static cache grows for a
4k-token prompt beside seven short ones; this script shows whether the process's RSS returns to its
short-prompt level afterwards (docs/gpu.md, "Memory follows live rows").

Runs the embedded SmolLM2 pair (n-gram drafts) in one batch: seven short requests, then the
same seven beside one long prompt, then 40 more short requests after it left, and prints the
process RSS and the target cache's bytes at each point as JSON.

    python bench/rss_long_prompt.py --long-tokens 4000 --out docs/measurements/cpu_rss_long_prompt.json

Figures: docs/measurements/cpu_rss_long_prompt.json; read in docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import NgramDrafter
from specpair.models import load_model

SHORT = ["Write a haiku about rain.", "def add(a, b):", "Name three rivers in Europe.",
         "Summarise: the cat sat on the mat.", "What is 7 times 8?", "import json\n", "Say hello in French."]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run(engine, batch, prompts: list[list[int]], params: GenerationParams) -> float:
    """Serve prompts in one batch to the end; the peak RSS seen between steps."""
    for ids in prompts:
        batch.add(ids, params)
    peak = rss_mb()
    while batch.active:
        batch.step()
        peak = max(peak, rss_mb())
    return peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()
    target = load_model(None, device="cpu", progress=lambda _m: None)
    engine = SpeculativeEngine(target, drafter=NgramDrafter(device=target.device),
                               speculation=SpeculationConfig())
    short = [engine.encode(p) for p in SHORT]
    filler = engine.encode("The history of the river and the town beside it, told year by year. " * 400)
    long = filler[: args.long_tokens]
    params = GenerationParams(max_new_tokens=args.new_tokens)
    batch = engine.new_batch()
    points = {"loaded": {"rss_mb": rss_mb()}}

    def point(name, **extra):
        points[name] = {"rss_mb": round(rss_mb(), 1), "cache_bytes": batch.target.cache_bytes, **extra}

    peak = run(engine, batch, short, params)
    point("after 7 short", peak_rss_mb=round(peak, 1))
    started = time.perf_counter()
    peak = run(engine, batch, short + [long], params)
    point("after 7 short beside one long", peak_rss_mb=round(peak, 1),
          seconds=round(time.perf_counter() - started, 1))
    for _ in range(40 // len(short) + 1):
        run(engine, batch, short, params)
    point("after 40+ more short")
    base, after = points["after 7 short"]["rss_mb"], points["after 40+ more short"]["rss_mb"]
    report = {"what": "process RSS around one long prompt (bench/rss_long_prompt.py)",
              "target": "SmolLM2-135M-Instruct fp32, n-gram drafts, CPU", "long_prompt_tokens": len(long),
              "torch": torch.__version__, "machine": platform.machine(), "points": points,
              "after_vs_short_level": round(after / base, 3)}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
