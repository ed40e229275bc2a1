"""`specpair` as the stand-in engine image runs it: `specpair engine serve ...` with the flags the
operator writes into the Deployment, speaking the real gRPC API (specpair.engine.v1.Engine and
grpc.health.v1, so the pod's gRPC probes are real) with numbers from the test's model world.

For scenarios that need chosen numbers (drift, tokenizer changes, crash loops) without models.
The world file (SPECPAIR_STANDIN_WORLD) maps a draft source to what it measures:
  {"good-draft": {"acceptanceRate": 0.7, "live": {"code": 0.78}, ...},
   "_crash_versions": ["3"],                  # pods of these release versions exit at start
   "_fingerprint_overrides": {"faster-draft": "fff..."},   # re-read on every GetModelInfo
   "_wrong_hash_versions": ["2"],             # pods of these versions report another content hash
   "_serving_counters": true,                 # GetStats reports serving counters (below)
   "_first_token_seconds": {"3": 1.0},        # pods of these versions wait this long to answer
   "_swappable_drafts": ["good-draft", "faster-draft"]}   # SwapDraft between these (below)
A Generate request with category C drafts `max_new_tokens` tokens, accepted at the world's live
rate for C: traffic is driven over gRPC like real traffic. With `_serving_counters`, each answered
request is counted as the engine counts it for the operator's serving health and canary (GetStats:
TTFT as the stand-in took it, requests by status). A pod started with a draft named in
`_swappable_drafts` reports the release whose draft it serves (GetModelInfo.draft_version and
draft_content_hash, as the real engine) and takes SwapDraft to another of them (any other
FAILED_PRECONDITION, as the real engine refuses what it cannot swap); a pod started with another
draft reports none, as an engine older than SwapDraft. Its answer's initial metadata names the version that served it
(`x-specpair-version`), so a client through a gateway sees which side it reached.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specpair._proto import engine_pb2, engine_pb2_grpc
from specpair.contract import DEFAULT_CATEGORY, content_hash
from specpair.server.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS

SERVED_BY = "x-specpair-version"


def fingerprint(source: str | None) -> str:
    return hashlib.sha256(f"tokenizer-of:{source}".encode()).hexdigest()


def world() -> dict[str, Any]:
    with open(os.environ["SPECPAIR_STANDIN_WORLD"]) as f:
        return json.load(f)


class StandInEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.speculation = True
        self.counters: dict[str, list[int]] = {}   # category -> [requests, drafted, accepted]
        self.ttft: dict[str, list[float]] = {}      # category -> each answered request's TTFT (seconds)
        self.lock = threading.Lock()
        # The draft it serves and the release it came with: the started one until a SwapDraft.
        self.draft = args.draft
        self.draft_release = (str(args.version), args.content_hash)

    @property
    def swappable(self) -> bool:
        return self.args.draft in (world().get("_swappable_drafts") or [])

    def _draft(self) -> str:
        return self.draft or self.args.drafter or ""

    def answer(self, category: str, drafted: int) -> int:
        """One request answered and counted, whichever protocol brought it: the accepted tokens."""
        began = time.monotonic()
        accepted = 0
        wait = float((world().get("_first_token_seconds") or {}).get(str(self.args.version), 0.0))
        if wait:
            time.sleep(wait)
        with self.lock:
            self.ttft.setdefault(category, []).append(time.monotonic() - began)
            c = self.counters.setdefault(category, [0, 0, 0])
            c[0] += 1
            if self.speculation:
                w = world().get(self._draft(), {})
                rate = (w.get("live") or {}).get(category, w.get("acceptanceRate", 0.5))
                accepted = int(drafted * rate)
                c[1] += drafted
                c[2] += accepted
        return accepted

    def Generate(self, request: Any, context: Any) -> Any:
        drafted = request.max_new_tokens if request.HasField("max_new_tokens") else 64
        context.send_initial_metadata(((SERVED_BY, str(self.args.version)),))
        accepted = self.answer(request.category or DEFAULT_CATEGORY, drafted)
        yield engine_pb2.GenerateResponse(
            request_id=request.request_id or "r", text="x" * drafted,
            stats=engine_pb2.AcceptanceStats(num_draft_tokens=drafted if self.speculation else 0,
                                             num_accepted_tokens=accepted))

    def GetModelInfo(self, request: Any, context: Any) -> Any:
        w = world()
        overrides = w.get("_fingerprint_overrides") or {}
        draft = self.draft
        tok_of = (w.get(draft) or {}).get("tokenizerOf", draft)
        return engine_pb2.ModelInfo(
            pair=self.args.pair, version=self.args.version,
            tokenizer=engine_pb2.TokenizerInfo(
                target_fingerprint=overrides.get(self.args.target) or fingerprint(self.args.target),
                draft_fingerprint=(overrides.get(draft) or fingerprint(tok_of)) if draft else "",
                compatible=True),
            speculation=engine_pb2.SpeculationSettings(enabled=self.speculation, k=self.args.k),
            content_hash=self.args.content_hash,
            **({"draft_version": self.draft_release[0], "draft_content_hash": self.draft_release[1]}
               if self.swappable else {}))

    def SwapDraft(self, request: Any, context: Any) -> Any:
        if self.args.control_port and \
                b"specpair-operator" not in (context.auth_context().get("x509_common_name") or []):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          "SwapDraft needs the operator's client certificate on the control port")
        release = json.loads(request.release_json)
        source = (release.get("draft") or {}).get("source")
        if not self.swappable or source not in (world().get("_swappable_drafts") or []):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the stand-in swaps only between {world().get('_swappable_drafts')}: a swap needs new pods")
        now = (str((release.get("mlflow") or {}).get("version", "0")), content_hash(release))
        swapped = now != self.draft_release
        with self.lock:
            self.draft, self.draft_release = source, now
        return engine_pb2.SwapDraftReply(swapped=swapped, draft_version=now[0], draft_content_hash=now[1])

    def GetStats(self, request: Any, context: Any) -> Any:
        with self.lock:
            cats = {cat: engine_pb2.CategoryStats(requests=r, cumulative=engine_pb2.AcceptanceStats(
                num_draft_tokens=d, num_accepted_tokens=a),
                serving=self._serving(cat) if world().get("_serving_counters") else None)
                for cat, (r, d, a) in self.counters.items()}
        return engine_pb2.Stats(pair=self.args.pair, version=self.args.version, categories=cats,
                                speculating=self.speculation)

    def _serving(self, category: str) -> Any:
        """The category's serving counters (under the lock): TTFT histogram, TPOT (the stand-in
        answers all tokens at once: its TTFT spread over them), requests by status (all ok)."""
        ttft = self.ttft.get(category, [])
        tpot = [t / 8 for t in ttft]

        def histogram(values: list[float], bounds: tuple[float, ...]) -> Any:
            return engine_pb2.Histogram(upper_bounds=list(bounds), counts=[sum(v <= b for v in values) for b in bounds],
                                        count=len(values), sum=sum(values))
        return engine_pb2.ServingStats(time_to_first_token=histogram(ttft, LATENCY_BUCKETS),
                                       time_per_output_token=histogram(tpot, TOKEN_BUCKETS),
                                       requests={"ok": len(ttft)} if ttft else {})

    def SetSpeculation(self, request: Any, context: Any) -> Any:
        # As the real engine: with a control listener, only the operator's certificate may switch.
        if self.args.control_port and \
                b"specpair-operator" not in (context.auth_context().get("x509_common_name") or []):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          "SetSpeculation needs the operator's client certificate on the control port")
        if request.HasField("enabled"):
            self.speculation = request.enabled
        return engine_pb2.SpeculationSettings(enabled=self.speculation, k=self.args.k)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags the operator writes into the Deployment (`engine serve ...`), read as the real
    engine reads them; --release fills in what it serves."""
    ap = argparse.ArgumentParser()
    for flag in ("--target", "--draft", "--drafter", "--target-revision", "--draft-revision", "--pair",
                 "--fallback-threshold", "--batch-size-threshold", "--host", "--release"):
        ap.add_argument(flag)
    ap.add_argument("--version", default="0")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--metrics-port", type=int, default=9400)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--control-port", type=int, default=0)
    ap.add_argument("--http-port", type=int, default=0)
    # As the real engine stops (server/app.py): unready but serving for the stop delay, then drained.
    ap.add_argument("--stop-delay", type=float, default=0.0)
    ap.add_argument("--drain-timeout", type=float, default=2.0)
    for flag in ("--control-tls-cert", "--control-tls-key", "--control-tls-client-ca"):
        ap.add_argument(flag)
    args, _ = ap.parse_known_args(argv[2:])
    if args.release:
        # What the real engine does with --release: everything served comes from the file.
        with open(args.release) as f:
            release = json.load(f)
        args.target = release["target"].get("source")
        args.draft = release["draft"].get("source")
        args.drafter = release["draft"].get("drafter")
        args.pair = release.get("pair", args.pair)
        args.version = str((release.get("mlflow") or {}).get("version", args.version))
        args.k = int(release["speculation"].get("k", args.k))
        args.content_hash = content_hash(release)
        if str(args.version) in {str(v) for v in world().get("_wrong_hash_versions", [])}:
            args.content_hash = "0" * 64  # this pod serves something other than its release file says
    else:
        args.content_hash = ""
    return args


