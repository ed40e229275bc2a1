"""Ownership as values: whether a pair owns an object (a controller owner reference with its uid),
the fingerprint a mutable object carries of the manifest it was rendered from, and what
ensure_owned (act/owned.py, the one writer) did. Pure: plans compare desired with live objects
through these, act writes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from specpair_operator.clients.kube import PLURALS

ANN_MANIFEST = "specpair.io/manifest-hash"

CREATED, PATCHED, UNCHANGED, CONFLICT = "created", "patched", "unchanged", "conflict"
DELETED, ABSENT = "deleted", "absent"   # what delete_owned did: deleted it, or there was none


@dataclass(frozen=True)
class Ensured:
    """What ensure_owned or delete_owned did to one object, and the object as the API server
    returned it (delete_owned: as it was before it went)."""
    kind: str
    name: str
    outcome: str                      # CREATED, PATCHED, UNCHANGED, CONFLICT; DELETED or ABSENT
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


def api_of(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return obj["apiVersion"], PLURALS[obj["kind"]], meta["namespace"], meta["name"]
