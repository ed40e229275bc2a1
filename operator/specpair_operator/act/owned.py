"""The objects a pair owns (engine Deployment and Service, NetworkPolicies, gate Jobs, the
engine's TLS Secret, its autoscaler), all written through one create-or-patch, `ensure_owned`,
and removed through one delete, `delete_owned`, when a plan no longer wants them.

An object of the child's name that the pair does not own (no controller owner reference with
the pair's uid) is never touched: the answer is CONFLICT and the caller reports NameConflict.
Mutable kinds carry a fingerprint of their manifest (annotation `specpair.io/manifest-hash`), so
an owned object is patched exactly when what the operator would render differs from what it
rendered last; create-only kinds (Jobs, Services: RBAC grants no patch) are only created.
Kinds the operator may not read (Secrets) are created, or replaced in place when a JSON-patch
test on their owner's uid proves them the pair's.
"""

from __future__ import annotations

from typing import Any

import kopf

from specpair_operator.clients.kube import Kube, KubeError
from specpair_operator.desired.ownership import (ABSENT, ANN_MANIFEST, CONFLICT, CREATED, DELETED,  # noqa: F401
                                                 PATCHED, UNCHANGED, Ensured, api_of, manifest_fingerprint, owns,
                                                 stamp)

_UNREAD: Any = object()  # `live` not read by the caller: ensure_owned reads it


async def ensure_owned(kube: Kube, owner: dict[str, Any], desired: dict[str, Any], *, mutable: bool = True,
                       readable: bool = True, live: Any = _UNREAD) -> Ensured:
    """Create `desired` (owned by `owner`, a pair's body), or patch the owned object of its name
    when it differs; CONFLICT when that name is taken by an object `owner` does not own.
    `live` is the object as the caller already read it (None: absent), saving a read."""
    api_version, plural, namespace, name = api_of(desired)
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


async def delete_owned(kube: Kube, owner: dict[str, Any], unwanted: dict[str, Any], *,
                       live: Any = _UNREAD) -> Ensured:
    """Delete the object named by `unwanted` (apiVersion, kind, metadata namespace and name) when
    `owner` (a pair's body) owns it: ABSENT when there is none, CONFLICT when an object the pair
    does not own has the name (never touched). The delete holds only for the object read (a uid
    precondition): one made again under the name since is left, UNCHANGED. `live` as for
    ensure_owned."""
    api_version, plural, namespace, name = api_of(unwanted)
    kind = unwanted["kind"]
    if live is _UNREAD:
        live = await kube.get(api_version, plural, namespace, name)
    if live is None:
        return Ensured(kind, name, ABSENT)
    if not owns(owner["metadata"]["uid"], live):
        return Ensured(kind, name, CONFLICT, live)
    try:
        deleted = await kube.delete(api_version, plural, namespace, name, live["metadata"]["uid"])
    except KubeError as exc:
        if exc.status != 409:
            raise
        return Ensured(kind, name, UNCHANGED, live)   # another object of the name since the read: left
    return Ensured(kind, name, DELETED if deleted else ABSENT, live)


async def _ensure_unreadable(kube: Kube, owner_uid: str, desired: dict[str, Any]) -> Ensured:
    """A kind the operator may create and patch but not read: created, or its data replaced
    when the object of that name is the owner's (a JSON-patch `test` on the owner's uid)."""
    api_version, plural, namespace, name = api_of(desired)
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
