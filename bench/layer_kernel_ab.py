#!/usr/bin/env python
"""One SmolLM2-shaped paged layer through cpu_kernels.c, a git revision's kernel (A) against the
working tree's (B): R rows sharing a P-position prompt prefix by reference (one group,
attend_group), one token each, the two libraries alternated call by call in one process, so the
machine's noise falls on both. Per row count: min and median ms a call, ms a token, GFLOP/s
(weights' and attention's multiply-adds), and whether B's output is bitwise A's. Then the layer's
time split into phases (a build of B with -DSPECPAIR_PROFILE: q/k/v, rotary and cache writes,
attention and its scores / softmax / values, output projection, gate/up, SiLU, down) and each
linear alone through our kernel against torch's (oneDNN/BLAS) at the same rows. Figures:
docs/measurements/2026-12-07-layer-kernel-ab-cpu.md.

    python bench/layer_kernel_ab.py --base f2dee58 --rows 8 32 --calls 31
    OMP_WAIT_POLICY=passive python bench/layer_kernel_ab.py ...    # CPU times without spinning
    python bench/layer_kernel_ab.py --tiny        # seconds: a small shape, for a test

Random weights and caches (the layer's speed is not its weights'); weights stay in the L3 here,
as they would not in a whole model's step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "engine"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specpair import cpu_kernels as ck  # noqa: E402

SMOLLM2 = dict(D=576, H=9, Hkv=3, hd=64, F=1536)
TINY = dict(D=64, H=4, Hkv=2, hd=16, F=128)
PHASES = ["qkv", "rope+write", "attention", "out", "gate+up", "silu", "down",
          "scores (cpu s)", "softmax (cpu s)", "values (cpu s)"]
BLOCK = 16


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    base = ck.library()
    for fn in ("specpair_small_linear", "specpair_llama_layer"):
        getattr(lib, fn).argtypes = getattr(base, fn).argtypes
        getattr(lib, fn).restype = getattr(base, fn).restype
    return lib


def build_at(rev: str, out_dir: Path) -> ctypes.CDLL:
    """The kernel as it was at `rev`, built with the served flags."""
    text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:engine/specpair/cpu_kernels.c"],
                          check=True, capture_output=True).stdout
    src = out_dir / "cpu_kernels.c"
    src.write_bytes(text)
    # and the headers as they were at `rev` (its folder is searched first): the working tree's
    # may no longer fit the older source (prompt_scores() took a head count from c2181c4)
    headers = []
    for header in ck.HEADERS:
        shown = subprocess.run(["git", "-C", str(REPO), "show",
                                f"{rev}:engine/specpair/{header.name}"], capture_output=True)
        if shown.returncode == 0:       # (a revision before the header existed: none)
            (out_dir / header.name).write_bytes(shown.stdout)
            headers.append(out_dir / header.name)
    lib, err = ck.build_library(src, *headers)
    if lib is None:
        raise SystemExit(f"building {rev}'s kernel: {err}")
    return _typed(lib)


def build_profiled(out_dir: Path) -> ctypes.CDLL:
    out = out_dir / "cpu_kernels_profile.so"
    compiler = os.environ.get("CC") or "cc"
    subprocess.run([compiler, *ck.FLAGS, "-DSPECPAIR_PROFILE", str(ck.SOURCE), "-o", str(out)],
                   check=True)
    lib = _typed(ctypes.CDLL(str(out)))
    lib.specpair_profile.argtypes = [ctypes.c_void_p]
    lib.specpair_profile.restype = ctypes.c_int
    return lib


def flops_per_token(shape: dict, positions: int) -> tuple[float, float]:
    D, H, Hkv, hd, F_ = (shape[k] for k in ("D", "H", "Hkv", "hd", "F"))
    qd, kd = H * hd, Hkv * hd
    weights = 2 * (D * (qd + 2 * kd) + qd * D + 3 * D * F_)
    attention = 2 * 2 * H * hd * (positions + 1)          # scores and values
    return weights, attention


def layer_case(shape: dict, rows: int, positions: int, gen: torch.Generator):
    D, H, Hkv, hd, F_ = (shape[k] for k in ("D", "H", "Hkv", "hd", "F"))
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    w = [r(H * hd, D) * 0.02, r(Hkv * hd, D) * 0.02, r(Hkv * hd, D) * 0.02, r(D, H * hd) * 0.02,
         r(F_, D) * 0.02, r(F_, D) * 0.02, r(D, F_) * 0.02, torch.ones(D), torch.ones(D)]
    shared = positions // BLOCK                         # the prefix's full blocks, shared
    per_row = shared + 2
    blocks = shared + rows * 2 + 1
    kc, vc = r(blocks, Hkv, BLOCK, hd), r(blocks, Hkv, BLOCK, hd)
    table = torch.tensor([list(range(shared)) + [shared + 2 * i, shared + 2 * i + 1]
                          for i in range(rows)], dtype=torch.long)
    assert table.shape[1] == per_row
    pos = torch.full((rows,), positions, dtype=torch.long)
    return dict(h=r(rows, D), rows=torch.arange(rows), positions=pos, cos=r(rows, hd),
                sin=r(rows, hd), kc=kc, vc=vc, weights=w, table=table)


def call(lib, case: dict, shape: dict) -> tuple[float, float, torch.Tensor]:
    """(wall seconds, the process's CPU seconds, the layer's output) of one call."""
    ck.use_library(lib)
    h = case["h"].clone()      # the cache's writes are the same key and value every call
    cpu, started = time.process_time(), time.perf_counter()
    ck.llama_layer(h, case["rows"], case["positions"], case["cos"], case["sin"], case["kc"],
                   case["vc"], case["weights"], 1e-5, shape["H"], shape["Hkv"], shape["hd"],
                   table=case["table"])
    return time.perf_counter() - started, time.process_time() - cpu, h


def linears_ab(libs: dict, shape: dict, rows: int, calls: int, gen) -> dict:
    """Each of the layer's products alone: our kernel (each library) and torch's F.linear."""
    D, H, Hkv, hd, F_ = (shape[k] for k in ("D", "H", "Hkv", "hd", "F"))
    products = {"qkv": (D, [H * hd, Hkv * hd, Hkv * hd]), "out": (H * hd, [D]),
                "gate+up": (D, [F_, F_]), "down": (F_, [D])}
    out = {}
    for name, (inner, outs) in products.items():
        x = torch.randn(rows, inner, generator=gen)
        ws = [torch.randn(o, inner, generator=gen) for o in outs]
        flop = 2 * rows * inner * sum(outs)
        times = {k: [] for k in [*libs, "torch"]}
        for i in range(calls):
            for k in (list(times) if i % 2 == 0 else list(reversed(times))):
                if k != "torch":
                    ck.use_library(libs[k])   # before the clock: the switch is not the product's time
                started = time.perf_counter()
                if k == "torch":
                    [F.linear(x, w) for w in ws]
                else:
                    ck.linears(x, *ws)
                times[k].append(time.perf_counter() - started)
        out[name] = {k: {"min_ms": 1e3 * min(v), "gflops_at_min": flop / min(v) / 1e9}
                     for k, v in times.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the A kernel")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--positions", type=int, default=1696, help="shared prefix positions")
    ap.add_argument("--calls", type=int, default=31)
    ap.add_argument("--tiny", action="store_true", help="a small shape (a test's seconds)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch's (and so the kernel's)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    assert ck.available(), ck.status()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = TINY if args.tiny else SMOLLM2
    gen = torch.Generator().manual_seed(0)
    load = [os.getloadavg()]
    report: dict = {"shape": shape, "positions": args.positions, "base": args.base,
                    "threads": torch.get_num_threads(), "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"A": build_at(args.base, Path(tmp)), "B": _typed(ck.library())}
        profiled = None if args.no_profile else build_profiled(Path(tmp))
        w_flop, a_flop = flops_per_token(shape, args.positions)
        for R in args.rows:
            case = layer_case(shape, R, args.positions, gen)
            times = {k: [] for k in libs}
            cpus = {k: [] for k in libs}
            outs = {}
            for i in range(args.calls):
                for k in (list(libs) if i % 2 == 0 else list(reversed(libs))):
                    dt, dc, outs[k] = call(libs[k], case, shape)
                    times[k].append(dt)
                    cpus[k].append(dc)
            row = {"equal": torch.equal(outs["A"], outs["B"])}
            for k, ts in times.items():
                row[k] = {"min_ms": 1e3 * min(ts), "median_ms": 1e3 * statistics.median(ts),
                          "min_ms_per_token": 1e3 * min(ts) / R,
                          "gflops_at_min": R * (w_flop + a_flop) / min(ts) / 1e9,
                          # CPU time: what the call's threads ran, less sensitive than wall
                          # time to other jobs preempting one thread while the other waits
                          # (with OMP_WAIT_POLICY=passive a waiting thread does not spin)
                          "cpu_min_ms": 1e3 * min(cpus[k]),
                          "cpu_median_ms": 1e3 * statistics.median(cpus[k])}
            if profiled is not None:
                phases = (ctypes.c_double * len(PHASES))()
                call(profiled, case, shape)
                profiled.specpair_profile(phases)         # drop the warm-up call
                seen = {p: [] for p in PHASES}
                for _ in range(args.calls):
                    call(profiled, case, shape)
                    profiled.specpair_profile(phases)
                    for i, p in enumerate(PHASES):
                        seen[p].append(1e3 * phases[i])
                # each phase's least over the calls: the noise of other jobs only adds
                row["phases_ms"] = {p: min(v) for p, v in seen.items()}
            row["linears"] = linears_ab(libs, shape, R, args.calls, gen)
            report["rows"][R] = row
            print(f"R={R:>2}: A min {row['A']['min_ms']:.2f} ms ({row['A']['min_ms_per_token']:.3f}"
                  f"/token, {row['A']['gflops_at_min']:.1f} GFLOP/s), B min {row['B']['min_ms']:.2f}"
                  f" ms ({row['B']['min_ms_per_token']:.3f}/token, {row['B']['gflops_at_min']:.1f}"
                  f" GFLOP/s), B/A {row['B']['min_ms'] / row['A']['min_ms']:.2f}, medians "
                  f"{row['A']['median_ms']:.2f} / {row['B']['median_ms']:.2f}, bitwise equal: "
                  f"{row['equal']}", flush=True)
            print(f"      CPU ms a call (min, median): A {row['A']['cpu_min_ms']:.2f}, "
                  f"{row['A']['cpu_median_ms']:.2f}; B {row['B']['cpu_min_ms']:.2f}, "
                  f"{row['B']['cpu_median_ms']:.2f}", flush=True)
            if "phases_ms" in row:
                print("      B's phases, least ms a call: " + ", ".join(
                    f"{p} {v:.2f}" for p, v in row["phases_ms"].items()), flush=True)
            for name, res in row["linears"].items():
                print(f"      {name:>8}: " + ", ".join(
                    f"{k} {v['min_ms']:.3f} ms {v['gflops_at_min']:.1f} GFLOP/s"
                    for k, v in res.items()), flush=True)
            load.append(os.getloadavg())
    for R in args.rows[1:]:
        a, b, r0 = report["rows"][args.rows[0]], report["rows"][R], args.rows[0]
        for k in ("A", "B"):
            print(f"per token, {R} rows / {r0} rows, {k}: wall min "
                  f"{b[k]['min_ms_per_token'] / a[k]['min_ms_per_token']:.2f}x, CPU min "
                  f"{b[k]['cpu_min_ms'] / R / (a[k]['cpu_min_ms'] / r0):.2f}x")
    report["load_averages"] = load
    print("load averages:", " ".join(f"{x[0]:.1f}" for x in load))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(r["equal"] for r in report["rows"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
