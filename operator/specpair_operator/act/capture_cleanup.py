"""Carries out plan/capture_cleanup.py's step for one pair: its finalizer added or removed (a JSON
patch that tests what it removes), its engine Deployments scaled to 0 replicas, its clean-up Job
created once their pods are gone, an Event for each (docs/learning.md).
Called by the periodic loop for every pair, deleting ones included (handlers.py)."""

from __future__ import annotations

import logging
from typing import Any

from specpair_operator.clients.kube import Kube, KubeError
from specpair_operator.crd.conditions import now_iso
from specpair_operator.desired.learning import CAPTURE_FINALIZER, Learning, capture_cleanup_job, cleanup_job_name
from specpair_operator.desired.manifests import PodDefaults, engine_selector
from specpair_operator.desired.ownership import owns
from specpair_operator.plan import capture_cleanup as plan

log = logging.getLogger("specpair.operator.capture")

GROUP_VERSION, PLURAL = "specpair.io/v1alpha1", "specmodelpairs"
# Warnings already posted, by (pair uid, reason, Job uid): a Job that stays failed is said once
# per operator process, not at every pass.
_warned: set[tuple[str, str, str]] = set()


def waits_on_us(body: Any) -> bool:
    """The pair carries the capture clean-up finalizer."""
    return CAPTURE_FINALIZER in (body.get("metadata", {}).get("finalizers") or [])


def _terminating(exc: KubeError) -> bool:
    """The API server's refusal to create in a namespace being deleted (403, NamespaceTerminating)."""
    return exc.status == 403 and "being terminated" in exc.message


async def converge(kube: Kube, body: dict[str, Any], defaults: PodDefaults = PodDefaults()) -> plan.CleanupStep:
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    job, engines, engine_pods = None, {}, []
    if meta.get("deletionTimestamp") and CAPTURE_FINALIZER in (meta.get("finalizers") or []):
        job = await kube.get("batch/v1", "jobs", namespace, cleanup_job_name(name, uid))
        selector = ",".join(f"{k}={v}" for k, v in engine_selector(name).items())
        engines = {d["metadata"]["name"]: int((d.get("spec") or {}).get("replicas", 1))
                   for d in await kube.list("apps/v1", "deployments", namespace, selector) if owns(uid, d)}
        engine_pods = [p["metadata"]["name"] for p in await kube.list("v1", "pods", namespace, selector)]
    now = now_iso()
    step = plan.decide(body, job, engines=engines, engine_pods=engine_pods, now=now)
    if step.action == plan.STOP_ENGINES:
        for deployment in step.scale_down:
            try:
                await kube.merge_patch("apps/v1", "deployments", namespace, deployment, {"spec": {"replicas": 0}})
            except KubeError as exc:
                if exc.status != 404:   # gone meanwhile: stopped all the same
                    raise
    if step.action == plan.CREATE_JOB:
        learning = Learning.from_spec(body.get("spec") or {})
        try:
            await kube.create(capture_cleanup_job(name, namespace, uid, str(learning.claim),
                                                  (body.get("spec") or {}).get("rollout") or {}, defaults))
        except KubeError as exc:
            if not _terminating(exc):
                raise
            step = plan.decide(body, job, namespace_terminating=True, engines=engines, engine_pods=engine_pods,
                               now=now)
    # Only on the object as read (a test on its resourceVersion, or on the finalizer removed): the
    # body may be older than the pair (Kopf hands a pair's events to on_event only between its
    # handlers' runs, and on_change may run for minutes), and a refused patch (422) is decided
    # again from a fresher one at the next pass.
    finalizers = list(meta.get("finalizers") or [])
    ops: list[dict[str, Any]] = []
    if step.action == plan.ADD_FINALIZER:
        ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
               {"op": "add", "path": "/metadata/finalizers/-", "value": CAPTURE_FINALIZER} if finalizers
               else {"op": "add", "path": "/metadata/finalizers", "value": [CAPTURE_FINALIZER]}]
    elif step.action == plan.REMOVE_FINALIZER:
        index = finalizers.index(CAPTURE_FINALIZER)
        ops = [{"op": "test", "path": f"/metadata/finalizers/{index}", "value": CAPTURE_FINALIZER},
               {"op": "remove", "path": f"/metadata/finalizers/{index}"}]
    if ops:
        try:
            await kube.json_patch(GROUP_VERSION, PLURAL, namespace, name, ops)
        except KubeError as exc:
            if exc.status != 422:
                raise
            log.debug("%s/%s: finalizers changed since read; next pass", namespace, name)
            return plan.CleanupStep(plan.WAIT)
    if step.event is not None:
        type_, reason, message = step.event
        key = (uid, reason, ((job or {}).get("metadata") or {}).get("uid", ""))
        if type_ != "Warning" or key not in _warned:
            _warned.add(key)
            log.info("%s/%s: %s: %s", namespace, name, reason, message)
            try:
                await kube.event(body, type_, reason, message)
            except KubeError as exc:   # a namespace being deleted takes no Event: the step is done all the same
                log.warning("%s/%s: Event %s not posted: %s", namespace, name, reason, exc.message)
    return step
