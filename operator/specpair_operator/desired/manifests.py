"""What every object the operator owns shares: their names, labels and annotations, the paths and
ports inside the pods, the installation's defaults (PodDefaults), MLflow credentials by reference,
and the pieces of a pod (volumes, mounts, environment, security, resources, placement).

The objects themselves: engine_objects.py (the engine's Deployment, Service, NetworkPolicy),
gate_objects.py (the gate's Job and NetworkPolicy), model_fetch.py (the model cache's fetch Job),
tls.py (the engine's certificate). The release JSON reaches engine and gate pods through a pod
annotation projected into a file by the downward API: no ConfigMap to create, update or
garbage-collect, and the pod template changes (so the Deployment rolls) exactly when the release
does. Owner references are added by the adapter (kopf.adopt), not here.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from specpair.contract import parallelism

from specpair_operator.crd import names
from specpair_operator.release import content as release_mod

GROUP = "specpair.io"
LABEL_PAIR = f"{GROUP}/pair"
LABEL_VERSION = f"{GROUP}/release-version"
LABEL_ROLE = f"{GROUP}/role"
ANN_RELEASE = f"{GROUP}/release"
ANN_HASH = f"{GROUP}/content-hash"
RELEASE_DIR = "/etc/specpair"
RELEASE_FILE = f"{RELEASE_DIR}/release.json"
# A candidate scored in shadow on the champion's pods (docs/shadow.md): its release file beside
# the champion's, from the pod template's annotation the same way.
ANN_SHADOW_RELEASE = f"{GROUP}/shadow-release"
SHADOW_RELEASE_FILE = f"{RELEASE_DIR}/shadow-release.json"
CACHE_DIR = "/var/cache/specpair"
NONROOT_UID = 10001
METRICS_PORT = names.METRICS_PORT   # the CRD states it (crd/names.py)
HTTP_PORT = 8000        # the engine's OpenAI-compatible HTTP API (rollout.httpPort; 0: off)
# The engine's control listener: gRPC with mutual TLS, the operator its only client (tls.py).
CONTROL_PORT = 50052
TLS_DIR = "/var/run/specpair/tls"
# The serving ports' bearer token (spec.rollout.auth), from the pair's Secret.
AUTH_DIR = "/var/run/specpair/auth"
# A vLLM pod's companion: a small asyncio proxy (measured in docs/measurements, vLLM companion).
COMPANION_REQUESTS = {"cpu": "100m", "memory": "128Mi"}
TERMINATION_LOG = "/dev/termination-log"
# A pre-filled Hugging Face hub cache (rollout.modelCache.persistentVolumeClaim), read-only.
HUB_CACHE_DIR = "/var/cache/specpair-hub"
# The model cache emptyDir's limit when neither the pair nor the chart says (a pod whose cache
# outgrows it is evicted, instead of filling the node's disk).
CACHE_SIZE_LIMIT = "64Gi"
# vLLM's workers of a target split over several GPUs exchange tensors through shared memory
# (NCCL): a pod's own /dev/shm (64 MiB by default) is too small, so such pods get a memory-backed
# one of this size (vLLM's Kubernetes guide uses the same).
SHM_DIR = "/dev/shm"
SHM_SIZE_LIMIT = "2Gi"
# A finished gate Job (and its pod, with the gate's log) is kept a day. The operator needs it
# only until it has recorded the gate (its Failed condition, GateStarted, the gate's duration:
# seconds after it finishes, while the operator runs); the verdict itself is in MLflow.
GATE_TTL_SECONDS = 86400


@dataclass(frozen=True)
class PodDefaults:
    """What the installation says about every pod the operator creates: the chart's `engine.*`
    and `gate.*` values, handed to the operator as environment variables (from_env)."""
    image_pull_secrets: tuple[str, ...] = ()
    cache_size_limit: str = CACHE_SIZE_LIMIT
    # NetworkPolicyPeers allowed to reach the engine's ports; empty: any source (ports only).
    ingress_from: tuple[dict[str, Any], ...] = ()
    gate_ttl_seconds: int = GATE_TTL_SECONDS
    # Where the operator runs (namespace, pod labels): the only peer allowed on the control port.
    # Unknown (an operator outside the cluster): the port is open to any source, mTLS still holds.
    operator_namespace: str = ""
    operator_pod_labels: tuple[tuple[str, str], ...] = ()
    # (Secret, key) with a Hugging Face hub token for pairs that name none (chart engine.hubTokenSecret).
    hub_token: tuple[str, str] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "PodDefaults":
        """SPECPAIR_IMAGE_PULL_SECRETS (comma list of Secret names), SPECPAIR_MODEL_CACHE_SIZE_LIMIT,
        SPECPAIR_ENGINE_INGRESS_FROM (a JSON list of NetworkPolicyPeers), SPECPAIR_GATE_TTL_SECONDS,
        SPECPAIR_OPERATOR_NAMESPACE and SPECPAIR_OPERATOR_POD_LABELS (a JSON object),
        SPECPAIR_HUB_TOKEN_SECRET and SPECPAIR_HUB_TOKEN_KEY."""
        peers = json.loads(env.get("SPECPAIR_ENGINE_INGRESS_FROM") or "[]")
        if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
            raise ValueError("SPECPAIR_ENGINE_INGRESS_FROM must be a JSON list of NetworkPolicyPeer objects")
        labels = json.loads(env.get("SPECPAIR_OPERATOR_POD_LABELS") or "{}")
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise ValueError("SPECPAIR_OPERATOR_POD_LABELS must be a JSON object of label -> value")
        return cls(
            image_pull_secrets=tuple(s.strip() for s in (env.get("SPECPAIR_IMAGE_PULL_SECRETS") or "").split(",")
                                     if s.strip()),
            cache_size_limit=env.get("SPECPAIR_MODEL_CACHE_SIZE_LIMIT") or CACHE_SIZE_LIMIT,
            ingress_from=tuple(peers),
            gate_ttl_seconds=int(env.get("SPECPAIR_GATE_TTL_SECONDS") or GATE_TTL_SECONDS),
            operator_namespace=(env.get("SPECPAIR_OPERATOR_NAMESPACE") or "").strip(),
            operator_pod_labels=tuple(sorted(labels.items())),
            hub_token=((env["SPECPAIR_HUB_TOKEN_SECRET"].strip(), (env.get("SPECPAIR_HUB_TOKEN_KEY") or "token").strip())
                       if (env.get("SPECPAIR_HUB_TOKEN_SECRET") or "").strip() else None),
        )


def engine_name(pair: str) -> str:
    return names.object_name(pair, "engine")


def engine_canary_name(pair: str) -> str:
    """The canary's Deployment: a candidate's engine pods beside the champion's (canary.py)."""
    return names.object_name(pair, "engine-canary")


