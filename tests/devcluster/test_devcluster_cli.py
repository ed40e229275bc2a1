"""`scripts/devcluster.sh up|status|down` (python -m specpair_devcluster) for people: up leaves a
cluster running and prints its kubeconfig; kubectl works with it; down leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


def cli(*args: str, folder: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specpair_devcluster", *args, "--dir", str(folder)],
                          capture_output=True, text=True, timeout=timeout)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # A zombie is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(300)
def test_up_status_kubectl_down(tmp_path):
    folder = tmp_path / "dc"
    up = cli("up", "--gpus", "1", "--nodes", "2", "--pods-per-node", "250", folder=folder)
    assert up.returncode == 0, up.stderr
    kubeconfig = up.stdout.strip().splitlines()[-1]
    try:
        status = cli("status", folder=folder)
        info = json.loads(status.stdout)
        assert status.returncode == 0 and info["kubeconfig"] == kubeconfig
        nodes = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "get", "nodes", "-o", "json"],
                               capture_output=True, text=True, timeout=60)
        assert nodes.returncode == 0, nodes.stderr
        # The node capacity asked for: two nodes of 250 pods and one GPU each.
        items = json.loads(nodes.stdout)["items"]
        assert sorted(n["metadata"]["name"] for n in items) == ["devcluster-node-1", "devcluster-node-2"]
        assert [(n["status"]["capacity"]["pods"], n["status"]["capacity"]["nvidia.com/gpu"]) for n in items] == \
            [("250", "1"), ("250", "1")]
        assert cli("up", folder=folder).stdout.strip() == kubeconfig  # already up: same cluster
        children = [int(p) for p in subprocess.run(["pgrep", "-g", str(os.getpgid(info["pid"]))],
                                                   capture_output=True, text=True).stdout.split()]
        assert len(children) >= 1
    finally:
        down = cli("down", folder=folder)
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in children):
        time.sleep(0.2)
    assert not [p for p in children if alive(p)], "processes left behind after down"
    # The control plane's own processes (their own process groups) are gone too.
    left = subprocess.run(["pgrep", "-f", str(folder)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes still running from {folder}: {left}"
    assert cli("status", folder=folder).returncode == 1
