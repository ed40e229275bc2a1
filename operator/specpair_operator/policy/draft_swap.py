"""Whether a new champion can be promoted in place: its draft swapped inside the running engine
pods (the engine's SwapDraft, engine/specpair/server/draft_swap.py) instead of rolling them (pure).

A drafter never changes what a pod answers (verification is the target's alone), so a release
that differs from the one the pods run only in its draft can be served by the same pods: each
loads and warms the new draft beside the serving one and swaps it in between two steps, with no
restart and no request lost. Everything else needs new pods, and so does what the engine cannot
swap:
- another target, engine, parallelism, or speculation setting (the engine keeps the speculation
  settings it started with: a swap changes the drafter only);
- a drafting head on either side (EAGLE, EAGLE-3, Medusa, MTP: the batch hands the target's
  features only to the drafter it was built with);
- vLLM pods (vLLM 0.32 has no runtime weight update for a draft);
- an engine that does not report the draft it serves (one older than SwapDraft);
- a pod template that changes beyond the release it mounts (resources, image, environment...):
  the pods would not get it until they restart.
The engine refuses by name what it finds it cannot swap (on its paged pool, a draft model's plane
replaced by a lookup, or by a draft whose plane passes the pool's KV budget); the operator then
rolls the pods (plan/serving_draft_swap.py).

Releases are the dicts `release.build_release` writes, as served (gate-tuned, with `mlflow`).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from specpair_operator.desired import manifests
from specpair_operator.desired import ownership as owned

# Release keys the engine never serves from: who and where, the gate's prompts, the registry.
NOT_SERVED = ("pair", "namespace", "gating", "mlflow", "version")
# Drafting heads the engine cannot swap (draft.method).
HEADS = ("eagle", "eagle3", "medusa", "mtp")
# On the engine Deployment while the operator holds it paused to move its pod template in place
# (act/draft_swap.py): the promotion's key. A pass finding it resumes the Deployment.
ANN_PAUSED_FOR_SWAP = "specpair.io/paused-for-draft-swap"


def served_changes(live: Mapping[str, Any], served: Mapping[str, Any]) -> list[str]:
    """The release blocks the engine serves from, other than the draft, that differ."""
    return sorted(key for key in set(live) | set(served)
                  if key not in NOT_SERVED and key != "draft" and live.get(key) != served.get(key))


def draft_only(live: Mapping[str, Any], served: Mapping[str, Any]) -> bool:
    """Whether the two releases serve alike but for their drafts."""
    return not served_changes(live, served) and (live.get("draft") or {}) != (served.get("draft") or {})


def release_refusal(live: Mapping[str, Any], served: Mapping[str, Any]) -> str | None:
    """Why the pods running `live` cannot serve `served` by a draft swap (None: they can)."""
    changed = served_changes(live, served)
    if changed:
        return f"the release changes {', '.join(changed)}, not only the draft"
    mine, theirs = live.get("draft") or {}, served.get("draft") or {}
    if mine == theirs:
        return "the draft is the same: nothing to swap"
    if str((served.get("engine") or {}).get("kind") or "specpair") != "specpair":
        return "vLLM cannot swap a draft at run time (vLLM 0.32 has no runtime weight update for drafts)"
    if not theirs.get("drafter") and not theirs.get("source"):
        return "the release has no draft (speculation off is SetSpeculation's)"
    for which, draft in (("the serving", mine), ("the new", theirs)):
        if draft.get("method") in HEADS:
            return f"{which} draft is a {draft['method']} head, which the engine swaps only with new pods"
    return None


def live_release(live_deployment: Mapping[str, Any]) -> dict[str, Any] | None:
    """The release the live engine Deployment's pod template mounts (None: unreadable)."""
    annotations = ((live_deployment.get("spec") or {}).get("template") or {}).get("metadata", {}).get("annotations") or {}
    try:
        release = json.loads(annotations.get(manifests.ANN_RELEASE) or "")
    except ValueError:
        return None
    return release if isinstance(release, dict) else None


def as_if_live(desired: Mapping[str, Any], live_deployment: Mapping[str, Any]) -> dict[str, Any]:
    """The desired Deployment's spec with the live template's release, digest and version label in
    place of its own: equal (by fingerprint) to the live spec exactly when the template changes in
    nothing but the release."""
    spec = json.loads(json.dumps(desired["spec"]))
    live_meta = ((live_deployment.get("spec") or {}).get("template") or {}).get("metadata") or {}
    meta = spec["template"]["metadata"]
    for key in (manifests.ANN_RELEASE, manifests.ANN_HASH):
        meta["annotations"][key] = (live_meta.get("annotations") or {}).get(key)
    meta["labels"][manifests.LABEL_VERSION] = (live_meta.get("labels") or {}).get(manifests.LABEL_VERSION)
    return spec


def template_fingerprint_of(spec: Mapping[str, Any]) -> str:
    """The engine Deployment's template fingerprint (serving_steps.template_fingerprint's)."""
    return owned.manifest_fingerprint({**spec, "replicas": None})


def owning_replicaset(pods: list[Mapping[str, Any]]) -> str | None:
    """The one ReplicaSet that owns all of `pods` (None: none, or several)."""
    owners = {ref.get("name") for pod in pods for ref in (pod.get("metadata") or {}).get("ownerReferences") or []
              if ref.get("kind") == "ReplicaSet" and ref.get("controller")}
    owners |= {None for pod in pods if not any(ref.get("kind") == "ReplicaSet" for ref in
                                               (pod.get("metadata") or {}).get("ownerReferences") or [])}
    return next(iter(owners)) if len(owners) == 1 else None


def serving_draft(info: Mapping[str, Any] | None) -> str:
    """The content hash of the release whose draft the pod serves ('' when it does not say)."""
    return str((info or {}).get("draftContentHash") or "")


def serves_draft(info: Mapping[str, Any] | None, pair: str, version: str, digest: str) -> bool:
    """Whether a pod drafts with release `version` (`digest`) of `pair`: started with it, or
    swapped to it."""
    info = info or {}
    return (info.get("pair"), str(info.get("draftVersion") or ""), serving_draft(info)) == (pair, str(version), digest)


def serves(info: Mapping[str, Any] | None, pair: str, version: str, digest: str) -> bool:
    """Whether a pod serves release `version` (`digest`) of `pair`: started with it and drafting
    with it, or started with one that differs only in the draft and swapped to it (only the
    operator swaps, and only such a release). An engine that does not report its draft (older
    than SwapDraft, vLLM's companion) serves what it started with."""
    info = info or {}
    if not serving_draft(info):
        return (info.get("pair"), str(info.get("releaseVersion")), info.get("contentHash") or "") == \
            (pair, str(version), digest)
    return serves_draft(info, pair, version, digest)


def swapped(info: Mapping[str, Any] | None, pair: str, version: str, digest: str) -> bool:
    """Whether a pod serves release `version` by a swap (it started with another)."""
    return serves_draft(info, pair, version, digest) and ((info or {}).get("contentHash") or "") != digest
