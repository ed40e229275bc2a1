"""A real `mlflow server` for the tests that need one (the operator's, the model fetch's)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# MLflow's Flask app under gunicorn (one of the servers `mlflow server` offers; uvicorn is its
# default) with threads, as uvicorn runs the same Flask handlers in a thread pool: measured on
# this 2-core machine, a start took 8.6 CPU-s against 10.2 and a registered-model read 7.5 ms of
# CPU against 12 (uvicorn's ASGI-to-WSGI bridge), and the suite makes ~9,000 such calls. The
# timeout is gunicorn's for a request a loaded machine makes slow (its default is 30 s).
GUNICORN_OPTS = "--threads 8 --timeout 300"


class MlflowServer:
    """`mlflow server` with a sqlite store on loopback; stop()/start() keep the same data."""

    def __init__(self, root: Path, args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.args, self.env = tuple(args), dict(env or {})

    def start(self, timeout: float = 90) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1", "--gunicorn-opts", GUNICORN_OPTS, *self.args],
            stdout=open(self.root / "server.log", "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("mlflow server did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # our own process group (start_new_session)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(5)
        self.proc = None
