"""EngineServer: the life of one engine pod's server, from loading to draining.

    starting -> loading (gRPC up, health NOT_SERVING) -> serving (models loaded, warm-up step ran,
    health SERVING) -> [leaving: health NOT_SERVING, requests still served, for the stop delay]
    -> draining (health NOT_SERVING, new Generate refused, in-flight streams run on up to the drain
    timeout, then end with UNAVAILABLE) -> stopped

Why leaving: Kubernetes removes a stopping pod from its Services' endpoints as it sends SIGTERM,
and kube-proxy, gateways and load balancers follow some seconds later. A pod that refused new
requests at once would fail those still sent to it meanwhile; so with a stop delay (the operator
writes rollout.shutdown.stopDelaySeconds) readiness fails first and requests are still served
until the delay ends, and only then does the server refuse new ones and drain.

The gRPC server (grpc.aio) runs on its own event loop in its own thread, the engine in the
worker thread, the metrics HTTP server in prometheus-client's thread, the OpenAI-compatible HTTP
front (openai_api.py, when `http_port` is set) in uvicorn's: `start()` and `stop()` are plain
blocking calls, usable from the CLI, tests and benchmarks alike. Both fronts feed the one worker;
the HTTP front answers 503 while loading and draining and stops after the drain.

The gRPC server may listen twice: the main port (plaintext or TLS) and a control port (mutual TLS)
serving the same services; every TLS listener, the HTTP front's included, re-reads its certificate
files when they change (tls.py), so a certificate renewed in place needs no restart. Once any listener verifies
client certificates, SetSpeculation is the operator's alone (`control_client_names`); without
them, a server whose serving ports take a bearer token refuses SetSpeculation to every caller
(control_policy): the token is the clients', never a control credential.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import platform
import threading
import time
import dataclasses
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from specpair._proto import engine_pb2 as pb
from specpair import capture as capture_mod
from specpair.capture import CaptureSettings, CaptureWriter
from specpair.errors import SpecpairError
from specpair.server import draft_swap
from specpair.server.draft_swap import ServingDraft
from specpair.server.metrics import EngineMetrics
from specpair.server.requests import Limits
from specpair.server.service import (SERVICE_NAME, EngineService, category_message, model_identity,
                                     model_info_message, speculation_message)
from specpair.server.tls import DEFAULT_CONTROL_CLIENT_NAMES, ReloadingTLS, TLSFiles, peer_common_names
from specpair.server.worker import EngineWorker

log = logging.getLogger("specpair.server")


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051                  # 0: pick a free port (see EngineServer.port)
    metrics_port: int | None = None    # None: no metrics HTTP server; 0: a free port
    pair: str = "default"
    version: str = "0"
    # None: the engine's default (worker.default_max_batch_size: its paged pool's, else 32),
    # written here once the worker is made.
    max_batch_size: int | None = None
    max_queue: int = 32
    drain_timeout: float = 30.0
    # Seconds `stop` keeps serving with health NOT_SERVING before it drains (module docstring);
    # 0 outside Kubernetes, where nothing routes by endpoints.
    stop_delay: float = 0.0
    # The serving ports' (gRPC and HTTP) certificate, re-read on rotation. None: plaintext (the
    # CLI asks for --insecure explicitly).
    tls: TLSFiles | None = None
    limits: Limits = Limits()
    warm_up_prompt: str = "Hello"
    content_hash: str = ""             # of the release file served (--release), for GetModelInfo
    http_port: int | None = None       # OpenAI-compatible HTTP API (openai_api.py); None: off, 0: a free port
    # Set: every call to the serving ports needs "authorization: Bearer <token>" (HTTP header,
    # gRPC metadata); a client certificate allowed to control the server also passes on gRPC.
    auth_token: str | None = None
    # Seconds an HTTP request may take to arrive in full (else 408), and an idle kept-alive
    # connection is held.
    http_read_timeout: float = 30.0
    # A second gRPC listener, same services, mutual TLS required, its files re-read on rotation
    # (tls.py). None: no control listener; 0: a free port (see EngineServer.control_port).
    control_port: int | None = None
    control_tls: TLSFiles | None = None   # cert, key and client CA: all three required
    # Client-certificate common names allowed to call SetSpeculation, once any listener verifies
    # client certificates (a control listener, or a client CA on the main port).
    control_client_names: tuple[str, ...] = DEFAULT_CONTROL_CLIENT_NAMES
    # Capture of served traffic (capture.py, docs/learning.md); None: off.
    capture: CaptureSettings | None = None


# glibc's mallopt parameter (malloc.h) and the value the server sets: allocations of 64 KiB and
# more get pages of their own (mmap), handed back to the system when freed.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 10


def return_freed_memory_to_the_system() -> bool:
    """Make large allocations their own mappings, so memory freed is memory given back.

    The CPU cache arrays, and a long prompt's activations, are malloc'd. glibc maps a large
    block on its own, but each time one is freed it raises its mmap threshold to that block's
    size (up to 32 MiB), so the next blocks of that size come from its heaps instead; freed
    there, among live blocks, the pages stay with the process. One 4k-token prompt beside short
    ones left an engine serving SmolLM2 at 2.57 GB instead of 1.47 GB long after it left. A fixed
    threshold turns that adjustment off: every block from 64 KiB up is mapped and unmapped on
    its own, at the price of a page fault for each 4 KiB of it first touched. Set before
    the models load; a MALLOC_MMAP_THRESHOLD_ in the environment is the user's choice and is
    kept. Not glibc (musl, macOS): nothing to do. True when the threshold is set here.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    except (OSError, AttributeError):
        return False


