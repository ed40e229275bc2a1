#!/usr/bin/env python
"""Where a speculating server's target-only requests spend time that a target-only server's do
not: both servers (`load_bench.start_server`) take the same greedy requests without speculation
at concurrency 1, one after the other, each sampled by py-spy while they run; prints each
server's tokens/s and the frames whose samples differ most between the two (inclusive, per
thousand samples), and writes them (--out). A diagnostic; its figures are benchmark output.

    python bench/server_profile_ab.py --target DIR --device cuda --out out/server_ab.json
    python bench/server_profile_ab.py --random-smollm2 /tmp/smol --device cuda --out ...

--random-smollm2 DIR first writes a random-weight SmolLM2-135M shape there with the tests' tiny
tokenizer (ids past its 400 decode to nothing): a machine without the real model measures the
same step and loop.

Figures: docs/measurements/gpu_h100_10b6695_server_profile_ab.json; read in docs/gpu.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/: gpu_step_bench (the step builder) and load_bench (the HTTP load)
sys.path[:0] = [str(ROOT / "engine"), str(ROOT / "tests"), str(ROOT / "bench")]

FRAME = re.compile(r"(.*?) \((.*?):\d+\)")
RATE = 500      # py-spy samples a second


def frames_by_samples(raw: Path) -> tuple[int, collections.Counter]:
    """py-spy's raw output (one stack a line, then its sample count) -> total samples and the
    samples each function (name and file) appears in, once a stack."""
    total, inclusive = 0, collections.Counter()
    for line in raw.read_text().split("\n"):       # (not splitlines: frames may hold \x1c)
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        names = set()
        for frame in stack.split(";"):
            m = FRAME.match(frame)
            names.add(f"{m.group(1)} ({m.group(2).split('/')[-1]})" if m else frame)
        for name in names:
            inclusive[name] += n
    return total, inclusive


def write_random_smollm2(path: Path, device: str) -> str:
    import torch

    from gpu_step_bench import build
    from tiny_models import make_tokenizer
    model = build("smollm2-135m", torch.device(device), torch.bfloat16, real_smollm2=False)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--random-smollm2", metavar="DIR")
    ap.add_argument("--device")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not shutil.which("py-spy"):
        raise SystemExit("py-spy is not on PATH (pip install py-spy)")
    target = args.target or write_random_smollm2(Path(args.random_smollm2), args.device or "cpu")

    import load_bench
    from specpair.server.client import EngineClient

    server_args = argparse.Namespace(target=target, draft=None, device=args.device,
                                     concurrency=[1], k=4)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"target": target, "device": args.device, "requests": args.requests, "servers": {}}
    samples = {}
    for name, plain in (("speculating", False), ("target-only", True)):
        server, address = load_bench.start_server(server_args, threshold=8, plain=plain)
        try:
            client = EngineClient(address, insecure=True)
            load_bench.run_level(client, 1, 8, args.max_new_tokens, speculate=False)   # warm
            raw = out.with_name(f"{out.stem}_{name}.txt")
            spy = subprocess.Popen(["py-spy", "record", "-p", str(server.pid), "-o", str(raw),
                                    "--format", "raw", "-r", str(RATE), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)
            level = load_bench.run_level(client, 1, args.requests, args.max_new_tokens,
                                         speculate=False)
            spy.send_signal(signal.SIGINT)
            _, err = spy.communicate(timeout=60)
            if not raw.exists():
                raise SystemExit(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
        finally:
            server.terminate()
            server.wait(timeout=60)
        level.pop("_token_ids", None)
        samples[name] = frames_by_samples(raw)
        report["servers"][name] = {**level, "samples": samples[name][0]}
        print(f"{name} server: {level['tokens_per_second']} tokens/s, p50 latency "
              f"{level['latency_p50']} s, {samples[name][0]} samples")
    # A sample is 1000 / RATE ms of one thread's time; per generated token, so the two servers'
    # runs compare whatever their lengths.
    a, b = samples["speculating"][1], samples["target-only"][1]
    ta, tb = (report["servers"][n]["output_tokens"] for n in ("speculating", "target-only"))
    ms = {k: (a[k] * 1000 / RATE / ta, b[k] * 1000 / RATE / tb) for k in set(a) | set(b)}
    ranked = sorted(ms.items(), key=lambda kv: -abs(kv[1][0] - kv[1][1]))[:args.top]
    report["ms_a_token_by_frame"] = [{"frame": k, "speculating": round(x, 4),
                                      "target_only": round(y, 4)} for k, (x, y) in ranked]
    print("ms a token (threads summed): speculating server, target-only server, frame")
    for k, (x, y) in ranked:
        print(f"{x:8.4f} {y:8.4f}  {k}")
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
