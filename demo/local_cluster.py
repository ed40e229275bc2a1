"""A cluster on one machine: the Kubernetes API emulator plus a local runtime standing in for
the kubelet and the Job/Deployment controllers.

The API is the emulator the operator tests use (tests/operator/kube_emulator.py, imported from
there so there is one emulator, tested in one place). The runtime watches Jobs and Deployments
in one namespace and runs what their pod templates say, as local processes:

- a gate Job runs its container command (`python -m specpair_operator.gate_runner`) with the
  release file its pod would get from the downward API; its exit code becomes the Job's
  Complete/Failed condition;
- a Deployment's pod runs its container command (`specpair engine serve ...`) on 127.0.0.1;
  it becomes Ready when gRPC health says SERVING, as the pod's gRPC readiness probe would.

What differs from a cluster, and why: all pods share one network namespace, so a new pod can
only bind the engine port after the old one is gone (a roll is stop-then-start, not surge);
metrics ports are picked free instead of 9400 for the same reason; pods use this machine's
model cache and HOME instead of their emptyDir volumes, so the embedded model is converted
once per machine, not once per pod.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from specpair_operator import manifests

from .processes import Children, free_port, tail

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "specmodelpair.yaml"
# The emulator lives with the operator tests, which exercise and test it; the demo imports it
# from there rather than keeping a second copy.
sys.path.insert(0, str(REPO / "tests" / "operator"))
from kube_emulator import KubeEmulator  # noqa: E402


class LocalApi:
    """The emulator served over HTTP from its own event-loop thread; sync helpers for the demo."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kube-api", daemon=True)
        self.thread.start()
        self.emu: KubeEmulator = self._sync(self._make)
        self.url: str = self._run(self.emu.start())

    @staticmethod
    def _make() -> KubeEmulator:
        emu = KubeEmulator()
        emu.load_crd(str(CRD))
        return emu

    def _run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _sync(self, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            return fn()
        return self._run(call())

    def _rt(self, api_version: str, kind: str) -> Any:
        return self.emu.find_type(api_version, kind)

    def get(self, api_version: str, kind: str, ns: str | None, name: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any] | None:
            try:
                return json.loads(json.dumps(self.emu.get(self._rt(api_version, kind), ns, name)))
            except Exception:  # noqa: BLE001 - the emulator's ApiError 404
                return None
        return self._sync(read)

    def list(self, api_version: str, kind: str, ns: str | None = None, selector: str | None = None) -> list[dict]:
        return self._sync(lambda: self.emu.list(self._rt(api_version, kind), ns, selector))

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._run(self.emu.create(self._rt(obj["apiVersion"], obj["kind"]),
                                         obj["metadata"].get("namespace"), obj))

    def patch(self, api_version: str, kind: str, ns: str | None, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        return self._run(self.emu.patch(self._rt(api_version, kind), ns, name, patch,
                                        "application/merge-patch+json", subresource))

    def delete(self, api_version: str, kind: str, ns: str | None, name: str) -> None:
        try:
            self._run(self.emu.delete(self._rt(api_version, kind), ns, name))
        except Exception:  # noqa: BLE001 - already gone
            pass

    def write_kubeconfig(self, path: Path, namespace: str) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "specpair-demo",
            "clusters": [{"name": "local", "cluster": {"server": self.url}}],
            "users": [{"name": "demo", "user": {"token": "demo"}}],
            "contexts": [{"name": "specpair-demo", "context": {"cluster": "local", "user": "demo",
                                                              "namespace": namespace}}],
        }))
        return path

    def stop(self) -> None:
        try:
            self._run(self.emu.stop(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def _last_line(path: Path) -> str:
    text = tail(path, 600).replace("\r", "\n")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:100] if lines else ""


class EnginePod:
    def __init__(self, name: str, proc: subprocess.Popen, port: int, metrics_port: int, log: Path):
        self.name, self.proc, self.port, self.metrics_port, self.log = name, proc, port, metrics_port, log


class LocalRuntime:
    """Kubelet + Job/Deployment controllers for one namespace, as local processes."""

    def __init__(self, api: LocalApi, namespace: str, workdir: Path, children: Children,
                 gate_command: str | None = None, engine_start_timeout: float = 600.0):
        self.api, self.ns, self.workdir, self.children = api, namespace, workdir, children
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.gate_command = gate_command or f"{sys.executable} -m specpair gate --device cpu"
        self.engine_start_timeout = engine_start_timeout
        self.jobs: dict[str, subprocess.Popen] = {}
        self.pods: dict[str, EnginePod] = {}          # deployment name -> its (one) pod
        self.rolling: set[str] = set()
        self.pod_counter = 0
        self.activity: dict[str, str] = {}            # what is happening, for progress displays
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="local-runtime", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        for pod in list(self.pods.values()):
            self.children.stop(pod.proc, grace=15)
        for proc in self.jobs.values():
            self.children.stop(proc)

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - keep the node alive; the demo reports it
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.stopping.wait(0.3)

    def _step(self) -> None:
        for job in self.api.list("batch/v1", "Job", self.ns):
            name = job["metadata"]["name"]
            if (job.get("status") or {}).get("conditions"):
                continue
            if name not in self.jobs:
                self._start_job(job)
            elif self.jobs[name].poll() is not None:
                self._finish_job(name, self.jobs[name].returncode)
            else:
                self.activity[f"job/{name}"] = _last_line(self.logs / f"{name}.log")
        for dep in self.api.list("apps/v1", "Deployment", self.ns):
            name = dep["metadata"]["name"]
            if name in self.rolling:
                continue
            if (dep.get("status") or {}).get("observedGeneration") != dep["metadata"]["generation"]:
                self.rolling.add(name)
                threading.Thread(target=self._roll, args=(dep,), name=f"roll-{name}", daemon=True).start()
            elif name in self.pods and self.pods[name].proc.poll() is not None:
                # The container died (a crash, or someone stopped it): restart it, as the kubelet would.
                self.rolling.add(name)
                threading.Thread(target=self._roll, args=(dep,), name=f"restart-{name}", daemon=True).start()

    # -- Jobs ---------------------------------------------------------------------------------

    def _start_job(self, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        template = job["spec"]["template"]
        container = template["spec"]["containers"][0]
        release_file = self.workdir / "pods" / f"{name}-release.json"
        release_file.parent.mkdir(parents=True, exist_ok=True)
        release_file.write_text(template["metadata"]["annotations"][manifests.ANN_RELEASE])
        cmd = [str(release_file) if a == manifests.RELEASE_FILE else a for a in container["command"]]
        if cmd[0] == "python":
            cmd[0] = sys.executable
        env = {**os.environ, **self._pod_env(container), "SPECPAIR_GATE_COMMAND": self.gate_command}
        self.jobs[name] = self.children.start(cmd, self.logs / f"{name}.log", env=env)
        self.api.patch("batch/v1", "Job", self.ns, name, {"status": {"active": 1, "startTime": _now()}}, "status")
        self.activity[f"job/{name}"] = "starting"

    def _finish_job(self, name: str, code: int) -> None:
        ok = code == 0
        cond = {"type": "Complete" if ok else "Failed", "status": "True",
                "reason": "Completed" if ok else "BackoffLimitExceeded",
                "message": "" if ok else f"gate exited {code}: {_last_line(self.logs / f'{name}.log')}"}
        self.api.patch("batch/v1", "Job", self.ns, name, {"status": {
            "active": 0, "conditions": [cond], "succeeded" if ok else "failed": 1, "completionTime": _now()}}, "status")
        self.activity.pop(f"job/{name}", None)

    @staticmethod
    def _pod_env(container: dict[str, Any]) -> dict[str, str]:
        # Only what tells the pod where MLflow is; HOME/HF_HOME/cache paths point at the pod's
        # volumes, which here are this machine's own directories (see the module docstring).
        return {e["name"]: e["value"] for e in container.get("env", [])
                if "value" in e and e["name"].startswith("MLFLOW_")}

    # -- Deployments ----------------------------------------------------------------------------

    def _roll(self, dep: dict[str, Any]) -> None:
        name, gen = dep["metadata"]["name"], dep["metadata"]["generation"]
        try:
            self._replace_pod(dep)
            self.api.patch("apps/v1", "Deployment", self.ns, name, {"status": {
                "observedGeneration": gen, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1,
                "availableReplicas": 1, "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                                                       {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}]}},
                "status")
        except Exception as exc:  # noqa: BLE001 - a pod that never serves fails the rollout
            self.errors.append(f"engine pod for {name}: {exc}")
            self.api.patch("apps/v1", "Deployment", self.ns, name, {"status": {
                "observedGeneration": gen, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 0,
                "availableReplicas": 0, "conditions": [{"type": "Progressing", "status": "False",
                                                        "reason": "ProgressDeadlineExceeded", "message": str(exc)[-300:]}]}},
                "status")
        finally:
            self.activity.pop(f"deployment/{name}", None)
            self.rolling.discard(name)

    def _replace_pod(self, dep: dict[str, Any]) -> None:
        name = dep["metadata"]["name"]
        template = dep["spec"]["template"]
        old = self.pods.pop(name, None)
        if old is not None:
            self.activity[f"deployment/{name}"] = f"stopping pod {old.name}"
            self.children.stop(old.proc, grace=15)
            self.api.delete("v1", "Pod", self.ns, old.name)
        if self.stopping.is_set():
            raise RuntimeError("the demo is stopping")
        self.pod_counter += 1
        pod_name = f"{name}-{self.pod_counter}"
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": pod_name, "namespace": self.ns, "labels": template["metadata"]["labels"],
                            "annotations": template["metadata"].get("annotations", {}),
                            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": name,
                                                 "uid": dep["metadata"]["uid"], "controller": True}]},
               "spec": template["spec"]}
        self.api.create(pod)
        self.api.patch("v1", "Pod", self.ns, pod_name, {"status": {"phase": "Pending"}}, "status")
        container = template["spec"]["containers"][0]
        cmd = list(container["command"])
        if cmd[0] == "specpair":
            cmd = [sys.executable, "-m", "specpair", *cmd[1:]]
        metrics_port = free_port()
        cmd[cmd.index("--metrics-port") + 1] = str(metrics_port)
        cmd += ["--host", "127.0.0.1", "--device", "cpu"]
        port = int(cmd[cmd.index("--port") + 1])
        log = self.logs / f"{pod_name}.log"
        proc = self.children.start(cmd, log, env={**os.environ, **self._pod_env(container)})
        self.pods[name] = EnginePod(pod_name, proc, port, metrics_port, log)
        self._wait_serving(name, self.pods[name])
        self.api.patch("v1", "Pod", self.ns, pod_name, {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "startTime": _now(),
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]}}, "status")

    def _wait_serving(self, dep_name: str, pod: EnginePod) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + self.engine_start_timeout
        with grpc.insecure_channel(f"127.0.0.1:{pod.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline and not self.stopping.is_set():
                if pod.proc.poll() is not None:
                    raise RuntimeError(f"engine pod {pod.name} exited {pod.proc.returncode}: {_last_line(pod.log)}")
                self.activity[f"deployment/{dep_name}"] = f"pod {pod.name}: {_last_line(pod.log) or 'starting'}"
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        raise RuntimeError(f"engine pod {pod.name} was not SERVING within {self.engine_start_timeout:.0f} s")

    def restart_pod(self, deployment: str) -> None:
        """Stop the pod's process; the runtime restarts it from the same template (a node reboot)."""
        pod = self.pods.get(deployment)
        if pod is not None:
            self.children.stop(pod.proc, grace=15)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
