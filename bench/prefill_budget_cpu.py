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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_load_bench import WORDS, system_prompt  # noqa: E402
from worker_timeline import forget_prefixes, load_engine  # noqa: E402


@dataclass
class BudgetRun:
    """One run under a budget: the batch (released by the caller), its decoding rows and the
    cold prompt's row, the largest step (wall, CPU seconds) the rows waited through while the
    prompt was fed (its first token's step included), the steps until that first token, and the
    CPU seconds of the whole run."""
    batch: object
    rows: list
    late: object
    worst_wall: float
    worst_cpu: float
    steps_to_first: int
    run_cpu: float

    def tokens(self) -> list[list[int]]:
        return [self.batch.result(s).token_ids for s in self.rows + [self.late]]


def chat_prompts(engine, rows: int, shared_prefix: int) -> tuple[list[list[int]], list[int]]:
    """The shared-prefix chat load's short requests (one a decoding row) and a cold prompt of
    a `shared_prefix`-token system prompt."""
    short = [engine.encode([{"role": "user", "content": f"Request {i}: which {WORDS[i % len(WORDS)]} "
                                                         f"setting matters most, and why?"}], chat=True)
             for i in range(rows)]
    cold = engine.encode([{"role": "system", "content": system_prompt(shared_prefix)},
                          {"role": "user", "content": "Which setting matters most?"}], chat=True)
    return short, cold


def run_budget(engine, budget: int, short: list[list[int]], cold: list[int], params, *,
               warm_steps: int = 1, prepare=None) -> BudgetRun:
    """The short rows decode `warm_steps` steps on a new batch (`prepare(batch)` first, cold
    prefix cache), then the cold prompt joins and every row steps to its end under `budget`
    (0: whole prompts)."""
    engine.prefill_budget = budget or None
    forget_prefixes(engine)
    batch = engine.new_batch()
    if prepare is not None:
        prepare(batch)
    rows = [batch.add(ids, params, request_id=f"s{i}") for i, ids in enumerate(short)]
    for _ in range(warm_steps):
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
    return BudgetRun(batch, rows, late, worst_wall, worst_cpu, steps_to_first,
                     time.process_time() - run_cpu)


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
    short, cold = chat_prompts(engine, args.rows, args.shared_prefix)
    params = GenerationParams(max_new_tokens=args.max_new_tokens, speculation_k=0)
    print(f"{args.rows} rows decoding, a cold {len(cold)}-token prompt joins; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    replies = {}
    for turn in range(args.repeat):
        for budget in args.budgets:
            run = run_budget(engine, budget, short, cold, params,
                             prepare=lambda batch: setattr(batch, "speculate", False))
            tokens = run.tokens()
            same = replies.setdefault("tokens", tokens) == tokens
            print(f"budget {budget or 'none'}: largest step while the prompt was fed {run.worst_wall:.2f} s "
                  f"wall / {run.worst_cpu:.2f} CPU-s, its first token after {run.steps_to_first} steps, the "
                  f"whole run {run.run_cpu:.2f} CPU-s, tokens equal to the first run's: {same}; load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            run.batch.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
