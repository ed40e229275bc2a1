"""`specpair engine serve` and `specpair engine generate`.

`specpair/cli.py` (the `specpair` command) calls add_engine_parser(subparsers); `python -m
specpair.server engine ...` runs the same commands standalone. Each command is `func(args) -> exit code` set as a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import select
import signal
import sys
import threading
from pathlib import Path

from specpair.block_pool import MAX_BATCH_ROWS, PLANNED_ROW_POSITIONS
from specpair.capture import add_capture_arguments, capture_settings
from specpair.config import KV_BUDGET_HELP, PREFILL_TOKEN_BUDGET, ModelRef, PairSpec, Release, SpeculationConfig, kv_budget_flag
from specpair.errors import SpecpairError
from specpair.server.worker import DEFAULT_MAX_BATCH_SIZE
from specpair.shadow_flags import add_shadow_arguments, attach_shadow_from_args


class ReplaceDefaultThenAppend(argparse.Action):
    """A repeatable option whose default list is replaced, not extended, by the first use
    (argparse's "append" would add the given values to the default)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        setattr(namespace, self.dest, (current if current is not self.default else []) + [values])


def add_engine_parser(subparsers) -> argparse.ArgumentParser:
    engine = subparsers.add_parser("engine", help="the gRPC engine server and its client")
    commands = engine.add_subparsers(dest="engine_command", metavar="{serve,generate}")
    commands.required = True

    serve = commands.add_parser("serve", help="serve one draft+target pair over gRPC",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--target", default="default",
                       help="target model: directory, .gguf, hub id, MLflow model URI or 'default'")
    serve.add_argument("--target-revision", default=None,
                       help="pinned revision of a hub target (a release pins it)")
    serve.add_argument("--draft-revision", default=None, help="pinned revision of a hub draft")
    draft = serve.add_mutually_exclusive_group()
    draft.add_argument("--draft", help="draft model (same kinds of source as --target)")
    draft.add_argument("--drafter", choices=["ngram"], help="a model-free drafter (default when no --draft)")
    draft.add_argument("--no-spec", action="store_true", help="serve target-only")
    serve.add_argument("--release", metavar="FILE",
                       help="serve this release file (the operator mounts it at /etc/specpair/release.json): "
                            "models, revisions, speculation (in place of the speculation flags but "
                            "--no-spec), pair and version come from it, and GetModelInfo reports its "
                            "content hash")
    serve.add_argument("--pair", default="default", help="pair name (metrics label, GetModelInfo)")
    serve.add_argument("--version", default="0", help="release version (metrics label, GetModelInfo)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    serve.add_argument("--metrics-port", type=int, default=9400,
                       help="Prometheus /metrics port (0: any free port, -1: none)")
    http = serve.add_argument_group("OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                                    "/v1/models, /health), same batch as gRPC")
    http.add_argument("--http-port", type=int, default=0, help="HTTP port (0: off)")
    http.add_argument("--http-read-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="a request must arrive in full (headers and body) within this time, or it is "
                           "answered 408 and its connection closed; a kept-alive connection idle this "
                           "long between requests is closed")
    tls = serve.add_argument_group("transport security of the serving ports, gRPC and HTTP alike (one of "
                                   "--tls-cert/--tls-key or --insecure); the files are re-read when they "
                                   "change, so a certificate renewed in place needs no restart")
    tls.add_argument("--tls-cert", help="server certificate chain (PEM)")
    tls.add_argument("--tls-key", help="server private key (PEM)")
    tls.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")
    tls.add_argument("--insecure", action="store_true",
                     help="plaintext gRPC and HTTP (only inside a trusted network, or behind a gateway "
                          "that terminates TLS)")
    tls.add_argument("--auth-token-file", "--http-token-file", dest="auth_token_file", metavar="FILE",
                     help="require a bearer token, the text of this file (e.g. a mounted Secret), on the "
                          "serving ports: HTTP 'Authorization: Bearer <token>', gRPC metadata "
                          "'authorization: Bearer <token>' (or the operator's client certificate); "
                          "default: no authentication")
    control = serve.add_argument_group(
        "control listener (the operator's port: mutual TLS; SetSpeculation is accepted only from an "
        "allowed client certificate once this port, or --tls-client-ca, is set; a server with neither "
        "refuses SetSpeculation to every caller when --auth-token-file is set (the token is the "
        "clients'), and keeps it open to any caller without a token, for development)")
    control.add_argument("--control-port", type=int, default=None,
                         help="a second gRPC port, same services, mutual TLS required (0: any free port); "
                              "needs the three --control-tls-* files, re-read when they change")
    control.add_argument("--control-tls-cert", help="control port's server certificate chain (PEM)")
    control.add_argument("--control-tls-key", help="control port's server private key (PEM)")
    control.add_argument("--control-tls-client-ca", help="CA that signs the control port's client certificates")
    control.add_argument("--control-client-name", action=ReplaceDefaultThenAppend, metavar="NAME",
                         # tls.DEFAULT_CONTROL_CLIENT_NAMES, the operator's certificate (not
                         # imported: building the parser must not import grpc).
                         default=["specpair-operator"],
                         help="client-certificate common name allowed to call SetSpeculation (repeatable)")
    spec = serve.add_argument_group("speculation")
    spec.add_argument("--k", type=int, default=SpeculationConfig.k,
                      help="draft tokens per round (start value when dynamic)")
    spec.add_argument("--no-dynamic-k", action="store_true", help="keep k fixed")
    spec.add_argument("--tree-width", type=int, default=SpeculationConfig.tree_width,
                      help="drafting heads: candidates per draft position, verified as a token "
                           "tree in one pass (1: a chain)")
    spec.add_argument("--lookup-min-match", type=int, default=SpeculationConfig.lookup_min_match,
                      help="drafting heads: a request whose last N tokens (N >= this) occurred "
                           "earlier copies what followed them instead of asking the head (0: off)")
    spec.add_argument("--fallback-threshold", type=float, default=SpeculationConfig.fallback_threshold,
                      help="windowed acceptance below this switches to target-only decoding")
    spec.add_argument("--batch-size-threshold", type=int, default=None,
                      help="speculation off while more requests than this run at once "
                           "(default: 1 on CPU, 16 on GPU, as measured in docs/server.md)")
    spec.add_argument("--on-mismatch", choices=["error", "target-only"], default="error",
                      help="a draft whose tokenizer differs: refuse to start, or serve target-only")
    limits = serve.add_argument_group("limits")
    limits.add_argument("--max-batch-size", type=int, default=None,
                        help="requests decoded together, and admitted beside the queue (default: "
                             "admitted, on the CPU's paged KV cache the rows its pool holds at "
                             f"{PLANNED_ROW_POSITIONS} positions each, up to {MAX_BATCH_ROWS}, else "
                             f"{DEFAULT_MAX_BATCH_SIZE}; decoded together, the fewest of those whose "
                             "decode step measured at start-up comes within 10%% of the best tokens/s)")
    limits.add_argument("--max-queue", type=int, default=32, help="requests waiting beyond the batch")
    limits.add_argument("--prefill-budget", type=int, default=None, metavar="TOKENS",
                        help="prompt positions a step feeds beside its decoding rows on the CPU's "
                             "paged KV cache (a long prompt is prefilled in chunks while the "
                             "other rows keep decoding; default "
                             f"{PREFILL_TOKEN_BUDGET}; 0: each prompt whole in one step)")
    limits.add_argument("--kv-budget", type=kv_budget_flag, default=None, metavar="BUDGET", help=KV_BUDGET_HELP)
    limits.add_argument("--max-new-tokens-limit", type=int, default=1024)
    limits.add_argument("--max-request-bytes", type=int, default=1 << 20)
    limits.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds in-flight streams may run on after SIGTERM (after the stop delay)")
    limits.add_argument("--stop-delay", type=float, default=0.0,
                        help="seconds after SIGTERM the server still serves with health NOT_SERVING, while "
                             "endpoints and gateways stop sending to it, before it refuses new requests and "
                             "drains (the operator writes rollout.shutdown.stopDelaySeconds)")
    serve.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")
    serve.add_argument("--dtype", help="float32, bfloat16, ... (default: fp32 on CPU, bf16 on CUDA)")
    add_shadow_arguments(serve)
    add_capture_arguments(serve)
    serve.set_defaults(func=serve_command)

    gen = commands.add_parser("generate", help="stream a reply from an engine server",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompt", help="prompt text ('-' reads stdin)")
    gen.add_argument("--address", default="127.0.0.1:50051", help="host:port of the engine")
    gen.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    gen.add_argument("--max-new-tokens", type=int)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--k", type=int, help="speculation k for this request (0: off)")
    gen.add_argument("--category", default="")
    gen.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    ctls = gen.add_argument_group("transport security (TLS unless --insecure)")
    ctls.add_argument("--insecure", action="store_true", help="plaintext gRPC")
    ctls.add_argument("--ca", help="CA that signed the server certificate (default: system roots)")
    ctls.add_argument("--cert", help="client certificate (mutual TLS)")
    ctls.add_argument("--key", help="client private key (mutual TLS)")
    ctls.add_argument("--auth-token-file", metavar="FILE",
                      help="send 'authorization: Bearer <token>' with the token in this file")
    ctls.add_argument("--server-name", help="expected name in the server certificate")
    gen.set_defaults(func=generate_command)
    return engine


# -- serve -----------------------------------------------------------------------------------------

# The batch threshold a server speculates with until start-up has measured its own (a release
# carries its gate's; --batch-size-threshold sets one): batch 1, where speculation is for and where
# each request's own back-off (costs.DynamicK) stops drafts that fail.
PROVISIONAL_BATCH_SIZE_THRESHOLD = 1


def served_pair(args, release: Release | None, device_type: str) -> PairSpec:
    """What the engine serves: a release's pair and speculation settings when it serves one (read
    as the gate read them for its verdict; of the pair's flags only --no-spec applies), else the
    flags. Either way the flags say how this process runs it (device, dtype, on a mismatch, the KV
    budget)."""
    runtime = {"device": args.device, "dtype": args.dtype, "on_mismatch": args.on_mismatch,
               "kv_budget": args.kv_budget}
    if release is not None:
        pair = dataclasses.replace(release.pair, **runtime)
    else:
        threshold = args.batch_size_threshold
        if threshold is None:
            threshold = PROVISIONAL_BATCH_SIZE_THRESHOLD     # measured once loaded (load_engine)
        pair = PairSpec(
            target=ModelRef(args.target, args.target_revision),
            draft=ModelRef(args.draft, args.draft_revision) if args.draft else None,
            drafter=None if args.draft else args.drafter or "ngram",
            speculation=SpeculationConfig(k=args.k, dynamic_k=not args.no_dynamic_k,
                                          fallback_threshold=args.fallback_threshold,
                                          batch_size_threshold=threshold, tree_width=args.tree_width,
                                          lookup_min_match=args.lookup_min_match), **runtime)
    if args.no_spec:
        pair = dataclasses.replace(pair, draft=None, drafter=None, speculation=dataclasses.replace(
            pair.speculation, enabled=False))
    return pair


def load_engine(args, release: Release | None, progress=print):
    """Load the pair the command line or the release names into a SpeculativeEngine (imports
    torch), with the shadow candidate of --shadow-release attached."""
    from specpair.models import pick_device
    from specpair.pair import load_pair

    pair = served_pair(args, release, pick_device(args.device).type)
    engine = load_pair(pair, progress=progress)
    if args.prefill_budget is not None:
        if args.prefill_budget < 0:
            raise SpecpairError(f"--prefill-budget must be >= 0 (0: whole prompts), got {args.prefill_budget}")
        engine.prefill_budget = args.prefill_budget or None
    if args.max_batch_size is None:
        decide_decode_rows_at_startup(engine, progress)
    if release is None and args.batch_size_threshold is None:
        decide_speculation_at_startup(engine, args.max_batch_size or engine.decode_rows, progress)
    speculation = engine.config
    progress(f"speculation k={speculation.k}{' (dynamic)' if speculation.dynamic_k else ''}, "
             f"off above {speculation.batch_size_threshold} concurrent requests")
    # The shadow candidate must share the target served, which a release names, not the flags:
    # its check reads a copy of the flags with the served target in them.
    served = argparse.Namespace(**{**vars(args), "target": pair.target.source,
                                   "target_revision": pair.target.revision})
    return attach_shadow_from_args(engine, served, progress)


def decide_decode_rows_at_startup(engine, progress=print) -> dict:
    """Where --max-batch-size is not set: time target-only decode steps of a real batch at row
    counts up to the rows admission holds (worker.default_max_batch_size) on this device, and
    decode at most the fewest rows whose tokens/s come within a margin of the best
    (costs.decide_decode_rows). The requests past them wait queued, their shared prompt's blocks
    kept in the prefix store, and join as rows end. The worker reads `engine.decode_rows`;
    logged here, exported as specpair_decode_rows."""
    from specpair.costs import decide_decode_rows
    from specpair.server.worker import default_max_batch_size

    admitted = default_max_batch_size(engine)
    decided = decide_decode_rows(engine, admitted)
    rates = ", ".join(f"{rows}: {rate:.1f}" for rows, rate in decided["tokens_per_second"].items())
    per_position = decided["costs"].per_row_position
    clock = "a CPU second at one thread" if engine.target.device.type == "cpu" else "a second"
    progress(f"decode rows by measured step cost, tokens {clock} after a {decided['context']}-token "
             f"shared prompt (medians, measured in {decided['seconds']:.1f} s): {rates}; a position of "
             f"context costs a row {1e6 * per_position:.2f} us a step; decoding up to {decided['rows']} "
             f"rows a step there (the fewest within {decided['costs'].margin:.0%} of the best; "
             f"re-priced at the "
             f"rows' own context as they are admitted), the rest of the {admitted} rows admission "
             f"holds queued")
    engine.decode_rows = decided["rows"]
    engine.decode_costs = decided["costs"]     # the worker prices its rows' context by these
    return decided


def decide_speculation_at_startup(engine, max_rows: int | None, progress=print) -> dict | None:
    """Where the batch threshold is no one's setting: time a target step and a verification at
    the row buckets on this device, and speculate up to the largest batch size where drafting is
    expected to pay (costs.decide_speculation_by_rows), starting each request at batch 1's k.
    Batch 1 keeps speculating even where the costs say otherwise: there each request's own
    back-off judges its real acceptance. Each size's k holds in the running batch as rows join and
    leave (costs.k_for_rows, Batch._ks); logged per batch size, exported as
    specpair_speculation_k_by_rows; GetStats reports the threshold."""
    import dataclasses as dc

    from specpair.costs import STARTUP_ACCEPTANCE, STARTUP_MAX_ROWS, decide_speculation_by_rows

    if engine.drafter is None or not engine.config.enabled:
        return None
    decided = decide_speculation_by_rows(engine, max_rows or STARTUP_MAX_ROWS)
    by_rows = ", ".join(f"{d.rows}: {'k=' + str(d.k) if d.pays else 'off'} ({d.speedup:.2f}x)"
                        for d in decided["decisions"])
    threshold = max(PROVISIONAL_BATCH_SIZE_THRESHOLD, decided["threshold"])
    first = decided["decisions"][0]
    k = first.k if first.pays else engine.config.k
    progress(f"speculation by batch size, measured in {decided['seconds']:.1f} s at acceptance "
             f"{STARTUP_ACCEPTANCE}: {by_rows}; threshold {threshold}")
    engine.config = dc.replace(engine.config, batch_size_threshold=threshold, k=k)
    engine.speculation_by_rows = decided["decisions"]
    if engine.compile_mode == "on":
        engine.warm_up()      # the step buckets follow the threshold (SpeculativeEngine.step_bucket)
    return decided


def server_options(args, release: Release | None = None):
    from specpair.server.app import ServerOptions, TLSFiles
    from specpair.server.auth import read_token_file
    from specpair.server.requests import Limits
    from specpair.server.tls import DEFAULT_CONTROL_CLIENT_NAMES

    if args.insecure and (args.tls_cert or args.tls_key or args.tls_client_ca):
        raise SpecpairError("--insecure contradicts --tls-cert/--tls-key/--tls-client-ca")
    tls = None
    if not args.insecure:
        if not (args.tls_cert and args.tls_key):
            raise SpecpairError("give --tls-cert and --tls-key (optionally --tls-client-ca), "
                                "or --insecure for plaintext gRPC and HTTP")
        tls = TLSFiles(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca)
    control_files = (args.control_tls_cert, args.control_tls_key, args.control_tls_client_ca)
    control_tls = None
    if args.control_port is None:
        if any(control_files):
            raise SpecpairError("--control-tls-cert/--control-tls-key/--control-tls-client-ca need "
                                "--control-port (they are the control listener's)")
        if tuple(args.control_client_name) != DEFAULT_CONTROL_CLIENT_NAMES and not args.tls_client_ca:
            raise SpecpairError("--control-client-name needs --control-port or --tls-client-ca: without "
                                "client certificates no caller can be told from another")
    else:
        if not all(control_files):
            raise SpecpairError("--control-port needs --control-tls-cert, --control-tls-key and "
                                "--control-tls-client-ca (the control port requires mutual TLS)")
        if not 0 <= args.control_port <= 65535:
            raise SpecpairError("--control-port must be in [0, 65535] (0: any free port)")
        if args.control_port and args.control_port == args.port:
            raise SpecpairError(f"--control-port {args.control_port} is also --port")
        control_tls = TLSFiles(cert=args.control_tls_cert, key=args.control_tls_key,
                               client_ca=args.control_tls_client_ca)
    client_names = tuple(args.control_client_name)
    if not all(name.strip() for name in client_names):
        raise SpecpairError("--control-client-name must not be empty")
    for name in ("max_batch_size", "max_new_tokens_limit", "max_request_bytes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SpecpairError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_queue < 0:
        raise SpecpairError("--max-queue must be >= 0")
    if not 0 <= args.http_port <= 65535:
        raise SpecpairError("--http-port must be in [0, 65535] (0: off)")
    if not args.http_read_timeout > 0:
        raise SpecpairError("--http-read-timeout must be > 0 seconds")
    if not (args.stop_delay >= 0 and args.drain_timeout >= 0):
        raise SpecpairError("--stop-delay and --drain-timeout must be >= 0 seconds")
    token = read_token_file(args.auth_token_file) if args.auth_token_file else None
    return ServerOptions(host=args.host, port=args.port,
                         metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                         pair=release and release.name or args.pair,
                         version=release and release.version or args.version,
                         content_hash=release.content_hash if release else "",
                         max_batch_size=args.max_batch_size,
                         max_queue=args.max_queue, drain_timeout=args.drain_timeout,
                         stop_delay=args.stop_delay, tls=tls,
                         limits=Limits(max_request_bytes=args.max_request_bytes,
                                       max_new_tokens=args.max_new_tokens_limit),
                         http_port=args.http_port or None, auth_token=token,
                         http_read_timeout=args.http_read_timeout,
                         control_port=args.control_port, control_tls=control_tls,
                         control_client_names=client_names, capture=capture_settings(args))


def read_release(path: str) -> Release:
    """The release file served (the one contract operator, gate and engine read): models and
    revisions, speculation settings, pair and version, and its content hash."""
    try:
        release = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SpecpairError(f"--release {path}: {exc}") from exc
    if not (release.get("target") or {}).get("source"):
        raise SpecpairError(f"--release {path}: no target.source")
    return Release.from_dict(release)   # refused here if unservable


def serve_command(args) -> int:
    # Before torch loads OpenMP: its threads spin briefly, then sleep (specpair/openmp.py).
    from specpair.openmp import serving_wait_default, torch_loaded

    waits = {} if torch_loaded() else serving_wait_default()
    from specpair.server.app import EngineServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def progress(message: str) -> None:
        # One write: the loader thread reports while the main thread does (print writes the
        # message and its newline separately, and two threads' lines could run together).
        sys.stderr.write(f"{message}\n")
        sys.stderr.flush()

    if waits:
        progress(f"OpenMP waits: {', '.join(f'{k}={v}' for k, v in waits.items())} (no wait set; "
                 f"specpair/openmp.py)")
    release = read_release(args.release) if args.release else None
    options = server_options(args, release)
    if release is not None:
        progress(f"release {options.pair} v{options.version}, content hash {release.content_hash[:12]}")

    def load():
        engine = load_engine(args, release, progress)
        # Which cache and step serve (SPECPAIR_KV, SPECPAIR_COMPILE, the CPU kernel's build).
        progress(f"step: {json.dumps(engine.describe_step())}")
        return engine

    server = EngineServer(load, options, progress=progress)
    server.start()
    progress(f"gRPC listening on {options.host}:{server.port} ({'TLS' if options.tls else 'plaintext'})"
             + (f" and on {options.host}:{server.control_port} (control: mutual TLS, SetSpeculation for "
                f"{', '.join(options.control_client_names)})" if server.control_port else "")
             + ", health NOT_SERVING until the models are loaded"
             + (f"; metrics on :{server.metrics_port}/metrics" if server.metrics_port else "")
             + (f"; OpenAI-compatible {'HTTPS' if options.tls else 'HTTP'} on :{server.http_port}/v1"
                if server.http_port else "")
             + ("; bearer token required on the serving ports" if options.auth_token else ""))
    stop = threading.Event()

    def on_signal(signum, _frame):
        progress(f"{signal.Signals(signum).name}: "
                 + (f"leaving for {options.stop_delay:g} s, then " if options.stop_delay else "")
                 + f"draining (up to {options.drain_timeout:g} s)")
        stop.set()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The kubelet's SIGTERM may land on any of the server's threads; Python runs the handler on the
    # main thread only when that thread next runs. Waiting on an Event it ran at the wait's
    # timeout, up to 0.5 s late: the drain began after requests that were in flight had ended and
    # new ones were admitted. The signal's byte on this pipe wakes the main thread at once.
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    # Until a signal, or until loading fails (then the pod should restart, not sit NOT_SERVING).
    while not stop.is_set() and server.phase != "failed":
        if select.select([wake_read], [], [], 0.5)[0]:
            os.read(wake_read, 512)
    if server.phase == "failed":     # the reason is already printed by the loader
        server.stop(0)
        return 2
    result = server.stop()
    progress(f"stopped ({result['drained']} in-flight requests finished while draining, "
             f"{result['aborted']} ended by the drain timeout)")
    # The process ends next: frozen, the objects torch and transformers made are left out of the
    # interpreter's last collection, which took 2-5 s of CPU in every stopping engine pod (a
    # rollout's old pods stop beside the new ones starting).
    gc.freeze()
    return 0


# -- generate --------------------------------------------------------------------------------------

def generate_command(args) -> int:
    import grpc

    from specpair._proto import engine_pb2 as pb
    from specpair.server.client import EngineClient, request

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": prompt}]
    req = request(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed, stop=args.stop, speculation_k=args.k,
                  category=args.category)
    from specpair.server.auth import read_token_file

    token = read_token_file(args.auth_token_file) if args.auth_token_file else None
    client = EngineClient(args.address, token=token, insecure=args.insecure, ca=args.ca, cert=args.cert,
                          key=args.key, server_name=args.server_name)
    text, token_ids, last = [], [], None
    try:
        for msg in client.stream(req, timeout=args.timeout):
            text.append(msg.text)
            token_ids.extend(msg.token_ids)
            last = msg
            if not args.json:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
    except grpc.RpcError as exc:
        if not args.json:
            sys.stdout.write("\n")
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    stats, timings = last.stats, last.timings
    if args.json:
        print(json.dumps({"text": "".join(text), "token_ids": token_ids,
                          "finish_reason": pb.FinishReason.Name(last.finish_reason),
                          "usage": plain(last.usage), "timings": plain(timings), "stats": plain(stats)}))
    else:
        sys.stdout.write("\n")
        print(f"[{last.usage.completion_tokens} tokens in {timings.total_seconds:.2f} s, first after "
              f"{timings.time_to_first_token_seconds:.2f} s; acceptance {stats.acceptance_rate:.2f}, "
              f"mean acceptance length {stats.mean_acceptance_length:.2f}]", file=sys.stderr)
    return 0


def plain(message) -> dict:
    """A flat protobuf message as JSON-ready values (json_format would quote 64-bit ints)."""
    from specpair.server.requests import is_repeated
    return {f.name: list(getattr(message, f.name)) if is_repeated(f) else getattr(message, f.name)
            for f in message.DESCRIPTOR.fields}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specpair")
    subparsers = parser.add_subparsers(dest="command", metavar="{engine}")
    subparsers.required = True
    add_engine_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecpairError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
