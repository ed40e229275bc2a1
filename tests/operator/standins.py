"""What a cluster would run around the operator, played by the tests.

- `ControllerStandIn`: the Job and Deployment controllers plus the kubelet. A gate Job "runs" by
  executing its own container command (`python -m specpair_operator.gate_runner`) on this
  machine with the release file its pod would have mounted; a Deployment "rolls" by replacing
  its pods with Running+Ready ones and starting the engine on the release in its template.
- `EngineStandIn`: an engine pod speaking the real gRPC API (specpair.engine.v1.Engine, the
  generated stubs) on loopback, so the operator's gRPC probe is exercised for real. Its
  acceptance counters are driven by the test (traffic simulation).
- `gate_standin.py`: for scenarios that need chosen numbers (drift, thresholds): it looks the
  candidate's numbers up in a small "model world" the test declares. test_operator_real_gate
  runs the engine's real `specpair gate` on tiny models instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable

import grpc

from specpair._proto import engine_pb2, engine_pb2_grpc
from specpair_operator import manifests

HERE = Path(__file__).resolve().parent
CRD = HERE.parents[1] / "crds" / "specmodelpair.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fingerprint(source: str | None) -> str:
    return hashlib.sha256(f"tokenizer-of:{source}".encode()).hexdigest()


class EngineStandIn(engine_pb2_grpc.EngineServicer):
    def __init__(self, world: dict[str, Any], fingerprints: dict[str, str] | None = None):
        self.world = world
        # source -> real tokenizer fingerprint, for pods loading real (tiny) models
        self.fingerprints = fingerprints or {}
        self.release: dict[str, Any] | None = None
        self.speculation = True
        self.counters: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        engine_pb2_grpc.add_EngineServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def load(self, release: dict[str, Any]) -> None:
        """What `specpair serve --release FILE` would do when a pod starts."""
        with self.lock:
            self.release, self.speculation, self.counters = release, True, {}

    def serve_traffic(self, category: str, drafted: int) -> None:
        """Requests in `category`; the draft is accepted at the world's live rate for it."""
        with self.lock:
            if not self.speculation or self.release is None:
                return
            draft = self.release["draft"].get("source") or self.release["draft"].get("drafter")
            rate = self.world[draft]["live"].get(category, self.world[draft]["acceptanceRate"])
            c = self.counters.setdefault(category, [0, 0])
            c[0] += drafted
            c[1] += int(drafted * rate)

    def GetModelInfo(self, request: Any, context: Any) -> Any:
        rel = self.release or {}
        draft = rel.get("draft") or {}
        tok_draft = self.world.get(draft.get("source"), {}).get("tokenizerOf", draft.get("source"))
        return engine_pb2.ModelInfo(
            pair=rel.get("pair", ""), version=str((rel.get("mlflow") or {}).get("version", "")),
            tokenizer=engine_pb2.TokenizerInfo(
                target_fingerprint=self._fp(rel.get("target", {}).get("source")),
                draft_fingerprint=self._fp(tok_draft) if draft.get("source") else "", compatible=True),
            speculation=engine_pb2.SpeculationSettings(enabled=self.speculation))

    def _fp(self, source: str | None) -> str:
        return self.fingerprints.get(source) or fingerprint(source)

    def GetStats(self, request: Any, context: Any) -> Any:
        with self.lock:
            cats = {c: engine_pb2.CategoryStats(cumulative=engine_pb2.AcceptanceStats(
                num_draft_tokens=d, num_accepted_tokens=a)) for c, (d, a) in self.counters.items()}
        return engine_pb2.Stats(categories=cats, speculating=self.speculation)

    def SetSpeculation(self, request: Any, context: Any) -> Any:
        if request.HasField("enabled"):
            self.speculation = request.enabled
        return engine_pb2.SpeculationSettings(enabled=self.speculation)

    def stop(self) -> None:
        self.server.stop(0)


STANDIN_GATE = f"{sys.executable} {HERE / 'gate_standin.py'}"
REAL_GATE = f"{sys.executable} -m specpair gate --device cpu"


def template_version(dep: dict[str, Any]) -> str:
    return dep["spec"]["template"]["metadata"]["labels"].get(manifests.LABEL_VERSION, "")


class EngineProcesses:
    """Engine pods as local processes: the pod's own container command, as a kubelet would run it.

    There is one network namespace here, so the stand-in binds loopback, turns the metrics port
    off (pods would all use 9400), forces CPU, and maps the cache volume to a temp dir.
    """

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: dict[str, tuple[subprocess.Popen, list[str], dict[str, str], int]] = {}

    def start(self, pod: str, command: list[str], env: dict[str, str], timeout: float = 120) -> None:
        cmd = [sys.executable, "-m", "specpair", *command[1:]] if command[0] == "specpair" else list(command)
        cmd[cmd.index("--metrics-port") + 1] = "-1"
        cmd += ["--host", "127.0.0.1", "--device", "cpu"]
        port = int(cmd[cmd.index("--port") + 1])
        env = {**os.environ, **{k: v.replace(manifests.CACHE_DIR, str(self.workdir / "cache")) for k, v in env.items()}}
        log = open(self.workdir / f"{pod}.log", "ab")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[pod] = (proc, command, env, port)
        self._wait_serving(pod, timeout)

    def _wait_serving(self, pod: str, timeout: float) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        proc, _, _, port = self.procs[pod]
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"engine pod {pod} exited: {(self.workdir / f'{pod}.log').read_text()[-2000:]}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"engine pod {pod} never became SERVING")

    def stop(self, pod: str) -> None:
        entry = self.procs.pop(pod, None)
        if entry is not None and entry[0].poll() is None:
            os.killpg(entry[0].pid, 15)
            try:
                entry[0].wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(entry[0].pid, 9)
                entry[0].wait(5)

    def restart(self, pod: str) -> None:
        _, command, env, _ = self.procs[pod]
        self.stop(pod)
        self.start(pod, command, env)

    def stop_all(self) -> None:
        for pod in list(self.procs):
            self.stop(pod)


