#!/usr/bin/env python
"""Load benchmark for the engine server: throughput and latency at several concurrencies,
speculation on vs off, through real gRPC.

    python bench/load_bench.py                        # default pair (SmolLM2-135M + n-gram) on CPU
    python bench/load_bench.py --draft DIR --concurrency 1 4 --json out.json
    python bench/load_bench.py --address host:port    # an engine that is already running

It starts `specpair engine serve` as a subprocess (so client and server do not share a GIL), with
speculation allowed at every batch size measured (or up to each --batch-size-threshold, one server
each), then for each concurrency level sends the same greedy requests twice: once target-only
(per-request speculation off, in the same server: same step shapes, so replies equal bitwise) and
once speculating. --plain-server also measures a target-only server (--no-spec), the yardstick a
user compares against. Reported: output tokens/s over the level's wall time, p50/p95 end-to-end
latency and time to first token, mean acceptance, and whether the speculative replies equal the
target-only ones (they must).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engine"))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from specpair.server.client import EngineClient, collect, request  # noqa: E402

# Chat prompts of the kinds a pair is gated on; the n-gram drafter pays where replies copy the prompt.
PROMPTS = [
    ("summarisation", "Summarise in two sentences: The Python standard library contains modules for "
                      "file handling, networking, text processing and data compression. The json module "
                      "reads and writes JSON; the pathlib module represents file system paths as objects."),
    ("extraction", "List every function name in this code, one per line:\n"
                   "def load(path):\n    return open(path).read()\n\ndef save(path, text):\n"
                   "    open(path, 'w').write(text)\n\ndef exists(path):\n    return os.path.exists(path)"),
    ("code", "Write a Python function that returns the n-th Fibonacci number."),
    ("qa", "What is the capital of France, and what river runs through it?"),
    ("creative", "Write a short poem about the sea."),
    ("code", "Rewrite this with a list comprehension: result = []\nfor x in items:\n    if x > 0:\n"
             "        result.append(x * 2)"),
]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    index = (len(values) - 1) * q
    lo, hi = int(index), min(int(index) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (index - lo)


def run_level(client: EngineClient, concurrency: int, requests: int, max_new_tokens: int,
              speculate: bool) -> dict:
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    lock = threading.Lock()
    results: list[dict] = []
    next_job = iter(range(requests))

    def worker():
        while True:
            with lock:
                i = next(next_job, None)
            if i is None:
                return
            category, prompt = jobs[i]
            started = time.perf_counter()
            reply = collect(client.stream(request([{"role": "user", "content": prompt}],
                                                  max_new_tokens=max_new_tokens, category=category,
                                                  speculation_k=None if speculate else 0), timeout=600))
            ended = time.perf_counter()
            with lock:
                results.append({"i": i, "latency": ended - started, "tokens": len(reply.token_ids),
                                "ttft": reply.last.timings.time_to_first_token_seconds,
                                "drafted": reply.last.stats.num_draft_tokens,
                                "accepted": reply.last.stats.num_accepted_tokens,
                                "token_ids": reply.token_ids})

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    latencies = [r["latency"] for r in results]
    ttfts = [r["ttft"] for r in results]
    drafted = sum(r["drafted"] for r in results)
    return {
        "concurrency": concurrency, "speculation": speculate, "requests": len(results),
        "output_tokens": sum(r["tokens"] for r in results), "wall_seconds": round(wall, 3),
        "tokens_per_second": round(sum(r["tokens"] for r in results) / wall, 2),
        "latency_p50": round(percentile(latencies, 0.5), 3), "latency_p95": round(percentile(latencies, 0.95), 3),
        "ttft_p50": round(percentile(ttfts, 0.5), 3), "ttft_p95": round(percentile(ttfts, 0.95), 3),
        "acceptance_rate": round(sum(r["accepted"] for r in results) / drafted, 3) if drafted else None,
        "_token_ids": {r["i"]: r["token_ids"] for r in results},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, threshold: int | None = None, plain: bool = False
                 ) -> tuple[subprocess.Popen, str]:
    """`specpair engine serve` on a free port: speculating with speculation allowed up to
    `threshold` rows, or with `plain` a target-only server (--no-spec)."""
    port = free_port()
    cmd = [sys.executable, "-m", "specpair.server", "engine", "serve", "--target", args.target,
           "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1", "--insecure",
           "--max-batch-size", str(max(args.concurrency)), "--max-queue", "64"]
    if plain:
        cmd += ["--no-spec"]
    else:
        cmd += ["--batch-size-threshold", str(threshold), "--k", str(args.k)]
        cmd += ["--draft", args.draft] if args.draft else ["--drafter", "ngram"]
    if args.device:
        cmd += ["--device", args.device]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "engine") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server = subprocess.Popen(cmd, env=env)
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit("engine server exited while starting")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return server, address
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    server.kill()
    raise SystemExit("engine server did not become SERVING in 600 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", help="draft model (default: the n-gram drafter)")
    parser.add_argument("--address", help="use a running engine instead of starting one")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default: max(4, concurrency))")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--device")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--batch-size-threshold", type=int, nargs="+",
                        help="speculation allowed up to this many rows, one server each (default: "
                             "the highest concurrency, so 'on' measures what speculating costs or "
                             "gains at every level; the engine's own default switches it off past 8)")
    parser.add_argument("--plain-server", action="store_true",
                        help="also measure a target-only server (--no-spec) at every level: the "
                             "yardstick a user compares against, where 'off' is a request "
                             "without speculation inside the speculating server")
    args = parser.parse_args()

    if args.address:
        info, rows = measure(args, args.address, None)
    else:
        rows = []
        for threshold in args.batch_size_threshold or [max(args.concurrency)]:
            info, measured = serve_and_measure(args, threshold=threshold)
            rows += measured
        if args.plain_server:
            rows += serve_and_measure(args, plain=True)[1]
    result = {"target": info.target.source, "draft": info.draft.source or info.draft.kind,
              "device": info.target.device, "dtype": info.target.dtype, "k": args.k,
              "max_new_tokens": args.max_new_tokens, "cpu_count": os.cpu_count(), "rows": rows}
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def serve_and_measure(args, threshold: int | None = None, plain: bool = False):
    server, address = start_server(args, threshold, plain)
    try:
        return measure(args, address, threshold, plain)
    finally:
        server.terminate()
        server.wait(60)


def measure(args, address: str, threshold: int | None, plain: bool = False):
    """Each concurrency level through one server: target-only requests, then (unless `plain`)
    speculating ones, with their speedup and greedy identity against the target-only ones;
    -> (the server's model info, the rows)."""
    client = EngineClient(address, insecure=True)
    info = client.model_info()
    client.generate([{"role": "user", "content": "Hello"}], max_new_tokens=8)     # warm-up
    rows = []
    for c in args.concurrency:
        n = args.requests or max(4, c)
        off = run_level(client, c, n, args.max_new_tokens, speculate=False)
        off["server"] = "target-only" if plain else "speculating"
        off["batch_size_threshold"] = threshold
        line = (f"{off['server']:>11} threshold {threshold}, concurrency {c:>2}: off "
                f"{off['tokens_per_second']:7.1f} tok/s p50 {off['latency_p50']:.2f} s "
                f"p95 {off['latency_p95']:.2f} s")
        if plain:
            off.pop("_token_ids")
            rows.append(off)
            print(line, flush=True)
            continue
        on = run_level(client, c, n, args.max_new_tokens, speculate=True)
        on["server"], on["batch_size_threshold"] = off["server"], threshold
        same = sum(ids == off["_token_ids"].get(i) for i, ids in on["_token_ids"].items())
        on["greedy_identity"] = round(same / on["requests"], 3) if on["requests"] else None
        for row in (off, on):
            row.pop("_token_ids")
            rows.append(row)
        on["speedup"] = round(on["tokens_per_second"] / off["tokens_per_second"], 3)
        print(f"{line} | on {on['tokens_per_second']:7.1f} tok/s p50 {on['latency_p50']:.2f} s "
              f"p95 {on['latency_p95']:.2f} s acceptance {on['acceptance_rate']} "
              f"speedup {on['speedup']}x identity {on['greedy_identity']}", flush=True)
    client.close()
    return info, rows


def print_table(result: dict) -> None:
    print(f"\n{result['target']} + {result['draft']} on {result['device']} ({result['dtype']}), "
          f"k={result['k']}, {result['max_new_tokens']} new tokens, greedy, chat prompts")
    print("| server | threshold | concurrency | speculation | requests | tokens/s | p50 latency s "
          "| p95 latency s | p50 TTFT s | acceptance | speedup | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r.get('server', '-')} | {r.get('batch_size_threshold') or '-'} | "
              f"{r['concurrency']} | {'on' if r['speculation'] else 'off'} | {r['requests']} | "
              f"{r['tokens_per_second']} | {r['latency_p50']} | {r['latency_p95']} | {r['ttft_p50']} | "
              f"{r['acceptance_rate'] if r['acceptance_rate'] is not None else '-'} | "
              f"{r.get('speedup', '-')} | {r.get('greedy_identity', '-')} |")


if __name__ == "__main__":
    raise SystemExit(main())
