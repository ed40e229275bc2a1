#!/usr/bin/env python
"""What a greedy EAGLE-3 drafting step costs on the CPU, by part, at one thread in CPU time: the
head's layer (head_kernels.c, its norm riding along), its LM head over the draft vocabulary
(cpu_kernels.linear: the whole logits row written) and the top-1 over that row (topk + the map
to target ids), against the LM head and top-1 fused into the layer's C call (blocks of the
vocabulary scored and reduced to (max, index) as they are produced, no logits row), where the
working tree's head_kernels has it.

A round of k drafts is one catch-up call (each row's pairs since its last round) and k - 1
drafting calls, each followed by an LM head and a top-1: `round` adds them up for k = 3 and
two pairs a row caught up. The LM head's 4 * D * Vd bytes come from memory each step (113 MB
for SmolLM2's whole vocabulary); each figure is the least CPU time over --reps alternated runs
(other jobs only add), tokens of the fused path checked equal to the unfused one's.

    python bench/head_top1.py --shape smollm2 --vocab 8192 49152 --rows 1 4 16
    python bench/head_top1.py --shape tiny      # the tests' head: seconds

--engine: the rounds as the engine runs them instead: SmolLM2 (the model cache's) with an
untrained EAGLE-3 head over each --vocab, k = 3, one thread, greedy replies to the first
--prompts of bench/eagle3_prompts.jsonl, the drafter's propose() (every round: catch-up, drafts,
LM heads, top-1) timed in CPU seconds, the fused top-1 on and off in turns; replies checked equal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "engine"))

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from specpair import cpu_kernels, head_kernels  # noqa: E402
from specpair.drafters.head import draft_vocab_logits  # noqa: E402
from specpair.eagle3 import Eagle3Head  # noqa: E402

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=512),
}


def make_head(shape: str, vocab: int, seed: int = 0) -> Eagle3Head:
    config = LlamaConfig(**SHAPES[shape], num_hidden_layers=1, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(seed)
    head = Eagle3Head(config, draft_vocab_size=vocab, aux_layers=(2, 15, 27),
                      norm_before_residual=False).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.05)
        head.d2t.copy_(torch.arange(vocab) * (config.vocab_size // vocab))   # a spread map
    return head


def cpu(fn, reps: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(reps):
        start = time.process_time()
        out = fn()
        best = min(best, time.process_time() - start)
    return best, out


def measure(head, rows: int, context: int, reps: int) -> dict:
    run = head_kernels.Eagle3Kernel(head)
    D = head.config.hidden_size
    ids = head.draft_token_ids
    layer = head.layer
    kc = torch.zeros(rows, layer.kv_heads, context + 8, layer.head_dim)
    vc = torch.zeros_like(kc)
    generator = torch.Generator().manual_seed(1)
    embeds, hidden = torch.randn(2, rows, D, generator=generator)
    row_ids = torch.arange(rows)
    positions = torch.full((rows,), context)
    # the keys and values of `context` earlier positions, so attention reads a real context
    kc[:, :, :context] = torch.randn(rows, layer.kv_heads, context, layer.head_dim,
                                     generator=generator)
    vc[:, :, :context] = torch.randn_like(kc[:, :, :context])
    pairs = torch.randn(2, 2 * rows, D, generator=generator)
    pair_rows = torch.arange(rows).repeat_interleave(2)
    pair_positions = torch.tensor([context - 2, context - 1] * rows)
    fused = hasattr(run, "top1_applies") and run.top1_applies()
    figures: dict = {}

    def step():
        return run(embeds, hidden, row_ids, positions, context + 1, kc, vc)

    def catch_up():
        return run(pairs[0], pairs[1], pair_rows, pair_positions, context, kc, vc)

    _, normed = step()
    logits = draft_vocab_logits(head, normed)
    parts = {
        "layer": step,
        "catch_up": catch_up,
        "lm_head": lambda: draft_vocab_logits(head, normed),
        "top1": lambda: ids[logits.topk(1, dim=-1).indices][:, 0],
        "unfused_step": lambda: ids[draft_vocab_logits(head, step()[1]).topk(1, dim=-1)
                                    .indices][:, 0],
    }
    if fused:
        parts["fused_step"] = lambda: ids[run.with_top1(embeds, hidden, row_ids, positions,
                                                        context + 1, kc, vc)[2]]
    seconds = {name: float("inf") for name in parts}
    outs = {}
    for _ in range(reps):                      # alternated, so the machine's noise falls on all
        for name, fn in parts.items():
            spent, outs[name] = cpu(fn, 1)
            seconds[name] = min(seconds[name], spent)
    figures = {name: round(s * 1e3, 3) for name, s in seconds.items()}
    figures["lm_head+top1_share_of_step"] = round(
        (seconds["lm_head"] + seconds["top1"]) / seconds["unfused_step"], 3)
    figures["top1_share_of_step"] = round(seconds["top1"] / seconds["unfused_step"], 3)
    # a k = 3 round: one catch-up of two pairs a row, two drafting steps, three LM heads + top-1
    figures["round_unfused_k3"] = round(
        (seconds["catch_up"] + 2 * seconds["layer"] + 3 * (seconds["lm_head"] + seconds["top1"]))
        * 1e3, 3)
    if fused:
        figures["fused_equal"] = bool(torch.equal(outs["fused_step"], outs["unfused_step"]))
        figures["fused_over_unfused"] = round(seconds["fused_step"] / seconds["unfused_step"], 3)
        figures["round_fused_k3"] = round(
            (seconds["catch_up"] + 2 * seconds["layer"]
             + 3 * (seconds["fused_step"] - seconds["layer"])) * 1e3, 3)
    return figures


def engine_rounds(vocabs: list[int], n_prompts: int, max_tokens: int, turns: int) -> list:
    """CPU seconds in the drafter's rounds, fused top-1 on and off in turns (module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from eagle3_vs_vllm import PROMPTS_FILE, our_side

    from specpair.drafters.eagle3 import Eagle3Drafter

    spent = {"rounds": 0, "cpu": 0.0}
    propose = Eagle3Drafter.propose

    def timed(self, *args, **kwargs):
        start = time.process_time()
        try:
            return propose(self, *args, **kwargs)
        finally:
            spent["cpu"] += time.process_time() - start
            spent["rounds"] += 1
    Eagle3Drafter.propose = timed
    fused_rule = Eagle3Drafter._top1_fused
    runs = []
    for vocab in vocabs:
        _, _, prompts, reply = our_side("default", None, str(PROMPTS_FILE), n_prompts,
                                        max_tokens, 3, draft_vocab=vocab)
        figures = {"vocab": vocab, "fused": [], "unfused": []}
        replies = {}
        for turn in range(turns):
            for fused in (True, False) if turn % 2 == 0 else (False, True):
                Eagle3Drafter._top1_fused = (fused_rule if fused
                                             else lambda self, sampling, width: False)
                spent.update(rounds=0, cpu=0.0)
                start = time.process_time()
                got = [reply(ids).generated for ids in prompts]
                total = time.process_time() - start
                replies.setdefault(fused, got)
                assert replies[fused] == got
                figures["fused" if fused else "unfused"].append(
                    {"rounds": spent["rounds"], "round_ms": round(spent["cpu"] / spent["rounds"]
                                                                  * 1e3, 3),
                     "tokens": sum(map(len, got)), "total_cpu_s": round(total, 3)})
        Eagle3Drafter._top1_fused = fused_rule
        figures["replies_equal"] = replies[True] == replies[False]
        best = {k: min(r["round_ms"] for r in figures[k]) for k in ("fused", "unfused")}
        figures["round_ms_min"] = best
        figures["fused_over_unfused"] = round(best["fused"] / best["unfused"], 3)
        print(json.dumps(figures), flush=True)
        runs.append(figures)
    Eagle3Drafter.propose = propose
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--vocab", type=int, nargs="+", default=None,
                        help="draft vocabulary sizes (default: 8192 and the whole for smollm2)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None)
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not cpu_kernels.available() or head_kernels.library() is None:
        sys.exit("the C kernels did not build")
    if args.engine:
        load = os.getloadavg()
        runs = engine_rounds(args.vocab or [8192, 49152], args.prompts, args.max_tokens,
                             args.turns)
        print("load", load, "->", os.getloadavg())
        if args.out:
            Path(args.out).write_text(json.dumps({"engine": True, "load_before": load,
                                                  "load_after": os.getloadavg(), "runs": runs},
                                                 indent=1))
        return
    vocabs = args.vocab or ([8192, 49152] if args.shape == "smollm2" else [200, 512])
    result = {"shape": args.shape, "context": args.context, "threads": 1,
              "load_before": os.getloadavg(), "runs": []}
    for vocab in vocabs:
        head = make_head(args.shape, vocab)
        for rows in args.rows:
            with torch.no_grad():
                figures = measure(head, rows, args.context, args.reps)
            figures.update(vocab=vocab, rows=rows)
            print(json.dumps(figures), flush=True)
            result["runs"].append(figures)
    result["load_after"] = os.getloadavg()
    print("load", result["load_before"], "->", result["load_after"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
