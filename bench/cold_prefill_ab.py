#!/usr/bin/env python
"""A cold chat prompt alone, to its first token, at several prefill budgets alternated in one
process (issue 51's cold TTFT): the engine as `specpair engine serve` loads it, the prefix cache
emptied before each run, wall and process CPU time to the first token, the steps it took, the
load; every run's tokens must equal the first's.

    python bench/cold_prefill_ab.py --rounds 3 --budgets 256 0
    python bench/cold_prefill_ab.py --idle-budgets 0 2048   # with nothing decoding: the old 256 a step vs now
    python bench/cold_prefill_ab.py --prompt-scores off on   # the kernel without / with prompt_scores.h
    python bench/cold_prefill_ab.py --call-tokens 64 128     # the C layer's tokens a call (MAX_TOKENS)

--budgets sets Batch.prefill_budget (0: whole prompts); --idle-budgets sets
decoding.PREFILL_IDLE_TOKEN_BUDGET (what a step feeds with no row decoding; 0: the budget, as
before 78ddb20); --prompt-scores builds the served kernel source twice (bench/prompt_scores_ab.py:
off, attend_group's own score loop; on, the keys transposed once for the group) and alternates
the two builds under the same engine. --call-tokens builds the served source once for each N with
-DMAX_TOKENS=N (the tokens of a prompt one C call takes; cpu_kernels.MAX_TOKENS follows the build
in use) and alternates them likewise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_load_bench import system_prompt  # noqa: E402
from worker_timeline import forget_prefixes, load_engine  # noqa: E402  (sets the serving OpenMP wait)


def first_token(engine, ids: list[int], max_new_tokens: int) -> tuple[dict, list[int]]:
    from specpair.config import GenerationParams

    batch = engine.new_batch()
    batch.add(ids, GenerationParams(max_new_tokens=max_new_tokens))
    load = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    steps, first, tokens = 0, None, []
    while batch.active:
        for out in batch.step():
            tokens += out.token_ids
        steps += 1
        if tokens and first is None:
            first = {"wall_s": round(time.perf_counter() - wall, 3), "cpu_s": round(time.process_time() - cpu, 3),
                     "steps": steps, "load": round(load, 2)}
    return first, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--shared-prefix", type=int, default=1500, metavar="TOKENS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budgets", type=int, nargs="+", help="prefill budgets (0: whole prompts)")
    parser.add_argument("--idle-budgets", type=int, nargs="+",
                        help="PREFILL_IDLE_TOKEN_BUDGET values (0: the prefill budget, as before)")
    parser.add_argument("--prompt-scores", nargs="+", choices=["off", "on"],
                        help="kernel builds to alternate (bench/prompt_scores_ab.py)")
    parser.add_argument("--call-tokens", type=int, nargs="+", metavar="N",
                        help="MAX_TOKENS of the kernel builds to alternate (a prompt's tokens a C call)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--warm-up", type=int, default=1, metavar="ROUNDS",
                        help="rounds run first and not counted (the process's first prefill paid "
                             "~2x: 5.9 s against 2.9 s, its pages and code cold)")
    args = parser.parse_args()
    from specpair import cpu_kernels, decoding

    engine = load_engine(args.target, [])
    libs = {}
    if args.prompt_scores or args.call_tokens:
        import tempfile

        from prompt_scores_ab import OFF, build, wired
        text = wired(cpu_kernels.SOURCE.read_text())
        holder = tempfile.TemporaryDirectory(prefix="cold_prefill_ab")    # removed at exit
        if args.prompt_scores:
            libs = {k: build(text, Path(holder.name), k, *([OFF] if k == "off" else []))
                    for k in args.prompt_scores}
        else:
            libs = {n: build(text, Path(holder.name), f"calls{n}", f"-DMAX_TOKENS={n}")
                    for n in args.call_tokens}
    ids = engine.encode([{"role": "system", "content": system_prompt(args.shared_prefix)},
                         {"role": "user", "content": "Request 0: which setting matters most, and why?"}], chat=True)
    if args.prompt_scores:
        settings = [("scores", b) for b in args.prompt_scores]
    elif args.call_tokens:
        settings = [("calls", n) for n in args.call_tokens]
    elif args.idle_budgets:
        settings = [("idle", b) for b in args.idle_budgets]
    else:
        settings = [("budget", b) for b in (args.budgets or [256, 0])]
    print(f"prompt: {len(ids)} tokens; settings {settings}", flush=True)
    runs: dict[str, list] = {f"{kind} {b}": [] for kind, b in settings}
    replies = []
    for n in range(args.warm_up + args.rounds):
        for kind, b in (settings if n % 2 == 0 else list(reversed(settings))):
            forget_prefixes(engine)
            saved = engine.prefill_budget
            if kind in ("scores", "calls"):
                cpu_kernels.use_library(libs[b])
            elif kind == "idle":
                decoding.PREFILL_IDLE_TOKEN_BUDGET = b
            else:
                engine.prefill_budget = b or None
            try:
                first, tokens = first_token(engine, ids, args.max_new_tokens)
            finally:
                engine.prefill_budget = saved
            if n >= args.warm_up:
                runs[f"{kind} {b}"].append(first)
            replies.append(tokens)
            print(f"{kind} {b}{' (warm-up)' if n < args.warm_up else ''}: {json.dumps(first)}", flush=True)
    for name, rs in runs.items():
        print(f"{name}: mean wall {sum(r['wall_s'] for r in rs) / len(rs):.3f} s, mean CPU "
              f"{sum(r['cpu_s'] for r in rs) / len(rs):.3f} s, {rs[0]['steps']} steps, loads "
              f"{[r['load'] for r in rs]}", flush=True)
    print("tokens equal across runs:", all(r == replies[0] for r in replies))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