def engine_tls_secret_name(pair: str) -> str:
    return names.object_name(pair, "engine-tls")


def engine_tls_secret(pair: str, namespace: str, cert_pem: bytes, key_pem: bytes, ca_pem: bytes) -> dict[str, Any]:
    """The engine's control-listener certificate, its key, and the CA its clients must show."""
    import base64

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": engine_tls_secret_name(pair), "namespace": namespace, "labels": pod_labels(pair, "engine")},
            "data": {"tls.crt": b64(cert_pem), "tls.key": b64(key_pem), "ca.crt": b64(ca_pem)}}


def gate_policy_name(pair: str) -> str:
    return names.object_name(pair, "gate")


def gate_job_name(pair: str, digest: str, attempt: int = 1) -> str:
    # A Job's name becomes its pods' job-name label: 63 characters at most. Each attempt at gating
    # a release (gate_attempts.py) is a Job of its own; the first keeps the name it always had.
    return names.object_name(pair, "gate", digest[:10], f"a{attempt}" if attempt > 1 else "")


def engine_selector(pair: str) -> dict[str, str]:
    """The engine pods of one pair, across releases (a Deployment's selector never changes)."""
    return {LABEL_PAIR: names.label_value(pair), LABEL_ROLE: "engine"}


def pod_labels(pair: str, role: str, version: str | None = None) -> dict[str, str]:
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


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _model_cache(rollout: dict[str, Any]) -> dict[str, Any]:
    return dict(rollout.get("modelCache") or {})


