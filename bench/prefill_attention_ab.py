#!/usr/bin/env python
"""A cold prompt's prefill through one SmolLM2-shaped paged layer of cpu_kernels.c, a git
revision's kernel (A) against the working tree's (B): one row, P positions fed in calls of up to
MAX_TOKENS (128; 64 before ba8630a) tokens in position order, as the engine prefills a prompt, its keys and values
written into a pool of 16-position blocks through a shuffled block table. The two libraries are
alternated call by call in one process (the machine's noise falls on both), each on its own copy
of the pool. Per thread count: the whole prompt's CPU and wall seconds for one layer (SmolLM2 has
30), whether every call's output of B is bitwise A's, and the layer's phases (builds of A and B
with -DSPECPAIR_PROFILE: q/k/v, rotary and cache writes, attention and its scores / softmax /
values summed over threads, output projection, gate/up, SiLU, down). Figures:
docs/measurements/2026-12-07e-prefill-attention.md.

    OMP_WAIT_POLICY=passive python bench/prefill_attention_ab.py --base HEAD~1 --threads 1 2
    ... --model ~/.cache/specpair/smollm2-135m-instruct-f32   # and the whole model, greedy tokens
    python bench/prefill_attention_ab.py --tiny       # seconds: a small shape

Random weights and caches (the layer's speed is not its weights').
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO.parent / "engine"))

import torch  # noqa: E402

from layer_kernel_ab import PHASES, SMOLLM2, TINY, _typed, build_at  # noqa: E402
from specpair import cpu_kernels as ck  # noqa: E402

BLOCK = 16
LAYERS = 30          # SmolLM2-135M's decoder layers


def build_profiled_source(source: Path, out_dir: Path, name: str, *flags: str) -> ctypes.CDLL:
    import subprocess

    out = out_dir / f"{name}_profile.so"
    subprocess.run([os.environ.get("CC") or "cc", *ck.FLAGS, "-DSPECPAIR_PROFILE", *flags,
                    str(source), "-o", str(out)], check=True)
    lib = _typed(ctypes.CDLL(str(out)))
    lib.specpair_profile.argtypes = [ctypes.c_void_p]
    lib.specpair_profile.restype = ctypes.c_int
    return lib


def prompt_case(shape: dict, positions: int, gen: torch.Generator) -> dict:
    D, H, Hkv, hd, F_ = (shape[k] for k in ("D", "H", "Hkv", "hd", "F"))
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    weights = [r(H * hd, D) * 0.02, r(Hkv * hd, D) * 0.02, r(Hkv * hd, D) * 0.02,
               r(D, H * hd) * 0.02, r(F_, D) * 0.02, r(F_, D) * 0.02, r(D, F_) * 0.02,
               torch.ones(D), torch.ones(D)]
    blocks = -(-positions // BLOCK)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks].reshape(1, blocks).contiguous()
    return dict(weights=weights, table=table, pool=(blocks + 3, Hkv, BLOCK, hd),
                h=r(positions, D), cos=r(positions, hd), sin=r(positions, hd))


def calls(positions: int) -> list[tuple[int, int]]:
    step = ck.MAX_TOKENS
    return [(a, min(a + step, positions)) for a in range(0, positions, step)]


def run_call(lib, case: dict, shape: dict, pool: tuple, a: int, b: int):
    ck._LIB = lib
    h = case["h"][a:b].clone()
    cpu, wall = time.process_time(), time.perf_counter()
    ck.llama_layer(h, torch.zeros(b - a, dtype=torch.long), torch.arange(a, b), case["cos"][a:b],
                   case["sin"][a:b], pool[0], pool[1], case["weights"], 1e-5, shape["H"],
                   shape["Hkv"], shape["hd"], table=case["table"])
    return time.process_time() - cpu, time.perf_counter() - wall, h


def model_prefill(libs: dict, model_dir: Path, positions: int, threads_list: list[int],
                  repeats: int, new_tokens: int = 16) -> dict:
    """The whole model (SmolLM2's real weights) on the paged cache: a prompt of `positions`
    tokens (the HTTP bench's system prompt) prefilled with each library, alternated, the
    process's CPU seconds of each prefill; then `new_tokens` greedy tokens from each cache, and
    whether the last prompt position's logits and those tokens are the same under A and B."""
    from http_load_bench import system_prompt
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specpair.paged_cache import PagedKVModel

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = tokenizer(system_prompt(positions * 2))["input_ids"][:positions]
    out: dict = {"model": str(model_dir), "positions": len(prompt), "threads": {}}
    for threads in threads_list:
        torch.set_num_threads(threads)
        spent = {k: [] for k in libs}
        logits, tokens = {}, {}
        for rep in range(repeats):
            for k in (list(libs) if rep % 2 == 0 else list(reversed(libs))):
                ck.use_library(libs[k])
                kv = PagedKVModel(model, blocks=-(-positions // BLOCK) + new_tokens // BLOCK + 2)
                kv.add_rows(1)
                with torch.inference_mode():
                    cpu, wall = time.process_time(), time.perf_counter()
                    last = kv.extend([prompt])[0][-1]
                    spent[k].append((time.process_time() - cpu, time.perf_counter() - wall))
                    seq = [int(last.argmax())]
                    for _ in range(new_tokens - 1):
                        seq.append(int(kv.extend([[seq[-1]]])[0][-1].argmax()))
                logits[k], tokens[k] = last, seq
        row = {k: {"cpu_s_min": min(c for c, _ in v), "wall_s_min": min(w for _, w in v),
                   "runs": v} for k, v in spent.items()}
        row["logits_equal"] = torch.equal(logits["A"], logits["B"])
        row["tokens_equal"] = tokens["A"] == tokens["B"]
        row["tokens"] = tokens["B"]
        out["threads"][threads] = row
        print(f"model prefill, {len(prompt)} tokens, {threads} thread(s): A {row['A']['cpu_s_min']:.2f} "
              f"CPU-s ({row['A']['wall_s_min']:.2f} s wall), B {row['B']['cpu_s_min']:.2f} CPU-s "
              f"({row['B']['wall_s_min']:.2f} s wall); last logits bitwise {row['logits_equal']}, "
              f"{new_tokens} greedy tokens equal {row['tokens_equal']}", flush=True)
    return out


def model_phases(profiled: dict, model_dir: Path, positions: int, threads: int) -> dict:
    """The whole model's prefill (as model_prefill) once with each profiled build: the process's
    CPU seconds and the layers' phases summed over the 30 layers."""
    from http_load_bench import system_prompt
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specpair.paged_cache import PagedKVModel

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = tokenizer(system_prompt(positions * 2))["input_ids"][:positions]
    torch.set_num_threads(threads)
    out = {}
    for name, lib in profiled.items():
        phases = (ctypes.c_double * len(PHASES))()
        lib.specpair_profile(phases)
        ck.use_library(lib)
        kv = PagedKVModel(model, blocks=-(-positions // BLOCK) + 2)
        kv.add_rows(1)
        with torch.inference_mode():
            cpu = time.process_time()
            kv.extend([prompt])
            spent = time.process_time() - cpu
        lib.specpair_profile(phases)
        out[name] = {"prefill_cpu_s": spent, "phases_s": {p: phases[i] for i, p in enumerate(PHASES)}}
        print(f"model prefill phases, {threads} thread(s), {name}: {spent:.2f} CPU-s; "
              + ", ".join(f"{p} {phases[i]:.2f}" for i, p in enumerate(PHASES)), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the A kernel")
    ap.add_argument("--positions", type=int, default=1696)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3, help="prefills per library (least is said)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--model", type=Path, default=None,
                    help="also the whole model from this directory (e.g. ~/.cache/specpair/"
                         "smollm2-135m-instruct-f32), its real weights")
    ap.add_argument("--only-model", action="store_true", help="skip the one-layer figures")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    assert ck.available(), ck.status()
    shape = TINY if args.tiny else SMOLLM2
    gen = torch.Generator().manual_seed(0)
    case = prompt_case(shape, args.positions, gen)
    report: dict = {"shape": shape, "positions": args.positions, "base": args.base,
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "load": [os.getloadavg()],
                    "threads": {}}
    before = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"A": build_at(args.base, Path(tmp)), "B": _typed(ck.library())}
        profiled = {}
        if not args.no_profile:
            # The phases of B, and of B's source with every run through the one-row path
            # (PROMPT_RUN past any call: the attention as before the prompt's chunks were
            # grouped), both with B's clocks (CPU time; A's revision may time by wall clock).
            profiled["one-row path"] = build_profiled_source(ck.SOURCE, Path(tmp), "rows",
                                                             "-DPROMPT_RUN=1000000")
            profiled["B"] = build_profiled_source(ck.SOURCE, Path(tmp), "B")
        if args.model:
            report["model"] = model_prefill(libs, args.model.expanduser(), args.positions,
                                            args.threads, args.repeats)
            if profiled:
                report["model"]["phases"] = model_phases(profiled, args.model.expanduser(),
                                                         args.positions, args.threads[0])
        for threads in ([] if args.only_model else args.threads):
            torch.set_num_threads(threads)
            totals = {k: {"cpu": [], "wall": []} for k in libs}
            equal = True
            for rep in range(args.repeats):
                pools = {k: (torch.zeros(case["pool"]), torch.zeros(case["pool"])) for k in libs}
                spent = {k: [0.0, 0.0] for k in libs}
                for i, (a, b) in enumerate(calls(args.positions)):
                    outs = {}
                    for k in (list(libs) if (i + rep) % 2 == 0 else list(reversed(libs))):
                        cpu, wall, outs[k] = run_call(libs[k], case, shape, pools[k], a, b)
                        spent[k][0] += cpu
                        spent[k][1] += wall
                    equal = equal and torch.equal(outs["A"], outs["B"])
                equal = equal and all(torch.equal(x, y) for x, y in zip(pools["A"], pools["B"]))
                for k in libs:
                    totals[k]["cpu"].append(spent[k][0])
                    totals[k]["wall"].append(spent[k][1])
            row: dict = {"equal": equal}
            for k in libs:
                row[k] = {"cpu_s_min": min(totals[k]["cpu"]), "wall_s_min": min(totals[k]["wall"]),
                          "cpu_s": totals[k]["cpu"], "wall_s": totals[k]["wall"]}
            for k, lib in profiled.items():
                phases = (ctypes.c_double * len(PHASES))()
                lib.specpair_profile(phases)
                seen = {p: [] for p in PHASES}
                for _ in range(args.repeats):
                    pool = (torch.zeros(case["pool"]), torch.zeros(case["pool"]))
                    for a, b in calls(args.positions):
                        run_call(lib, case, shape, pool, a, b)
                    lib.specpair_profile(phases)
                    for j, p in enumerate(PHASES):
                        seen[p].append(phases[j])
                row.setdefault(k, {})["phases_s"] = {p: round(min(v), 4) for p, v in seen.items()}
            report["threads"][threads] = row
            print(f"{threads} thread(s), {args.positions} positions, one layer: A {row['A']['cpu_s_min']:.3f}"
                  f" CPU-s ({row['A']['wall_s_min']:.3f} s wall), B {row['B']['cpu_s_min']:.3f} CPU-s "
                  f"({row['B']['wall_s_min']:.3f} s wall), B/A CPU {row['B']['cpu_s_min'] / row['A']['cpu_s_min']:.2f}"
                  f"; x{LAYERS} layers: A {LAYERS * row['A']['cpu_s_min']:.2f}, B "
                  f"{LAYERS * row['B']['cpu_s_min']:.2f} CPU-s; bitwise equal: {equal}", flush=True)
            for k in profiled:
                ph = row[k]["phases_s"]
                print(f"  {k} phases (s, one layer): " + ", ".join(f"{p} {v:.3f}" for p, v in ph.items()),
                      flush=True)
    torch.set_num_threads(before)
    report["load"].append(os.getloadavg())
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    model_ok = all(r["logits_equal"] and r["tokens_equal"]
                   for r in report.get("model", {}).get("threads", {}).values())
    return 0 if model_ok and all(r["equal"] for r in report["threads"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
