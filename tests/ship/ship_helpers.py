"""Shared helpers for the ship tests (tests/ship/): paths, pinned versions, running commands,
parsing renders, and the non-default values every optional chart part is tested with.

A missing tool FAILS the test (it never skips): CI runs scripts/install-k8s-tools.sh first, and a
developer who has not sees exactly what to run.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLS_BIN = REPO_ROOT / ".tools" / "bin"
CHART_DIR = REPO_ROOT / "charts" / "specpair"
INSTALL_HINT = "run `bash scripts/install-k8s-tools.sh` (installs helm, kubectl, checkov and Lua into .tools/)"
# The Kubernetes API version the rendered manifests are validated against: the kubectl that the
# install script ships is 1.33, and the chart's kubeVersion floor is 1.29.
KUBERNETES_VERSION = "1.33.0"
RELEASE_NAMESPACE = "specpair-system"


def require_tool(name: str) -> Path:
    path = TOOLS_BIN / name
    if not (path.exists() and os.access(path, os.X_OK)):
        pytest.fail(f"{name} is missing at {path}: {INSTALL_HINT}", pytrace=False)
    return path


def run(argv: list[Any], *, check: bool = True, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess:
    """Run a command, and on failure show its output (the assertion message is all CI shows)."""
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, argv))} exited {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
        )
    return result


def load_manifests(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render_args(values: dict[str, Any] | None) -> list[str]:
    """`helm template` arguments for a values dict (JSON is valid YAML: no --set escaping)."""
    if not values:
        return []
    return ["--values", "-"]


def by_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m.get("kind") == kind]


def one(manifests: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(manifests, kind)
    assert len(found) == 1, f"expected one {kind}, got {[m['metadata']['name'] for m in found]}"
    return found[0]


# Values that exercise every optional part of the chart at once.
NON_DEFAULT_VALUES: dict[str, Any] = {
    "image": {"repository": "registry.example.com/specpair/operator", "tag": "0.1.0-rc1",
              "digest": "sha256:" + "ab" * 32, "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "watchNamespaces": ["team-a", "team-b"],
    "replicaCount": 2,
    "leaderElection": {"enabled": True, "leaseDurationSeconds": 30, "renewDeadlineSeconds": 20, "retryPeriodSeconds": 4},
    "gate": {"ttlSecondsAfterFinished": 3600, "attempts": 5, "retryDelaySeconds": 60},
    "mlflow": {"trackingUri": "https://mlflow.example.com",
               "credentialsSecret": {"name": "mlflow-credentials", "usernameKey": "user",
                                     "passwordKey": "pass", "tokenKey": "", "grantOperatorRead": True}},
    "operator": {"logLevel": "debug", "logFormat": "json",
                 "extraArgs": ["--mlflow-tracking-uri=https://mlflow.example.com", "--log-refkey=k8s"]},
    "resources": {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "platform", "effect": "NoSchedule"}],
    "priorityClassName": "system-cluster-critical",
    "metrics": {"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kube-prometheus-stack"}}},
    "grafana": {"dashboard": {"enabled": True, "namespace": "monitoring"}},
    "autoscaling": {"prometheusAddress": "http://prometheus.monitoring:9090"},
    "networkPolicy": {"enabled": True, "egress": [{"ports": [{"port": 443, "protocol": "TCP"}]}]},
    "engine": {"image": "registry.example.com/specpair/engine:0.1.0", "imagePullSecrets": [{"name": "regcred"}],
               "hubTokenSecret": {"name": "hf-token", "key": "hf"},
               "modelCache": {"sizeLimit": "200Gi"},
               "networkPolicy": {"from": [{"namespaceSelector": {"matchLabels": {"team": "web"}}}]}},
}
