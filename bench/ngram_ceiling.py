#!/usr/bin/env python
"""How far prompt lookup can go on the target's own replies: greedy rounds replayed offline.

    python bench/ngram_ceiling.py --target TARGET_DIR --replies OUT/replies.jsonl [--k 4 8]

Under greedy decoding a round's outcome is fixed by the reply the target went on to write: the
drafter proposes from the text so far, the target keeps the longest prefix of the proposal that
the reply continues with, plus one token of its own. So the n-gram drafter's mean acceptance
length per target pass can be replayed from replies alone, with no model and no timing noise:

- `lookup`: as the engine drafts (NgramDrafter.lookup: the latest match of the longest n-gram);
- `ceiling`: the best continuation among *all* matches of that n-gram, chosen in hindsight. No
  policy that picks one earlier occurrence to copy can beat it, so it bounds what a smarter
  choice among matches (longer context, frequency, recency) could add.

Replies come from `specpair distill --replies` (OUT/replies.jsonl: the target's greedy chat
answers with their kinds); the target directory gives the tokenizer and chat template, to tell
prompt from reply. Prints one JSON object: per kind and k, rounds, the share of rounds with no
match (a plain decode step), and both mean lengths.

Figures: docs/measurements/ngram_ceiling_on_target_replies.json; read in docs/bench/bandwidth.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def replay(drafter, ids: list[int], start: int, k: int) -> dict:
    """Greedy rounds of prompt lookup over one reply (ids[start:]), as counts."""
    out = {"rounds": 0, "no_match": 0, "lookup": 0, "ceiling": 0}
    t = start
    while t < len(ids):
        context, rest = ids[:t], ids[t:]
        matches = drafter.matches(context)
        out["rounds"] += 1
        out["no_match"] += not matches

        def kept(begin: int) -> int:        # the proposal's prefix the reply continues with
            proposal = context[begin:begin + k]
            n = 0
            while n < len(proposal) and n < len(rest) and proposal[n] == rest[n]:
                n += 1
            return n

        ours = kept(matches[0]) if matches else 0
        best = max((kept(m) for m in matches), default=0)
        out["lookup"] += min(ours + 1, len(rest))         # plus the target's own token
        out["ceiling"] += min(best + 1, len(rest))
        t += min(ours + 1, len(rest))                      # the engine's own trajectory
    return out


def summarise(totals: dict) -> dict:
    r = totals["rounds"]
    return {"rounds": r, "no_match": round(totals["no_match"] / r, 3),
            "lookup_length": round(totals["lookup"] / r, 3),
            "ceiling_length": round(totals["ceiling"] / r, 3)}


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from specpair.decoding import encode_prompt
    from specpair.drafters import NgramDrafter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the target's directory (tokenizer, chat template)")
    ap.add_argument("--replies", required=True, help="a replies.jsonl of `specpair distill --replies`")
    ap.add_argument("--k", type=int, nargs="+", default=[4], help="draft tokens per round")
    ap.add_argument("--kinds", nargs="*", default=None, help="only these kinds")
    args = ap.parse_args(argv)
    if any(k < 1 for k in args.k):
        ap.error("--k must be >= 1")
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    drafter = NgramDrafter()
    with open(args.replies) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if not args.kinds or r["kind"] in args.kinds]
    if not rows:
        ap.error(f"no replies of kinds {args.kinds} in {args.replies}")
    totals: dict = defaultdict(lambda: defaultdict(int))
    for r in rows:
        start = len(encode_prompt(tokenizer, r["prompt"], chat=True))
        for k in args.k:
            for key, n in replay(drafter, r["ids"], start, k).items():
                totals[(r["kind"], k)][key] += n
    report = defaultdict(dict)
    for (kind, k), t in sorted(totals.items()):
        report[kind][f"k={k}"] = summarise(t)
    print(json.dumps({"replies": len(rows), "kinds": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
