"""The gate's objects: the Job that gates one release, and its pods' NetworkPolicy (no ingress)."""

from __future__ import annotations

from typing import Any

from specpair.vllm_parallel import cpu_binding_env

from specpair_operator.crd import names
from specpair_operator.crd.schema import has_gpu
from specpair_operator.desired.manifests import (ANN_HASH, LABEL_PAIR, LABEL_ROLE, RELEASE_FILE, TERMINATION_LOG,
                                                 MlflowCredentials, PodDefaults, container_security, gate_job_name,
                                                 gate_policy_name, pod_env, pod_labels, pod_mounts, pod_resources,
                                                 pod_spec, release_job, release_job_container, shm_mounts,
                                                 shm_volumes)


def gate_job(pair: str, namespace: str, release: dict[str, Any], digest: str, version: str,
             rollout: dict[str, Any], tracking_uri: str, deadline_seconds: int = 3600,
             credentials: MlflowCredentials | None = None, defaults: PodDefaults = PodDefaults(),
             attempt: int = 1) -> dict[str, Any]:
    """The Job that gates one release. Never retried by Kubernetes: the operator starts the next
    attempt when one ends without a verdict (gate_attempts.py).
    Deleted defaults.gate_ttl_seconds after it finishes (its verdict lives in MLflow)."""
    labels = pod_labels(pair, "gate", version)
    # The runner retries MLflow until shortly before the Job's deadline.
    command = ["python", "-m", "specpair_operator.gate.runner", "--release", RELEASE_FILE,
               "--termination-log", TERMINATION_LOG, "--deadline-seconds", str(int(deadline_seconds))]
    container = {
        # The verdict's digest, written by the gate runner: the operator checks MLflow's verdict
        # against it (gate_verdict.verify_verdict).
        **release_job_container("gate", release, rollout, command, "File"),
        "env": pod_env(tracking_uri, credentials, rollout=rollout, defaults=defaults)
        + cpu_binding_env(release, rollout, has_gpu(rollout)),  # vLLM split over CPU processes
        "volumeMounts": pod_mounts(rollout),
        "securityContext": container_security(),
    }
    if rollout.get("resources"):
        container["resources"] = pod_resources(release, rollout)
    container["volumeMounts"] += shm_mounts(release)
    return release_job(gate_job_name(pair, digest, attempt), namespace, labels, {ANN_HASH: digest}, release, digest,
                       container, pod_spec(rollout, defaults, extra_volumes=shm_volumes(release)),
                       backoff_limit=0, deadline_seconds=deadline_seconds, defaults=defaults)


def gate_network_policy(pair: str, namespace: str) -> dict[str, Any]:
    """Gate pods listen on nothing: no ingress at all (they still reach MLflow and the hub)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": gate_policy_name(pair), "namespace": namespace, "labels": pod_labels(pair, "gate")},
        "spec": {"podSelector": {"matchLabels": {LABEL_PAIR: names.label_value(pair), LABEL_ROLE: "gate"}},
                 "policyTypes": ["Ingress"], "ingress": []},
    }
