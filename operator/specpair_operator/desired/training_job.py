"""The training Job: a new draft for one category of a release, from the traffic the pair captured.

When the drift ladder finds a category breaching and no rollback that would help
(`RollbackWouldNotHelp`) and the pair has `spec.learning` enabled, the operator runs this Job once
per (release, category) (plan/learning.py decides). In the engine image it runs the training
runner (gate/training_runner.py): `specpair distill --from-capture` on that category's captured
requests, measured on the release's golden prompts of that category, within `--max-seconds`; the
draft it trains is logged to MLflow and registered as a new version of the pair's model that
changes only the draft side, with its lineage (`specpair.lineage.*` tags: the release, the
capture, the category). Its termination message says which version (`training_state` reads it).

`activeDeadlineSeconds` (spec.learning.training) bounds the whole Job; Kubernetes never retries it
(backoffLimit 0): a Job that fails or runs out of time leaves the pair as it was, and is said in a
condition and an Event. The capture PVC is mounted read-only: training never changes the data.

Everything here is pure (manifests and decisions from values); nothing reads or writes the API.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any, Collection, Mapping

from specpair.contract import content_hash

from specpair_operator.crd import names
from specpair_operator.crd.schema import spec_schema
from specpair_operator.desired import manifests
from specpair_operator.desired import learning as learning_mod

ROLE = "training"
ABSENT, RUNNING, DONE, FAILED, TIMED_OUT = "absent", "running", "done", "failed", "timed-out"
WANTED = "wanted"            # status.training.runs: wanted, its Job not created yet (waiting for capture)


def training_defaults() -> dict[str, Any]:
    """spec.learning.training's defaults as the CRD declares them (their one home). Read when
    asked, not on import: the training runner imports this module in the engine image."""
    props = spec_schema()["properties"]["learning"]["properties"]["training"]["properties"]
    return {k: sub["default"] for k, sub in props.items() if "default" in sub}
# A CPU training pod without resources of its own: torch uses what it is given; 2 cores, and
# memory for the target, the draft, its optimiser and the features.
CPU_RESOURCES = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
# Of the Job's deadline, the share the training loop may take (`distill --max-seconds`): the rest
# loads the target, reads the capture, saves and uploads the draft and registers it.
TRAINING_SHARE = 0.6
OUT_DIR = "/tmp/training"                          # the pod's emptyDir
MESSAGE_LIMIT = 1500
# The runner's report (its termination message) names the version it registered under this key.
REPORT_VERSION = "version"
# The Job's name, for the runner's lineage tag (its pod's HOSTNAME is the pod's name, not the Job's).
JOB_ENV = "SPECPAIR_TRAINING_JOB"


@dataclass(frozen=True)
class TrainingSettings:
    deadline_seconds: int
    gpu: bool
    method: str
    steps: int
    resources: Mapping[str, Any]
    min_captured: int            # captured requests of the category a Job waits for (minCapturedRequests)

    @classmethod
    def from_spec(cls, learning: Mapping[str, Any] | None) -> "TrainingSettings":
        given = {**training_defaults(), **dict((learning or {}).get("training") or {})}
        return cls(int(given["activeDeadlineSeconds"]), bool(given["gpu"]), str(given["method"]),
                   int(given["steps"]), dict(given.get("resources") or {}), int(given["minCapturedRequests"]))

    @property
    def max_seconds(self) -> int:
        return max(1, int(self.deadline_seconds * TRAINING_SHARE))


def recorded_runs(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """status.training.runs as the plan writes them: [{version, category, job, phase, candidate,
    message}], the newest last."""
    runs = (status.get("training") or {}).get("runs") or []
    return [dict(r) for r in runs if isinstance(r, Mapping) and r.get("version") and r.get("category")]


def followed(status: Mapping[str, Any], champion: str) -> list[tuple[str, str, str]]:
    """(version, category, slot) of the champion's trainings not yet ended, whose Jobs a pass reads."""
    return [(str(r["version"]), str(r["category"]), str(r.get("slot") or "")) for r in recorded_runs(status)
            if str(r["version"]) == champion and r.get("phase") not in (DONE, FAILED, TIMED_OUT)]


