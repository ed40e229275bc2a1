"""The demo's cluster: devcluster (a real control plane and a node that runs pods as local
processes) with the specpair chart installed by the real helm.

Nothing here plays kubelet or controllers: the Deployment/ReplicaSet/Job controllers and the
scheduler are the real ones, and the devcluster node runs what they bind to it. The operator
is the chart's own Deployment: its pod runs `python -m specpair_operator` (the image
ghcr.io/specpair/operator maps to this virtualenv), logged in with the token the node projects
for the chart's ServiceAccount, so every call it makes is authorised by the chart's RBAC.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from specpair_devcluster import DevCluster, NodeSpec
from specpair_devcluster.processes import repo_tool
from specpair_operator.desired import manifests

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "specpair"
OPERATOR_NAMESPACE = "specpair-system"
RELEASE = "specpair"          # helm release name; the chart's fullname (Deployment, ServiceAccount) is the same
PAIR_API = "specpair.io/v1alpha1"


def model_cache() -> str:
    """This machine's model cache: the node mounts it wherever a pod mounts the cache volume,
    so the embedded model is converted once per machine, as a node image that ships it."""
    return os.environ.get("SPECPAIR_CACHE", str(Path.home() / ".cache" / "specpair"))


def ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and bool(st.get("podIP")) and not pod["metadata"].get("deletionTimestamp") \
        and any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])


def pod_state(pod: dict[str, Any]) -> str:
    """A pod's state in kubectl's words: Running/Ready, ContainerCreating, CrashLoopBackOff, ..."""
    st = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp"):
        return "Terminating"
    for c in st.get("containerStatuses") or []:
        waiting = (c.get("state") or {}).get("waiting")
        if waiting:
            return waiting.get("reason", "Waiting")
    if st.get("phase") == "Running":
        return "Ready" if ready(pod) else "Running, not ready"
    return st.get("phase") or "Pending"


class DemoCluster:
    def __init__(self, workdir: Path, namespace: str, omp_threads: str):
        self.workdir = workdir
        self.namespace = namespace
        node = NodeSpec(name="demo-node-1", cpu="8", memory="32Gi", env={"OMP_NUM_THREADS": omp_threads},
                        preseeded={manifests.CACHE_DIR: model_cache()})
        self.cluster = DevCluster(workdir, nodes=[node])

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self.cluster.start()
        self.cluster.ensure_namespace(self.namespace)

    def stop(self) -> None:
        self.cluster.stop()

    @property
    def kube(self) -> Any:
        return self.cluster.kube

    @property
    def kubeconfig(self) -> Path:
        return self.cluster.kubeconfig

    def helm(self, *args: str, values: dict[str, Any] | None = None, timeout: float = 300) -> str:
        done = subprocess.run([repo_tool("helm"), "--kubeconfig", str(self.kubeconfig), *args],
                              input=json.dumps(values) if values is not None else None,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args[:2])} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def install_operator(self, mlflow_url: str, extra_env: dict[str, str]) -> None:
        """`helm upgrade --install` of charts/specpair: CRD, ServiceAccount, RBAC and the operator
        Deployment, with MLflow at `mlflow_url`."""
        # The operator watches, and may write in, the demo's namespace only.
        # (The operator's metrics bind its pod IP here: the chart says 0.0.0.0, which the
        # devcluster node rewrites, so a test run's operator beside the demo holds another address.)
        env = [{"name": k, "value": v} for k, v in extra_env.items()]
        values = {"mlflow": {"trackingUri": mlflow_url}, "watchNamespaces": [self.namespace],
                  "operator": {"extraEnv": env}}
        self.helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE,
                  "--create-namespace", "--values", "-", values=values)

    def operator_pods(self) -> list[dict[str, Any]]:
        return self.kube.list("v1", "Pod", OPERATOR_NAMESPACE, labels=f"app.kubernetes.io/instance={RELEASE}")

    def operator_log(self) -> str:
        return "\n".join(self.cluster.pod_log(OPERATOR_NAMESPACE, p["metadata"]["name"], "operator")
                         for p in self.operator_pods())

    def operator_restarts(self) -> int:
        return sum(int(c.get("restartCount", 0)) for p in self.operator_pods()
                   for c in (p.get("status") or {}).get("containerStatuses") or [])

    def wait_operator_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pods = [p for p in self.operator_pods() if ready(p)]
            if pods:
                return pods[0]
            time.sleep(0.5)
        states = [f"{p['metadata']['name']}: {pod_state(p)}" for p in self.operator_pods()]
        raise RuntimeError(f"the operator pod was not Ready within {timeout:.0f} s ({'; '.join(states) or 'no pod'})"
                           f"\n{self.operator_log()[-2000:]}")

    def crd_served(self) -> bool:
        try:
            self.kube.list(PAIR_API, "SpecModelPair", self.namespace)
            return True
        except Exception:  # noqa: BLE001 - not established yet
            return False

    # -- the pair and its pods ---------------------------------------------------------------------

    def pair(self, name: str) -> dict[str, Any] | None:
        return self.kube.get(PAIR_API, "SpecModelPair", self.namespace, name)

    def create_pair(self, pair: dict[str, Any]) -> dict[str, Any]:
        return self.kube.create(pair)

    def patch_pair_spec(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.kube.patch(PAIR_API, "SpecModelPair", self.namespace, name, {"spec": spec})

    def pods(self, labels: str | None = None) -> list[dict[str, Any]]:
        return self.kube.list("v1", "Pod", self.namespace, labels=labels)

    def engine_pods(self, pair: str) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in manifests.engine_selector(pair).items())
        return self.pods(selector)

    def engine_address(self, pair: str, port: int) -> str | None:
        """The newest ready engine pod's gRPC address: its pod IP (no kube-proxy here)."""
        pods = sorted((p for p in self.engine_pods(pair) if ready(p)),
                      key=lambda p: p["metadata"]["creationTimestamp"], reverse=True)
        return f"{pods[0]['status']['podIP']}:{port}" if pods else None

    def delete_engine_pods(self, pair: str) -> list[str]:
        """What `kubectl delete pod` does: the ReplicaSet controller makes new ones."""
        names = [p["metadata"]["name"] for p in self.engine_pods(pair) if not p["metadata"].get("deletionTimestamp")]
        for n in names:
            self.kube.delete("v1", "Pod", self.namespace, n)
        return names

    def activity(self) -> str:
        """What the pods of the demo namespace are doing, for the progress line."""
        words = []
        for p in self.pods():
            role = (p["metadata"].get("labels") or {}).get(manifests.LABEL_ROLE, "pod")
            state = pod_state(p)
            line = ""
            if role == "gate" and state in ("Ready", "Running, not ready"):
                state = "running"
                line = last_line(self.cluster.pod_log(self.namespace, p["metadata"]["name"], "gate"))
            elif state in ("Succeeded", "Ready"):
                continue
            words.append(f"{role} pod {state}" + (f": {line}" if line else ""))
        return "; ".join(words)

    def node_errors(self) -> list[str]:
        return self.cluster.node_errors()


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text[-800:].replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1][:90] if lines else ""
