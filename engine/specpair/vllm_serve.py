"""`python -m specpair.vllm_serve --release FILE`: an engine pod of a vLLM release.

The operator starts vLLM pods through this, as it starts ours through `specpair engine serve
--release`: the release file (mounted from the pod's annotation) is the one description of what
is served. Model sources are resolved by our loader (hub ids, local directories, our embedded
default, MLflow models), the speculative config and the serving flags (parallel sizes, memory,
context, quantization) come from the release by the one mapping (vllm_peer.speculative_config,
vllm_peer.serving_flags), and then this process becomes vLLM's OpenAI server (exec), so
signals and the exit code are vLLM's own.

In a pod (`--uds`) this process stays as vLLM's parent instead of becoming it: told to stop, it
holds vLLM's SIGTERM back until the pod's companion has drained (`supervise`), so no request the
companion accepted meets a vLLM that is shutting down (vLLM 0.32 answers such a request with an
empty 200 stream). Everywhere else (`--host`/`--port`) it execs vLLM.

Identity: besides the pair's name (what clients send as "model"), vLLM serves
`identity_name(...)`: pair, release version, the release file's content hash and whether
speculation is on. It is the first served name, because vLLM labels its /metrics with the first
one only (`model_name`), which the autoscaler's queries match. In an engine pod vLLM listens on a
Unix socket (`--uds`) behind the pod's companion (specpair.vllm_companion), which reads the
identity back from /v1/models for the operator's GetModelInfo, applies the pair's token and
counts each request by category. vLLM also names the first served name as the `model` of its
replies.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

from specpair.contract import content_hash
from specpair.errors import SpecpairError

IDENTITY_PREFIX = "specpair"
# An engine pod's vLLM listens on a Unix socket in a volume its two containers share, behind
# the pod's companion (specpair.vllm_companion), which needs each reply's timings and acceptance.
VLLM_SOCKET_DIR = "/var/run/specpair/vllm"
VLLM_SOCKET = f"{VLLM_SOCKET_DIR}/vllm.sock"
VLLM_PER_REQUEST_FLAGS = ("--enable-per-request-metrics",)
VLLM_SPEC_DECODE_FLAGS = ("--per-request-spec-decode-metrics", "summary")
# On SIGTERM a pod's vLLM finishes the requests in flight for up to this long (vLLM's default, 0,
# aborts them), as its companion does: within the pod's default 30 s grace period.
POD_DRAIN_SECONDS = 25
# The companion writes this file beside the socket once it has drained (nothing in flight, new
# requests refused with 503): the pod's vLLM is sent SIGTERM only then (`supervise`).
DRAINED_MARKER = "companion-drained"
# After the drain vLLM has nothing in flight; this bounds its own shutdown before SIGKILL.
VLLM_STOP_SECONDS = 10
# sockaddr_un holds 108 bytes with its terminator; a mounted volume's path can be longer.
UNIX_PATH_MAX = 107


def reachable_socket_path(path: str) -> str:
    """`path` as this process binds or connects to it: a path too long for a Unix socket address
    is reached relative to its folder (the process moves there; both sides of the pod's socket
    do the same)."""
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        return path
    folder, name = os.path.split(path)
    os.chdir(folder)
    return f"./{name}"


def drained_marker(socket_path: str) -> str:
    """Where the companion in front of the socket at `socket_path` says it has drained (the
    volume both containers mount)."""
    return os.path.join(os.path.dirname(socket_path), DRAINED_MARKER)


def _die_with_parent() -> None:
    """In vLLM's process, before it runs: SIGKILL when its supervisor dies (a SIGKILL at the end
    of the pod's grace period reaches the supervisor's process group, not vLLM's session)."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def supervise(cmd: list[str], env: dict[str, str], marker: str, drain_wait: float,
              stop_seconds: float = VLLM_STOP_SECONDS, poll: float = 0.1) -> int:
    """Run vLLM (`cmd`) as a child in a session of its own until it exits, or until this process
    is sent SIGTERM or SIGINT: then wait for the companion's `marker` (at most `drain_wait`
    seconds: a companion that died writes none), pass SIGTERM on to vLLM, and SIGKILL what is
    left of its session after `stop_seconds`. Returns vLLM's exit status (128 + signal where a
    signal ended it), as the container's own."""
    try:
        os.unlink(marker)           # one a companion of an earlier life of the pod left
    except FileNotFoundError:
        pass
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stopping.set())
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_die_with_parent)
    try:
        while proc.poll() is None and not stopping.wait(poll):
            pass
        if proc.poll() is None:
            deadline = time.monotonic() + drain_wait
            while not os.path.exists(marker) and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(poll)
            said = "the companion drained" if os.path.exists(marker) else f"no drained companion in {drain_wait:g} s"
            print(f"specpair.vllm_serve: {said}; stopping vLLM", file=sys.stderr, flush=True)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(stop_seconds)
            except subprocess.TimeoutExpired:
                pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # vLLM's workers, and vLLM if it is still up
        except (ProcessLookupError, PermissionError):
            pass
        code = proc.wait()
    return 128 - code if code < 0 else code


