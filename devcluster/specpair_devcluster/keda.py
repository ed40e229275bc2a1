"""Real KEDA beside the devcluster: its operator and its metrics API server as local processes.

Both are built from the github.com/kedacore/keda/v2 module by scripts/build-keda.sh, which keeps
KEDA's own kustomize folders beside the binaries; from them come the CRDs, the ServiceAccount
`keda/keda-operator` and its RBAC (the operator's ClusterRole, the metrics server's
auth-delegator and extension-apiserver-authentication-reader bindings, and the HPA controller's
right to read external metrics), applied with kubectl as in any cluster. Both programs log in with
a token of that ServiceAccount, so they are held to KEDA's RBAC.

How the pieces meet, as in a cluster:
- the operator watches ScaledObjects and makes an HPA for each, whose metric is an external
  metric; it serves the metric values over gRPC (mutual TLS) to the metrics server;
- the metrics server is an aggregated API server: the APIService `v1beta1.external.metrics.k8s.io`
  sends the API server's requests for external metrics to it, authenticated as the front proxy
  (controlplane.py gives the API server its requestheader/proxy-client certificates);
- the HPA controller in kube-controller-manager reads the metric through the API server and
  writes the target's scale subresource.

The one difference: an APIService names a Service, and devcluster Services cannot have endpoints
(the API server refuses loopback addresses in EndpointSlices), so the aggregator could not route
to endpoints (--enable-aggregator-routing). The Service here is `type: ExternalName` with the
name 127.0.0.1, which the aggregator's default resolver dials as `externalName:port` with the
APIService's port; TLS is still checked against the Service's DNS name
(keda-metrics-apiserver.keda.svc), which the metrics server's certificate carries.

    keda = DevKeda(cluster, workdir).start()   # then ScaledObjects work
    keda.stop()
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .client import ApiError
from .processes import Child, built_binaries, first_exit, free_port, http_ok, wait_until

NAMESPACE = "keda"
ACCOUNT = "keda-operator"
METRICS_SERVICE = "keda-metrics-apiserver"
API_SERVICE = "v1beta1.external.metrics.k8s.io"
PROGRAMS = ("keda", "keda-adapter")
KEDA_GROUPS = ("keda.sh", "eventing.keda.sh")
# KEDA's kustomize folders applied as they are (CRDs with their patches, the operator's RBAC), and
# the metrics server's RBAC files (its folder's kustomization also holds the Deployment and
# Service this replaces).
KUSTOMIZATIONS = ("crd", "rbac", "service_account")
METRICS_SERVER_RBAC = ("metrics-server/role.yaml", "metrics-server/role_binding.yaml")


def keda_binaries() -> Path:
    """The folder with `keda` and `keda-adapter` ($SPECPAIR_KEDA_BIN or the build script's cache);
    KEDA's config folders are in ../config."""
    return built_binaries("build-keda.sh", "SPECPAIR_KEDA_BIN", PROGRAMS)


class DevKeda:
    """KEDA's operator and metrics API server for a DevCluster (`cluster`)."""

    def __init__(self, cluster: Any, workdir: Path):
        self.cluster, self.workdir = cluster, Path(workdir)
        self.children: list[Child] = []

    def install(self, config: Path) -> None:
        """KEDA's CRDs, namespace, ServiceAccount and RBAC, from its own module's `config` folder."""
        self.cluster.ensure_namespace(NAMESPACE)
        for folder in KUSTOMIZATIONS:
            # Server-side: the CRDs are larger than client-side apply's annotation allows.
            self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(config / folder))
        for path in METRICS_SERVER_RBAC:
            self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(config / path))
        kube = self.cluster.kube
        wait_until(lambda: all(_established(kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, n))
                               for n in ("scaledobjects.keda.sh", "scaledjobs.keda.sh", "triggerauthentications.keda.sh")),
                   30, what="KEDA's CRDs established")

    def start(self, timeout: float = 120.0) -> "DevKeda":
        started = time.monotonic()
        binaries = keda_binaries()
        self.install(binaries.parent / "config")
        self.workdir.mkdir(parents=True, exist_ok=True)
        kubeconfig = self.cluster.service_account_kubeconfig(NAMESPACE, ACCOUNT, self.workdir / "kubeconfig")
        certs = self._certificates()
        grpc_port, adapter_port = free_port(), free_port()
        # KEDA reads these as its Deployment sets them; scalers' CA folder (--ca-dir) is empty.
        env = {"PATH": os.environ.get("PATH", ""), "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": NAMESPACE,
               "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE, "WATCH_NAMESPACE": ""}
        (self.workdir / "custom-ca").mkdir(exist_ok=True)
        self.health = f"http://127.0.0.1:{free_port()}"
        self.children.append(Child("keda-operator", [
            str(binaries / "keda"), "--leader-elect=false",
            f"--metrics-bind-address=127.0.0.1:{free_port()}",
            f"--health-probe-bind-address={self.health.removeprefix('http://')}",
            f"--metrics-service-bind-address=127.0.0.1:{grpc_port}",
            # The certificates are this cluster's, written below; KEDA's own rotation would make and
            # publish others (and patch the APIService's CA bundle).
            f"--cert-dir={certs}", "--enable-cert-rotation=false",
            "--enable-webhook-patching=false", "--enable-apiservice-patching=false",
            f"--ca-dir={self.workdir / 'custom-ca'}",
            "--zap-log-level=info", "--zap-encoder=console"], self.workdir / "keda-operator.log", env=env))
        self.children.append(Child("keda-metrics-apiserver", [
            str(binaries / "keda-adapter"),
            "--bind-address=127.0.0.1", f"--secure-port={adapter_port}",
            f"--tls-cert-file={certs / 'tls.crt'}", f"--tls-private-key-file={certs / 'tls.key'}",
            f"--cert-dir={certs}", f"--client-ca-file={certs / 'ca.crt'}",
            f"--lister-kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            f"--metrics-service-address=127.0.0.1:{grpc_port}", f"--port={free_port()}",
            "--zap-log-level=info", "--zap-encoder=console"], self.workdir / "keda-metrics-apiserver.log", env=env))
        self._register(adapter_port)
        remaining = max(10.0, timeout - (time.monotonic() - started))
        wait_until(lambda: self._available() and self._operator_ready(), remaining, interval=0.5,
                   what=f"APIService {API_SERVICE} Available and KEDA's operator ready", abort=self._dead_child)
        return self

    def _certificates(self) -> Path:
        """One key pair for both programs, as KEDA's own rotation makes: the operator serves gRPC
        with it, the metrics server presents it to the operator and serves the aggregated API."""
        ca = self.cluster.control_plane.ca
        pair = ca.issue("keda", ACCOUNT, server=True, client=True,
                        hosts=("127.0.0.1", "localhost", f"{ACCOUNT}.{NAMESPACE}.svc",
                               f"{ACCOUNT}.{NAMESPACE}.svc.cluster.local", f"{METRICS_SERVICE}.{NAMESPACE}.svc",
                               f"{METRICS_SERVICE}.{NAMESPACE}.svc.cluster.local"))
        folder = self.workdir / "certs"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ca.cert, folder / "ca.crt")
        shutil.copyfile(pair.cert, folder / "tls.crt")
        shutil.copyfile(pair.key, folder / "tls.key")
        (folder / "tls.key").chmod(0o600)
        return folder

    def _register(self, port: int) -> None:
        """The metrics server's Service (ExternalName: module docstring) and its APIService."""
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": METRICS_SERVICE, "namespace": NAMESPACE},
                   "spec": {"type": "ExternalName", "externalName": "127.0.0.1"}}
        api_service = {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": API_SERVICE},
                       "spec": {"service": {"name": METRICS_SERVICE, "namespace": NAMESPACE, "port": port},
                                "group": "external.metrics.k8s.io", "version": "v1beta1",
                                "caBundle": _b64(self.cluster.ca_file.read_bytes()),
                                "groupPriorityMinimum": 100, "versionPriority": 100}}
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                  "items": [service, api_service]}))

    def _available(self) -> bool:
        try:
            got = self.cluster.kube.get("apiregistration.k8s.io/v1", "apiservices", None, API_SERVICE)
        except ApiError:
            return False
        return any(c["type"] == "Available" and c["status"] == "True"
                   for c in ((got or {}).get("status") or {}).get("conditions") or [])

    def _operator_ready(self) -> bool:
        return http_ok(self.health + "/readyz")

    def _dead_child(self) -> str | None:
        return first_exit(self.children)

    def external_metric(self, namespace: str, name: str, selector: str) -> dict[str, Any]:
        """GET an external metric through the API server, as the HPA controller reads it."""
        from urllib.parse import quote
        return self.cluster.kube.request(
            "GET", f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{namespace}/{name}?labelSelector={quote(selector)}")

    def stop(self) -> None:
        """KEDA leaves the cluster as it found it: its CRDs go while it runs (it removes its
        finalizers from what they held), so an operator on the same cluster no longer sees KEDA;
        then the APIService, which left behind would fail API discovery for every client."""
        kube = self.cluster.kube
        if kube is not None:
            crds = [c["metadata"]["name"] for c in kube.list("apiextensions.k8s.io/v1", "CustomResourceDefinition")
                    if c["spec"]["group"] in KEDA_GROUPS]
            for name in crds:
                kube.delete("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, name)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(
                    kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, n) for n in crds):
                time.sleep(0.2)
            try:
                kube.delete("apiregistration.k8s.io/v1", "apiservices", None, API_SERVICE)
            except ApiError:
                pass
        for child in reversed(self.children):
            child.stop(grace=10)
        self.children.clear()

    def __enter__(self) -> "DevKeda":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _established(crd: dict[str, Any] | None) -> bool:
    return any(c["type"] == "Established" and c["status"] == "True"
               for c in ((crd or {}).get("status") or {}).get("conditions") or [])


def _b64(data: bytes) -> str:
    import base64
    return base64.b64encode(data).decode()
