"""The release registry converges when MLflow wrote a request and its reply never came back.

A real `mlflow server` behind a forwarding HTTP proxy on loopback (below): every request reaches
the server and is written there; the reply the test picks is then lost (the proxy closes the
connection) or held past the client's timeout, as a slow, lock-bound MLflow does. The operator's
adapter must retry into the same end state as a registration nothing disturbed: one version, one
release run holding every parameter and its release file, one logged model, one event record.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

import pytest
from mlflow.entities import LoggedModelStatus

from specpair_operator.clients.registry import ReleaseRegistry
from specpair_operator.release import content as release
from specpair_operator.release.registry_contract import (PARAMS_PER_BATCH, TAG_EVENT_KEY, TAG_HASH, TAG_LOGGED_MODEL,
                                                         TAG_SHADOW_VERDICT, event_record, gate_experiment,
                                                         release_params)

# A release with more parameters than one log-batch takes (a category floor each), so its
# parameters go in two batches.
CATEGORIES = {f"cat{i:03d}": 0.5 for i in range(PARAMS_PER_BATCH + 20)}
SPEC = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "r1"}, "draft": {"drafter": "ngram"},
        "gating": {"thresholds": {"minCategoryAcceptance": CATEGORIES}}}
PROMPTS = [{"prompt": "def add(a, b):", "category": "cat000"}]
SHADOW = json.dumps({"result": "passed", "reason": "candidate as good",
                     "categories": {"cat000": {"candidateAlpha": 0.7, "championAlpha": 0.6, "requests": 12}}})


def is_write(method: str, path: str) -> bool:
    """MLflow's REST reads are GETs and POSTed searches; everything else writes."""
    return method != "GET" and "/search" not in path


class LosingProxy:
    """A forwarding HTTP proxy on 127.0.0.1 in front of a real server. Each request is sent to the
    server and answered there; for the writes `lose(n, path)` picks (n counts writes from 0) the reply
    does not reach the client: held `hold_s` (past the client's timeout), then the connection is
    closed without it."""

    def __init__(self, upstream: str):
        split = urlsplit(upstream)
        self.upstream = (split.hostname, split.port)
        self.lose: Callable[[int, str], bool] = lambda n, path: False
        self.hold_s = 0.0
        self.log: list[tuple[str, str, int, bool]] = []   # method, path, server's status, reply lost
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):   # quiet: the log list records what matters
                pass

            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection", "content-length", "keep-alive")}
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=300)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                finally:
                    conn.close()
                with proxy.lock:
                    writes = sum(1 for m, p, _, _ in proxy.log if is_write(m, p))
                    lost = is_write(self.command, self.path) and proxy.lose(writes, self.path)
                    proxy.log.append((self.command, self.path, reply.status, lost))
                self.close_connection = True
                if lost:
                    time.sleep(proxy.hold_s)
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(reply.status)
                for k, v in reply.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "keep-alive"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def writes(self) -> list[str]:
        return [f"{m} {p}" for m, p, _, _ in self.log if is_write(m, p)]

    def lost(self) -> list[str]:
        return [f"{m} {p}" for m, p, _, lost in self.log if lost]

    def reset(self, lose: Callable[[int, str], bool] = lambda n, path: False, hold_s: float = 0.0) -> None:
        with self.lock:
            self.log.clear()
            self.lose, self.hold_s = lose, hold_s

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(mlflow_server):
    p = LosingProxy(mlflow_server.url)
    yield p
    p.close()


def register(tracking_uri: str, model: str) -> tuple[dict, str, str]:
    """A pair's model and release, then a shadow verdict marked on it (an event with metrics)."""
    reg = ReleaseRegistry(tracking_uri)
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    digest = release.content_hash(rel)
    reg.ensure_model(model, "ns/p")
    version = reg.ensure_release(model, rel, digest)
    reg.set_tags(model, version, {TAG_SHADOW_VERDICT: SHADOW})
    return rel, digest, version


