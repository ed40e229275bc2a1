"""The engine's objects: its Deployment (our engine, or vLLM with its companion; a shadow
candidate's release beside the champion's), its Service and NetworkPolicy, the command lines, and
how far a Deployment's rollout to a release has got."""

from __future__ import annotations

import json
from typing import Any

from specpair.vllm_parallel import cpu_binding_env, start_budget_seconds
from specpair.vllm_serve import VLLM_SOCKET, VLLM_SOCKET_DIR

from specpair_operator.crd.schema import has_gpu
from specpair_operator.release import content as release_mod
from specpair_operator.desired.pod_shutdown import shutdown_of
from specpair_operator.desired.manifests import (ANN_HASH, ANN_SHADOW_RELEASE, AUTH_DIR, COMPANION_REQUESTS,
                                                 CONTROL_PORT, HTTP_PORT, METRICS_PORT, RELEASE_DIR, RELEASE_FILE,
                                                 SHADOW_RELEASE_FILE, TLS_DIR, MlflowCredentials, PodDefaults,
                                                 container_security, engine_image, engine_name, engine_selector,
                                                 engine_tls_secret_name, pod_env, pod_labels, pod_mounts,
                                                 pod_resources, pod_spec, release_annotations, shm_mounts,
                                                 shm_volumes)


def serving_tls(rollout: dict[str, Any]) -> bool:
    """rollout.tls.enabled: the serving ports speak TLS (our engine's; a vLLM pod's companion's HTTP port)."""
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


def vllm_command(http_port: int, rollout: dict[str, Any], speculation: bool = True) -> list[str]:
    """vLLM's OpenAI server for the release file the pod mounts (specpair.vllm_serve resolves the
    models and builds vLLM's flags from the release), on the Unix socket the pod's companion
    fronts. No GPU: eager mode (compiling for the CPU takes minutes at every start).
    rollout.maxBatchSize is vLLM's --max-num-seqs (the requests it runs together; more wait in its
    queue), as it is our engine's --max-batch-size: a pod's setting, outside the release."""
    batch = ["--max-num-seqs", str(int(rollout["maxBatchSize"]))] if rollout.get("maxBatchSize") is not None else []
    # The companion's stop delay and drain: vLLM is sent SIGTERM only once the companion drained.
    return ["python", "-m", "specpair.vllm_serve", "--release", RELEASE_FILE, "--uds", VLLM_SOCKET,
            *([] if speculation else ["--no-speculation"]),
            *([] if has_gpu(rollout) else ["--enforce-eager"]), *batch, *shutdown_of(rollout).engine_flags()]


def vllm_companion_command(http_port: int, control_port: int, rollout: dict[str, Any]) -> list[str]:
    """The pod's companion (specpair.vllm_companion): the pair's HTTP port in front of vLLM's
    socket, the bearer token where rollout.auth names one, TLS with the pair's engine certificate
    where rollout.tls is on (as our engine's serving ports: the companion re-reads it when the
    operator renews it), and GetStats on the control port (mutual TLS, the same certificate)."""
    token = ["--auth-token-file", f"{AUTH_DIR}/token"] if (rollout.get("auth") or {}).get("tokenSecretRef") else []
    tls = ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"] if serving_tls(rollout) else []
    return ["python", "-m", "specpair.vllm_companion", "--release", RELEASE_FILE, "--uds", VLLM_SOCKET,
            "--host", "0.0.0.0", "--port", str(http_port), *token, *tls, "--metrics-port", str(METRICS_PORT),
            "--control-port", str(control_port), "--control-tls-cert", f"{TLS_DIR}/tls.crt",
            "--control-tls-key", f"{TLS_DIR}/tls.key", "--control-tls-client-ca", f"{TLS_DIR}/ca.crt",
            *shutdown_of(rollout).engine_flags()]


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
        "command": engine_command(release, port, http_port, control_port, tls) + engine_limit_flags(rollout)
        + shutdown_of(rollout).engine_flags(),
        "ports": [{"name": "grpc", "containerPort": port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
                  {"name": "control", "containerPort": control_port, "protocol": "TCP"},
                  *([{"name": "http", "containerPort": http_port, "protocol": "TCP"}] if http_port else [])],
        "env": pod_env(tracking_uri, credentials, rollout=rollout, defaults=defaults),
        "volumeMounts": [*pod_mounts(rollout), {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}],
        "securityContext": container_security(),
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


# How long the kubelet waits for an engine's health answer (its default: 1 s). A serving engine on
# a busy CPU node answers late, not never: with 1 s, three late answers in a row restarted a
# working engine, failing the requests in flight and, until its readiness caught up, those still
# sent to a pod listed Ready (the canary e2e test on the devcluster at load). Liveness restarts
# only a process silent for its whole timeout at three periods running; readiness still takes a
# slow pod out of the endpoints, but not one merely late by a second.
READINESS_TIMEOUT_S = 5
LIVENESS_TIMEOUT_S = 10


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
            "readinessProbe": {**probe, "periodSeconds": 5, "timeoutSeconds": READINESS_TIMEOUT_S},
            "livenessProbe": {**probe, "periodSeconds": 20, "failureThreshold": 3,
                              "timeoutSeconds": LIVENESS_TIMEOUT_S}}


