"""Nodes whose pods run as local processes: the part of a kubelet devcluster needs.

The agent registers a Node with real capacity (cpu, memory, pods and `nvidia.com/gpu` when
asked), renews its Lease, and runs the pods the real scheduler binds to it. It logs in as
`system:node:<name>` (group system:nodes), so the Node authorizer and the NodeRestriction
admission plugin hold it to what a kubelet may do: read the Secrets and ConfigMaps its pods
reference, request tokens for their ServiceAccounts, write its pods' status.

How a pod runs here, and where that differs from a kubelet with a container runtime:
- Images: only the project's own images (see `LocalImages`) exist on these nodes; their
  programs are this machine's `specpair` commands from the running virtualenv. Any other
  image answers ErrImagePull / ImagePullBackOff, as an image missing from a registry would.
- Network: each pod gets its own loopback address (127.<n>.x.y) as its pod IP, so two
  pods can listen on the same port. Each node claims its own n (20-249) for as long as it runs
  (a lock file), so clusters running side by side on one machine (the demo beside the tests,
  parallel test workers) never hand out the same address. Programs bind that address instead of 0.0.0.0 (the
  agent rewrites a literal 0.0.0.0 in the command line and in environment values, and gives `specpair engine serve` a
  `--host`). There is no kube-proxy: Service IPs do not route; clients use pod IPs.
- Volumes: emptyDir, configMap, secret, downwardAPI, projected (service-account tokens) and
  hostPath become folders under the pod's directory (hostPath: the real path), and every
  mount path found in the command line, in environment values or as workingDir is rewritten
  to its folder. A service-account mount also yields a kubeconfig in $KUBECONFIG holding the
  same projected token (programs read /var/run/secrets/... only inside containers). A
  persistentVolumeClaim is the folder of the PersistentVolume it is bound to, when that is a
  hostPath or local volume (a local cluster's kind), shared by every pod that mounts it; a
  read-only mount of it is bound read-only over itself in a mount namespace of the program's own
  (unshare), so the pod cannot write there while a pod that mounts it read-write can. Paths
  listed in `NodeSpec.preseeded` (the model cache) map to one folder shared by all pods, like
  a node image that ships them.
- Termination messages: the file at terminationMessagePath is a file under the pod's directory
  (the path is rewritten like a mount); what the program wrote there becomes the terminated
  state's message. A failed container that wrote nothing gets its log's tail instead.
- Volumes are materialised when a container starts; a Secret changed later is not projected
  into running pods (a kubelet updates it within a minute or so).
- Probes: startup, readiness and liveness (grpc, httpGet, tcpSocket, exec) with their delays,
  periods and thresholds; a failed liveness or startup probe restarts the container. Until a
  startup or readiness probe first succeeds, the node also looks every
  `NodeSpec.first_success_poll_seconds` between the probe's periods (a look that fails is not
  counted): a container is started and Ready about when it answers instead of up to a whole
  period later (10 s for the engines' startup probe), while failures still count once a period.
  `NodeSpec.settled_probe_period_seconds` (off by default) stretches the period of a readiness or
  liveness probe that has succeeded SETTLED_AFTER times in a row; its first failure brings the
  spec's period back, so failures still count towards the threshold as the spec says.
- Stopping: SIGTERM to the container's session, SIGKILL after the grace period to it and to
  every process the container made that left it (a session of its own, a parent that died): each
  carries the container's mark in its environment, and its descendants are looked up while its
  first process lives (container_processes.py), where a runtime kills the container's cgroup.
  When the node itself stops, it looks those up once for all its containers (one read of /proc,
  not two or three a container: a node of ~200 pods in a process of ~1,000 took minutes to stop,
  its threads taking turns on the interpreter), signals every pod's session, and kills what is
  left of them all in one sweep.
- Restarts follow restartPolicy with a doubling back-off (1 s to 60 s; a kubelet uses 10 s to
  5 min) shown as CrashLoopBackOff.
- Admission: a pod whose GPU requests exceed what the node has free is refused
  (OutOfnvidia.com/gpu), as a kubelet refuses it, even if a scheduler were to bind it.
- Resources are not enforced; containers run as this user (runAsUser is not applied).
- Process start: a container whose command is `python -m <module>` from the project's
  virtualenv is forked from the node's warm python, an interpreter that imported torch once
  (warm_python.py), where its environment agrees on what those imports read; it then runs as a
  fresh interpreter would, but does not tear its modules down at exit (atexit functions run).
  The Started event says so. Anything else starts as a new process.
"""

from __future__ import annotations

import base64
import datetime as dt
import fcntl
import functools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import container_processes
from .client import ApiError, Kube, resource_path
from .processes import tail
from .warm_python import WarmProcess, WarmPython

GPU = "nvidia.com/gpu"
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
LEASE_SECONDS = 40
HEARTBEAT_SECONDS = 10
# A node syncs its pods when a watch on them reports a change, and at least this often (a watch
# that broke and is being restarted misses nothing that way). Listing every half second instead
# kept the API servers of a test run busy answering the nodes.
SYNC_SECONDS = 2.0
WATCH_SECONDS = 30
# A running container's process is looked at for an exit at least this often by default, and
# its supervisor never sleeps less (NodeSpec.exit_poll_seconds, supervise_wait).
EXIT_POLL_SECONDS = 0.2
# Successes in a row after which a probe counts as settled (NodeSpec.settled_probe_period_seconds).
SETTLED_AFTER = 3


