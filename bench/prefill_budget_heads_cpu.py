#!/usr/bin/env python
"""What a cold long prompt costs the rows already decoding with a head drafter, by the prefill
token budget (decoding.Batch._prefill_caps; until 94c3bea a head's batch fed prompts whole, as
budget 0 does now), in-process on a real Batch (no server): --rows rows decode with an EAGLE,
EAGLE-3 or Medusa head built from the target (untrained: what a round costs is real, what it
accepts is not the point), optionally drafting trees; a cold prompt of --shared-prefix tokens
then joins. Per budget: the largest step (wall and CPU seconds) the decoding rows waited through
while it was fed, the steps until its first token, the CPU seconds of the whole run, and whether
every row's tokens and every row's drafts (position, chain) equal the first run's. Budgets
alternate, --repeat times each; read the CPU seconds (other jobs share the machine).

    python bench/prefill_budget_heads_cpu.py --head eagle --rows 8 --budgets 0 256 --repeat 2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_budget_cpu import chat_prompts, run_budget  # noqa: E402
from worker_timeline import load_engine  # noqa: E402


def head_engine(target, kind: str, k: int, tree_width: int):
    """An engine drafting with a fresh head of `kind` on `target` (a loaded model)."""
    import torch

    from specpair.config import SpeculationConfig
    from specpair.decoding import SpeculativeEngine
    from specpair.eagle3 import build_eagle3_head
    from specpair.heads import build_eagle_head, build_medusa_heads
    from specpair.models import wrap_model

    ids = torch.arange(0, target.embedding_rows)
    if kind == "eagle":
        head = wrap_model(build_eagle_head(target.model, ids, seed=0), target.tokenizer, "head")
    elif kind == "eagle3":
        head = wrap_model(build_eagle3_head(target.model, ids, seed=0), None, "head")
    else:
        head = wrap_model(build_medusa_heads(target.model, ids, k), target.tokenizer, "medusa")
    speculation = SpeculationConfig(k=k, k_max=k, dynamic_k=False, fallback_threshold=0,
                                    batch_size_threshold=64, tree_width=tree_width)
    return SpeculativeEngine(target, draft=head, speculation=speculation)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--head", choices=["eagle", "eagle3", "medusa"], default="eagle")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tree-width", type=int, default=1)
    parser.add_argument("--rows", type=int, default=8, help="rows decoding when the prompt joins")
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 256], help="0: whole prompts")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--shared-prefix", type=int, default=1500, metavar="TOKENS")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()

    from specpair.config import GenerationParams

    loaded = load_engine(args.target, ["--no-spec", "--max-batch-size", "64"])
    engine = head_engine(loaded.target, args.head, args.k, args.tree_width)
    assert engine.paged_space is not None, engine.paged_unused
    engine.eos_ids = frozenset()      # every row steps to its budget
    short, cold = chat_prompts(engine, args.rows, args.shared_prefix)
    params = GenerationParams(max_new_tokens=args.max_new_tokens)
    print(f"{args.head} head (k {args.k}, tree width {args.tree_width}), {args.rows} rows decoding, "
          f"a cold {len(cold)}-token prompt joins; load {os.getloadavg()[0]:.1f}", flush=True)
    first: dict = {}
    for turn in range(args.repeat):
        for budget in args.budgets:
            drafts: dict = {}

            def spy(batch, _drafts=drafts):
                inner = batch.drafter.propose

                def propose(sequences, ks, sampling, width=1, **extra):
                    proposal = inner(sequences, ks, sampling, width, **extra)
                    for seq, row, n in zip(batch.rows, proposal.tokens.tolist(), proposal.num.tolist()):
                        if n:
                            _drafts.setdefault(seq.request_id, []).append((len(seq.tokens), row[:n]))
                    return proposal
                batch.drafter.propose = propose
            # two steps: the rows decode (and draft) before the prompt joins
            run = run_budget(engine, budget, short, cold, params, warm_steps=2, prepare=spy)
            batch, rows, late = run.batch, run.rows, run.late
            tokens = run.tokens()
            same = first.setdefault("tokens", tokens) == tokens
            same_drafts = first.setdefault("drafts", drafts) == drafts
            drafted = sum(batch.result(s).stats.num_draft_tokens for s in rows + [late])
            print(f"budget {budget or 'none'}: largest step while the prompt was fed {run.worst_wall:.2f} s "
                  f"wall / {run.worst_cpu:.2f} CPU-s, its first token after {run.steps_to_first} "
                  f"steps, the whole run {run.run_cpu:.2f} CPU-s, {drafted} tokens drafted ({len(drafts.get('cold', []))} "
                  f"rounds of the cold row's); tokens equal to the first run's: {same}, drafts: "
                  f"{same_drafts}; load {os.getloadavg()[0]:.1f}", flush=True)
            batch.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
