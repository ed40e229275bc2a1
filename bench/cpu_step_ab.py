#!/usr/bin/env python
"""A whole SmolLM2-shaped CPU step through cpu_kernels.c (30 layers and the LM head), a git
revision's kernel (A) against the working tree's (B, its 30 layers in one call where it has
specpair_llama_layers), alternated step by step in one process:
the CPU time of a decode step of 32 rows sharing a 1,696-position prompt by reference (paged,
issue 51's load) and of a k=5 verification (one row, 6 tokens at position 300; issue 52's
chains), and whether B's logits are bitwise A's. Per step also its wall time and, from /proc
(worker_timeline.thread_clocks), the calling thread's and the kernel pool's other thread's
ms asleep and sleeps (an OpenMP thread asleep at a barrier, its spin run out): counts a busy
machine changes little, where wall times are only worth their load.

    python bench/cpu_step_ab.py --base 75a0615 --steps 9
    python bench/cpu_step_ab.py --a-layer-a-call     # the same kernel, 30 calls against one
    GOMP_SPINCOUNT=2000 python bench/cpu_step_ab.py --threads 2 ...   # as served

Random weights (30 copies of a layer's, ~109 MB: from memory as in a real step, with the
LM head's 113 MB); one cache serves every layer (its reads cost what a layer's own would).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from layer_kernel_ab import BLOCK, SMOLLM2, _typed, build_at, layer_case  # noqa: E402
from specpair import cpu_kernels as ck  # noqa: E402
from worker_timeline import thread_clocks  # noqa: E402  (after torch: its OpenMP wait is set)

LAYERS, VOCAB = 30, 49152


def verification_case(shape: dict, tokens: int, start: int, gen: torch.Generator) -> dict:
    """One row's `tokens` consecutive tokens from position `start`, a contiguous cache."""
    Hkv, hd, D = shape["Hkv"], shape["hd"], shape["D"]
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    S = start + tokens
    return dict(h=r(tokens, D), rows=torch.zeros(tokens, dtype=torch.long),
                positions=torch.arange(start, start + tokens), cos=r(tokens, hd),
                sin=r(tokens, hd), kc=r(1, Hkv, S, hd), vc=r(1, Hkv, S, hd), table=None)


def step(lib, case: dict, layers: list, head: torch.Tensor, shape: dict,
         one_call: bool = True) -> tuple[dict, torch.Tensor]:
    """One step: (its seconds: CPU, wall, and per thread, asleep and times asleep; logits).
    A kernel with specpair_llama_layers runs the 30 layers in one call (as
    paged_cache.PagedKVModel.extend does) unless `one_call` is off; an older one a layer a call."""
    ck.use_library(lib)
    h = case["h"].clone()
    stack = None
    if one_call and ck.layers_apply():       # built once a model in the engine: not timed
        if "stack" not in case:
            case["stack"] = ck.LayerStack(layers, [{}] * len(layers), [None] * len(layers),
                                          [(case["kc"], case["vc"])] * len(layers))
        stack = case["stack"]
    before, wall, cpu = thread_clocks(), time.perf_counter(), time.process_time()
    if stack is not None:
        ck.llama_layers(h, case["rows"], case["positions"], case["cos"], case["sin"], stack,
                        1e-5, shape["H"], shape["Hkv"], shape["hd"], table=case["table"])
    else:
        for weights in layers:
            ck.llama_layer(h, case["rows"], case["positions"], case["cos"], case["sin"],
                           case["kc"], case["vc"], weights, 1e-5, shape["H"], shape["Hkv"],
                           shape["hd"], table=case["table"])
    logits = ck.linear(h, head)
    cpu, wall, after = time.process_time() - cpu, time.perf_counter() - wall, thread_clocks()
    return dict(cpu=cpu, wall=wall, **threads_apart(before, after, wall)), logits


