"""Kubernetes objects the operator owns, as pure functions of the pair and its release.

The release JSON reaches engine and gate pods through a pod annotation projected into a file
by the downward API: no ConfigMap to create, update or garbage-collect, and the pod template
changes (so the Deployment rolls) exactly when the release does. Owner references are added
by the adapter (kopf.adopt), not here.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from specpair.contract import parallelism
from specpair.vllm_parallel import cpu_binding_env
from specpair.vllm_serve import VLLM_SOCKET, VLLM_SOCKET_DIR

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
            "metadata": {"name": engine_tls_secret_name(pair), "namespace": namespace, "labels": _labels(pair, "engine")},
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


def _mounts(rollout: dict[str, Any]) -> list[dict[str, Any]]:
    mounts = [
        {"name": "release", "mountPath": RELEASE_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
    ]
    if _model_cache(rollout).get("persistentVolumeClaim"):
        mounts.append({"name": "hub", "mountPath": HUB_CACHE_DIR, "readOnly": True})
    return mounts


def _pod_spec(rollout: dict[str, Any], defaults: PodDefaults,
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


def _env(tracking_uri: str, credentials: MlflowCredentials | None = None,
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


def _release_annotations(release: dict[str, Any], digest: str) -> dict[str, str]:
    return {ANN_RELEASE: json.dumps(release, sort_keys=True), ANN_HASH: digest}


def gate_job(pair: str, namespace: str, release: dict[str, Any], digest: str, version: str,
             rollout: dict[str, Any], tracking_uri: str, deadline_seconds: int = 3600,
             credentials: MlflowCredentials | None = None, defaults: PodDefaults = PodDefaults(),
             attempt: int = 1) -> dict[str, Any]:
    """The Job that gates one release. Never retried by Kubernetes: the operator starts the next
    attempt when one ends without a verdict (gate_attempts.py).
    Deleted defaults.gate_ttl_seconds after it finishes (its verdict lives in MLflow)."""
    labels = _labels(pair, "gate", version)
    container = {
        "name": "gate",
        "image": engine_image(release, rollout),
        "imagePullPolicy": rollout.get("imagePullPolicy", "IfNotPresent"),
        # The runner retries MLflow until shortly before the Job's deadline.
        "command": ["python", "-m", "specpair_operator.gate.runner", "--release", RELEASE_FILE,
                    "--termination-log", TERMINATION_LOG, "--deadline-seconds", str(int(deadline_seconds))],
        # The verdict's digest, written by the gate runner: the operator checks MLflow's verdict
        # against it (gate_verdict.verify_verdict).
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        "env": _env(tracking_uri, credentials, rollout=rollout, defaults=defaults)
        + cpu_binding_env(release, rollout, _has_gpu(rollout)),  # vLLM split over CPU processes
        "volumeMounts": _mounts(rollout),
        "securityContext": _container_security(),
    }
    if rollout.get("resources"):
        container["resources"] = _resources(release, rollout)
    container["volumeMounts"] += _shm_mounts(release)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": gate_job_name(pair, digest, attempt), "namespace": namespace, "labels": labels,
                     "annotations": {ANN_HASH: digest}},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": int(deadline_seconds),
            "ttlSecondsAfterFinished": int(defaults.gate_ttl_seconds),
            "template": {
                "metadata": {"labels": labels, "annotations": _release_annotations(release, digest)},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [container],
                    **_pod_spec(rollout, defaults, extra_volumes=_shm_volumes(release)),
                },
            },
        },
    }


def engine_image(release: dict[str, Any], rollout: dict[str, Any]) -> str:
    """The image is part of the release: a rolled-back release runs the image it was gated with."""
    return str((release.get("engine") or {}).get("image") or rollout.get("image") or release_mod.default_engine_image())


def serving_tls(rollout: dict[str, Any]) -> bool:
    """rollout.tls.enabled: the serving ports speak TLS (engine specpair; the CRD refuses it for vLLM)."""
    return (rollout.get("tls") or {}).get("enabled") is True


def engine_command(release: dict[str, Any], port: int, http_port: int = HTTP_PORT,
                   control_port: int = CONTROL_PORT, tls: bool = False) -> list[str]:
    """`specpair engine serve` of the release file the pod mounts: models, revisions, speculation,
    pair and version come from that one document (the engine reports its content hash, which the
    operator checks); the command line only says how to listen (gRPC, metrics, the
    OpenAI-compatible HTTP API on the same batch unless http_port is 0, and the control listener)."""
    # The operator's calls, SetSpeculation among them, go to the control listener, which takes
    # only the operator's client certificate (mutual TLS). The serving ports speak plaintext to
    # the pair's clients (the NetworkPolicy names who may connect), or with `tls` TLS from the
    # pair's engine certificate, the control port's own: the engine re-reads both when the
    # operator renews it in place.
    serving = (["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"] if tls
               else ["--insecure"])
    return ["specpair", "engine", "serve", "--release", RELEASE_FILE,
            "--port", str(port), "--metrics-port", str(METRICS_PORT),
            *(["--http-port", str(http_port)] if http_port else []),
            *serving,
            "--control-port", str(control_port), "--control-tls-cert", f"{TLS_DIR}/tls.crt",
            "--control-tls-key", f"{TLS_DIR}/tls.key", "--control-tls-client-ca", f"{TLS_DIR}/ca.crt"]


# rollout.kvBudget's quantity suffixes (the CRD's pattern) as the engine's --kv-budget units: the
# engine reads a bare number as a count of target tokens, the CRD's as bytes.
KV_BUDGET_UNITS = {"": "B", "k": "KB", "M": "MB", "G": "GB", "T": "TB",
                   "Ki": "KiB", "Mi": "MiB", "Gi": "GiB", "Ti": "TiB"}


def engine_kv_budget(quantity: int | str) -> str:
    """rollout.kvBudget (bytes: an integer or "2Gi", "512Mi", "4G") as the engine's --kv-budget."""
    text = str(quantity)
    digits = text.rstrip("".join(set("".join(KV_BUDGET_UNITS))))
    return digits + KV_BUDGET_UNITS[text[len(digits):]]


