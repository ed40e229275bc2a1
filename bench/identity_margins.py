#!/usr/bin/env python
"""Where batched speculative greedy output departs from single-request target-only output, and why.

    python bench/identity_margins.py --device cuda --dtype bfloat16 --batch 4

For each prompt of bench/load_bench.py's set it decodes single-request target-only (the
reference) and as part of a speculating batch. At the first token where they differ it reports the
reference's logit margin there (top-1 minus top-2 logit of the single-request target pass): a
margin within the dtype's rounding noise means the batch changed only floating-point rounding
(different kernels / shapes for a k+1-token verification of a batch), not the decoding rule.

Figures: docs/server.md, "Greedy identity" (bf16, CPU, 32 new tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engine"))
sys.path.insert(0, str(ROOT / "bench"))     # load_bench, beside this script

import torch  # noqa: E402

from load_bench import PROMPTS  # noqa: E402
from specpair.config import GenerationParams, SpeculationConfig  # noqa: E402
from specpair.decoding import SpeculativeEngine  # noqa: E402
from specpair.drafters import NgramDrafter  # noqa: E402
from specpair.models import load_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()

    target = load_model(args.target, device=args.device, dtype=args.dtype, progress=lambda _m: None)
    engine = SpeculativeEngine(target, drafter=NgramDrafter(device=target.device),
                               speculation=SpeculationConfig(k=args.k, batch_size_threshold=1000))
    params = GenerationParams(max_new_tokens=args.max_new_tokens)
    prompts = [[{"role": "user", "content": p}] for _, p in PROMPTS]
    reference = [engine.generate([p], params, chat=True, speculate=False)[0] for p in prompts]
    batched = []
    for i in range(0, len(prompts), args.batch):
        batched += engine.generate(prompts[i:i + args.batch], params, chat=True, speculate=True)
    report = []
    for prompt, ref, got in zip(prompts, reference, batched):
        row = {"prompt": prompt[0]["content"][:40], "identical": ref.token_ids == got.token_ids}
        if not row["identical"]:
            at = next(j for j, (a, b) in enumerate(zip(ref.token_ids + [-1], got.token_ids + [-2])) if a != b)
            ids = engine.encode(prompt, chat=True) + ref.token_ids[:at]
            with torch.no_grad():
                logits = target.model(torch.tensor([ids], device=target.device)).logits[0, -1].float()
            top = logits.topk(2)
            row.update(first_difference=at, reference_token=ref.token_ids[at], batched_token=got.token_ids[at],
                       margin=round(float(top.values[0] - top.values[1]), 4),
                       batched_token_gap=round(float(top.values[0] - logits[got.token_ids[at]]), 4))
        report.append(row)
    summary = {"device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
               "batch": args.batch, "identical": sum(r["identical"] for r in report), "prompts": len(report),
               "rows": report}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
