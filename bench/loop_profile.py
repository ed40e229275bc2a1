"""Where the decode loop's host time goes: the default bench prompts decoded greedily with a pair
(flags as `specpair bench`'s), once to warm, then under cProfile; prints and writes (--out) the
loop's time per step, the model's share of it (StepTiming) and the functions with the most time
of their own. A diagnostic for the GPU loop, where the step is a recorded graph and everything
else is host work; its figures are benchmark output.

    python bench/loop_profile.py --target /path/model.gguf --drafter ngram --device cuda \
        --dtype bfloat16 --out out/loop_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prompts", type=int, help="only the first N default prompts")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from specpair.bench import load_prompts
    from specpair.config import GenerationParams, ModelRef, PairSpec
    from specpair.pair import load_pair

    engine = load_pair(PairSpec(target=ModelRef(args.target), drafter=args.drafter,
                                device=args.device, dtype=args.dtype))
    prompts = [p["prompt"] for p in load_prompts(None)][:args.prompts]
    params = GenerationParams(max_new_tokens=args.max_new_tokens)
    engine.generate(prompts[:1], params, chat=True)
    profile = cProfile.Profile()
    steps = 0
    started = time.perf_counter()
    for prompt in prompts:
        profile.enable()
        result = engine.generate([prompt], params, chat=True)[0]
        profile.disable()
        steps += result.stats.num_target_steps
    wall = time.perf_counter() - started
    stats = pstats.Stats(profile)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())
    top = sorted(((v[2], v[3], v[0], f"{k[0].split('/')[-1]}:{k[1]}({k[2]})")
                  for k, v in stats.stats.items()), reverse=True)[:args.top]
    report = {"device": args.device or "default", "steps": steps, "wall_s": round(wall, 3),
              "ms_per_step_profiled": round(wall / max(steps, 1) * 1e3, 3),
              "step": engine.describe_step(),
              "top_tottime": [{"function": name, "tottime_ms_per_step": round(own / steps * 1e3, 4),
                               "cumtime_ms_per_step": round(cum / steps * 1e3, 4), "calls": calls}
                              for own, cum, calls, name in top]}
    print(json.dumps({k: v for k, v in report.items() if k != "top_tottime"}))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