def identity_name(pair: str, version: str, digest: str, speculating: bool) -> str:
    return f"{IDENTITY_PREFIX}:{pair}:v{version}:{digest}:{'spec' if speculating else 'nospec'}"


def parse_identity_name(name: str) -> dict | None:
    """identity_name's fields (the operator reads them from /metrics or /v1/models), or None for other names."""
    parts = name.split(":")
    if len(parts) != 5 or parts[0] != IDENTITY_PREFIX or not parts[2].startswith("v") or parts[4] not in ("spec", "nospec"):
        return None
    return {"pair": parts[1], "version": parts[2][1:], "digest": parts[3], "speculating": parts[4] == "spec"}


def command(release: dict, *, python: str, host: str, port: int, speculation: bool, enforce_eager: bool,
            progress=print, uds: str | None = None, max_num_seqs: int | None = None) -> list[str]:
    """vLLM's command line for the release. `uds`: listen on that Unix socket instead of host and
    port (behind the pod's companion, specpair.vllm_companion), with the per-request timings and
    acceptance in every reply the companion counts by category. `max_num_seqs`: the most requests
    in vLLM's running batch (the pair's rollout.maxBatchSize; a pod's setting, not the release's:
    None leaves vLLM's default), the rest wait in its queue (vllm:num_requests_waiting)."""
    from specpair.gate.vllm import dtype_of
    from specpair.models import resolve_source
    from specpair.vllm_peer import flags_argv, serving_flags, speculative_config

    target = str(resolve_source(release["target"].get("source") or "default", progress))
    draft = dict(release.get("draft") or {})
    if draft.get("source"):
        draft["source"] = str(resolve_source(draft["source"], progress))
    spec = speculative_config({**release, "draft": draft}) if speculation else None
    version = str((release.get("mlflow") or {}).get("version") or "0")
    pair = str(release.get("pair") or "specpair")
    listen = ["--uds", reachable_socket_path(uds)] if uds else ["--host", host, "--port", str(port)]
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--dtype", dtype_of(release),
           *listen, "--generation-config", "vllm",
           "--served-model-name", identity_name(pair, version, content_hash(release), spec is not None), pair,
           *flags_argv(serving_flags(release))]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(int(max_num_seqs))]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    if uds:
        # vLLM refuses the acceptance flag without speculation.
        cmd += [*VLLM_PER_REQUEST_FLAGS, *(VLLM_SPEC_DECODE_FLAGS if spec is not None else ()),
                "--shutdown-timeout", str(POD_DRAIN_SECONDS)]
    return cmd


def main(argv: list[str] | None = None) -> int:
    from specpair.gate.vllm import vllm_python

    ap = argparse.ArgumentParser(prog="python -m specpair.vllm_serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--release", required=True, help="the release JSON (engine.kind vllm)")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000, help="vLLM's OpenAI API, /health and /metrics")
    ap.add_argument("--uds", help="listen on this Unix socket instead (behind the pod's specpair.vllm_companion)")
    ap.add_argument("--no-speculation", action="store_true",
                    help="serve target-only (the operator's SpeculationOff for vLLM: a re-rollout)")
    ap.add_argument("--enforce-eager", action="store_true", help="no compilation or graphs (CPU nodes)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the most requests vLLM runs together (its --max-num-seqs; the pair's rollout.maxBatchSize)")
    ap.add_argument("--dry-run", action="store_true", help="print the vLLM command line and exit")
    ap.add_argument("--stop-delay", type=float, default=0.0,
                    help="with --uds: the companion's stop delay (it serves that long after SIGTERM)")
    ap.add_argument("--drain-timeout", type=float, default=float(POD_DRAIN_SECONDS),
                    help="with --uds: the companion's drain timeout; vLLM is sent SIGTERM once the companion "
                         "has drained, or at the latest after stop delay + drain timeout + "
                         f"{VLLM_STOP_SECONDS} s")
    args = ap.parse_args(argv)
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        ap.error(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    try:
        with open(args.release) as f:
            release = json.load(f)
        if (release.get("engine") or {}).get("kind") != "vllm":
            raise SpecpairError(f"{args.release} is not a vLLM release (engine.kind is "
                                f"{(release.get('engine') or {}).get('kind', 'specpair')!r})")
        progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
        python = vllm_python()
        cmd = command(release, python=python, host=args.host, port=args.port, speculation=not args.no_speculation,
                      enforce_eager=args.enforce_eager, progress=progress, uds=args.uds,
                      max_num_seqs=args.max_num_seqs)
    except (OSError, ValueError, KeyError, SpecpairError) as exc:
        print(f"specpair.vllm_serve: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps(cmd))
        return 0
    from specpair.vllm_peer import VllmServer

    # The same environment as every vLLM we start (sources are local directories by now).
    env = VllmServer(python, ".").environment()
    if args.uds:
        print(f"run: {' '.join(cmd)}", file=sys.stderr, flush=True)
        return supervise(cmd, env, drained_marker(args.uds), args.stop_delay + args.drain_timeout + VLLM_STOP_SECONDS)
    print(f"exec: {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
