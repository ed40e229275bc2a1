"""What the server tests build and call: engines over the tiny pair (optionally paced so a request
is still running when a test acts), clients for a running server (gRPC and the official `openai`
client), the target-only reference reply, and waiting that fails the test on timeout."""

from __future__ import annotations

import contextlib
import inspect
import threading
import time

import grpc
import pytest

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import Batch, SpeculativeEngine
from specpair.server.app import EngineServer, ServerOptions
from specpair.server.client import EngineClient
from specpair.server.requests import Limits
from waiting import wait_until


class PacedBatch(Batch):
    """A real Batch whose steps take at least the engine's `step_delay` seconds and that records
    its peak size.

    Timing tests (cancel, deadline, queue full, drain) need a request that is still running when
    the test acts; tiny models finish hundreds of tokens in well under a second. The delay is read
    at every step, so a test may run unpaced (step_delay 0) where it only needs the replies.
    """

    def __init__(self, engine, peaks: list[int]):
        super().__init__(engine)
        self.paced_engine, self.peaks = engine, peaks

    def step(self):
        self.peaks.append(self.active)
        if self.paced_engine.step_delay:
            time.sleep(self.paced_engine.step_delay)
        return super().step()


def make_engine(tiny_pair, *, draft: bool = True, speculation: SpeculationConfig | None = None,
                delay: float = 0.0, peaks: list | None = None) -> SpeculativeEngine:
    target, draft_model = tiny_pair
    engine = SpeculativeEngine(target, draft=draft_model if draft else None, speculation=speculation)
    if delay or peaks is not None:
        recorded = peaks if peaks is not None else []
        engine.step_delay = delay
        engine.new_batch = lambda: PacedBatch(engine, recorded)
    return engine


class FailingBatch(Batch):
    """A real Batch whose next step with requests in it raises once its engine's `fail_next` is
    set (then clears it): a device falling over mid-batch, for the server's failure paths (that
    batch fails, the next request is served). Read at every step, as PacedBatch's delay is."""

    def step(self):
        if self.engine.fail_next and self.active:
            self.engine.fail_next = False
            raise RuntimeError("device fell over")
        return super().step()


def failing_engine(tiny_pair) -> SpeculativeEngine:
    engine = make_engine(tiny_pair)
    engine.fail_next = False
    engine.new_batch = lambda: FailingBatch(engine)
    return engine


@contextlib.contextmanager
def tiny_server(tiny_pair, **options):
    """A real server of `tiny_pair` on 127.0.0.1 (the ports the OS picks), ready, for a module's
    tests to share; `options` are ServerOptions fields over these defaults."""
    engine = make_engine(tiny_pair)
    options = {"port": 0, "metrics_port": 0, "pair": "tiny", "version": "1", "max_batch_size": 8,
               "limits": Limits(max_request_bytes=64 * 1024, max_new_tokens=256), **options}
    server = EngineServer(lambda: engine, ServerOptions(**options), progress=lambda _m: None)
    server.start(wait_ready=True, timeout=60)
    try:
        yield server
    finally:
        server.stop(drain_timeout=1.0)


def client_for(server, **options) -> EngineClient:
    options.setdefault("insecure", True)
    return EngineClient(f"127.0.0.1:{server.port}", **options)


def reference(tiny_pair, prompt, max_new_tokens: int, chat: bool = False):
    """Single-request, target-only greedy decoding: what every served greedy reply must equal."""
    target, _ = tiny_pair
    engine = SpeculativeEngine(target)
    return engine.generate([prompt], GenerationParams(max_new_tokens=max_new_tokens), chat=chat,
                           speculate=False)[0]


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.02):
    """waiting.wait_until for a server in this process: looked at often, the condition named by
    its source line (a lambda) or its name. The deadline is a minute: a condition that holds is
    seen at once, and on CI's loaded cores (load 5-15) a worker's next step or a gRPC thread's
    unwinding can take seconds (this was 5 s, and 2 s in places)."""
    try:
        what = inspect.getsource(predicate).strip() if predicate.__name__ == "<lambda>" else predicate.__qualname__
    except (AttributeError, OSError, TypeError):
        what = repr(predicate)
    return wait_until(what, predicate, timeout, interval)


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