def waits_for_capture(status: Mapping[str, Any], champion: str) -> bool:
    """Whether a training of the champion is wanted and its Job not started (it waits for enough
    captured requests): the pods' counters are read every pass meanwhile (observe)."""
    return any(str(r["version"]) == str(champion) and r.get("phase") == WANTED for r in recorded_runs(status))


def run_key(version: str, category: str, slot: str = "") -> str:
    """A training's key (its history entries', and the pass's map of Jobs): "version/category",
    with "@slot" for a scheduled one."""
    return f"{version}/{category}" + (f"@{slot}" if slot else "")


def learning_enabled(spec: Mapping[str, Any]) -> bool:
    """Capture and training are off unless spec.learning.enabled says so, with a PVC to read."""
    return learning_mod.Learning.from_spec(spec).captures


def category_digest(category: str) -> str:
    return hashlib.sha256(category.encode()).hexdigest()[:8]


def training_job_name(pair: str, version: str, category: str, slot: str = "") -> str:
    """One Job per (release version, category), and per slot of spec.learning.schedule for a
    scheduled one: a category's name is any string, so the Job's name carries its hash (the Job's
    annotations carry the name itself)."""
    return names.object_name(pair, "train", f"v{version}", category_digest(category),
                             category_digest(slot) if slot else "")


ANN_CATEGORY = f"{manifests.GROUP}/training-category"
ANN_VERSION = f"{manifests.GROUP}/training-version"
ANN_SLOT = f"{manifests.GROUP}/training-slot"     # a scheduled training's slot (its time); absent on drift


def _resources(settings: TrainingSettings, rollout: Mapping[str, Any]) -> dict[str, Any]:
    """spec.learning.training.resources; else, on the GPU the pair names, the engine pods' own
    resources (their GPU), or on the CPU CPU_RESOURCES. A CPU Job asks for no GPU whatever the
    resources say, so it never holds one."""
    if settings.resources:
        resources = copy.deepcopy(dict(settings.resources))
    elif settings.gpu:
        resources = copy.deepcopy(dict(rollout.get("resources") or {}))
    else:
        resources = copy.deepcopy(CPU_RESOURCES)
    if not settings.gpu:
        for part in ("requests", "limits"):
            for name in list(resources.get(part) or {}):
                if name.endswith("/gpu"):
                    del resources[part][name]
    return resources


def desired_training_job(pair: str, namespace: str, release: dict[str, Any], rollout: dict[str, Any],
                         learning: Mapping[str, Any], version: str, category: str, model: str,
                         tracking_uri: str, credentials: manifests.MlflowCredentials | None = None,
                         defaults: manifests.PodDefaults = manifests.PodDefaults(), slot: str = "") -> dict[str, Any]:
    """The training Job of (release `version`, `category`, and the schedule's `slot` for a
    scheduled one); `release` is the release document as its pods get it. The owner reference is
    added by the adapter, as for every child."""
    claim = (learning or {}).get("persistentVolumeClaim")
    if not claim:
        raise ValueError("a training Job needs spec.learning.persistentVolumeClaim")
    settings = TrainingSettings.from_spec(learning)
    name = training_job_name(pair, version, category, slot)
    labels = manifests.pod_labels(pair, ROLE, version)
    digest = content_hash(release)
    command = ["python", "-m", "specpair_operator.gate.training_runner",
               "--release", manifests.RELEASE_FILE, "--model", model, "--version", str(version),
               "--capture-dir", learning_mod.capture_dir(pair), "--category", category,
               "--method", settings.method, "--steps", str(settings.steps),
               "--max-seconds", str(settings.max_seconds), "--out", OUT_DIR,
               "--device", "cuda" if settings.gpu else "cpu",
               "--termination-log", manifests.TERMINATION_LOG]
    container = {
        # The runner's JSON report; its log's tail if it died before writing one.
        **manifests.release_job_container("train", release, rollout, command, "FallbackToLogsOnError"),
        "env": [*manifests.pod_env(tracking_uri, credentials, rollout=rollout, defaults=defaults),
                {"name": JOB_ENV, "value": name}],
        # The captures, read-only: training never changes them (the pair's own folder is read).
        "volumeMounts": [*manifests.pod_mounts(rollout), learning_mod.capture_mount(read_only=True)],
        "securityContext": manifests.container_security(),
    }
    resources = _resources(settings, rollout)
    if resources:
        container["resources"] = resources
    pod_spec = manifests.pod_spec(rollout, defaults)
    pod_spec["volumes"] = [*pod_spec["volumes"], learning_mod.capture_volume(str(claim), read_only=True)]
    return manifests.release_job(
        name, namespace, labels,
        {manifests.ANN_HASH: digest, ANN_CATEGORY: category, ANN_VERSION: str(version), **({ANN_SLOT: slot} if slot else {})},
        release, digest, container, pod_spec,
        backoff_limit=0, deadline_seconds=settings.deadline_seconds, defaults=defaults)


