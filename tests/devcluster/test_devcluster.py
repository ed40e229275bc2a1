"""devcluster is a real control plane: what the old API emulator accepted, it refuses; its nodes
run pods as processes with probes, exit codes, GPU capacity and deletion as a kubelet would."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_until
import yaml

from devcluster_images import TEST_PYTHON_IMAGE
from specpair_devcluster.client import ApiError

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "specmodelpair.yaml"


wait = wait_until


@pytest.fixture(scope="module")
def crd(devcluster):
    devcluster.kube.apply(yaml.safe_load(CRD.read_text()))
    wait("the CRD to be established", lambda: any(
        c["type"] == "Established" and c["status"] == "True"
        for c in (devcluster.kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None,
                                      "specmodelpairs.specpair.io") or {}).get("status", {}).get("conditions") or []))
    # Discovery catches up a moment after Established.
    wait("specmodelpairs to be served", lambda: _served(devcluster))


def _served(devcluster) -> bool:
    try:
        devcluster.kube.list("specpair.io/v1alpha1", "SpecModelPair", "default")
        return True
    except ApiError:
        return False


def python_pod(name: str, ns: str, code: str, **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": TEST_PYTHON_IMAGE, "command": ["python", "-c", code]}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"containers": [container], "restartPolicy": spec.pop("restartPolicy", "Never"), **spec}}


def pod(devcluster, ns: str, name: str) -> dict[str, Any]:
    return devcluster.kube.get("v1", "Pod", ns, name) or {}


def ready(p: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (p.get("status") or {}).get("conditions", []))


# -- the API server refuses what the emulator accepted -----------------------------------------

def test_malformed_pairs_are_refused_with_the_crds_own_messages(devcluster, crd, ns):
    good = {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": "p", "namespace": ns},
            "spec": {"target": {"source": "default"}, "draft": {"drafter": "ngram"}}}
    cases = [
        ({"speculation": {"k": 1000}}, "spec.speculation.k"),
        ({"draft": {"drafter": "eagle9"}}, "spec.draft.drafter"),
        ({"target": {}}, "spec.target.source"),
        ({"draft": {"drafter": "ngram", "source": "x"}}, "spec.draft"),
    ]
    for patch, field in cases:
        bad = {**good, "spec": {**good["spec"], **patch}}
        with pytest.raises(ApiError) as err:
            devcluster.kube.create(bad)
        assert err.value.status == 422 and field in err.value.message, err.value.message
    # Unknown fields are pruned, not kept.
    made = devcluster.kube.create({**good, "spec": {**good["spec"], "surprise": {"a": 1}}})
    assert "surprise" not in made["spec"]


def test_the_server_enforces_optimistic_concurrency_immutability_and_label_syntax(devcluster, ns):
    kube = devcluster.kube
    cm = kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": ns}, "data": {"a": "1"}})
    kube.patch("v1", "ConfigMap", ns, "c", {"data": {"a": "2"}})
    with pytest.raises(ApiError) as err:
        kube.patch("v1", "ConfigMap", ns, "c", {"metadata": {"resourceVersion": cm["metadata"]["resourceVersion"]},
                                               "data": {"a": "3"}})
    assert err.value.status == 409
    with pytest.raises(ApiError) as err:
        kube.create({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": "l", "namespace": ns, "labels": {"specpair.io/pair": "x" * 70}}})
    assert err.value.status == 422 and "63" in err.value.message
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": ns},
           "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "a"}},
                    "template": {"metadata": {"labels": {"app": "a"}},
                                 "spec": {"containers": [{"name": "c", "image": TEST_PYTHON_IMAGE}]}}}}
    kube.create(dep)
    with pytest.raises(ApiError) as err:
        kube.patch("apps/v1", "Deployment", ns, "d", {"spec": {"selector": {"matchLabels": {"app": "b"}},
                                                               "template": {"metadata": {"labels": {"app": "b"}}}}})
    assert err.value.status == 422 and "immutable" in err.value.message


# -- nodes ---------------------------------------------------------------------------------------

def test_a_pod_runs_as_a_process_on_its_own_ip_with_probes_and_exit_codes(devcluster, ns):
    server = ("import http.server, os\n"
              "http.server.ThreadingHTTPServer(('0.0.0.0', 8080), http.server.SimpleHTTPRequestHandler).serve_forever()")
    probe = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
    for name in ("web-a", "web-b"):  # both listen on 8080: each pod has its own address
        devcluster.kube.create(python_pod(name, ns, server, restartPolicy="Always",
                                          container={"ports": [{"name": "http", "containerPort": 8080}],
                                                     "readinessProbe": probe}))
    a = wait("web-a ready", lambda: ready(p := pod(devcluster, ns, "web-a")) and p)
    b = wait("web-b ready", lambda: ready(p := pod(devcluster, ns, "web-b")) and p)
    assert a["status"]["podIP"] != b["status"]["podIP"]
    with socket.create_connection((a["status"]["podIP"], 8080), timeout=2):
        pass
    assert a["spec"]["nodeName"].startswith("devcluster-")  # bound by the real scheduler

    devcluster.kube.create(python_pod("exit3", ns, "import sys; print('bye'); sys.exit(3)"))
    done = wait("exit3 failed", lambda: (p := pod(devcluster, ns, "exit3"))["status"].get("phase") == "Failed" and p)
    term = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 3 and "bye" in devcluster.pod_log(ns, "exit3")

    # Deleting a pod stops its process, and the pod object goes away once it has.
    devcluster.kube.delete("v1", "Pod", ns, "web-a")
    wait("web-a gone", lambda: devcluster.kube.get("v1", "Pod", ns, "web-a") is None, timeout=45)
    with pytest.raises(OSError):
        socket.create_connection((a["status"]["podIP"], 8080), timeout=1)


def test_a_startup_probe_passes_when_the_container_answers_and_fails_at_its_periods(devcluster, ns):
    # Listens after a second: the probe at the start fails, a look between periods passes, long
    # before the next period (a kubelet would wait the whole 60 s).
    server = ("import http.server, time\ntime.sleep(1)\n"
              "http.server.ThreadingHTTPServer(('0.0.0.0', 8080), http.server.SimpleHTTPRequestHandler).serve_forever()")
    startup = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 60, "failureThreshold": 2}
    created = time.monotonic()
    devcluster.kube.create(python_pod("slow-start", ns, server, restartPolicy="Always",
                                      container={"ports": [{"name": "http", "containerPort": 8080}],
                                                 "startupProbe": startup}))
    wait("slow-start ready", lambda: ready(pod(devcluster, ns, "slow-start")), timeout=45)
    assert time.monotonic() - created < 45
    # Never answers: failures count once a period (3 x 2 s), not once a look.
    never = {"tcpSocket": {"port": 9}, "periodSeconds": 2, "failureThreshold": 3}
    created = time.monotonic()
    devcluster.kube.create(python_pod("never", ns, "import time; time.sleep(600)", restartPolicy="Always",
                                      container={"startupProbe": never}))
    wait("a restart of never", lambda: ((pod(devcluster, ns, "never").get("status") or {}).get("containerStatuses")
                                        or [{}])[0].get("restartCount", 0) >= 1, timeout=30)
    assert time.monotonic() - created >= 4


# A container that leaves processes outside its session, as vLLM's pod does: its first process
# starts `left` in a session of its own, and `middle`, which starts `orphan` in a session of its
# own and exits (orphan's parent is init then, as vLLM's EngineCore's once vLLM died). Told to stop,
# the first process exits at once, as a supervisor killed at the end of its grace period.
LEAVES_PROCESSES = """
import os, signal, subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
left = subprocess.Popen(sleeper, start_new_session=True)
middle = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys
orphan = subprocess.Popen(sys.argv[1:], start_new_session=True)
print("orphan", orphan.pid, flush=True)
''', *sleeper])
middle.wait()
print("left", left.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
print("started", flush=True)
time.sleep(600)
"""


def running(pid: int, started: str) -> bool:
    """Whether the process seen started at `started` (clock ticks since boot) still runs: a zombie
    has ended; a pid reused since is not the same process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == started and fields[0] != "Z"


def test_a_deleted_pod_leaves_no_process_even_one_that_left_its_session(devcluster, ns):
    devcluster.kube.create(python_pod("leaves", ns, LEAVES_PROCESSES, restartPolicy="Always"))
    # (The log's first line is the command, this code included: its lines are read whole.)
    wait("the pod's processes started", lambda: re.search(r"^started$", devcluster.pod_log(ns, "leaves"), re.M),
         timeout=120)
    log = devcluster.pod_log(ns, "leaves")
    pids = {word: int(re.search(rf"^{word} (\d+)$", log, re.M).group(1)) for word in ("left", "orphan")}
    seen = {word: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() for word, pid in pids.items()}
    # Each in a session of its own (not the container's), the orphan a child of some reaper, not of the pod.
    first = int(seen["left"][1])
    assert int(seen["orphan"][1]) != first and len({int(s[3]) for s in seen.values()} | {first}) == 3, seen
    started = {word: fields[19] for word, fields in seen.items()}
    assert all(running(pids[w], started[w]) for w in pids)
    devcluster.kube.delete("v1", "Pod", ns, "leaves")
    wait("leaves gone", lambda: devcluster.kube.get("v1", "Pod", ns, "leaves") is None, timeout=120)
    # The node kills them before it lets the pod object go; a short wait for the kernel's part.
    wait("its processes gone", lambda: not any(running(pids[w], started[w]) for w in pids), timeout=30)


def test_liveness_failure_restarts_and_a_missing_image_never_runs(devcluster, ns):
    devcluster.kube.create(python_pod("flaky", ns, "import time; time.sleep(600)", restartPolicy="Always",
                                      container={"livenessProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 1,
                                                                   "failureThreshold": 2}}))
    wait("a restart", lambda: ((pod(devcluster, ns, "flaky").get("status") or {}).get("containerStatuses") or
                               [{}])[0].get("restartCount", 0) >= 1, timeout=30)
    devcluster.kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "elsewhere", "namespace": ns},
                            "spec": {"containers": [{"name": "c", "image": "registry.example.com/private/thing:1"}]}})
    # ContainerCreating first, then the pull fails.
    st = wait("ErrImagePull", lambda: (w := ((pod(devcluster, ns, "elsewhere").get("status") or {}).get("containerStatuses")
                                            or [{}])[0].get("state", {}).get("waiting")) and
              w.get("reason") == "ErrImagePull" and w)
    assert "private/thing" in st["message"]


def test_gpu_capacity_is_scheduled_for_real(devcluster, ns):
    gpu = {"resources": {"limits": {"nvidia.com/gpu": 1}}}
    for name in ("gpu-a", "gpu-b"):
        devcluster.kube.create(python_pod(name, ns, "import time; time.sleep(600)", restartPolicy="Always", container=gpu))
    wait("one GPU pod running", lambda: pod(devcluster, ns, "gpu-a").get("status", {}).get("phase") == "Running")
    # The second waits for the one GPU in the cluster: Pending, with the scheduler's reason.
    cond = wait("gpu-b unschedulable", lambda: next(
        (c for c in pod(devcluster, ns, "gpu-b").get("status", {}).get("conditions", [])
         if c["type"] == "PodScheduled" and c["status"] == "False"), None))
    assert cond["reason"] == "Unschedulable" and "nvidia.com/gpu" in cond["message"]
    devcluster.kube.delete("v1", "Pod", ns, "gpu-a")
    # Alone this takes well under a second; on a loaded machine it timed out (twice in one session), so a
    # timeout shows what both pods were doing: gpu-a still terminating, or gpu-b never rescheduled.
    wait("gpu-b runs once the GPU is free", lambda: pod(devcluster, ns, "gpu-b").get("status", {}).get("phase") == "Running",
         timeout=90, show=lambda: {name: {k: pod(devcluster, ns, name).get(k) for k in ("metadata", "status")}
                                   for name in ("gpu-a", "gpu-b")})
    assert pod(devcluster, ns, "gpu-b")["spec"]["nodeName"] == "devcluster-gpu-1"


def test_controllers_run_jobs_and_deployments_and_collect_garbage(devcluster, ns):
    kube = devcluster.kube
    kube.create({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": ns},
                 "spec": {"backoffLimit": 0, "template": {"spec": {
                     "restartPolicy": "Never",
                     "containers": [{"name": "c", "image": TEST_PYTHON_IMAGE, "command": ["python", "-c", "print(1)"]}]}}}})
    wait("the Job completes", lambda: any(c["type"] == "Complete" and c["status"] == "True"
                                          for c in (kube.get("batch/v1", "Job", ns, "j").get("status") or {}).get("conditions", [])))
    dep = kube.create({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": ns},
                       "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "d"}},
                                "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [
                                    {"name": "c", "image": TEST_PYTHON_IMAGE,
                                     "command": ["python", "-c", "import time; time.sleep(600)"]}]}}}})
    wait("2 available", lambda: (kube.get("apps/v1", "Deployment", ns, "d").get("status") or {}).get("availableReplicas") == 2)
    kube.delete("apps/v1", "Deployment", ns, "d")
    wait("the garbage collector removes the pods", lambda: not kube.list("v1", "Pod", ns, labels="app=d"), timeout=60)
    assert dep["metadata"]["uid"]


def test_kubectl_works_against_it(devcluster, crd):
    out = devcluster.kubectl("get", "nodes", "-o", "name").stdout.split()
    assert out == ["node/devcluster-gpu-1", "node/devcluster-node-1"]
    assert "specmodelpairs" in devcluster.kubectl("api-resources", "--api-group=specpair.io").stdout