def build_server(args: argparse.Namespace, executor: futures.Executor | None = None,
                 interceptors: tuple[Any, ...] = (), health_servicer: Any = None,
                 engine: StandInEngine | None = None) -> grpc.Server:
    """The stand-in's gRPC server on the pod's address (serving port, and the control port with
    mutual TLS when asked), not started. Several servers may share one `executor`
    (engine_standin_host.py serves many pods from one process, and counts their calls)."""
    server = grpc.server(executor or futures.ThreadPoolExecutor(max_workers=8), interceptors=interceptors)
    engine_pb2_grpc.add_EngineServicer_to_server(engine or StandInEngine(args), server)
    health_servicer = health_servicer or health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{args.host or '127.0.0.1'}:{args.port}")
    if args.control_port:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()
        creds = grpc.ssl_server_credentials([(read(args.control_tls_key), read(args.control_tls_cert))],
                                            root_certificates=read(args.control_tls_client_ca),
                                            require_client_auth=True)
        server.add_secure_port(f"{args.host or '127.0.0.1'}:{args.control_port}", creds)
    return server


def http_server(args: argparse.Namespace, engine: StandInEngine, ready: threading.Event) -> Any:
    """The OpenAI-compatible port (--http-port) as far as a client through a gateway needs it, on
    HTTP/1.1 keep-alive: POST /v1/completions answered and counted as a Generate is (its reply's
    `x-specpair-version` header names the version that served it), GET /health 200 while `ready`
    (503 once told to stop, as the real engine's). Serving in threads of its own; not started."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header(SERVED_BY, str(args.version))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                self._reply(200 if ready.is_set() else 503, {"status": "serving" if ready.is_set() else "leaving"})
            else:
                self._reply(404, {"error": {"message": f"no {self.path} here"}})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path != "/v1/completions":
                self._reply(404, {"error": {"message": f"no {self.path} here"}})
                return
            drafted = int(body.get("max_tokens") or 16)
            engine.answer(str((body.get("metadata") or {}).get("category") or DEFAULT_CATEGORY), drafted)
            self._reply(200, {"object": "text_completion", "model": args.pair,
                              "choices": [{"index": 0, "text": "x" * drafted, "finish_reason": "length"}],
                              "usage": {"completion_tokens": drafted}})

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((args.host or "127.0.0.1", args.http_port), Handler)
    server.daemon_threads = True
    return server


def crashes(args: argparse.Namespace) -> bool:
    return str(args.version) in {str(v) for v in world().get("_crash_versions", [])}


def main(argv: list[str]) -> int:
    if argv[:2] != ["engine", "serve"]:
        print(f"stand-in image: only `specpair engine serve` is here, not {argv[:2]}", file=sys.stderr)
        return 2
    args = parse_args(argv)
    if crashes(args):
        print(f"stand-in engine: release v{args.version} crashes at start (the test's world says so)", file=sys.stderr)
        return 1
    engine, health_servicer, ready = StandInEngine(args), health.HealthServicer(), threading.Event()
    server = build_server(args, health_servicer=health_servicer, engine=engine)
    server.start()
    http = http_server(args, engine, ready) if args.http_port else None
    if http is not None:
        threading.Thread(target=http.serve_forever, daemon=True).start()
    ready.set()
    print(f"stand-in engine {args.pair} v{args.version} on {args.host}:{args.port}"
          + (f" and HTTP :{args.http_port}" if http else ""), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    # The real engine's stop (server/app.py): readiness fails at once, requests are still served
    # for the stop delay while endpoints and gateways drop the pod, then in-flight ones drain.
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    ready.clear()
    print(f"SIGTERM: leaving for {args.stop_delay:g} s, then draining (up to {args.drain_timeout:g} s)", flush=True)
    time.sleep(args.stop_delay)
    if http is not None:
        http.shutdown()
    server.stop(args.drain_timeout).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
