"""A node's stop looks at /proc once for all its pods, not two or three times a pod: a node of
~200 pods (bench/operator_scale.py's 1,000 pairs on five nodes) took ~6 minutes to stop, each
pod's worker reading every process's stat and environ in turn under one interpreter lock. It
still kills everything its containers made: here each container starts a child that leaves its
session and drops its environment (so neither the session's signal nor the container's mark
reaches it, only the parent links read while the container lives). On the session's real
control plane."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from waiting import wait_until

from devcluster_images import TEST_PYTHON_IMAGE
from specpair_devcluster import container_processes
from specpair_devcluster.node_agent import NodeSpec

PODS = 8


def test_a_node_stops_all_its_pods_with_one_look_at_proc(devcluster, ns, tmp_path: Path, monkeypatch):
    spec = NodeSpec(name=f"stopping-{ns}", cpu="4", env={"OMP_NUM_THREADS": "1"},
                    taints=[{"key": "specpair.io/test", "value": "stopping-node", "effect": "NoSchedule"}])
    agent = devcluster.add_node(spec)
    kube = devcluster.kube
    runs = tmp_path / "runs"
    runs.mkdir()
    names = [f"p{i}" for i in range(PODS)]
    stopped = False
    try:
        for name in names:
            code = ("import subprocess, time\n"
                    "child = subprocess.Popen(['/bin/sleep', '900'], env={}, start_new_session=True)\n"
                    f"open({str(runs / name)!r}, 'w').write(str(child.pid))\n"
                    "time.sleep(900)\n")
            kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
                         "spec": {"nodeName": spec.name, "restartPolicy": "Never",
                                  "containers": [{"name": "main", "image": TEST_PYTHON_IMAGE,
                                                  "command": ["python", "-c", code]}]}})
        wait_until("every pod's child started", lambda: all(
            (runs / n).exists() and (runs / n).read_text() for n in names), 300)
        children = []
        for name in names:
            pid = int((runs / name).read_text())
            stat = container_processes._stat(pid)
            assert stat is not None, f"{name}'s child {pid} is not running"
            children.append((pid, stat[2]))
        assert container_processes.marked(agent.mark + "/", prefix=True)

        # What this stop does, in order: "L" a read of /proc's process list, "K" a round of
        # SIGKILLs by kill_all's sweep; by the test's thread (which runs the node's stop) and this
        # node's pods' threads (named after the namespace), not the session's other nodes.
        done: list[str] = []                      # by the stop's own thread
        by_pods: list[tuple[str, str]] = []       # by this node's pods' threads
        listed, killed = container_processes._pids, container_processes.kill
        caller = threading.current_thread()

        def note(kind: str) -> None:
            thread = threading.current_thread()
            if thread is caller:
                done.append(kind)
            elif ns in thread.name:
                by_pods.append((thread.name, kind))

        def counted_listing() -> list[int]:
            note("L")
            return listed()

        def counted_kill(processes, *args, **kwargs) -> int:
            note("K")
            return killed(processes, *args, **kwargs)

        monkeypatch.setattr(container_processes, "_pids", counted_listing)
        monkeypatch.setattr(container_processes, "kill", counted_kill)
        agent.stop()
        stopped = True
        monkeypatch.setattr(container_processes, "_pids", listed)
        monkeypatch.setattr(container_processes, "kill", killed)

        assert not [c for c in children if container_processes.alive(c)], "a container's child outlived the node"
        assert container_processes.marked(agent.mark + "/", prefix=True) == []
        # No pod's worker looked or killed on its own (each looked two or three times before: 25
        # looks for 6 pods).
        assert by_pods == [], by_pods
        # The stop looked once for every container's descendants, then once a round of its sweep:
        # a look, SIGKILLs to what it found (at least the children that left their sessions), and
        # a last look that finds nothing. A process slow to die (a loaded machine) adds rounds,
        # each one look and one kill; one look a pod, by any thread, does not fit.
        assert re.fullmatch(r"L(LK)+L", "".join(done)), done
    finally:
        if not stopped:
            agent.stop()
        devcluster.agents.remove(agent)
        for name in names:     # gone at once: no node is left to finalise them
            kube.delete("v1", "Pod", ns, name, grace_seconds=0)
        kube.delete("v1", "Node", None, spec.name)
    assert not agent.errors, agent.errors[-5:]
