"""Fixtures for the operator tests: a real MLflow server, the API emulator, and stand-ins for
what a cluster would run (kubelet, Deployment/Job controllers, engine pods).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

# Before the handlers module is imported: its timer interval is fixed at decoration time.
os.environ.setdefault("SPECPAIR_RECONCILE_INTERVAL", "0.4")
os.environ.setdefault("SPECPAIR_WATCH_TIMEOUT", "30")

from kube_emulator import KubeEmulator  # noqa: E402  (tests/operator is on sys.path via rootdir conftest)

from standins import CRD, free_port  # noqa: E402


class MlflowServer:
    """`mlflow server` with a sqlite store on loopback; stop()/start() keep the same data."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
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


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.stop()


class EmulatorThread:
    """The emulator on its own event loop thread, so sync tests and Kopf's thread can use it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.emu: KubeEmulator = self.call_sync(self._make)
        self.url = self.call(self.emu.start())

    @staticmethod
    def _make() -> KubeEmulator:
        emu = KubeEmulator()
        emu.load_crd(str(CRD))
        return emu

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_sync(self, fn: Callable[[], Any]) -> Any:
        async def wrap() -> Any:
            return fn()
        return self.call(wrap())

    # shorthand for tests: (apiVersion, kind-or-plural)
    def rt(self, api_version: str, kind: str) -> Any:
        return self.emu.find_type(api_version, kind)

    def get(self, api_version: str, kind: str, ns: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self.call_sync(lambda: json.loads(json.dumps(self.emu.get(self.rt(api_version, kind), ns, name))))
        except Exception:  # noqa: BLE001 - ApiError 404
            return None

    def list(self, api_version: str, kind: str, ns: str | None = None, selector: str | None = None) -> list[dict]:
        return self.call_sync(lambda: self.emu.list(self.rt(api_version, kind), ns, selector))

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self.call(self.emu.create(self.rt(obj["apiVersion"], obj["kind"]), obj["metadata"].get("namespace"), obj))

    def patch(self, api_version: str, kind: str, ns: str | None, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        return self.call(self.emu.patch(self.rt(api_version, kind), ns, name, patch, "application/merge-patch+json",
                                        subresource))

    def stop(self) -> None:
        self.call(self.emu.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def kube():
    emu = EmulatorThread()
    yield emu
    emu.stop()


@pytest.fixture
def kubeconfig(kube: EmulatorThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": kube.url}}],
        "users": [{"name": "emu", "user": {"token": "test"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": "default"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path
