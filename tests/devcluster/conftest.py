"""Fixtures for the devcluster room's tests: a namespace of the session's cluster per test, and a
claim on a hostPath volume that the real PV controller binds."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Callable

import pytest
from waiting import wait_until


@pytest.fixture
def ns(devcluster) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    devcluster.ensure_namespace(name)
    yield name
    devcluster.kube.delete("v1", "Namespace", None, name)


@pytest.fixture
def models_claim(devcluster, ns) -> Callable[[Path], str]:
    """Makes a hostPath PersistentVolume on `folder` and a claim `models` in the test's namespace,
    waits for the PV controller to bind them, and returns the claim's name."""
    def make(folder: Path) -> str:
        pv = f"models-{ns}"
        devcluster.kube.create({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                                "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                                         "storageClassName": "", "persistentVolumeReclaimPolicy": "Retain",
                                         "hostPath": {"path": str(folder), "type": "DirectoryOrCreate"}}})
        devcluster.kube.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                "metadata": {"name": "models", "namespace": ns},
                                "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                                         "volumeName": pv, "resources": {"requests": {"storage": "1Gi"}}}})
        wait_until("the claim to be bound",
                   lambda: ((devcluster.kube.get("v1", "PersistentVolumeClaim", ns, "models") or {})
                            .get("status") or {}).get("phase") == "Bound", 60)
        return "models"
    return make
