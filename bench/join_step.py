#!/usr/bin/env python
"""What one step costs when a request joins running rows: padded into one forward vs run apart.

    python bench/join_step.py --target TARGET_DIR [--rows 15] [--context 80]
        [--prompt-tokens 60 300] [--repeats 3]

`--rows` rows hold `--context` tokens each and decode one token a step; then a request joins
with its whole prompt. Padded into one forward, every running row is computed at the prompt's
width; run apart (buckets.width_groups), the prompt runs alone and the running rows take
their usual one-token step. Prints one JSON object: per prompt length, the fastest of
`--repeats` join steps each way (ms), and the prompt's prefill alone for scale.

Figures: docs/measurements/cpu_join_step.json; read in docs/server.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))


def tokens(model, start: int, count: int) -> list[int]:
    """Some real token ids of this model's vocabulary (the cost does not depend on which)."""
    vocab = model.config.vocab_size
    return [(start + j) % vocab for j in range(count)]


def join_step_ms(model, rows: int, context: int, prompt_tokens: int, apart: bool,
                 repeats: int) -> float:
    from specpair.kv import buckets, static

    saved = buckets.GROUP_CALL_TOKENS
    buckets.GROUP_CALL_TOKENS = saved if apart else 10**9   # never worth a cut: one forward
    try:
        best = float("inf")
        for _ in range(repeats):
            kv = static.StaticKVModel(model)
            kv.add_rows(rows)
            kv.extend([tokens(model, 100 + i, context) for i in range(rows)])
            kv.extend([tokens(model, 5, 1)] * rows)
            kv.add_rows(1)
            started = time.perf_counter()
            kv.extend([tokens(model, 7, 1)] * rows + [tokens(model, 1000, prompt_tokens)])
            best = min(best, time.perf_counter() - started)
        return round(best * 1000, 1)
    finally:
        buckets.GROUP_CALL_TOKENS = saved


def main(argv=None) -> int:
    from specpair.models import load_model
    from specpair.kv.static import StaticKVModel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--context", type=int, default=80)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[60, 300])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rows < 1 or args.context < 1 or args.repeats < 1 or min(args.prompt_tokens) < 1:
        ap.error("rows, context, repeats and prompt tokens must be >= 1")
    model = load_model(args.target, dtype="float32").model
    out = {"rows": args.rows, "context": args.context, "prompts": {}}
    for n in args.prompt_tokens:
        kv = StaticKVModel(model)
        kv.add_rows(1)
        started = time.perf_counter()
        kv.extend([tokens(model, 1000, n)])
        alone = round((time.perf_counter() - started) * 1000, 1)
        out["prompts"][str(n)] = {
            "padded_ms": join_step_ms(model, args.rows, args.context, n, False, args.repeats),
            "apart_ms": join_step_ms(model, args.rows, args.context, n, True, args.repeats),
            "prefill_alone_ms": alone}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
