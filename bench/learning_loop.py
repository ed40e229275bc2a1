#!/usr/bin/env python
"""Issue 58's target figures: a drafter trained on the traffic a pair captured, on the demo's
domain shift (free-form writing sent as the 'extraction' category to the SmolLM2 pair drafted by
n-gram lookup).

    python bench/learning_loop.py capture --workdir /tmp/loop      # serve v2 (n-gram, k 8 fixed), capture
    python bench/learning_loop.py train --workdir /tmp/loop --method draft --max-seconds 400
    python bench/learning_loop.py measure --workdir /tmp/loop --draft /tmp/loop/draft-draft

`capture` starts `specpair engine serve` as the demo's v2 serves (the embedded SmolLM2-135M target,
n-gram lookup, k 8, dynamic k off) with the engine's `--capture-*` flags, and sends it the
shifted traffic: free-form writing requests labelled 'extraction' (TRAIN_PROMPTS, none of them
the demo's six). The engine writes prompt and reply token ids per category, as a pod does.
It then measures that release on the held-out evaluation prompts (the demo's six free-form
prompts, demo/traffic.py CREATIVE, sent as 'extraction'): first-position acceptance and speed
against target-only.

`train` runs `specpair distill --from-capture DIR --category extraction` as the training Job does
(docs/learning.md), in a child process, and records its CPU time (user + system, from the
child's rusage): the budget is 15 minutes of the Job's CPU.

`measure` serves the trained drafter (the engine's default k and dynamic k) and measures it on the
same held-out prompts. Per prompt, after one untimed target-only pass that puts the prompt in the
prefix store, target-only and speculative requests alternate (--rounds each); each request is
timed by wall clock and by the server process's CPU time (/proc/<pid>/stat: the requests are
sent one at a time, so that CPU is the request's), and every speculative reply is compared with
the target-only one (greedy: identical). First-position acceptance is accepted drafts at
position 1 over rounds that drafted (the engine's `accepted_per_position[0]` / `drafts`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from load_bench import ROOT, free_port  # noqa: E402

from demo.traffic import CREATIVE  # noqa: E402

CATEGORY = "extraction"
EVAL_PROMPTS = [p for _, p in CREATIVE]
# The shifted traffic the pair captures: the demo's kind of request (free-form writing), other
# subjects. None is an evaluation prompt (checked at import).
_TEMPLATES = ["Write a short poem about {}.", "Tell a two-sentence story about {}.",
              "Describe {} to someone who has never seen it.", "Write a limerick about {}.",
              "Write a short diary entry from the point of view of {}.", "Describe the sound of {}.",
              "Write a four-line song about {}.", "Tell a short fable about {} with a moral."]
_SUBJECTS = ["a lighthouse keeper", "autumn leaves", "a lost umbrella", "a dragon who is afraid of the dark",
             "the first snow of winter", "an old library", "a city at midnight", "a tired astronaut",
             "a garden after rain", "a clock that runs backwards", "a fox in the mountains",
             "a train crossing the desert", "the last day of summer", "a friendly ghost", "a busy market",
             "a river in spring"]
TRAIN_PROMPTS = [t.format(s) for t in _TEMPLATES for s in _SUBJECTS]
assert not set(TRAIN_PROMPTS) & set(EVAL_PROMPTS)


def server_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(args, workdir: Path, extra: list[str], log_name: str) -> tuple[subprocess.Popen, openai.OpenAI]:
    http = free_port()
    cmd = [sys.executable, "-m", "specpair.server", "engine", "serve", "--target", args.target,
           "--host", "127.0.0.1", "--port", str(free_port()), "--http-port", str(http),
           "--metrics-port", "-1", "--insecure", "--max-queue", "256",
           # Speculation at batch 1 only (the measured requests go one at a time) with the k given,
           # as a pod serving a release runs: no start-up timing picks another k or threshold.
           "--batch-size-threshold", "1",
           # A fixed row cap: the start-up timing of decode rows reads nonsense on a busy machine.
           "--max-batch-size", "8", *extra]
    # One OpenMP thread, as the demo's pods run (demo/run_demo.py): the server's CPU time is then
    # its work, not threads spinning at barriers on a shared machine.
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT / "engine") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(workdir / log_name, "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", max_retries=0, timeout=900)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"engine server exited while starting: see {workdir / log_name}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=5).status == 200:
                return server, client
        except OSError:
            pass
        time.sleep(1)
    server.kill()
    raise SystemExit("engine server did not become ready in 900 s")


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(120)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(30)


def chat(client: openai.OpenAI, prompt: str, max_tokens: int, k: int | None = None) -> dict:
    ext = {"category": CATEGORY if k != 0 else "baseline"}
    if k is not None:
        ext["k"] = k
    reply = client.chat.completions.create(model=client.models.list().data[0].id,
                                           messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, temperature=0, extra_body={"specpair": ext})
    figures = (reply.model_extra or {}).get("specpair") or {}
    return {"text": reply.choices[0].message.content, "tokens": reply.usage.completion_tokens, **figures}


def measure_release(args, server: subprocess.Popen, client: openai.OpenAI) -> dict:
    """Alternated target-only and speculative requests on the held-out prompts (module doc)."""
    rows = []
    for prompt in EVAL_PROMPTS:
        chat(client, prompt, 1, k=0)      # into the prefix store, untimed
        row = {"prompt": prompt, "target_only": [], "speculative": []}
        for _ in range(args.rounds):
            for side, k in (("target_only", 0), ("speculative", None)):
                cpu, wall = server_cpu(server.pid), time.perf_counter()
                r = chat(client, prompt, args.max_new_tokens, k)
                r["wall"], r["cpu"] = time.perf_counter() - wall, server_cpu(server.pid) - cpu
                row[side].append(r)
        row["identical"] = all(s["text"] == row["target_only"][0]["text"]
                               for s in row["target_only"] + row["speculative"])
        rows.append(row)
        s = row["speculative"][0]
        print(f"  {prompt[:48]!r}: {s['tokens']} tokens, drafts {s.get('drafts')}, accepted/pos "
              f"{s.get('accepted_per_position')}, identical {row['identical']}", flush=True)
    return summarise(rows)


def summarise(rows: list[dict]) -> dict:
    def total(side: str, key: str) -> float:
        return sum(r[key] for row in rows for r in row[side])

    spec = [r for row in rows for r in row["speculative"]]
    drafts = sum(r.get("drafts", 0) for r in spec)
    first = sum((r.get("accepted_per_position") or [0])[0] for r in spec)
    drafted = sum(r.get("drafted_tokens", 0) for r in spec)
    accepted = sum(r.get("accepted_tokens", 0) for r in spec)
    steps = sum(r.get("target_steps", 0) for r in spec)
    tokens = total("speculative", "tokens")
    return {"prompts": len(rows), "requests_per_side": len(spec), "tokens": tokens,
            "identical": all(row["identical"] for row in rows),
            "first_position_acceptance": round(first / drafts, 4) if drafts else None,
            "drafts": drafts, "target_steps": steps,
            "rounds_drafted_share": round(drafts / steps, 4) if steps else None,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "tokens_per_target_step": round(tokens / steps, 3) if steps else None,
            "speedup_wall": round(total("target_only", "wall") / total("speculative", "wall"), 3),
            "speedup_cpu": round(total("target_only", "cpu") / total("speculative", "cpu"), 3),
            "target_only_cpu_s": round(total("target_only", "cpu"), 2),
            "speculative_cpu_s": round(total("speculative", "cpu"), 2),
            "target_only_wall_s": round(total("target_only", "wall"), 2),
            "speculative_wall_s": round(total("speculative", "wall"), 2),
            "load_average": [round(x, 2) for x in os.getloadavg()], "rows": rows}


def cmd_capture(args, workdir: Path) -> dict:
    capture = workdir / "capture"
    server, client = serve(args, workdir, ["--drafter", "ngram", "--k", "8", "--no-dynamic-k",
                                           "--capture-dir", str(capture), "--capture-rate", "1",
                                           "--capture-cap", "100000"], "serve-ngram.log")
    try:
        started, cpu0 = time.perf_counter(), server_cpu(server.pid)
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(args.concurrency) as pool:
            replies = list(pool.map(lambda p: chat(client, p, args.capture_tokens), TRAIN_PROMPTS))
        sent = {"requests": len(replies), "reply_tokens": sum(r["tokens"] for r in replies),
                "wall_s": round(time.perf_counter() - started, 1), "server_cpu_s": round(server_cpu(server.pid) - cpu0, 1)}
        print(f"captured traffic: {sent}", flush=True)
        result = {"capture": sent, "release": "n-gram lookup, k 8, dynamic k off (the demo's v2)",
                  "before": measure_release(args, server, client)}
    finally:
        stop(server)     # rotates the open shard into a complete one
    shards = sorted(p.name for p in (capture / CATEGORY).glob("*.jsonl"))
    result["capture"]["shards"] = shards
    return result


def training_capture(workdir: Path) -> tuple[Path, int]:
    """The shifted traffic only: the first len(TRAIN_PROMPTS) records of the category by time,
    copied as one complete shard into capture-train/. The measured requests that follow them are
    captured too (they are served as 'extraction'), and the drafter must never see the held-out
    prompts."""
    from specpair.capture import complete_name, read_records

    records = sorted(read_records(workdir / "capture", CATEGORY), key=lambda r: r["time"])[:len(TRAIN_PROMPTS)]
    if len(records) < len(TRAIN_PROMPTS):
        raise SystemExit(f"only {len(records)} of {len(TRAIN_PROMPTS)} shifted requests are in complete shards yet")
    folder = workdir / "capture-train" / CATEGORY
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.jsonl"):
        old.unlink()
    (folder / complete_name(records[-1]["time"], "bench", 1, len(records))).write_text(
        "".join(json.dumps(r) + "\n" for r in records))
    return folder.parent, len(records)


def cmd_train(args, workdir: Path) -> dict:
    out = workdir / f"draft-{args.method}{args.tag}"
    capture, records = training_capture(workdir)
    cmd = ["nice", "-n", "10", sys.executable, "-m", "specpair.cli", "distill", "--target", args.target,
           "--from-capture", str(capture), "--category", CATEGORY, "--method", args.method,
           "--steps", str(args.steps), "--max-seconds", str(args.max_seconds), "--out", str(out),
           *args.distill_args]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "engine") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    before, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with open(workdir / f"train-{args.method}{args.tag}.log", "w") as log:
        done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode:
        raise SystemExit(f"distill failed ({done.returncode}): see {workdir}/train-{args.method}{args.tag}.log")
    summary = json.loads((out / "distill_summary.json").read_text())
    return {"draft": str(out), "cmd": cmd[3:], "records": records, "cpu_s": round(cpu, 1), "wall_s": round(time.perf_counter() - wall, 1),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "summary": {k: summary.get(k) for k in ("method", "steps", "parameters", "loss_first10", "loss_last10",
                                                    "seconds", "feature_seconds", "capture")}}


def cmd_measure(args, workdir: Path) -> dict:
    extra = ["--draft", args.draft, "--k", str(args.k)] + \
        (["--no-dynamic-k"] if args.no_dynamic_k else [])
    server, client = serve(args, workdir, extra, f"serve-{Path(args.draft).name}.log")
    try:
        return {"release": f"trained drafter {args.draft} ({' '.join(extra[2:])}{'' if args.no_dynamic_k else ', dynamic k'})",
                "after": measure_release(args, server, client)}
    finally:
        stop(server)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=["capture", "train", "measure"])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--target", default="default")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per measured reply")
    ap.add_argument("--rounds", type=int, default=2, help="measured requests per side per prompt")
    ap.add_argument("--capture-tokens", type=int, default=128, help="capture: tokens per shifted request")
    ap.add_argument("--concurrency", type=int, default=4, help="capture: requests in flight")
    ap.add_argument("--method", default="draft")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--max-seconds", type=float, default=400)
    ap.add_argument("--threads", type=int, default=2, help="train: OMP threads")
    ap.add_argument("--tag", default="", help="train: suffix of the output folder")
    ap.add_argument("--distill-args", nargs=argparse.REMAINDER, default=[], help="train: more distill flags")
    ap.add_argument("--draft", help="measure: the trained drafter's folder")
    ap.add_argument("--k", type=int, default=4, help="measure: --k for the served drafter (the engine's default 4)")
    ap.add_argument("--no-dynamic-k", action="store_true")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    result = {"capture": cmd_capture, "train": cmd_train, "measure": cmd_measure}[args.phase](args, workdir)
    result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                      text=True).stdout.strip()
    result["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    name = f"{args.phase}{'-' + Path(args.draft).name if args.draft else ''}" \
           f"{'-' + args.method + args.tag if args.phase == 'train' else ''}.json"
    (workdir / name).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("before", "after")}, indent=2))
    for key in ("before", "after"):
        if key in result:
            print(key, json.dumps({k: v for k, v in result[key].items() if k != "rows"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
