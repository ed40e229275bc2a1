#!/usr/bin/env python
"""The pause a draft swap costs on the paged pool (issue 58), in process, by CPU time: SmolLM2
(the embedded default target, paged cache) drafted by a draft model of its first 2 layers (A);
rows of `--context` prompt tokens run to mid-reply, then A is replaced by B (A's weights plus
noise: the same shape, as a retrained draft is; `--b-layers 1`: a plane of another shape) as
SwapDraft does it (server/draft_swap.py: load_release_drafter off the step loop, install between
two steps). Printed per (rows, context): a normal step's CPU and wall time (median of the steps
before), the load (B's plane and warm-up; B is built in memory, so no read from disk), the install
between steps, and the first step after it, in which every row's new draft rows catch up on the
row's whole sequence: that step's time beyond a normal one is the swap's pause. Also the tokens
each step emitted and whether the replies equal target-only's (they must).

    python bench/draft_swap_paged.py [--rows 1,8] [--context 512,1500] [--threads 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import torch  # noqa: E402

from specpair.config import GenerationParams  # noqa: E402
from specpair.decoding import SpeculativeEngine  # noqa: E402
from specpair.models import load_model, wrap_model  # noqa: E402
from specpair.server.draft_swap import (CATCH_UP_POSITIONS, install, load_release_drafter,  # noqa: E402
                                        read_release)

NEW_TOKENS = 48
STEPS_BEFORE = 6
TEXT = ("The committee met on Tuesday to review the quarterly figures, the hiring plan and the schedule "
        "for the new warehouse. Each department presented its numbers and the open questions. ")


def first_layers(target, layers: int, noise: float = 0.0, seed: int = 0, name: str = "draft"):
    model = copy.deepcopy(target.model)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    if noise:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    return wrap_model(model, target.tokenizer, source=name)


def prompts(engine, rows: int, context: int) -> list[list[int]]:
    """Distinct prompts of `context` tokens (no shared prefix block: each row's catch-up is its own)."""
    out = []
    for i in range(rows):
        ids = engine.encode(f"Report {i} of {rows}. " + TEXT * (context // 20 + 2))
        out.append(ids[:context])
    return out


def target_only(target, ids, params) -> list[list[int]]:
    """The rows' greedy replies without speculation (the paged C layer: bitwise each row's solo)."""
    batch = SpeculativeEngine(target).new_batch()
    batch.speculate = False
    seqs = [batch.add(p, params) for p in ids]
    while batch.active:
        batch.step()
    return [batch.result(s).token_ids for s in seqs]


def timed(fn):
    c, w = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.process_time() - c, time.perf_counter() - w


def run(target, draft_a, draft_b, rows: int, context: int, catch_up: int) -> dict:
    engine = SpeculativeEngine(target, draft=draft_a)
    assert engine.paged_space is not None and engine.paged_space.draft is not None, engine.paged_unused
    ids = prompts(engine, rows, context)
    # k fixed at 3 a row: every row drafts every round whatever the (untrained) drafts' acceptance,
    # so each row in flight has draft rows to catch up (a row backed off to k 0 would not).
    params = GenerationParams(max_new_tokens=NEW_TOKENS, speculation_k=3)
    batch = engine.new_batch()
    seqs = [batch.add(p, params) for p in ids]
    while min(s.num_generated for s in seqs) < 4:          # every prompt prefilled, drafting
        batch.step()

    def step():
        before = sum(s.num_generated for s in seqs)
        batch.step()
        return sum(s.num_generated for s in seqs) - before
    normal = [timed(step) for _ in range(STEPS_BEFORE)]
    release = read_release(json.dumps({"target": {"source": target.source}, "draft": {"source": "b"},
                                       "speculation": {"k": 3}, "mlflow": {"version": "2"}}))
    loaded, load_cpu, load_wall = timed(lambda: load_release_drafter(engine, release,
                                                                     load_model=lambda *_a, **_k: draft_b))
    sum_positions = sum(len(s.tokens) for s in seqs)
    _, install_cpu, install_wall = timed(lambda: install(engine, batch, loaded, catch_up_positions=catch_up))
    caught_up = sum(not s.drafts_ended for s in seqs)
    after = [timed(step) for _ in range(3)]
    while batch.active:
        batch.step()
    replies = [batch.result(s).token_ids for s in seqs]
    solo = target_only(target, ids, params)
    median_cpu = statistics.median(c for _, c, _ in normal)
    median_wall = statistics.median(w for _, _, w in normal)
    first_tokens, first_cpu, first_wall = after[0]
    return {
        "rows": rows, "context": context, "catch_up_budget": catch_up, "rows_catching_up": caught_up,
        "positions_to_catch_up": sum_positions,
        "normal_step": {"cpu_s": round(median_cpu, 4), "wall_s": round(median_wall, 4),
                        "tokens": [t for t, _, _ in normal]},
        "load": {"cpu_s": round(load_cpu, 4), "wall_s": round(load_wall, 4)},
        "install": {"cpu_s": round(install_cpu, 5), "wall_s": round(install_wall, 5)},
        "first_step_after": {"cpu_s": round(first_cpu, 4), "wall_s": round(first_wall, 4), "tokens": first_tokens},
        "pause": {"cpu_s": round(first_cpu - median_cpu, 4), "wall_s": round(first_wall - median_wall, 4)},
        "steps_after": [{"cpu_s": round(c, 4), "wall_s": round(w, 4), "tokens": t} for t, c, w in after[1:]],
        "plane_layers": engine.paged_space.draft.runner.layer_count,
        "replies_equal_target_only": replies == solo,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--context", default="512,1500")
    parser.add_argument("--b-layers", type=int, default=2)
    parser.add_argument("--catch-up", default=f"{CATCH_UP_POSITIONS},1000000",
                        help="catch-up budgets in positions (draft_swap.CATCH_UP_POSITIONS; 1000000: every row)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model("default")
    draft_a = first_layers(target, 2, name="first-2-layers")
    draft_b = first_layers(target, args.b_layers, noise=0.02, seed=1, name=f"first-{args.b_layers}-layers-noised")
    results = []
    ints = [[int(v) for v in text.split(",")] for text in (args.rows, args.context, args.catch_up)]
    for rows, context, catch_up in itertools.product(*ints):
        load = os.getloadavg()[0]
        r = run(target, draft_a, draft_b, rows, context, catch_up)
        r["load_avg_1m"] = [round(load, 1), round(os.getloadavg()[0], 1)]
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "threads": args.threads,
                                               "b_layers": args.b_layers}, indent=1) + "\n")


if __name__ == "__main__":
    main()
