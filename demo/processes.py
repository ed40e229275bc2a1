"""Child processes of the demo (MLflow, the operator, gate Jobs, engine pods): each in its own
process group, so stopping one stops everything it spawned (uvicorn workers, gate subprocesses),
and all of them are stopped on exit, on errors and on Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Children:
    """Every process the demo starts, so one call stops them all (terminate, then kill)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.lock = threading.Lock()

    def start(self, cmd: list[str], log: Path, env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        with self.lock:
            self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, grace: float = 10.0) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # its own group (start_new_session)
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
            except ProcessLookupError:
                pass
        else:
            # The leader is gone; a child it left behind (a gate's `specpair gate`) may not be.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        with self.lock:
            if proc in self.procs:
                self.procs.remove(proc)

    def stop_all(self) -> None:
        with self.lock:
            procs = list(reversed(self.procs))
        for proc in procs:
            self.stop(proc, grace=5.0)


def wait_http_ok(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} did not come up, its process exited:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s:\n{tail(log)}")


def tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def start_mlflow(children: Children, root: Path, timeout: float = 300.0) -> str:
    """`mlflow server` on loopback with a sqlite store; job execution off keeps it at 2 processes.
    Up to 300 s to answer: at load 22-27 (2026-12-07, nice 5) it missed 120 s twice."""
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = root / "logs" / "mlflow.log"
    proc = children.start(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--artifacts-destination", str(root / "mlartifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"], log, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(url + "/health", proc, log, timeout)
    return url
