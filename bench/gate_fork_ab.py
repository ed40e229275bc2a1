"""What forking the gate saves: the gate runner, itself forked from an interpreter that imported
torch (as a devcluster node's warm python is), runs a tiny-model `specpair gate` (no sweeps)
forked (`<python> -m specpair gate`, the runner's own) and as a new process (`env <python> -m
specpair gate`: another command to the runner), in turns, against a real MLflow server; prints
each run's seconds and CPU-seconds (the runner and the gate together).

    .venv/bin/python bench/gate_fork_ab.py [--runs 3]

Figures: docs/testing.md, "The gate forked too" (2026-11-27).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import numpy  # noqa: E402,F401  (the warm python's modules: devcluster warm_python.WARM_MODULES)
import scipy.optimize  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401

from mlflow_server import MlflowServer  # noqa: E402
from specpair_operator.release import content as release  # noqa: E402
from specpair_operator.clients.registry import ReleaseRegistry  # noqa: E402

PROMPTS = [{"prompt": "def add(a, b):", "category": "code"}, {"prompt": "The quick brown fox", "category": "qa"}]


def tiny_pair(root: Path) -> dict[str, str]:
    """Saved in a child: transformers stays out of this process, as it is out of the warm python."""
    code = ("import sys; sys.path.insert(0, 'tests'); from tiny_models import make_tokenizer, make_model, save_tiny; "
            f"t = make_tokenizer(); save_tiny(make_model(t, seed=1), {str(root / 'target')!r}); "
            f"save_tiny(make_model(t, seed=2, layers=1), {str(root / 'draft')!r})")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)
    return {"target": str(root / "target"), "draft": str(root / "draft")}


def run_gate(reg: ReleaseRegistry, url: str, root: Path, dirs: dict[str, str], command: str) -> tuple[int, float, float]:
    model = f"ab-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/ab")
    spec = {"target": {"source": dirs["target"]}, "draft": {"source": dirs["draft"]}, "speculation": {"k": 3},
            "gating": {"maxNewTokens": 8, "tuning": {"kValues": [], "batchSizes": []}}}
    rel = release.build_release("ab", "ns", spec, PROMPTS)
    version = reg.ensure_release(model, rel, release.content_hash(rel))
    path = root / f"{model}.json"
    path.write_text(json.dumps(release.with_mlflow(rel, url, model, version)))
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    pid = os.fork()
    if pid == 0:                        # the gate pod's runner, forked warm
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        from specpair_operator.gate import runner as gate_runner
        os._exit(gate_runner.main(["--release", str(path), "--gate-command", command, "--termination-log", ""]))
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return status, time.monotonic() - started, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gate-fork-ab-"))
    dirs = tiny_pair(root)
    assert "transformers" not in sys.modules
    (root / "mlflow").mkdir()
    server = MlflowServer(root / "mlflow")
    server.start()
    try:
        reg = ReleaseRegistry(server.url)
        py = sys.executable
        for _ in range(args.runs):
            for name, command in (("forked", f"{py} -m specpair gate"), ("new process", f"env {py} -m specpair gate")):
                status, seconds, cpu = run_gate(reg, server.url, root, dirs, command)
                print(f"{name:12s} exit {status}  {seconds:5.2f} s  {cpu:5.2f} CPU-s", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
