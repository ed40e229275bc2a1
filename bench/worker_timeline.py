#!/usr/bin/env python
"""Where a loaded server's time goes, in-process: the shared-prefix chat load of
`http_load_bench.py --shared-prefix` handed straight to an EngineWorker (no HTTP, no client in the
way), step by step (EngineWorker.timeline), at several --max-batch-size settings alternated in one
process, so a busy machine's noise falls on each alike and the ratios mean something.

    python bench/worker_timeline.py --shared-prefix 1500 --max-new-tokens 64 --batch-sizes 8 0 \
        --rounds 2 --json /tmp/timeline.json
    python bench/worker_timeline.py --http ...     # the same through the HTTP front

Every run starts with the prefix cache emptied, so it prefills the shared system prompt cold once,
as the HTTP benchmark's load does, and every run's replies must be the first run's. Per run: wall time and tokens/s of the load, and the steps split
into those that prefilled (a row's uncached prompt positions) and those that only decoded, with
their rows, positions fed, k and seconds. With --steps the whole timeline is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_load_bench import WORDS, system_prompt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from specpair.openmp import serving_wait_default  # noqa: E402

# The OpenMP wait `specpair engine serve` runs with (unless one is given), set before torch loads:
# the in-process engine here is the served one (and bench/load_phase_cpu.py's, which imports this).
serving_wait_default()


def load_engine(target: str, extra: list[str]):
    """The engine as `specpair engine serve --target TARGET` loads it (its start-up threshold)."""
    from specpair.server.cli import add_engine_parser, load_engine as load

    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers())
    args = parser.parse_args(["engine", "serve", "--target", target, "--insecure", *extra])
    return load(args, None, progress=lambda m: print(m, flush=True))


def forget_prefixes(engine) -> None:
    """Empty the prefix cache (the paged pool's named blocks, or the copying store)."""
    space = getattr(engine, "paged_space", None)
    if space is not None:
        space.pool.evict_to(0)
    elif engine.prefix_store is not None:      # a fresh store of the same size
        store = engine.prefix_store
        engine.prefix_store = type(store)(store.capacity, store.block)


# -- where the threads' wall time went: running, waiting for a core, asleep ------------------------

def thread_clocks(pid: int | None = None) -> dict:
    """Each thread of the process (and each child process, keyed "child PID"): (seconds it ran on
    a CPU, seconds it was runnable but waited for one, voluntary context switches: the times it
    went to sleep, e.g. an OpenMP thread whose spin at a barrier ran out), from /proc."""
    pid = pid or os.getpid()
    out, children = {}, set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            ran, waited, _ = map(int, Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split())
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            children |= set(Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except (OSError, ValueError):          # the thread ended while read
            continue
        sleeps = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        out[int(tid)] = (ran / 1e9, waited / 1e9, sleeps)
    tick = os.sysconf("SC_CLK_TCK")
    for child in children:
        try:
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[f"child {child}"] = ((int(fields[11]) + int(fields[12])) / tick, 0.0, 0)
    return out


class ThreadSampler:
    """thread_clocks every `every` seconds in a daemon thread, from start() to stop()."""

    def __init__(self, every: float = 0.2):
        self.every, self.samples, self._stop = every, [], threading.Event()
        self._thread = threading.Thread(target=self._run, name="thread-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.perf_counter(), thread_clocks()))
            if self._stop.wait(self.every):
                self.samples.append((time.perf_counter(), thread_clocks()))
                return

    def start(self) -> "ThreadSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def window(self, start: float, end: float) -> tuple[float, dict, dict]:
        """(seconds, the first sample at or after start, the last at or before end)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return 0.0, {}, {}
        return inside[-1][0] - inside[0][0], inside[0][1], inside[-1][1]


def thread_split(seconds: float, before: dict, after: dict, names: dict, steps: float) -> dict:
    """A window of `seconds` (`steps` steps long) split per step by group of threads: ms run,
    ms waiting for a core (others' work on the machine, or our own threads beside each other),
    ms asleep (the window less both: a thread with nothing to do, an OpenMP thread waiting at a
    barrier for its partner or for the serial Python between C calls, the engine thread waiting
    for the GIL) and the times it went to sleep. names: thread id -> group ("engine", "http",
    ...); a thread not named that ran is "kernel pool N" (OpenMP threads, busiest first, each
    apart); a child process is
    "client" (its CPU only). Threads that ran under 1% of the busiest one's time are left out."""
    groups: dict[str, list] = {}
    ran_by = {tid: ran - before.get(tid, (0.0,))[0] for tid, (ran, _, _) in after.items()}
    busiest = max(ran_by.values(), default=0.0)
    # Threads not named, busiest first, each apart: the kernel pool's worker beside any other
    # OpenMP team's (one per thread that ran a parallel region), which is mostly asleep.
    unnamed = sorted((tid for tid in after if not isinstance(tid, str) and tid not in names),
                     key=lambda tid: -ran_by[tid])
    for tid, (ran, waited, sleeps) in after.items():
        ran0, waited0, sleeps0 = before.get(tid, (0.0, 0.0, 0))
        ran, waited = ran - ran0, waited - waited0
        if ran <= 0.01 * busiest:         # a thread that barely ran (a monitor, an idle thread)
            continue
        child = isinstance(tid, str)
        group = ("client" if child else names[tid] if tid in names
                 else f"kernel pool {unnamed.index(tid) + 1}")
        g = groups.setdefault(group, [0, 0.0, 0.0, 0.0, 0])
        g[0] += 1
        g[1] += ran
        if not child:
            g[2] += waited
            g[3] += seconds - ran - waited
            g[4] += sleeps - sleeps0
    per = 1e3 / steps
    return {group: {"threads": n, "run_ms": round(ran * per, 1), "wait_for_core_ms": round(waited * per, 1),
                    "asleep_ms": round(asleep * per, 1), "sleeps": round(sleeps * per / 1e3, 1)}
            for group, (n, ran, waited, asleep, sleeps) in sorted(groups.items())}


def thread_names(worker) -> dict:
    """Thread id -> group for the threads a served engine runs by name (the engine's own)."""
    known = {"specpair-http": "http", "specpair-grpc": "grpc", "thread-sampler": "sampler"}
    out = {}
    main = Path("/proc/self/comm").read_text().strip()
    for tid in os.listdir("/proc/self/task"):       # threads C libraries named (gRPC's core)
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        if comm != main:                 # the OpenMP threads keep the process's name
            out[int(tid)] = comm
    out.update({t.native_id: known.get(t.name, t.name) for t in threading.enumerate()})
    if worker._thread is not None:
        out[worker._thread.native_id] = "engine"
    return out


# The HTTP load's client, in a process of its own (as http_load_bench.py runs it): one thread per
# chat, streamed with the official openai client; prints each reply's token count and text.
HTTP_CLIENT = r"""
import json, sys, threading
sys.path.insert(0, sys.argv[1])
import openai
from http_load_bench import chat_request
base_url, system, max_new, questions = sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=1800)
model = client.models.list().data[0].id
out = [None] * len(questions)
def send(i):
    out[i] = chat_request(client, model, system, questions[i], max_new)
threads = [threading.Thread(target=send, args=(i,)) for i in range(len(questions))]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps([[r["tokens"], r["text"], r["ttft"]] for r in out]))
"""


def run_http_load(engine, max_batch_size: int, system: str, questions: list[str],
                  max_new_tokens: int) -> dict:
    """The same load through the OpenAI HTTP front of an in-process server (its worker's
    timeline read here), from a client process of its own."""
    from specpair.server.app import EngineServer, ServerOptions

    server = EngineServer(lambda: engine, ServerOptions(port=0, http_port=0, max_queue=len(questions),
                                                        max_batch_size=max_batch_size or None),
                          progress=lambda _m: None)
    server.start(wait_ready=True, timeout=600)
    if server.phase != "serving":
        raise SystemExit(f"server did not start: {server.error}")
    server.worker.timeline = deque(maxlen=100_000)
    sampler = ThreadSampler().start()
    try:
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", HTTP_CLIENT, str(Path(__file__).resolve().parent),
                               f"http://127.0.0.1:{server.http_port}/v1", system, str(max_new_tokens),
                               json.dumps(questions)], capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - started
        if proc.returncode:
            raise SystemExit(f"the HTTP client failed: {proc.stderr[-2000:]}")
        replies = json.loads(proc.stdout)
        sampler.stop()
        return figures(server.worker, max_batch_size, started, wall, [r[0] for r in replies], [r[2] for r in replies],
                       [r[1] for r in replies], sampler, thread_names(server.worker))
    finally:
        sampler.stop()
        server.stop(drain_timeout=5)


def run_load(engine, max_batch_size: int, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """All prompts submitted at once to a fresh worker; -> figures, replies and the timeline."""
    from specpair.config import GenerationParams
    from specpair.server.worker import EngineWorker, Failed, Finished, Job

    worker = EngineWorker(engine, max_batch_size=max_batch_size or None, max_queue=len(prompts),
                          timeline=100_000)
    worker.warm_up(prompts[0][:8])
    worker.start()
    sampler = ThreadSampler().start()
    done = threading.Semaphore(0)
    finished: dict[int, object] = {}

    def sink_for(i: int):
        def sink(event):
            if isinstance(event, (Finished, Failed)):
                finished[i] = event
                done.release()
        return sink
    started = time.perf_counter()
    for i, ids in enumerate(prompts):
        worker.submit(Job(prompt_ids=ids, params=GenerationParams(max_new_tokens=max_new_tokens),
                          sink=sink_for(i)))
    for _ in prompts:
        if not done.acquire(timeout=3600):
            raise SystemExit("the load did not finish in an hour")
    wall = time.perf_counter() - started
    sampler.stop()
    names = thread_names(worker)
    worker.stop()
    failed = [e.message for e in finished.values() if isinstance(e, Failed)]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed: {failed[0]}")
    events = [finished[i] for i in range(len(prompts))]
    return figures(worker, max_batch_size, started, wall, [e.completion_tokens for e in events],
                   [e.time_to_first_token for e in events], [e.token_ids for e in events], sampler, names)


def figures(worker, setting: int, started: float, wall: float, tokens_each: list[int], ttfts: list[float],
            replies: list, sampler: ThreadSampler | None = None, names: dict | None = None) -> dict:
    """A run's figures from its worker's timeline (with a sampler, also where the threads' wall
    time went over the decode phase: decode-only steps at the widest batch, first to last)."""
    steps = [r for r in worker.timeline if r.started >= started]
    tokens = sum(tokens_each)

    def part(records) -> dict:
        seconds = sum(r.seconds for r in records)
        cpu = sum(r.cpu for r in records)
        return {"steps": len(records), "seconds": round(seconds, 2),
                # CPU seconds of the process and of the worker thread over these steps: their
                # ratio to the wall time is the cores the steps had (2 at best on 2 cores).
                "cpu_seconds": round(cpu, 2), "thread_cpu_seconds": round(sum(r.thread_cpu for r in records), 2),
                "cores_used": round(cpu / seconds, 2) if seconds else None,
                "mean_rows": round(sum(r.rows for r in records) / len(records), 1) if records else 0,
                "fed": sum(r.fed for r in records), "emitted": sum(r.emitted for r in records),
                "max_k": max((r.k for r in records), default=0),
                "ms_per_step": round(1e3 * seconds / len(records), 1) if records else None}
    prefill = [r for r in steps if r.fed > r.rows]       # more than each row's one new token
    decode = [r for r in steps if r.fed <= r.rows]
    stepped = sum(r.seconds for r in steps)
    threads = None
    widest = max((r.rows for r in decode), default=0)
    full = [r for r in decode if r.rows == widest]
    if sampler is not None and full:
        seconds, before, after = sampler.window(full[0].started, full[-1].started + full[-1].seconds)
        if seconds:
            per_step = seconds / sum(r.seconds for r in full) * len(full)    # steps the samples span
            threads = {"rows": widest, "ms_per_step": round(1e3 * seconds / per_step, 1),
                       "by_thread": thread_split(seconds, before, after, names or {}, per_step)}
    # The first-token phase: the steps until every request had its first token, which of them
    # held requests back for a running row's prompt blocks (Batch.prefix_pending), and when the
    # first tokens came (a shared prompt's cold prefill, then its joiners' suffixes).
    firsts, reached = 0, None
    for n, r in enumerate(steps):
        firsts += r.first
        if reached is None and firsts >= len(tokens_each):
            reached = n + 1
    first_phase = {"steps_until_all_emitted": reached,
                   "seconds_until_all_emitted": round(sum(r.seconds for r in steps[:reached or 0]), 2),
                   "cpu_seconds_until_all_emitted": round(sum(r.cpu for r in steps[:reached or 0]), 2),
                   "steps_holding_requests": sum(1 for r in steps if r.held),
                   "first_tokens_by_step": [[n, r.first, r.rows, r.fed] for n, r in enumerate(steps[:reached or 0])
                                            if r.first]}
    return {"max_batch_size": setting or f"default ({worker.max_batch_size} admitted, "
                                         f"{worker.decode_rows} decoded)",
            "decode_rows": worker.decode_rows,
            "wall_seconds": round(wall, 2), "tokens": tokens, "tokens_per_second": round(tokens / wall, 2),
            "stepping_seconds": round(stepped, 2), "between_steps_seconds": round(wall - stepped, 2),
            "idle_seconds": round(sum(r.waited for r in steps), 2),
            "mean_ttft": round(sum(ttfts) / len(ttfts), 2),
            "prefill_steps": part(prefill), "decode_steps": part(decode),
            "load_average": round(os.getloadavg()[0], 1),
            "decode_phase_threads": threads,
            "first_token_phase": first_phase,
            "_replies": replies,
            "_steps": [{"t": round(r.started - started, 3), "ms": round(1e3 * r.seconds, 1), "rows": r.rows,
                        "joined": r.joined, "held": r.held, "first": r.first, "fed": r.fed, "k": r.k,
                        "emitted": r.emitted,
                        "cpu_ms": round(1e3 * r.cpu, 1)} for r in steps]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--shared-prefix", type=int, default=1500, metavar="TOKENS")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 0],
                        help="--max-batch-size per run (0: the server's default)")
    parser.add_argument("--rounds", type=int, default=1, help="each setting this many times, alternated")
    parser.add_argument("--serve-flag", action="append", default=[],
                        help="an extra `engine serve` flag for the engine (repeatable, e.g. --serve-flag=--no-spec)")
    parser.add_argument("--http", action="store_true",
                        help="through the OpenAI HTTP front of an in-process server, from a client process")
    parser.add_argument("--steps", action="store_true", help="print every step")
    parser.add_argument("--json")
    args = parser.parse_args()

    engine = load_engine(args.target, args.serve_flag)
    questions = [f"Request {i}: which {WORDS[i % len(WORDS)]} setting matters most, and why?"
                 for i in range(args.concurrency)]
    runs = []
    order = []
    for n in range(args.rounds):         # 8 0, 0 8, 8 0, ...: each setting first as often
        order += args.batch_sizes if n % 2 == 0 else list(reversed(args.batch_sizes))
    system = system_prompt(args.shared_prefix)
    prompts = [engine.encode([{"role": "system", "content": system}, {"role": "user", "content": q}],
                             chat=True) for q in questions]
    for n, batch in enumerate(order):
        forget_prefixes(engine)
        run = (run_http_load(engine, batch, system, questions, args.max_new_tokens) if args.http
               else run_load(engine, batch, prompts, args.max_new_tokens))
        run["run"] = n
        runs.append(run)
        print(f"run {n}, batch {run['max_batch_size']}: {run['tokens_per_second']:.1f} tok/s, wall "
              f"{run['wall_seconds']:.1f} s (stepping {run['stepping_seconds']:.1f} s), prefill steps "
              f"{json.dumps(run['prefill_steps'])}, decode steps {json.dumps(run['decode_steps'])}, "
              f"load {run['load_average']}", flush=True)
        print(f"    first tokens: {json.dumps(run['first_token_phase'])} (per step: [step, first tokens, "
              f"rows, positions uncached])", flush=True)
        if run["decode_phase_threads"]:
            print(f"    per decode step at {run['decode_phase_threads']['rows']} rows, where each thread's wall went: "
                  f"{json.dumps(run['decode_phase_threads'])}", flush=True)
        if args.steps:
            for s in run["_steps"]:
                print("   ", json.dumps(s))
    by_setting: dict[str, list] = {}
    for run in runs:
        by_setting.setdefault(str(run["max_batch_size"]), []).append(run)
    same = all(run["_replies"] == runs[0]["_replies"] for run in runs)
    summary = {name: round(sum(r["tokens_per_second"] for r in rs) / len(rs), 2) for name, rs in by_setting.items()}
    print("mean tokens/s by setting:", json.dumps(summary), "| replies equal across runs:", same)
    if args.json:
        for run in runs:
            run.pop("_replies")
        Path(args.json).write_text(json.dumps({
            "target": args.target, "shared_prefix": args.shared_prefix, "concurrency": args.concurrency,
            "max_new_tokens": args.max_new_tokens, "cpu_count": os.cpu_count(),
            "threshold": engine.config.batch_size_threshold, "mean_tokens_per_second": summary,
            "replies_equal_across_runs": same, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