def assert_registered_once(reg: ReleaseRegistry, model: str, rel: dict, digest: str, version: str) -> None:
    """What an undisturbed registration leaves, read from the server itself (not the proxy)."""
    client = reg.client
    [mv] = client.search_model_versions(f"name='{model}'")
    assert str(mv.version) == version and mv.tags[TAG_HASH] == digest
    exp_id = client.get_experiment_by_name(gate_experiment(model)).experiment_id
    [run] = client.search_runs([exp_id], filter_string=f"tags.`{TAG_HASH}` = '{digest}'")
    assert mv.run_id == run.info.run_id and run.info.status == "FINISHED"
    assert run.data.params == release_params(rel) and len(run.data.params) > PARAMS_PER_BATCH
    assert json.load(open(client.download_artifacts(run.info.run_id, "release/release.json"))) == rel
    [logged] = client.search_logged_models(experiment_ids=[exp_id])
    assert logged.status == LoggedModelStatus.READY
    assert mv.source == f"models:/{logged.model_id}" and run.data.tags[TAG_LOGGED_MODEL] == logged.model_id
    event = event_record(TAG_SHADOW_VERDICT, SHADOW, version, mv.tags)
    [event_run] = client.search_runs([exp_id], filter_string=f"tags.`{TAG_EVENT_KEY}` = '{event.key}'")
    assert event_run.data.metrics == event.metrics and event_run.info.status == "FINISHED"
    assert (mv.description or "").count(f"/runs/{event_run.info.run_id})") == 1
    assert mv.tags[event.version_tag] == event.summary and mv.tags[TAG_SHADOW_VERDICT] == SHADOW


def test_unlogged_is_what_the_run_lacks_whatever_the_value_it_holds():
    from specpair_operator.release.registry_contract import unlogged

    assert unlogged({"a": "1", "b": "2", "c": "3"}, {"b": "2", "c": "old wording"}) == [("a", "1")]
    assert unlogged({"a": 1.0}, {"a": 1.0}) == []


def test_the_first_log_batch_timing_out_after_the_server_wrote_it_still_logs_every_parameter(
        reg, proxy, monkeypatch):
    """The first of two parameter batches is written and its reply held past the client's
    timeout: the retry must log the second batch too, and make nothing twice."""
    # The client's timeout for every request of the test: long enough for a loaded machine's
    # MLflow to answer the others, short of the held reply.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "8")
    batches = []

    def first_log_batch(n: int, path: str) -> bool:
        if path.endswith("/runs/log-batch"):
            batches.append(n)
        return batches == [n]
    proxy.reset(lose=first_log_batch, hold_s=10.0)
    model = f"m-{uuid.uuid4().hex[:6]}"
    rel, digest, version = register(proxy.url, model)
    assert proxy.lost() == ["POST /api/2.0/mlflow/runs/log-batch"], proxy.lost()
    assert_registered_once(reg, model, rel, digest, version)


def test_a_lost_reply_to_any_write_of_a_registration_converges_to_the_same_records(reg, proxy):
    """Each write of a registration (the model, the experiment, the release run, its parameter
    batches, its release file, the logged model, the version, the event record) has its reply
    lost once, in turn: each retried registration leaves the records an undisturbed one does."""
    proxy.reset()
    model = f"m-{uuid.uuid4().hex[:6]}"
    rel, digest, version = register(proxy.url, model)
    assert_registered_once(reg, model, rel, digest, version)
    writes = proxy.writes()
    assert sum(w.endswith("/runs/log-batch") for w in writes) >= 3   # two parameter batches, the event's metrics
    for n, write in enumerate(writes):
        proxy.reset(lose=lambda k, path, n=n: k == n)
        model = f"m-{uuid.uuid4().hex[:6]}"
        rel, digest, version = register(proxy.url, model)
        assert len(proxy.lost()) == 1, (n, write, proxy.lost())
        assert_registered_once(reg, model, rel, digest, version)