class WatchedPods:
    """A node's pods as its watch last reported them (an informer's store): `replace` with a
    list's answer, then `apply` each watch event from the list's resourceVersion on. `pods()` is
    None until the first list: a node that read nothing yet must not take "no pods" for "every
    pod deleted" (it would kill what runs). Written by the watch thread, read by the sync thread:
    entries are replaced, never edited, so a reader's pod dicts stay whole."""

    def __init__(self) -> None:
        self._pods: dict[str, dict[str, Any]] | None = None
        # Where the watch resumes; "" = list first (never listed, or the watch could not resume).
        self.version = ""
        self._lock = threading.Lock()

    def replace(self, listed: dict[str, Any]) -> None:
        with self._lock:
            self._pods = {p["metadata"]["uid"]: p for p in listed.get("items") or []}
            self.version = (listed.get("metadata") or {}).get("resourceVersion", "")

    def apply(self, event: dict[str, Any]) -> bool:
        """One watch event applied; False when the watch must list again (an ERROR event: 410
        Gone when the API server no longer holds the version it resumed from)."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            self.version = ""
            return False
        meta = obj.get("metadata") or {}
        with self._lock:
            if kind in ("ADDED", "MODIFIED", "DELETED") and self._pods is not None:
                if kind == "DELETED":
                    self._pods.pop(meta["uid"], None)
                else:
                    self._pods[meta["uid"]] = obj
            # A BOOKMARK carries only the version: the watch resumes from there.
            if meta.get("resourceVersion"):
                self.version = meta["resourceVersion"]
        return True

    def pods(self) -> list[dict[str, Any]] | None:
        with self._lock:
            return None if self._pods is None else list(self._pods.values())


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class NodeSpec:
    name: str = "devcluster-node-1"
    cpu: str = "2"
    memory: str = "16Gi"
    gpus: int = 0
    max_pods: int = 30
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)
    # Environment every local container starts with (the node image's environment).
    env: dict[str, str] = field(default_factory=dict)
    # mountPath -> host folder shared by every pod on the node (pre-seeded content).
    preseeded: dict[str, str] = field(default_factory=dict)
    # How often a startup or readiness probe that has not yet succeeded is also looked at,
    # between its periods (None: only at its periods, as a kubelet does).
    first_success_poll_seconds: float | None = 1.0
    # How often a running container's process is looked at for an exit between its probes: an
    # exit is noticed this late at most (a deletion at once). Each look wakes the pod's thread;
    # a node holding hundreds of idle pods (bench/operator_scale.py) looks less often.
    exit_poll_seconds: float = EXIT_POLL_SECONDS
    # gRPC probes keep their connection open between looks, per container and port, instead of
    # dialling each time as a kubelet does: a channel's set-up costs ~0.5 ms of CPU on each end,
    # and 1,000 engine pods are probed ~250 times a second. A connection is kept only after a
    # probe that succeeded on it; a failed probe drops it, so the next one dials afresh (a kept
    # channel that failed would wait out gRPC's reconnect back-off, up to minutes).
    probe_connections_kept: bool = False
    # How often the node lists its pods when no watch event woke it (SYNC_SECONDS): the backstop
    # for a watch that broke. A list of 250 pods is MBs for the API server to write and the node
    # to parse; a node of hundreds of idle pods (bench/operator_scale.py) may list less often.
    sync_seconds: float = SYNC_SECONDS
    # The node keeps its pods as its watch reports them (WatchedPods: listed once, then each
    # event applied, as a kubelet's informer does) instead of listing them whenever the watch
    # wakes it: while pods change, a node of 250 pods listed them (MBs of JSON, both ends) at
    # every event (bench/operator_scale.py, 2026-12-07e: its node agents were the largest part
    # of bringing 546 pairs up). Listed again only when the watch cannot resume (410 Gone, an
    # error). Default off: every wake-up lists, as before.
    pods_from_watch: bool = False
    # A readiness or liveness probe that has succeeded SETTLED_AFTER times in a row is looked at
    # every max(its period, this) until it fails once (then at its period again): None, as a
    # kubelet does, at its period always. A node of hundreds of idle stand-in engines
    # (bench/operator_scale.py) otherwise spends most of a core on their probes (~960 pods:
    # ~240 gRPC Checks a second, 0.71 core on both ends, 2026-12-07f); what the pods report while
    # they keep answering (Ready) is the same.
    settled_probe_period_seconds: float | None = None


@dataclass
class LocalImage:
    """An image as this machine runs it: its ENTRYPOINT/CMD, its ENV, and where its programs are.

    `programs` maps the first word of a command to the local argv prefix that runs it (the
    image's filesystem, in effect).
    """
    entrypoint: list[str]
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    programs: dict[str, list[str]] = field(default_factory=dict)


def project_programs(python: str = sys.executable) -> dict[str, list[str]]:
    """The project's commands from this virtualenv, as the project's images install them."""
    return {"python": [python], "python3": [python], "specpair": [python, "-m", "specpair"],
            "specpair-operator": [python, "-m", "specpair_operator"], "kopf": [python, "-m", "kopf"]}


class LocalImages:
    """Which images exist on the nodes. An image is found when its repository ends with a known
    name (any registry, any tag): `registry.example.com/team/specpair/engine:1.2` runs the local
    engine, as a mirror of the same image would."""

    def __init__(self, images: dict[str, LocalImage] | None = None, python: str = sys.executable):
        programs = project_programs(python)
        self.python = python
        self.images: dict[str, LocalImage] = {
            # From deploy/*.Dockerfile: ENTRYPOINT + CMD.
            "specpair/engine": LocalImage(["specpair"], ["engine", "serve", "--insecure", "--port", "50051",
                                                         "--metrics-port", "9400"], programs=programs),
            "specpair/operator": LocalImage(["python", "-m", "specpair_operator"],
                                            ["--liveness=http://0.0.0.0:8080/healthz"], programs=programs),
            **(images or {}),
        }

    @property
    def entrypoints(self) -> list[str]:
        return list(self.images)

    @staticmethod
    def repository_of(image: str) -> str:
        name = image.split("@", 1)[0]
        if ":" in name.rsplit("/", 1)[-1]:
            name = name[: name.rfind(":")]
        return name

    def find(self, image: str) -> LocalImage | None:
        repo = self.repository_of(image)
        for suffix, entry in self.images.items():
            if repo == suffix or repo.endswith("/" + suffix):
                return entry
        return None

    def argv(self, container: dict[str, Any], rewrite=lambda a: a) -> list[str] | None:
        """The local command line; `rewrite` maps the pod's own words (mount paths, addresses),
        not the host paths of the programs that run them."""
        image = self.find(container.get("image", ""))
        if image is None:
            return None
        command = list(container.get("command") or image.entrypoint)
        if "args" in container:
            args = list(container["args"])
        else:
            args = [] if container.get("command") else list(image.cmd)
        argv = [rewrite(a) for a in command + args]
        prefix = image.programs.get(argv[0])
        return [*prefix, *argv[1:]] if prefix else argv


def gpu_request(pod: dict[str, Any]) -> int:
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        total += int((res.get("limits") or {}).get(GPU, (res.get("requests") or {}).get(GPU, 0)) or 0)
    return total


class ContainerError(Exception):
    """A container cannot be created yet: (reason, message) as the kubelet reports them."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


class NodeAgent:
    def __init__(self, kube: Kube, spec: NodeSpec, index: int, workdir: Path, api_server: str, ca_file: str,
                 images: LocalImages | None = None):
        self.kube, self.spec, self.index = kube, spec, index
        self.workdir = workdir / "nodes" / spec.name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.api_server, self.ca_file = api_server, ca_file
        self.images = images or LocalImages()
        self.pods: dict[str, PodWorker] = {}        # uid -> worker
        # Pods whose worker finished (ended or deleted), while their objects are still seen: a
        # kubelet never starts a pod twice, and a pod read before its worker's last status (a
        # watch event not yet applied, a list that raced) must not be admitted again.
        self.ended: set[str] = set()
        self.watched = WatchedPods() if spec.pods_from_watch else None
        self.next_ip = 2
        self.network, self._network_lock = claim_pod_network()
        self.stopping = threading.Event()
        self.pods_changed = threading.Event()
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []
        # Every process of this node's containers carries `container_processes.MARK=<mark>/<pod
        # uid>/<container>` in its environment: what is killed when the container stops, wherever
        # it went (nodes of clusters side by side share names, so a random part).
        self.mark = uuid.uuid4().hex[:12]
        # Forks `python -m` containers from an interpreter that imported torch once (warm_python.py);
        # its environment is what a pod's would be, less the pod's own names and folders.
        self.warm_python = WarmPython(self.images.python,
                                      {**self._base_env(), "HOME": str(self.workdir), **spec.env},
                                      self.workdir / "warm-python.log")

    # -- node --------------------------------------------------------------------------------

    def register(self) -> None:
        labels = {"kubernetes.io/hostname": self.spec.name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", "node.specpair.io/devcluster": "true", **self.spec.labels}
        if self.spec.gpus:
            labels.setdefault("nvidia.com/gpu.present", "true")
        capacity = {"cpu": self.spec.cpu, "memory": self.spec.memory, "pods": str(self.spec.max_pods),
                    "ephemeral-storage": "50Gi"}
        if self.spec.gpus:
            capacity[GPU] = str(self.spec.gpus)
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.spec.name, "labels": labels},
                "spec": {"taints": self.spec.taints} if self.spec.taints else {}}
        try:
            self.kube.create(node)
        except ApiError as exc:
            if exc.status != 409:
                raise
        self.kube.patch("v1", "Node", None, self.spec.name,
                        {"status": {"capacity": capacity, "allocatable": capacity, **self._node_conditions(),
                                    "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                                                  {"type": "Hostname", "address": self.spec.name}],
                                    "nodeInfo": {"kubeletVersion": "v1.37.2-devcluster", "operatingSystem": "linux",
                                                 "architecture": "amd64", "containerRuntimeVersion": "local-process://1",
                                                 "kernelVersion": os.uname().release, "osImage": "devcluster",
                                                 "kubeProxyVersion": "", "machineID": "", "systemUUID": "",
                                                 "bootID": ""}}},
                        subresource="status")
        self._renew_lease()

    def _base_env(self) -> dict[str, str]:
        """What every container's environment starts from, before the pod's own names."""
        return {"PATH": f"{Path(self.images.python).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                "LANG": "C.UTF-8"}

    def _node_conditions(self) -> dict[str, Any]:
        t = now_iso()

        def cond(type_: str, status: str, reason: str, message: str) -> dict[str, str]:
            return {"type": type_, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": t, "lastTransitionTime": t}
        return {"conditions": [
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "devcluster node"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "devcluster node"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID", "devcluster node"),
            cond("Ready", "True", "KubeletReady", "devcluster node agent is running pods as local processes")]}

    def _renew_lease(self) -> None:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.spec.name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": self.spec.name, "leaseDurationSeconds": LEASE_SECONDS,
                         "renewTime": now_micro()}}
        try:
            self.kube.patch("coordination.k8s.io/v1", "leases", "kube-node-lease", self.spec.name,
                            {"spec": body["spec"]})
        except ApiError as exc:
            if exc.status != 404:
                raise
            self.kube.create(body)

    def _heartbeat_loop(self) -> None:
        last_status = time.monotonic()
        while not self.stopping.wait(HEARTBEAT_SECONDS):
            try:
                self._renew_lease()
                if time.monotonic() - last_status > 60:
                    self.kube.patch("v1", "Node", None, self.spec.name, {"status": self._node_conditions()},
                                    subresource="status")
                    last_status = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the API server may be restarting; try again
                self.errors.append(f"heartbeat: {exc}")

    # -- pods --------------------------------------------------------------------------------

    def start(self) -> None:
        self.register()
        for target in (self._heartbeat_loop, self._sync_loop):
            t = threading.Thread(target=target, name=f"{self.spec.name}-{target.__name__}", daemon=True)
            t.start()
            self.threads.append(t)
        # Not joined on stop: it may be inside a read the API server ends only at WATCH_SECONDS;
        # it ends by itself once stopping is set (or with the process: a daemon thread).
        threading.Thread(target=self._watch_loop, name=f"{self.spec.name}-watch", daemon=True).start()

    def _sync_loop(self) -> None:
        while not self.stopping.is_set():
            self.pods_changed.clear()
            try:
                self.sync()
            except Exception as exc:  # noqa: BLE001 - keep the node alive; report on stop
                self.errors.append(f"sync: {type(exc).__name__}: {exc}")
            self.pods_changed.wait(self.spec.sync_seconds)

    def _watch_loop(self) -> None:
        """Wake the sync loop whenever a pod of this node changes, as a kubelet's watch does; with
        `pods_from_watch`, also keep `self.watched` (list once, then resume the watch from the
        version reached; list again when it cannot). Its own client: a requests session is not
        shared between threads."""
        kube = Kube(self.kube.creds)
        fields = f"spec.nodeName={self.spec.name}"
        watched = self.watched
        try:
            while not self.stopping.is_set():
                try:
                    if watched is not None and not watched.version:
                        watched.replace(kube.request("GET", resource_path("v1", "Pod"),
                                                     params={"fieldSelector": fields}))
                        self.pods_changed.set()
                    for event in kube.watch("v1", "Pod", None, fields=fields, timeout_seconds=WATCH_SECONDS,
                                            resource_version=watched.version if watched is not None else ""):
                        if self.stopping.is_set():
                            return
                        if watched is not None and not watched.apply(event):
                            break
                        if event.get("type") != "BOOKMARK":
                            self.pods_changed.set()
                except Exception:  # noqa: BLE001 - restarting, or gone; the periodic sync covers it
                    if watched is not None:
                        watched.version = ""     # resume from a fresh list: events may be lost
                    self.stopping.wait(1.0)
        finally:
            kube.close()

    def sync(self) -> None:
        # Workers whose pod has stopped (and, when deleted, is gone) hold nothing any more. Let go
        # of them before listing: a worker that finished after the list was read left its deleted
        # pod in it, and the pod was admitted again, holding its GPU until it stopped a second
        # time (the next GPU pod bound here failed OutOfnvidia.com/gpu, a CI failure).
        for uid in [u for u, w in self.pods.items() if w.finished]:
            self.pods.pop(uid)
            self.ended.add(uid)
        if self.watched is not None:
            pods = self.watched.pods()
            if pods is None:
                return      # not listed yet: nothing known, nothing to start or stop
        else:
            pods = self.kube.list("v1", "Pod", None, fields=f"spec.nodeName={self.spec.name}")
        seen = set()
        for pod in pods:
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            worker = self.pods.get(uid)
            if worker is None:
                # Nothing of it runs here: a pod being deleted is not started again (a kubelet
                # does not start one either), and one that ended is only let go.
                if pod["metadata"].get("deletionTimestamp"):
                    self._finalise_deletion(pod)
                    continue
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") or uid in self.ended:
                    continue
                worker = self._admit(pod)
                if worker is None:
                    continue
                self.pods[uid] = worker
                worker.start()
            worker.observe(pod)
        for uid in list(self.pods):
            if uid not in seen:
                # Deleted without a grace period (force delete): stop at once.
                self.pods.pop(uid).kill_now()
            elif self.pods[uid].finished:
                self.pods.pop(uid)
                self.ended.add(uid)
        self.ended &= seen      # the pods gone from the API are gone for good

    def _admit(self, pod: dict[str, Any]) -> PodWorker | None:
        want = gpu_request(pod)
        if want:
            in_use = sum(gpu_request(w.pod) for w in self.pods.values() if not (w.terminal or w.stopped))
            if in_use + want > self.spec.gpus:
                msg = (f"Node didn't have enough resource: {GPU}, requested: {want}, used: {in_use}, "
                       f"capacity: {self.spec.gpus}")
                self._patch_status(pod, {"phase": "Failed", "reason": f"OutOf{GPU}", "message": msg})
                self._event(pod, "Warning", "UnexpectedAdmissionError", msg)
                return None
        with self.lock:
            n = self.next_ip
            self.next_ip += 1
        ip = f"127.{self.network}.{n // 250}.{n % 250 + 2}"
        return PodWorker(self, pod, ip)

    def _finalise_deletion(self, pod: dict[str, Any]) -> None:
        try:
            self.kube.delete("v1", "Pod", pod["metadata"]["namespace"], pod["metadata"]["name"], grace_seconds=0,
                             uid=pod["metadata"]["uid"])
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

    def _patch_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        try:
            self.kube.patch("v1", "Pod", pod["metadata"]["namespace"], pod["metadata"]["name"], {"status": status},
                            subresource="status")
        except ApiError as exc:
            if exc.status != 404:
                raise

    def _event(self, pod: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        try:
            self.kube.create({"apiVersion": "v1", "kind": "Event",
                              "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                              "involvedObject": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                                                 "namespace": meta["namespace"], "uid": meta["uid"]},
                              "type": type_, "reason": reason, "message": message[:1000],
                              "source": {"component": "kubelet", "host": self.spec.name},
                              "firstTimestamp": now_iso(), "lastTimestamp": now_iso(), "count": 1,
                              "reportingComponent": "kubelet", "reportingInstance": self.spec.name})
        except ApiError:
            pass  # an event is best effort, as in the kubelet

    def stop(self) -> None:
        workers = list(self.pods.values())
        # Every container's descendants in one look at /proc, while their first processes live
        # (a process forked without exec from a warm-forked container carries no mark); the
        # workers, seeing `stopping`, only signal their sessions, and the sweep below kills the
        # rest of them all at once.
        below = container_processes.descendants_of(
            [proc.pid for w in workers for proc in list(w.procs.values()) if proc.poll() is None])
        self.stopping.set()
        self.pods_changed.set()
        for w in workers:
            w.shutdown()
        for w in workers:
            w.join(30)
        for t in self.threads:
            t.join(15)
        # Whatever a worker did not stop (one still joining) goes with the node, as a kubelet's
        # containers' cgroups outlive it only while their runtime keeps them.
        left = container_processes.kill_all(self.mark + "/", below, prefix=True)
        if left:
            self.errors.append(f"processes of this node's containers survived SIGKILL: {left}")
        self.warm_python.stop()
        self._network_lock.close()


def claim_pod_network() -> tuple[int, Any]:
    """The second octet of a free 127.<n>.0.0/16 for one node's pods, and the open lock file that
    holds it (closed by the node's stop, or by the kernel when the process dies)."""
    folder = Path(tempfile.gettempdir()) / "specpair-devcluster-pod-networks"
    folder.mkdir(exist_ok=True)
    for octet in range(20, 250):
        lock = open(folder / f"127.{octet}.lock", "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return octet, lock
    raise RuntimeError(f"every pod network 127.20-249 is claimed by a running node (lock files in {folder})")


class Probe:
    """One probe's schedule and thresholds (Kubernetes' defaults where the spec is silent)."""

    def __init__(self, spec: dict[str, Any] | None, kind: str, settled_period: float | None = None):
        self.spec, self.kind, self.settled_period = spec, kind, settled_period
        spec = spec or {}
        self.initial = float(spec.get("initialDelaySeconds", 0))
        self.period = float(spec.get("periodSeconds", 10))
        self.timeout = float(spec.get("timeoutSeconds", 1))
        self.failure_threshold = int(spec.get("failureThreshold", 3))
        self.success_threshold = int(spec.get("successThreshold", 1))
        self.next_at = 0.0
        self.look_at = 0.0
        self.failures = 0
        self.successes = 0
        self.succeeded = False

    def due(self, now: float, poll: float | None) -> bool | None:
        """True: a probe counted at its period; False: an uncounted look between periods (before
        the probe's first success); None: nothing to do now."""
        if now >= self.next_at:
            settled = self.settled_period is not None and self.successes >= SETTLED_AFTER
            self.next_at = now + (max(self.period, self.settled_period) if settled else self.period)
            self.look_at = now + (poll or 0)
            return True
        if poll is not None and not self.succeeded and now >= self.look_at:
            self.look_at = now + poll
            return False
        return None

    def record(self, ok: bool, counted: bool = True) -> None:
        """Count a look's outcome; a failure counts towards failureThreshold only when `counted`
        (a look between periods before the first success is not)."""
        if ok:
            self.successes += 1
            self.failures = 0
            self.succeeded = True
        elif counted:
            self.failures += 1
            self.successes = 0

    def next_look(self, poll: float | None) -> float:
        """When `due` next has something to do (with the same `poll`)."""
        return min(self.next_at, self.look_at) if poll is not None and not self.succeeded else self.next_at


def supervise_wait(now: float, started: bool, startup: Probe, readiness: Probe, liveness: Probe,
                   poll: float | None, exit_poll: float) -> float:
    """How long a running container's supervisor sleeps before its next look: until the next
    probe is due (as PodWorker._supervise asks them) or the next look for an exit, whichever
    comes first, but never less than EXIT_POLL_SECONDS (or `exit_poll`, if less), so that at the
    default `exit_poll` every sleep is EXIT_POLL_SECONDS (0.2 s), as it always was."""
    if not started:
        due = startup.next_look(poll)
    else:
        due = readiness.next_look(poll if readiness.spec is not None else None)
        if liveness.spec is not None:
            due = min(due, liveness.next_look(None))
    return max(min(exit_poll, EXIT_POLL_SECONDS), min(exit_poll, due - now))


class PodWorker:
    """Runs one pod: volumes, environment, its containers' processes, probes and status."""

    def __init__(self, agent: NodeAgent, pod: dict[str, Any], ip: str):
        self.agent, self.pod, self.ip = agent, pod, ip
        meta = pod["metadata"]
        self.key = f"{meta['namespace']}_{meta['name']}"
        self.dir = agent.workdir / "pods" / f"{self.key}_{meta['uid'][:8]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.deleting = threading.Event()
        self.killed = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.key}", daemon=True)
        self.terminal = False
        self.stopped = False    # its processes are gone: it holds no GPU, even before its pod object is
        self.finished = False
        self.started_at = now_iso()
        self.containers: dict[str, dict[str, Any]] = {}   # name -> status fields
        self.ready: dict[str, bool] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.last_status: dict[str, Any] | None = None
        # container name -> {(address, port): gRPC channel} kept between probes
        # (NodeSpec.probe_connections_kept), closed when that container's process stops.
        self.probe_channels: dict[str, dict[tuple[str, int], Any]] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def observe(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.deleting.set()

    def shutdown(self) -> None:
        """The node stops: stop the processes, leave the pod objects as they are."""
        self.killed.set()
        self.deleting.set()

    def kill_now(self) -> None:
        self.killed.set()
        self.deleting.set()

    def _grace(self) -> float:
        meta, spec = self.pod["metadata"], self.pod.get("spec") or {}
        grace = meta.get("deletionGracePeriodSeconds", spec.get("terminationGracePeriodSeconds", 30))
        return float(0 if self.killed.is_set() else min(float(grace), 30.0))

    def _run(self) -> None:
        try:
            self._run_pod()
        except Exception as exc:  # noqa: BLE001 - report on the pod, keep the node alive
            self.agent.errors.append(f"pod {self.key}: {type(exc).__name__}: {exc}")
            self.agent._event(self.pod, "Warning", "Failed", f"devcluster node: {exc}")
        finally:
            for name, proc in self.procs.items():
                self._stop(name, proc, 0)
            # Before the pod object goes: once it is gone a Recreate rollout's next pod may be bound
            # here and admitted at once (the watch wakes the sync), and must find the GPU free.
            self.stopped = True
            if self.deleting.is_set() and not (self.agent.stopping.is_set() or self.killed.is_set()):
                self.agent._finalise_deletion(self.pod)
            self.finished = True

    def _run_pod(self) -> None:
        spec = self.pod["spec"]
        if spec.get("initContainers"):
            self._fail_pod("InitContainersUnsupported", "devcluster nodes do not run init containers")
            return
        policy = spec.get("restartPolicy", "Always")
        containers = spec["containers"]
        self.containers = {c["name"]: {"restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}
                           for c in containers}
        self.ready = {c["name"]: False for c in containers}
        self._push_status()
        runners = [threading.Thread(target=self._run_container, args=(c, policy), daemon=True,
                                    name=f"{self.key}-{c['name']}") for c in containers]
        for r in runners:
            r.start()
        for r in runners:
            r.join()
        if not self.deleting.is_set():
            exits = [((self.containers[c["name"]].get("state") or {}).get("terminated") or {}).get("exitCode", 1)
                     for c in containers]
            phase = "Succeeded" if all(code == 0 for code in exits) else "Failed"
            self.terminal = True
            self._push_status(phase=phase)
        else:
            self._push_status()

    def _fail_pod(self, reason: str, message: str) -> None:
        self.terminal = True
        self.agent._patch_status(self.pod, {"phase": "Failed", "reason": reason, "message": message})
        self.agent._event(self.pod, "Warning", reason, message)

    # -- one container -------------------------------------------------------------------------

    def _run_container(self, container: dict[str, Any], policy: str) -> None:
        name = container["name"]
        status = self.containers[name]
        backoff = 1.0
        while not self.deleting.is_set():
            try:
                try:
                    argv, env, cwd = self._prepare(container)
                except ApiError as exc:
                    # A Secret or ConfigMap it mounts cannot be read (yet, or any more: the Node
                    # authorizer refuses once the pod is gone): the kubelet's status, not a crash.
                    raise ContainerError("CreateContainerConfigError", str(exc)) from exc
            except ContainerError as exc:
                status["state"] = {"waiting": {"reason": exc.reason, "message": exc.message}}
                self._push_status()
                if self.deleting.wait(min(backoff, 10)):
                    return
                backoff = min(backoff * 2, 60)
                continue
            log = self.dir / f"{name}.log"
            with open(log, "ab") as out:
                out.write(f"--- {now_iso()} starting: {shlex.join(argv)}\n".encode())
                out.flush()
            env = {**env, container_processes.MARK: self._mark(name)}
            proc = self.agent.warm_python.spawn(argv, env, cwd, log)
            if proc is None:
                with open(log, "ab") as out:
                    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, cwd=cwd, start_new_session=True)
            self.procs[name] = proc
            started = now_iso()
            status["state"] = {"running": {"startedAt": started}}
            status["started"] = container.get("startupProbe") is None
            self.ready[name] = False
            self._push_status()
            warm = ", forked from the node's warm python" if isinstance(proc, WarmProcess) else ""
            self.agent._event(self.pod, "Normal", "Started", f"Started container {name} (pid {proc.pid}){warm}")
            try:
                reason = self._supervise(container, proc)
            finally:
                for channel in self.probe_channels.pop(name, {}).values():
                    channel.close()
            code = self._stop(name, proc, self._grace() if reason else 0)
            self.ready[name] = False
            if code is None:
                code = 137
            status["lastState"] = {}
            written = self._termination_file(container).read_bytes()[:4096].decode(errors="replace") \
                if self._termination_file(container).exists() else ""
            status["state"] = {"terminated": {"exitCode": code, "startedAt": started, "finishedAt": now_iso(),
                                              "reason": "Completed" if code == 0 else ("Error" if not reason else reason),
                                              # the file's content; a failure without one, the log's tail
                                              "message": written or (tail(log, 400).strip()[-400:] if code else "")}}
            self._push_status()
            if self.deleting.is_set():
                return
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                return
            status["restartCount"] += 1
            status["lastState"] = {"terminated": status["state"]["terminated"]}
            status["state"] = {"waiting": {"reason": "CrashLoopBackOff",
                                           "message": f"back-off {backoff:.0f}s restarting failed container={name}"}}
            self._push_status()
            self.agent._event(self.pod, "Warning", "BackOff", f"Back-off restarting container {name} (exit {code})")
            if self.deleting.wait(backoff):
                return
            backoff = min(backoff * 2, 60)

    def _mark(self, name: str) -> str:
        """The value of container_processes.MARK in container `name`'s processes."""
        return f"{self.agent.mark}/{self.pod['metadata']['uid']}/{name}"

    def _stop(self, name: str, proc: subprocess.Popen, grace: float) -> int | None:
        """Stop container `name` whose first process is `proc` (see _stop_process), and every
        process it made: as a runtime kills the container's cgroup, nothing of it outlives it.
        While the node stops, only its session is signalled here: the node's stop sweeps the
        rest of every container's processes at once (NodeAgent.stop)."""
        code, left = _stop_process(proc, grace, self._mark(name), sweep=not self.agent.stopping.is_set())
        if left:
            self.agent.errors.append(f"pod {self.key}: processes of container {name} survived SIGKILL: {left}")
        return code

    def _supervise(self, container: dict[str, Any], proc: subprocess.Popen) -> str | None:
        """Run probes until the process exits (None) or a probe / deletion stops it (a reason)."""
        name = container["name"]
        t0 = time.monotonic()
        startup = Probe(container.get("startupProbe"), "startup")
        settled = self.agent.spec.settled_probe_period_seconds
        readiness = Probe(container.get("readinessProbe"), "readiness", settled)
        liveness = Probe(container.get("livenessProbe"), "liveness", settled)
        started = startup.spec is None
        poll = self.agent.spec.first_success_poll_seconds
        for p in (startup, readiness, liveness):
            p.next_at = p.look_at = t0 + p.initial
        while proc.poll() is None:
            wait = supervise_wait(time.monotonic(), started, startup, readiness, liveness, poll,
                                  self.agent.spec.exit_poll_seconds)
            if self.deleting.wait(wait):
                return "Killing"
            now = time.monotonic()
            if not started:
                counted = startup.due(now, poll)
                if counted is not None:
                    if self._probe(container, startup, counted):
                        started = True
                        self.containers[name]["started"] = True
                        readiness.next_at = readiness.look_at = liveness.next_at = now
                        self._push_status()
                    elif startup.failures >= startup.failure_threshold:
                        self.agent._event(self.pod, "Warning", "Unhealthy", f"Startup probe failed {startup.failures} times")
                        return "StartupProbeFailed"
                continue
            counted = readiness.due(now, poll if readiness.spec is not None else None)
            if counted is not None:
                if readiness.spec is None:
                    ok = True
                else:
                    self._probe(container, readiness, counted)
                    ok = self.ready[name]
                    if readiness.successes >= readiness.success_threshold:
                        ok = True
                    elif readiness.failures >= readiness.failure_threshold:
                        ok = False
                if ok != self.ready[name]:
                    self.ready[name] = ok
                    self._push_status()
            if liveness.spec is not None and liveness.due(now, None):
                if not self._probe(container, liveness) and liveness.failures >= liveness.failure_threshold:
                    self.agent._event(self.pod, "Warning", "Unhealthy",
                                      f"Liveness probe failed {liveness.failures} times; restarting")
                    return "LivenessProbeFailed"
        return None

    def _probe(self, container: dict[str, Any], probe: Probe, counted: bool = True) -> bool:
        """Run the probe; a failure counts towards its failureThreshold only when `counted`."""
        channels = self.probe_channels.setdefault(container["name"], {}) \
            if self.agent.spec.probe_connections_kept else None
        ok = run_probe(probe.spec or {}, self.ip, container, probe.timeout, self._env_cache, channels)
        probe.record(ok, counted)
        return ok

    # -- the pod's view of the world -------------------------------------------------------------

    _env_cache: dict[str, str] = {}

    def _prepare(self, container: dict[str, Any]) -> tuple[list[str], dict[str, str], str | None]:
        if self.agent.images.find(container.get("image", "")) is None:
            raise ContainerError("ErrImagePull", f"image {container.get('image')!r} is not available on "
                                 f"{self.agent.spec.name}: devcluster nodes hold only the project's own images "
                                 f"({', '.join(self.agent.images.entrypoints)})")
        mounts, read_only = self._volumes(container)
        # The termination message file, as the kubelet provides it: empty at each start, read
        # into the terminated state's message when the container exits.
        termination = self._termination_file(container)
        termination.write_bytes(b"")
        mounts[container.get("terminationMessagePath") or "/dev/termination-log"] = str(termination)
        env = self._environment(container, mounts)
        self._env_cache = env
        rewrite = _path_rewriter(mounts)
        argv = self.agent.images.argv(container, lambda a: rewrite(a).replace("0.0.0.0", self.ip))
        if "engine" in argv and "serve" in argv and "--host" not in argv:
            argv += ["--host", self.ip]
        if read_only:
            argv = self._read_only_view(argv, read_only)
        cwd = rewrite(container["workingDir"]) if container.get("workingDir") else str(self.dir)
        return argv, env, cwd

    def _read_only_view(self, argv: list[str], folders: set[str]) -> list[str]:
        """argv in a mount namespace of its own where each read-only claim's folder is bound
        read-only over itself: the program cannot write there, while other pods (a Job
        filling the volume) still can."""
        wrapper = read_only_wrapper()
        if wrapper is None:
            self.agent._event(self.pod, "Warning", "ReadOnlyNotEnforced",
                              "this machine cannot make mount namespaces (unshare); read-only volumes are writable")
            return argv
        binds = " && ".join(f"mount --bind -o ro {shlex.quote(p)} {shlex.quote(p)}" for p in sorted(folders))
        return [*wrapper, "sh", "-c", f'{binds} && exec "$@"', "sh", *argv]

    def _termination_file(self, container: dict[str, Any]) -> Path:
        return self.dir / f"{container['name']}.termination-log"

    def _volumes(self, container: dict[str, Any]) -> tuple[dict[str, str], set[str]]:
        """mountPath -> host folder for this container's mounts, materialising each volume, and
        the host folders it may only read (its read-only claims)."""
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        out: dict[str, str] = {}
        read_only: set[str] = set()
        for m in container.get("volumeMounts") or []:
            path = m["mountPath"]
            if path in self.agent.spec.preseeded:
                out[path] = self.agent.spec.preseeded[path]
                Path(out[path]).mkdir(parents=True, exist_ok=True)
                continue
            vol = volumes.get(m["name"])
            if vol is None:
                raise ContainerError("CreateContainerConfigError", f"volume {m['name']!r} is not defined in the pod")
            host = self.dir / "volumes" / m["name"]
            host.mkdir(parents=True, exist_ok=True)
            if "hostPath" in vol:
                out[path] = vol["hostPath"]["path"]
                continue
            if "persistentVolumeClaim" in vol:
                out[path] = self._claim_folder(vol, m)
                if m.get("readOnly") or vol["persistentVolumeClaim"].get("readOnly"):
                    read_only.add(out[path])
                continue
            files = self._volume_files(vol)
            for rel, data in files.items():
                target = host / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            base = host / m["subPath"] if m.get("subPath") else host
            out[path] = str(base)
        return out, read_only

    def _claim_folder(self, vol: dict[str, Any], mount: dict[str, Any]) -> str:
        """The folder of the PersistentVolume a claim is bound to: its hostPath or local path (what
        a local cluster's volumes are), as a kubelet reads claim and volume (the Node authorizer
        lets a node read those its pods use)."""
        claim_name = vol["persistentVolumeClaim"]["claimName"]
        ns = self.pod["metadata"]["namespace"]
        claim = self.agent.kube.get("v1", "PersistentVolumeClaim", ns, claim_name)
        if claim is None:
            raise ContainerError("CreateContainerConfigError", f'persistentvolumeclaim "{claim_name}" not found')
        volume_name = (claim.get("spec") or {}).get("volumeName")
        if (claim.get("status") or {}).get("phase") != "Bound" or not volume_name:
            raise ContainerError("CreateContainerConfigError",
                                 f'persistentvolumeclaim "{claim_name}" is not bound to a volume yet')
        pv = self.agent.kube.get("v1", "PersistentVolume", None, volume_name) or {}
        source = (pv.get("spec") or {}).get("hostPath") or (pv.get("spec") or {}).get("local")
        if not source or not source.get("path"):
            raise ContainerError("CreateContainerConfigError",
                                 f'volume {mount["name"]!r}: persistentvolume "{volume_name}" is neither hostPath '
                                 f"nor local; devcluster nodes mount only those")
        folder = Path(source["path"])
        if "hostPath" in pv["spec"] and pv["spec"]["hostPath"].get("type") in (None, "", "DirectoryOrCreate"):
            folder.mkdir(parents=True, exist_ok=True)
        if not folder.is_dir():
            raise ContainerError("CreateContainerConfigError",
                                 f'persistentvolume "{volume_name}": {folder} is not a directory on this node')
        return str(folder / mount["subPath"]) if mount.get("subPath") else str(folder)

    def _volume_files(self, vol: dict[str, Any]) -> dict[str, bytes]:
        meta = self.pod["metadata"]
        ns = meta["namespace"]
        if "emptyDir" in vol:
            return {}
        if "downwardAPI" in vol:
            return {i["path"]: self._field(i["fieldRef"]["fieldPath"]).encode() for i in vol["downwardAPI"]["items"]
                    if "fieldRef" in i}
        if "configMap" in vol:
            return self._keyed_files("ConfigMap", vol["configMap"], ns)
        if "secret" in vol:
            src = dict(vol["secret"])
            src["name"] = src.pop("secretName", src.get("name"))
            return self._keyed_files("Secret", src, ns)
        if "projected" in vol:
            out: dict[str, bytes] = {}
            for source in vol["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    tok = source["serviceAccountToken"]
                    out[tok.get("path", "token")] = self._token(tok).encode()
                elif "configMap" in source:
                    out.update(self._keyed_files("ConfigMap", source["configMap"], ns))
                elif "secret" in source:
                    out.update(self._keyed_files("Secret", source["secret"], ns))
                elif "downwardAPI" in source:
                    out.update({i["path"]: self._field(i["fieldRef"]["fieldPath"]).encode()
                                for i in source["downwardAPI"]["items"] if "fieldRef" in i})
            return out
        raise ContainerError("CreateContainerConfigError",
                             f"volume {vol['name']!r}: this kind of volume is not supported on devcluster nodes")

    def _keyed_files(self, kind: str, src: dict[str, Any], ns: str) -> dict[str, bytes]:
        obj = self.agent.kube.get("v1", kind, ns, src["name"])
        if obj is None:
            if src.get("optional"):
                return {}
            raise ContainerError("CreateContainerConfigError", f"{kind.lower()} {src['name']!r} not found")
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()} if kind == "ConfigMap" else \
            {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        if src.get("items"):
            return {i["path"]: data[i["key"]] for i in src["items"] if i["key"] in data}
        return data

    def _token(self, tok: dict[str, Any]) -> str:
        meta = self.pod["metadata"]
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
               "spec": {"audiences": [tok["audience"]] if tok.get("audience") else None,
                        "expirationSeconds": int(tok.get("expirationSeconds", 3607)),
                        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}}
        if req["spec"]["audiences"] is None:
            del req["spec"]["audiences"]
        try:
            got = self.agent.kube.request(
                "POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token", body=req)
        except ApiError as exc:
            raise ContainerError("CreateContainerConfigError", f"service account token for {sa}: {exc}") from exc
        return got["status"]["token"]

    def _field(self, path: str) -> str:
        meta, spec = self.pod["metadata"], self.pod.get("spec") or {}
        simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
                  "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName": spec.get("serviceAccountName", ""),
                  "status.podIP": self.ip, "status.hostIP": "127.0.0.1", "status.podIPs": self.ip}
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        if path in ("metadata.annotations", "metadata.labels"):
            items = meta.get(path.split(".")[1]) or {}
            return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
        raise ContainerError("CreateContainerConfigError", f"unsupported fieldRef {path!r}")

    def _environment(self, container: dict[str, Any], mounts: dict[str, str]) -> dict[str, str]:
        ns = self.pod["metadata"]["namespace"]
        api = self.agent.api_server.split("://", 1)[1]
        host, port = api.rsplit(":", 1)
        env: dict[str, str] = {
            **self.agent._base_env(),
            "HOSTNAME": self.pod["metadata"]["name"], "HOME": str(self.dir / "home"),
            # No kube-proxy here: the in-cluster API address is the API server itself.
            "KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port, "POD_IP": self.ip,
            **self.agent.spec.env,
        }
        image = self.agent.images.find(container.get("image", ""))
        if image is not None:
            env.update(image.env)
        (self.dir / "home").mkdir(exist_ok=True)
        for src in container.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in src:
                    data = self._keyed_files(kind, {"name": src[key]["name"], "optional": src[key].get("optional")}, ns)
                    env.update({prefix + k: v.decode() for k, v in data.items()})
        rewrite = _path_rewriter(mounts)
        for item in container.get("env") or []:
            name = item["name"]
            if "value" in item:
                env[name] = rewrite(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                           lambda m: env.get(m.group(1), m.group(0)), item["value"])
                                    ).replace("0.0.0.0", self.ip)
                continue
            ref = item.get("valueFrom") or {}
            if "fieldRef" in ref:
                env[name] = self._field(ref["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in ref or "configMapKeyRef" in ref:
                kind, r = ("Secret", ref["secretKeyRef"]) if "secretKeyRef" in ref else ("ConfigMap", ref["configMapKeyRef"])
                data = self._keyed_files(kind, {"name": r["name"], "optional": r.get("optional")}, ns)
                if r["key"] in data:
                    env[name] = data[r["key"]].decode()
                elif not r.get("optional"):
                    raise ContainerError("CreateContainerConfigError",
                                         f"couldn't find key {r['key']} in {kind} {ns}/{r['name']}")
            elif "resourceFieldRef" in ref:
                env[name] = "0"
        if SA_MOUNT in mounts:
            env["KUBECONFIG"] = self._service_account_kubeconfig(Path(mounts[SA_MOUNT]))
        return env

    def _service_account_kubeconfig(self, folder: Path) -> str:
        path = self.dir / "in-cluster.kubeconfig"
        ns = (folder / "namespace").read_text() if (folder / "namespace").exists() else self.pod["metadata"]["namespace"]
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "in-cluster",
            "clusters": [{"name": "in-cluster", "cluster": {"server": self.agent.api_server,
                                                            "certificate-authority": str(folder / "ca.crt")}}],
            "users": [{"name": "sa", "user": {"tokenFile": str(folder / "token"),
                                              "token": (folder / "token").read_text()}}],
            "contexts": [{"name": "in-cluster", "context": {"cluster": "in-cluster", "user": "sa", "namespace": ns}}],
        }))
        return str(path)

    # -- status --------------------------------------------------------------------------------

    def _push_status(self, phase: str | None = None) -> None:
        spec = self.pod["spec"]
        statuses = []
        for c in spec["containers"]:
            st = self.containers.get(c["name"], {})
            statuses.append({"name": c["name"], "image": c.get("image", ""), "imageID": "",
                             "containerID": f"local://{self.key}/{c['name']}",
                             "ready": bool(self.ready.get(c["name"])), "started": bool(st.get("started")),
                             "restartCount": st.get("restartCount", 0), "state": st.get("state", {}),
                             "lastState": st.get("lastState", {})})
        all_ready = bool(statuses) and all(s["ready"] for s in statuses)
        if phase is None:
            running = any("running" in s["state"] for s in statuses)
            phase = "Running" if running or any(s["restartCount"] for s in statuses) else "Pending"
        t = now_iso()
        prev = {c["type"]: c for c in (self.last_status or {}).get("conditions", [])}

        def cond(type_: str, ok: bool) -> dict[str, Any]:
            status = "True" if ok else "False"
            old = prev.get(type_)
            return {"type": type_, "status": status,
                    "lastTransitionTime": old["lastTransitionTime"] if old and old["status"] == status else t}
        status = {"phase": phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
                  "podIP": self.ip, "podIPs": [{"ip": self.ip}], "startTime": self.started_at,
                  "conditions": [cond("PodReadyToStartContainers", True), cond("Initialized", True),
                                 cond("Ready", all_ready and phase == "Running"),
                                 cond("ContainersReady", all_ready), cond("PodScheduled", True)],
                  "containerStatuses": statuses}
        comparable = {k: v for k, v in status.items() if k != "conditions"}
        if self.last_status is not None and comparable == {k: v for k, v in self.last_status.items() if k != "conditions"} \
                and [(c["type"], c["status"]) for c in status["conditions"]] == \
                [(c["type"], c["status"]) for c in self.last_status["conditions"]]:
            return
        self.last_status = status
        self.agent._patch_status(self.pod, status)