def _volumes(rollout: dict[str, Any], defaults: PodDefaults) -> list[dict[str, Any]]:
    cache = _model_cache(rollout)
    volumes = [
        {"name": "release", "downwardAPI": {"items": [
            {"path": "release.json", "fieldRef": {"fieldPath": f"metadata.annotations['{ANN_RELEASE}']"}}]}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {"sizeLimit": str(cache.get("sizeLimit") or defaults.cache_size_limit)}},
    ]
    if cache.get("persistentVolumeClaim"):
        volumes.append({"name": "hub", "persistentVolumeClaim": {"claimName": cache["persistentVolumeClaim"],
                                                                "readOnly": True}})
    return volumes


def pod_mounts(rollout: dict[str, Any]) -> list[dict[str, Any]]:
    mounts = [
        {"name": "release", "mountPath": RELEASE_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
    ]
    if _model_cache(rollout).get("persistentVolumeClaim"):
        mounts.append({"name": "hub", "mountPath": HUB_CACHE_DIR, "readOnly": True})
    return mounts


def pod_spec(rollout: dict[str, Any], defaults: PodDefaults,
              extra_volumes: list[dict[str, Any]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    """What engine and gate pods share: no API token, unprivileged, pull secrets, volumes, placement."""
    return {
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
        **({"imagePullSecrets": [{"name": n} for n in defaults.image_pull_secrets]}
           if defaults.image_pull_secrets else {}),
        "volumes": [*_volumes(rollout, defaults), *extra_volumes],
        **_placement(rollout),
    }


# MLflow's client reads these; values come from a Secret in the pair's namespace, by reference.
# The MLflow client's variables and their keys in a credentials Secret, unless told otherwise.
CREDENTIAL_KEYS = {"MLFLOW_TRACKING_USERNAME": "username", "MLFLOW_TRACKING_PASSWORD": "password"}


@dataclass(frozen=True)
class MlflowCredentials:
    """A Secret in the pair's namespace holding MLflow credentials, and the key of each variable.

    References are not optional: a missing Secret or key keeps the pod from starting with the
    kubelet's reason (reported on the pair), instead of a gate that silently runs unauthenticated."""
    secret: str
    keys: tuple[tuple[str, str], ...] = tuple(CREDENTIAL_KEYS.items())   # (variable, key)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "MlflowCredentials | None":
        """The installation's: SPECPAIR_MLFLOW_CREDENTIALS_SECRET and SPECPAIR_MLFLOW_CREDENTIALS_KEYS
        (a JSON object variable -> key; the chart's mlflow.credentialsSecret.*Key values)."""
        name = (env.get("SPECPAIR_MLFLOW_CREDENTIALS_SECRET") or "").strip()
        if not name:
            return None
        keys = json.loads(env.get("SPECPAIR_MLFLOW_CREDENTIALS_KEYS") or "null") or CREDENTIAL_KEYS
        if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
            raise ValueError("SPECPAIR_MLFLOW_CREDENTIALS_KEYS must be a JSON object of variable -> key")
        return cls(name, tuple((var, key) for var, key in keys.items() if key))

    @classmethod
    def for_pair(cls, spec_mlflow: Mapping[str, Any] | None,
                 installation: "MlflowCredentials | None") -> "MlflowCredentials | None":
        """The pair's own spec.mlflow.credentialsSecretRef, else the installation's."""
        ref = (spec_mlflow or {}).get("credentialsSecretRef")
        if not ref:
            return installation
        keys = {"MLFLOW_TRACKING_USERNAME": ref.get("usernameKey", "username"),
                "MLFLOW_TRACKING_PASSWORD": ref.get("passwordKey", "password"),
                "MLFLOW_TRACKING_TOKEN": ref.get("tokenKey", "")}
        return cls(str(ref["name"]), tuple((var, key) for var, key in keys.items() if key))


def pod_env(tracking_uri: str, credentials: MlflowCredentials | None = None,
         rollout: dict[str, Any] | None = None, defaults: PodDefaults = PodDefaults()) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "MLFLOW_TRACKING_URI", "value": tracking_uri},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/hf"},
        {"name": "SPECPAIR_CACHE", "value": CACHE_DIR},
        # Read-only root filesystem: anything that writes to $HOME writes to the /tmp emptyDir.
        {"name": "HOME", "value": "/tmp"},
    ]
    if _model_cache(rollout or {}).get("persistentVolumeClaim"):
        # Weights come from the pre-filled, read-only hub cache; nothing is downloaded.
        env += [{"name": "HF_HUB_CACHE", "value": HUB_CACHE_DIR}, {"name": "HF_HUB_OFFLINE", "value": "1"}]
    if credentials is not None:
        for var, key in credentials.keys:
            env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": credentials.secret, "key": key}}})
    ref = _model_cache(rollout or {}).get("hubTokenSecretRef")
    token = (str(ref["name"]), str(ref.get("key") or "token")) if ref else defaults.hub_token
    if token is not None:
        # By reference, not optional: a missing Secret or key keeps the pod from starting, with
        # the kubelet's reason on the pair, instead of a download that fails as "not found".
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token[0], "key": token[1]}}})
    return env


