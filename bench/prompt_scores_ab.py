#!/usr/bin/env python
"""Attention scores through prompt_scores.h (A: without, B: with), issue 51's cold prompt: the
same cpu_kernels.c source built twice with the served flags, A with PS_MIN_QUERIES past any
group (attend_group's own score loop, as before), B as served; if the source does not include
the header yet, B's copy is wired in here (the #include and the call in attend_group). Checks
every output bitwise (A == B) and times the two alternated call by call in one process:

- one SmolLM2-shaped layer over a 1,696-position prompt in calls of MAX_TOKENS (a cold prefill's);
- one layer of R decode rows sharing a P-position prefix (a 32-chat step's), one token each;
- with --model, the whole model's prefill (real weights): CPU-s, the last position's logits
  bitwise and 16 greedy tokens equal; with --profile the layers' phases (scores, softmax ...).

    OMP_WAIT_POLICY=passive python bench/prompt_scores_ab.py --model ~/.cache/specpair/smollm2-135m-instruct-f32
    python bench/prompt_scores_ab.py --tiny        # seconds: a small shape

Figures: docs/measurements/2026-12-08-cold-prompt.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO.parent / "engine"))

import torch  # noqa: E402

from layer_kernel_ab import PHASES, SMOLLM2, TINY, _typed, call, layer_case  # noqa: E402
from prefill_attention_ab import calls, model_phases, model_prefill, prompt_case, run_call  # noqa: E402
from specpair import cpu_kernels as ck  # noqa: E402

HEADER = ck.SOURCE.with_name("prompt_scores.h")
OFF = "-DPS_MIN_QUERIES=1000000000"          # A: no group is large enough
LOOP = ("    for (long p = lomin / 8 * 8; p < nmax; p += 8) {\n"
        "        for (long i = 0; i < n; i++) {\n")
WIRED_LOOP = ("    long done_from, done_to;     /* keys every token reads at one place: prompt_scores.h */\n"
              "    prompt_scores(q, qd, hh, hd, kr, toks, n, lo, n0, scores, H, L, &done_from, &done_to);\n"
              "    for (long p = lomin / 8 * 8; p < nmax; p += 8) {\n"
              "        if (p >= done_from && p < done_to) continue;\n"
              "        for (long i = 0; i < n; i++) {\n")


def wired(text: str) -> str:
    """cpu_kernels.c's text with prompt_scores.h wired into attend_group (as it is, if it is)."""
    if '#include "prompt_scores.h"' in text:
        return text
    if text.count(LOOP) != 1 or text.count("static void attend_group(") != 1:
        raise SystemExit("attend_group's score loop is not where this bench expects it")
    text = text.replace("static void attend_group(", '#include "prompt_scores.h"\n\nstatic void attend_group(')
    return text.replace(LOOP, WIRED_LOOP)


def build(text: str, out_dir: Path, name: str, *flags: str) -> ctypes.CDLL:
    src = out_dir / "cpu_kernels.c"
    src.write_text(text)
    (out_dir / HEADER.name).write_bytes(HEADER.read_bytes())
    out = out_dir / f"{name}.so"
    subprocess.run([os.environ.get("CC") or "cc", *ck.FLAGS, *flags, str(src), "-o", str(out)], check=True)
    lib = _typed(ctypes.CDLL(str(out)))
    if "-DSPECPAIR_PROFILE" in flags:
        lib.specpair_profile.argtypes = [ctypes.c_void_p]
        lib.specpair_profile.restype = ctypes.c_int
    return lib