def _engine_deployment_of(pair: str, namespace: str, release: dict[str, Any], digest: str, version: str,
                          rollout: dict[str, Any], container: dict[str, Any], defaults: PodDefaults,
                          extra_volumes: list[dict[str, Any]] = (),  # type: ignore[assignment]
                          sidecars: list[dict[str, Any]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    """The Deployment around an engine container (ours or vLLM's): what both engines share.
    `sidecars`: containers beside it (vLLM's companion), given as they are."""
    if rollout.get("resources"):
        container["resources"] = pod_resources(release, rollout)
    container["volumeMounts"] = [*container["volumeMounts"], *shm_mounts(release)]
    extra_volumes = [*extra_volumes, *shm_volumes(release)]
    labels = pod_labels(pair, "engine", version)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": engine_name(pair), "namespace": namespace, "labels": labels,
                     "annotations": {ANN_HASH: digest}},
        "spec": {
            "replicas": int(rollout.get("replicas", 1)),
            "selector": {"matchLabels": engine_selector(pair)},
            "progressDeadlineSeconds": int(rollout.get("progressDeadlineSeconds", 600)),
            "strategy": rollout_strategy(rollout, release_mod.engine_kind(release)),
            "template": {
                "metadata": {"labels": labels, "annotations": release_annotations(release, digest)},
                "spec": {"containers": [container, *sidecars],
                         # The stop delay and the drain, then the exit (pod_shutdown.py).
                         "terminationGracePeriodSeconds": shutdown_of(rollout).grace_period,
                         **pod_spec(rollout, defaults, extra_volumes=list(extra_volumes))},
            },
        },
    }


# Seconds between a vLLM container's startup probes (its budget: vllm_parallel.start_budget_seconds).
STARTUP_PERIOD_S = 10


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
    # rollout.tls: the companion's port speaks HTTPS, and so do the kubelet's probes of it (they
    # do not verify the certificate); /health needs no token.
    scheme = {"scheme": "HTTPS"} if serving_tls(rollout) else {}
    health = {"httpGet": {"path": "/health", "port": http_port, **scheme}}
    container = {
        "name": "engine",
        "image": engine_image(release, rollout),
        "imagePullPolicy": rollout.get("imagePullPolicy", "IfNotPresent"),
        "command": vllm_command(http_port, rollout, speculation),
        "env": pod_env(tracking_uri, credentials, rollout=rollout, defaults=defaults)
        + cpu_binding_env(release, rollout, has_gpu(rollout)),  # vLLM split over CPU processes
        "volumeMounts": [*pod_mounts(rollout), socket_mount],
        "securityContext": container_security(),
        # vLLM answers on its socket only: its health through the companion's port. A split
        # target starts a process a rank: as long as the gate lets its servers take.
        "startupProbe": {**health, "periodSeconds": STARTUP_PERIOD_S,
                         "failureThreshold": start_budget_seconds(release) // STARTUP_PERIOD_S},
        "livenessProbe": {**health, "periodSeconds": 20, "failureThreshold": 3, "timeoutSeconds": LIVENESS_TIMEOUT_S},
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
        "securityContext": container_security(),
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5,
                           "timeoutSeconds": READINESS_TIMEOUT_S},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 20, "failureThreshold": 3,
                          "timeoutSeconds": LIVENESS_TIMEOUT_S},
    }
    companion["readinessProbe"]["httpGet"].update(scheme)
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


def rollout_strategy(rollout: dict[str, Any], kind: str = "specpair") -> dict[str, Any]:
    """Surge a new pod before the old one goes, unless the engine holds accelerators: a GPU
    node pool rarely has a spare device, and a surge pod that cannot be scheduled would stall
    the rollout until its progress deadline. Then the old pod goes first (a short gap in
    serving per replica instead of a stuck rollout).

    Except a vLLM pair of one replica on GPUs: it switches speculation by a rollout (vLLM has no
    runtime switch), and its only pod going first would leave the pair unserved at every drift
    step. It surges: the new pod waits Pending for a free device while the old one serves on."""
    if has_gpu(rollout):
        if kind == "vllm" and int(rollout.get("replicas") or 1) <= 1:
            return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
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
            "metadata": {"name": engine_name(pair), "namespace": namespace, "labels": pod_labels(pair, "engine")},
            "spec": {"selector": engine_selector(pair),
                     "ports": [{"name": "http", "port": http_port, "targetPort": "http", "protocol": "TCP",
                                "appProtocol": "https" if serving_tls(rollout) else "http"},
                               {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}]},
        }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": engine_name(pair), "namespace": namespace, "labels": pod_labels(pair, "engine")},
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
        "metadata": {"name": engine_name(pair), "namespace": namespace, "labels": pod_labels(pair, "engine")},
        "spec": {"podSelector": {"matchLabels": engine_selector(pair)}, "policyTypes": ["Ingress"],
                 "ingress": [rule, control]},
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
