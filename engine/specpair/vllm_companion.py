"""`python -m specpair.vllm_companion`: the specpair side of a vLLM engine pod.

vLLM counts acceptance, latency and finishes over all its traffic; drift and serving health judge
them per category (docs/drift.md). The companion runs beside vLLM in the pod and fronts its OpenAI
server, which then listens on a Unix socket in a volume of the pod only (no port the network
reaches around the companion):

    client --HTTP(S), bearer token--> companion :httpPort --HTTP--> vLLM unix:VLLM_SOCKET
    operator --mutual TLS gRPC (GetStats, GetModelInfo)--> companion :controlPort

- Requests and replies pass through unchanged: every OpenAI field, streaming included. The
  companion reads the request's category where our engine's HTTP front does (the extension
  `specpair: {"category": "code"}`), and vLLM's own per-request acceptance from each reply's
  `metrics.speculative_decoding` (vLLM's `--per-request-spec-decode-metrics`), with vLLM's
  per-request timings (`--enable-per-request-metrics`) and the usage. A streamed reply carries
  them on its usage chunk only, so the companion asks vLLM for it
  (`stream_options.include_usage`) and drops that chunk where the client did not ask for it.
- It counts them per category into the engine's own metrics (specpair.server.metrics: the same
  `specpair_*` series, appended to vLLM's /metrics on the same port) and serves the engine's
  GetStats contract from them on the control port, so the operator judges a vLLM pair's
  categories by exactly the rules it judges ours by.
- The pair's bearer token (rollout.auth) and serving TLS (rollout.tls) apply here, as on our
  engine's HTTP front; /health and /metrics stay open.
- SIGTERM: /health answers 503 at once (readiness fails) while requests are still served for the
  stop delay (rollout.shutdown.stopDelaySeconds: endpoints and gateways drop the terminating pod
  meanwhile, as for our engine); then a new request is refused with 503 and `Retry-After` (the
  client or gateway sends it elsewhere), and requests in flight run to their end (up to the drain
  timeout); then the companion
  writes its drained marker beside vLLM's socket and exits. Only then does the pod's vLLM get its
  SIGTERM (specpair.vllm_serve.supervise holds it back), so no request the companion let through
  meets a vLLM that is shutting down. Should vLLM still close a stream before its first event, the
  client gets the same 503 (the reply had not started) instead of an empty 200.

Torch-free: aiohttp, grpc, prometheus_client and the engine's generated protobufs only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpair.contract import DEFAULT_CATEGORY
from specpair.server.requests import CATEGORY_PATTERN
from specpair.stats import AcceptanceStats, RequestMoments
from specpair.vllm_front import FrontConnection, UpstreamPool
from specpair.vllm_serve import (POD_DRAIN_SECONDS, VLLM_SOCKET, drained_marker, parse_identity_name,
                                 reachable_socket_path)

log = logging.getLogger("specpair.vllm_companion")

PROTOCOL = "http"
# The `engine` label of the specpair_* series the companion exports (our engine's say "specpair").
# vLLM's own vllm:* series have an `engine` label too: vLLM's engine index ("0"), not a kind.
ENGINE = "vllm"
# Paths whose requests the companion counts; everything else passes through uncounted.
COUNTED_PATHS = ("/v1/chat/completions", "/v1/completions")
# Paths open without the bearer token (the probes, Prometheus), as on our engine's front.
OPEN_PATHS = ("/health", "/metrics", "/ping", "/version")
# Seconds a refused client is told to wait before it sends again (elsewhere, as a rule).
RETRY_AFTER_SECONDS = 1
# Hop-by-hop headers and those the proxy sets anew.
_DROPPED_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host",
                              "authorization", "upgrade", "proxy-connection", "te", "trailer", "expect"})
_DROPPED = frozenset(name.encode() for name in _DROPPED_HEADERS)
# Seconds between takes of the compiled front's records (also taken whenever the counts are read).
NATIVE_RECORDS_SECONDS = 0.25
# The largest request body taken (a long prompt's JSON).
MAX_BODY_BYTES = 64 << 20


class InvalidRequest(Exception):
    """The client's request is refused before vLLM sees it (HTTP 400, OpenAI's error shape)."""

    def __init__(self, param: str, reason: str):
        super().__init__(f"{param}: {reason}")
        self.param, self.reason = param, reason


# -- pure: what the companion reads from a request and a reply --------------------------------------


@dataclass(frozen=True)
class Prepared:
    """A counted request as the companion forwards it."""
    category: str
    body: bytes            # what vLLM gets: the client's bytes, unless the companion had to add usage
    stream: bool
    client_usage: bool     # the client asked for the usage chunk (else the companion drops it)


def prepare(raw: bytes) -> Prepared:
    """The category of a completion request and what vLLM is sent. Our engine's extension
    `specpair: {"category": ...}` names the category (absent: the gate's default); vLLM ignores
    unknown fields, so it is forwarded as the client wrote it. A streamed request gets
    `stream_options.include_usage` (vLLM's per-request metrics ride on the usage chunk only).
    A body that is no JSON object is vLLM's to refuse, counted in the default category."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return Prepared(DEFAULT_CATEGORY, raw, False, False)
    if not isinstance(body, dict):
        return Prepared(DEFAULT_CATEGORY, raw, False, False)
    ext = body.get("specpair")
    category = DEFAULT_CATEGORY
    if ext is not None:
        if not isinstance(ext, dict):
            raise InvalidRequest("specpair", "must be an object")
        given = ext.get("category", "")
        if not isinstance(given, str):
            raise InvalidRequest("specpair.category", "must be a string")
        category = given or DEFAULT_CATEGORY
        if not CATEGORY_PATTERN.fullmatch(category):
            raise InvalidRequest("specpair.category", "1-64 characters from A-Z a-z 0-9 _ . -")
    stream = body.get("stream") is True
    options = body.get("stream_options")
    client_usage = isinstance(options, dict) and options.get("include_usage") is True
    if stream and not client_usage:
        if "stream_options" not in body and raw[:1] == b"{" and b"\x00" not in raw[:4]:
            # The usual case, a UTF-8 object without stream_options: the field goes in before its
            # closing brace (the last "}" of the text), sparing a re-encoding of the whole body.
            end = raw.rindex(b"}")
            raw = raw[:end] + b', "stream_options": {"include_usage": true}' + raw[end:]
        else:
            body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
            raw = json.dumps(body).encode()
    return Prepared(category, raw, stream, client_usage)


@dataclass
class Reply:
    """One request's outcome as the companion counts it."""
    category: str
    status: str = "ok"                  # the engine's statuses: ok, error, invalid, cancelled, unavailable
    completion_tokens: int | None = None
    spec: dict[str, Any] | None = None  # vLLM's metrics.speculative_decoding
    ttft: float | None = None           # seconds, arrival to first token
    tpot: float | None = None           # seconds, mean between output tokens
    e2e: float | None = None
    queue: float | None = None


def read_final(reply: Reply, obj: dict[str, Any], arrived: float, first_at: float | None, now: float) -> None:
    """A reply's usage and vLLM's per-request metrics (a whole reply, or a stream's usage chunk)
    into `reply`. vLLM's timings are its engine's (queue, then scheduled to first token, then the
    mean gap): the same for streamed and whole replies. Without them, the companion's clock:
    arrival to the first streamed event, and the mean gap after it."""
    usage = obj.get("usage") or {}
    if isinstance(usage.get("completion_tokens"), int):
        reply.completion_tokens = usage["completion_tokens"]
    metrics = obj.get("metrics") or {}
    spec = metrics.get("speculative_decoding")
    if isinstance(spec, dict):
        reply.spec = spec
    ttft_ms, queue_ms, itl_ms = (metrics.get(k) for k in ("time_to_first_token_ms", "queue_time_ms", "mean_itl_ms"))
    if isinstance(ttft_ms, (int, float)):
        reply.queue = (queue_ms or 0.0) / 1000.0
        reply.ttft = reply.queue + ttft_ms / 1000.0
    elif first_at is not None:
        reply.ttft = first_at - arrived
    if isinstance(itl_ms, (int, float)):
        reply.tpot = itl_ms / 1000.0
    elif first_at is not None and reply.completion_tokens and reply.completion_tokens > 1:
        reply.tpot = (now - first_at) / (reply.completion_tokens - 1)


def acceptance_of(spec: dict[str, Any] | None, emitted: int | None) -> AcceptanceStats:
    """vLLM's per-request summary as the engine's AcceptanceStats (a step delta for the metrics):
    steps that drafted, draft and accepted tokens, accepted per position from the histogram of
    accepted counts (position p accepted in every step that accepted more than p)."""
    stats = AcceptanceStats(num_emitted_tokens=int(emitted or 0))
    if not spec:
        return stats
    histogram = [int(n) for n in spec.get("acceptance_histogram") or []]
    stats.num_drafts = int(spec.get("num_spec_steps") or 0)
    stats.num_draft_tokens = int(spec.get("num_draft_tokens") or 0)
    stats.num_accepted_tokens = int(spec.get("num_accepted_draft_tokens") or 0)
    k = max(len(histogram) - 1, 0)
    stats.num_accepted_tokens_per_pos = [sum(histogram[p + 1:]) for p in range(k)]
    # Steps that reached position p drafted there: vLLM's summary keeps no per-position drafts, so
    # every step counts as drafting k (an upper bound; the metrics use it to touch positions).
    stats.num_draft_tokens_per_pos = [stats.num_drafts] * k
    return stats


SSE_DONE = b"data: [DONE]\n\n"


class SseScanner:
    """Server-sent events as vLLM streams them, split into whole events: what goes on to the
    client, the first event's time, and the usage chunk (parsed), which is held back when the
    client did not ask for it. Only events that carry "usage" or "error" are parsed."""

    def __init__(self, keep_usage: bool):
        self.keep_usage = keep_usage
        self._pending = b""
        self.first_at: float | None = None
        self.final: dict[str, Any] | None = None
        self.error = False
        self.done = False       # [DONE] passed: the client has had the whole reply

    def feed(self, chunk: bytes, now: float) -> bytes:
        data = self._pending + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._pending = data
            return b""
        whole, self._pending = data[:cut + 2], data[cut + 2:]
        if self.first_at is None:
            self.first_at = now
        if SSE_DONE in whole:
            self.done = True
        if b'"usage"' not in whole and b'"error"' not in whole:
            return whole
        kept = []
        for event in whole.split(b"\n\n")[:-1]:
            payload = event[6:] if event.startswith(b"data: ") else None
            obj = None
            if payload is not None and payload != b"[DONE]" and (b'"usage"' in payload or b'"error"' in payload):
                try:
                    obj = json.loads(payload)
                except ValueError:
                    obj = None
            if isinstance(obj, dict) and "error" in obj and not obj.get("choices"):
                self.error = True
            if isinstance(obj, dict) and obj.get("usage") and not obj.get("choices"):
                self.final = obj
                if not self.keep_usage:
                    continue
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def pending(self) -> bool:
        """Part of an event is held (the next bytes complete it)."""
        return bool(self._pending)

    def rest(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest


# -- the counts: the engine's metrics and GetStats ------------------------------------------------


@dataclass
class _Category:
    cumulative: AcceptanceStats = field(default_factory=AcceptanceStats)
    finished: RequestMoments = field(default_factory=RequestMoments.zero)
    requests: int = 0


class Tally:
    """Per category: acceptance (cumulative, and the per-request sums drift judges), finished
    requests, and the serving counters, in the engine's EngineMetrics (one home for the series
    names and the serving histograms GetStats reports)."""

    def __init__(self, pair: str, version: str):
        from specpair.server.metrics import EngineMetrics

        self.metrics = EngineMetrics(pair, version, engine=ENGINE)
        self._categories: dict[str, _Category] = {}
        self._lock = threading.Lock()
        self.running = 0

    def record(self, reply: Reply) -> None:
        self.record_many((reply,))

    def record_many(self, replies: Any) -> None:
        """Replies into the counts: the acceptance counters (sums) once a category, the finished
        requests' moments and serving histograms once a reply (the compiled front's records come in
        batches: one step delta a category spares most of the counting a request)."""
        steps: dict[str, AcceptanceStats] = {}
        moments: dict[str, list[RequestMoments]] = {}
        for reply in replies:
            category = self.metrics.category(reply.category)
            ok = reply.status == "ok"
            if ok:
                stats = acceptance_of(reply.spec, reply.completion_tokens)
                if category in steps:
                    steps[category].merge(stats)
                else:
                    steps[category] = stats
                moments.setdefault(category, []).append(
                    RequestMoments.of_request(stats.num_draft_tokens, stats.num_accepted_tokens))
            self.metrics.record_finished(category, reply.status, protocol=PROTOCOL,
                                         queue=reply.queue if ok else None, ttft=reply.ttft if ok else None,
                                         e2e=reply.e2e if ok else None,
                                         tpot=reply.tpot if ok and (reply.completion_tokens or 0) > 1 else None)
        for category, stats in steps.items():
            self.metrics.record_step(category, stats)
            with self._lock:
                c = self._categories.setdefault(category, _Category())
                c.cumulative.merge(stats)
                for m in moments[category]:
                    c.finished = c.finished + m
                c.requests += len(moments[category])

    def stats_message(self, pair: str, version: str, speculating: bool, uptime: float) -> Any:
        from specpair._proto import engine_pb2 as pb
        from specpair.server.service import add_serving, stats_message

        msg = pb.Stats(pair=pair, version=version, speculating=speculating,
                       num_requests_running=self.running, uptime_seconds=uptime)
        overall = _Category()
        with self._lock:
            categories = {name: (_copy(c.cumulative), c.finished, c.requests) for name, c in self._categories.items()}
        for name, (cumulative, finished, requests) in categories.items():
            msg.categories[name].CopyFrom(pb.CategoryStats(cumulative=stats_message(cumulative), requests=requests,
                                                           finished=finished.to_message()))
            overall.cumulative.merge(cumulative)
            overall.finished = overall.finished + finished
            overall.requests += requests
        msg.overall.CopyFrom(pb.CategoryStats(cumulative=stats_message(overall.cumulative), requests=overall.requests,
                                              finished=overall.finished.to_message()))
        add_serving(msg, self.metrics.serving_counts())
        return msg


def _copy(s: AcceptanceStats) -> AcceptanceStats:
    out = AcceptanceStats()
    out.merge(s)
    return out


# -- the server: HTTP in front of vLLM, GetStats on the control port --------------------------------


@dataclass
class CompanionOptions:
    upstream: str = f"unix:{VLLM_SOCKET}"        # vLLM's OpenAI server: unix:PATH or host:port
    host: str = "127.0.0.1"
    port: int = 8000                             # 0: a free port (Companion.port)
    pair: str = "specpair"
    version: str = "0"
    auth_token: str | None = None                # set: /v1/* need "Authorization: Bearer <token>"
    tls: Any = None                              # server.tls.TLSFiles of the HTTP port; None: plaintext
    control_port: int | None = None              # None: no control listener; 0: a free port
    control_tls: Any = None                      # TLSFiles with client_ca: mutual TLS, required
    drain_timeout: float = float(POD_DRAIN_SECONDS)
    stop_delay: float = 0.0                      # after SIGTERM, seconds still serving with /health 503
    # /metrics alone, plain HTTP, as our engine's --metrics-port: what Prometheus scrapes (the
    # container port `metrics` on both engines' pods); None: only on the HTTP port.
    metrics_port: int | None = None
    # Written once drained: the pod's vLLM waits for it before it stops (vllm_serve.drained_marker).
    drained_marker: str | None = None


def _respond_error(conn: Any, status: int, message: str, kind: str, param: str | None = None,
                   retry_after: bool = False) -> None:
    """OpenAI's error shape, as vLLM and our engine's front answer. `retry_after`: a refusal the
    client may send again at once (to another pod: this one is going away)."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()
    headers = [(b"Content-Type", b"application/json; charset=utf-8")]
    if retry_after:
        headers.append((b"Retry-After", str(RETRY_AFTER_SECONDS).encode()))
    conn.respond(status, headers, body)


METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's where it is installed (it halves the event loop's share of each proxied request),
    else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Companion:
    """The companion's HTTP front and control listener on one event loop. `start()`/`stop()` run
    it in a thread of its own (tests, benchmarks); `serve()` is the pod's foreground loop."""

    def __init__(self, options: CompanionOptions):
        if options.control_port is not None and not (options.control_tls and options.control_tls.client_ca):
            raise ValueError("a control port needs control_tls with cert, key and client_ca (mutual TLS)")
        self.options = options
        self._tally = Tally(options.pair, options.version)
        self.started_at = time.time()
        self.port: int | None = None
        self.control_port: int | None = None
        self.leaving = False                    # told to stop: /health 503, still serving (the stop delay)
        self._draining = False                  # new requests refused, those in flight finishing
        self._relays_in_flight = 0              # the Python front's (the compiled front counts its own)
        self._native: Any = None                # the compiled front (vllm_front_native.NativeFront), if it serves
        self.identity: dict[str, Any] | None = None
        self._session = None
        self._server: asyncio.AbstractServer | None = None
        self._pool: UpstreamPool | None = None
        # Client connections (closed with the companion), and tasks the loop must keep alive.
        self._fronts: weakref.WeakSet[FrontConnection] = weakref.WeakSet()
        self._loop_tasks: set[asyncio.Task] = set()
        self._metrics_runner = None
        self.metrics_port: int | None = None
        self._grpc = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, on: bool) -> None:
        """Draining: new requests refused (the compiled front hands every one to the Python front,
        which refuses them)."""
        self._draining = on
        if self._native is not None:
            self._native.handover_all(on)

    @property
    def tally(self) -> Tally:
        """The counts, with the compiled front's records taken first (whoever reads them reads all
        the requests answered so far)."""
        self._count_native()
        return self._tally

    @property
    def in_flight(self) -> int:
        """Counted requests not yet answered, on either front."""
        return self._relays_in_flight + (self._native.in_flight() if self._native is not None else 0)

    @property
    def front(self) -> str:
        """Which front serves the HTTP port: "c" or "python"."""
        return "c" if self._native is not None else "python"

    # -- lifecycle ---------------------------------------------------------------------------------

    async def open(self) -> None:
        import aiohttp
        from aiohttp import web

        if self.options.drained_marker:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.options.drained_marker)      # an earlier life of this container's

        upstream = self.options.upstream
        # vLLM on a Unix socket in the pod ("unix:PATH"): no port the network can reach around the
        # companion's token; else host:port (tests, a laptop). The relayed requests go through
        # the front's own keep-alive connections; /metrics and /v1/models (rare) through aiohttp.
        if upstream.startswith("unix:"):
            upstream = f"unix:{reachable_socket_path(upstream[len('unix:'):])}"
        connector = (aiohttp.UnixConnector(path=upstream[len("unix:"):], limit=0)
                     if upstream.startswith("unix:") else aiohttp.TCPConnector(limit=0))
        self._base = "http://localhost" if upstream.startswith("unix:") else f"http://{upstream}"
        self._host = b"localhost" if upstream.startswith("unix:") else upstream.encode()
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self._pool = UpstreamPool(upstream)
        ssl_context = None
        if self.options.tls is not None:
            from specpair.server.tls import ReloadingTLS
            ssl_context = ReloadingTLS(self.options.tls, "serving TLS").ssl_context()
        fronts = self._fronts

        def front() -> FrontConnection:
            conn = FrontConnection(self._dispatch, MAX_BODY_BYTES)
            fronts.add(conn)
            return conn
        self._native = self._start_native(ssl_context, upstream, front)
        if self._native is None:
            self._server = await asyncio.get_running_loop().create_server(
                front, self.options.host, self.options.port, ssl=ssl_context, reuse_address=True)
            self.port = self._server.sockets[0].getsockname()[1]
        if self.options.metrics_port is not None:
            metrics = web.Application()
            metrics.router.add_get("/metrics", lambda _request: self._metrics())
            self._metrics_runner = web.AppRunner(metrics, access_log=None, handle_signals=False)
            await self._metrics_runner.setup()
            metrics_site = web.TCPSite(self._metrics_runner, self.options.host, self.options.metrics_port,
                                       reuse_address=True)
            await metrics_site.start()
            self.metrics_port = metrics_site._server.sockets[0].getsockname()[1]
        if self.options.control_port is not None:
            await self._start_control()

    def _start_native(self, ssl_context: Any, upstream: str, front: Any) -> Any:
        """The compiled front on the HTTP port (specpair.vllm_front_native), or None where the Python
        front serves it: TLS on the port, vLLM at a host name, no compiler or a failed build, or
        SPECPAIR_COMPANION_FRONT=python. Each reason is logged once."""
        import ipaddress
        import socket

        from specpair import vllm_front_native as native
        if not native.wanted():
            return None
        if ssl_context is not None:
            log.warning("serving TLS on the HTTP port: the Python front serves it (the compiled front speaks "
                        "plaintext only)")
            return None
        if not upstream.startswith("unix:"):
            try:
                ipaddress.IPv4Address(upstream.rpartition(":")[0])
            except ValueError:
                log.warning("vLLM at %s is no Unix socket or IPv4 address: the Python front serves", upstream)
                return None
        # (vLLM's socket's folder: a writable emptyDir in the pod, whose root filesystem is read-only)
        lib, why = native.library(Path(upstream[len("unix:"):]).parent if upstream.startswith("unix:") else None)
        if lib is None:
            log.warning("the compiled front could not be built (%s): the Python front serves", why)
            return None
        sock = socket.create_server((self.options.host, self.options.port), backlog=1024)
        try:
            made = native.NativeFront(lib, sock, upstream, self._host, self.options.auth_token)
        except OSError as exc:
            sock.close()
            log.warning("%s: the Python front serves", exc)
            return None
        self.port = sock.getsockname()[1]
        loop = asyncio.get_running_loop()

        def handed(prefix: bytes) -> FrontConnection:
            conn = front()
            conn.prefix = prefix
            return conn

        def take_handovers() -> None:
            for fd, prefix in made.take_handovers():
                conn_sock = socket.socket(fileno=fd)
                self._loop_tasks.add(task := loop.create_task(
                    loop.connect_accepted_socket(lambda prefix=prefix: handed(prefix), conn_sock)))
                task.add_done_callback(self._loop_tasks.discard)
        loop.add_reader(made.notify_r, take_handovers)

        async def count_now_and_then() -> None:
            while True:
                await asyncio.sleep(NATIVE_RECORDS_SECONDS)
                self._count_native()
        self._native_counting = loop.create_task(count_now_and_then())
        return made

    def _count_native(self, records: list | None = None) -> None:
        """The compiled front's records since the last call into the counts, as the Python relay
        counts its requests (_Relay._settle)."""
        native = self._native
        if records is None:
            if native is None:
                return
            records = native.take_records()
        replies = []
        for rec in records:
            reply = Reply(rec.category or DEFAULT_CATEGORY, status=rec.status)
            replies.append(reply)
            if rec.status == "ok":
                if rec.whole:
                    with contextlib.suppress(ValueError, AttributeError, TypeError, IndexError):
                        read_final(reply, json.loads(rec.finals[0]), 0.0, None, rec.end)
                else:
                    final, error = None, False
                    for payload in rec.finals:
                        try:
                            obj = json.loads(payload)
                        except ValueError:
                            continue
                        if isinstance(obj, dict) and "error" in obj and not obj.get("choices"):
                            error = True
                        if isinstance(obj, dict) and obj.get("usage") and not obj.get("choices"):
                            final = obj
                    if final is not None:
                        read_final(reply, final, 0.0, rec.first, rec.end)
                    if error:
                        reply.status = "error"
            reply.e2e = rec.end
        self._tally.record_many(replies)

    async def _start_control(self) -> None:
        import grpc

        from specpair.server.service import SERVICE_NAME
        from specpair.server.tls import ReloadingTLS

        from specpair._proto import engine_pb2 as pb
        self._grpc = grpc.aio.server()
        self._grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "GetStats": grpc.unary_unary_rpc_method_handler(
                self._get_stats, request_deserializer=pb.GetStatsRequest.FromString,
                response_serializer=pb.Stats.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self._get_model_info, request_deserializer=pb.GetModelInfoRequest.FromString,
                response_serializer=pb.ModelInfo.SerializeToString),
            "SetSpeculation": grpc.unary_unary_rpc_method_handler(
                self._set_speculation, request_deserializer=pb.SetSpeculationRequest.FromString,
                response_serializer=pb.SpeculationSettings.SerializeToString),
        }),))
        self.control_port = self._grpc.add_secure_port(f"{self.options.host}:{self.options.control_port}",
                                                       ReloadingTLS(self.options.control_tls).credentials())
        await self._grpc.start()

    async def leave(self) -> int:
        """SIGTERM's whole course: not ready at once, serving for the stop delay, then drain."""
        self.leaving = True
        await asyncio.sleep(self.options.stop_delay)
        return await self.drain()

    async def drain(self) -> int:
        """Health says 503 from now; wait for the requests in flight (up to the drain timeout).
        Returns how many were still running at the deadline."""
        self.draining = True
        deadline = time.monotonic() + self.options.drain_timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.options.drained_marker:
            with open(self.options.drained_marker, "w") as f:
                f.write(f"{self.in_flight}\n")
        return self.in_flight

    async def close(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1)
        if self._native is not None:
            asyncio.get_running_loop().remove_reader(self._native.notify_r)
            self._native_counting.cancel()
            self._count_native(self._native.stop())
            self._native = None
        if self._pool is not None:
            if self._server is not None:
                self._server.close()
            for conn in list(self._fronts):
                if conn.transport is not None and not conn.closed:
                    conn.transport.close()
            self._fronts.clear()
            self._pool.close()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def start(self) -> "Companion":
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            self._loop = new_event_loop()
            try:
                self._loop.run_until_complete(self.open())
            except BaseException as exc:    # a port in use, bad TLS files: report to start()
                failed.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(target=run, name="specpair-vllm-companion", daemon=True)
        self._thread.start()
        ready.wait(60)
        if failed:
            raise RuntimeError(f"the companion did not start: {failed[0]}") from failed[0]
        return self

    def stop(self, drain: bool = True) -> int:
        async def shut() -> int:
            left = await self.drain() if drain else self.in_flight
            await self.close()
            return left
        left = asyncio.run_coroutine_threadsafe(shut(), self._loop).result(self.options.drain_timeout + 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        return left

    async def serve(self) -> None:
        """The pod's companion: until SIGTERM or SIGINT, then drain and exit."""
        await self.open()
        # What the start made (modules, grpc, prometheus, aiohttp: most of the heap) lives as long as
        # the process: out of the collector's sight, its full collections stop walking it each time
        # (they were ~18% of the compiled front's process CPU at 200 requests/s; perf, 2026-12-08).
        gc.freeze()
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        log.warning("companion serving on %s:%s in front of vLLM at %s%s", self.options.host, self.port,
                    self.options.upstream, f", control port {self.control_port}" if self.control_port else "")
        await stopping.wait()
        left = await self.leave()
        log.warning("drained: %d requests still running at the drain timeout", left)
        await self.close()

    # -- HTTP ----------------------------------------------------------------------------------------

    def _dispatch(self, conn: Any, request: Any) -> None:
        """One whole request on the front (specpair.vllm_front.FrontConnection), answered now or
        by a relay to vLLM."""
        from specpair.server.auth import bearer_token_matches

        path = request.path
        if path == "/health" and (self.leaving or self.draining):
            return _respond_error(conn, 503, "draining: this pod is shutting down", "service_unavailable")
        if self.draining and path.startswith("/v1/"):
            # A request that reaches a draining pod (its endpoint not yet dropped everywhere) is
            # refused before it starts, as our engine's front does, so the client sends it elsewhere.
            return _respond_error(conn, 503, "shutting down: this pod is draining; send the request to another",
                                  "service_unavailable", retry_after=True)
        if path == "/metrics":
            self._loop_tasks.add(task := asyncio.get_running_loop().create_task(self._metrics_reply(conn)))
            task.add_done_callback(self._loop_tasks.discard)
            return None
        token = self.options.auth_token
        if token and path not in OPEN_PATHS and not bearer_token_matches(request.header(b"authorization"), token):
            return _respond_error(conn, 401, "missing or wrong bearer token", "authentication_error")
        if request.method == "POST" and path in COUNTED_PATHS:
            arrived = time.perf_counter()
            try:
                prep = prepare(request.body)
            except InvalidRequest as exc:
                self._tally.record(Reply(DEFAULT_CATEGORY, status="invalid"))
                return _respond_error(conn, 400, str(exc), "invalid_request_error", exc.param)
            self._relays_in_flight += 1
            self._tally.running += 1
            return _Relay(self, conn, request, prep.body, Reply(prep.category), prep, arrived).go()
        return _Relay(self, conn, request, request.body, None, None, 0.0).go()

    def _upstream_request(self, request: Any, body: bytes) -> bytes:
        head = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (request.method.encode(), request.target.encode("latin-1"),
                                                      self._host)]
        head += [b"%s: %s\r\n" % kv for kv in request.headers if kv[0].lower() not in _DROPPED]
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        return b"".join(head) + body

    async def _metrics_text(self) -> bytes:
        import aiohttp
        from prometheus_client import generate_latest

        text = b""
        try:
            async with self._session.get(f"{self._base}/metrics") as resp:
                if resp.status == 200:
                    text = await resp.read()
        except (aiohttp.ClientError, OSError):
            pass        # vLLM not up (yet): the companion's own series still answer
        return text + generate_latest(self.tally.metrics.registry)     # (the property: records taken first)

    async def _metrics_reply(self, conn: Any) -> None:
        conn.respond(200, [(b"Content-Type", METRICS_CONTENT_TYPE)], await self._metrics_text())

    async def _metrics(self) -> Any:
        from aiohttp import web
        return web.Response(body=await self._metrics_text(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE.decode()})

    # -- control (gRPC) ------------------------------------------------------------------------------

    async def _read_identity(self) -> dict[str, Any] | None:
        """Who vLLM says it serves (its first served name, specpair.vllm_serve.identity_name):
        read once it answers, kept (a vLLM process serves one identity for its life)."""
        import aiohttp

        if self.identity is None:
            try:
                async with self._session.get(f"{self._base}/v1/models") as resp:
                    models = (await resp.json()).get("data") or [] if resp.status == 200 else []
            except (aiohttp.ClientError, OSError, ValueError):
                return None
            self.identity = next((i for m in models if (i := parse_identity_name(str(m.get("id", ""))))), None)
        return self.identity

    async def _get_stats(self, request: Any, context: Any) -> Any:
        identity = await self._read_identity() or {}
        msg = self.tally.stats_message(self.options.pair, self.options.version, bool(identity.get("speculating")),
                                       time.time() - self.started_at)
        if self._native is not None:
            msg.num_requests_running += self._native.in_flight()
        return msg

    async def _get_model_info(self, request: Any, context: Any) -> Any:
        import grpc

        from specpair import __version__
        from specpair._proto import engine_pb2 as pb
        identity = await self._read_identity()
        if identity is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"vLLM at {self.options.upstream} does not answer with a specpair identity yet")
        return pb.ModelInfo(pair=identity["pair"], version=identity["version"], content_hash=identity["digest"],
                            speculation=pb.SpeculationSettings(enabled=identity["speculating"]),
                            engine_version=__version__)

    async def _set_speculation(self, request: Any, context: Any) -> Any:
        import grpc
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "vLLM cannot switch speculation at run time; a vLLM pair's speculation changes by "
                            "a rollout of its Deployment")


