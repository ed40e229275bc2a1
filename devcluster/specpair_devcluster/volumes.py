"""Storage a devcluster offers: no provisioner runs here, so a PersistentVolumeClaim is bound by
hand to a hostPath PersistentVolume (a folder on this machine, which the node's pods share).

Used where a pair names a claim (spec.learning.persistentVolumeClaim: the captured traffic):
the learning loop's e2e test and the demo's domain shift chapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def hostpath_claim(kube: Any, namespace: str, name: str, folder: Path) -> str:
    """Create a ReadWriteMany claim `name` in `namespace` bound to a new hostPath volume at
    `folder` (created by the node when a pod first mounts it); returns the volume's name, which
    the caller deletes (volumes are cluster-scoped: a namespace's deletion leaves them)."""
    pv = f"{name}-{namespace}"
    kube.create({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                 "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                          # Retain: what the pods captured outlives the claim (a test reads it).
                          "persistentVolumeReclaimPolicy": "Retain",
                          "hostPath": {"path": str(folder), "type": "DirectoryOrCreate"}}})
    kube.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": namespace},
                 "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
                          "resources": {"requests": {"storage": "1Gi"}}}})
    return pv
