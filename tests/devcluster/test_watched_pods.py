"""A node that keeps its pods from its watch's events (NodeSpec.pods_from_watch, an informer's
store, as a kubelet has) instead of listing them whenever the watch wakes it: bench/operator_scale.py's
nodes of 250 pods listed them (MBs of JSON) at every event while pairs were brought up. The store
as a pure function of the events it is given, then a node on the session's real control plane
that runs, ends and deletes pods with its periodic look pushed out of reach (so only the watch's
events can drive it) and never lists."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from waiting import wait_until

from devcluster_images import TEST_PYTHON_IMAGE
from specpair_devcluster.node_agent import NodeSpec, WatchedPods


def pod_obj(uid: str, version: str, phase: str = "Running") -> dict:
    return {"metadata": {"uid": uid, "name": f"p-{uid}", "namespace": "n", "resourceVersion": version},
            "status": {"phase": phase}}


def test_the_store_applies_events_from_its_list_and_asks_for_a_new_list_on_an_error():
    store = WatchedPods()
    # Nothing read yet is not "no pods": a node that took it so would stop everything it runs.
    assert store.pods() is None and store.version == ""
    assert store.apply({"type": "ADDED", "object": pod_obj("a", "5")})
    assert store.pods() is None

    store.replace({"metadata": {"resourceVersion": "10"}, "items": [pod_obj("a", "9"), pod_obj("b", "8")]})
    assert store.version == "10" and {p["metadata"]["uid"] for p in store.pods()} == {"a", "b"}

    assert store.apply({"type": "MODIFIED", "object": pod_obj("a", "11", "Succeeded")})
    assert store.apply({"type": "ADDED", "object": pod_obj("c", "12")})
    assert store.apply({"type": "DELETED", "object": pod_obj("b", "13")})
    by_uid = {p["metadata"]["uid"]: p for p in store.pods()}
    assert set(by_uid) == {"a", "c"} and by_uid["a"]["status"]["phase"] == "Succeeded"
    assert store.version == "13"
    # A pod deleted twice (its DELETED seen after a list that no longer held it) is no error.
    assert store.apply({"type": "DELETED", "object": pod_obj("b", "14")})
    # A bookmark moves only where the watch resumes.
    assert store.apply({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}})
    assert store.version == "20" and len(store.pods()) == 2
    # 410 Gone (the API server no longer holds version 20): list again, keep what is known till then.
    assert not store.apply({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}})
    assert store.version == "" and len(store.pods()) == 2
    # A handed-out list is the caller's: the store's later events do not change it.
    seen = store.pods()
    store.apply({"type": "DELETED", "object": pod_obj("c", "21")})
    assert len(seen) == 2 and len(store.pods()) == 1


def test_a_node_on_its_watch_alone_runs_ends_and_deletes_pods_and_never_lists(devcluster, ns, tmp_path: Path):
    # Its periodic look (sync_seconds) out of reach: every pod it starts or stops, it learnt of
    # from a watch event. Tainted, so the scheduler places no other test's pod on it; this test's
    # pods name it (spec.nodeName), as a bound pod does.
    spec = NodeSpec(name=f"watched-{ns}", cpu="4", env={"OMP_NUM_THREADS": "1"}, pods_from_watch=True,
                    sync_seconds=3600.0,
                    taints=[{"key": "specpair.io/test", "value": "watched-node", "effect": "NoSchedule"}])
    agent = devcluster.add_node(spec)
    lists = []
    listed = agent.kube.list
    agent.kube.list = lambda *a, **k: lists.append((a, k)) or listed(*a, **k)
    kube = devcluster.kube
    runs = tmp_path / "runs"

    def make(name: str, code: str, restart: str, **container) -> None:
        kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
                     "spec": {"nodeName": spec.name, "restartPolicy": restart,
                              "containers": [{"name": "main", "image": TEST_PYTHON_IMAGE,
                                              "command": ["python", "-c", code], **container}]}})

    def status(name: str) -> dict:
        return (kube.get("v1", "Pod", ns, name) or {}).get("status") or {}

    try:
        server = ("import http.server\n"
                  "http.server.ThreadingHTTPServer(('0.0.0.0', 8080), http.server.SimpleHTTPRequestHandler).serve_forever()")
        make("web", server, "Always", ports=[{"name": "http", "containerPort": 8080}],
             readinessProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1})
        make("once", f"open({str(runs)!r}, 'a').write('ran\\n')", "Never")
        wait_until("web ready", lambda: any(c["type"] == "Ready" and c["status"] == "True"
                                            for c in status("web").get("conditions") or []), 180)
        wait_until("once succeeded", lambda: status("once").get("phase") == "Succeeded", 180)
        ip = status("web")["podIP"]
        with socket.create_connection((ip, 8080), timeout=5):
            pass
        # The ended pod's object stays; its later events (and the store's copy of it from before
        # its last status) never start it again.
        kube.patch("v1", "Pod", ns, "once", {"metadata": {"labels": {"touched": "yes"}}})
        time.sleep(3)
        assert runs.read_text() == "ran\n"

        # Deleting a pod stops its process and lets its object go, woken by the watch alone.
        kube.delete("v1", "Pod", ns, "web")
        wait_until("web gone", lambda: kube.get("v1", "Pod", ns, "web") is None, 180)
        with pytest.raises(OSError):
            socket.create_connection((ip, 8080), timeout=2)

        # The store holds what the API server holds for the node.
        wait_until("the store agrees with the API server", lambda: sorted(
            p["metadata"]["uid"] for p in agent.watched.pods()) == sorted(
            p["metadata"]["uid"] for p in kube.list("v1", "Pod", None, fields=f"spec.nodeName={spec.name}")), 60)
        assert lists == []
    finally:
        for name in ("web", "once"):     # gone at once: no node is left to finalise them
            kube.delete("v1", "Pod", ns, name, grace_seconds=0)
        agent.stop()
        devcluster.agents.remove(agent)
        kube.delete("v1", "Node", None, spec.name)
    assert not agent.errors, agent.errors[-5:]