class _Relay:
    """One request passed to vLLM and its reply passed back (the sink of a
    specpair.vllm_front.UpstreamConnection), counted when `reply` is set: a stream's events go
    through the SseScanner (usage chunk read, and dropped unless asked for), and its status and
    headers wait for its first event other than [DONE] (a stream vLLM closes before one is
    refused as unstarted); a whole reply is read for vLLM's metrics at its end."""
    __slots__ = ("companion", "conn", "data", "reply", "prep", "arrived", "up", "status", "headers", "scanner",
                 "held", "started", "whole", "retried", "settled", "head_request")

    def __init__(self, companion: Companion, conn: Any, request: Any, body: bytes, reply: Reply | None,
                 prep: Prepared | None, arrived: float):
        self.companion, self.conn, self.reply, self.prep, self.arrived = companion, conn, reply, prep, arrived
        self.data = companion._upstream_request(request, body)
        self.head_request = request.method == "HEAD"
        self.up: Any = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.scanner: SseScanner | None = None
        self.held = b""
        self.started = False
        self.whole: list[bytes] | None = None
        self.retried = False
        self.settled = False

    def go(self) -> None:
        up = self.companion._pool.take()
        if up is not None:
            self._send(up)
            return
        tasks = self.companion._loop_tasks
        tasks.add(task := asyncio.get_running_loop().create_task(self._connect()))
        task.add_done_callback(tasks.discard)

    async def _connect(self) -> None:
        try:
            up = await self.companion._pool.connect()
        except (OSError, asyncio.TimeoutError) as exc:
            self._unavailable(exc)
            return
        if self.conn.closed:
            up.transport.close()
            self._client_lost()
            return
        self._send(up)

    def _send(self, up: Any) -> None:
        self.up = up
        self.conn.on_lost, self.conn.on_pause = self._client_lost, self._pause
        self.conn.hold = True
        up.send(self, self.data, self.head_request)

    def _unavailable(self, exc: BaseException | str) -> None:
        if self.reply is not None:
            self.reply.status = "unavailable"
        # Counted before the reply goes out (a write now is synchronous): whoever reads the reply
        # finds it counted.
        self._settle()
        _respond_error(self.conn, 503, f"vLLM is not answering: {exc}", "service_unavailable")

    # -- vLLM's reply -----------------------------------------------------------------------------

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], lower: dict[bytes, bytes],
                length: int | None) -> None:
        self.status = status
        self.headers = [kv for kv in headers if kv[0].lower() not in _DROPPED]
        reply = self.reply
        if reply is not None:
            if status >= 400:
                reply.status = "invalid" if status < 500 else "error"
            elif lower.get(b"content-type", b"").startswith(b"text/event-stream"):
                self.scanner = SseScanner(self.prep.client_usage)
                return
            else:
                self.whole = []
        self.started = True
        self.conn.start(status, self.headers, length)

    def on_body(self, data: bytes) -> None:
        scanner = self.scanner
        if scanner is None:
            if self.whole is not None:
                self.whole.append(data)
            self.conn.write(data)
            return
        out = scanner.feed(data, time.perf_counter())
        if not self.started:
            held = self.held + out
            if not held.replace(SSE_DONE, b"").strip():
                self.held = held
                return
            self.held, self.started = b"", True
            self.conn.start(self.status, self.headers, None, held)
        elif out:
            self.conn.write(out)

    def on_end(self) -> None:
        scanner, reply = self.scanner, self.reply
        if scanner is not None:
            rest = self.held + scanner.rest()
            self.held = b""
            if not self.started:
                if not rest.replace(SSE_DONE, b"").strip():
                    reply.status = "unavailable"
                    self._settle()
                    _respond_error(self.conn, 503, "vLLM closed the stream before its first event (it is shutting "
                                   "down); send the request to another pod", "service_unavailable", retry_after=True)
                    return
                self.started = True
                self.conn.start(self.status, self.headers, None, rest)
            elif rest:
                self.conn.write(rest)
        elif self.whole is not None:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                read_final(reply, json.loads(b"".join(self.whole)), self.arrived, None, time.perf_counter())
        self._settle()
        self.conn.end()

    def on_chunks(self, raw: bytes) -> bool:
        """Whole chunks of a stream already started: passed on in vLLM's own framing, when they
        end with a whole event, hold none the scanner must read (usage, error, [DONE]) and nothing
        waits before them. Else False: they are decoded and scanned (on_body)."""
        scanner = self.scanner
        if (not self.started or scanner is None or scanner.pending() or not raw.endswith(b"\n\n\r\n")
                or b'"usage"' in raw or b'"error"' in raw or b"[DONE]" in raw):
            return False
        return self.conn.write_framed(raw)

    def on_turn(self) -> None:
        """The end of one read from vLLM: what it gave the client is written now."""
        self.conn.flush()

    def on_lost(self, replied: bool, exc: BaseException | None) -> None:
        if not replied and self.up.reused and not self.retried:
            # An idle connection vLLM closed as the request went out: once more on a new one.
            self.retried = True
            self.conn.on_lost = self.conn.on_pause = None
            tasks = self.companion._loop_tasks
            tasks.add(task := asyncio.get_running_loop().create_task(self._connect()))
            task.add_done_callback(tasks.discard)
            return
        if not self.started:
            self._unavailable(exc or "the connection closed")
            return
        if self.reply is not None:
            self.reply.status = "error"          # vLLM's reply broke off
        self._settle()
        self.conn.end(whole=False)

    # -- the client -------------------------------------------------------------------------------

    def _client_lost(self) -> None:
        """The client left: vLLM aborts the request as its connection closes. A stream whose
        [DONE] the client had was whole (the openai client closes before the body's last chunk)."""
        up, self.up = self.up, None
        if up is not None and up.sink is self:
            up.sink = None
            up.transport.abort()
        if self.reply is not None and self.reply.status == "ok" and not (self.scanner and self.scanner.done):
            self.reply.status = "cancelled"
        self._settle()

    def _pause(self, paused: bool) -> None:
        """The client reads slower than vLLM writes: vLLM's connection waits with it."""
        if self.up is not None and not self.up.transport.is_closing():
            (self.up.transport.pause_reading if paused else self.up.transport.resume_reading)()

    def _settle(self) -> None:
        """Counted once, however the request ended."""
        if self.settled:
            return
        self.settled = True
        reply = self.reply
        if reply is None:
            return
        scanner = self.scanner
        if scanner is not None and reply.status == "ok":
            if scanner.final is not None:
                read_final(reply, scanner.final, self.arrived, scanner.first_at, time.perf_counter())
            if scanner.error:
                reply.status = "error"
        reply.e2e = time.perf_counter() - self.arrived
        companion = self.companion
        companion._relays_in_flight -= 1
        companion._tally.running -= 1
        companion._tally.record(reply)


