"""Real Flux beside the devcluster: its source-controller and kustomize-controller as local
processes, the two controllers a GitRepository -> Kustomization pipeline needs.

Both are built from their Go modules by scripts/build-flux.sh, which keeps their CRDs and
ClusterRoles beside the binaries. They are installed as Flux's own manifests install them: the
CRDs, namespace `flux-system`, a ServiceAccount per controller, each controller's ClusterRole, and
`cluster-admin` for kustomize-controller (Flux's `cluster-reconciler` binding: it applies whatever
Git holds). Each logs in with a token of its ServiceAccount, so it is held to that RBAC.

How the pieces meet, as in a cluster: source-controller clones a GitRepository's URL, packs the
revision as an artifact in its storage folder and serves it over HTTP; the GitRepository's status
names the artifact's URL (`--storage-adv-addr`: here 127.0.0.1 and the port it serves on), which
kustomize-controller downloads, builds with kustomize and applies with server-side apply (field
manager `kustomize-controller`), then waits on the health of what it applied (kstatus) when the
Kustomization says `wait: true`. A git server on loopback (git_server.py) stands where GitHub would.

    flux = DevFlux(cluster, workdir).start()   # then GitRepository and Kustomization objects work
    flux.stop()
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from .client import ApiError
from .processes import Child, built_binaries, first_exit, free_port, http_ok, wait_until

NAMESPACE = "flux-system"
PROGRAMS = ("source-controller", "kustomize-controller")
FLUX_GROUPS = ("source.toolkit.fluxcd.io", "kustomize.toolkit.fluxcd.io")
# kustomize-controller starts watches on every source kind, so all of source-controller's CRDs go in.
REQUIRED_CRDS = ("gitrepositories.source.toolkit.fluxcd.io", "kustomizations.kustomize.toolkit.fluxcd.io")


def flux_binaries() -> Path:
    """The folder with `source-controller` and `kustomize-controller` ($SPECPAIR_FLUX_BIN or the
    build script's cache); their CRDs are in ../crds, their ClusterRoles in ../rbac."""
    return built_binaries("build-flux.sh", "SPECPAIR_FLUX_BIN", PROGRAMS)


class DevFlux:
    """Flux's source-controller and kustomize-controller for a DevCluster (`cluster`)."""

    def __init__(self, cluster: Any, workdir: Path):
        self.cluster, self.workdir = cluster, Path(workdir)
        self.children: list[Child] = []
        self.storage_url = ""

    def install(self, folder: Path) -> None:
        """Flux's CRDs, namespace, ServiceAccounts and RBAC (module docstring)."""
        self.cluster.ensure_namespace(NAMESPACE)
        # Server-side: the CRDs are larger than client-side apply's annotation allows.
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(folder / "crds"))
        objects: list[dict[str, Any]] = []
        for program in PROGRAMS:
            role = yaml.safe_load((folder / "rbac" / f"{program}.yaml").read_text())
            role["metadata"] = {"name": f"flux-{program}"}
            objects += [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": program, "namespace": NAMESPACE}},
                        role, _binding(f"flux-{program}", f"flux-{program}", program)]
        objects.append(_binding("flux-cluster-reconciler", "cluster-admin", "kustomize-controller"))
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        kube = self.cluster.kube
        wait_until(lambda: all(_established(kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, n))
                               for n in REQUIRED_CRDS), 30, what="Flux's CRDs established")

    def start(self, timeout: float = 120.0) -> "DevFlux":
        started = time.monotonic()
        binaries = flux_binaries()
        self.install(binaries.parent)
        (self.workdir / "storage").mkdir(parents=True, exist_ok=True)
        storage_port = free_port()
        self.storage_url = f"http://127.0.0.1:{storage_port}"
        self.health: dict[str, str] = {}
        flags = {
            "source-controller": [f"--storage-path={self.workdir / 'storage'}",
                                  f"--storage-addr=127.0.0.1:{storage_port}",
                                  f"--storage-adv-addr=127.0.0.1:{storage_port}"],
            # Remote bases would fetch from the internet, which a test cluster never reaches.
            "kustomize-controller": ["--no-remote-bases=true"],
        }
        for program in PROGRAMS:
            kubeconfig = self.cluster.service_account_kubeconfig(NAMESPACE, program, self.workdir / f"{program}.kubeconfig")
            # Flux's Deployments set RUNTIME_NAMESPACE from the pod's namespace.
            env = {"PATH": os.environ.get("PATH", ""), "KUBECONFIG": str(kubeconfig), "RUNTIME_NAMESPACE": NAMESPACE,
                   "HOME": str(self.workdir), "TMPDIR": str(self.workdir)}
            health = f"127.0.0.1:{free_port()}"
            self.health[program] = f"http://{health}/readyz"
            self.children.append(Child(program, [
                str(binaries / program), "--enable-leader-election=false", "--watch-all-namespaces=true",
                f"--metrics-addr=127.0.0.1:{free_port()}", f"--health-addr={health}",
                "--log-level=info", "--log-encoding=console", *flags[program]],
                self.workdir / f"{program}.log", env=env))
        remaining = max(10.0, timeout - (time.monotonic() - started))
        wait_until(lambda: all(http_ok(url) for url in self.health.values()), remaining, interval=0.5,
                   what="Flux's source-controller and kustomize-controller ready", abort=self._dead_child)
        return self

    def _dead_child(self) -> str | None:
        return first_exit(self.children)

    def logs(self) -> str:
        """Both controllers' logs' ends (for a failing test's message)."""
        from .processes import tail
        return "\n".join(f"--- {c.name} ---\n{tail(c.log, 3000)}" for c in self.children)

    def stop(self) -> None:
        """Flux leaves the cluster as it found it: its CRDs go while its controllers run (they
        remove their finalizers from what the CRDs held; a Kustomization's prune deletes what it
        applied), then the controllers stop."""
        kube = self.cluster.kube
        if kube is not None and self.children:
            crds = [c["metadata"]["name"] for c in kube.list("apiextensions.k8s.io/v1", "CustomResourceDefinition")
                    if c["spec"]["group"] in FLUX_GROUPS]
            for name in crds:
                try:
                    kube.delete("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, name)
                except ApiError:
                    pass
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(
                    kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, n) for n in crds):
                time.sleep(0.2)
        for child in reversed(self.children):
            child.stop(grace=10)
        self.children.clear()

    def __enter__(self) -> "DevFlux":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _binding(name: str, role: str, account: str) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]}


def _established(crd: dict[str, Any] | None) -> bool:
    return any(c["type"] == "Established" and c["status"] == "True"
               for c in ((crd or {}).get("status") or {}).get("conditions") or [])
