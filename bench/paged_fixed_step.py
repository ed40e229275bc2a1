#!/usr/bin/env python
"""The paged fixed step (kv/paged_fixed.py) against the contiguous fixed step (kv/static.py) on
one model shape: `rows` rows, one holding a long prompt and the rest short ones (issue 51's "one
8k-token chat makes every short chat in its batch pay"), then one-token decode steps. Per batch
size: the KV bytes each cache holds (contiguous: its whole rows x capacity tensor; paged: the
blocks the rows hold) beside the rows' theoretical bytes, the median decode step of each, in
turns, and whether every step's logits were bitwise equal. Figures:
docs/measurements/2026-12-06-paged-fixed-step-cpu.md.

    python bench/paged_fixed_step.py --shape smollm2-135m --rows 1 8 32      # CPU, bf16, eager
    python bench/paged_fixed_step.py --device cuda --compile on               # GPU: graphs

A random model of the shape (bench/gpu_step_bench.py's SHAPES); its speed is not its weights'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "engine"))
sys.path.insert(0, str(REPO / "bench"))   # gpu_step_bench, beside it

import torch  # noqa: E402

from gpu_step_bench import SHAPES, build, sync, versions  # noqa: E402
from specpair.kv.paged_fixed import PagedFixedKVModel  # noqa: E402
from specpair.kv.static import StaticKVModel  # noqa: E402


def run(model, rows: int, long: int, short: int, steps: int, compile: str, device) -> dict:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim
                 * next(model.parameters()).element_size())
    blocks = ((long + steps + 16) // 16 + 1) + (rows - 1) * ((short + steps + 16) // 16 + 1)
    caches = {"contiguous": StaticKVModel(model, compile=compile, fixed=True),
              "paged": PagedFixedKVModel(model, blocks=blocks, compile=compile)}
    prompts = [[(7 * i + 3) % 500 + 3 for i in range(long)]] + [
        [(11 * i + r) % 500 + 3 for i in range(short)] for r in range(1, rows)]
    equal = True
    for kv in caches.values():
        kv.add_rows(rows)
        for i, prompt in enumerate(prompts):      # one prompt a step, as rows join a batch
            kv.extend([prompt if j == i else [] for j in range(rows)])
    times = {name: [] for name in caches}
    for step in range(steps):
        out = {}
        for name, kv in caches.items():           # in turns: the machine's noise falls on both
            sync(device)
            started = time.perf_counter()
            out[name] = kv.extend([[(step * 13 + r) % 500 + 3] for r in range(rows)])
            sync(device)
            times[name].append(time.perf_counter() - started)
        equal &= torch.equal(out["contiguous"], out["paged"])
    lengths = caches["paged"].lengths
    return {"rows": rows, "lengths": f"1 x {lengths[0]}, {rows - 1} x {short + steps}",
            "capacity": caches["contiguous"].capacity,
            "kv_bytes": {"theoretical": sum(lengths) * per_token,
                         "contiguous": caches["contiguous"].cache_bytes,
                         "paged_held": caches["paged"].held_bytes},
            "decode_step_ms_median": {name: round(statistics.median(t[1:] or t) * 1e3, 2)
                                      for name, t in times.items()},
            "bitwise_equal": equal}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--long", type=int, default=1500, help="the long row's prompt tokens")
    parser.add_argument("--short", type=int, default=40, help="every other row's prompt tokens")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compile", default="off", choices=["off", "on"])
    parser.add_argument("--layers", type=int, default=0,
                        help="keep only the first N layers (0: all): per-layer costs, sooner")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    model = build(args.shape, device, getattr(torch, args.dtype), real_smollm2=False)
    if args.layers:
        model.model.layers = model.model.layers[:args.layers]
        model.config.num_hidden_layers = args.layers
    report = {"shape": args.shape, "layers": model.config.num_hidden_layers, "dtype": args.dtype,
              "compile": args.compile,
              **versions(device), "runs": []}
    for rows in args.rows:
        report["runs"].append(run(model, rows, args.long, args.short, args.steps, args.compile,
                                  device))
        print(json.dumps(report["runs"][-1]), flush=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
