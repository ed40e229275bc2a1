"""A real `mlflow server` for the tests that need one (the operator's, the model fetch's)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
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


def basic_auth_config(root: Path, admin: tuple[str, str], default_permission: str) -> dict[str, str]:
    """The environment of an `mlflow server --app-name basic-auth` whose users live in root/auth.db,
    with `admin` as its admin. Checked credentials are remembered for 5 minutes (MLflow's
    `auth_cache_ttl_seconds`; its default 0 checks each request's password hash again): measured
    on this 2-core machine a request cost the server 400 ms of CPU without it and 15 ms with it,
    and the operator reads the registry a few times on every pass. Only a correct password is
    remembered: a wrong one is refused as before."""
    ini = root / "basic_auth.ini"
    ini.write_text(f"[mlflow]\ndefault_permission = {default_permission}\n"
                   f"database_uri = sqlite:///{root}/auth.db\n"
                   f"admin_username = {admin[0]}\nadmin_password = {admin[1]}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                   "auth_cache_ttl_seconds = 300\n")
    return {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": uuid.uuid4().hex}


class MlflowServer:
    """`mlflow server` with a sqlite store on loopback; stop()/start() keep the same data."""

    def __init__(self, root: Path, args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.args, self.env = tuple(args), dict(env or {})

    # A wait, not a speed check: MLflow's imports took over 90 s to answer /health while the
    # machine ran 30-50 jobs on 2 cores (2026-12-06); a quiet start is a few seconds.
    def start(self, timeout: float = 240) -> None:
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
        raise RuntimeError(f"mlflow server did not answer /health within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # our own process group (start_new_session)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(5)
        self.proc = None


def load_table(client, tracking_uri: str, experiment_id: str, path: str, run_id: str):
    """`MlflowClient.load_table` finds its runs through mlflow's global tracking URI, not the
    client's own; other tests in the same worker set that URI to their own servers
    (`mlflow.set_tracking_uri`), which an environment variable does not override. So the URI is
    set for the one call and put back."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(tracking_uri):
        return client.load_table(experiment_id, path, run_ids=[run_id])


def get_trace(client, tracking_uri: str, trace_id: str):
    """`MlflowClient.get_trace`: its spans, kept as an artifact, are downloaded through mlflow's
    global tracking URI too (load_table's case)."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(tracking_uri):
        return client.get_trace(trace_id)
