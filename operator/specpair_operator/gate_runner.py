"""Entry point of the gate Job: run `specpair gate` on the release, record the verdict in MLflow.

The operator reads the verdict from the model version's tags, so the Job needs no write access
to Kubernetes. A gate that fails its thresholds is a result (exit 0, status `failed`); a gate
that crashes without a verdict is an error (status `error`, exit 1).

MLflow is not where the operator's trust ends: anyone who may write a model version's tags could
write a passing verdict. So the runner also writes the verdict's digest to its termination
message, which only the kubelet puts into the pod's status, and the operator promotes a release
only when the verdict in MLflow has that digest (gate_verdict.verdict_digest).

    python -m specpair_operator.gate_runner --release /etc/specpair/release.json \
        --termination-log /dev/termination-log
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import tempfile

from .gate_verdict import unusable_message, verdict_digest, verdict_problems
from .registry import ReleaseRegistry


def write_termination_message(path: str | None, message: dict) -> None:
    """The kubelet creates the file before the container starts; elsewhere (a developer running
    the gate by hand) there is none, and nothing is written."""
    if path and os.path.exists(path):
        with open(path, "w") as f:
            f.write(json.dumps(message, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specpair_operator.gate_runner")
    ap.add_argument("--release", required=True, help="release JSON (with its mlflow block)")
    ap.add_argument("--gate-command", default=os.environ.get("SPECPAIR_GATE_COMMAND", "specpair gate"),
                    help="command that takes --release FILE --out VERDICT.json")
    ap.add_argument("--termination-log", default=os.environ.get("SPECPAIR_TERMINATION_LOG", "/dev/termination-log"),
                    help="the container's terminationMessagePath: the verdict's digest goes there")
    args = ap.parse_args(argv)
    with open(args.release) as f:
        rel = json.load(f)
    ml = rel.get("mlflow") or {}
    tracking_uri = ml.get("trackingUri") or os.environ.get("MLFLOW_TRACKING_URI")
    if not (tracking_uri and ml.get("modelName") and ml.get("version")):
        print("release has no mlflow block (trackingUri, modelName, version)", file=sys.stderr)
        return 2
    registry = ReleaseRegistry(tracking_uri, attempts=6, backoff_s=1.0)
    workdir = tempfile.mkdtemp(prefix="specpair-gate-")
    out = os.path.join(workdir, "verdict.json")
    cmd = [*shlex.split(args.gate_command), "--release", args.release, "--out", out]
    # Stream the gate's progress as it happens (`kubectl logs -f` on the Job shows it live) and
    # keep the last lines for the error message if it ends without a verdict.
    tail: collections.deque[str] = collections.deque(maxlen=20)
    proc = subprocess.Popen(cmd, stdout=sys.stdout, stderr=subprocess.PIPE, text=True, bufsize=1)
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
        registry.record_gate_error(ml["modelName"], str(ml["version"]),
                                   f"gate exited {proc.returncode} without a verdict: " + " | ".join(last))
        return 1
    problems = verdict_problems(verdict)
    if problems:
        # A verdict that is not one (a NaN passes every threshold, a string where a mapping
        # belongs) is the gate's error, recorded as such and never as a verdict. Exit 0: the
        # Job is done, since running the same gate again writes the same verdict.
        registry.record_gate_error(ml["modelName"], str(ml["version"]), unusable_message(problems))
        return 0
    extras = [os.path.join(workdir, n) for n in os.listdir(workdir) if n != "verdict.json"]
    run_id = registry.record_gate(ml["modelName"], str(ml["version"]), verdict, extras)
    digest = verdict_digest(verdict)
    write_termination_message(args.termination_log, {"version": str(ml["version"]), "passed": verdict["passed"],
                                                     "verdictSha256": digest})
    print(json.dumps({"passed": verdict["passed"], "mlflowRunId": run_id, "verdictSha256": digest}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
