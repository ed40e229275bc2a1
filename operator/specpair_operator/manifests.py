"""Kubernetes objects the operator owns, as pure functions of the pair and its release.

The release JSON reaches engine and gate pods through a pod annotation projected into a file
by the downward API: no ConfigMap to create, update or garbage-collect, and the pod template
changes (so the Deployment rolls) exactly when the release does. Owner references are added
by the adapter (kopf.adopt), not here.
"""

from __future__ import annotations

import json
from typing import Any

from . import names
from . import release as release_mod

GROUP = "specpair.io"
LABEL_PAIR = f"{GROUP}/pair"
LABEL_VERSION = f"{GROUP}/release-version"
LABEL_ROLE = f"{GROUP}/role"
ANN_RELEASE = f"{GROUP}/release"
ANN_HASH = f"{GROUP}/content-hash"
RELEASE_DIR = "/etc/specpair"
RELEASE_FILE = f"{RELEASE_DIR}/release.json"
CACHE_DIR = "/var/cache/specpair"
NONROOT_UID = 10001
METRICS_PORT = 9400
HTTP_PORT = 8000        # the engine's OpenAI-compatible HTTP API (rollout.httpPort; 0: off)


def engine_name(pair: str) -> str:
    return names.object_name(pair, "engine")


def gate_job_name(pair: str, digest: str) -> str:
    # A Job's name becomes its pods' job-name label: 63 characters at most.
    return names.object_name(pair, "gate", digest[:10])


def engine_selector(pair: str) -> dict[str, str]:
    """The engine pods of one pair, across releases (a Deployment's selector never changes)."""
    return {LABEL_PAIR: names.label_value(pair), LABEL_ROLE: "engine"}


def _labels(pair: str, role: str, version: str | None = None) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "specpair-engine",
        "app.kubernetes.io/instance": names.label_value(pair),
        "app.kubernetes.io/managed-by": "specpair-operator",
        LABEL_PAIR: names.label_value(pair),
        LABEL_ROLE: role,
    }
    if version is not None:
        labels[LABEL_VERSION] = str(version)
    return labels


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": NONROOT_UID,
        "runAsGroup": NONROOT_UID,
        "fsGroup": NONROOT_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _volumes() -> list[dict[str, Any]]:
    return [
        {"name": "release", "downwardAPI": {"items": [
            {"path": "release.json", "fieldRef": {"fieldPath": f"metadata.annotations['{ANN_RELEASE}']"}}]}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
    ]


def _mounts() -> list[dict[str, Any]]:
    return [
        {"name": "release", "mountPath": RELEASE_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
    ]


# MLflow's client reads these; values come from a Secret in the pair's namespace, by reference.
CREDENTIAL_VARS = {"MLFLOW_TRACKING_USERNAME": "username", "MLFLOW_TRACKING_PASSWORD": "password",
                   "MLFLOW_TRACKING_TOKEN": "token"}


def _env(tracking_uri: str, credentials_secret: str | None = None,
         credential_keys: dict[str, str] | None = None) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "MLFLOW_TRACKING_URI", "value": tracking_uri},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/hf"},
        {"name": "SPECPAIR_CACHE", "value": CACHE_DIR},
        # Read-only root filesystem: anything that writes to $HOME writes to the /tmp emptyDir.
        {"name": "HOME", "value": "/tmp"},
    ]
    if credentials_secret:
        keys = {**CREDENTIAL_VARS, **(credential_keys or {})}
        for var, key in keys.items():
            env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": credentials_secret, "key": key,
                                                                     "optional": True}}})
    return env


def _placement(rollout: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rollout.get("nodeSelector"):
        out["nodeSelector"] = dict(rollout["nodeSelector"])
    if rollout.get("tolerations"):
        out["tolerations"] = list(rollout["tolerations"])
    return out


def _release_annotations(release: dict[str, Any], digest: str) -> dict[str, str]:
    return {ANN_RELEASE: json.dumps(release, sort_keys=True), ANN_HASH: digest}


def gate_job(pair: str, namespace: str, release: dict[str, Any], digest: str, version: str,
             rollout: dict[str, Any], tracking_uri: str, deadline_seconds: int = 3600,
             credentials_secret: str | None = None) -> dict[str, Any]:
    """The Job that gates one release. Never retried by Kubernetes: a failed gate is a result."""
    labels = _labels(pair, "gate", version)
    container = {
        "name": "gate",
        "image": engine_image(release, rollout),
        "imagePullPolicy": rollout.get("imagePullPolicy", "IfNotPresent"),
        "command": ["python", "-m", "specpair_operator.gate_runner", "--release", RELEASE_FILE],
        "env": _env(tracking_uri, credentials_secret),
        "volumeMounts": _mounts(),
        "securityContext": _container_security(),
    }
    if rollout.get("resources"):
        container["resources"] = rollout["resources"]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": gate_job_name(pair, digest), "namespace": namespace, "labels": labels,
                     "annotations": {ANN_HASH: digest}},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": int(deadline_seconds),
            "template": {
                "metadata": {"labels": labels, "annotations": _release_annotations(release, digest)},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "securityContext": _pod_security(),
                    "containers": [container],
                    "volumes": _volumes(),
                    **_placement(rollout),
                },
            },
        },
    }