@functools.lru_cache(maxsize=1)
def read_only_wrapper() -> list[str] | None:
    """How this machine runs a program in a mount namespace of its own (as root: unshare --mount;
    otherwise in a user namespace too), or None when it cannot: tried once, on a folder bound
    read-only and then written to."""
    candidates = [["unshare", "--mount"]] if os.geteuid() == 0 else []
    candidates.append(["unshare", "--user", "--map-root-user", "--mount"])
    with tempfile.TemporaryDirectory() as folder:
        script = f"mount --bind -o ro {shlex.quote(folder)} {shlex.quote(folder)} && ! touch {shlex.quote(folder)}/w 2>/dev/null"
        for wrapper in candidates:
            try:
                if subprocess.run([*wrapper, "sh", "-c", script], capture_output=True, timeout=10).returncode == 0:
                    return wrapper
            except (OSError, subprocess.TimeoutExpired):
                continue
    return None


def _path_rewriter(mounts: dict[str, str]):
    ordered = sorted(mounts.items(), key=lambda kv: -len(kv[0]))

    def rewrite(value: str) -> str:
        for mount, host in ordered:
            if value == mount or value.startswith(mount + "/"):
                return host + value[len(mount):]
            # --flag=/path
            if "=" in value:
                k, _, v = value.partition("=")
                if v == mount or v.startswith(mount + "/"):
                    return f"{k}={host}{v[len(mount):]}"
        return value
    return rewrite