def threads_apart(before: dict, after: dict, wall: float) -> dict:
    """The calling thread's and the busiest other thread's (the kernel pool's: another OpenMP
    team's threads barely run) seconds run (CPU: what the caller runs beyond the pool thread is
    work the pool thread could not share, a busy machine or not), asleep (the wall less run
    and waiting for a core) and times asleep over a step of `wall` seconds."""
    me = threading.get_native_id()
    delta = {tid: tuple(a - b for a, b in zip(clocks, before.get(tid, (0, 0, 0))))
             for tid, clocks in after.items() if not isinstance(tid, str)}
    pool = max((tid for tid in delta if tid != me and delta[tid][0] > 0),
               key=lambda tid: delta[tid][0], default=None)
    out = {}
    for name, tid in (("caller", me), ("pool", pool)):
        # no other thread ran (one thread): nothing to say of a pool
        ran, waited, sleeps = delta[tid] if tid is not None else (float("nan"),) * 3
        out[f"{name}_ran"], out[f"{name}_asleep"] = ran, wall - ran - waited
        out[f"{name}_sleeps"] = sleeps
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--a-layer-a-call", action="store_true",
                    help="A is the working tree's kernel a layer a call, B the same in one call "
                         "(--base unused): the one call's effect alone")
    args = ap.parse_args(argv)
    assert ck.available(), ck.status()
    torch.set_num_threads(args.threads)
    shape, gen = SMOLLM2, torch.Generator().manual_seed(0)
    layers = [layer_case(shape, 1, BLOCK, gen)["weights"] for _ in range(LAYERS)]
    head = torch.randn(VOCAB, shape["D"], generator=gen) * 0.05
    cases = {"decode 32 rows, 1,696 shared positions": layer_case(shape, 32, 1696, gen),
             "verify k=5 (6 tokens, 1 row)": verification_case(shape, 6, 300, gen),
             "verify k=3 (4 tokens, 1 row)": verification_case(shape, 4, 300, gen)}
    report = {"base": args.base, "threads": args.threads, "load_start": os.getloadavg(),
              "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        base = ck.library() if args.a_layer_a_call else build_at(args.base, Path(tmp))
        libs = {"A": _typed(base), "B": _typed(ck.library())}
        if args.a_layer_a_call:
            report["base"] = "the working tree, a layer a call"
        for name, case in cases.items():
            taken = {k: [] for k in libs}
            logits = {}
            for i in range(args.steps):
                for k in (list(libs) if i % 2 == 0 else list(reversed(libs))):
                    seconds, logits[k] = step(libs[k], case, layers, head, shape,
                                              one_call=not (args.a_layer_a_call and k == "A"))
                    taken[k].append(seconds)
            row = {}
            for k, steps in taken.items():
                cpu = [s["cpu"] for s in steps]
                row[k] = {"cpu_min_ms": 1e3 * min(cpu), "cpu_median_ms": 1e3 * statistics.median(cpu)}
                for key in ("wall", "caller_ran", "pool_ran", "caller_asleep", "pool_asleep"):
                    row[k][f"{key}_median_ms"] = 1e3 * statistics.median(s[key] for s in steps)
                for key in ("caller_sleeps", "pool_sleeps"):
                    row[k][f"{key}_median"] = statistics.median(s[key] for s in steps)
            row["equal"] = torch.equal(logits["A"], logits["B"])
            report["cases"][name] = row
            print(f"{name}: A {row['A']['cpu_min_ms']:.1f} / {row['A']['cpu_median_ms']:.1f} ms, "
                  f"B {row['B']['cpu_min_ms']:.1f} / {row['B']['cpu_median_ms']:.1f} ms (CPU min /"
                  f" median), B/A {row['B']['cpu_min_ms'] / row['A']['cpu_min_ms']:.3f}, "
                  f"logits equal {row['equal']}", flush=True)
            for k in libs:
                r = row[k]
                print(f"    {k}: wall {r['wall_median_ms']:.1f} ms; caller ran "
                      f"{r['caller_ran_median_ms']:.1f} ms, pool thread {r['pool_ran_median_ms']:.1f};"
                      f" pool thread asleep "
                      f"{r['pool_asleep_median_ms']:.1f} ms in {r['pool_sleeps_median']:.0f} sleeps, "
                      f"caller asleep {r['caller_asleep_median_ms']:.1f} ms in "
                      f"{r['caller_sleeps_median']:.0f} (medians a step)", flush=True)
    report["load_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
