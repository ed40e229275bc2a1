"""A real Gateway API gateway beside the devcluster: Traefik, a local process with a kubeconfig.

Traefik (built from its Go module by scripts/build-gateway.sh, with the Gateway API CRDs of the
standard channel, HTTPRoute and GRPCRoute included) runs its Kubernetes Gateway provider against
the devcluster's API server, logged in with a token of the ServiceAccount
`devcluster-gateway/traefik`, whose ClusterRole is exactly what that provider reads and writes
(Traefik's own kubernetes-gateway-rbac.yml, less the pods `get` it needs only for OpenTelemetry).
It programs the Gateways of its GatewayClass (`specpair-dev`, controller
`traefik.io/gateway-controller`), routes what HTTPRoutes and GRPCRoutes attach to them, splits
by their backendRefs' weights per request (weighted round robin), and sends each request to an
address of the backend Service's EndpointSlices, as on any cluster.

The one difference: pods here have loopback addresses (node_agent.py), which the API server refuses
in an IPv4 EndpointSlice, so the EndpointSlice controller makes none and Traefik would find no
endpoints. `EndpointMirror` stands in for that controller for the namespaces it is given: for each
Service with a selector it keeps one EndpointSlice of addressType FQDN (which the API server
accepts for a dotted-quad name) holding the ready pods' IPs, with the Service's ports resolved to
the pods' container ports, labelled `kubernetes.io/service-name` as the controller labels its
own and managed by `devcluster-gateway`. Traefik reads endpoint addresses whatever their
addressType, so it dials the pod IPs. A Service without a selector keeps whatever slices its
owner writes (a test's stand-in backends).

The Gateway's listener port must be the port of a Traefik entry point, so one Gateway per
DevGateway: `gateway(namespace)` makes it on the entry point's port, `url` is where to send
requests (HTTP/1.1 and h2c gRPC on the same port).

    gw = DevGateway(cluster, workdir, namespaces=["demo"]).start()
    gw.gateway("demo")                     # Gateway demo/specpair, Programmed
    ... HTTPRoutes with parentRefs [{name: specpair}] ...
    requests.get(gw.url + "/v1/models")
    gw.stop()
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from .client import ApiError
from .processes import Child, built_binaries, first_exit, free_port, http_ok, wait_until

NAMESPACE = "devcluster-gateway"
ACCOUNT = "traefik"
GATEWAY_CLASS = "specpair-dev"
CONTROLLER = "traefik.io/gateway-controller"
GATEWAY_NAME = "specpair"
GATEWAY_API = "gateway.networking.k8s.io/v1"
MIRROR_MANAGER = "devcluster-gateway"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
# What Traefik's Kubernetes Gateway provider reads and writes (its kubernetes-gateway-rbac.yml), the
# experimental channel's TCPRoute and OpenTelemetry's pods `get` left out: nothing else (TLSRoute is
# in v1.6's standard channel, and Traefik watches it: without it the GatewayClass is never accepted).
CLUSTER_ROLE_RULES = [
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["services", "secrets", "configmaps"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    {"apiGroups": ["gateway.networking.k8s.io"],
     "resources": ["gatewayclasses", "gateways", "httproutes", "grpcroutes", "tlsroutes", "referencegrants",
                   "backendtlspolicies"],
     "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["gateway.networking.k8s.io"],
     "resources": ["gatewayclasses/status", "gateways/status", "httproutes/status", "grpcroutes/status",
                   "tlsroutes/status", "referencegrants/status", "backendtlspolicies/status"],
     "verbs": ["update"]},
]
CRDS = ("gatewayclasses", "gateways", "httproutes", "grpcroutes", "referencegrants", "backendtlspolicies")


def gateway_binaries() -> Path:
    """The folder with `traefik` ($SPECPAIR_GATEWAY_BIN or the build script's cache); the Gateway
    API CRDs are in ../crds."""
    return built_binaries("build-gateway.sh", "SPECPAIR_GATEWAY_BIN", ("traefik",))


# -- the EndpointSlice stand-in (module docstring) -------------------------------------------------

def _selects(selector: Mapping[str, str], pod: Mapping[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (not (pod.get("metadata") or {}).get("deletionTimestamp") and bool(status.get("podIP"))
            and any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []))


def _container_port(pod: Mapping[str, Any], target: Any) -> int | None:
    """A Service port's targetPort on this pod: a number, or a named container port."""
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target:
                return int(port["containerPort"])
    return None


def endpoint_slice(service: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The FQDN EndpointSlice standing in for the controller's for `service` (None: the Service has
    no selector, so its slices are its owner's). Ports resolve on the first selected pod, as every
    pod of one Service here runs one template; the slice lists ready pods only."""
    spec = service.get("spec") or {}
    selector = spec.get("selector") or {}
    if not selector:
        return None
    meta = service["metadata"]
    chosen = sorted((p for p in pods if _selects(selector, p)), key=lambda p: p["metadata"]["name"])
    ports = []
    for port in spec.get("ports") or []:
        target = port.get("targetPort", port["port"])
        number = next((n for n in (_container_port(p, target) for p in chosen) if n), None)
        if number is None and isinstance(target, int):
            number = target
        if number is not None:
            ports.append({"name": port.get("name", ""), "port": number, "protocol": port.get("protocol", "TCP"),
                          **({"appProtocol": port["appProtocol"]} if port.get("appProtocol") else {})})
    endpoints = [{"addresses": [p["status"]["podIP"]], "conditions": {"ready": True},
                  "targetRef": {"kind": "Pod", "namespace": meta["namespace"], "name": p["metadata"]["name"],
                                "uid": p["metadata"]["uid"]}}
                 for p in chosen if _ready(p)]
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{meta['name']}-devcluster", "namespace": meta["namespace"],
                         "labels": {SERVICE_NAME_LABEL: meta["name"], MANAGED_BY_LABEL: MIRROR_MANAGER},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": meta["name"],
                                              "uid": meta["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "addressType": "FQDN", "endpoints": endpoints, "ports": ports}


class EndpointMirror:
    """Keeps `endpoint_slice` of every selector Service in `namespaces`, looking every `interval`
    seconds (level-triggered: a missed change is seen at the next look)."""

    def __init__(self, kube: Any, namespaces: Iterable[str], interval: float = 0.5):
        self.kube, self.namespaces, self.interval = kube, list(namespaces), interval
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sync(self) -> None:
        for ns in self.namespaces:
            services = self.kube.list("v1", "Service", ns)
            pods = self.kube.list("v1", "Pod", ns)
            slices = {s["metadata"]["name"]: s for s in self.kube.list(
                "discovery.k8s.io/v1", "endpointslices", ns, labels=f"{MANAGED_BY_LABEL}={MIRROR_MANAGER}")}
            wanted = {}
            for service in services:
                desired = endpoint_slice(service, pods)
                if desired is not None:
                    wanted[desired["metadata"]["name"]] = desired
            for name, desired in wanted.items():
                live = slices.get(name)
                if live is None:
                    self.kube.request("POST", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", body=desired)
                elif (live.get("endpoints") or []) != desired["endpoints"] or (live.get("ports") or []) != desired["ports"]:
                    self.kube.patch("discovery.k8s.io/v1", "endpointslices", ns, name,
                                    {"endpoints": desired["endpoints"], "ports": desired["ports"]})
            for name in set(slices) - set(wanted):
                self.kube.delete("discovery.k8s.io/v1", "endpointslices", ns, name)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except (ApiError, OSError) as exc:   # the next look tries again
                self.errors.append(str(exc)[:300])
                del self.errors[:-20]
            self._stop.wait(self.interval)

    def start(self) -> "EndpointMirror":
        self.sync()
        self._thread = threading.Thread(target=self._run, name="endpoint-mirror", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


# -- Traefik ---------------------------------------------------------------------------------------

class DevGateway:
    """Traefik's Gateway API provider for a DevCluster (`cluster`), routing on 127.0.0.1:`port`.
    `namespaces`: where EndpointMirror keeps slices for selector Services (the pods' namespaces)."""

    def __init__(self, cluster: Any, workdir: Path, namespaces: Iterable[str] = (), port: int | None = None):
        self.cluster, self.workdir = cluster, Path(workdir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.address = f"127.0.0.1:{self.port}"
        self.mirror = EndpointMirror(cluster.kube, namespaces)
        self.child: Child | None = None
        self._ping = f"http://127.0.0.1:{free_port()}"

    def install(self, crds: Path) -> None:
        """The Gateway API CRDs (standard channel), the ServiceAccount and its RBAC, the GatewayClass."""
        # Server-side: the CRDs are larger than client-side apply's annotation allows.
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crds))
        kube = self.cluster.kube
        wait_until(lambda: all(_established(kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None,
                                                     f"{c}.gateway.networking.k8s.io")) for c in CRDS),
                   60, what="the Gateway API CRDs established")
        name = f"{NAMESPACE}-{ACCOUNT}"
        for obj in ({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": ACCOUNT, "namespace": NAMESPACE}},
                    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
                     "rules": CLUSTER_ROLE_RULES},
                    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                     "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}]},
                    {"apiVersion": GATEWAY_API, "kind": "GatewayClass", "metadata": {"name": GATEWAY_CLASS},
                     "spec": {"controllerName": CONTROLLER}}):
            meta = obj["metadata"]
            plural = "gatewayclasses" if obj["kind"] == "GatewayClass" else obj["kind"]
            if kube.get(obj["apiVersion"], plural, meta.get("namespace"), meta["name"]) is None:
                kube.request("POST", _collection(obj["apiVersion"], plural, meta.get("namespace")), body=obj)
        self.cluster.ensure_namespace(NAMESPACE)

    def start(self, timeout: float = 120.0) -> "DevGateway":
        started = time.monotonic()
        binaries = gateway_binaries()
        self.install(binaries.parent / "crds")
        self.workdir.mkdir(parents=True, exist_ok=True)
        kubeconfig = self.cluster.service_account_kubeconfig(NAMESPACE, ACCOUNT, self.workdir / "kubeconfig")
        self.mirror.start()
        self.child = Child("traefik", [
            str(binaries / "traefik"),
            f"--entryPoints.web.address={self.address}",
            f"--entryPoints.traefik.address={self._ping.removeprefix('http://')}", "--ping=true",
            "--providers.kubernetesGateway=true",
            # Every change programmed at once (the default waits for more before it reloads).
            "--providers.kubernetesGateway.throttleDuration=0s",
            "--providers.kubernetesGateway.statusAddress.ip=127.0.0.1",
            "--log.level=INFO", "--accesslog=false", "--global.checkNewVersion=false",
            "--global.sendAnonymousUsage=false"],
            self.workdir / "traefik.log", env={"KUBECONFIG": str(kubeconfig), "PATH": "/usr/bin:/bin"})
        try:
            remaining = max(10.0, timeout - (time.monotonic() - started))
            wait_until(self._pinged, remaining, interval=0.3, what="Traefik's /ping", abort=self._dead)
            wait_until(self._class_accepted, max(10.0, timeout - (time.monotonic() - started)), interval=0.3,
                       what=f"GatewayClass {GATEWAY_CLASS} Accepted", abort=self._dead)
        except BaseException:
            # A start that fails leaves nothing running (a test's fixture never reaches its stop()).
            self.stop()
            raise
        return self

    def gateway(self, namespace: str, name: str = GATEWAY_NAME, timeout: float = 60.0) -> dict[str, Any]:
        """A Gateway in `namespace` with one HTTP listener on the entry point's port, taking routes
        from every namespace; returned once Traefik says it is Programmed."""
        kube = self.cluster.kube
        body = {"apiVersion": GATEWAY_API, "kind": "Gateway", "metadata": {"name": name, "namespace": namespace},
                "spec": {"gatewayClassName": GATEWAY_CLASS,
                         "listeners": [{"name": "web", "protocol": "HTTP", "port": self.port,
                                        "allowedRoutes": {"namespaces": {"from": "All"}}}]}}
        if kube.get(GATEWAY_API, "gateways", namespace, name) is None:
            kube.request("POST", _collection(GATEWAY_API, "gateways", namespace), body=body)

        def programmed() -> bool:
            got = kube.get(GATEWAY_API, "gateways", namespace, name) or {}
            return _condition(got, "Programmed")
        wait_until(programmed, timeout, interval=0.3, what=f"Gateway {namespace}/{name} Programmed", abort=self._dead)
        return kube.get(GATEWAY_API, "gateways", namespace, name)

    def _pinged(self) -> bool:
        return http_ok(self._ping + "/ping")

    def _class_accepted(self) -> bool:
        return _condition(self.cluster.kube.get(GATEWAY_API, "gatewayclasses", None, GATEWAY_CLASS) or {}, "Accepted")

    def _dead(self) -> str | None:
        return first_exit([self.child])

    def stop(self) -> None:
        self.mirror.stop()
        if self.child is not None:
            self.child.stop()
            self.child = None

    def __enter__(self) -> "DevGateway":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _collection(api_version: str, plural: str, namespace: str | None) -> str:
    from .client import resource_path
    return resource_path(api_version, plural, namespace)


def _condition(obj: Mapping[str, Any], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True"
               for c in ((obj or {}).get("status") or {}).get("conditions") or [])


def _established(crd: Mapping[str, Any] | None) -> bool:
    return _condition(crd or {}, "Established")
