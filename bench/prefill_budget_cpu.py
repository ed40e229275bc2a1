#!/usr/bin/env python
"""What a cold long prompt costs the rows already decoding, by the prefill token budget
(decoding.Batch._prefill_caps, the server's --prefill-budget), in-process on a real Batch (no
server): --rows rows decode the shared-prefix chat load's short tails; a cold prompt of
--shared-prefix tokens then joins; per budget the largest step (wall and CPU seconds) the
decoding rows waited through while it was fed, the steps until its first token, and the CPU
seconds of the whole run (chunking must not cost more in all). Every row's tokens are compared
across budgets (they must be equal). Budgets alternate, --repeat times each.

    python bench/prefill_budget_cpu.py --rows 8 --budgets 0 256 --repeat 2
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
    parser.add_argument("--rows", type=int, default=8, help="rows decoding when the prompt joins")
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 256], help="0: whole prompts")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--shared-prefix", type=int, default=1500, metavar="TOKENS")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    from specpair.config import GenerationParams

    engine = load_engine(args.target, ["--no-spec", "--max-batch-size", "64"])
    engine.eos_ids = frozenset()      # every row steps to its budget
    short = [engine.encode([{"role": "user", "content": f"Request {i}: which {WORDS[i % len(WORDS)]} "
                                                         f"setting matters most, and why?"}], chat=True)
             for i in range(args.rows)]
    cold = engine.encode([{"role": "system", "content": system_prompt(args.shared_prefix)},
                          {"role": "user", "content": "Which setting matters most?"}], chat=True)
    params = GenerationParams(max_new_tokens=args.max_new_tokens, speculation_k=0)
    print(f"{args.rows} rows decoding, a cold {len(cold)}-token prompt joins; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    replies = {}
    for turn in range(args.repeat):
        for budget in args.budgets:
            engine.prefill_budget = budget or None
            forget_prefixes(engine)
            batch = engine.new_batch()
            batch.speculate = False
            rows = [batch.add(ids, params, request_id=f"s{i}") for i, ids in enumerate(short)]
            batch.step()
            late = batch.add(cold, params, request_id="cold")
            worst_wall = worst_cpu = 0.0
            steps_to_first = 0
            run_cpu = time.process_time()
            while batch.active:
                waiting = late.num_generated == 0
                wall, cpu = time.perf_counter(), time.process_time()
                batch.step()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                if waiting:      # a step the cold prompt was fed in (its first token's included)
                    steps_to_first += 1
                    worst_wall, worst_cpu = max(worst_wall, wall), max(worst_cpu, cpu)
            run_cpu = time.process_time() - run_cpu
            tokens = [batch.result(s).token_ids for s in rows + [late]]
            same = replies.setdefault("tokens", tokens) == tokens
            print(f"budget {budget or 'none'}: largest step while the prompt was fed {worst_wall:.2f} s "
                  f"wall / {worst_cpu:.2f} CPU-s, its first token after {steps_to_first} steps, the "
                  f"whole run {run_cpu:.2f} CPU-s, tokens equal to the first run's: {same}; load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            batch.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
