#!/usr/bin/env python
"""What the shared-prefix chat load's phases cost by CPU time, in-process on a real Batch (no
server, no HTTP): the cold prefill of one prompt, the other rows joining (their prompt tails at
the shared prefix's length), and target-only decode steps at each --rows count; per phase the wall
and the process's CPU seconds, and the share inside the C layer calls. On a shared machine wall
times say how often the threads were preempted; run with OMP_WAIT_POLICY=passive so that CPU times
do not count threads spinning at barriers (docs/measurements/2026-12-07-served-load-cpu.md).

    OMP_WAIT_POLICY=passive python bench/load_phase_cpu.py --rows 32 8 --steps 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_load_bench import WORDS, system_prompt  # noqa: E402
from worker_timeline import forget_prefixes, load_engine  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 8], help="decode rows, in this order")
    parser.add_argument("--steps", type=int, default=5, help="timed steps a count (the median is said)")
    parser.add_argument("--shared-prefix", type=int, default=1500, metavar="TOKENS")
    args = parser.parse_args()

    import torch

    from specpair import cpu_kernels
    from specpair.config import GenerationParams

    engine = load_engine(args.target, ["--no-spec", "--max-batch-size", "64"])
    clock = {"layer": 0.0, "layer_cpu": 0.0}

    def time_calls(entry):
        # the C layer a layer a call, or a step's layers in one call (llama_layers: the paged
        # step since c36890c, the contiguous one since cedb5e8)
        call = getattr(cpu_kernels, entry)

        def timed_layer(*a, **k):
            wall, cpu = time.perf_counter(), time.process_time()
            out = call(*a, **k)
            clock["layer"] += time.perf_counter() - wall
            clock["layer_cpu"] += time.process_time() - cpu
            return out
        setattr(cpu_kernels, entry, timed_layer)
    for entry in ("llama_layer", "llama_layers"):
        time_calls(entry)

    def timed(fn) -> dict:
        clock.update(layer=0.0, layer_cpu=0.0)
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return {"wall": round(time.perf_counter() - wall, 4), "cpu": round(time.process_time() - cpu, 4),
                "layer_wall": round(clock["layer"], 4), "layer_cpu": round(clock["layer_cpu"], 4)}

    system = system_prompt(args.shared_prefix)
    most = max(args.rows)
    prompts = [engine.encode([{"role": "system", "content": system},
                              {"role": "user", "content": f"Request {i}: which {WORDS[i % len(WORDS)]} "
                                                          f"setting matters most, and why?"}], chat=True)
               for i in range(most)]
    print(f"{len(prompts[0])}-token prompts, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, load {os.getloadavg()[0]:.1f}", flush=True)
    params = GenerationParams(max_new_tokens=args.steps * len(args.rows) * 2 + 8, speculation_k=0)
    engine.eos_ids = frozenset()      # every row steps to its budget
    forget_prefixes(engine)
    batch = engine.new_batch()
    batch.speculate = False
    batch.add(prompts[0], params, request_id="r0")
    print("cold prefill", timed(batch.step), flush=True)
    for i in range(1, most):
        batch.add(prompts[i], params, request_id=f"r{i}")
    print(f"{most - 1} rows joining", timed(batch.step), flush=True)
    added = most
    for rows in args.rows:
        while batch.active > rows:
            batch.cancel(batch.rows[-1].request_id)
        while batch.active < rows:        # (their tails fed in the untimed step below)
            batch.add(prompts[added % most], params, request_id=f"r{added}")
            added += 1
        batch.done.clear()
        batch.step()
        runs = sorted((timed(batch.step) for _ in range(args.steps)), key=lambda r: r["wall"])
        median = runs[len(runs) // 2]
        print(f"{rows} rows: median step {median}: {1e3 * median['cpu'] / rows:.2f} CPU ms a token, "
              f"{rows / median['wall']:.1f} tok/s wall", flush=True)
    batch.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
