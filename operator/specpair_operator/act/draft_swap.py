"""Act for a promotion in place (plan/serving_draft_swap.py): SwapDraft on a pod, and the engine
Deployment's pod template moved to the new release without a roll.

The Deployment controller rolls when no ReplicaSet's template equals the Deployment's (it
compares them without the pod-template-hash label). So the template moves in three writes, with
the controller held off by a pause in between: the Deployment paused (marked with the
promotion's key), the pods' ReplicaSet given the new template (its pods are untouched: a
ReplicaSet's template only shapes pods it creates later), the Deployment given the same template
and resumed. Resumed, the controller finds the ReplicaSet's template equal to its own and makes
no other. A pass that dies in between leaves the mark; the next one redoes the writes, or resumes
the Deployment (serving_draft_swap.resume_if_paused).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from specpair_operator.act.owned import ensure_owned
from specpair_operator.clients.engine_probe import SWAP_REFUSED_CODES, EngineProbe, EngineUnreachable
from specpair_operator.clients.kube import KubeError
from specpair_operator.plan.release_steps import Record
from specpair_operator.plan.serving_draft_swap import DRAFT_SWAP_REFUSED, PromoteInPlace, ResumeEngine, SwapDraft
from specpair_operator.policy.draft_swap import ANN_PAUSED_FOR_SWAP

if TYPE_CHECKING:
    from specpair_operator.act.reconciler import PairReconciler


async def swap_draft(r: PairReconciler, probe: EngineProbe, server: str, step: SwapDraft) -> Record | None:
    """SwapDraft on one pod: an Event when it swapped; DraftSwapRefused's record when the engine
    cannot take the draft in place (the pods roll then); nothing when it did not answer (the next
    pass asks again)."""
    if r.ledger.was_recorded(DRAFT_SWAP_REFUSED, step.key, step.version):
        return None      # another pod refused it this pass: the pods roll
    try:
        reply = await probe.swap_draft(step.address, step.release_json,
                                       f"operator: v{step.version} promoted in place", server_name=server)
    except EngineUnreachable as exc:
        if exc.code in SWAP_REFUSED_CODES:
            return Record(DRAFT_SWAP_REFUSED, f"pod {step.pod} cannot swap in the draft of v{step.version} in place, "
                          f"so the pods roll: {exc}"[:1000], None, step.version, key=step.key)
        r.logger.warning(f"SwapDraft on pod {step.pod} did not answer: {exc}")
        return None
    kube = r.operator.kube
    assert kube is not None
    # The pod is the release's now: its version label (routes select by it) and the release file
    # its downward-API volume gives a restarted container.
    await kube.merge_patch("v1", "pods", r.namespace, step.pod, {"metadata": copy.deepcopy(dict(step.metadata))})
    how = (f"loaded in {reply['loadSeconds']:.1f} s, swapped in between two steps in "
           f"{1000 * reply['installSeconds']:.0f} ms" if reply["swapped"] else "it already did")
    r.ledger.event("Normal", "DraftSwapped", f"pod {step.pod} drafts with v{step.version} now ({how}), without a restart")
    return None


async def promote_in_place(r: PairReconciler, step: PromoteInPlace) -> bool:
    """The engine Deployment's template moved to `step.manifest`'s without a roll; False when
    its name was taken since the pass looked (NameConflict)."""
    kube, ns = r.operator.kube, r.namespace
    assert kube is not None
    name = step.manifest["metadata"]["name"]
    await kube.merge_patch("apps/v1", "deployments", ns, name,
                           {"metadata": {"annotations": {ANN_PAUSED_FOR_SWAP: step.key}}, "spec": {"paused": True}})
    try:
        await kube.merge_patch("apps/v1", "replicasets", ns, step.replicaset,
                               {"spec": {"template": copy.deepcopy(dict(step.manifest["spec"]["template"]))}})
    except KubeError:
        await resume(r, name)       # the template stays; the next pass decides again
        raise
    done = await ensure_owned(kube, r.body, copy.deepcopy(dict(step.manifest)), live=copy.deepcopy(dict(step.live)))
    if done.conflict:
        r._name_conflict(done.kind, done.name)
        return False
    await resume(r, name)
    return True


async def resume(r: PairReconciler, name: str) -> None:
    kube = r.operator.kube
    assert kube is not None
    await kube.merge_patch("apps/v1", "deployments", r.namespace, name,
                           {"metadata": {"annotations": {ANN_PAUSED_FOR_SWAP: None}}, "spec": {"paused": False}})


async def resume_engine(r: PairReconciler, step: ResumeEngine) -> None:
    await resume(r, step.name)
    r.ledger.event("Normal", "EngineResumed", f"engine Deployment {step.name} resumed: a promotion in place paused "
                   "it and its pass ended before resuming it")