def _placement(rollout: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rollout.get("nodeSelector"):
        out["nodeSelector"] = dict(rollout["nodeSelector"])
    if rollout.get("tolerations"):
        out["tolerations"] = list(rollout["tolerations"])
    return out


def release_annotations(release: dict[str, Any], digest: str) -> dict[str, str]:
    return {ANN_RELEASE: json.dumps(release, sort_keys=True), ANN_HASH: digest}


def engine_image(release: dict[str, Any], rollout: dict[str, Any]) -> str:
    """The image is part of the release: a rolled-back release runs the image it was gated with."""
    return str((release.get("engine") or {}).get("image") or rollout.get("image") or release_mod.default_engine_image())


def gpus_per_pod(release: dict[str, Any]) -> int:
    """The GPUs one engine (or gate) pod of the release uses: tensor x pipeline parallel size."""
    split = parallelism(release)
    return split["tensor"] * split["pipeline"]


def pod_resources(release: dict[str, Any], rollout: dict[str, Any]) -> dict[str, Any]:
    """rollout.resources, where the release splits its target over several GPUs with each GPU
    resource it names (`nvidia.com/gpu`, any `*/gpu`) set to gpus_per_pod: vLLM takes exactly
    that many, so a pod asking for fewer never starts and one asking for more strands the rest.
    A release on one device keeps the pair's resources as they are."""
    resources = copy.deepcopy(rollout.get("resources") or {})
    count = gpus_per_pod(release)
    if count > 1:
        for part in ("requests", "limits"):
            for name in list((resources.get(part) or {})):
                if name.endswith("/gpu"):
                    resources[part][name] = count
    return resources


def shm_volumes(release: dict[str, Any]) -> list[dict[str, Any]]:
    if gpus_per_pod(release) == 1:
        return []
    return [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE_LIMIT}}]


def shm_mounts(release: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": "shm", "mountPath": SHM_DIR}] if shm_volumes(release) else []


def release_job_container(name: str, release: dict[str, Any], rollout: Mapping[str, Any], command: list[str],
                          termination_policy: str) -> dict[str, Any]:
    """The head of the one container of a Job run for a release (gate, model fetch, training): the
    release's engine image, and the report its command writes to the termination log, which the
    operator reads back (`termination_policy` "FallbackToLogsOnError": the log's tail when the
    command died before writing one). The caller adds env, mounts, resources and security."""
    return {
        "name": name,
        "image": engine_image(release, dict(rollout)),
        "imagePullPolicy": rollout.get("imagePullPolicy", "IfNotPresent"),
        "command": command,
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": termination_policy,
    }


def release_job(name: str, namespace: str, labels: dict[str, str], annotations: dict[str, str],
                release: dict[str, Any], digest: str, container: dict[str, Any], pod: dict[str, Any], *,
                backoff_limit: int, deadline_seconds: int, defaults: PodDefaults) -> dict[str, Any]:
    """A Job run for a release: its one pod never restarted in place (Kubernetes retries it
    `backoff_limit` times at most), stopped after `deadline_seconds`, deleted the installation's
    gate TTL after it ends; the pod carries the release document (release_annotations) as engine
    pods do. `pod` is pod_spec()'s, volumes included."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
        "spec": {
            "backoffLimit": backoff_limit,
            "activeDeadlineSeconds": int(deadline_seconds),
            "ttlSecondsAfterFinished": int(defaults.gate_ttl_seconds),
            "template": {
                "metadata": {"labels": labels, "annotations": release_annotations(release, digest)},
                "spec": {"restartPolicy": "Never", "containers": [container], **pod},
            },
        },
    }
