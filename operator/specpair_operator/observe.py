"""Every read a pass needs about the spec's release, into one ReleaseWorld (world.py): its
aliases, tags and gate result from MLflow, its gate Jobs (one per attempt), what their pods
reported, and the gate's NetworkPolicy from the API server."""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

from . import aliases as aliases_mod
from . import conditions as c
from . import gate_attempts, manifests
from .kube import Kube
from .owned import owns
from .registry import ReleaseRegistry
from .world import GateJob, Records, ReleaseWorld, pods_waiting


def _controlled_by_job(pod: dict[str, Any], job: str) -> bool:
    return any(ref.get("kind") == "Job" and ref.get("name") == job and ref.get("controller")
               for ref in (pod.get("metadata") or {}).get("ownerReferences") or [])


def _condition(job: dict[str, Any], type_: str) -> bool:
    return any(cd.get("type") == type_ and cd.get("status") == "True"
               for cd in (job.get("status") or {}).get("conditions") or [])


def gate_job_view(job: dict[str, Any], owner_uid: str, pods: list[dict[str, Any]]) -> GateJob:
    name = job["metadata"]["name"]
    failed, message, failed_at = gate_attempts.job_failed(job)
    st = job.get("status") or {}
    reports = tuple(((cs.get("state") or {}).get("terminated") or {}).get("message") or ""
                    for pod in pods if _controlled_by_job(pod, name)
                    for cs in (pod.get("status") or {}).get("containerStatuses") or [])
    return GateJob(name, owns(owner_uid, job), failed, message, failed_at, _condition(job, "Complete"),
                   st.get("startTime") or "", st.get("completionTime") or "", reports)


async def observe_release(kube: Kube, registry: ReleaseRegistry, body: Mapping[str, Any], status: Mapping[str, Any],
                          model: str, version: str, digest: str, thresholds: Mapping[str, Any]) -> ReleaseWorld:
    meta = body["metadata"]
    pair, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    aliases = await asyncio.to_thread(registry.aliases, model)
    tags = await asyncio.to_thread(registry.version_tags, model, version)
    gate_status, verdict, gate_message = await asyncio.to_thread(registry.gate_result, model, version)
    policy = gate_attempts.Policy.from_env()
    jobs: list[dict[str, Any]] = []
    for attempt in range(1, policy.attempts + 1):
        job = await kube.get("batch/v1", "jobs", namespace, manifests.gate_job_name(pair, digest, attempt))
        if job is None:
            break
        jobs.append(job)
    pods: list[dict[str, Any]] = []
    if jobs:
        names = ",".join(j["metadata"]["name"] for j in jobs)
        pods = await kube.list("v1", "pods", namespace, f"job-name in ({names})")
    latest = jobs[-1]["metadata"]["name"] if jobs else ""
    gating = aliases.get(aliases_mod.CHAMPION) != version
    gate_policy_owned = None
    if gating:
        live = await kube.get("networking.k8s.io/v1", "networkpolicies", namespace,
                              manifests.gate_network_policy(pair, namespace)["metadata"]["name"])
        gate_policy_owned = None if live is None else owns(uid, live)
    return ReleaseWorld(
        pair=pair, namespace=namespace, version=version, digest=digest, thresholds=dict(thresholds),
        aliases=dict(aliases), tags=dict(tags), gate_status=gate_status, verdict=verdict, gate_message=gate_message,
        gate_jobs=tuple(gate_job_view(j, uid, pods) for j in jobs), gate_policy_owned=gate_policy_owned,
        gate_pods_waiting=pods_waiting([p for p in pods if (p["metadata"].get("labels") or {}).get("job-name") == latest]),
        verified_verdicts={str(k): str(v) for k, v in (status.get("verifiedVerdicts") or {}).items()},
        records=Records.from_status(status), attempts=policy, now=c.now_iso())
