"""A small synchronous client for the Kubernetes REST API, used by the node agent, the demo and
the tests. It speaks to the real kube-apiserver with a kubeconfig's certificate or token; it
adds no behaviour of its own (no retries, no caching), so what a test sees is what the server
answered.
"""

from __future__ import annotations

import base64
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

import requests
import yaml


class ApiError(Exception):
    def __init__(self, status: int, body: Any):
        self.status, self.body = status, body
        message = body.get("message") if isinstance(body, dict) else str(body)
        self.reason = body.get("reason", "") if isinstance(body, dict) else ""
        super().__init__(f"HTTP {status} {self.reason}: {message}")

    @property
    def message(self) -> str:
        return self.body.get("message", "") if isinstance(self.body, dict) else str(self.body)


# Kinds this project touches -> (plural, namespaced). Anything else: pass `plural=` explicitly.
RESOURCES: dict[str, tuple[str, bool]] = {
    "Pod": ("pods", True), "Service": ("services", True), "ConfigMap": ("configmaps", True),
    "Secret": ("secrets", True), "Event": ("events", True), "ServiceAccount": ("serviceaccounts", True),
    "Namespace": ("namespaces", False), "Node": ("nodes", False),
    "Deployment": ("deployments", True), "ReplicaSet": ("replicasets", True), "Job": ("jobs", True),
    "Lease": ("leases", True), "Role": ("roles", True), "RoleBinding": ("rolebindings", True),
    "ClusterRole": ("clusterroles", False), "ClusterRoleBinding": ("clusterrolebindings", False),
    "CustomResourceDefinition": ("customresourcedefinitions", False),
    "SpecModelPair": ("specmodelpairs", True),
    "PersistentVolume": ("persistentvolumes", False), "PersistentVolumeClaim": ("persistentvolumeclaims", True),
}


def resource_path(api_version: str, kind_or_plural: str, namespace: str | None = None, name: str | None = None,
                  subresource: str | None = None) -> str:
    plural, namespaced = RESOURCES.get(kind_or_plural, (kind_or_plural, namespace is not None))
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespaced and namespace:
        base += f"/namespaces/{quote(namespace)}"
    base += f"/{plural}"
    if name:
        base += f"/{quote(name)}"
    if subresource:
        base += f"/{subresource}"
    return base


@dataclass
class Credentials:
    server: str
    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = None
    namespace: str = "default"


def load_kubeconfig(path: str | Path) -> Credentials:
    """The current context of a kubeconfig (file paths or inline base64 data, cert or token)."""
    cfg = yaml.safe_load(Path(path).read_text())
    ctx_name = cfg.get("current-context")
    ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
    user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])

    def materialise(file_key: str, data_key: str, src: dict[str, Any]) -> str | None:
        if src.get(file_key):
            return str(src[file_key])
        if src.get(data_key):
            tmp = tempfile.NamedTemporaryFile(prefix="kubeconfig-", delete=False)
            tmp.write(base64.b64decode(src[data_key]))
            tmp.close()
            return tmp.name
        return None

    return Credentials(server=cluster["server"],
                       ca_file=materialise("certificate-authority", "certificate-authority-data", cluster) or "",
                       cert_file=materialise("client-certificate", "client-certificate-data", user),
                       key_file=materialise("client-key", "client-key-data", user),
                       token=user.get("token"), namespace=ctx.get("namespace", "default"))