def main(argv: list[str] | None = None) -> int:
    from specpair.errors import SpecpairError
    from specpair.server.auth import read_token_file
    from specpair.server.tls import TLSFiles

    ap = argparse.ArgumentParser(prog="python -m specpair.vllm_companion", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", help="vLLM's OpenAI server as host:port (else its Unix socket, --uds)")
    ap.add_argument("--uds", default=VLLM_SOCKET, help="vLLM's Unix socket (a path on its own: a pod's mount "
                    "paths are found as whole arguments)")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000, help="the pod's OpenAI API, /health and /metrics")
    ap.add_argument("--pair", default="specpair")
    ap.add_argument("--version", default="0")
    ap.add_argument("--release", help="the release JSON: pair and version from it")
    ap.add_argument("--auth-token-file")
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    ap.add_argument("--metrics-port", type=int, help="also /metrics alone here, plain HTTP (Prometheus' port)")
    ap.add_argument("--control-port", type=int)
    ap.add_argument("--control-tls-cert")
    ap.add_argument("--control-tls-key")
    ap.add_argument("--control-tls-client-ca")
    ap.add_argument("--drain-timeout", type=float, default=float(POD_DRAIN_SECONDS),
                    help="seconds requests in flight may take to end after the stop delay")
    ap.add_argument("--stop-delay", type=float, default=0.0,
                    help="seconds after SIGTERM still serving with /health 503, while endpoints drop the pod")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        pair, version = args.pair, args.version
        if args.release:
            with open(args.release) as f:
                release = json.load(f)
            pair = str(release.get("pair") or pair)
            version = str((release.get("mlflow") or {}).get("version") or version)
        options = CompanionOptions(
            upstream=args.upstream or f"unix:{args.uds}", host=args.host, port=args.port, pair=pair, version=version,
            auth_token=read_token_file(args.auth_token_file) if args.auth_token_file else None,
            tls=TLSFiles(args.tls_cert, args.tls_key) if args.tls_cert else None,
            control_port=args.control_port,
            control_tls=(TLSFiles(args.control_tls_cert, args.control_tls_key, args.control_tls_client_ca)
                         if args.control_port is not None else None),
            drain_timeout=args.drain_timeout, stop_delay=args.stop_delay, metrics_port=args.metrics_port,
            drained_marker=None if args.upstream else drained_marker(args.uds))
        companion = Companion(options)
    except (OSError, ValueError, SpecpairError) as exc:
        print(f"specpair.vllm_companion: error: {exc}", file=sys.stderr)
        return 2
    loop = new_event_loop()
    try:
        loop.run_until_complete(companion.serve())
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