class ControllerStandIn:
    def __init__(self, kube: Any, engine: EngineStandIn | None, workdir: Path, world_file: Path,
                 namespace: str = "default", gate: str = STANDIN_GATE, processes: EngineProcesses | None = None):
        """`engine`: one in-test engine the pods "are"; or `processes`: real engine processes."""
        self.kube, self.engine, self.workdir, self.ns, self.gate = kube, engine, workdir, namespace, gate
        self.processes = processes
        self.env = {**os.environ, "SPECPAIR_STANDIN_WORLD": str(world_file)}
        self.gates_run: list[str] = []
        self.pod_counter = 0
        self.failing_versions: set[str] = set()  # releases whose pods crash-loop

    def step(self) -> None:
        for job in self.kube.list("batch/v1", "Job", self.ns):
            if not (job.get("status") or {}).get("conditions"):
                self._run_job(job)
        for dep in self.kube.list("apps/v1", "Deployment", self.ns):
            st = dep.get("status") or {}
            if st.get("observedGeneration") != dep["metadata"]["generation"]:
                self._roll(dep)

    def _run_job(self, job: dict[str, Any]) -> None:
        pod = job["spec"]["template"]
        rel_file = self.workdir / f"{job['metadata']['name']}.json"
        rel_file.write_text(pod["metadata"]["annotations"][manifests.ANN_RELEASE])
        cmd = list(pod["spec"]["containers"][0]["command"])
        cmd[cmd.index(manifests.RELEASE_FILE)] = str(rel_file)
        cmd[0] = sys.executable if cmd[0] == "python" else cmd[0]
        env = {**self.env, **{e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]},
               "SPECPAIR_GATE_COMMAND": self.gate}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        self.gates_run.append(job["metadata"]["name"])
        ok = proc.returncode == 0
        cond = {"type": "Complete" if ok else "Failed", "status": "True",
                "reason": "Completed" if ok else "BackoffLimitExceeded", "message": proc.stderr[-300:] if not ok else ""}
        self.kube.patch("batch/v1", "Job", self.ns, job["metadata"]["name"],
                        {"status": {"conditions": [cond], "succeeded" if ok else "failed": 1}}, "status")

    def _roll(self, dep: dict[str, Any]) -> None:
        name = dep["metadata"]["name"]
        gen = dep["metadata"]["generation"]
        template = dep["spec"]["template"]
        if template_version(dep) in self.failing_versions:
            self.kube.patch("apps/v1", "Deployment", self.ns, name, {"status": {
                "observedGeneration": gen, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 0,
                "conditions": [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                "message": "engine pods crash-looping"}]}}, "status")
            return
        template = dep["spec"]["template"]
        for pod in self.kube.list("v1", "Pod", self.ns, f"{manifests.LABEL_PAIR}={template['metadata']['labels'][manifests.LABEL_PAIR]}"):
            if self.processes is not None:
                self.processes.stop(pod["metadata"]["name"])
            self.kube.call(self.kube.emu.delete(self.kube.rt("v1", "Pod"), self.ns, pod["metadata"]["name"]))
        self.pod_counter += 1
        if self.processes is not None:
            container = template["spec"]["containers"][0]
            self.processes.start(f"{name}-{self.pod_counter}", container["command"],
                                 {e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
        else:
            self.engine.load(json.loads(template["metadata"]["annotations"][manifests.ANN_RELEASE]))
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{name}-{self.pod_counter}", "namespace": self.ns, "labels": template["metadata"]["labels"]},
               "spec": template["spec"]}
        self.kube.create(pod)
        self.kube.patch("v1", "Pod", self.ns, pod["metadata"]["name"], {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}, "status")
        replicas = dep["spec"].get("replicas", 1)
        self.kube.patch("apps/v1", "Deployment", self.ns, name, {"status": {
            "observedGeneration": gen, "replicas": replicas, "updatedReplicas": replicas,
            "readyReplicas": replicas, "availableReplicas": replicas,
            "conditions": [{"type": "Available", "status": "True"}]}}, "status")

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float = 60.0,
                 during: Callable[[], None] | None = None, show: Callable[[], Any] | None = None) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step()
            if during:
                during()
            got = predicate()
            if got:
                return got
            time.sleep(0.25)
        state = show() if show else [o.get("status") for o in self.kube.list("specpair.io/v1alpha1", "SpecModelPair", self.ns)]
        raise AssertionError(f"timed out waiting for {what}; state: {json.dumps(state, indent=1)[-3000:]}")
