#!/usr/bin/env python
"""Structured output under speculation against unconstrained speculation and constrained
target-only decoding, on the same prompts (issue 56's target: >= 0.9x unconstrained speculation,
faster than constrained target-only).

Four modes per prompt, in turn on one engine (one prompt at a time: the latency case): free text
target-only and speculative, then the same request with a strict JSON schema (grammar.py's mask;
the n-gram drafter drafts within the grammar, the tokens it forces included: RowGrammar.
guided_drafts) target-only and speculative. Forced drafts count as drafts in the acceptance. Each mode's figure is
tokens per second over all prompts and rounds (the replies differ in length between free and
constrained text, so tokens/s, not seconds, is compared), with the speculative rows' acceptance.
Every constrained reply is checked against its schema and each speculative reply against its
target-only one. Benchmark output, not a test (tests/tools/test_structured_speed.py runs it on
the tiny pair).

    python bench/structured_speed.py --out docs/measurements/cpu_structured_speed.json

Default: the CPU default pair (embedded SmolLM2 target, n-gram drafter, k 4).
Figures: docs/measurements/2026-12-06-structured-speed-cpu.md (before grammar-aware drafts),
docs/measurements/2026-12-06-structured-speed-guided-cpu.md (with them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "engine")]

from specpair.config import GenerationParams  # noqa: E402
from specpair.grammar import reply_valid  # noqa: E402
from specpair.stats import AcceptanceStats  # noqa: E402

# A JSON-extraction task: the record's fields named in the prompt (as such prompts do).
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "skills"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 40},
                         "skills": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 30}}}}
PEOPLE = ["a baker in Lyon", "a pilot from Oslo", "a retired teacher in Lima", "a young chemist in Osaka",
          "a carpenter from Quebec", "a nurse in Nairobi", "a violinist in Vienna", "a farmer near Cork"]
PROMPTS = [f"Describe {who} as a JSON object with the keys name, age, city and skills." for who in PEOPLE]
MODES = (("free", False, False), ("free+spec", False, True), ("json", True, False), ("json+spec", True, True))


def run(engine, prompts: list[str], *, max_new_tokens: int, rounds: int, chat: bool = True) -> dict:
    """Each prompt in each mode, `rounds` times, the modes in turn per prompt (a noisy neighbour
    slows all four alike) -> per mode: tokens, seconds, tokens/s, acceptance; and the checks."""
    structure = ("json_schema", json.dumps(SCHEMA))
    totals = {name: {"tokens": 0, "seconds": 0.0, "stats": AcceptanceStats(), "per_round": []} for name, *_ in MODES}
    valid = identical = constrained = 0
    engine.generate(prompts[:1], GenerationParams(max_new_tokens=4, structure=structure), chat=chat)   # warm-up
    for _ in range(rounds):
        round_tokens = {name: [0, 0.0] for name, *_ in MODES}
        for prompt in prompts:
            texts = {}
            for name, constrained_mode, speculate in MODES:
                params = GenerationParams(max_new_tokens=max_new_tokens,
                                          structure=structure if constrained_mode else None)
                engine.controller.reset()
                started = time.perf_counter()
                result = engine.generate([prompt], params, chat=chat, speculate=speculate)[0]
                seconds = time.perf_counter() - started
                texts[name] = result.token_ids
                t = totals[name]
                t["tokens"] += len(result.token_ids)
                t["seconds"] += seconds
                round_tokens[name][0] += len(result.token_ids)
                round_tokens[name][1] += seconds
                if speculate:
                    t["stats"].merge(result.stats)
                if name == "json+spec":
                    constrained += 1
                    valid += bool(reply_valid(structure, result.text))
            identical += texts["free"] == texts["free+spec"]
            identical += texts["json"] == texts["json+spec"]
        for name, (tokens, seconds) in round_tokens.items():
            totals[name]["per_round"].append(round(tokens / seconds, 2) if seconds else 0.0)
    modes = {}
    for name, t in totals.items():
        modes[name] = {"tokens": t["tokens"], "seconds": round(t["seconds"], 3),
                       "tokens_per_s": round(t["tokens"] / t["seconds"], 2) if t["seconds"] else 0.0,
                       "tokens_per_s_by_round": t["per_round"],
                       "median_round_tokens_per_s": statistics.median(t["per_round"]) if t["per_round"] else 0.0}
        if name.endswith("+spec"):
            modes[name]["acceptance_rate"] = round(t["stats"].acceptance_rate, 4)
            modes[name]["mean_acceptance_length"] = round(t["stats"].mean_acceptance_length, 4)
    tps = {name: m["tokens_per_s"] for name, m in modes.items()}
    return {"modes": modes,
            "json_spec_vs_free_spec": round(tps["json+spec"] / tps["free+spec"], 4) if tps["free+spec"] else None,
            "json_spec_vs_json_target_only": round(tps["json+spec"] / tps["json"], 4) if tps["json"] else None,
            "schema_valid": f"{valid}/{constrained}",
            "speculative_equal_to_target_only": f"{identical}/{2 * len(prompts) * rounds}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS),
                    help=f"how many of the {len(PROMPTS)} prompts (the first ones)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from specpair.config import ModelRef, PairSpec, SpeculationConfig
    from specpair.pair import load_pair

    pair = PairSpec(target=ModelRef(args.target), drafter=args.drafter, threads=args.threads,
                    speculation=SpeculationConfig(k=args.k, dynamic_k=False))
    engine = load_pair(pair, progress=lambda m: print(m, file=sys.stderr))
    load_before = os.getloadavg()
    result = run(engine, PROMPTS[:args.prompts], max_new_tokens=args.max_new_tokens, rounds=args.rounds)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
              "pair": dataclasses.asdict(pair)["target"] | {"drafter": args.drafter, "k": args.k},
              "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "prompts": args.prompts,
              "threads": args.threads or __import__("torch").get_num_threads(),
              "load_average_before": [round(x, 2) for x in load_before],
              "load_average_after": [round(x, 2) for x in os.getloadavg()], **result}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
