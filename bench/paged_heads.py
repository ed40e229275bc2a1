#!/usr/bin/env python
"""A head engine on the paged cache against the contiguous one, in process (issue 51, A2):
SmolLM2 with an EAGLE-3 head (untrained, built from the target: `eagle3.build_eagle3_head`,
aux layers vLLM's default), greedy, k 3. One request first names the shared system prompt's
blocks (an earlier conversation); then 16 rows sharing that ~1,500-token system prompt, each
with its own question, join one batch and run to the end. Paged (SPECPAIR_PAGED=on: the prompt's
blocks and their features served from the pool) and contiguous (off: a head engine recomputes
every prompt), alternated, each in an engine of its own; tokens/s over the 16 rows' wall time,
the process's CPU seconds (steadier than wall time on a shared machine), mean time to first
token, target steps and drafting rounds per request, acceptance, and the load average around
each run. The replies of the two are compared (they must be equal).

`--head-prefix off,on` runs the paged cache only, alternating the head's own keys and values over
the shared prefix recomputed by every row (off: as before the sixth session) against served from
the pool beside the target's blocks (on: `Drafter.prefix_identity`,
decoding.Batch._load_head_prefix).

    python bench/paged_heads.py [--rows 16] [--rounds 2] [--new 32] [--threads 2]
    python bench/paged_heads.py --head-prefix off,on [--rows 8] [--new 16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import torch  # noqa: E402

from specpair.config import GenerationParams, SpeculationConfig  # noqa: E402
from specpair.decoding import SpeculativeEngine  # noqa: E402
from specpair.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from specpair.eagle3 import build_eagle3_head  # noqa: E402
from specpair.models import load_model, wrap_model  # noqa: E402
from specpair.paged_cache import PAGED_ENV  # noqa: E402

SYSTEM_SENTENCE = ("You are a helpful assistant for a platform team. Answer briefly, cite the "
                   "configuration key you rely on, and never invent a value you were not given. ")
QUESTIONS = [f"Question {i}: how do I set the replica count of service number {i}?"
             for i in range(64)]


def run(mode: str, target, head, rows: int, new: int, head_prefix: str = "on") -> dict:
    os.environ[PAGED_ENV] = mode
    Eagle3Drafter.shares_prefix = head_prefix == "on"
    engine = SpeculativeEngine(target, draft=head, speculation=SpeculationConfig(
        k=3, k_max=3, dynamic_k=False, fallback_threshold=0, batch_size_threshold=64))
    assert (engine.paged_space is not None) == (mode == "on"), engine.paged_unused
    system = engine.encode(SYSTEM_SENTENCE * 50)[:1500]
    params = GenerationParams(max_new_tokens=new)
    engine.generate([engine.target.tokenizer.decode(system + engine.encode(QUESTIONS[-1])[1:])],
                    params)
    load_before = os.getloadavg()[0]
    batch = engine.new_batch()
    started, cpu_started = time.perf_counter(), time.process_time()
    seqs = [batch.add(system + engine.encode(q)[1:], params) for q in QUESTIONS[:rows]]
    while batch.active:
        batch.step()
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    results = [batch.result(s) for s in seqs]
    generated = sum(len(r.token_ids) for r in results)
    head_cached = sum(s.head_cached for s in seqs) / rows
    return {"mode": "paged" if mode == "on" else "contiguous", "head_prefix": head_prefix,
            "head_cached_mean": head_cached, "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu_seconds, 2),
            "target_steps_mean": sum(r.stats.num_target_steps for r in results) / rows,
            "drafting_rounds_mean": sum(r.stats.num_drafts for r in results) / rows,
            "tokens_per_s": round(generated / seconds, 2),
            "ttft_mean_s": round(sum(r.time_to_first_token for r in results) / rows, 3),
            "cached_tokens_mean": sum(r.cached_tokens for r in results) / rows,
            "drafted": sum(r.stats.num_draft_tokens for r in results),
            "accepted": sum(r.stats.num_accepted_tokens for r in results),
            "load_before": round(load_before, 1), "load_after": round(os.getloadavg()[0], 1),
            "replies": [r.token_ids for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head-prefix", default=None,
                    help="paged only, alternating these settings of the head's own prefix "
                         "blocks (off,on); default: paged (on) against contiguous")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model("default")
    head = wrap_model(build_eagle3_head(target.model, torch.arange(target.embedding_rows),
                                        seed=5), None, "head")
    if args.head_prefix:
        head_prefix(args, target, head)
        return
    runs = []
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            runs.append(run(mode, target, head, args.rows, args.new))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "replies"}), flush=True)
    paged = [r for r in runs if r["mode"] == "paged"]
    contiguous = [r for r in runs if r["mode"] == "contiguous"]
    same = all(p["replies"] == c["replies"] for p, c in zip(paged, contiguous))
    print(json.dumps({
        "rows": args.rows, "new_tokens": args.new, "threads": args.threads,
        "tokens_per_s_ratio": [round(p["tokens_per_s"] / c["tokens_per_s"], 2)
                               for p, c in zip(paged, contiguous)],
        "ttft_ratio": [round(p["ttft_mean_s"] / c["ttft_mean_s"], 3)
                       for p, c in zip(paged, contiguous)],
        "replies_equal": same}))


def head_prefix(args, target, head) -> None:
    """Paged runs alternating the head's prefix blocks off and on; their ratios (on / off)."""
    settings = args.head_prefix.split(",")
    runs = []
    for _ in range(args.rounds):
        for setting in settings:
            runs.append(run("on", target, head, args.rows, args.new, setting))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "replies"}), flush=True)
    by = {s: [r for r in runs if r["head_prefix"] == s] for s in settings}
    if len(settings) == 2:
        a, b = (by[s] for s in settings)
        print(json.dumps({
            "rows": args.rows, "new_tokens": args.new, "threads": args.threads,
            f"ttft_ratio_{settings[1]}_over_{settings[0]}": [
                round(y["ttft_mean_s"] / x["ttft_mean_s"], 3) for x, y in zip(a, b)],
            f"tokens_per_s_ratio_{settings[1]}_over_{settings[0]}": [
                round(y["tokens_per_s"] / x["tokens_per_s"], 2) for x, y in zip(a, b)],
            "replies_equal": all(x["replies"] == y["replies"] for x, y in zip(a, b)),
            "drafts_equal": all((x["drafted"], x["accepted"]) == (y["drafted"], y["accepted"])
                                for x, y in zip(a, b))}))


if __name__ == "__main__":
    main()
