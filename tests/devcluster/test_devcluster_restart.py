"""A control-plane component restarted in place (DevCluster.restart) comes back with its
arguments, ports, certificates and data, stays up, and the rest of the cluster (the other
components, the nodes, the clients) carries on with it: what a test of an operator across an API
server restart needs (tests/operator/test_operator_apiserver_restart.py)."""

from __future__ import annotations

import time

import pytest
from waiting import wait_until

from devcluster_images import TEST_PYTHON_IMAGE


def deployment(name: str, ns: str) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [
                         {"name": "c", "image": TEST_PYTHON_IMAGE,
                          "command": ["python", "-c", "import time; time.sleep(600)"]}]}}}}


def available(devcluster, ns: str, name: str) -> bool:
    return ((devcluster.kube.get("apps/v1", "Deployment", ns, name) or {}).get("status") or {}).get("availableReplicas") == 1


def api_answers(devcluster) -> bool:
    try:
        return devcluster.kube.get("v1", "Namespace", None, "default") is not None
    except Exception:  # noqa: BLE001  (a refused connection is what is being waited out)
        return False


@pytest.mark.timeout(300)
def test_a_crashed_api_server_comes_back_in_place_and_stays_up(devcluster, ns):
    kube = devcluster.kube
    before = kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "before", "namespace": ns},
                          "data": {"k": "v"}})
    server = devcluster.server
    pid = next(c for c in devcluster.control_plane.children if c.name == "kube-apiserver").pid
    away = devcluster.restart("kube-apiserver")            # SIGKILL, then the same argv
    apiserver = next(c for c in devcluster.control_plane.children if c.name == "kube-apiserver")
    assert apiserver.pid != pid and devcluster.server == server and away < 90
    # Stays up: not stopped a few seconds after it came back (as a restart by hand once was).
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        assert apiserver.alive(), apiserver.describe_exit()
        assert api_answers(devcluster)
        time.sleep(0.5)
    # Same data (etcd kept it), and every controller, the scheduler and the nodes reconnected:
    # a Deployment made after the restart is scheduled, run and reported available.
    assert kube.get("v1", "ConfigMap", ns, "before")["metadata"]["uid"] == before["metadata"]["uid"]
    kube.create(deployment("after-apiserver", ns))
    wait_until("a Deployment made after the restart to be available",
               lambda: available(devcluster, ns, "after-apiserver"), timeout=120)
    assert not devcluster.node_errors()


@pytest.mark.timeout(300)
def test_etcd_the_controllers_and_the_scheduler_restart_in_place(devcluster, ns):
    for component in ("etcd", "kube-controller-manager", "kube-scheduler"):
        old = next(c for c in devcluster.control_plane.children if c.name == component)
        devcluster.restart(component, crash=component == "etcd")  # etcd killed, the others drained
        new = next(c for c in devcluster.control_plane.children if c.name == component)
        assert new.pid != old.pid and new.argv == old.argv and new.alive()
    wait_until("the API server to answer", lambda: api_answers(devcluster), timeout=60)
    devcluster.kube.create(deployment("after-the-rest", ns))
    wait_until("a Deployment made after the restarts to be available",
               lambda: available(devcluster, ns, "after-the-rest"), timeout=120)
    with pytest.raises(ValueError, match="no control-plane component 'kubelet'"):
        devcluster.restart("kubelet")
