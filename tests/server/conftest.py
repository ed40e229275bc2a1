"""Fixtures for the gRPC server tests: real servers on 127.0.0.1 serving tiny seeded models."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/tiny_models.py

from tiny_models import make_model, make_tokenizer, perturbed_copy  # noqa: E402

from specpair.config import GenerationParams, SpeculationConfig  # noqa: E402
from specpair.decoding import Batch, SpeculativeEngine  # noqa: E402
from specpair.server.app import EngineServer, ServerOptions  # noqa: E402
from specpair.server.client import EngineClient  # noqa: E402
from specpair.server.requests import Limits  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair():
    tok = make_tokenizer()
    target = make_model(tok, seed=11)
    # Target weights plus noise: accepts some drafts, rejects others (cache cut-backs run).
    draft = perturbed_copy(target, seed=12, noise=0.03)
    return target, draft


class PacedBatch(Batch):
    """A real Batch whose steps take at least `delay` seconds and that records its peak size.

    Timing tests (cancel, deadline, queue full, drain) need a request that is still running when
    the test acts; tiny models finish hundreds of tokens in well under a second.
    """

    def __init__(self, engine, delay: float, peaks: list[int]):
        super().__init__(engine)
        self.delay, self.peaks = delay, peaks

    def step(self):
        self.peaks.append(self.active)
        if self.delay:
            time.sleep(self.delay)
        return super().step()


def make_engine(tiny_pair, *, draft: bool = True, speculation: SpeculationConfig | None = None,
                delay: float = 0.0, peaks: list | None = None) -> SpeculativeEngine:
    target, draft_model = tiny_pair
    engine = SpeculativeEngine(target, draft=draft_model if draft else None, speculation=speculation)
    if delay or peaks is not None:
        recorded = peaks if peaks is not None else []
        engine.new_batch = lambda: PacedBatch(engine, delay, recorded)
    return engine


@pytest.fixture
def start_server(tiny_pair):
    """start_server(engine=None, **ServerOptions fields) -> running EngineServer (stopped after)."""
    servers = []

    def start(engine=None, load=None, wait=True, **options):
        options.setdefault("port", 0)
        options.setdefault("metrics_port", 0)
        options.setdefault("drain_timeout", 5.0)
        options.setdefault("pair", "tiny")
        options.setdefault("version", "1")
        engine = engine or make_engine(tiny_pair)
        server = EngineServer(load or (lambda: engine), ServerOptions(**options), progress=lambda _m: None)
        servers.append(server)
        server.start(wait_ready=wait, timeout=60)
        return server

    yield start
    for server in servers:
        server.stop(drain_timeout=1.0)


@pytest.fixture(scope="module")
def shared_server(tiny_pair):
    """One server for the tests that need nothing special (saves start-up time)."""
    engine = make_engine(tiny_pair)
    server = EngineServer(lambda: engine, ServerOptions(port=0, metrics_port=0, pair="tiny", version="1",
                                                         max_batch_size=8, max_queue=32,
                                                         limits=Limits(max_request_bytes=64 * 1024,
                                                                       max_new_tokens=256)),
                          progress=lambda _m: None)
    server.start(wait_ready=True, timeout=60)
    yield server
    server.stop(drain_timeout=1.0)


def client_for(server, **options) -> EngineClient:
    options.setdefault("insecure", True)
    return EngineClient(f"127.0.0.1:{server.port}", **options)


@pytest.fixture
def client(shared_server):
    with client_for(shared_server) as c:
        yield c


def reference(tiny_pair, prompt, max_new_tokens: int, chat: bool = False):
    """Single-request, target-only greedy decoding: what every served greedy reply must equal."""
    target, _ = tiny_pair
    engine = SpeculativeEngine(target)
    return engine.generate([prompt], GenerationParams(max_new_tokens=max_new_tokens), chat=chat,
                           speculate=False)[0]


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02):
    """The first truthy value of predicate(); fails the test when none comes within timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    value = predicate()
    if not value:
        pytest.fail(f"timed out after {timeout:g} s waiting for {getattr(predicate, '__qualname__', predicate)}")
    return value


def openai_client(server, **options):
    """The official `openai` client for a server's HTTP front (no retries: a refusal is the answer)."""
    import openai
    options.setdefault("api_key", "none")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", max_retries=0, timeout=60, **options)


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def run_threads(targets) -> list:
    """Run callables at once (released together) and return their results or exceptions."""
    results = [None] * len(targets)
    barrier = threading.Barrier(len(targets))

    def run(i, fn):
        barrier.wait()
        try:
            results[i] = fn()
        except Exception as exc:   # returned, so the test can assert on it
            results[i] = exc
    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results