def _stop_process(proc: subprocess.Popen, grace: float, mark: str, sweep: bool = True) -> tuple[int | None, list]:
    """SIGTERM to the process's group (its session: the container's own), SIGKILL after `grace`
    to the group and to every process of the container outside it: those marked `mark`, and its
    descendants seen before each signal (container_processes). Returns (the exit status, or None
    when it is not known within 5 s; the container's processes still alive after 30 s of
    SIGKILLs, which only uninterruptible sleep explains). `sweep` False: the group alone (the
    caller sweeps the rest, NodeAgent.stop)."""
    # Looked at while the first process lives (its pid cannot be reused before it is reaped):
    # once it is gone its children's parent is init and the links to them are lost.
    below = container_processes.descendants(proc.pid) if sweep and proc.poll() is None else []
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(max(grace, 0.1))
        except subprocess.TimeoutExpired:
            pass
    if sweep and proc.poll() is None:
        below += [p for p in container_processes.descendants(proc.pid) if p not in below]
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    left = container_processes.kill_all(mark, below) if sweep else []
    try:
        return proc.wait(5), left
    except subprocess.TimeoutExpired:
        return None, left


def _container_port(container: dict[str, Any], port: Any) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


def run_probe(spec: dict[str, Any], ip: str, container: dict[str, Any], timeout: float, env: dict[str, str],
              channels: dict[tuple[str, int], Any] | None = None) -> bool:
    """One look. `channels`: gRPC channels kept between looks (NodeSpec.probe_connections_kept),
    by (address, port); one is kept only after a healthy answer on it, and dropped (closed) on
    any other outcome, so a look after a failure dials afresh as without them."""
    try:
        if "grpc" in spec:
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            port = _container_port(container, spec["grpc"]["port"])
            if channels is None:
                with grpc.insecure_channel(f"{ip}:{port}") as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")), timeout=timeout)
                    return reply.status == health_pb2.HealthCheckResponse.SERVING
            channel = channels.pop((ip, port), None) or grpc.insecure_channel(f"{ip}:{port}")
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")), timeout=timeout)
            except BaseException:
                channel.close()
                raise
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                channel.close()
                return False
            channels[(ip, port)] = channel
            return True
        if "httpGet" in spec:
            h = spec["httpGet"]
            port = _container_port(container, h["port"])
            scheme = h.get("scheme", "HTTP").lower()
            url = f"{scheme}://{h.get('host') or ip}:{port}{h.get('path', '/')}"
            req = urllib.request.Request(url, headers={x["name"]: x["value"] for x in h.get("httpHeaders") or []})
            import ssl
            ctx = ssl._create_unverified_context() if scheme == "https" else None  # kubelets skip verification too
            with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
                return 200 <= resp.status < 400
        if "tcpSocket" in spec:
            port = _container_port(container, spec["tcpSocket"]["port"])
            with socket.create_connection((spec["tcpSocket"].get("host") or ip, port), timeout=timeout):
                return True
        if "exec" in spec:
            done = subprocess.run(spec["exec"]["command"], env=env, timeout=max(timeout, 1),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return done.returncode == 0
    except Exception:  # noqa: BLE001 - any failure to get a healthy answer is a failed probe
        return False
    return False
