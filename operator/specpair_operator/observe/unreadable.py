"""Reads of objects the operator may not read (Secrets): whether one exists, is the pair's, and
carries given annotations, asked as a dry-run JSON patch of tests alone (which writes nothing)."""

from __future__ import annotations

from typing import Any

from specpair_operator.clients.kube import Kube, KubeError
from specpair_operator.desired.ownership import api_of


async def holds(kube: Kube, owner_uid: str, obj: dict[str, Any], annotations: dict[str, str]) -> bool:
    """Whether the object of `obj`'s kind and name exists, is `owner_uid`'s, and carries these
    annotations: a dry-run JSON patch of tests alone, for kinds the operator may not read."""
    api_version, plural, namespace, name = api_of(obj)
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