@dataclass(frozen=True)
class TrainingState:
    phase: str               # ABSENT, RUNNING, DONE, FAILED or TIMED_OUT
    message: str = ""        # for the pair's condition and Event
    candidate: str = ""      # DONE: the model version the runner registered
    # Which training the Job is (its annotations; empty for ABSENT): (version, category, slot).
    run: tuple[str, str, str] = ("", "", "")


def job_run(job: Mapping[str, Any]) -> tuple[str, str, str]:
    """(version, category, slot) of a training Job, from its annotations."""
    notes = job["metadata"].get("annotations") or {}
    return (str(notes.get(ANN_VERSION) or ""), str(notes.get(ANN_CATEGORY) or ""), str(notes.get(ANN_SLOT) or ""))


def _condition(job: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((cd for cd in (job.get("status") or {}).get("conditions") or []
                 if cd.get("type") == type_ and cd.get("status") == "True"), None)


def _reports(job: Mapping[str, Any], pods: Collection[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any] | str]]:
    """(finishedAt, the runner's JSON report, or the log tail a pod died with) of the Job's pods."""
    name = job["metadata"]["name"]
    found: list[tuple[str, dict[str, Any] | str]] = []
    for pod in pods:
        if (pod["metadata"].get("labels") or {}).get("job-name") != name:
            continue
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            done = (cs.get("state") or {}).get("terminated") or {}
            text = done.get("message") or ""
            try:
                report = json.loads(text)
            except ValueError:
                if text.strip():
                    found.append((done.get("finishedAt") or "", text.strip().splitlines()[-1]))
                continue
            if isinstance(report, dict):
                found.append((done.get("finishedAt") or "", report))
    return sorted(found, key=lambda r: r[0])


def training_state(job: Mapping[str, Any] | None, pods: Collection[Mapping[str, Any]] = ()) -> TrainingState:
    """Where a training Job stands, from the Job and its pods' termination messages."""
    if job is None:
        return TrainingState(ABSENT, "no training Job yet")
    return replace(_training_state(job, pods), run=job_run(job))


def _training_state(job: Mapping[str, Any], pods: Collection[Mapping[str, Any]]) -> TrainingState:
    name = job["metadata"]["name"]
    reports = _reports(job, pods)
    last = reports[-1][1] if reports else None
    if _condition(job, "Complete") is not None:
        version = str(last.get(REPORT_VERSION) or "") if isinstance(last, dict) else ""
        if not version:
            return TrainingState(FAILED, f"training Job {name} completed without naming the version it registered")
        return TrainingState(DONE, f"training Job {name} registered v{version}"
                             + (f": {last['summary']}" if isinstance(last, dict) and last.get("summary") else ""),
                             version)
    failed = _condition(job, "Failed")
    if failed is not None:
        reason = str(failed.get("reason") or "Failed")
        why = (str(last.get("error") or "") if isinstance(last, dict) else str(last or "")) \
            or str(failed.get("message") or reason)
        phase = TIMED_OUT if reason == "DeadlineExceeded" else FAILED
        return TrainingState(phase, f"training Job {name} {'ran out of time' if phase == TIMED_OUT else 'failed'} "
                             f"({reason}): {why}"[:MESSAGE_LIMIT])
    return TrainingState(RUNNING, f"training Job {name} is running")
