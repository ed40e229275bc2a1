#!/usr/bin/env python
"""Each product shape the engine runs on the CPU (SmolLM2's q/k/v, output projection, gate/up,
down, LM head) at 1-64 rows: our kernel (cpu_kernels.c; a git revision's as A, the working tree's
as B) against torch's own F.linear (oneDNN/MKL), in GFLOP/s by CPU time, and whether B's outputs
are bitwise A's and a row's output is bitwise the same alone and in the batch.

The weights come from memory as in a model's step: a layer's products sweep `--layers` copies of
its weights (30: SmolLM2's, ~109 MB in all, past the L3) and the LM head is 113 MB by itself.
Implementations alternate sweep by sweep in one process, so the machine's noise falls on all;
each figure is the least CPU time over `--reps` sweeps (other jobs only add).

    python bench/cpu_products.py --base 75a0615 --rows 1 4 5 8 16 32 64
    python bench/cpu_products.py --rows --prefill 256 1696   # a prompt's products, below
    python bench/cpu_products.py --tiny      # seconds: a small shape, for a test

--prefill N: a prompt of N tokens through the layers' products as the engine prefills it (our
kernel in calls of at most MAX_TOKENS rows, 128) against torch's one F.linear over all N rows (how
vLLM-CPU's fp32 prefill runs them: oneDNN on the whole chunk). The weights are reused N times, so
a few copies (`--prefill-layers`) are swept, not 30; the LM head is left out (a prefill reads it
for one row).

--prefill-calls C...: with --prefill N, our kernel alone in calls of each C rows, alternated: the
served source built with -DMAX_TOKENS=max(C), so one build runs every size. Each call reads all
the weights again, so calls of 64 rows read a 1,696-token prompt's weights 27 times and one call
once; the figures say what that costs, and whether every size's outputs are bitwise the first's
(a row's output must not depend on how many rows share its call).

    python bench/cpu_products.py --rows --prefill 1696 --prefill-layers 30 --prefill-calls 64 128 256 1696
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from layer_kernel_ab import _typed, build_at  # noqa: E402
from specpair import cpu_kernels as ck  # noqa: E402

SMOLLM2 = dict(D=576, qd=576, kd=192, F=1536, V=49152)
TINY = dict(D=64, qd=64, kd=32, F=128, V=512)


def products(s: dict) -> dict:
    """name: (inner width, [output widths] read by one call, copies swept a step)."""
    return {"qkv": (s["D"], [s["qd"], s["kd"], s["kd"]]), "o": (s["qd"], [s["D"]]),
            "gate+up": (s["D"], [s["F"], s["F"]]), "down": (s["F"], [s["D"]]),
            "lm_head": (s["D"], [s["V"]])}


def sweep(fn, x: torch.Tensor, copies: list[list[torch.Tensor]]) -> tuple[float, list]:
    cpu = time.process_time()
    outs = [fn(x, ws) for ws in copies]
    return time.process_time() - cpu, outs


def alternated(impls: dict, x: torch.Tensor, copies: list[list[torch.Tensor]],
               reps: int) -> tuple[dict, dict]:
    """Each implementation's least CPU seconds over `reps` sweeps, in turn and in reversed turn
    rep by rep (so the machine's noise falls on all), and its outputs of the last sweep."""
    best, got = {k: float("inf") for k in impls}, {}
    for rep in range(reps):
        for k in (list(impls) if rep % 2 == 0 else list(reversed(impls))):
            dt, got[k] = sweep(impls[k], x, copies)
            best[k] = min(best[k], dt)
    return best, got


def ours(lib):
    def run(x, ws):
        ck._LIB = lib
        return ck._small_linear(x, ws)
    return run


def theirs(x, ws):
    return [F.linear(x, w) for w in ws]


def in_calls(run):
    """`run` over x in slices of at most MAX_TOKENS rows (the engine's calls); per weight, its
    outputs' slices (not joined: a copy of the outputs is no part of the products' cost)."""
    def chunked(x, ws):
        parts = [run(x[s:s + ck.MAX_TOKENS], ws) for s in range(0, len(x), ck.MAX_TOKENS)]
        return [list(col) for col in zip(*parts)]
    return chunked


def in_calls_of(run, width: int):
    """`run` over x in slices of `width` rows, the outputs joined per weight."""
    def chunked(x, ws):
        parts = [run(x[s:s + width], ws) for s in range(0, len(x), width)]
        return [torch.cat(col) for col in zip(*parts)]
    return chunked


def prefill_calls(shape: dict, args, gen: torch.Generator, tmp: Path) -> dict:
    """--prefill-calls: a prompt's products in calls of each width, one build (MAX_TOKENS the
    widest), alternated; GFLOP/s by CPU time and whether each width's outputs are the first's."""
    from prompt_scores_ab import build

    lib = build(ck.SOURCE.read_text(), tmp, "calls", f"-DMAX_TOKENS={max(args.prefill_calls)}")
    impls = {c: in_calls_of(ours(lib), c) for c in args.prefill_calls}
    out: dict = {}
    for name, (inner, outs) in products(shape).items():
        if name == "lm_head" or (args.only and name not in args.only):
            continue
        copies = [[torch.randn(o, inner, generator=gen) * 0.05 for o in outs]
                  for _ in range(args.prefill_layers)]
        for N in args.prefill:
            x = torch.randn(N, inner, generator=gen)
            flop = 2 * N * inner * sum(outs) * len(copies)
            best, got = alternated(impls, x, copies, args.reps)
            first = args.prefill_calls[0]
            row = {"gflops": {c: flop / v / 1e9 for c, v in best.items()},
                   "bitwise_the_first": {c: all(torch.equal(a, b) for a, b in zip(got[c][0], got[first][0]))
                                         for c in impls}}
            out[f"{name} {N}"] = row
            print(f"{name:>8} prefill N={N:>4} in calls of " + ", ".join(
                f"{c}: {row['gflops'][c]:6.1f}" for c in impls) + " GFLOP/s | bitwise the "
                f"{first}-row calls': {all(row['bitwise_the_first'].values())}", flush=True)
    ck.use_library(ck.library())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the A kernel")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 5, 8, 16, 32, 64])
    ap.add_argument("--prefill", type=int, nargs="*", default=[], metavar="N",
                    help="prompt lengths: ours in calls of MAX_TOKENS rows, torch's one call")
    ap.add_argument("--prefill-layers", type=int, default=3)
    ap.add_argument("--prefill-calls", type=int, nargs="*", default=[], metavar="C",
                    help="with --prefill: ours in calls of C rows, each C (one build, MAX_TOKENS=max C)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch's and the kernel's threads")
    ap.add_argument("--only", nargs="*", help="product names (default: all)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    assert ck.available(), ck.status()
    torch.set_num_threads(args.threads)
    shape = TINY if args.tiny else SMOLLM2
    gen = torch.Generator().manual_seed(0)
    report = {"base": args.base, "threads": args.threads, "load_start": os.getloadavg(),
              "products": {}}
    with tempfile.TemporaryDirectory() as tmp:
        impls = {"A": ours(build_at(args.base, Path(tmp))), "B": ours(_typed(ck.library())),
                 "torch": theirs}
        for name, (inner, outs) in products(shape).items():
            if args.only and name not in args.only:
                continue
            if not args.rows:
                continue
            n = 1 if name == "lm_head" else args.layers
            copies = [[torch.randn(o, inner, generator=gen) * 0.05 for o in outs] for _ in range(n)]
            report["products"][name] = {}
            for R in args.rows:
                x = torch.randn(R, inner, generator=gen)
                flop = 2 * R * inner * sum(outs) * n
                best, got = alternated(impls, x, copies, args.reps)
                # the engine's property: row 0 alone equals row 0 of the batch, bitwise
                alone = impls["B"](x[:1].clone(), copies[0])
                row = {"ms": {k: 1e3 * v for k, v in best.items()},
                       "gflops": {k: flop / v / 1e9 for k, v in best.items()},
                       "b_equals_a": all(torch.equal(a, b) for a, b in
                                         zip(got["A"][0], got["B"][0])),
                       "row_alone_equals_batch": all(torch.equal(a[0], b[0]) for a, b in
                                                     zip(alone, got["B"][0]))}
                report["products"][name][R] = row
                g = row["gflops"]
                print(f"{name:>8} R={R:>2}: A {g['A']:6.1f}  B {g['B']:6.1f}  torch {g['torch']:6.1f}"
                      f" GFLOP/s | ms A {row['ms']['A']:7.2f} B {row['ms']['B']:7.2f} torch "
                      f"{row['ms']['torch']:7.2f} | B==A {row['b_equals_a']} alone==batch "
                      f"{row['row_alone_equals_batch']}", flush=True)
        for name, (inner, outs) in products(shape).items():
            if (name == "lm_head" or (args.only and name not in args.only) or not args.prefill
                    or args.prefill_calls):              # --prefill-calls: ours alone, below
                continue
            copies = [[torch.randn(o, inner, generator=gen) * 0.05 for o in outs]
                      for _ in range(args.prefill_layers)]
            chunked = {"A": in_calls(impls["A"]), "B": in_calls(impls["B"]),
                       "torch": lambda x, ws: [[y] for y in theirs(x, ws)]}
            report["products"].setdefault(name, {})
            for N in args.prefill:
                x = torch.randn(N, inner, generator=gen)
                flop = 2 * N * inner * sum(outs) * len(copies)
                best, got = alternated(chunked, x, copies, args.reps)
                alone = impls["B"](x[-1:].clone(), copies[0])
                row = {"ms": {k: 1e3 * v for k, v in best.items()},
                       "gflops": {k: flop / v / 1e9 for k, v in best.items()},
                       "b_equals_a": all(torch.equal(a, b) for pa, pb in
                                         zip(got["A"][0], got["B"][0]) for a, b in zip(pa, pb)),
                       "row_alone_equals_batch": all(torch.equal(a[0], b[-1][-1]) for a, b in
                                                     zip(alone, got["B"][0]))}
                report["products"][name][f"prefill {N}"] = row
                g = row["gflops"]
                print(f"{name:>8} prefill N={N:>4}: A {g['A']:6.1f}  B {g['B']:6.1f}  torch "
                      f"{g['torch']:6.1f} GFLOP/s | B==A {row['b_equals_a']} last row alone==batch "
                      f"{row['row_alone_equals_batch']}", flush=True)
        if args.prefill and args.prefill_calls:
            report["prefill_calls"] = prefill_calls(shape, args, gen, Path(tmp))
    report["load_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
