"""The one-shot Job that fills a pair's model cache before any pod of a release reads it.

`spec.rollout.modelCache.persistentVolumeClaim` is a hub cache that engine and gate pods mount
read-only (HF_HUB_CACHE, HF_HUB_OFFLINE=1, manifests.py): N replicas read one copy and none
downloads at start. A release whose models are not in it yet gets this Job first: `specpair
fetch-models` (engine/specpair/model_fetch.py) downloads each model from the release's sources
(MLflow artifacts with the pair's MLflow credentials, the hub with the pair's hub token, both as
the gate Job gets them) into the PVC, mounted read-write in this Job alone, skipping what is
there, and writes a completion marker for the release's content hash last. The Job is named
after the release's models (`models_digest`: sources and revisions), not its whole content: a
release that changes only speculation or gating, or the gate's tuning of the served release,
needs no second fetch. A fetch that fails
says why in its termination message (the model, its source and the reason), which
`fetch_state` reads back: a condition with the reason, not engine pods in a crash loop.

Everything here is pure (manifests and decisions from values); nothing reads or writes the API.

How the plans use it (reads.observe_fetch, model_cache.fetch_steps and fetch_job, serving_rollout._models_ready):

- observe: where `needs_fetch(release, rollout, fetched)` holds, get the Job
  `fetch_job_name(pair, models_digest(release))` and the pods labelled `job-name=<that name>`
  into the world (`fetched`: the models digests the pair's status records as fetched, see DONE).
- release_gate.py, gating the spec's release: before StartGateJob (gate pods read the same read-only,
  offline cache, so a hub model must be in it before the gate runs).
  serving_rollout._engine, for the release served (a rollback's `previous` included): before
  `EnsureOwned` of the engine Deployment, after the certificate and NetworkPolicy. In both:
  - `needs_fetch` false: proceed as today.
  - `fetch_state(job, pods)` ABSENT: `EnsureOwned` of the Job `desired_fetch_job(...)` as
    plan/model_cache.fetch_job renders it for both (act: owned.ensure_owned), with an Event ModelFetchStarted; report Reconciling, reason
    ModelsFetching (kstatus's "progressing"); no gate Job, no engine rollout this pass (the
    champion keeps serving).
  - RUNNING: report Reconciling, reason ModelsFetching, message `state.message` (it names a pod
    that cannot start, e.g. a missing Secret: `state.waiting`); nothing else moves.
  - FAILED: report Stalled, reason ModelFetchFailed, message `state.message` (fetch-models' own
    words: which model, which source, why); an Event ModelFetchFailed once (Records, keyed by
    the models digest); the engine is not rolled, the champion keeps serving. A fixed spec is a new
    set of models with a Job of its own (the name carries its digest); deleting the failed Job
    retries the same one.
  - DONE: record `models_digest(release)` in the pair's status (e.g. `status.modelCache.fetched`,
    the last few; an Event ModelsFetched) and proceed: gate, or roll the engine. `needs_fetch` reads
    that record later, so the Job's TTL may delete it without it being created again; a pass
    that dies between DONE and the record finds the Job still there, or runs it again, which
    skips what is present (idempotent).
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Collection, Mapping

from specpair.contract import content_hash, source_kind

from specpair_operator.desired import manifests
from specpair_operator.crd import names
from specpair_operator.desired.pod_status import pods_waiting

MODELS_FETCHING = "ModelsFetching"       # Reconciling's reason while the Job runs
MODEL_FETCH_FAILED = "ModelFetchFailed"  # Stalled's reason when it failed
ABSENT, RUNNING, DONE, FAILED = "absent", "running", "done", "failed"
ROLE = "model-fetch"
# Kubernetes retries a failed fetch pod this many times (a dropped connection, an evicted pod):
# a model that is not there is not there the third time either.
FETCH_BACKOFF_LIMIT = 2
# The whole Job, retries included, unless rollout.modelCache.fetch.activeDeadlineSeconds says.
FETCH_DEADLINE_SECONDS = 3600
# A download streams to disk: a little CPU, memory for Python, MLflow and the hub client.
FETCH_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
MESSAGE_LIMIT = 1500


def fetch_job_name(pair: str, models: str) -> str:
    """The fetch Job of a set of models (`models_digest`)."""
    return names.object_name(pair, "fetch", models[:10])


def _cache(rollout: Mapping[str, Any]) -> dict[str, Any]:
    return dict(rollout.get("modelCache") or {})


def fetched_sources(release: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The release's models a fetch downloads: MLflow URIs and hub ids (not the embedded
    default, a model-free drafter or a path in the image)."""
    out = []
    for role in ("target", "draft"):
        side = release.get(role) or {}
        if side.get("drafter") or (role == "draft" and not side.get("source")):
            continue
        kind = source_kind(str(side.get("source") or ""), exists=lambda _: False)
        if kind in ("mlflow", "hub"):
            out.append({"role": role, "source": side["source"], "revision": side.get("revision"), "kind": kind})
    return out


