"""The operator's process-wide state: its clients (Kubernetes, MLflow, engine probes), the
installation's settings, per-pair memory (locks, backoff, drift samples) and the CA that issues
engine certificates. A restarted operator starts with none of it: all it needs is in the cluster
and MLflow."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field, fields
from typing import Any

from specpair_operator.policy import drift as drift_mod
from specpair_operator.desired import manifests
from specpair_operator.desired import tls as tls_mod
from specpair_operator.clients.engine_probe import ClientTLS, EngineProbe, GrpcEngineProbe, VllmProbe
from specpair_operator.clients.kube import Kube
from specpair_operator.clients.registry import ReleaseRegistry


def per_pair_memory() -> Any:
    """A field of per-pair memory, keyed by the pair's uid: forgotten when the pair is deleted
    (OperatorState.forget) and when the operator starts. Every dict of per-pair memory is one."""
    return field(default_factory=dict, metadata={"per_pair": True})


@dataclass
class OperatorState:
    """Process-wide clients and per-pair memory (locks, backoff, drift samples)."""
    tracking_uri: str = ""
    gate_tracking_uri: str = ""
    credentials: manifests.MlflowCredentials | None = None   # the installation's; a pair may name its own
    # The installation's settings for child pods (pull secrets, cache limit, ingress peers, gate TTL).
    pods: manifests.PodDefaults = field(default_factory=manifests.PodDefaults)
    kube: Kube | None = None
    registry: ReleaseRegistry | None = None
    probe: EngineProbe | None = None
    vllm_probe: EngineProbe = field(default_factory=VllmProbe)
    locks: dict[str, asyncio.Lock] = per_pair_memory()
    retry_at: dict[str, float] = per_pair_memory()
    backoff: dict[str, float] = per_pair_memory()
    # per pair: (champion version, drift.Memory: per-pod counters and open windows)
    samples: dict[str, tuple[str, drift_mod.Memory]] = per_pair_memory()
    # per pair: serving health's counters and windows (serving_health.ServingMemory)
    serving_samples: dict[str, Any] = per_pair_memory()
    canary_samples: dict[str, Any] = per_pair_memory()   # per pair: canary.Memory of its step
    last_drift_check: dict[str, float] = per_pair_memory()
    # per pair: the (version, categories) its specpair_release_speedup series carry
    speedup_series: dict[str, tuple[str, tuple[str, ...]]] = per_pair_memory()
    # Mutual TLS to engine control listeners (tls.py): the CA (re-read every CA_REFRESH_S) and
    # the operator's client certificate.
    operator_namespace: str = ""
    ca: tls_mod.KeyPair | None = None
    ca_read_at: float = 0.0
    client_cert: tls_mod.KeyPair | None = None
    ca_lock: asyncio.Lock | None = None
    tls_checked_at: dict[str, float] = per_pair_memory()  # per pair: its Secret last seen
    # per pair (uid): the latest body the watch delivered, for the periodic passes
    bodies: dict[str, dict[str, Any]] = per_pair_memory()
    periodic: asyncio.Task | None = None
    # pairs (uids) an owned Job or Deployment changed since the periodic loop last woke, and
    # its wake-up call (handlers.on_owned_event)
    woken: set[str] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # per pair: what the last pass that verified the champion read from MLflow, so its drift is
    # still judged while MLflow is down: (model, aliases, champion, tags, verdict, served hash)
    watch_cache: dict[str, tuple[str, dict[str, str], str, dict[str, str], dict[str, Any], str]] = \
        per_pair_memory()
    # per pair: the records (history, recorded) the last pass wrote, and until when a body that
    # does not show them is left alone
    status_written: dict[str, tuple[str, float]] = per_pair_memory()
    # per pair: when (monotonic) its next periodic pass is due (handlers.pass_delay)
    due_at: dict[str, float] = per_pair_memory()
    # per pair: the reads of its last full pass, which its settled passes replay
    # (clients/read_cache.PassReads)
    pass_reads: dict[str, Any] = per_pair_memory()
    # per pair: its engine Deployment as last rendered, with what it was rendered from
    # (ServingWorld.rendered; plan/serving_steps.rendered_engine renders again when that changed)
    renders: dict[str, dict[str, Any]] = per_pair_memory()
    # Whether KEDA's ScaledObject is served, and when that was last asked (autoscaling.py)
    keda_seen: tuple[bool, float] | None = None

    def per_pair(self) -> list[dict[str, Any]]:
        """Every per-pair memory (the fields made with per_pair_memory)."""
        return [getattr(self, f.name) for f in fields(self) if f.metadata.get("per_pair")]

    def forget(self, uid: str) -> None:
        """A deleted pair: none of its memory stays (a pair made again later starts afresh)."""
        for memory in self.per_pair():
            memory.pop(uid, None)
        self.woken.discard(uid)

    def forget_all(self) -> None:
        """A (re)started operator remembers nothing: all it needs is in the cluster and MLflow."""
        for memory in self.per_pair():
            memory.clear()
        self.woken.clear()


STATE = OperatorState()
CA_REFRESH_S = 300.0
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class ControlTLSError(Exception):
    """The CA Secret exists but cannot sign (not a CA, a key that does not match, expired)."""


def operator_namespace(env: dict[str, str] | None = None) -> str:
    env = dict(os.environ) if env is None else env
    if env.get("SPECPAIR_OPERATOR_NAMESPACE"):
        return env["SPECPAIR_OPERATOR_NAMESPACE"].strip()
    try:
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip()
    except OSError:
        return ""


async def read_control_ca(state: OperatorState) -> tls_mod.KeyPair | None:
    """The CA engine certificates are issued from, read from the CA Secret in the operator's
    namespace and kept with the operator's client certificate; re-read now and then so a CA
    rotated by cert-manager (or by hand) is picked up. None: there is none (observe never writes;
    the serving plan then plans CreateControlCA, which act/control_ca.py carries out)."""
    if state.ca_lock is None:
        state.ca_lock = asyncio.Lock()
    async with state.ca_lock:
        if state.ca is not None and time.monotonic() - state.ca_read_at < CA_REFRESH_S:
            return state.ca
        secret = await state.kube.get("v1", "secrets", state.operator_namespace, tls_mod.CA_SECRET)
        return None if secret is None else use_control_ca(state, secret)


def use_control_ca(state: OperatorState, secret: dict[str, Any]) -> tls_mod.KeyPair:
    """The CA in `secret` (the CA Secret, read or just created) kept as the one engine certificates
    are issued from, with a client certificate from it for the engine probes' mutual TLS."""
    import base64

    data = secret.get("data") or {}
    ca = tls_mod.KeyPair(base64.b64decode(data.get("tls.crt", "")), base64.b64decode(data.get("tls.key", "")))
    why = tls_mod.check_ca(ca)
    if why:
        raise ControlTLSError(f"Secret {state.operator_namespace}/{tls_mod.CA_SECRET} cannot issue engine "
                              f"certificates: {why}")
    state.ca, state.ca_read_at = ca, time.monotonic()
    client = state.client_cert
    if client is None or tls_mod.reissue_reason(client.cert_pem, ca.cert_pem, ca, (), renew_days=tls_mod.CLIENT_RENEW_DAYS):
        client = state.client_cert = tls_mod.issue(ca, tls_mod.OPERATOR_NAME, server=False, days=tls_mod.CLIENT_DAYS)
    for probe in (state.probe, state.vllm_probe):     # vLLM pods: their companion's control port
        if isinstance(probe, GrpcEngineProbe):
            probe.tls = ClientTLS(ca=ca.cert_pem, cert=client.cert_pem, key=client.key_pem)
    return ca
