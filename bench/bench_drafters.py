#!/usr/bin/env python
"""Several drafters on the same prompts, one after the other, in one table.

    python bench/bench_drafters.py --out docs/measurements/drafters \\
        --config "n-gram=--drafter ngram" \\
        --config "EAGLE chain=--draft HEAD_DIR" \\
        --config "EAGLE tree of 2=--draft HEAD_DIR --tree-width 2"

Each configuration is one `specpair bench` (same prompts, runs and tokens; its own process, so
no configuration warms another's caches), strictly one at a time: on a small CPU two benches side
by side measure each other. Every report is kept as OUT/<name>.json; the table (markdown) goes to
stdout and OUT/table.md: speedup and mean acceptance length per category, overall, acceptance per
position, the draft's cost against a target step, greedy identity.

Figures: docs/bench/heads.md (tables); reports in docs/measurements/cpu_eagle_*_chain.json,
*_tree2.json, cpu_medusa_*.json, cpu_ngram_beside_trees.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def table(reports: dict[str, dict]) -> str:
    categories = list(dict.fromkeys(c for r in reports.values() for c in r["categories"]))
    head = ["drafter", *categories, "overall", "acceptance per position", "draft cost (of a step)",
            "identity"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in reports.items():
        cells = [name]
        for c in categories + ["overall"]:
            row = r["categories"].get(c) if c != "overall" else r["overall"]
            cells.append(f"{row['speedup']:.2f}x (len {row['mean_acceptance_length']:.2f})" if row else "-")
        overall = r["overall"]
        cells.append(" ".join(f"{x:.2f}" for x in overall["acceptance_per_position"]))
        cells.append(f"{overall['cost_ratio']:.3f}")
        cells.append(f"{round(overall['greedy_identity'] * overall['prompts'])}/{overall['prompts']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", required=True, metavar="NAME=ARGS",
                    help="a name and the `specpair bench` arguments of one drafter (repeatable)")
    ap.add_argument("--target", default=None, help="passed to every bench")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True, help="folder for the reports and the table")
    args = ap.parse_args(argv)
    configs = []
    for item in args.config:
        name, sep, rest = item.partition("=")
        if not sep or not name.strip():
            ap.error(f"--config {item!r}: expected NAME=ARGS")
        configs.append((name.strip(), shlex.split(rest)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for name, extra in configs:
        path = out / f"{slug(name)}.json"
        cmd = [sys.executable, "-m", "specpair", "bench", "--runs", str(args.runs),
               "--max-new-tokens", str(args.max_new_tokens), "--json", "--out", str(path), *extra]
        if args.target:
            cmd += ["--target", args.target]
        print(f"# {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        if proc.returncode != 0:
            print(f"{name}: bench failed (exit {proc.returncode}); stopping", file=sys.stderr)
            return proc.returncode
        reports[name] = json.loads(path.read_text())
    text = table(reports)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