def models_digest(release: Mapping[str, Any]) -> str:
    """sha256 of the models a fetch of the release downloads (role, kind, source, revision)."""
    text = json.dumps(fetched_sources(release), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def needs_fetch(release: Mapping[str, Any], rollout: Mapping[str, Any], fetched: Collection[str] = ()) -> bool:
    """Whether the release needs the Job: the pair has a model cache, the release has models to
    download, and their digest (`models_digest`) is not among those recorded as fetched."""
    return bool(_cache(rollout).get("persistentVolumeClaim")) and bool(fetched_sources(release)) \
        and models_digest(release) not in fetched


def deadline_seconds(rollout: Mapping[str, Any]) -> int:
    return int((_cache(rollout).get("fetch") or {}).get("activeDeadlineSeconds") or FETCH_DEADLINE_SECONDS)


def desired_fetch_job(pair: str, namespace: str, release: dict[str, Any], rollout: dict[str, Any],
                      tracking_uri: str, credentials: manifests.MlflowCredentials | None = None,
                      defaults: manifests.PodDefaults = manifests.PodDefaults()) -> dict[str, Any]:
    """The fetch Job of one release (owner reference added by the adapter, as for every child).
    The engine image runs `specpair fetch-models` on the release file; the PVC is mounted
    read-write here (at the path engine pods read it from), nowhere else."""
    claim = _cache(rollout).get("persistentVolumeClaim")
    if not claim:
        raise ValueError("a fetch Job needs rollout.modelCache.persistentVolumeClaim")
    # The pod's environment and its own volumes as a gate pod's, but online: the cache it
    # writes is not the read-only, offline one engine pods get.
    online = {**rollout, "modelCache": {k: v for k, v in _cache(rollout).items() if k != "persistentVolumeClaim"}}
    # MLflow credentials only where a model comes from MLflow, as for engine pods.
    credentials = credentials if any(m["kind"] == "mlflow" for m in fetched_sources(release)) else None
    labels = manifests.pod_labels(pair, ROLE)
    digest = content_hash(release)   # what fetch-models reports for this release file
    command = ["python", "-m", "specpair", "fetch-models", "--release", manifests.RELEASE_FILE,
               "--cache-dir", manifests.HUB_CACHE_DIR, "--termination-log", manifests.TERMINATION_LOG]
    container = {
        # The report the command writes; its log's tail if it died before writing one.
        **manifests.release_job_container("fetch", release, rollout, command, "FallbackToLogsOnError"),
        "env": manifests.pod_env(tracking_uri, credentials, rollout=online, defaults=defaults),
        "volumeMounts": [*manifests.pod_mounts(online), {"name": "hub", "mountPath": manifests.HUB_CACHE_DIR}],
        "resources": copy.deepcopy(FETCH_RESOURCES),
        "securityContext": manifests.container_security(),
    }
    pod_spec = manifests.pod_spec(online, defaults)
    pod_spec["volumes"] = [*pod_spec["volumes"], {"name": "hub", "persistentVolumeClaim": {"claimName": claim}}]
    return manifests.release_job(
        fetch_job_name(pair, models_digest(release)), namespace, labels, {manifests.ANN_HASH: digest},
        release, digest, container, pod_spec,
        backoff_limit=FETCH_BACKOFF_LIMIT, deadline_seconds=deadline_seconds(rollout), defaults=defaults)


@dataclass(frozen=True)
class FetchState:
    phase: str            # ABSENT, RUNNING, DONE or FAILED
    reason: str = ""      # FAILED: the Job's reason (BackoffLimitExceeded, DeadlineExceeded, ...)
    message: str = ""     # for the pair's condition
    waiting: str = ""     # RUNNING: why its pod cannot start ('' when nothing stops it)


def _condition(job: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((cd for cd in (job.get("status") or {}).get("conditions") or []
                 if cd.get("type") == type_ and cd.get("status") == "True"), None)


def _reported_error(job: Mapping[str, Any], pods: Collection[Mapping[str, Any]]) -> str:
    """The newest error a pod of the Job reported for the Job's release (fetch-models' JSON)."""
    name = job["metadata"]["name"]
    digest = (job["metadata"].get("annotations") or {}).get(manifests.ANN_HASH)
    errors: list[tuple[str, str]] = []
    for pod in pods:
        if (pod["metadata"].get("labels") or {}).get("job-name") != name:
            continue
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            done = (cs.get("state") or {}).get("terminated") or {}
            try:
                report = json.loads(done.get("message") or "")
            except ValueError:
                if done.get("exitCode") and done.get("message"):   # died before writing a report
                    errors.append((done.get("finishedAt") or "", done["message"].strip().splitlines()[-1]))
                continue
            if isinstance(report, dict) and report.get("error") and report.get("digest") in (digest, "", None):
                errors.append((done.get("finishedAt") or "", str(report["error"])))
    return max(errors)[1][-MESSAGE_LIMIT:] if errors else ""


def fetch_state(job: Mapping[str, Any] | None, pods: Collection[Mapping[str, Any]] = ()) -> FetchState:
    """Where the release's fetch stands, from its Job and the Job's pods."""
    if job is None:
        return FetchState(ABSENT, message="the model fetch Job is not there yet")
    name = job["metadata"]["name"]
    if _condition(job, "Complete") is not None:
        return FetchState(DONE, message=f"models fetched by Job {name}")
    failed = _condition(job, "Failed")
    if failed is not None:
        why = _reported_error(job, pods) or failed.get("message") or failed.get("reason") or "no reason given"
        return FetchState(FAILED, reason=str(failed.get("reason") or "Failed"),
                          message=f"model fetch Job {name} failed ({failed.get('reason') or 'Failed'}): {why}")
    mine = [p for p in pods if (p["metadata"].get("labels") or {}).get("job-name") == name]
    waiting = pods_waiting(list(mine))
    retried = _reported_error(job, mine)
    return FetchState(RUNNING, waiting=waiting,
                      message=f"fetching the release's models into the model cache (Job {name})"
                      + (f"; {waiting}" if waiting else "") + (f"; an attempt failed: {retried}" if retried else ""))
