"""spec.learning as objects (issue 58, docs/learning.md): what the engine pods of a pair that
captures its served traffic mount and run with, and the Job that deletes that traffic when the
pair goes.

The capture's defaults and bounds have one home, the engine's specpair.capture (the CRD defaults
only `enabled` and `keepOnDelete`, both false); its format is that module's too. The pair's
traffic is kept on the PersistentVolumeClaim the pair names, in a folder named after the pair:
the volume is mounted whole (not by subPath: the kubelet would make that folder as root, which
the engine's unprivileged user could not write on every volume) and the engine makes the folder.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

from specpair import capture

from specpair_operator.crd import names
from specpair_operator.crd.schema import spec_schema
from specpair_operator.desired.manifests import PodDefaults, container_security, pod_labels, pod_spec
from specpair_operator.release import content as release_mod

CAPTURE_MOUNT_PATH = "/var/lib/specpair/capture"
CAPTURE_VOLUME = "capture"
# On a pair whose captured traffic goes with it: the operator deletes the pair's folder (a Job)
# before the pair may go. The only finalizer the operator sets (handlers.py says why it sets no
# other): a pair that does not capture, or keeps its capture, is deleted at once.
CAPTURE_FINALIZER = "specpair.io/capture-cleanup"
ANN_PAIR_UID = "specpair.io/pair-uid"
CLEANUP_DEADLINE_SECONDS = 600
# A finished clean-up Job stays this long (its Event and the pair's finalizer outlive it).
CLEANUP_TTL_SECONDS = 600


def learning_crd_defaults() -> dict[str, Any]:
    """spec.learning's defaults as the CRD declares them (enabled, keepOnDelete)."""
    props = spec_schema()["properties"]["learning"]["properties"]
    return {k: sub["default"] for k, sub in props.items() if "default" in sub}


@dataclass(frozen=True)
class Learning:
    enabled: bool
    sample_rate: float
    per_category_cap: int
    retention_seconds: int
    claim: str | None            # the PersistentVolumeClaim holding the captured traffic
    keep_on_delete: bool

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "Learning":
        given = {**learning_crd_defaults(), **dict(spec.get("learning") or {})}
        return cls(enabled=given.get("enabled") is True,
                   sample_rate=float(given.get("sampleRate", capture.DEFAULT_SAMPLE_RATE)),
                   per_category_cap=int(given.get("perCategoryCap", capture.DEFAULT_PER_CATEGORY_CAP)),
                   retention_seconds=int(given.get("retentionSeconds", capture.DEFAULT_RETENTION_SECONDS)),
                   claim=given.get("persistentVolumeClaim") or None,
                   keep_on_delete=given.get("keepOnDelete") is True)

    @property
    def captures(self) -> bool:
        """Whether engine pods capture (the CRD refuses enabled without a claim; an older CRD may not)."""
        return self.enabled and bool(self.claim)


def capture_dir(pair: str) -> str:
    """The pair's folder on the capture volume, as engine pods and the training Job mount it."""
    return f"{CAPTURE_MOUNT_PATH}/{pair}"


def capture_volume(claim: str, read_only: bool = False) -> dict[str, Any]:
    return {"name": CAPTURE_VOLUME, "persistentVolumeClaim": {"claimName": claim, **({"readOnly": True} if read_only else {})}}


def capture_mount(read_only: bool = False) -> dict[str, Any]:
    return {"name": CAPTURE_VOLUME, "mountPath": CAPTURE_MOUNT_PATH, **({"readOnly": True} if read_only else {})}


def capture_flags(pair: str, learning: Learning) -> list[str]:
    """`specpair engine serve`'s capture flags, every setting written out (the engine's defaults
    are the same values: the pod's command says what it does)."""
    return ["--capture-dir", capture_dir(pair), "--capture-rate", f"{learning.sample_rate:g}",
            "--capture-cap", str(learning.per_category_cap), "--capture-retention", str(learning.retention_seconds)]


def pods_capture(spec: Mapping[str, Any], release: Mapping[str, Any]) -> bool:
    """Whether the engine pods of `release` capture traffic: where spec.learning says so, and only
    our engine's (vLLM's server reports no token ids to capture; docs/learning.md)."""
    return Learning.from_spec(spec).captures and release_mod.engine_kind(dict(release)) == "specpair"


def with_capture(dep: dict[str, Any], pair: str, spec: Mapping[str, Any], release: Mapping[str, Any]) -> dict[str, Any]:
    """The engine Deployment `dep`, capturing where pods_capture says so: the claim mounted
    read-write and the engine's capture flags."""
    if not pods_capture(spec, release):
        return dep
    learning = Learning.from_spec(spec)
    dep = copy.deepcopy(dep)
    pod = dep["spec"]["template"]["spec"]
    pod["volumes"] = [*pod.get("volumes", []), capture_volume(learning.claim)]
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    engine["volumeMounts"] = [*engine.get("volumeMounts", []), capture_mount()]
    engine["command"] = [*engine["command"], *capture_flags(pair, learning)]
    return dep


def cleanup_job_name(pair: str, uid: str) -> str:
    """The clean-up Job of one pair (its uid in the name: a pair made again under the same name
    never takes the old one's finished Job for its own)."""
    return names.object_name(pair, "capture-cleanup", uid.replace("-", "")[:8])


def capture_cleanup_job(pair: str, namespace: str, uid: str, claim: str, rollout: Mapping[str, Any],
                        defaults: PodDefaults = PodDefaults()) -> dict[str, Any]:
    """The Job that deletes a pair's folder on its capture claim (`python -m specpair.capture
    remove`), in the engine image, as the engine's unprivileged user. Not owned by the pair: it
    runs while the pair is being deleted, and a pair deleted in the foreground would have the
    garbage collector delete its own clean-up; it goes CLEANUP_TTL_SECONDS after it ends."""
    labels = pod_labels(pair, "capture-cleanup")
    pod = pod_spec(dict(rollout), defaults)
    pod["volumes"] = [capture_volume(claim)]
    image = str(rollout.get("image") or release_mod.default_engine_image())
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": cleanup_job_name(pair, uid), "namespace": namespace, "labels": labels,
                     "annotations": {ANN_PAIR_UID: uid}},
        "spec": {
            "backoffLimit": 2,
            "activeDeadlineSeconds": CLEANUP_DEADLINE_SECONDS,
            "ttlSecondsAfterFinished": CLEANUP_TTL_SECONDS,
            "template": {
                "metadata": {"labels": labels},
                "spec": {"restartPolicy": "Never",
                         "containers": [{"name": "cleanup", "image": image,
                                         "imagePullPolicy": rollout.get("imagePullPolicy", "IfNotPresent"),
                                         "command": ["python", "-m", "specpair.capture", "remove", capture_dir(pair)],
                                         "volumeMounts": [capture_mount()],
                                         "securityContext": container_security(),
                                         "resources": {"requests": {"cpu": "10m", "memory": "64Mi"},
                                                       "limits": {"memory": "256Mi"}}}],
                         **pod},
            },
        },
    }