def engine_image(release: dict[str, Any], rollout: dict[str, Any]) -> str:
    """The image is part of the release: a rolled-back release runs the image it was gated with."""
    return str((release.get("engine") or {}).get("image") or rollout.get("image") or release_mod.ENGINE_IMAGE)


def engine_command(release: dict[str, Any], port: int, http_port: int = HTTP_PORT) -> list[str]:
    """`specpair engine serve` of the release file the pod mounts: models, revisions, speculation,
    pair and version come from that one document (the engine reports its content hash, which the
    operator checks); the command line only says how to listen (gRPC, metrics, and the
    OpenAI-compatible HTTP API on the same batch unless http_port is 0)."""
    return ["specpair", "engine", "serve", "--release", RELEASE_FILE,
            "--port", str(port), "--metrics-port", str(METRICS_PORT),
            *(["--http-port", str(http_port)] if http_port else []),
            # Plaintext inside the cluster; the chart's NetworkPolicy limits who can connect.
            "--insecure"]


def engine_deployment(pair: str, namespace: str, release: dict[str, Any], digest: str, version: str,
                      rollout: dict[str, Any], tracking_uri: str,
                      credentials_secret: str | None = None) -> dict[str, Any]:
    """The engine Deployment serving one release; the selector is stable across releases."""
    port = int(rollout.get("port", 50051))
    http_port = int(rollout.get("httpPort", HTTP_PORT))
    selector = engine_selector(pair)
    labels = _labels(pair, "engine", version)
    container = {
        "name": "engine",
        "image": engine_image(release, rollout),
        "imagePullPolicy": rollout.get("imagePullPolicy", "IfNotPresent"),
        "command": engine_command(release, port, http_port),
        "ports": [{"name": "grpc", "containerPort": port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
                  *([{"name": "http", "containerPort": http_port, "protocol": "TCP"}] if http_port else [])],
        "env": _env(tracking_uri, credentials_secret),
        "volumeMounts": _mounts(),
        "securityContext": _container_security(),
        # Model loading takes a while; the gRPC health service says SERVING only once loaded.
        "startupProbe": {"grpc": {"port": port}, "periodSeconds": 10, "failureThreshold": 60},
        "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5},
        "livenessProbe": {"grpc": {"port": port}, "periodSeconds": 20, "failureThreshold": 3},
    }
    if rollout.get("resources"):
        container["resources"] = rollout["resources"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": engine_name(pair), "namespace": namespace, "labels": labels,
                     "annotations": {ANN_HASH: digest}},
        "spec": {
            "replicas": int(rollout.get("replicas", 1)),
            "selector": {"matchLabels": selector},
            "progressDeadlineSeconds": int(rollout.get("progressDeadlineSeconds", 600)),
            "strategy": rollout_strategy(rollout),
            "template": {
                "metadata": {"labels": labels, "annotations": _release_annotations(release, digest)},
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": _pod_security(),
                    "containers": [container],
                    "volumes": _volumes(),
                    **_placement(rollout),
                },
            },
        },
    }


def rollout_strategy(rollout: dict[str, Any]) -> dict[str, Any]:
    """Surge a new pod before the old one goes, unless the engine holds accelerators: a GPU
    node pool rarely has a spare device, and a surge pod that cannot be scheduled would stall
    the rollout until its progress deadline. Then the old pod goes first (a short gap in
    serving per replica instead of a stuck rollout)."""
    limits = {**((rollout.get("resources") or {}).get("requests") or {}),
              **((rollout.get("resources") or {}).get("limits") or {})}
    if any(name.endswith("/gpu") and str(v) not in ("0", "") for name, v in limits.items()):
        return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def engine_service(pair: str, namespace: str, rollout: dict[str, Any]) -> dict[str, Any]:
    port = int(rollout.get("port", 50051))
    http_port = int(rollout.get("httpPort", HTTP_PORT))
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": engine_name(pair), "namespace": namespace, "labels": _labels(pair, "engine")},
        "spec": {
            "selector": engine_selector(pair),
            # `metrics` is what the chart's ServiceMonitor scrapes; `http` is the OpenAI-compatible API.
            "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
                      {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
                      *([{"name": "http", "port": http_port, "targetPort": "http", "protocol": "TCP",
                          "appProtocol": "http"}] if http_port else [])],
        },
    }


def deployment_rollout_state(deployment: dict[str, Any] | None, digest: str) -> tuple[str, str]:
    """('absent'|'progressing'|'available'|'failed', message) for the Deployment serving `digest`."""
    if not deployment:
        return "absent", "engine Deployment not created yet"
    meta, spec, status = deployment.get("metadata", {}), deployment.get("spec", {}), deployment.get("status") or {}
    if (meta.get("annotations") or {}).get(ANN_HASH) != digest:
        return "progressing", "engine Deployment not yet updated to this release"
    if status.get("observedGeneration", 0) < meta.get("generation", 1):
        return "progressing", "Deployment controller has not observed the new template yet"
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return "failed", f"rollout failed: {cond.get('message') or 'progress deadline exceeded'}"
    want = int(spec.get("replicas", 1))
    updated = int(status.get("updatedReplicas", 0))
    available = int(status.get("availableReplicas", 0))
    total = int(status.get("replicas", 0))
    if updated >= want and available >= want and total <= want:
        return "available", f"{available}/{want} engine pods available"
    return "progressing", f"{updated}/{want} updated, {available}/{want} available"
