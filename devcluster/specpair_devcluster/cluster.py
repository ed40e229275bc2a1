"""DevCluster: the control plane plus local-process nodes, started and stopped as one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .client import ApiError, Kube
from .controlplane import ControlPlane, control_plane_binaries, write_kubeconfig
from .node_agent import LocalImages, NodeAgent, NodeSpec

__all__ = ["DevCluster", "NodeSpec"]

# How long a node's requests keep trying while the API server does not answer (a restart in place
# takes a few seconds; a loaded machine, more).
NODE_RETRY_S = 120.0


class DevCluster:
    """A real Kubernetes control plane on 127.0.0.1 and nodes that run pods as local processes.

    with DevCluster(workdir, nodes=[NodeSpec(gpus=1)]) as cluster:
        cluster.kube.create({...})            # admin client (system:masters)
        cluster.kubectl("get", "pods", "-A")  # the real kubectl with the admin kubeconfig
    """

    def __init__(self, workdir: Path | None = None, nodes: list[NodeSpec] | None = None,
                 images: LocalImages | None = None):
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="devcluster-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.node_specs = nodes or [NodeSpec()]
        self.images = images or LocalImages()
        self.control_plane: ControlPlane | None = None
        self.agents: list[NodeAgent] = []
        self.kube: Kube | None = None
        self.startup_seconds = 0.0

    @property
    def kubeconfig(self) -> Path:
        assert self.control_plane and self.control_plane.admin_kubeconfig
        return self.control_plane.admin_kubeconfig

    @property
    def server(self) -> str:
        assert self.control_plane
        return self.control_plane.server

    @property
    def ca_file(self) -> Path:
        assert self.control_plane and self.control_plane.ca
        return self.control_plane.ca.cert

    def start(self, timeout: float = 120.0) -> "DevCluster":
        t0 = time.monotonic()
        self.control_plane = ControlPlane(self.workdir, control_plane_binaries())
        try:
            self.control_plane.start(timeout)
            self.kube = Kube.from_kubeconfig(self.kubeconfig)
            for i, spec in enumerate(self.node_specs):
                self.add_node(spec, index=i)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def add_node(self, spec: NodeSpec, index: int | None = None) -> NodeAgent:
        """A node logged in as system:node:<name>, as a kubelet with a client certificate is."""
        assert self.control_plane and self.control_plane.ca
        index = len(self.agents) if index is None else index
        cert = self.control_plane.ca.issue(f"node-{spec.name}", f"system:node:{spec.name}",
                                           groups=("system:nodes",), client=True)
        config = write_kubeconfig(self.workdir / "pki" / f"node-{spec.name}.kubeconfig", self.server,
                                  self.ca_file, f"system:node:{spec.name}", cert=cert)
        # Its client keeps trying through an API server restart (restart()), as a kubelet's does.
        agent = NodeAgent(Kube.from_kubeconfig(config, unreachable_retry_s=NODE_RETRY_S), spec, index, self.workdir,
                          self.server, str(self.ca_file), self.images)
        agent.start()
        self.agents.append(agent)
        return agent

    def __enter__(self) -> "DevCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        # The nodes stop side by side: each waits on its own pods' processes and status patches.
        stopping = [threading.Thread(target=agent.stop, name=f"stop-{agent.spec.name}") for agent in self.agents]
        for t in stopping:
            t.start()
        for t in stopping:
            t.join()
        self.agents.clear()
        if self.control_plane is not None:
            self.control_plane.stop()
        if self.kube is not None:
            self.kube.close()

    def restart(self, component: str, *, crash: bool = True, down_seconds: float = 0.0) -> float:
        """Restart one control-plane component in place (ControlPlane.restart): the nodes, the
        other components and every client reconnect by themselves. Returns the seconds it was away."""
        assert self.control_plane
        return self.control_plane.restart(component, crash=crash, down_seconds=down_seconds)

    def node_errors(self) -> list[str]:
        return [e for a in self.agents for e in a.errors]

    # -- conveniences for tests, the demo and people ---------------------------------------------

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                kubeconfig: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            raise RuntimeError("kubectl is not on PATH (scripts/install-k8s-tools.sh puts it in .tools/bin)")
        done = subprocess.run([kubectl, "--kubeconfig", str(kubeconfig or self.kubeconfig), *args], input=input,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def ensure_namespace(self, name: str) -> None:
        assert self.kube
        try:
            self.kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        except ApiError as exc:
            if exc.status != 409:
                raise
        # Pods are refused until the ServiceAccount controller has made the namespace's default account.
        deadline = time.monotonic() + 30
        while self.kube.get("v1", "ServiceAccount", name, "default") is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no default ServiceAccount in namespace {name}")
            time.sleep(0.1)

    def service_account_kubeconfig(self, namespace: str, account: str, path: Path, seconds: int = 24 * 3600) -> Path:
        """A kubeconfig holding a TokenRequest token of one ServiceAccount: whoever uses it is
        authorised by exactly that account's RBAC."""
        assert self.kube
        got = self.kube.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
                                body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                      "spec": {"expirationSeconds": seconds}})
        return write_kubeconfig(path, self.server, self.ca_file, f"system:serviceaccount:{namespace}:{account}",
                                token=got["status"]["token"], namespace=namespace)

    def audit_events(self, user: str) -> list[dict[str, Any]]:
        """The API requests `user` (a ServiceAccount's full name) made, as the API server audited
        them (verb, objectRef, responseStatus, ...)."""
        assert self.control_plane and self.control_plane.audit_log
        events = []
        if self.control_plane.audit_log.exists():
            for line in self.control_plane.audit_log.read_text().splitlines():
                event = json.loads(line)
                if event.get("user", {}).get("username") == user:
                    events.append(event)
        return events

    def pod_log(self, namespace: str, pod: str, container: str | None = None) -> str:
        """A pod's container log, from the node folder that ran it (no kubelet API here)."""
        texts = []
        for agent in self.agents:
            for folder in sorted((agent.workdir / "pods").glob(f"{namespace}_{pod}_*")):
                for log in sorted(folder.glob(f"{container or '*'}.log")):
                    texts.append(log.read_text(errors="replace"))
        return "\n".join(texts)

    def describe(self) -> dict[str, Any]:
        return {"server": self.server, "kubeconfig": str(self.kubeconfig), "workdir": str(self.workdir),
                "nodes": [a.spec.name for a in self.agents], "startupSeconds": round(self.startup_seconds, 1),
                "pid": os.getpid()}

    def write_state(self) -> Path:
        # Written aside and renamed into place: `up` polls this file, and a poll between
        # write_text's truncate and its write read an empty file (seen in a CI run).
        path = self.workdir / "cluster.json"
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(self.describe(), indent=1))
        os.replace(partial, path)
        return path
