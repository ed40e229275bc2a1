#!/usr/bin/env python
"""How often a drafting head's first guess is the target's own next token, teacher-forced.

    python bench/head_agreement.py --target TARGET_DIR --head HEAD_DIR [--prompts FILE.jsonl]
        [--replies OUT/replies.jsonl --kinds qa code --limit 40 --stride 1] [--max-new-tokens 64]
        [--depth 4]

The first draft position of a round is exactly this setting (the head reads the target's real
features), so this number is what bench acceptance at position 1 can reach; the gap between it
on the head's training conversations and on new requests measures generalisation. Replies to
`--prompts` (default: the bench's golden prompts) are the target's greedy chat answers,
generated here; `--replies` takes conversations already made (distill's replies.jsonl).
Agreement counts reply tokens only.

`--depth K` follows each chain on for K drafts, the head reading its own predicted features after
the first (as a greedy round of K drafts does): agreement per step counts chains right at every
step so far, and `tokens_per_pass` is what such rounds would commit per target pass, before
the drafter's cost. An EAGLE head only (Medusa heads draft all positions from one feature).

Figures: docs/measurements/cpu_eagle_head_agreement.json, cpu_eagle_head_agreement_2000.json,
cpu_eagle_ttt_400_agreement.json, cpu_eagle_heldout_by_replies.json; read in docs/bench/heads.md.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


@torch.no_grad()
def agreement(target, head, conversations: list[tuple[list[int], int]], depth: int = 1,
              read=None) -> dict:
    """conversations: (token ids, index of the first reply token). A chain starts after every
    pair j whose first draft (token j+2) is a reply token; its step d drafts token j+d+1 from the
    head's own step d-1 (`EagleHead.unroll`), as a greedy round of `depth` drafts would.
    `read(ids)` -> [1, n, F]: the features the head reads, the target's last feature in the first
    D columns (default: that feature alone; bench/head_probe.py adds fused layers, depth 1).
    -> per step: chains right up to it / chains reaching it, and the mean accepted run + 1
    (tokens per target pass of such rounds, ignoring the drafter's cost)."""
    draft_ids = head.draft_token_ids
    D = target.model.config.hidden_size
    right = [0] * depth
    reached = [0] * depth
    runs = starts = 0
    for ids, start in conversations:
        x = torch.tensor([ids])
        features = read(ids) if read else target.model.model(input_ids=x).last_hidden_state
        embeds = target.model.get_input_embeddings()(x)
        steps = [head(embeds[:, 1:], features[:, :-1])] if depth == 1 else \
            head.unroll(embeds, features, min(depth, len(ids) - 1))
        truth = target.model.lm_head(features[..., :D]).argmax(-1)[0]  # the target's token j+1
        n = len(ids) - 2                        # chains whose first draft (token j+2) is in the text
        alive = torch.ones(n, dtype=torch.bool)
        first = torch.arange(n) + 2 >= start                            # ... and a reply token
        run = torch.zeros(n, dtype=torch.long)
        for d, predicted in enumerate(steps, start=1):
            m = predicted.shape[1] - 1          # chains whose step d drafts a token of the text
            guess = draft_ids[head.lm_head(predicted[:, :m]).argmax(-1)][0]   # token j+d+1
            ok = (guess == truth[d:d + m]) & alive[:m]
            keep = first[:m]
            reached[d - 1] += int(keep.sum())
            right[d - 1] += int((ok & keep).sum())
            run[:m] += ok.long()
            alive = torch.zeros(n, dtype=torch.bool)
            alive[:m] = ok
        runs += int(run[first].sum())
        starts += int(first.sum())
    rate = [round(r / t, 4) if t else None for r, t in zip(right, reached)]
    out = {"agreed": right[0], "tokens": reached[0], "rate": rate[0]}
    if depth > 1:
        out |= {"depth": depth, "rate_per_step": rate,
                "tokens_per_pass": round(1 + runs / starts, 4) if starts else None}
    return out


def reply_conversations(engine, path, kinds=None, stride: int = 1, limit: int | None = None
                        ) -> list[tuple[list[int], int]]:
    """Conversations of a replies.jsonl (`specpair distill --replies`): only `kinds`, every
    `stride`-th, the first `limit`; each as (token ids, index of the first reply token)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if not kinds or r["kind"] in kinds][::stride][:limit]
    return [(r["ids"], len(engine.encode(r["prompt"], chat=True))) for r in rows]


def prompt_conversations(engine, prompts_path, max_new_tokens: int) -> list[tuple[list[int], int]]:
    """The target's greedy chat replies to a prompt file (None: the bench's golden prompts)."""
    from specpair.bench import load_prompts
    from specpair.config import GenerationParams

    conversations = []
    for p in load_prompts(prompts_path):
        prompt = engine.encode(p["prompt"], chat=True)
        batch = engine.new_batch()
        seq = batch.add(prompt, GenerationParams(max_new_tokens=max_new_tokens))
        while batch.active:
            batch.step()
        conversations.append((prompt + seq.generated, len(prompt)))
    return conversations


def main(argv=None) -> int:
    from specpair.config import SpeculationConfig
    from specpair.decoding import SpeculativeEngine
    from specpair.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--prompts", default=None, help="JSON Lines of {prompt, category}")
    ap.add_argument("--replies", default=None, help="a replies.jsonl of `specpair distill --replies`")
    ap.add_argument("--kinds", nargs="*", default=None, help="with --replies: only these kinds")
    ap.add_argument("--limit", type=int, default=40, help="with --replies: the first N")
    ap.add_argument("--stride", type=int, default=1,
                    help="with --replies: every Nth conversation (a spread over a file whose "
                         "replies are ordered by prompt length)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=1,
                    help="draft chains this long: agreement per step (the head drafting from its "
                         "own predictions after the first) and tokens per target pass")
    args = ap.parse_args(argv)
    if args.depth < 1:
        ap.error("--depth must be >= 1")
    target = load_model(args.target, dtype="float32")
    head = load_model(args.head, dtype="float32").model
    if getattr(head, "method", None) != "eagle":
        ap.error(f"{args.head} is not an EAGLE head")
    engine = SpeculativeEngine(target, speculation=SpeculationConfig(enabled=False))
    if args.replies:
        if args.stride < 1:
            ap.error("--stride must be >= 1")
        conversations = reply_conversations(engine, args.replies, args.kinds, args.stride, args.limit)
    else:
        conversations = prompt_conversations(engine, args.prompts, args.max_new_tokens)
    print(json.dumps(agreement(target, head, conversations, args.depth)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
