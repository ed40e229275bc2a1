"""A thin async Kubernetes client for the objects the operator owns (Jobs, Deployments, ...).

Kopf has no public client for arbitrary resources; this one uses the same credentials Kopf
logged in with (see handlers.login), so the operator has one identity and one RBAC story.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import ssl
from typing import Any, AsyncIterator
from urllib.parse import quote

import aiohttp
from yarl import URL


# The API server refused the request itself (malformed, forbidden, invalid): sending it again
# gets the same answer until a person changes the spec, the RBAC or the cluster's policy.
PERMANENT_STATUSES = frozenset({400, 403, 422})


class KubeError(Exception):
    """An answer of the API server (status >= 400), or status 0: no answer (connection refused
    or reset, a timeout), which is always worth retrying."""

    def __init__(self, status: int, body: Any):
        super().__init__(f"HTTP {status}: {body}" if status else f"no answer from the API server: {body}")
        self.status, self.body = status, body

    @property
    def permanent(self) -> bool:
        return self.status in PERMANENT_STATUSES

    @property
    def message(self) -> str:
        """The API server's own words (a Status object's message), else the whole body."""
        if isinstance(self.body, dict) and isinstance(self.body.get("message"), str):
            return self.body["message"]
        return str(self.body)


def _segment(text: str) -> str:
    """One path segment, every reserved character escaped: a name with '/' in it stays one
    segment (which the API server then refuses), never a path into another namespace. '', '.'
    and '..' are refused here: no escaping keeps them from meaning "here" or "up"."""
    if text in ("", ".", ".."):
        raise KubeError(400, {"message": f"{text!r} is not a valid name for a Kubernetes request path"})
    return quote(text, safe="")


def _path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
          subresource: str | None = None) -> str:
    group, _, version = api_version.rpartition("/")
    base = f"/apis/{_segment(group)}/{_segment(version)}" if group else f"/api/{_segment(version)}"
    if namespace:
        base += f"/namespaces/{_segment(namespace)}"
    base += f"/{_segment(plural)}"
    if name is not None:
        base += f"/{_segment(name)}"
    if subresource:
        base += f"/{_segment(subresource)}"
    return base


# A list's items (named outside Kube, whose own `list` would shadow the builtin in its annotations).
Items = list[dict[str, Any]]


class Kube:
    def __init__(self, server: str, token: str | None = None, ca_path: str | None = None,
                 ca_data: bytes | None = None, insecure: bool = False,
                 cert_path: str | None = None, key_path: str | None = None, timeout_s: float = 30.0):
        self.server = server.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.ssl: ssl.SSLContext | bool | None = None
        if self.server.startswith("https"):
            if insecure:
                self.ssl = False
            else:
                ctx = ssl.create_default_context(cafile=ca_path, cadata=ca_data.decode() if ca_data else None)
                if cert_path:
                    ctx.load_cert_chain(cert_path, key_path)
                self.ssl = ctx
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        # Watches stream on a session of their own, without aiohttp's cap of 100 connections a
        # session: a watch holds its connection for minutes, and the operator keeps one per
        # namespace and kind (clients/pod_watch.py: 6 kinds, so 17 namespaces are 102). On the
        # requests' session, 100 open watches left no connection for a request: every GET,
        # PATCH and LIST waited for one until its timeout ("no answer from the API server"),
        # and the operator stopped at ~860 pairs in 20 namespaces (2026-12-07f).
        self._watch_session: aiohttp.ClientSession | None = None

    @classmethod
    def from_connection_info(cls, info: Any) -> "Kube":
        return cls(info.server, token=info.token, ca_path=info.ca_path, ca_data=info.ca_data,
                   insecure=bool(info.insecure), cert_path=info.certificate_path, key_path=info.private_key_path)

    async def _request(self, method: str, path: str, *, json: Any = None, params: dict[str, str] | None = None,
                       content_type: str = "application/json") -> Any:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        headers = {**self.headers, "Content-Type": content_type, "Accept": "application/json"}
        try:
            # encoded=True: the path is sent as _path quoted it (yarl would otherwise decode
            # %2F back into a separator).
            async with self._session.request(method, URL(self.server + path, encoded=True), json=json,
                                             params=params, headers=headers, ssl=self.ssl) as resp:
                try:
                    body = await resp.json(content_type=None) if resp.content_length != 0 else None
                except ValueError:
                    if resp.status < 400:
                        raise
                    body = await resp.text()  # a plain-text refusal ("404 page not found")
                if resp.status >= 400:
                    raise KubeError(resp.status, body)
                return body
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise KubeError(0, f"{type(exc).__name__}: {exc}") from exc

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", _path(api_version, plural, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, api_version: str, plural: str, namespace: str | None,
                   label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        body = await self._request("GET", _path(api_version, plural, namespace), params=params)
        return list(body.get("items") or [])

    async def list_versioned(self, api_version: str, plural: str, namespace: str | None,
                             label_selector: str | None = None) -> tuple[Items, str]:
        """The items and the list's resourceVersion, from which a watch goes on (`watch`)."""
        params = {"labelSelector": label_selector} if label_selector else None
        body = await self._request("GET", _path(api_version, plural, namespace), params=params)
        return list(body.get("items") or []), str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def watch(self, api_version: str, plural: str, namespace: str | None, resource_version: str,
                    label_selector: str | None = None, timeout_s: int = 300) -> AsyncIterator[dict[str, Any]]:
        """The watch events ({"type", "object"}) after `resource_version`, with bookmarks, until the
        API server ends the watch (about `timeout_s`). KubeError: refused (410 Gone: the version is
        too old, list again) or broken off."""
        if self._watch_session is None or self._watch_session.closed:
            self._watch_session = aiohttp.ClientSession(timeout=self.timeout,
                                                        connector=aiohttp.TCPConnector(limit=0))
        params = {"watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(timeout_s)}
        if label_selector:
            params["labelSelector"] = label_selector
        # No total deadline for a stream; a read that waits past the server's own timeout is a
        # connection gone quiet.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout.total, sock_read=timeout_s + 30)
        try:
            async with self._watch_session.get(URL(self.server + _path(api_version, plural, namespace), encoded=True),
                                         params=params, headers={**self.headers, "Accept": "application/json"},
                                         ssl=self.ssl, timeout=timeout) as resp:
                if resp.status >= 400:
                    raise KubeError(resp.status, await resp.text())
                async for line in resp.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        raise KubeError(int(status.get("code") or 500), status)
                    yield event
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise KubeError(0, f"{type(exc).__name__}: {exc}") from exc

    async def create(self, obj: dict[str, Any], read_existing: bool = True, dry_run: bool = False) -> dict[str, Any]:
        """Create, or return the existing object of that name (409): creation is idempotent.
        read_existing=False raises the 409 instead (for kinds the operator may not read)."""
        meta = obj["metadata"]
        plural = PLURALS[obj["kind"]]
        try:
            return await self._request("POST", _path(obj["apiVersion"], plural, meta.get("namespace")), json=obj,
                                       params={"dryRun": "All"} if dry_run else None)
        except KubeError as exc:
            if exc.status != 409 or not read_existing:
                raise
            existing = await self.get(obj["apiVersion"], plural, meta.get("namespace"), meta["name"])
            if existing is None:
                raise
            return existing

    async def merge_patch(self, api_version: str, plural: str, namespace: str | None, name: str,
                          patch: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        return await self._request("PATCH", _path(api_version, plural, namespace, name, subresource), json=patch,
                                   content_type="application/merge-patch+json")

    async def json_patch(self, api_version: str, plural: str, namespace: str | None, name: str,
                         operations: list[dict[str, Any]], dry_run: bool = False) -> dict[str, Any]:
        """RFC 6902: a `test` operation makes the whole patch conditional (the API server
        refuses it, 422, when the test fails). dry_run: only the tests count, nothing is written
        (a way to ask about an object the operator may not read)."""
        return await self._request("PATCH", _path(api_version, plural, namespace, name), json=operations,
                                   params={"dryRun": "All"} if dry_run else None,
                                   content_type="application/json-patch+json")

    async def event(self, involved: dict[str, Any], type_: str, reason: str, message: str,
                    component: str = "specpair-operator") -> None:
        """A core/v1 Event on `involved` (a full object: apiVersion, kind, metadata)."""
        meta = involved["metadata"]
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        await self._request("POST", _path("v1", "events", meta["namespace"]), json={
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": involved["apiVersion"], "kind": involved["kind"], "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid", ""),
                               "resourceVersion": meta.get("resourceVersion", "")},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": component},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1})

    async def delete(self, api_version: str, plural: str, namespace: str | None, name: str, uid: str) -> bool:
        """Delete the object of that name only while it is still the one with `uid` (a
        precondition: a new object of the same name is left alone); False when already gone."""
        try:
            await self._request("DELETE", _path(api_version, plural, namespace, name), json={
                "apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid},
                "propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def served_resources(self, api_version: str) -> set[str]:
        """The resources the API server serves under a group/version (API discovery; empty when
        the group/version is not served, e.g. its CRDs are not installed)."""
        group, _, version = api_version.rpartition("/")
        path = f"/apis/{_segment(group)}/{_segment(version)}" if group else f"/api/{_segment(version)}"
        try:
            body = await self._request("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return set()
            raise
        return {r.get("name", "") for r in (body or {}).get("resources") or []}

    async def close(self) -> None:
        for session in (self._session, self._watch_session):
            if session is not None:
                await session.close()


PLURALS = {"Job": "jobs", "Deployment": "deployments", "Service": "services", "Pod": "pods",
           "ConfigMap": "configmaps", "Event": "events", "NetworkPolicy": "networkpolicies",
           "Secret": "secrets", "Lease": "leases", "HorizontalPodAutoscaler": "horizontalpodautoscalers",
           "ScaledObject": "scaledobjects", "HTTPRoute": "httproutes", "GRPCRoute": "grpcroutes"}
