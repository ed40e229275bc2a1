"""The serving plan's promotion in place: a champion whose release differs from the one its pods
run only in the draft is served by the same pods, each told to swap its draft (SwapDraft on the
control port), and the engine Deployment's pod template then moved to the new release without a
roll (act/draft_swap.py: the Deployment paused, its ReplicaSet's template and its own set to the
new one, resumed; the Deployment controller finds the ReplicaSet's template equal to its own and
creates none). A pod that restarts later, or one added by scaling, starts with the new release.

Level-triggered, from any crash point: a pass swaps the pods that do not yet serve the champion's
draft (a pod already swapped reports it, GetModelInfo.draft_content_hash), moves the template only
once every pod does, and resumes a Deployment a dead pass left paused. An engine that refuses the
swap (FAILED_PRECONDITION, UNIMPLEMENTED) gets DraftSwapRefused recorded for this template, and
the pods roll as for any release; so do pods that cannot be asked (policy/draft_swap.py says why),
with RolloutStarted saying why they were not swapped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from specpair_operator.desired import engine_objects
from specpair_operator.desired import ownership as owned
from specpair_operator.desired.manifests import ANN_HASH, ANN_RELEASE, LABEL_VERSION
from specpair_operator.observe.serving_world import ready_pods
from specpair_operator.plan.release_steps import Record
from specpair_operator.plan.serving_steps import ANN_TEMPLATE, _Steps, address
from specpair_operator.policy import draft_swap
from specpair_operator.release import content as release_mod

DRAFT_SWAPPED, DRAFT_SWAP_REFUSED = "DraftSwapped", "DraftSwapRefused"
# The rollout's state while a draft is swapped in place: the pods are asked who they are (and
# what they draft with), as once a rollout is available (serving_rollout.rollout_state).
SWAPPING = "swapping"


@dataclass(frozen=True)
class SwapDraft:
    """Tell one engine pod to swap its draft for the release's (`release_json`, as its pods mount
    it; a pod that already drafts with it answers at once), then give the pod the release's
    version label and release annotations (`metadata`): routes select the champion's pods by that
    label, and the release file a restarted container reads comes from those annotations. A
    refusal records DraftSwapRefused under `key` (the pods then roll)."""
    pod: str
    address: str
    release_json: str
    version: str
    key: str
    metadata: Mapping[str, Any]


@dataclass(frozen=True)
class PromoteInPlace:
    """Every pod serves the new draft: the engine Deployment's template becomes `manifest`'s
    without a roll (its ReplicaSet `replicaset`'s template first, the Deployment held paused)."""
    manifest: Mapping[str, Any]
    live: Mapping[str, Any]
    replicaset: str
    key: str


@dataclass(frozen=True)
class ResumeEngine:
    """Resume the engine Deployment a promotion in place paused (a pass died holding it)."""
    name: str


@dataclass(frozen=True)
class InPlace:
    """What the plan does about a new template: `state` (the rollout's state and message) while the
    pods are swapped or the template moved in place; None and `why` when the pods roll."""
    state: tuple[str, str] | None = None
    why: str = ""
    draft_only: bool = False     # the release changes only the draft: RolloutStarted says `why`


def swap_in_place(out: _Steps, w: Any, served: dict[str, Any], dep: dict[str, Any], live: Mapping[str, Any] | None,
                  version: str, key: str) -> InPlace:
    """For a new pod template (`dep` against the `live` Deployment): swap the draft on each pod,
    then move the template in place; or say why the pods roll instead."""
    if live is None or not owned.owns(w.uid, dict(live)) or w.shadow is not None:
        return InPlace()
    before = draft_swap.live_release(live)
    if before is None or not draft_swap.draft_only(before, served):
        return InPlace()
    why = _refusal(out, w, served, dep, live, before, version, key)
    if why:
        return InPlace(why=why, draft_only=True)
    return _swap(out, w, served, dep, live, version, key)


def _refusal(out: _Steps, w: Any, served: dict[str, Any], dep: dict[str, Any], live: Mapping[str, Any],
             before: dict[str, Any], version: str, key: str) -> str | None:
    """Why a release that changes only the draft still rolls the pods (None: they swap)."""
    if out.was(DRAFT_SWAP_REFUSED, key, version):
        return "the engine refused to swap the draft (DraftSwapRefused)"
    why = draft_swap.release_refusal(before, served)
    if why:
        return why
    if draft_swap.template_fingerprint_of(draft_swap.as_if_live(dep, live)) != \
            ((live.get("metadata") or {}).get("annotations") or {}).get(ANN_TEMPLATE):
        return "the pod template changes beyond the release (the pods need it at start)"
    live_digest = ((live.get("metadata") or {}).get("annotations") or {}).get(ANN_HASH) or ""
    state, _ = engine_objects.deployment_rollout_state(dict(live), live_digest)
    pods = [p for p in w.pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    want = int((live.get("spec") or {}).get("replicas") or 0)
    ready = ready_pods(pods)
    if state != "available" or len(ready) != len(pods) or len(pods) != want or not pods:
        return f"not every engine pod is ready and rolled out ({len(ready)} ready of {len(pods)}, {want} wanted)"
    if draft_swap.owning_replicaset(list(pods)) is None:
        return "the pods do not all belong to one ReplicaSet"
    if not w.ready:
        return None      # not asked yet (observe asks them while SWAPPING)
    if len(w.ready) != len(pods) or any(pod.info is None for pod in w.ready):
        return "a pod did not say which draft it serves"
    cannot = next((pod.name for pod in w.ready if not draft_swap.serving_draft(pod.info)), None)
    if cannot:
        return f"pod {cannot}'s engine does not report the draft it serves (no SwapDraft)"
    return None


def _swap(out: _Steps, w: Any, served: dict[str, Any], dep: dict[str, Any], live: Mapping[str, Any], version: str,
          key: str) -> InPlace:
    """Swap the draft on each pod not serving it yet; once all do, move the template in place."""
    if not w.ready:
        # The plan needs the pods' answers: observe asks them while the rollout is SWAPPING.
        return InPlace(state=(SWAPPING, f"asking the engine pods which draft they serve, to swap in v{version}'s"))
    asked = list(w.ready)
    replicaset = draft_swap.owning_replicaset([p for p in w.pods if not (p.get("metadata") or {}).get("deletionTimestamp")])
    digest = release_mod.content_hash(served)
    meta = dep["spec"]["template"]["metadata"]
    metadata = {"labels": {LABEL_VERSION: meta["labels"][LABEL_VERSION]},
                "annotations": {k: meta["annotations"][k] for k in (ANN_RELEASE, ANN_HASH)}}
    labels = {p["metadata"]["name"]: p["metadata"].get("labels") or {} for p in w.pods}
    waiting = [pod for pod in asked if not draft_swap.serves_draft(pod.info, w.pair, version, digest)
               or labels.get(pod.name, {}).get(LABEL_VERSION) != metadata["labels"][LABEL_VERSION]]
    if waiting:
        release_json = json.dumps(served, sort_keys=True)
        out.add(*(SwapDraft(pod.name, address(w, pod), release_json, version, key, metadata) for pod in waiting))
        return InPlace(state=(SWAPPING, f"swapping the draft of v{version} into the running pods in place: "
                                             f"{len(asked) - len(waiting)} of {len(asked)} done"))
    out.add(PromoteInPlace(dep, live, replicaset, key))
    if not out.was(DRAFT_SWAPPED, key, version):
        out.add(Record(DRAFT_SWAPPED, f"draft of v{version} swapped in place on {len(asked)} pod(s) "
                       f"({', '.join(p.name for p in asked)}), no pod restarted; the engine Deployment's template "
                       f"moved to v{version} without a roll", _label_version(live), version, key=key))
    return InPlace(state=(SWAPPING, f"draft of v{version} swapped in place on {len(asked)} pod(s); the engine "
                                         f"Deployment's template follows"))


def _label_version(live: Mapping[str, Any]) -> str | None:
    return (((live.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {}).get(LABEL_VERSION)


def resume_if_paused(out: _Steps, w: Any, live: Mapping[str, Any] | None) -> None:
    """A Deployment a promotion in place paused and a dead pass left so: resumed."""
    if live is not None and owned.owns(w.uid, dict(live)) and \
            draft_swap.ANN_PAUSED_FOR_SWAP in ((live.get("metadata") or {}).get("annotations") or {}):
        out.add(ResumeEngine(live["metadata"]["name"]))


def swapped_in_place(out: _Steps, w: Any, key: str, version: str, digest: str) -> bool:
    """Whether this template reached the pods by a swap in place (recorded, or seen on the pods
    by a pass after one that died before recording it: then recorded now)."""
    if out.was(DRAFT_SWAPPED, key, version):
        return True
    if not w.ready or not all(draft_swap.swapped(p.info, w.pair, version, digest) for p in w.ready):
        return False
    out.add(Record(DRAFT_SWAPPED, f"draft of v{version} swapped in place on {len(w.ready)} pod(s), no pod restarted; "
                   f"the engine Deployment's template moved to v{version} without a roll", None, version, key=key))
    return True
