"""RFC 7386 JSON merge patch, as the API server applies a merge-patch write (the operator's status,
the demo's spec patch): maps merge key by key, null deletes a key, anything else replaces. The
tests apply it to see what a patch leaves in the object the server keeps."""

from __future__ import annotations


def merge_patch(target, patch):
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out
