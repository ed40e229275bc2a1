"""A small in-process Kubernetes API server for tests: just what Kopf and the operator rely on.

Why not kmock 0.8 as is: it is a request mock with an object store on the side, and for a Kopf
operator it falls short in nine places (no resourceVersion/uid/generation/creationTimestamp,
create answers 200, core discovery says `/v1`, `GET /api/v1/namespaces` breaks its path
parser, events between a list and its watch are lost, no label selectors, status is not a
separate subresource, no JSON patch with `test`, no controllers). Patching each of those means
overriding its parser, its discovery and its store at once, so this module replaces the server
part with one that behaves like kube-apiserver for these semantics:

- discovery (/api, /api/v1, /apis, /apis/G/V) listing `X/status` subresources; CRDs from YAML;
- monotonic resourceVersion, uid, generation (bumped on spec changes only), creationTimestamp;
- create -> 201 (409 on duplicates), status dropped on create and on main-resource writes where
  a status subresource exists, and only status accepted via /status;
- merge patch, strategic merge (treated as merge) and JSON patch with `test` (422 on failure);
- list with labelSelector (=, ==, !=, in, notin, exists, !exists) and resourceVersion;
- watch from any resourceVersion: events since then are replayed, then streamed live (nothing
  lost between list and watch), with timeoutSeconds;
- delete honouring finalizers (deletionTimestamp), and cascading to owner-referenced objects;
- CRD structural defaults applied on create/update (as the real server does).

It does not run controllers: tests play the kubelet and the Deployment/Job controllers by
patching status (see `KubeletStandIn` in conftest).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import yaml
from aiohttp import web


@dataclass
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    status_subresource: bool = False
    schema: dict[str, Any] | None = None
    short_names: list[str] = field(default_factory=list)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


BUILTINS = [
    ResourceType("", "v1", "namespaces", "Namespace", namespaced=False, status_subresource=True),
    ResourceType("", "v1", "pods", "Pod", status_subresource=True),
    ResourceType("", "v1", "services", "Service", status_subresource=True),
    ResourceType("", "v1", "configmaps", "ConfigMap"),
    ResourceType("", "v1", "secrets", "Secret"),
    ResourceType("", "v1", "events", "Event"),
    ResourceType("events.k8s.io", "v1", "events", "Event"),
    ResourceType("apps", "v1", "deployments", "Deployment", status_subresource=True),
    ResourceType("batch", "v1", "jobs", "Job", status_subresource=True),
]


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def response(self) -> web.Response:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}
        return web.json_response(body, status=self.code)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902: add, remove, replace, test (the ones Kopf and operators use)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = _pointer(op["path"])
        if not parts:
            if op["op"] == "test":
                if doc != op["value"]:
                    raise ApiError(422, "Invalid", "test failed at root")
                continue
            doc = copy.deepcopy(op["value"])
            continue
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent.get(p) if isinstance(parent, dict) else None
            if parent is None:
                if op["op"] == "test":
                    raise ApiError(422, "Invalid", f"test failed: {op['path']} missing")
                raise ApiError(422, "Invalid", f"path {op['path']} does not exist")
        last = parts[-1]
        kind = op["op"]
        if kind == "test":
            cur = (parent[int(last)] if isinstance(parent, list) and last.isdigit() and int(last) < len(parent)
                   else parent.get(last, object()) if isinstance(parent, dict) else object())
            if cur != op.get("value"):
                raise ApiError(422, "Invalid", f"test failed at {op['path']}: {cur!r} != {op.get('value')!r}")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(copy.deepcopy(op["value"]))
                elif kind == "add":
                    parent.insert(int(last), copy.deepcopy(op["value"]))
                else:
                    parent[int(last)] = copy.deepcopy(op["value"])
            else:
                if kind == "replace" and last not in parent:
                    raise ApiError(422, "Invalid", f"replace: {op['path']} missing")
                parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            try:
                del parent[int(last) if isinstance(parent, list) else last]
            except (KeyError, IndexError) as exc:
                raise ApiError(422, "Invalid", f"remove: {op['path']} missing") from exc
        else:
            raise ApiError(422, "Invalid", f"unsupported op {kind}")
    return doc


def apply_defaults(obj: Any, schema: dict[str, Any] | None) -> Any:
    """Structural-schema defaulting: absent properties with a `default` get it, recursively."""
    if not schema or not isinstance(obj, dict):
        return obj
    for name, sub in (schema.get("properties") or {}).items():
        if name not in obj and "default" in sub:
            obj[name] = copy.deepcopy(sub["default"])
        if name in obj:
            if isinstance(obj[name], dict):
                apply_defaults(obj[name], sub)
            elif isinstance(obj[name], list) and isinstance(sub.get("items"), dict):
                for item in obj[name]:
                    apply_defaults(item, sub["items"])
    return obj


def parse_label_selector(text: str | None) -> list[tuple[str, str, set[str]]]:
    """[(key, op, values)] with op in =, !=, in, notin, exists, !exists."""
    if not text:
        return []
    reqs, buf, depth = [], "", 0
    for ch in text:  # split on commas outside parentheses
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            reqs.append(buf)
            buf = ""
        else:
            buf += ch
    reqs.append(buf)
    out = []
    for r in (r.strip() for r in reqs if r.strip()):
        if " notin " in r or " in " in r:
            op = "notin" if " notin " in r else "in"
            key, vals = r.split(f" {op} ", 1)
            out.append((key.strip(), op, {v.strip() for v in vals.strip().strip("()").split(",") if v.strip()}))
        elif "!=" in r:
            k, v = r.split("!=", 1)
            out.append((k.strip(), "!=", {v.strip()}))
        elif "==" in r or "=" in r:
            k, v = r.split("==", 1) if "==" in r else r.split("=", 1)
            out.append((k.strip(), "=", {v.strip()}))
        elif r.startswith("!"):
            out.append((r[1:].strip(), "!exists", set()))
        else:
            out.append((r, "exists", set()))
    return out


def labels_match(labels: dict[str, str] | None, selector: list[tuple[str, str, set[str]]]) -> bool:
    labels = labels or {}
    for key, op, vals in selector:
        has, val = key in labels, labels.get(key)
        if op in ("=", "in") and (not has or val not in vals):
            return False
        if op in ("!=", "notin") and has and val in vals:
            return False
        if op == "exists" and not has:
            return False
        if op == "!exists" and has:
            return False
    return True


class KubeEmulator:
    """The store plus an aiohttp app serving it. Use `start()`/`stop()` inside a running loop."""

    def __init__(self) -> None:
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        for rt in BUILTINS:
            self.add_type(rt)
        self.objects: dict[tuple[str, str, str | None, str], dict[str, Any]] = {}
        self.events: list[tuple[int, tuple[str, str], str, dict[str, Any]]] = []  # (rv, (group, plural), type, obj)
        self.rv = 0
        self.changed = asyncio.Condition()
        self.requests: list[tuple[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    # -- types ---------------------------------------------------------------------------

    def add_type(self, rt: ResourceType) -> None:
        self.types[(rt.group, rt.version, rt.plural)] = rt

    def load_crd(self, path: str) -> None:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if not doc or doc.get("kind") != "CustomResourceDefinition":
                    continue
                spec = doc["spec"]
                for v in spec["versions"]:
                    if not v.get("served", True):
                        continue
                    self.add_type(ResourceType(
                        spec["group"], v["name"], spec["names"]["plural"], spec["names"]["kind"],
                        namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                        status_subresource="status" in (v.get("subresources") or {}),
                        schema=(v.get("schema") or {}).get("openAPIV3Schema"),
                        short_names=spec["names"].get("shortNames", [])))

    def _type(self, group: str, version: str, plural: str) -> ResourceType:
        rt = self.types.get((group, version, plural))
        if rt is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({group}/{version} {plural})")
        return rt

    # -- store operations (also used directly by tests playing controllers) ------------------

    def _bump(self) -> str:
        self.rv += 1
        return str(self.rv)

    async def _emit(self, rt: ResourceType, etype: str, obj: dict[str, Any]) -> None:
        self.events.append((self.rv, (rt.group, rt.plural), etype, copy.deepcopy(obj)))
        async with self.changed:
            self.changed.notify_all()

    def _key(self, rt: ResourceType, ns: str | None, name: str) -> tuple[str, str, str | None, str]:
        return (rt.group, rt.plural, ns if rt.namespaced else None, name)

    def get(self, rt: ResourceType, ns: str | None, name: str) -> dict[str, Any]:
        obj = self.objects.get(self._key(rt, ns, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{rt.plural}.{rt.group or "core"} "{name}" not found')
        return obj

    async def create(self, rt: ResourceType, ns: str | None, body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        if rt.namespaced:
            ns = ns or meta.get("namespace") or "default"
            meta["namespace"] = ns
        key = self._key(rt, ns, name)
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f'{rt.plural}.{rt.group or "core"} "{name}" already exists')
        if rt.status_subresource:
            body.pop("status", None)
        body["apiVersion"], body["kind"] = rt.api_version, rt.kind
        apply_defaults(body, rt.schema)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1, resourceVersion=self._bump())
        self.objects[key] = body
        await self._emit(rt, "ADDED", body)
        return body

    async def replace(self, rt: ResourceType, ns: str | None, name: str, new: dict[str, Any],
                      subresource: str | None = None, expected_rv: str | None = None) -> dict[str, Any]:
        """Store a new full body, enforcing status-subresource separation and generation rules."""
        old = self.get(rt, ns, name)
        if expected_rv is not None and expected_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.plural} "{name}": '
                                            "the object has been modified; please apply your changes to the latest version")
        new = copy.deepcopy(new)
        if rt.status_subresource:
            if subresource == "status":
                new = {**copy.deepcopy(old), "status": new.get("status")}
                if new["status"] is None:
                    new.pop("status")
            else:
                new.pop("status", None)
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
        apply_defaults(new, rt.schema)
        meta = new.setdefault("metadata", {})
        # Identity fields are the server's, whatever the client sent.
        for k in ("uid", "creationTimestamp", "name", "namespace"):
            if k in old["metadata"]:
                meta[k] = old["metadata"][k]
        meta["generation"] = old["metadata"].get("generation", 1)
        if {k: v for k, v in new.items() if k not in ("metadata", "status")} != \
           {k: v for k, v in old.items() if k not in ("metadata", "status")}:
            meta["generation"] += 1
        if new == old or (new.get("metadata") == old["metadata"] and
                          {k: v for k, v in new.items() if k != "metadata"} == {k: v for k, v in old.items() if k != "metadata"}):
            return old  # a no-op write does not bump resourceVersion (as the real server)
        new["apiVersion"], new["kind"] = rt.api_version, rt.kind
        meta["resourceVersion"] = self._bump()
        key = self._key(rt, ns, name)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            del self.objects[key]
            await self._emit(rt, "DELETED", new)
            await self._cascade(meta["uid"])
            return new
        self.objects[key] = new
        await self._emit(rt, "MODIFIED", new)
        return new

    async def patch(self, rt: ResourceType, ns: str | None, name: str, patch: Any, content_type: str,
                    subresource: str | None = None) -> dict[str, Any]:
        old = self.get(rt, ns, name)
        if "json-patch" in content_type:
            new = json_patch(old, patch)
        else:  # merge-patch and strategic-merge-patch (lists replaced: good enough here)
            new = merge_patch(old, patch)
        return await self.replace(rt, ns, name, new, subresource)

    async def delete(self, rt: ResourceType, ns: str | None, name: str) -> dict[str, Any]:
        obj = self.get(rt, ns, name)
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                new = copy.deepcopy(obj)
                new["metadata"]["deletionTimestamp"] = _now()
                new["metadata"]["resourceVersion"] = self._bump()
                self.objects[self._key(rt, ns, name)] = new
                await self._emit(rt, "MODIFIED", new)
                return new
            return obj
        del self.objects[self._key(rt, ns, name)]
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._bump()
        await self._emit(rt, "DELETED", obj)
        await self._cascade(obj["metadata"]["uid"])
        return obj

    async def _cascade(self, owner_uid: str) -> None:
        """The garbage collector's job, done at once: delete what the deleted object owned."""
        for (group, plural, ns, name), obj in list(self.objects.items()):
            if any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or []):
                rt = next(t for t in self.types.values() if t.group == group and t.plural == plural)
                if self._key(rt, ns, name) in self.objects:
                    await self.delete(rt, ns, name)

    def list(self, rt: ResourceType, ns: str | None, selector: str | None = None) -> list[dict[str, Any]]:
        sel = parse_label_selector(selector)
        return [copy.deepcopy(o) for (g, p, ons, _), o in sorted(self.objects.items(), key=lambda kv: str(kv[0]))
                if g == rt.group and p == rt.plural and (ns is None or ons == ns)
                and labels_match(o["metadata"].get("labels"), sel)]

    # -- convenience for tests -------------------------------------------------------------

    def find_type(self, api_version: str, kind_or_plural: str) -> ResourceType:
        group, _, version = api_version.rpartition("/")
        for rt in self.types.values():
            if rt.group == group and rt.version == version and kind_or_plural in (rt.kind, rt.plural):
                return rt
        raise KeyError(f"{api_version} {kind_or_plural}")

    # -- HTTP ------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        r = app.router
        r.add_get("/version", self._version)
        r.add_get("/api", self._core_versions)
        r.add_get("/apis", self._groups)
        r.add_get("/api/{version}", self._resource_list_core)
        r.add_get("/apis/{group}/{version}", self._resource_list)
        for prefix, group in (("/api/{version}", ""), ("/apis/{group}/{version}", None)):
            for scope in ("/namespaces/{namespace}", ""):  # namespaced first: more specific
                base = f"{prefix}{scope}/{{plural}}"
                r.add_route("*", base, self._collection(group))
                r.add_route("*", base + "/{name}", self._item(group))
                r.add_route("*", base + "/{name}/{subresource}", self._item(group))
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0-specpair-emulator",
                                  "platform": "linux/amd64"})

    async def _core_versions(self, request: web.Request) -> web.Response:
        return web.json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})

    async def _groups(self, request: web.Request) -> web.Response:
        groups: dict[str, list[str]] = {}
        for rt in self.types.values():
            if rt.group:
                groups.setdefault(rt.group, [])
                if rt.version not in groups[rt.group]:
                    groups[rt.group].append(rt.version)
        items = [{"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                  "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]}}
                 for g, vs in sorted(groups.items())]
        return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": items})

    def _discovery(self, group: str, version: str) -> web.Response:
        rts = [rt for rt in self.types.values() if rt.group == group and rt.version == version]
        if not rts:
            raise ApiError(404, "NotFound", f"no group version {group}/{version}")
        resources = []
        for rt in rts:
            resources.append({"name": rt.plural, "singularName": rt.kind.lower(), "namespaced": rt.namespaced,
                              "kind": rt.kind, "shortNames": rt.short_names,
                              "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]})
            if rt.status_subresource:
                resources.append({"name": f"{rt.plural}/status", "singularName": "", "namespaced": rt.namespaced,
                                  "kind": rt.kind, "verbs": ["get", "patch", "update"]})
        gv = f"{group}/{version}" if group else version
        return web.json_response({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
                                  "resources": resources})

    async def _resource_list_core(self, request: web.Request) -> web.Response:
        return self._discovery("", request.match_info["version"])

    async def _resource_list(self, request: web.Request) -> web.Response:
        return self._discovery(request.match_info["group"], request.match_info["version"])

    def _collection(self, fixed_group: str | None) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            m = request.match_info
            rt = self._type(fixed_group if fixed_group is not None else m["group"], m["version"], m["plural"])
            ns = m.get("namespace")
            if request.method == "GET":
                if request.query.get("watch") in ("true", "1"):
                    return await self._watch(request, rt, ns)
                items = self.list(rt, ns, request.query.get("labelSelector"))
                return web.json_response({"kind": f"{rt.kind}List", "apiVersion": rt.api_version,
                                          "metadata": {"resourceVersion": str(self.rv)}, "items": items})
            if request.method == "POST":
                obj = await self.create(rt, ns, await request.json())
                return web.json_response(obj, status=201)
            raise ApiError(405, "MethodNotAllowed", f"{request.method} not allowed on a collection")
        return handler

    def _item(self, fixed_group: str | None) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            m = request.match_info
            rt = self._type(fixed_group if fixed_group is not None else m["group"], m["version"], m["plural"])
            ns, name, sub = m.get("namespace"), m["name"], m.get("subresource")
            if sub not in (None, "status") or (sub == "status" and not rt.status_subresource):
                raise ApiError(404, "NotFound", f"no subresource {sub} on {rt.plural}")
            if request.method == "GET":
                return web.json_response(self.get(rt, ns, name))
            if request.method == "PATCH":
                obj = await self.patch(rt, ns, name, await request.json(), request.content_type, sub)
                return web.json_response(obj)
            if request.method == "PUT":
                body = await request.json()
                obj = await self.replace(rt, ns, name, body, sub, (body.get("metadata") or {}).get("resourceVersion"))
                return web.json_response(obj)
            if request.method == "DELETE":
                return web.json_response(await self.delete(rt, ns, name))
            raise ApiError(405, "MethodNotAllowed", request.method)
        return handler

    async def _watch(self, request: web.Request, rt: ResourceType, ns: str | None) -> web.StreamResponse:
        sel = parse_label_selector(request.query.get("labelSelector"))
        since = int(request.query.get("resourceVersion") or 0) if request.query.get("resourceVersion") not in (None, "") else None
        timeout = float(request.query.get("timeoutSeconds") or 3600)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if since is None:  # no resourceVersion: the current state as ADDED, then live
            for obj in self.list(rt, ns):
                if labels_match(obj["metadata"].get("labels"), sel):
                    await resp.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            since = self.rv
        cursor = since
        try:
            while loop.time() < deadline:
                for rv, (g, p), etype, obj in [e for e in self.events if e[0] > cursor]:
                    cursor = rv
                    if (g, p) != (rt.group, rt.plural):
                        continue
                    if ns is not None and obj["metadata"].get("namespace") != ns:
                        continue
                    if not labels_match(obj["metadata"].get("labels"), sel):
                        continue
                    await resp.write(json.dumps({"type": etype, "object": obj}).encode() + b"\n")
                async with self.changed:
                    if not (self.events and self.events[-1][0] > cursor):
                        try:
                            await asyncio.wait_for(self.changed.wait(), timeout=max(0.01, min(5.0, deadline - loop.time())))
                        except TimeoutError:
                            pass
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        await resp.write_eof()
        return resp

    async def start(self) -> str:
        self.runner = web.AppRunner(self.app(), handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
