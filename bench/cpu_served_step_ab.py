#!/usr/bin/env python
"""The served engine's steps with a git revision's C kernel (A) against the working tree's (B),
runs alternated in one process (A B B A ...): bench/worker_timeline.py's in-process shared-prefix
chat load (32 chats sharing a system prompt, the default batch size) handed to an EngineWorker.
A kernel without specpair_llama_layers runs a layer a call (PagedKVModel.extend's path for it),
so `--base` a revision before the one call measures the one call's effect on the served step.

Per run: the decode-only steps at the widest batch (32 rows): process CPU ms and the engine
thread's CPU ms a step, and from /proc each thread group's ms asleep and sleeps a step (counts a
busy machine changes little; wall times only with their load). Every run's replies must equal
the first run's (the kernels are bitwise alike).

    GOMP_SPINCOUNT=2000 python bench/cpu_served_step_ab.py --base c36890c~1 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_timeline import (WORDS, forget_prefixes, load_engine, run_load,  # noqa: E402
                             system_prompt)

from layer_kernel_ab import build_at  # noqa: E402  (after worker_timeline: its OpenMP wait)
from specpair import cpu_kernels as ck  # noqa: E402


def decode_figures(run: dict) -> dict:
    """The widest decode-only steps' CPU a step, and where the threads' wall went a step."""
    steps = [s for s in run["_steps"] if s["fed"] <= s["rows"]]
    widest = max(s["rows"] for s in steps)
    full = [s for s in steps if s["rows"] == widest]
    threads = (run["decode_phase_threads"] or {}).get("by_thread", {})
    pool = threads.get("kernel pool 1", {})
    engine = threads.get("engine", {})
    return {"rows": widest, "steps": len(full),
            "cpu_ms_median": statistics.median(s["cpu_ms"] for s in full),
            "cpu_ms_min": min(s["cpu_ms"] for s in full),
            "wall_ms_median": statistics.median(s["ms"] for s in full),
            "engine_run_ms": engine.get("run_ms"), "pool_run_ms": pool.get("run_ms"),
            "pool_asleep_ms": pool.get("asleep_ms"), "pool_sleeps": pool.get("sleeps"),
            "engine_asleep_ms": engine.get("asleep_ms"), "engine_sleeps": engine.get("sleeps"),
            "tokens_per_second": run["tokens_per_second"], "load": run["load_average"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision whose kernel is A")
    ap.add_argument("--target", default="default")
    ap.add_argument("--shared-prefix", type=int, default=1500, metavar="TOKENS")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="A B, then B A, ... this many times")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    engine = load_engine(args.target, [])
    served = ck.library()
    assert served is not None and ck.layers_apply(), ck.status()
    questions = [f"Request {i}: which {WORDS[i % len(WORDS)]} setting matters most, and why?"
                 for i in range(args.concurrency)]
    system = system_prompt(args.shared_prefix)
    prompts = [engine.encode([{"role": "system", "content": system}, {"role": "user", "content": q}],
                             chat=True) for q in questions]
    order = []
    for n in range(args.rounds):
        order += ["A", "B"] if n % 2 == 0 else ["B", "A"]
    report = {"base": args.base, "load_start": os.getloadavg(), "runs": []}
    replies = None
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"A": build_at(args.base, Path(tmp)), "B": served}
        try:
            for n, which in enumerate(order):
                ck.use_library(libs[which])
                forget_prefixes(engine)
                run = run_load(engine, 0, prompts, args.max_new_tokens)
                if replies is None:
                    replies = run["_replies"]
                figures = {"run": n, "kernel": which, "one_call": ck.layers_apply(),
                           "replies_equal_first": run["_replies"] == replies, **decode_figures(run)}
                report["runs"].append(figures)
                print(json.dumps(figures), flush=True)
        finally:
            ck.use_library(served)
    report["load_end"] = os.getloadavg()
    for which in ("A", "B"):
        runs = [r for r in report["runs"] if r["kernel"] == which]
        keys = ("cpu_ms_median", "cpu_ms_min", "wall_ms_median", "engine_run_ms", "pool_run_ms",
                "pool_asleep_ms", "pool_sleeps", "tokens_per_second")
        report[which] = {k: round(statistics.mean(r[k] for r in runs if r[k] is not None), 1)
                         for k in keys}
        print(which, json.dumps(report[which]), flush=True)
    print("replies equal across runs:", all(r["replies_equal_first"] for r in report["runs"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