def prompt_ab(libs: dict, shape: dict, positions: int, repeats: int) -> dict:
    case = prompt_case(shape, positions, torch.Generator().manual_seed(0))
    spent = {k: [] for k in libs}
    equal = True
    for rep in range(repeats):
        pools = {k: (torch.zeros(case["pool"]), torch.zeros(case["pool"])) for k in libs}
        total = {k: 0.0 for k in libs}
        for i, (a, b) in enumerate(calls(positions)):
            outs = {}
            for k in (list(libs) if (i + rep) % 2 == 0 else list(reversed(libs))):
                cpu, _, outs[k] = run_call(libs[k], case, shape, pools[k], a, b)
                total[k] += cpu
            equal = equal and torch.equal(outs["A"], outs["B"])
        equal = equal and all(torch.equal(x, y) for x, y in zip(pools["A"], pools["B"]))
        for k in libs:
            spent[k].append(total[k])
    return {"equal": equal, **{k: {"cpu_s_min": min(v), "cpu_s": v} for k, v in spent.items()}}


def decode_ab(libs: dict, shape: dict, rows: int, positions: int, calls_: int) -> dict:
    case = layer_case(shape, rows, positions, torch.Generator().manual_seed(rows))
    spent = {k: [] for k in libs}
    equal = True
    for i in range(calls_):
        outs = {}
        for k in (list(libs) if i % 2 == 0 else list(reversed(libs))):
            _, cpu, outs[k] = call(libs[k], case, shape)
            spent[k].append(cpu)
        equal = equal and torch.equal(outs["A"], outs["B"])
    return {"equal": equal, **{k: {"cpu_ms_min": 1e3 * min(v), "cpu_ms_median":
                                   1e3 * sorted(v)[len(v) // 2]} for k, v in spent.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=ck.SOURCE, help="the cpu_kernels.c to build")
    ap.add_argument("--positions", type=int, default=1696)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 16])
    ap.add_argument("--decode-calls", type=int, default=21)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="the model's phases (with --model)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    assert ck.available(), ck.status()
    shape = TINY if args.tiny else SMOLLM2
    report: dict = {"shape": shape, "positions": args.positions, "load": [os.getloadavg()],
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "threads": {}}
    text = wired(args.source.read_text())
    before = torch.get_num_threads()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"A": build(text, Path(tmp), "A", OFF), "B": build(text, Path(tmp), "B")}
        for threads in args.threads:
            torch.set_num_threads(threads)
            row = {"prompt": prompt_ab(libs, shape, args.positions, args.repeats)}
            p = row["prompt"]
            print(f"{threads} thread(s), one layer, {args.positions}-position prompt in {ck.MAX_TOKENS}-token calls: A "
                  f"{p['A']['cpu_s_min']:.3f} CPU-s, B {p['B']['cpu_s_min']:.3f} (B/A "
                  f"{p['B']['cpu_s_min'] / p['A']['cpu_s_min']:.2f}); bitwise {p['equal']}", flush=True)
            for rows in args.rows:
                d = row[f"decode {rows} rows"] = decode_ab(libs, shape, rows, args.positions, args.decode_calls)
                print(f"{threads} thread(s), one layer, {rows} rows sharing {args.positions} positions: A "
                      f"{d['A']['cpu_ms_min']:.2f} CPU-ms, B {d['B']['cpu_ms_min']:.2f} (medians "
                      f"{d['A']['cpu_ms_median']:.2f}, {d['B']['cpu_ms_median']:.2f}); bitwise {d['equal']}",
                      flush=True)
                ok = ok and d["equal"]
            ok = ok and p["equal"]
            report["threads"][threads] = row
        if args.model:
            report["model"] = model_prefill(libs, args.model.expanduser(), args.positions,
                                            args.threads, args.repeats)
            ok = ok and all(r["logits_equal"] and r["tokens_equal"]
                            for r in report["model"]["threads"].values())
            if args.profile:
                profiled = {"A": build(text, Path(tmp), "A_profile", OFF, "-DSPECPAIR_PROFILE"),
                            "B": build(text, Path(tmp), "B_profile", "-DSPECPAIR_PROFILE")}
                report["model"]["phases"] = model_phases(profiled, args.model.expanduser(),
                                                         args.positions, args.threads[0])
    torch.set_num_threads(before)
    report["load"].append(os.getloadavg())
    print("load", [round(x[0], 2) for x in report["load"]])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
