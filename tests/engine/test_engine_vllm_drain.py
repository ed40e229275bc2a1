"""A vLLM pod going away loses no request (issue 53): the companion (specpair.vllm_companion)
refuses what arrives once it drains with 503 and Retry-After, lets what is in flight finish, then
says it has drained (a marker beside vLLM's socket); vLLM's supervisor (specpair.vllm_serve.
supervise) sends vLLM its SIGTERM only then; a stream vLLM closes before its first event reaches
the client as the same 503, never as an empty 200.

The upstream here is a small aiohttp server speaking vLLM's streaming shape (the part under test
is the companion; it meets real vLLM in tests/engine/test_engine_vllm_peer.py and in a pod in
tests/operator/test_operator_vllm.py), and vLLM's place under the supervisor is taken by a Python
that writes down when its SIGTERM came."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from specpair.contract import DEFAULT_CATEGORY
from specpair.vllm_companion import RETRY_AFTER_SECONDS, Companion, CompanionOptions
from specpair.vllm_serve import drained_marker

@pytest.fixture(params=["c", "python"], autouse=True)
def front(request, monkeypatch):
    """Every test here runs with each of the companion's HTTP fronts (vllm_front_native: the
    compiled one, the default; the Python one)."""
    monkeypatch.setenv("SPECPAIR_COMPANION_FRONT", request.param)
    return request.param


EVENT = b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
LAST = b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"y","finish_reason":"length"}]}\n\n'
DONE = b"data: [DONE]\n\n"


class Upstream:
    """An HTTP server in a thread: /v1/completions streams `events` (each after `gap` seconds),
    or closes a 200 stream at once when the prompt is "close"."""

    def __init__(self, gap: float = 0.0):
        self.gap = gap
        self.port: int | None = None
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait(30)

    def _run(self, started: threading.Event) -> None:
        from aiohttp import web

        async def completions(request):
            body = await request.json()
            resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if body.get("prompt") == "close":
                return resp                      # 200, then the stream ends before any event
            if body.get("prompt") == "done-only":
                await resp.write(DONE)
                return resp
            for event in (EVENT, EVENT, LAST, DONE):
                await asyncio.sleep(self.gap)
                await resp.write(event)
            return resp

        async def open_() -> None:
            app = web.Application()
            app.router.add_post("/v1/completions", completions)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(open_())
        started.set()
        self._loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)


def post(port: int, prompt: str, stream: bool = True) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 3, "stream": stream}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture
def companion_for(tmp_path, front):
    made: list[tuple[Upstream, Companion]] = []

    def make(gap: float = 0.0, stop_delay: float = 0.0) -> Companion:
        upstream = Upstream(gap)
        companion = Companion(CompanionOptions(upstream=f"127.0.0.1:{upstream.port}", port=0, drain_timeout=30,
                                               stop_delay=stop_delay,
                                               drained_marker=str(tmp_path / "companion-drained"))).start()
        assert companion.front == front     # the compiled front built and serves where asked
        made.append((upstream, companion))
        return companion
    yield make
    for upstream, companion in made:
        companion.stop(drain=False)
        upstream.close()


def test_a_stream_closed_before_its_first_event_is_refused_as_unstarted_not_an_empty_200(companion_for):
    companion = companion_for()
    status, headers, body = post(companion.port, "close")
    assert status == 503 and headers["Retry-After"] == str(RETRY_AFTER_SECONDS), (status, headers)
    assert json.loads(body)["error"]["type"] == "service_unavailable"
    # [DONE] alone carries no reply either.
    assert post(companion.port, "done-only")[0] == 503
    # A whole stream still passes through as it came, its 200 sent with the first event.
    status, headers, body = post(companion.port, "hello")
    assert status == 200 and body == EVENT + EVENT + LAST + DONE
    # The outcome is counted as the handler ends, which may be just after the client has the body.
    from waiting import wait_until

    def counts():
        return {c: dict(got["requests"]) for c, got in companion.tally.metrics.serving_counts().items()}
    wait_until("the three outcomes counted", lambda: counts() == {DEFAULT_CATEGORY: {"unavailable": 2, "ok": 1}},
               timeout=60, show=counts)


def test_draining_refuses_new_requests_with_retry_after_finishes_those_in_flight_then_marks_itself(companion_for,
                                                                                                    tmp_path):
    marker = tmp_path / "companion-drained"
    marker.write_text("left by an earlier life\n")
    companion = companion_for(gap=0.5)
    assert companion.options.drained_marker == str(marker)
    assert not marker.exists()                   # a new companion removes a stale marker
    got: dict[str, object] = {}
    flight = threading.Thread(target=lambda: got.setdefault("in_flight", post(companion.port, "long")))
    flight.start()
    deadline = time.monotonic() + 30
    while companion.in_flight < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    draining = asyncio.run_coroutine_threadsafe(companion.drain(), companion._loop)
    deadline = time.monotonic() + 30
    while not companion.draining and time.monotonic() < deadline:
        time.sleep(0.01)
    status, headers, _ = post(companion.port, "new")
    assert status == 503 and headers["Retry-After"] == str(RETRY_AFTER_SECONDS)
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(f"http://127.0.0.1:{companion.port}/health", timeout=10)
    assert health.value.code == 503
    assert not marker.exists()                   # the stream is still in flight
    assert draining.result(60) == 0
    flight.join(30)
    assert got["in_flight"][0] == 200 and got["in_flight"][2].endswith(LAST + DONE)
    assert marker.read_text() == "0\n"


# vLLM's place under the supervisor: writes when its SIGTERM came, then exits as vLLM does.
CHILD = """
import signal, sys, time
out = sys.argv[1]
def stop(signum, frame):
    open(out, "a").write(f"sigterm {time.time()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(out, "a").write("started\\n")
while True:
    time.sleep(0.05)
"""

SUPERVISOR = """
import sys
from specpair.vllm_serve import supervise
sys.exit(supervise([sys.executable, "-c", sys.argv[1], sys.argv[2]], {}, sys.argv[3], float(sys.argv[4])))
"""


def supervised(tmp_path: Path, drain_wait: float) -> tuple[subprocess.Popen, Path, Path]:
    log, marker = tmp_path / "child.log", tmp_path / "companion-drained"
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, CHILD, str(log), str(marker), str(drain_wait)],
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not (log.exists() and "started" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.exists(), "the supervised child did not start"
    return proc, log, marker


def test_the_supervisor_holds_vllms_sigterm_until_the_companion_has_drained(tmp_path):
    proc, log, marker = supervised(tmp_path, drain_wait=60)
    # The node signals the container's process group (the devcluster) or its first process
    # (Kubernetes): neither reaches vLLM, in a session of its own.
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(1.0)
    assert "sigterm" not in log.read_text() and proc.poll() is None
    drained_at = time.time()
    marker.write_text("0\n")
    assert proc.wait(30) == 0
    sigterm = float(log.read_text().split("sigterm ")[1])
    assert sigterm >= drained_at


def test_without_a_drained_companion_the_supervisor_stops_vllm_after_its_bound(tmp_path):
    proc, log, marker = supervised(tmp_path, drain_wait=1.5)
    told = time.time()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0 and not marker.exists()
    sigterm = float(log.read_text().split("sigterm ")[1])
    assert sigterm - told >= 1.5


def test_told_to_stop_it_is_unready_at_once_but_serves_through_the_stop_delay(companion_for):
    """As our engine (rollout.shutdown.stopDelaySeconds): readiness fails at SIGTERM, and requests
    that still arrive while endpoints drop the pod are served; after the delay they are refused."""
    companion = companion_for(stop_delay=3.0)
    leaving = asyncio.run_coroutine_threadsafe(companion.leave(), companion._loop)
    deadline = time.monotonic() + 30
    while not companion.leaving and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(urllib.error.HTTPError) as health:
        urllib.request.urlopen(f"http://127.0.0.1:{companion.port}/health", timeout=10)
    assert health.value.code == 503
    status, _, body = post(companion.port, "within the delay")
    assert status == 200 and body.endswith(LAST + DONE) and not companion.draining
    assert leaving.result(60) == 0 and companion.draining
    assert post(companion.port, "after the delay")[0] == 503
    assert Path(companion.options.drained_marker).read_text() == "0\n"
