"""Soak: thousands of short requests through one server; memory stays flat, nothing is kept.

A server runs for weeks, so what one request leaves behind adds up. The figures (RSS after the
warm-up and after each part of the rest, sequences still alive) are printed; `pytest -s` shows
them. The number of live Sequence objects is the exact count; RSS is the figure an operator sees.

The server, its clients and the readings run in a child process of their own (soak()): RSS is the
whole process's, and a pytest worker holds what its earlier tests left running (a devcluster's
node agents, servers' threads), whose allocations and frees would be read as the server's (the
paged-memory test failed in CI reading its worker's RSS: 9c7280c)."""

import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from specpair.decoding import Sequence
from specpair.server.client import request

from serving_helpers import client_for, make_engine, wait_for

HERE = Path(__file__).resolve().parent

WARM_UP = 1000         # requests before the first RSS reading (allocator pools and caches fill)
SOAK = 2000            # requests measured, in PHASES parts
PHASES = 4
CLIENTS = 4
# Measured over the 2000 soak requests (2 busy cores): +0.8 MB; before finished requests were
# released, +6.9 MB in a steady climb (about 3.5 kB a request: the Sequence rows the batch kept).
MAX_GROWTH_MB = 3.0
PROMPTS = ["def foo(x):", "import os", "class Path:", "The quick brown fox", "return self",
           "for i in range(10):", "x = [1, 2, 3]", "hello world"]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_sequences() -> int:
    """Decoding rows still alive anywhere in the process (the scan briefly takes ~13 MB of RSS)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Sequence)


def settled_sequences(seconds: float = 10.0) -> tuple[int, str]:
    """Rows still alive once the last requests' threads have unwound: the worker is idle when the
    clients have their replies, but a gRPC thread may still be leaving a cancelled stream's
    handler (a CI run once counted one row there). A row still held after `seconds` is kept by
    something: its holders' types are returned, to name it."""
    deadline = time.monotonic() + seconds
    while (alive := live_sequences()) and time.monotonic() < deadline:
        time.sleep(0.5)
    held = [o for o in gc.get_objects() if type(o) is Sequence] if alive else []
    holders = sorted({type(r).__name__ for seq in held for r in gc.get_referrers(seq) if r is not held})
    return alive, ", ".join(holders)


def traffic(c, count: int, seed: int, errors: list) -> None:
    """Short requests of every kind a client sends: greedy, sampled, stop strings, cancelled."""
    rng = random.Random(seed)
    for i in range(count):
        options = dict(max_new_tokens=rng.randint(1, 6), category=rng.choice(["code", "qa", ""]))
        if rng.random() < 0.4:
            options.update(temperature=0.9, seed=rng.randint(0, 1000), top_p=rng.choice([1.0, 0.9]))
        if rng.random() < 0.3:
            options["stop"] = [rng.choice(["e", "(", "\n", "xyz"])]
        try:
            prompt = " ".join(rng.sample(PROMPTS, rng.randint(1, 8)))      # 3-40 tokens
            stream = c.stream(request(prompt, **options), timeout=30)
            if i % 50 == 49:
                next(stream)
                stream.cancel()
            else:
                assert list(stream)[-1].usage.completion_tokens >= 1
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                errors.append(exc)
        except StopIteration:
            pass


def run_traffic(server, total: int, seed: int) -> None:
    errors: list = []
    with client_for(server) as c:
        threads = [threading.Thread(target=traffic, args=(c, total // CLIENTS, seed + i, errors))
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert not errors, errors[:3]
    assert wait_for(lambda: server.worker.busy == 0, timeout=60)


def soak() -> dict:
    """The soak in this process: a tiny pair served as the server tests' `tiny_pair` and
    `start_server` fixtures serve it, on one torch thread (client threads, gRPC and the engine
    share this box's cores: a second intra-op thread only spins, measured 5x slower steps on a
    busy 2-core machine). Returns the readings."""
    from specpair.server.app import EngineServer, ServerOptions
    from tiny_models import make_model, make_tokenizer, perturbed_copy

    torch.set_num_threads(1)
    # The contiguous cache with its copying prefix store, whose bytes this soak subtracts to the
    # byte: a draft-model pair runs the paged pool by default since e2563ae, whose resident memory
    # after a burst is tested against the real server in test_server_memory.py.
    os.environ["SPECPAIR_PAGED"] = "off"
    target = make_model(make_tokenizer(), seed=11)
    engine = make_engine((target, perturbed_copy(target, seed=12, noise=0.03)))
    # The prefix store (prefix_cache.py) keeps prompts' blocks on purpose, up to its capacity: made
    # small enough that the warm-up fills it, the soak runs it at capacity, evicting, where RSS
    # must stay flat like everything else (its bytes are subtracted besides, to the byte).
    store = engine.prefix_store
    store.capacity = 8 << 20
    server = EngineServer(lambda: engine, ServerOptions(port=0, metrics_port=0, drain_timeout=5.0, pair="tiny",
                                                        version="1", max_batch_size=8, max_queue=64),
                          progress=lambda _m: None)
    server.start(wait_ready=True, timeout=600)
    try:
        started = time.monotonic()
        run_traffic(server, WARM_UP // 2, seed=0)
        live_before, _ = settled_sequences()
        run_traffic(server, WARM_UP // 2, seed=1)      # RSS settles after the scan in live_sequences()
        series, kept = [rss_mb()], [store.bytes / 2**20]
        for phase in range(PHASES):
            run_traffic(server, SOAK // PHASES, seed=100 * (phase + 1))
            series.append(rss_mb())
            kept.append(store.bytes / 2**20)
        live_after, holders = settled_sequences()      # after the last reading: the scan itself takes memory
        return {"seconds": time.monotonic() - started, "series": series, "kept": kept,
                "live_before": live_before, "live_after": live_after, "holders": holders,
                "store_bytes": store.bytes, "store_capacity": store.capacity, "evictions": store.evictions}
    finally:
        server.stop(drain_timeout=1.0)


@pytest.mark.slow
def test_soak_rss_is_flat_and_finished_requests_are_released():
    child = subprocess.run(
        [sys.executable, "-c", "import json, sys; sys.path[:0] = sys.argv[1:3]; import test_server_soak as t; "
                               "print('SOAK ' + json.dumps(t.soak()))", str(HERE), str(HERE.parent)],
        capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [line for line in child.stdout.splitlines() if line.startswith("SOAK ")]
    assert child.returncode == 0 and lines, (child.returncode, child.stdout[-3000:], child.stderr[-3000:])
    got = json.loads(lines[-1][len("SOAK "):])
    series, kept = got["series"], got["kept"]
    growth = (series[-1] - series[0]) - (kept[-1] - kept[0])
    assert got["store_bytes"] <= got["store_capacity"] and got["evictions"] > 0, got
    print(f"\nsoak: {WARM_UP} + {SOAK} requests in {got['seconds']:.0f} s; RSS after each {SOAK // PHASES}: "
          f"{' '.join(f'{v:.1f}' for v in series)} MB, the prefix store {kept[0]:.1f} -> {kept[-1]:.1f} MB "
          f"({growth:+.1f} MB beyond it); "
          f"sequences alive {got['live_before']} -> {got['live_after']}")
    assert growth < MAX_GROWTH_MB, f"RSS grew {growth:.1f} MB beyond the prefix store over {SOAK} requests: {got}"
    assert got["live_before"] == 0 and got["live_after"] == 0, got
