"""Entry point of the gate Job: run `specpair gate` on the release, record the verdict in MLflow.

The operator reads the verdict from the model version's tags, so the Job needs no write access
to Kubernetes. A gate that fails its thresholds is a result (exit 0, status `failed`). A gate
that ends without a verdict, or MLflow unreachable until the runner's deadline (it retries with
backoff until then, so an outage shorter than that costs nothing), is no result: exit 1 with the
cause in the termination message, and the operator runs the gate again a bounded number of times
(gate/attempts.py); only a verdict fails a release.

MLflow is not where the operator's trust ends: anyone who may write a model version's tags could
write a passing verdict. So the runner also writes the verdict's digest to its termination
message, which only the kubelet puts into the pod's status, and the operator promotes a release
only when the verdict in MLflow has that digest (gate/verdict.py's verdict_digest).

    python -m specpair_operator.gate.runner --release /etc/specpair/release.json \
        --termination-log /dev/termination-log
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import IO, Callable, TypeVar

from specpair_operator.gate import attempts as gate_attempts
from specpair_operator.gate.verdict import unusable_message, verdict_digest, verdict_problems
from specpair_operator.gate.record import GateRecord
from specpair_operator.release.registry_contract import RegistryUnavailable

T = TypeVar("T")
# Room left before the Job's activeDeadlineSeconds to write the termination message: Kubernetes
# kills the pod at the deadline, and a killed runner reports nothing.
DEADLINE_MARGIN_S = 15.0
BACKOFF_CAP_S = 15.0


def write_termination_message(path: str | None, message: dict) -> None:
    """The kubelet creates the file before the container starts; elsewhere (a developer running
    the gate by hand) there is none, and nothing is written."""
    if path and os.path.exists(path):
        with open(path, "w") as f:
            f.write(json.dumps(message, sort_keys=True))


def until_deadline(call: Callable[[], T], deadline: float, what: str,
                   sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> T:
    """`call`, again after each RegistryUnavailable (1 s doubling to BACKOFF_CAP_S) until the
    monotonic `deadline`; then the last RegistryUnavailable, saying how long MLflow was tried."""
    started, delay = clock(), 1.0
    while True:
        try:
            return call()
        except RegistryUnavailable as exc:
            left = deadline - clock()
            if left <= 0:
                raise RegistryUnavailable(f"{exc} (tried for {clock() - started:.0f}s to {what})") from exc
            print(f"MLflow unreachable ({exc}); {what}: again in {min(delay, left):.0f}s", file=sys.stderr)
            sleep(min(delay, left))
            delay = min(delay * 2, BACKOFF_CAP_S)


def report_failure(path: str | None, version: str, cause: str, message: str) -> int:
    """No verdict: the cause goes to the operator (termination message); exit 1."""
    print(f"{cause}: {message}", file=sys.stderr)
    write_termination_message(path, gate_attempts.failure_report(version, cause, message))
    return 1


def own_specpair_arguments(command: list[str]) -> list[str] | None:
    """The arguments of `command` when it runs this interpreter's own `specpair` CLI: a `specpair`
    console script whose `#!` line names this interpreter, or `<this python> -m specpair ...`
    (paths compared as written: a virtualenv's python is a link to the same base interpreter as
    another virtualenv's, with other packages). Any other command (another interpreter, a
    stand-in, vLLM's) gives None, as does a `specpair` this interpreter cannot import."""
    if not command:
        return None
    found = shutil.which(command[0])
    if not found:
        return None
    here = os.path.abspath(sys.executable)
    if os.path.basename(command[0]) == "specpair":
        try:
            with open(found, "rb") as script:
                first = script.readline(4096).decode(errors="replace")
        except OSError:
            return None
        runs = shlex.split(first[2:]) if first.startswith("#!") else []
        own, arguments = bool(runs) and os.path.abspath(runs[0]) == here, command[1:]
    else:
        own, arguments = command[1:3] == ["-m", "specpair"] and os.path.abspath(found) == here, command[3:]
    if not own or importlib.util.find_spec("specpair") is None:
        return None
    return arguments


class ForkedGate:
    """The gate as a forked child running the `specpair` CLI (the part of subprocess.Popen the
    runner uses: stderr, wait, returncode). Why: a child forked from this process starts with
    what this process imported; on a node whose pods start from an interpreter that imported
    torch already (the devcluster's warm python) that is most of a tiny-model gate's start (torch
    ~4 of a gate's 7-27 CPU-seconds). The runner itself imports nothing of the engine: the child
    does, as the fresh `specpair gate` did. Its own process still: a gate that crashes or is
    killed ends only itself, and the runner reports it as before."""

    def __init__(self, arguments: list[str]):
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:                       # the gate
            os.close(read_end)
            os.dup2(write_end, 2)
            os.close(write_end)
            try:
                status = importlib.import_module("specpair.cli").main(arguments)
            except SystemExit as exc:         # argparse's errors, sys.exit("message")
                status = exc.code
            except BaseException:
                traceback.print_exc()
                status = 1
            if status is not None and not isinstance(status, int):
                print(status, file=sys.stderr)  # as Python ends on sys.exit("message")
                status = 1
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            # The interpreter's teardown is the parent's: this child ends as the fresh gate ended
            # its own process, without running this process's exit handlers a second time.
            os._exit(status or 0)
        os.close(write_end)
        self.stderr: IO[str] = os.fdopen(read_end, "r", buffering=1)
        self.returncode: int | None = None

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            self.stderr.close()
        return self.returncode


def start_gate(command: list[str]) -> subprocess.Popen | ForkedGate:
    """The gate command, its stderr piped: forked in place when it is this interpreter's own
    `specpair` (ForkedGate), a new process otherwise."""
    own = own_specpair_arguments(command)
    if own is not None:
        print(f"gate: {shlex.join(command)} (this interpreter's own specpair: forked)", file=sys.stderr)
        return ForkedGate(own)
    return subprocess.Popen(command, stdout=sys.stdout, stderr=subprocess.PIPE, text=True, bufsize=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specpair_operator.gate.runner")
    ap.add_argument("--release", required=True, help="release JSON (with its mlflow block)")
    ap.add_argument("--gate-command", default=os.environ.get("SPECPAIR_GATE_COMMAND", "specpair gate"),
                    help="command that takes --release FILE --out VERDICT.json")
    ap.add_argument("--termination-log", default=os.environ.get("SPECPAIR_TERMINATION_LOG", "/dev/termination-log"),
                    help="the container's terminationMessagePath: the verdict's digest goes there")
    ap.add_argument("--deadline-seconds", type=float, default=3600.0,
                    help="the Job's activeDeadlineSeconds: MLflow is retried until shortly before it")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + max(args.deadline_seconds - DEADLINE_MARGIN_S, args.deadline_seconds / 2)
    # One bounded HTTP try per call: backoff and deadline are until_deadline's (MLflow's own
    # client reads these where it uploads artifacts the tracking server does not proxy).
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    with open(args.release) as f:
        rel = json.load(f)
    ml = rel.get("mlflow") or {}
    tracking_uri = ml.get("trackingUri") or os.environ.get("MLFLOW_TRACKING_URI")
    if not (tracking_uri and ml.get("modelName") and ml.get("version")):
        print("release has no mlflow block (trackingUri, modelName, version)", file=sys.stderr)
        return 2
    try:
        registry = GateRecord(tracking_uri)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    version = str(ml["version"])
    workdir = tempfile.mkdtemp(prefix="specpair-gate-")
    out = os.path.join(workdir, "verdict.json")
    cmd = [*shlex.split(args.gate_command), "--release", args.release, "--out", out]
    # Stream the gate's progress as it happens (`kubectl logs -f` on the Job shows it live) and
    # keep the last lines for the error message if it ends without a verdict.
    tail: collections.deque[str] = collections.deque(maxlen=20)
    started_ms = int(time.time() * 1000)      # the gate run's start in MLflow: when the gate began
    proc = start_gate(cmd)
    for line in proc.stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
        tail.append(line.rstrip("\n"))
    proc.wait()
    verdict = None
    if os.path.exists(out):
        try:
            with open(out) as f:
                verdict = json.load(f)
        except ValueError:
            verdict = None
    if not isinstance(verdict, dict) or not isinstance(verdict.get("passed"), bool):
        last = [line for line in tail if line.strip()][-5:]
        return report_failure(args.termination_log, version, gate_attempts.GATE_CRASHED,
                              f"gate exited {proc.returncode} without a verdict: " + " | ".join(last))
    problems = verdict_problems(verdict)
    if problems:
        # A verdict that is not one (a NaN passes every threshold, a string where a mapping
        # belongs) is the gate's error, recorded as such and never as a verdict. Exit 0: the
        # Job is done, since running the same gate again writes the same verdict.
        try:
            until_deadline(lambda: registry.record_gate_error(ml["modelName"], version, unusable_message(problems)),
                           deadline, f"record the gate error of v{version}")
        except RegistryUnavailable as exc:
            return report_failure(args.termination_log, version, gate_attempts.MLFLOW_UNREACHABLE,
                                  f"gate error not recorded: {exc}")
        return 0
    extras = [os.path.join(workdir, n) for n in os.listdir(workdir) if n != "verdict.json"]
    try:
        run_id = until_deadline(
            lambda: registry.record_gate(ml["modelName"], version, verdict, extras, rel, started_ms), deadline,
            f"record the verdict of v{version}")
    except RegistryUnavailable as exc:
        return report_failure(args.termination_log, version, gate_attempts.MLFLOW_UNREACHABLE,
                              f"verdict not recorded: {exc}")
    digest = verdict_digest(verdict)
    write_termination_message(args.termination_log, {"version": str(ml["version"]), "passed": verdict["passed"],
                                                     "verdictSha256": digest})
    print(json.dumps({"passed": verdict["passed"], "mlflowRunId": run_id, "verdictSha256": digest}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