class Kube:
    """unreachable_retry_s > 0: a request that gets no answer (connection refused or dropped) or
    a 503 (an API server starting) is sent again every half second for that long, as a kubelet's
    client keeps trying while the API server restarts (the node agents' clients); 0, the default,
    answers with what happened."""

    def __init__(self, creds: Credentials, timeout: float = 30.0, unreachable_retry_s: float = 0.0):
        self.creds = creds
        self.timeout = timeout
        self.unreachable_retry_s = unreachable_retry_s
        self.session = requests.Session()
        # Our CA, not the environment's bundle (REQUESTS_CA_BUNDLE would override `verify`), no proxies.
        self.session.trust_env = False
        self.session.verify = creds.ca_file or True
        if creds.cert_file:
            self.session.cert = (creds.cert_file, creds.key_file)
        if creds.token:
            self.session.headers["Authorization"] = f"Bearer {creds.token}"

    @classmethod
    def from_kubeconfig(cls, path: str | Path, **options: Any) -> "Kube":
        return cls(load_kubeconfig(path), **options)

    def request(self, method: str, path: str, *, body: Any = None, params: dict[str, Any] | None = None,
                content_type: str = "application/json", timeout: float | None = None) -> Any:
        deadline = time.monotonic() + self.unreachable_retry_s
        while True:
            try:
                resp = self.session.request(method, self.creds.server + path, params=params,
                                            data=None if body is None else json.dumps(body),
                                            headers={"Content-Type": content_type, "Accept": "application/json"},
                                            timeout=timeout or self.timeout)
            except requests.ConnectionError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
                continue
            if resp.status_code != 503 or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        try:
            payload = resp.json() if resp.content else None
        except ValueError:
            payload = resp.text
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, payload)
        return payload

    # -- verbs -----------------------------------------------------------------------------

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", resource_path(api_version, kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str | None = None, *, labels: str | None = None,
             fields: str | None = None) -> list[dict[str, Any]]:
        params = {k: v for k, v in (("labelSelector", labels), ("fieldSelector", fields)) if v}
        return list(self.request("GET", resource_path(api_version, kind, namespace), params=params).get("items") or [])

    def create(self, obj: dict[str, Any], subresource: str | None = None, name: str | None = None) -> dict[str, Any]:
        meta = obj.get("metadata") or {}
        return self.request("POST", resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), name, subresource),
                            body=obj)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create, or replace the spec of an existing object (what `kubectl apply` amounts to here)."""
        meta = obj["metadata"]
        live = self.get(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        if live is None:
            return self.create(obj)
        return self.patch(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"],
                          {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "status")})

    def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: Any, *,
              subresource: str | None = None, kind_of_patch: str = "merge") -> dict[str, Any]:
        ctype = {"merge": "application/merge-patch+json", "strategic": "application/strategic-merge-patch+json",
                 "json": "application/json-patch+json"}[kind_of_patch]
        return self.request("PATCH", resource_path(api_version, kind, namespace, name, subresource), body=patch,
                            content_type=ctype)

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str, *,
               grace_seconds: int | None = None, propagation: str | None = None,
               uid: str | None = None) -> bool:
        """True when the server accepted the deletion, False when the object was already gone."""
        opts: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if grace_seconds is not None:
            opts["gracePeriodSeconds"] = grace_seconds
        if propagation:
            opts["propagationPolicy"] = propagation
        if uid:
            opts["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", resource_path(api_version, kind, namespace, name), body=opts)
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    def watch(self, api_version: str, kind: str, namespace: str | None = None, *, resource_version: str = "",
              fields: str | None = None, timeout_seconds: int = 60) -> Iterator[dict[str, Any]]:
        """Watch events ({"type", "object"}) until the server closes the stream."""
        params: dict[str, Any] = {"watch": "1", "timeoutSeconds": timeout_seconds, "allowWatchBookmarks": "true"}
        if resource_version:
            params["resourceVersion"] = resource_version
        if fields:
            params["fieldSelector"] = fields
        with self.session.get(self.creds.server + resource_path(api_version, kind, namespace), params=params,
                              stream=True, timeout=(10, timeout_seconds + 10)) as resp:
            if resp.status_code >= 400:
                raise ApiError(resp.status_code, resp.text)
            for line in resp.iter_lines():
                if line:
                    yield json.loads(line)

    def close(self) -> None:
        self.session.close()
