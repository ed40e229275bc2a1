"""The objects a pair owns (engine Deployment and Service, NetworkPolicies, gate Jobs, the
engine's TLS Secret), all written through one create-or-patch: `ensure_owned`.

An object of the child's name that the pair does not own (no controller owner reference with
the pair's uid) is never touched: the answer is CONFLICT and the caller reports NameConflict.
Mutable kinds carry a fingerprint of their manifest (annotation `specpair.io/manifest-hash`), so
an owned object is patched exactly when what the operator would render differs from what it
rendered last; create-only kinds (Jobs, Services: RBAC grants no patch) are only created.
Kinds the operator may not read (Secrets) are created, or replaced in place when a JSON-patch
test on their owner's uid proves them the pair's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import kopf

from specpair_operator.clients.kube import PLURALS, Kube, KubeError

ANN_MANIFEST = "specpair.io/manifest-hash"

CREATED, PATCHED, UNCHANGED, CONFLICT = "created", "patched", "unchanged", "conflict"
_UNREAD: Any = object()  # `live` not read by the caller: ensure_owned reads it


@dataclass(frozen=True)
class Ensured:
    """What ensure_owned did to one object, and the object as the API server returned it."""
    kind: str
    name: str
    outcome: str                      # CREATED, PATCHED, UNCHANGED or CONFLICT
    live: dict[str, Any] | None = None

    @property
    def conflict(self) -> bool:
        return self.outcome == CONFLICT

    @property
    def changed(self) -> bool:
        return self.outcome in (CREATED, PATCHED)


def owns(owner_uid: str, obj: dict[str, Any] | None) -> bool:
    """Whether `owner_uid` is the controller owner of `obj`."""
    return obj is not None and any(ref.get("uid") == owner_uid and ref.get("controller")
                                   for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def manifest_fingerprint(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(_rendered(obj), sort_keys=True).encode()).hexdigest()[:16]


def _rendered(obj: Any) -> Any:
    """`obj` less the annotations set to null: in a merge patch null removes an annotation an
    earlier manifest had, and the object is then as if it was never named."""
    if isinstance(obj, dict):
        return {k: ({a: v for a, v in value.items() if v is not None} if k == "annotations" and isinstance(value, dict)
                    else _rendered(value)) for k, value in obj.items()}
    if isinstance(obj, list):
        return [_rendered(v) for v in obj]
    return obj


def stamp(desired: dict[str, Any]) -> str:
    """Annotate `desired` with the fingerprint of its manifest (taken before the annotation and
    the owner reference are added) and return it."""
    fingerprint = manifest_fingerprint(desired)
    desired["metadata"].setdefault("annotations", {})[ANN_MANIFEST] = fingerprint
    return fingerprint


def _api(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return obj["apiVersion"], PLURALS[obj["kind"]], meta["namespace"], meta["name"]


async def ensure_owned(kube: Kube, owner: dict[str, Any], desired: dict[str, Any], *, mutable: bool = True,
                       readable: bool = True, live: Any = _UNREAD) -> Ensured:
    """Create `desired` (owned by `owner`, a pair's body), or patch the owned object of its name
    when it differs; CONFLICT when that name is taken by an object `owner` does not own.
    `live` is the object as the caller already read it (None: absent), saving a read."""
    api_version, plural, namespace, name = _api(desired)
    kind, owner_uid = desired["kind"], owner["metadata"]["uid"]
    if not readable:
        kopf.adopt(desired, owner=owner)
        return await _ensure_unreadable(kube, owner_uid, desired)
    fingerprint = stamp(desired) if mutable else ""
    kopf.adopt(desired, owner=owner)
    if live is _UNREAD:
        live = await kube.get(api_version, plural, namespace, name)
    if live is None:
        return Ensured(kind, name, CREATED, await kube.create(desired))
    if not owns(owner_uid, live):
        return Ensured(kind, name, CONFLICT, live)
    if not mutable or (live["metadata"].get("annotations") or {}).get(ANN_MANIFEST) == fingerprint:
        return Ensured(kind, name, UNCHANGED, live)
    meta = desired["metadata"]
    patch = {"metadata": {k: meta[k] for k in ("labels", "annotations") if k in meta}, "spec": desired["spec"]}
    return Ensured(kind, name, PATCHED, await kube.merge_patch(api_version, plural, namespace, name, patch))


async def _ensure_unreadable(kube: Kube, owner_uid: str, desired: dict[str, Any]) -> Ensured:
    """A kind the operator may create and patch but not read: created, or its data replaced
    when the object of that name is the owner's (a JSON-patch `test` on the owner's uid)."""
    api_version, plural, namespace, name = _api(desired)
    try:
        return Ensured(desired["kind"], name, CREATED, await kube.create(desired, read_existing=False))
    except KubeError as exc:
        if exc.status != 409:
            raise
    try:
        live = await kube.json_patch(api_version, plural, namespace, name, [
            {"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": owner_uid},
            {"op": "add", "path": "/metadata/annotations", "value": desired["metadata"].get("annotations") or {}},
            {"op": "replace", "path": "/data", "value": desired["data"]}])
    except KubeError as exc:
        if exc.status in (400, 409, 422):  # the test failed: not the owner's
            return Ensured(desired["kind"], name, CONFLICT)
        raise
    return Ensured(desired["kind"], name, PATCHED, live)


async def holds(kube: Kube, owner_uid: str, obj: dict[str, Any], annotations: dict[str, str]) -> bool:
    """Whether the object of `obj`'s kind and name exists, is `owner_uid`'s, and carries these
    annotations: a dry-run JSON patch of tests alone, for kinds the operator may not read."""
    api_version, plural, namespace, name = _api(obj)
    tests = [{"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": owner_uid}]
    tests += [{"op": "test", "path": "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1"),
               "value": value} for key, value in annotations.items()]
    try:
        await kube.json_patch(api_version, plural, namespace, name, tests, dry_run=True)
    except KubeError as exc:
        if exc.status in (400, 404, 409, 422):  # absent, or a test failed
            return False
        raise
    return True
