"""PersistentVolumeClaims on devcluster nodes: a claim bound by the real PV controller to a
hostPath PersistentVolume is one folder for every pod that mounts it; a Job writes into it and a
second pod, mounting it read-only, reads what the Job wrote and cannot write."""

from __future__ import annotations

from typing import Any

from waiting import wait_until

from devcluster_images import TEST_PYTHON_IMAGE

READ_WRITE = """
import os, pathlib
pathlib.Path(os.environ["DATA"], "models").mkdir(exist_ok=True)
pathlib.Path(os.environ["DATA"], "models", "hello.txt").write_text("written by the Job")
"""
READ_ONLY = """
import errno, os, pathlib, sys
if pathlib.Path(os.environ["DATA"], "models", "hello.txt").read_text() != "written by the Job":
    sys.exit(3)
try:
    pathlib.Path(os.environ["DATA"], "models", "mine.txt").write_text("x")
except OSError as exc:
    sys.exit(0 if exc.errno == errno.EROFS else 4)
sys.exit(5)
"""


wait = wait_until


def pod_spec(code: str, claim_name: str, read_only: bool) -> dict[str, Any]:
    return {"restartPolicy": "Never",
            "containers": [{"name": "main", "image": TEST_PYTHON_IMAGE, "command": ["python", "-c", code],
                            "env": [{"name": "DATA", "value": "/data"}],
                            "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": read_only}]}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim_name}}]}


def test_a_job_fills_a_claim_and_another_pod_reads_it_read_only(devcluster, ns, models_claim, tmp_path):
    name = models_claim(tmp_path / "volume")
    devcluster.kube.create({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "fill", "namespace": ns},
                            "spec": {"backoffLimit": 0, "template": {"spec": pod_spec(READ_WRITE, name, False)}}})
    wait("the Job to complete", lambda: any(
        c["type"] == "Complete" and c["status"] == "True"
        for c in ((devcluster.kube.get("batch/v1", "Job", ns, "fill") or {}).get("status") or {}).get("conditions") or []))
    assert (tmp_path / "volume" / "models" / "hello.txt").read_text() == "written by the Job"

    devcluster.kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "reader", "namespace": ns},
                            "spec": pod_spec(READ_ONLY, name, True)})
    done = wait("the reader to finish", lambda: (lambda p: p if (p.get("status") or {}).get("phase") in (
        "Succeeded", "Failed") else None)(devcluster.kube.get("v1", "Pod", ns, "reader") or {}))
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert done["status"]["phase"] == "Succeeded", terminated     # read the Job's file, refused a write (EROFS)
    assert not (tmp_path / "volume" / "models" / "mine.txt").exists()


def test_a_claim_on_a_volume_nodes_cannot_mount_says_so(devcluster, ns):
    devcluster.kube.create({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"nfs-{ns}"},
                            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                                     "storageClassName": "", "nfs": {"server": "127.0.0.1", "path": "/x"}}})
    devcluster.kube.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                            "metadata": {"name": "nfs", "namespace": ns},
                            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                                     "volumeName": f"nfs-{ns}", "resources": {"requests": {"storage": "1Gi"}}}})
    devcluster.kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": ns},
                            "spec": pod_spec("print(1)", "nfs", True)})
    waiting = wait("the pod to wait on its volume", lambda: (lambda p: next(
        (cs["state"]["waiting"] for cs in (p.get("status") or {}).get("containerStatuses") or []
         if (cs.get("state") or {}).get("waiting", {}).get("reason") == "CreateContainerConfigError"), None))(
        devcluster.kube.get("v1", "Pod", ns, "p") or {}))
    assert "neither hostPath nor local" in waiting["message"]