def engine_limit_flags(rollout: dict[str, Any]) -> list[str]:
    """rollout.kvBudget and rollout.maxBatchSize as `specpair engine serve` flags; absent, the
    engine's own defaults (none passed)."""
    flags = []
    if rollout.get("kvBudget") is not None:
        flags += ["--kv-budget", engine_kv_budget(rollout["kvBudget"])]
    if rollout.get("maxBatchSize") is not None:
        flags += ["--max-batch-size", str(int(rollout["maxBatchSize"]))]
    return flags

def gpus_per_pod(release: dict[str, Any]) -> int:
    """The GPUs one engine (or gate) pod of the release uses: tensor x pipeline parallel size."""
    split = parallelism(release)
    return split["tensor"] * split["pipeline"]


def _resources(release: dict[str, Any], rollout: dict[str, Any]) -> dict[str, Any]:
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


def _shm_volumes(release: dict[str, Any]) -> list[dict[str, Any]]:
    if gpus_per_pod(release) == 1:
        return []
    return [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE_LIMIT}}]


def _shm_mounts(release: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": "shm", "mountPath": SHM_DIR}] if _shm_volumes(release) else []


def _has_gpu(rollout: dict[str, Any]) -> bool:
    limits = {**((rollout.get("resources") or {}).get("requests") or {}),
              **((rollout.get("resources") or {}).get("limits") or {})}
    return any(name.endswith("/gpu") and str(v) not in ("0", "") for name, v in limits.items())


def vllm_command(http_port: int, rollout: dict[str, Any], speculation: bool = True) -> list[str]:
    """vLLM's OpenAI server for the release file the pod mounts (specpair.vllm_serve resolves the
    models and builds vLLM's flags from the release), on the Unix socket the pod's companion
    fronts. No GPU: eager mode (compiling for the CPU takes minutes at every start)."""
    return ["python", "-m", "specpair.vllm_serve", "--release", RELEASE_FILE, "--uds", VLLM_SOCKET,
            *([] if speculation else ["--no-speculation"]),
            *([] if _has_gpu(rollout) else ["--enforce-eager"])]


def vllm_companion_command(http_port: int, control_port: int, rollout: dict[str, Any]) -> list[str]:
    """The pod's companion (specpair.vllm_companion): the pair's HTTP port in front of vLLM's
    socket, the bearer token where rollout.auth names one, and GetStats on the control port
    (mutual TLS, the engine certificate the operator issues, as our engine's)."""
    token = ["--auth-token-file", f"{AUTH_DIR}/token"] if (rollout.get("auth") or {}).get("tokenSecretRef") else []
    return ["python", "-m", "specpair.vllm_companion", "--release", RELEASE_FILE, "--uds", VLLM_SOCKET,
            "--host", "0.0.0.0", "--port", str(http_port), *token, "--metrics-port", str(METRICS_PORT),
            "--control-port", str(control_port), "--control-tls-cert", f"{TLS_DIR}/tls.crt",
            "--control-tls-key", f"{TLS_DIR}/tls.key", "--control-tls-client-ca", f"{TLS_DIR}/ca.crt"]


def engine_deployment(pair: str, namespace: str, release: dict[str, Any], digest: str, version: str,
                      rollout: dict[str, Any], tracking_uri: str,
                      credentials: MlflowCredentials | None = None, defaults: PodDefaults = PodDefaults(),
                      speculation: bool = True, shadow: tuple[dict[str, Any], float] | None = None) -> dict[str, Any]:
    """The engine Deployment serving one release; the selector is stable across releases.
    `speculation` matters only for vLLM, which cannot switch it at run time: its SpeculationOff
    is this Deployment rendered without it (a rollout of the same release). `shadow`: a
    candidate's release file and the share of requests its drafter is scored on (specpair
    engine only)."""
    if shadow is not None:
        return with_shadow(engine_deployment(pair, namespace, release, digest, version, rollout, tracking_uri,
                                             credentials, defaults, speculation), *shadow)
    if release_mod.engine_kind(release) == "vllm":
        return _vllm_deployment(pair, namespace, release, digest, version, rollout, tracking_uri, credentials,
                                defaults, speculation)
    port = int(rollout.get("port", 50051))
    http_port = int(rollout.get("httpPort", HTTP_PORT))
    control_port = int(rollout.get("controlPort", CONTROL_PORT))
    tls = serving_tls(rollout)
    container = {
        "name": "engine",
        "image": engine_image(release, rollout),
        "imagePullPolicy": rollout.get("imagePullPolicy", "IfNotPresent"),
        "command": engine_command(release, port, http_port, control_port, tls) + engine_limit_flags(rollout),
        "ports": [{"name": "grpc", "containerPort": port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
                  {"name": "control", "containerPort": control_port, "protocol": "TCP"},
                  *([{"name": "http", "containerPort": http_port, "protocol": "TCP"}] if http_port else [])],
        "env": _env(tracking_uri, credentials, rollout=rollout, defaults=defaults),
        "volumeMounts": [*_mounts(rollout), {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}],
        "securityContext": _container_security(),
        **_engine_probes(port, tls),
    }
    volumes = [{"name": "tls", "secret": {"secretName": engine_tls_secret_name(pair), "defaultMode": 0o440}}]
    ref = (rollout.get("auth") or {}).get("tokenSecretRef")
    if ref:
        # By reference: the kubelet mounts the key, the operator never reads it.
        volumes.append({"name": "auth", "secret": {"secretName": ref["name"], "defaultMode": 0o440,
                                                   "items": [{"key": ref.get("key") or "token", "path": "token"}]}})
        container["volumeMounts"].append({"name": "auth", "mountPath": AUTH_DIR, "readOnly": True})
        container["command"] += ["--auth-token-file", f"{AUTH_DIR}/token"]
    return _engine_deployment_of(pair, namespace, release, digest, version, rollout, container, defaults, volumes)


def with_shadow(dep: dict[str, Any], candidate: dict[str, Any], share: float) -> dict[str, Any]:
    """The champion's engine Deployment also scoring `candidate`'s drafter on `share` of its
    requests: the candidate's release file mounted as the champion's is (a pod template
    annotation through the downward API) and the engine's --shadow-release/--shadow-share."""
    template = dep["spec"]["template"]
    template["metadata"]["annotations"][ANN_SHADOW_RELEASE] = json.dumps(candidate, sort_keys=True)
    release_volume = next(v for v in template["spec"]["volumes"] if v["name"] == "release")
    release_volume["downwardAPI"]["items"].append(
        {"path": SHADOW_RELEASE_FILE.rsplit("/", 1)[1],
         "fieldRef": {"fieldPath": f"metadata.annotations['{ANN_SHADOW_RELEASE}']"}})
    engine = next(ctr for ctr in template["spec"]["containers"] if ctr["name"] == "engine")
    engine["command"] += ["--shadow-release", SHADOW_RELEASE_FILE, "--shadow-share", f"{share:g}"]
    return dep


def _engine_probes(port: int, tls: bool) -> dict[str, Any]:
    """Model loading takes a while; the engine says it serves only once loaded: the gRPC health
    service SERVING, /health 200 (both say not yet while loading and again while draining).

    Plaintext: the kubelet's gRPC probe on the serving port. With TLS that probe cannot connect
    (it speaks no TLS), and the control port wants a client certificate the kubelet has none of;
    the kubelet's HTTPS probe can (it does not verify the certificate), so the probes read the
    HTTP front's /health, which needs no bearer token. The CRD makes rollout.tls need httpPort,
    so no plaintext health port is left open beside the TLS ones.
    """
    probe = ({"httpGet": {"path": "/health", "port": "http", "scheme": "HTTPS"}} if tls
             else {"grpc": {"port": port}})
    return {"startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 60},
            "readinessProbe": {**probe, "periodSeconds": 5},
            "livenessProbe": {**probe, "periodSeconds": 20, "failureThreshold": 3}}


def _engine_deployment_of(pair: str, namespace: str, release: dict[str, Any], digest: str, version: str,
                          rollout: dict[str, Any], container: dict[str, Any], defaults: PodDefaults,
                          extra_volumes: list[dict[str, Any]] = (),  # type: ignore[assignment]
                          sidecars: list[dict[str, Any]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    """The Deployment around an engine container (ours or vLLM's): what both engines share.
    `sidecars`: containers beside it (vLLM's companion), given as they are."""
    if rollout.get("resources"):
        container["resources"] = _resources(release, rollout)
    container["volumeMounts"] = [*container["volumeMounts"], *_shm_mounts(release)]
    extra_volumes = [*extra_volumes, *_shm_volumes(release)]
    labels = _labels(pair, "engine", version)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": engine_name(pair), "namespace": namespace, "labels": labels,
                     "annotations": {ANN_HASH: digest}},
        "spec": {
            "replicas": int(rollout.get("replicas", 1)),
            "selector": {"matchLabels": engine_selector(pair)},
            "progressDeadlineSeconds": int(rollout.get("progressDeadlineSeconds", 600)),
            "strategy": rollout_strategy(rollout),
            "template": {
                "metadata": {"labels": labels, "annotations": _release_annotations(release, digest)},
                "spec": {"containers": [container, *sidecars], **_pod_spec(rollout, defaults, extra_volumes=list(extra_volumes))},
            },
        },
    }


def _vllm_deployment(pair: str, namespace: str, release: dict[str, Any], digest: str, version: str,
                     rollout: dict[str, Any], tracking_uri: str, credentials: MlflowCredentials | None,
                     defaults: PodDefaults, speculation: bool) -> dict[str, Any]:
    """Two containers: vLLM's OpenAI server on a Unix socket in a volume both mount, and its
    companion (specpair.vllm_companion) on the pair's HTTP port: the API passed through
    unchanged behind the pair's token (rollout.auth, the Secret mounted by reference), /health
    (the probes: vLLM's, 503 while the companion drains), /metrics (vLLM's series and ours, per
    category) and, on the control port, GetStats and GetModelInfo for the operator (mutual TLS)."""
    http_port = int(rollout.get("httpPort") or HTTP_PORT)
    control_port = int(rollout.get("controlPort", CONTROL_PORT))
    socket_mount = {"name": "vllm-socket", "mountPath": VLLM_SOCKET_DIR}
    health = {"httpGet": {"path": "/health", "port": http_port}}
    container = {
        "name": "engine",
        "image": engine_image(release, rollout),
        "imagePullPolicy": rollout.get("imagePullPolicy", "IfNotPresent"),
        "command": vllm_command(http_port, rollout, speculation),
        "env": _env(tracking_uri, credentials, rollout=rollout, defaults=defaults)
        + cpu_binding_env(release, rollout, _has_gpu(rollout)),  # vLLM split over CPU processes
        "volumeMounts": [*_mounts(rollout), socket_mount],
        "securityContext": _container_security(),
        # vLLM answers on its socket only: its health through the companion's port.
        "startupProbe": {**health, "periodSeconds": 10, "failureThreshold": 60},
        "livenessProbe": {**health, "periodSeconds": 20, "failureThreshold": 3},
    }
    companion = {
        "name": "companion",
        "image": engine_image(release, rollout),
        "imagePullPolicy": rollout.get("imagePullPolicy", "IfNotPresent"),
        "command": vllm_companion_command(http_port, control_port, rollout),
        # `metrics`: /metrics alone (vLLM's series and ours), the port our engine's pods name alike.
        "ports": [{"name": "http", "containerPort": http_port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
                  {"name": "control", "containerPort": control_port, "protocol": "TCP"}],
        "resources": {"requests": dict(COMPANION_REQUESTS)},
        "volumeMounts": [{"name": "release", "mountPath": RELEASE_DIR, "readOnly": True}, socket_mount,
                         {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}],
        "securityContext": _container_security(),
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 20, "failureThreshold": 3},
    }
    volumes = [{"name": "vllm-socket", "emptyDir": {}},
               {"name": "tls", "secret": {"secretName": engine_tls_secret_name(pair), "defaultMode": 0o440}}]
    ref = (rollout.get("auth") or {}).get("tokenSecretRef")
    if ref:
        # By reference: the kubelet mounts the key, the operator never reads it.
        volumes.append({"name": "auth", "secret": {"secretName": ref["name"], "defaultMode": 0o440,
                                                   "items": [{"key": ref.get("key") or "token", "path": "token"}]}})
        companion["volumeMounts"].append({"name": "auth", "mountPath": AUTH_DIR, "readOnly": True})
    return _engine_deployment_of(pair, namespace, release, digest, version, rollout, container, defaults, volumes,
                                 sidecars=[companion])


def rollout_strategy(rollout: dict[str, Any]) -> dict[str, Any]:
    """Surge a new pod before the old one goes, unless the engine holds accelerators: a GPU
    node pool rarely has a spare device, and a surge pod that cannot be scheduled would stall
    the rollout until its progress deadline. Then the old pod goes first (a short gap in
    serving per replica instead of a stuck rollout)."""
    if _has_gpu(rollout):
        return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def engine_service(pair: str, namespace: str, rollout: dict[str, Any], kind: str = "specpair") -> dict[str, Any]:
    port = int(rollout.get("port", 50051))
    http_port = int(rollout.get("httpPort", HTTP_PORT))
    if kind == "vllm":
        # The companion serves the API on `http` and /metrics also alone on `metrics`, as our
        # engine's pods do: the ServiceMonitor scrapes the same port name on both engines.
        http_port = http_port or HTTP_PORT
        return {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": engine_name(pair), "namespace": namespace, "labels": _labels(pair, "engine")},
            "spec": {"selector": engine_selector(pair),
                     "ports": [{"name": "http", "port": http_port, "targetPort": "http", "protocol": "TCP",
                                "appProtocol": "http"},
                               {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}]},
        }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": engine_name(pair), "namespace": namespace, "labels": _labels(pair, "engine")},
        "spec": {
            "selector": engine_selector(pair),
            # `metrics` is what the chart's ServiceMonitor scrapes; `http` is the OpenAI-compatible
            # API (appProtocol tells a gateway or mesh in front whether to speak TLS to it).
            "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
                      {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
                      *([{"name": "http", "port": http_port, "targetPort": "http", "protocol": "TCP",
                          "appProtocol": "https" if serving_tls(rollout) else "http"}] if http_port else [])],
        },
    }


# The engine's named container ports; a NetworkPolicy naming them follows rollout.port/httpPort.
ENGINE_PORT_NAMES = ("grpc", "http", "metrics")


def engine_network_policy(pair: str, namespace: str, defaults: PodDefaults = PodDefaults()) -> dict[str, Any]:
    """Ingress to the engine pods on their ports only (gRPC, HTTP, metrics), from the peers the
    chart names (engine.networkPolicy.from) or, when it names none, from anywhere; the control
    port from the operator's pods only (when the operator knows where it runs)."""
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": name} for name in ENGINE_PORT_NAMES]}
    if defaults.ingress_from:
        rule["from"] = [dict(peer) for peer in defaults.ingress_from]
    control: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": "control"}]}
    if defaults.operator_namespace:
        control["from"] = [{"namespaceSelector": {"matchLabels": {
                               "kubernetes.io/metadata.name": defaults.operator_namespace}},
                            **({"podSelector": {"matchLabels": dict(defaults.operator_pod_labels)}}
                               if defaults.operator_pod_labels else {})}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": engine_name(pair), "namespace": namespace, "labels": _labels(pair, "engine")},
        "spec": {"podSelector": {"matchLabels": engine_selector(pair)}, "policyTypes": ["Ingress"],
                 "ingress": [rule, control]},
    }


def gate_network_policy(pair: str, namespace: str) -> dict[str, Any]:
    """Gate pods listen on nothing: no ingress at all (they still reach MLflow and the hub)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": gate_policy_name(pair), "namespace": namespace, "labels": _labels(pair, "gate")},
        "spec": {"podSelector": {"matchLabels": {LABEL_PAIR: names.label_value(pair), LABEL_ROLE: "gate"}},
                 "policyTypes": ["Ingress"], "ingress": []},
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