def control_policy(options: ServerOptions) -> str:
    """Who may call the control RPCs (SetSpeculation): "certificate" (an allowed client
    certificate, once any listener verifies them), "refused" (nobody: the serving ports' bearer
    token is the clients', never a control credential), or "open" (no authentication at all, for
    development). docs/server.md, "Who may control the server"."""
    if options.control_port is not None or (options.tls is not None and options.tls.client_ca):
        return "certificate"
    return "refused" if options.auth_token else "open"


class EngineServer:
    def __init__(self, load_engine: Callable[[], object], options: ServerOptions | None = None,
                 progress: Callable[[str], None] = print):
        """load_engine: builds the SpeculativeEngine (loads the models); runs after gRPC is up."""
        self.options = options or ServerOptions()
        if self.options.control_port is not None and not (self.options.control_tls
                                                          and self.options.control_tls.client_ca):
            raise ValueError("a control port needs control_tls with cert, key and client_ca (mutual TLS)")
        self.limits = self.options.limits
        self.load_engine = load_engine
        self.progress = progress
        self.phase = "starting"
        # Told to stop: readiness fails (health NOT_SERVING, /health 503) while requests are still
        # served for the stop delay, then the drain (module docstring).
        self.leaving = False
        self.error: str | None = None
        self.engine = None
        self.worker: EngineWorker | None = None
        self.metrics = EngineMetrics(self.options.pair, self.options.version)
        self.port: int | None = None
        self.control_port: int | None = None
        self.control_tls: ReloadingTLS | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.capture: CaptureWriter | None = None      # while serving with options.capture
        self._http = None                  # the OpenAI-compatible front, when http_port is set
        self.started_at = time.time()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._service: EngineService | None = None
        self._bound = threading.Event()
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._metrics_httpd = None
        self._stop_lock = threading.Lock()
        # The release whose draft side serves (draft_swap.py): the started one until a SwapDraft.
        self.serving_draft = ServingDraft(self.options.version, self.options.content_hash)
        self._swap_lock = threading.Lock()     # one swap at a time

    # -- lifecycle (blocking, thread-safe) -------------------------------------------------------

    def start(self, wait_ready: bool = False, timeout: float = 600.0) -> "EngineServer":
        """Bind the ports and start loading the models in the background."""
        return_freed_memory_to_the_system()
        if self.options.metrics_port is not None:
            self._metrics_httpd, _ = start_http_server(self.options.metrics_port, addr=self.options.host,
                                                       registry=self.metrics.registry)
            self.metrics_port = self._metrics_httpd.server_address[1]
        self._thread = threading.Thread(target=self._run_loop, name="specpair-grpc", daemon=True)
        self._thread.start()
        if not self._bound.wait(60) or self.error:
            self._close_metrics()
            control = (f" (control port {self.options.control_port})"
                       if self.options.control_port is not None else "")
            raise RuntimeError(f"gRPC server did not start on {self.options.host}:{self.options.port}{control}: "
                               f"{self.error or 'timed out'}")
        if self.options.http_port is not None:
            from specpair.server.openai_api import OpenAIFront
            # The gRPC port's files, checked by a watcher of its own: each listener takes a
            # rotation at its own next handshake.
            http_tls = ReloadingTLS(self.options.tls, "serving TLS").ssl_context() if self.options.tls else None
            try:
                self._http = OpenAIFront(self, self._service.admission, host=self.options.host,
                                         port=self.options.http_port, token=self.options.auth_token,
                                         read_timeout=self.options.http_read_timeout, tls=http_tls).start()
            except OSError as exc:
                self.stop(0)
                raise RuntimeError(f"HTTP server did not start on {self.options.host}:"
                                   f"{self.options.http_port}: {exc}") from exc
            self.http_port = self._http.port
        threading.Thread(target=self._load, name="specpair-load", daemon=True).start()
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError(f"engine not ready after {timeout} s (phase {self.phase})")
        if self.phase != "serving":
            raise RuntimeError(self.error or f"engine failed to start (phase {self.phase})")

    def stop(self, drain_timeout: float | None = None, stop_delay: float | None = None) -> dict:
        """Fail readiness and keep serving for the stop delay (None: the options'), then drain
        in-flight requests (up to drain_timeout), then stop. Returns what happened."""
        with self._stop_lock:
            if self.phase == "stopped" or self._loop is None or self._stopped.is_set():
                self._close_metrics()
                return {"drained": 0, "aborted": 0}
            timeout = self.options.drain_timeout if drain_timeout is None else drain_timeout
            delay = self.options.stop_delay if stop_delay is None else stop_delay
            future = asyncio.run_coroutine_threadsafe(self._shutdown(timeout, delay), self._loop)
            result = future.result(delay + timeout + 60)
            self._thread.join(30)
            return result

    def _close_metrics(self) -> None:
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
            self._metrics_httpd = None

    # -- what the service asks ----------------------------------------------------------------------

    def unavailable_reason(self) -> str:
        if self.phase in ("starting", "loading"):
            return "models are still loading; retry when health reports SERVING"
        if self.phase == "failed":
            return f"engine failed to start: {self.error}"
        if self.phase == "serving" and self.leaving:
            return ("this pod is stopping: it still serves requests while endpoints drop it, "
                    "send new ones elsewhere")
        return "server is shutting down"

    def control_client_allowed(self, context) -> bool:
        """The caller presented a verified client certificate whose name may control the server."""
        return any(name in self.options.control_client_names for name in peer_common_names(context))

    def control_refusal(self, context, method: str) -> str | None:
        """Why this caller may not call a control method (None: it may), counted and logged.

        Who may control the server (server.control_policy):
          - a listener verifies client certificates (a control port, or --tls-client-ca): an
            allowed client certificate, and nothing else;
          - none does, but the serving ports take a bearer token: nobody. The token is handed to
            clients; a client that holds it must not switch speculation for everyone, and without
            client certificates no caller can be told from another;
          - no certificates and no token (a laptop): anyone, as anyone may call everything else.
        """
        policy = control_policy(self.options)
        if policy == "open" or (policy == "certificate" and self.control_client_allowed(context)):
            return None
        self.metrics.record_control_denied(method)
        if policy == "refused":
            log.warning("%s refused for %s: this server has no control listener and its serving ports "
                        "take a bearer token", method, context.peer())
            return (f"{method} is refused on this server: its serving ports take a bearer token, which is "
                    f"for clients, and it has no control port (--control-port, mutual TLS) or client CA "
                    f"to tell the operator by")
        names = peer_common_names(context)
        presented = (f"its client certificate's common name {names[0]!r} is not allowed" if names
                     else "it presented no client certificate")
        log.warning("%s refused for %s: %s (allowed: %s)", method, context.peer(), presented,
                    ", ".join(self.options.control_client_names))
        return (f"{method} needs the operator's client certificate on the control port (mutual TLS); "
                f"{presented}")

    def count_rejected(self, category: str, status: str, protocol: str = "grpc") -> None:
        self.metrics.record_finished(self.metrics.category(category), status, protocol=protocol)

    def model_info(self) -> pb.ModelInfo:
        info = model_info_message(self.engine, pair=self.options.pair, version=self.options.version,
                                  limits=self.limits, max_batch_size=self.options.max_batch_size,
                                  max_queue=self.options.max_queue, content_hash=self.options.content_hash)
        info.draft_version, info.draft_content_hash = self.serving_draft.version, self.serving_draft.content_hash
        return info

    def swap_draft(self, release_json: str, reason: str = "") -> pb.SwapDraftReply:
        """Load a draft-side release beside the serving one, then swap it in between two steps
        (draft_swap.swap); SwapRefused names what needs new pods."""
        def installed(serving: ServingDraft) -> None:
            self.serving_draft = serving

        with self._swap_lock:
            result = draft_swap.swap(self.engine, self.worker, release_json, self.serving_draft,
                                     installed=installed, reason=reason)
        return pb.SwapDraftReply(swapped=result.swapped, draft_version=result.serving.version,
                                 draft_content_hash=result.serving.content_hash,
                                 draft=model_identity(self.engine, "draft"), load_seconds=result.load_seconds,
                                 install_seconds=result.install_seconds)

    def stats(self) -> pb.Stats:
        engine, worker = self.engine, self.worker
        snap = worker.stats_snapshot()
        controller = engine.controller
        msg = pb.Stats(pair=self.options.pair, version=self.options.version,
                       overall=category_message(snap["overall"]),
                       speculating=bool(controller.should_speculate() and engine.drafter is not None),
                       falling_back=controller.falling_back, fallback_events=controller.fallback_events,
                       current_k=worker.batch.last_k,
                       speculation=speculation_message(engine, self.options.max_batch_size),
                       num_requests_running=worker.running, num_requests_waiting=worker.waiting,
                       uptime_seconds=time.time() - self.started_at)
        for name, cat in snap["categories"].items():
            msg.categories[name].CopyFrom(category_message(cat))
        if self.capture is not None:
            try:
                msg.captured.update(capture_mod.complete_records(self.capture.root))
            except OSError as exc:    # the volume failing: the operator reads no count, its training waits
                log.warning("capture: counting the complete shards: %s", exc)
        return msg

    def set_speculation(self, enabled: bool | None, k: int | None, reason: str = "") -> pb.SpeculationSettings:
        """Applied in the worker thread between steps, so no step sees half a change."""
        engine = self.engine

        def apply():
            controller = engine.controller
            if enabled is not None:
                if enabled and not controller.enabled:
                    # Turned back on by an operator: start from a fresh window, not the old verdict.
                    controller.falling_back = False
                    controller.window.clear()
                controller.enabled = enabled
            if k is not None:
                controller.k_override = k or None
            return speculation_message(engine, self.options.max_batch_size)

        settings = self.worker.call(apply)
        log.warning("speculation set to enabled=%s k_override=%s%s", settings.enabled,
                    settings.k_override if settings.HasField("k_override") else None,
                    f" ({reason})" if reason else "")
        return settings

    # -- internals ----------------------------------------------------------------------------------

    def _run_loop(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start_grpc_server())
        except Exception as exc:   # a port in use, bad TLS files: report to start()
            self.error = f"{type(exc).__name__}: {exc}"
            self.phase = "failed"
            self._bound.set()
            self._ready.set()
            self._stopped.set()
            self._loop.close()
            return
        try:
            # Until _shutdown stops it: the loop outlives the gRPC server so the shutdown
            # coroutine can finish its clean-up after server.stop().
            self._loop.run_forever()
        finally:
            self._stopped.set()
            self._loop.close()

    async def _start_grpc_server(self) -> None:
        """Bind the gRPC ports (serving and control) with health NOT_SERVING; the models load after."""
        opts = self.options
        # Above this gRPC itself refuses (RESOURCE_EXHAUSTED); between max_request_bytes and it, the
        # service answers INVALID_ARGUMENT naming the limit.
        grpc_limit = max(4 * self.limits.max_request_bytes, 4 << 20)
        self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", grpc_limit),
            ("grpc.max_send_message_length", grpc_limit),
            ("grpc.so_reuseport", 0),
        ])
        self._service = EngineService(self)
        self._server.add_generic_rpc_handlers((self._service.handler(),))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        address = f"{opts.host}:{opts.port}"
        if opts.tls is not None:
            self.port = self._server.add_secure_port(address, ReloadingTLS(opts.tls, "serving TLS").credentials())
        else:
            self.port = self._server.add_insecure_port(address)
        if opts.control_port is not None:
            # Same server, same services (health and reflection included), its own credentials.
            self.control_tls = ReloadingTLS(opts.control_tls)
            self.control_port = self._server.add_secure_port(f"{opts.host}:{opts.control_port}",
                                                             self.control_tls.credentials())
        await self._server.start()
        self.phase = "loading"
        self._bound.set()

    def _load(self) -> None:
        """Load the models, start the worker, warm up; then report SERVING."""
        try:
            self.progress(f"loading models for pair {self.options.pair} version {self.options.version}")
            started = time.perf_counter()
            engine = self.load_engine()
            self.metrics.set_k_by_rows(getattr(engine, "speculation_by_rows", None) or [])
            worker = EngineWorker(engine, max_batch_size=self.options.max_batch_size,
                                  max_queue=self.options.max_queue, metrics=self.metrics)
            self.options = dataclasses.replace(self.options, max_batch_size=worker.max_batch_size)
            self.metrics.set_decode_rows(worker.decode_rows)
            self.progress("warm-up step")
            worker.warm_up(engine.encode(self.options.warm_up_prompt))
            for warning in engine.warnings:
                self.progress(f"warning: {warning}")
            self.engine, self.worker = engine, worker
            if self.options.capture is not None:
                self.capture = CaptureWriter(self.options.capture, release=self.options.version,
                                             tokenizer=engine.target_fingerprint["sha256"],
                                             counted=self.metrics.record_capture).start()
                worker.on_finished = self.capture.offer
            worker.start()
            if self.phase != "loading":       # stop() arrived while loading
                worker.stop()
                return
            self.phase = "serving"
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
            self.progress(f"serving on {self.options.host}:{self.port} "
                          f"({time.perf_counter() - started:.1f} s to ready)")
        except SpecpairError as exc:    # the user's to fix: one line, no traceback
            self.error = str(exc)
            self.phase = "failed"
            self.progress(f"error: {self.error}")
        except Exception as exc:
            log.exception("engine failed to load")
            self.error = f"{type(exc).__name__}: {exc}"
            self.phase = "failed"
            self.progress(f"error: {self.error}")
        finally:
            self._ready.set()

    def _set_health(self, status) -> None:
        async def set_all():
            for name in ("", SERVICE_NAME):
                await self._health.set(name, status)
        asyncio.run_coroutine_threadsafe(set_all(), self._loop).result(10)

    async def _shutdown(self, drain_timeout: float, stop_delay: float = 0.0) -> dict:
        # Readiness first (module docstring): health NOT_SERVING while requests are still served.
        self.leaving = True
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if stop_delay > 0 and self.phase == "serving":
            self.progress(f"leaving: health NOT_SERVING, still serving for {stop_delay:g} s while endpoints "
                          f"drop this pod")
            await asyncio.sleep(stop_delay)
        self.phase = "draining"
        worker = self.worker
        aborted = in_flight = 0
        if worker is not None:
            worker.stop_accepting()
            # Replies, not worker jobs: a finished job's last tokens may still be on their way.
            admission = self._service.admission
            in_flight = admission.replying
            deadline = time.monotonic() + drain_timeout
            while (worker.busy or admission.replying) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if worker.busy:
                aborted = await asyncio.get_running_loop().run_in_executor(
                    None, worker.abort_all,
                    f"server shutting down: drain timeout of {drain_timeout:g} s expired")
            # Let the handlers send the final messages / statuses before the transport closes.
            await asyncio.sleep(0.1)
        if self._http is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._http.stop)
        await self._server.stop(grace=5)
        if worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)
        if self.capture is not None:    # after the worker: the last requests' records are queued
            await asyncio.get_running_loop().run_in_executor(None, self.capture.stop)
        self._service.close()
        self._close_metrics()
        self.phase = "stopped"
        asyncio.get_running_loop().call_soon(asyncio.get_running_loop().stop)
        # drained: the requests in flight (queued, running, or their replies being sent) when
        # draining began that finished.
        return {"drained": in_flight - aborted, "aborted": aborted}
