"""`python -m specpair.vllm_companion_bench`: what the pod's companion costs in front of vLLM.

One real vLLM server (its own virtualenv, a local model directory, n-gram speculation, the
per-request flags a pod's vLLM runs with) and one companion process in front of it. An open-loop
client sends short streamed completions at a fixed rate, in alternating phases straight to vLLM
and through the companion (so drift in the machine's load falls on both arms alike), and times
each request's first streamed event and its end. The companion's CPU is read from /proc (its
user + system time over each of its phases), vLLM's likewise (its process group).

    python -m specpair.vllm_companion_bench --model DIR --rate 20 --seconds 20 --json out.json

`--front both` runs a companion for each HTTP front (the compiled vllm_front.c, the Python
vllm_front), their phases alternated with the direct arm's in each round.

The target (issue 53): <= 2 ms added at p50, <= 5% of a core at 200 requests/s. Where vLLM
cannot serve 200 requests/s (a CPU box), the CPU figure is the companion's CPU per request,
measured at the rate given (CPU seconds over requests served), times 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TARGET_RATE = 200.0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (and its reaped children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _group_cpu_seconds(pgid: int) -> float:
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    total += sum(int(x) for x in fields[11:13]) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, IndexError):
                continue
    return total


async def _one(session: Any, url: str, model: str, max_tokens: int, prompt: str) -> tuple[float, float] | None:
    started = time.perf_counter()
    first = None
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "specpair": {"category": "bench"}}
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return None
            async for _chunk in resp.content.iter_any():
                if first is None:
                    first = time.perf_counter()
    except Exception:     # noqa: BLE001 - a failed request is counted, not raised
        return None
    end = time.perf_counter()
    return ((first or end) - started, end - started)


async def _phase(base: str, model: str, rate: float, seconds: float, max_tokens: int) -> dict[str, Any]:
    import aiohttp

    prompts = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over", "import os\nimport json\n"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks, t0 = [], time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, f"{base}/v1/completions", model, max_tokens,
                                                  prompts[i % len(prompts)])))
        done = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [d for d in done if d is not None]
    return {"sent": n, "ok": len(ok), "wall_s": wall, "first": [d[0] for d in ok], "end": [d[1] for d in ok]}


# vLLM 0.32's stream of a short completion, event by event (captured from a real server): what the
# --replay upstream sends, so the companion's own cost is measured at a rate no CPU vLLM reaches.
_TOKEN_EVENT = (b'data: {"id":"cmpl-9e2f","object":"text_completion","created":1796558678,"model":"peer",'
                b'"choices":[{"index":0,"text":"V","logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"token_ids":null}]}\n\n')
_USAGE_EVENT = (b'data: {"id":"cmpl-9e2f","object":"text_completion","created":1796558678,"model":"peer",'
                b'"choices":[],"usage":{"prompt_tokens":43,"total_tokens":51,"completion_tokens":8},'
                b'"metrics":{"time_to_first_token_ms":2.4,"queue_time_ms":0.05,"mean_itl_ms":1.5,'
                b'"speculative_decoding":{"mean_acceptance_length":1.5,"draft_acceptance_rate":0.25,'
                b'"acceptance_histogram":[2,1,1,0,0],"num_spec_steps":4,"num_accepted_draft_tokens":3,'
                b'"num_draft_tokens":12,"num_spec_tokens":4}}}\n\n')


def serve_replay(port: int, tokens: int = 8, gap_ms: float = 0.0, uds: str | None = None,
                 steps: bool = False) -> None:
    """An HTTP server answering /v1/completions with vLLM's stream of `tokens` events (and its usage
    chunk where asked for): at once, or each event `gap_ms` after the last, as vLLM writes one
    event a decoding step (then the companion relays each on its own); /health 200. `steps`: the
    gaps are one clock's for all streams, as vLLM's engine steps every running request together
    (each step's events of all streams are written at once); else each stream's own."""
    from aiohttp import web

    clock: dict[str, asyncio.Future] = {}

    async def step_clock(app: web.Application) -> Any:
        loop = asyncio.get_running_loop()
        clock["step"] = loop.create_future()

        async def tick() -> None:
            while True:
                await asyncio.sleep(gap_ms / 1000)
                step, clock["step"] = clock["step"], loop.create_future()
                step.set_result(None)
        ticking = loop.create_task(tick())
        yield
        ticking.cancel()

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for _ in range(int(body.get("max_tokens") or tokens)):
            if gap_ms:
                await (clock["step"] if steps else asyncio.sleep(gap_ms / 1000))
            await resp.write(_TOKEN_EVENT)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(_USAGE_EVENT)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")
    app = web.Application()
    if steps and gap_ms:
        app.cleanup_ctx.append(step_clock)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    # `uds`: also on a Unix socket, where a pod's companion reaches its vLLM.
    web.run_app(app, host="127.0.0.1", port=port, path=uds, access_log=None, print=None)


def _loop_name() -> str:
    """The event loop the companion runs (specpair.vllm_companion.new_event_loop's choice)."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class ReplayServer:
    """serve_replay in a process of its own, with VllmServer's attributes the benchmark reads."""
    served_model_name = "peer"

    def __init__(self, gap_ms: float = 0.0, uds: str | None = None, steps: bool = False):
        self.gap_ms, self.uds, self.steps = gap_ms, uds, steps

    def __enter__(self) -> "ReplayServer":
        import urllib.request

        from specpair.vllm_peer import free_port
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "specpair.vllm_companion_bench", "--model", "-",
                                      "--serve-replay", str(self.port),
                                      "--replay-gap-ms", str(self.gap_ms),
                                      *(["--replay-steps"] if self.steps else []),
                                      *(["--serve-replay-uds", self.uds] if self.uds else [])],
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.base_url}/health", timeout=2).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    from specpair.vllm_peer import VllmServer, default_python, free_port, speculative_config
    from specpair.vllm_serve import VLLM_PER_REQUEST_FLAGS, VLLM_SPEC_DECODE_FLAGS

    ap = argparse.ArgumentParser(prog="python -m specpair.vllm_companion_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local model directory vLLM serves")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second, each arm")
    ap.add_argument("--seconds", type=float, default=15.0, help="per phase")
    ap.add_argument("--rounds", type=int, default=2, help="direct/companion phase pairs")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--replay", action="store_true",
                    help="upstream: vLLM's captured stream replayed at once, not vLLM (the companion's own cost)")
    ap.add_argument("--replay-gap-ms", type=float, default=0.0,
                    help="--replay: milliseconds between the stream's events (vLLM's decoding steps); 0: at once")
    ap.add_argument("--replay-steps", action="store_true",
                    help="--replay with a gap: one step clock for all streams, as vLLM's engine steps every "
                         "running request together (a step's events of all streams come at once); else each "
                         "stream keeps its own gaps")
    ap.add_argument("--uds", action="store_true",
                    help="--replay: the companion reaches the upstream on a Unix socket, as in a pod (the "
                         "direct arm stays on TCP)")
    ap.add_argument("--front", choices=("c", "python", "both"), default="c",
                    help="the companion's HTTP front: the compiled one (vllm_front.c, the default where it "
                         "builds), the Python one, or both (two companions, their phases alternated with the "
                         "direct arm's)")
    ap.add_argument("--serve-replay", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-replay-uds", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_replay:
        serve_replay(args.serve_replay, gap_ms=args.replay_gap_ms, uds=args.serve_replay_uds, steps=args.replay_steps)
        return 0

    spec = speculative_config({"draft": {"drafter": "ngram"}, "speculation": {"k": 4}})
    import tempfile
    uds = os.path.join(tempfile.mkdtemp(prefix="specpair-bench-"), "vllm.sock") if args.replay and args.uds else None
    server = (ReplayServer(args.replay_gap_ms, uds, args.replay_steps) if args.replay else
              VllmServer(args.vllm_python or default_python(), args.model, speculative=spec, start_timeout=600,
                         extra_args=[*VLLM_PER_REQUEST_FLAGS, *VLLM_SPEC_DECODE_FLAGS]))
    fronts = ("c", "python") if args.front == "both" else (args.front,)
    # The companion arm of each front: "companion" alone, else "companion_c" and "companion_python".
    arms = {front: "companion" if len(fronts) == 1 else f"companion_{front}" for front in fronts}
    results: dict[str, Any] = {"direct": [], **{arm: [] for arm in arms.values()}}
    with server:
        upstream = ["--uds", uds] if uds else ["--upstream", f"127.0.0.1:{server.port}"]
        companions: dict[str, tuple[subprocess.Popen, str]] = {}
        try:
            import urllib.request
            for front in fronts:
                port = free_port()
                proc = subprocess.Popen([sys.executable, "-m", "specpair.vllm_companion", *upstream,
                                         "--host", "127.0.0.1", "--port", str(port)],
                                        stdin=subprocess.DEVNULL, env={**os.environ, "SPECPAIR_COMPANION_FRONT": front})
                companions[arms[front]] = (proc, f"http://127.0.0.1:{port}")
                deadline = time.monotonic() + 60
                while True:
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.2)
            model = server.served_model_name
            # Warm every path (connections, vLLM's first batches).
            asyncio.run(_phase(server.base_url, model, min(args.rate, 5.0), 2.0, args.max_tokens))
            for _proc, base in companions.values():
                asyncio.run(_phase(base, model, min(args.rate, 5.0), 2.0, args.max_tokens))
            for _ in range(args.rounds):
                for arm, base in (("direct", server.base_url), *((a, b) for a, (_, b) in companions.items())):
                    watched = [p.pid for p, _ in companions.values()]
                    cpu0, vllm0 = [_cpu_seconds(pid) for pid in watched], _group_cpu_seconds(server.proc.pid)
                    # The arm's own companion (the direct arm: the first, idle, as before).
                    pid = companions[arm][0].pid if arm in companions else watched[0]
                    split0 = _cpu_split(pid)
                    phase = asyncio.run(_phase(base, model, args.rate, args.seconds, args.max_tokens))
                    phase["companion_cpu_s"] = _cpu_seconds(pid) - cpu0[watched.index(pid)]
                    phase["companion_user_s"], phase["companion_system_s"] = (
                        now - then for now, then in zip(_cpu_split(pid), split0))
                    phase["vllm_cpu_s"] = _group_cpu_seconds(server.proc.pid) - vllm0
                    results[arm].append(phase)
        finally:
            for proc, _ in companions.values():
                proc.terminate()
                proc.wait(30)
    summary: dict[str, Any] = {"upstream": "replay" if args.replay else "vllm",
                               "replay_gap_ms": args.replay_gap_ms if args.replay else None,
                               "replay_clock": ("steps" if args.replay_steps else "per stream") if args.replay else None,
                               "companion_upstream": "unix socket" if uds else "tcp",
                               "event_loop": _loop_name(), "front": args.front, "rate": args.rate, "seconds_per_phase": args.seconds, "rounds": args.rounds,
                               "max_tokens": args.max_tokens, "cpus": os.cpu_count(),
                               "load_average": os.getloadavg()}
    for arm, phases in results.items():
        first = [x for p in phases for x in p["first"]]
        end = [x for p in phases for x in p["end"]]
        wall = sum(p["wall_s"] for p in phases)
        summary[arm] = {"sent": sum(p["sent"] for p in phases), "ok": sum(p["ok"] for p in phases),
                        "first_event_p50_ms": 1000 * (_pct(first, 0.5) or 0), "first_event_p90_ms": 1000 * (_pct(first, 0.9) or 0),
                        "end_p50_ms": 1000 * (_pct(end, 0.5) or 0), "end_p90_ms": 1000 * (_pct(end, 0.9) or 0),
                        "companion_cpu_share": sum(p["companion_cpu_s"] for p in phases) / wall,
                        "vllm_cpu_share": sum(p["vllm_cpu_s"] for p in phases) / wall}
    for arm in arms.values():
        companion_arm = summary[arm]
        tail = arm[len("companion"):]       # "" or "_c" / "_python"
        # Per request served: a saturated companion (a busy box) stretches its phases' wall time, so
        # its CPU share understates what each request costs it.
        per_request = sum(p["companion_cpu_s"] for p in results[arm]) / max(companion_arm["ok"], 1)
        summary[f"added_first_event_p50_ms{tail}"] = (companion_arm["first_event_p50_ms"]
                                                      - summary["direct"]["first_event_p50_ms"])
        summary[f"added_end_p50_ms{tail}"] = companion_arm["end_p50_ms"] - summary["direct"]["end_p50_ms"]
        summary[f"companion_cpu_ms_per_request{tail}"] = 1000 * per_request
        # user (the companion's code: C and Python) and system (the kernel's: sockets, wake-ups)
        for part in ("user", "system"):
            summary[f"companion_{part}_ms_per_request{tail}"] = 1000 * sum(
                p[f"companion_{part}_s"] for p in results[arm]) / max(companion_arm["ok"], 1)
        summary[f"companion_cpu_share_at_200_rps{tail}"] = per_request * TARGET_RATE
    summary["per_phase_p50_end_ms"] = {arm: [round(1000 * statistics.median(p["end"]), 2) if p["end"] else None
                                             for p in phases] for arm, phases in results.items()}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
