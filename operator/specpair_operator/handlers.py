"""Kopf handlers: one level-triggered reconcile for SpecModelPair, run on changes and periodically.

Each pass reads the world (the pair, MLflow, the gate Job, the engine Deployment and pods),
decides with the pure modules, and takes at most the next step. Every step is idempotent, so
an operator killed anywhere converges when restarted: releases are found by content hash,
Jobs and Deployments by name, aliases are moved in a crash-safe order (see aliases.py).
The operator writes status, annotations (Kopf's bookkeeping) and Events, never spec.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import kopf
from mlflow.exceptions import MlflowException

from specpair.stats import RequestMoments

from . import aliases as aliases_mod
from . import conditions as c
from . import drift as drift_mod
from . import gate_attempts, gate_verdict, leadership, manifests, names, validation
from . import metrics
from . import release as release_mod
from . import tls as tls_mod
from .engine_probe import ClientTLS, EngineProbe, EngineUnreachable, GrpcEngineProbe, VllmProbe
from .kube import Kube, KubeError
from .registry import (ModelClaimed, TAG_GATE_RUN, TAG_HASH, TAG_ROLLED_BACK, TAG_TOKENIZER_DRAFT, TAG_TOKENIZER_TARGET,
                       RegistryUnavailable, ReleaseRegistry)

GROUP, VERSION, PLURAL = "specpair.io", "v1alpha1", "specmodelpairs"
TAG_RELEASE = "specpair.release"
# Written before the alias moves they stand for, so a pass that dies after the moves leaves
# the mark behind and the next pass records the action (history, Event) it did not get to.
TAG_PROMOTED_AT = "specpair.promoted_at"
TAG_SPECULATION_OFF = "specpair.drift.speculation_off"
ANN_MANIFEST = "specpair.io/manifest-hash"
HISTORY_LIMIT = 20
RECORDED_KEYS = 10  # per action in status.recorded
# Container states that wait on a person (a Secret, a key, an image), not on time.
STUCK_CONTAINER_REASONS = ("CreateContainerConfigError", "ErrImagePull", "ImagePullBackOff", "InvalidImageName")


@dataclass
class Runtime:
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
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    retry_at: dict[str, float] = field(default_factory=dict)
    backoff: dict[str, float] = field(default_factory=dict)
    # per pair: (champion version, drift.Memory: per-pod counters and open windows)
    samples: dict[str, tuple[str, drift_mod.Memory]] = field(default_factory=dict)
    last_drift_check: dict[str, float] = field(default_factory=dict)
    # per pair: the (version, categories) its specpair_release_speedup series carry
    speedup_series: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    # Mutual TLS to engine control listeners (tls.py): the CA (re-read every CA_REFRESH_S) and
    # the operator's client certificate.
    operator_namespace: str = ""
    ca: tls_mod.KeyPair | None = None
    ca_read_at: float = 0.0
    client_cert: tls_mod.KeyPair | None = None
    ca_lock: asyncio.Lock | None = None
    tls_checked_at: dict[str, float] = field(default_factory=dict)  # per pair: its Secret last seen
    # per pair (uid): the latest body the watch delivered, for the periodic passes
    bodies: dict[str, dict[str, Any]] = field(default_factory=dict)
    periodic: asyncio.Task | None = None
    # per pair: what the last pass that verified the champion read from MLflow, so its drift is
    # still judged while MLflow is down: (model, aliases, champion, tags, verdict, served hash)
    watch_cache: dict[str, tuple[str, dict[str, str], str, dict[str, str], dict[str, Any], str]] = \
        field(default_factory=dict)
    # per pair: the resourceVersion of the body a pass read before writing status, and until when
    # a body of that version counts as older than that status
    status_written: dict[str, tuple[str | None, float]] = field(default_factory=dict)


RUNTIME = Runtime()
CA_REFRESH_S = 300.0
# How long a body the last status write has overtaken is left alone (a write that failed is not
# waited on longer than this).
STALE_BODY_S = 10.0
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


async def control_ca(rt: Runtime) -> tls_mod.KeyPair:
    """The CA engine certificates are issued from, and the operator's client certificate: read
    from (or first written to) the CA Secret in the operator's namespace, re-read now and then so
    a CA rotated by cert-manager (or by hand) is picked up."""
    import base64

    if rt.ca_lock is None:
        rt.ca_lock = asyncio.Lock()
    async with rt.ca_lock:
        if rt.ca is not None and time.monotonic() - rt.ca_read_at < CA_REFRESH_S:
            return rt.ca
        secret = await rt.kube.get("v1", "secrets", rt.operator_namespace, tls_mod.CA_SECRET)
        if secret is None:
            ca = tls_mod.new_ca()
            secret = await rt.kube.create({
                "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                "metadata": {"name": tls_mod.CA_SECRET, "namespace": rt.operator_namespace,
                             "labels": {"app.kubernetes.io/managed-by": "specpair-operator"}},
                "data": {"tls.crt": base64.b64encode(ca.cert_pem).decode(),
                         "tls.key": base64.b64encode(ca.key_pem).decode()}})  # a racing replica's wins (409)
        data = secret.get("data") or {}
        ca = tls_mod.KeyPair(base64.b64decode(data.get("tls.crt", "")), base64.b64decode(data.get("tls.key", "")))
        why = tls_mod.check_ca(ca)
        if why:
            raise ControlTLSError(f"Secret {rt.operator_namespace}/{tls_mod.CA_SECRET} cannot issue engine "
                                  f"certificates: {why}")
        rt.ca, rt.ca_read_at = ca, time.monotonic()
        client = rt.client_cert
        if client is None or tls_mod.reissue_reason(client.cert_pem, ca.cert_pem, ca, (), renew_days=tls_mod.CLIENT_RENEW_DAYS):
            client = rt.client_cert = tls_mod.issue(ca, tls_mod.OPERATOR_NAME, server=False, days=tls_mod.CLIENT_DAYS)
        if isinstance(rt.probe, GrpcEngineProbe):
            rt.probe.tls = ClientTLS(ca=ca.cert_pem, cert=client.cert_pem, key=client.key_pem)
        return ca


def reconcile_interval() -> float:
    return float(os.environ.get("SPECPAIR_RECONCILE_INTERVAL", "10"))


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Annotations, not status: status belongs to the CRD's documented fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="specpair.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="specpair.io", key="last-handled-configuration")
    settings.posting.level = logging.INFO
    # No cluster-wide watching of CRDs and namespaces: the chart installs the CRD before the
    # operator starts and names the namespaces, so the least-privilege RBAC needs neither.
    settings.scanning.disabled = True
    settings.watching.server_timeout = int(os.environ.get("SPECPAIR_WATCH_TIMEOUT", "300"))
    settings.networking.error_backoffs = [0.5, 1, 2, 5]
    RUNTIME.tracking_uri = os.environ.get("SPECPAIR_MLFLOW_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not RUNTIME.tracking_uri:
        raise kopf.PermanentError("set SPECPAIR_MLFLOW_TRACKING_URI (or MLFLOW_TRACKING_URI)")
    RUNTIME.gate_tracking_uri = os.environ.get("SPECPAIR_GATE_MLFLOW_TRACKING_URI", RUNTIME.tracking_uri)
    # A Secret (expected in each pair's namespace) with MLflow credentials for gate and engine
    # pods, and its keys; a pair's spec.mlflow.credentialsSecretRef takes precedence.
    try:
        RUNTIME.credentials = manifests.MlflowCredentials.from_env(os.environ)
    except ValueError as exc:
        raise kopf.PermanentError(str(exc)) from exc
    # The chart's engine.* and gate.* values: the image for pairs that name none (it goes into
    # their releases), pull secrets, the model cache limit, who may reach engine pods.
    release_mod.set_default_engine_image(os.environ.get("SPECPAIR_ENGINE_IMAGE"))
    try:
        RUNTIME.pods = manifests.PodDefaults.from_env(os.environ)
        gate_attempts.Policy.from_env(os.environ)  # read again where used; refused here when malformed
    except ValueError as exc:
        raise kopf.PermanentError(str(exc)) from exc
    RUNTIME.registry = ReleaseRegistry(RUNTIME.tracking_uri)
    # A (re)started operator remembers nothing: all it needs is in the cluster and MLflow.
    for memory in (RUNTIME.locks, RUNTIME.retry_at, RUNTIME.backoff, RUNTIME.samples, RUNTIME.last_drift_check,
                   RUNTIME.speedup_series, RUNTIME.watch_cache, RUNTIME.bodies, RUNTIME.tls_checked_at,
                   RUNTIME.status_written):
        memory.clear()
    RUNTIME.probe = GrpcEngineProbe()
    RUNTIME.operator_namespace = operator_namespace()
    if not RUNTIME.operator_namespace:
        raise kopf.PermanentError("set SPECPAIR_OPERATOR_NAMESPACE: the namespace of the operator's CA Secret "
                                  f"({tls_mod.CA_SECRET}); in a pod it is read from the service account")
    RUNTIME.ca, RUNTIME.client_cert, RUNTIME.ca_lock = None, None, None
    metrics.serve_from_env()
    RUNTIME.periodic = asyncio.create_task(periodic_passes(reconcile_interval()))


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Kopf's own credential discovery, shared with the operator's client for child objects."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        RUNTIME.kube = Kube.from_connection_info(info)
    return info


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if RUNTIME.periodic is not None:
        RUNTIME.periodic.cancel()
        try:
            await RUNTIME.periodic
        except (asyncio.CancelledError, Exception):  # noqa: BLE001  (stopping; it logged its own errors)
            pass
        RUNTIME.periodic = None
    if RUNTIME.kube is not None:
        await RUNTIME.kube.close()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def on_change(body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
    await reconcile(body, patch, logger, force=True)


# The periodic pass. Not a Kopf timer: Kopf puts a finalizer on every object a timer watches,
# so with the operator uninstalled or scaled to zero, deleting a pair (or its namespace) would
# hang in Terminating. Instead the watch keeps the latest body of each pair (on.event needs no
# finalizer) and one operator-level loop reconciles them all; deleting a pair never waits for us,
# and the garbage collector removes its children through their owner references.
@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_event(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002  (Kopf's kwarg name)
    uid = body.metadata.uid
    if type == "DELETED":
        RUNTIME.bodies.pop(uid, None)
        for memory in (RUNTIME.locks, RUNTIME.retry_at, RUNTIME.backoff, RUNTIME.samples,
                       RUNTIME.last_drift_check, RUNTIME.speedup_series, RUNTIME.watch_cache,
                       RUNTIME.tls_checked_at, RUNTIME.status_written):
            memory.pop(uid, None)
    else:
        RUNTIME.bodies[uid] = json.loads(json.dumps(dict(body)))


class _PairLogger(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['pair']}] {msg}", kwargs


async def periodic_passes(interval: float) -> None:
    """Every `interval` seconds, a pass over each known pair, a few at a time. A pass that fails
    unexpectedly is logged; the loop goes on (the next tick tries again)."""
    log = logging.getLogger("specpair.operator.periodic")
    limit = asyncio.Semaphore(int(os.environ.get("SPECPAIR_CONCURRENT_PASSES", "8")))

    async def one(raw: dict[str, Any]) -> None:
        async with limit:
            if raw["metadata"].get("deletionTimestamp") or RUNTIME.kube is None:
                return
            body, patch = kopf.Body(raw), kopf.Patch()
            meta = raw["metadata"]
            logger = _PairLogger(log, {"pair": f"{meta['namespace']}/{meta['name']}"})
            try:
                await reconcile(body, patch, logger)  # type: ignore[arg-type]
                if patch.status:
                    await RUNTIME.kube.merge_patch(f"{GROUP}/{VERSION}", PLURAL, meta["namespace"], meta["name"],
                                                   {"status": dict(patch.status)}, subresource="status")
            except KubeError as exc:
                if exc.status != 404:  # deleted meanwhile: its DELETED event is on its way
                    log.warning(f"periodic pass over {meta['namespace']}/{meta['name']}: {exc}")
            except Exception:  # noqa: BLE001  (a bug must not stop every pair's passes)
                log.exception(f"periodic pass over {meta['namespace']}/{meta['name']} failed")

    while True:
        await asyncio.sleep(interval)
        await asyncio.gather(*(one(raw) for raw in list(RUNTIME.bodies.values())))


async def reconcile(body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, force: bool = False) -> None:
    uid = body.metadata.uid
    lock = RUNTIME.locks.setdefault(uid, asyncio.Lock())
    if lock.locked():
        return  # the other trigger is on it; level-triggered, so nothing is lost
    async with lock:
        if not force and time.monotonic() < RUNTIME.retry_at.get(uid, 0.0):
            return
        if not leadership.acting():
            return  # an elected operator whose Lease lapsed: it is about to exit, the next leader acts
        version = body.metadata.get("resourceVersion")
        written = RUNTIME.status_written.get(uid)
        if written is not None and written[0] == version and time.monotonic() < written[1]:
            # This body predates the status the last pass wrote (the watch has not delivered it
            # yet): a pass on it would take that status's records for undone and repeat them.
            return
        await Pass(body, patch, logger).run()
        if patch.status:
            RUNTIME.status_written[uid] = (version, time.monotonic() + STALE_BODY_S)


class Pass:
    """One reconcile pass over one pair; collects status changes and writes them once."""

    def __init__(self, body: kopf.Body, patch: kopf.Patch, logger: logging.Logger):
        self.body, self.patch, self.logger = body, patch, logger
        self.name, self.namespace = body.metadata.name, body.metadata.namespace
        self.uid = body.metadata.uid
        self.spec: dict[str, Any] = json.loads(json.dumps(dict(body.spec)))
        self.status: dict[str, Any] = json.loads(json.dumps(dict(body.status)))
        self.gen = body.metadata.get("generation")
        self.conds: list[dict[str, Any]] = list(self.status.get("conditions") or [])
        self.history: list[dict[str, Any]] = list(self.status.get("history") or [])
        # action -> keys of the last ones recorded (history + Event), so a redone step records once
        self.recorded: dict[str, list[str]] = {k: list(v) for k, v in (self.status.get("recorded") or {}).items()
                                               if isinstance(v, list)}
        self.out: dict[str, Any] = {}
        self.rt = RUNTIME
        self.rollout = self.spec.get("rollout") or {}
        self.watching = False  # the champion is watched while the spec's release is elsewhere
        self.registry_down = False  # judging drift from the last MLflow facts while MLflow is down
        self.gate_jobs: dict[str, list[dict[str, Any]]] = {}  # per release: its gate Jobs, one per attempt
        self.events: list[tuple[str, str, str]] = []  # (type, reason, message), posted when the pass ends
        self.kind = "specpair"  # the serving release's engine (set by _serve from the champion's release)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    async def _post_events(self) -> None:
        """Events go out after the pass, like Kopf's own queue: a pass that dies posts none, and
        the status's `recorded` keys make the redone step post its Event once."""
        involved = {"apiVersion": self.body.get("apiVersion", f"{GROUP}/{VERSION}"),
                    "kind": self.body.get("kind", "SpecModelPair"), "metadata": dict(self.body.metadata)}
        for type_, reason, message in self.events:
            try:
                await self.rt.kube.event(involved, type_, reason, message)
            except (KubeError, OSError, asyncio.TimeoutError) as exc:
                self.logger.warning(f"Event {reason} not posted: {exc}")
        self.events.clear()

    # -- small helpers -------------------------------------------------------------------

    def cond(self, type_: str, status: bool | str, reason: str, message: str) -> None:
        self.conds = c.set_condition(self.conds, type_, status, reason, message, self.gen)

    def finish(self, phase: str, ready: tuple[bool, str, str], reconciling: tuple[bool, str, str],
               stalled: tuple[bool, str, str]) -> None:
        self.conds = c.summary(self.conds, self.gen, ready=ready, reconciling=reconciling, stalled=stalled)
        message = next(m for ok, _, m in (stalled, reconciling, ready) if ok) if (stalled[0] or reconciling[0]) else ready[2]
        self.out.update(phase=phase, message=message, observedGeneration=self.gen, conditions=self.conds,
                        history=self.history[-HISTORY_LIMIT:], recorded=self.recorded)
        for k, v in self.out.items():
            if self.status.get(k) != v:
                self.patch.status[k] = v
        if isinstance(self.out.get("drift"), dict):
            metrics.DRIFT_STEP.labels(self.namespace, self.name).set(int(self.out["drift"].get("stepsTaken", 0)))

    def record(self, action: str, reason: str, from_version: str | None, to_version: str | None,
               warning: bool = False, key: str | None = None) -> None:
        if key is not None:
            self.recorded[action] = (self.recorded.get(action, []) + [key])[-RECORDED_KEYS:]
        self.history.append({"time": c.now_iso(), "action": action, "fromVersion": from_version or "",
                             "toVersion": to_version or "", "reason": reason})
        self.event("Warning" if warning else "Normal", action, reason)
        self.logger.info(f"{action}: {reason}")
        labels = (self.namespace, self.name)
        if action == "Promoted":
            metrics.PROMOTIONS.labels(*labels).inc()
        elif action == "RolledBack":
            metrics.ROLLBACKS.labels(*labels, metrics.rollback_cause(reason)).inc()
        elif action == "SpeculationOff":
            metrics.SPECULATION_OFF.labels(*labels).inc()

    def credentials(self) -> manifests.MlflowCredentials | None:
        return manifests.MlflowCredentials.for_pair(self.spec.get("mlflow"), self.rt.credentials)

    def was_recorded(self, action: str, key: str, version: str) -> bool:
        """Whether the action identified by `key` is in the status already. (A status written
        before `recorded` existed counts the last such history entry for the same version.)"""
        if "recorded" in self.status:
            return key in self.recorded.get(action, [])
        last = next((h for h in reversed(self.history) if h.get("action") == action), None)
        return last is not None and str(last.get("toVersion")) == str(version)

    async def registry(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    # -- the pass --------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._pass()
        finally:
            # The API server refuses a whole status patch over one NaN or Infinity (JSON has
            # neither): such a number becomes null, and the rest of the status is written.
            for key, value in list(self.patch.status.items()):
                safe = c.finite(value)
                if safe is not value:
                    self.logger.warning(f"status.{key} held a number JSON cannot carry; written as null")
                    self.patch.status[key] = safe
            await self._post_events()

    async def _pass(self) -> None:
        try:
            await self._run()
        except MlflowException as exc:
            # MLflow answered and refused (bad name, credentials, a value over its limits): retrying
            # the same request changes nothing, so say so where people look, and retry slowly.
            self.rt.retry_at[self.uid] = time.monotonic() + 60.0
            metrics.RECONCILE_ERRORS.labels(self.namespace, self.name, "MLflowRejected").inc()
            self._stall("MLflowRejected", f"MLflow refused a request: {str(exc)[:800]}")
            self.out.setdefault("observedGeneration", self.gen)
            self.logger.error(f"MLflow refused a request: {exc}")
            return
        except (RegistryUnavailable, KubeError) as exc:
            if isinstance(exc, KubeError) and exc.permanent:
                self._refused(exc)
                return
            # Transient: back off (1 s doubling to 60 s) and let a later pass redo the steps.
            reason = "MLflowUnavailable" if isinstance(exc, RegistryUnavailable) else "KubernetesAPIError"
            delay = min(60.0, self.rt.backoff.get(self.uid, 0.5) * 2)
            self.rt.backoff[self.uid] = delay
            metrics.RECONCILE_ERRORS.labels(self.namespace, self.name, reason).inc()
            self.rt.retry_at[self.uid] = time.monotonic() + delay
            if isinstance(exc, RegistryUnavailable):
                await self._watch_while_registry_down()
            self.cond(c.RECONCILING, True, reason, f"{exc}; retrying in {delay:.0f}s")
            if self.history != list(self.status.get("history") or []):
                self.out.update(history=self.history[-HISTORY_LIMIT:], recorded=self.recorded)
            self.out.update(conditions=self.conds, observedGeneration=self.gen,
                            message=f"{reason}, retrying in {delay:.0f}s (nothing half-promoted: steps are redone)")
            for k, v in self.out.items():
                self.patch.status[k] = v
            self.logger.warning(f"{reason}, retry in {delay:.0f}s: {exc}")
            return
        self.rt.backoff.pop(self.uid, None)
        self.rt.retry_at.pop(self.uid, None)

    def _refused(self, exc: KubeError) -> None:
        """The API server refused a request for good (400, 403, 422: an invalid quantity, a name
        it does not accept, a policy): Stalled with its words, retried slowly (a changed spec
        is reconciled at once)."""
        self.rt.retry_at[self.uid] = time.monotonic() + 60.0
        self.rt.backoff.pop(self.uid, None)
        metrics.RECONCILE_ERRORS.labels(self.namespace, self.name, "KubernetesAPIRefused").inc()
        self._stall("KubernetesAPIRefused", f"the Kubernetes API refused a request (HTTP {exc.status}): "
                    f"{exc.message[:800]}")
        self.logger.error(f"the Kubernetes API refused a request: {exc}")

    async def _watch_while_registry_down(self) -> None:
        """MLflow is down, serving is not: keep judging the champion's drift on what MLflow said
        last. Only the protective first step (SpeculationOff) can be taken; promotion, rollback
        and SpeculationOn wait for MLflow."""
        cached = self.rt.watch_cache.get(self.uid)
        if cached is None:
            return
        model, al, champion, tags, verdict, served_hash = cached
        self.registry_down = True
        self.kind = release_mod.engine_kind(json.loads(tags.get(TAG_RELEASE) or "{}"))
        try:
            pods = await self._engine_pods()
            ok, _, infos = await self._verify_identity(pods, champion, served_hash, tags)
            if ok:
                await self._drift(model, al, champion, verdict, tags, pods, infos)
                await self._reconcile_speculation(champion, pods, infos)
        except (KubeError, EngineUnreachable) as exc:
            self.logger.warning(f"drift check while MLflow is down skipped: {exc}")

    async def _resolve_prompts(self) -> list[dict[str, Any]]:
        gating = self.spec.get("gating") or {}
        prompts = list(gating.get("prompts") or [])
        ref = gating.get("configMapRef")
        if ref:
            cm = await self.rt.kube.get("v1", "configmaps", self.namespace, ref["name"])
            key = ref.get("key") or "prompts.jsonl"
            if cm is None or key not in (cm.get("data") or {}):
                raise ValueError(f"ConfigMap {ref['name']} (key {key}) with golden prompts not found")
            prompts += release_mod.parse_prompt_lines(cm["data"][key])
        return prompts or release_mod.builtin_prompts()

    def _stall(self, reason: str, message: str) -> None:
        """A state no retry fixes until someone changes something: Stalled, with an Event once."""
        if self.status.get("message") != message:
            self.event("Warning", reason, message[:1000])
        self.finish("Failed", (False, reason, message), (False, reason, ""), (True, reason, message))

    async def _run(self) -> None:
        invalid = validation.validate_spec(self.spec)
        if invalid:
            # The CRD refuses these; a spec that got past it (an older CRD) must not crash-loop.
            self._stall("InvalidSpec", "the spec is invalid: " + "; ".join(invalid))
            return
        try:
            prompts = await self._resolve_prompts()
        except (ValueError, OSError) as exc:
            self.finish("Failed", (False, "PromptsUnavailable", str(exc)), (False, "PromptsUnavailable", str(exc)),
                        (True, "PromptsUnavailable", str(exc)))
            return
        rel = release_mod.build_release(self.name, self.namespace, self.spec, prompts)
        digest = release_mod.content_hash(rel)
        model = release_mod.effective_model_name(self.name, self.namespace, self.spec)
        reg = self.rt.registry
        self.out["modelName"] = model
        try:
            await self.registry(reg.ensure_model, model, f"{self.namespace}/{self.name}", self.uid)
        except ModelClaimed as exc:
            self._stall("ModelOwnedByAnotherPair", f"{exc}; name another in spec.mlflow.modelName")
            return
        version = await self.registry(self._ensure_release, reg, model, rel, digest)
        al = await self.registry(reg.aliases, model)
        tags = await self.registry(reg.version_tags, model, version)
        self.out.update(candidateVersion=version, contentHash=digest)

        if tags.get(TAG_ROLLED_BACK):
            # This release was rolled back; it stays out of service until the spec changes.
            champion = al.get(aliases_mod.CHAMPION)
            if champion and champion != version and not self.was_recorded("RolledBack", version, champion):
                # The pass that rolled it back died before writing its status.
                self.record("RolledBack", tags[TAG_ROLLED_BACK], version, champion, warning=True, key=version)
            await self._serve(model, al, desired=None, desired_reason=f"v{version} was rolled back: {tags[TAG_ROLLED_BACK]}")
            return
        if al.get(aliases_mod.CHAMPION) != version:
            gate_status, verdict, gate_msg = await self.registry(reg.gate_result, model, version)
            if gate_status == "pending":
                await self._gate(model, version, rel, digest, al)
                if self.out.get("phase") == "Gating":
                    await self._serve(model, al, desired=None, desired_reason="", watch_only=True)
                return
            await self._record_gate_started_late(version, digest)
            if gate_status == "error":
                msg = f"gate of v{version} errored: {gate_msg}"
                self.cond(c.GATED, False, "GateError", msg)
                if not self.was_recorded("GateError", version, version):
                    self.record("GateError", msg, None, version, warning=True, key=version)
                await self._serve(model, al, desired=None, desired_reason=msg)
                return
            outcome = gate_verdict.evaluate_verdict(verdict or {}, rel["gating"]["thresholds"])
            if outcome.passed:
                # A pass is promoted only if it is the verdict the gate Job reported (MLflow tags
                # can be written by anyone with MLflow access); a failure promotes nothing.
                reported = await self._reported_digest(version, digest)
                unverified = gate_verdict.verify_verdict(verdict or {}, version, reported)
                if unverified is not None and reported is None:
                    if await self._regate(model, version, rel, digest, al):
                        return
                    job = manifests.gate_job_name(self.name, digest)
                    unverified = replace(unverified, message=f"{unverified.message}: Job {job} finished without "
                                         f"a report (its pod is gone); delete the Job to gate v{version} again")
                if unverified is not None:
                    if not self.was_recorded(unverified.reason, version, version):
                        self.record(unverified.reason, unverified.message, None, version, warning=True, key=version)
                    outcome = unverified
            self._record_gate(version, outcome, verdict or {}, tags)
            await self._record_gate_result(version, digest, outcome)
            if not outcome.passed:
                await self._serve(model, al, desired=None, desired_reason=f"gate of v{version} failed: {outcome.message}")
                return
            moves = aliases_mod.plan_promotion(al, version)
            if moves:
                at = tags.get(TAG_PROMOTED_AT)
                if not at or self.was_recorded("Promoted", f"{version}@{at}", version):
                    # No mark, or the mark of an earlier promotion: this one gets its own. (A mark
                    # not yet recorded is this promotion's, left by a pass that died: reuse it.)
                    tags = {**tags, TAG_PROMOTED_AT: c.now_iso()}
                    await self.registry(reg.set_tags, model, version, {TAG_PROMOTED_AT: tags[TAG_PROMOTED_AT]})
                for move in moves:
                    await self.registry(reg.set_alias, model, move.alias, move.version)
            al = await self.registry(reg.aliases, model)
            self._record_promotion(version, tags, al, outcome)
        else:
            _, verdict, _ = await self.registry(reg.gate_result, model, version)
            if verdict is not None:
                outcome = gate_verdict.evaluate_verdict(verdict, rel["gating"]["thresholds"])
                self._record_gate(version, outcome, verdict, tags)
                await self._record_gate_started_late(version, digest)
                self._record_promotion(version, tags, al, outcome)
        await self._serve(model, al, desired=version, desired_reason="")

    async def _reported_digest(self, version: str, digest: str) -> str | None:
        """The digest of the verdict the release's gate Job reported: kept in status once seen,
        read from the gate pod's termination message (written by the kubelet) before that."""
        kept = (self.status.get("verifiedVerdicts") or {}).get(str(version))
        if kept:
            return str(kept)
        jobs = [j["metadata"]["name"] for j in await self._gate_attempts(digest)]
        if not jobs:
            return None
        for pod in await self.rt.kube.list("v1", "pods", self.namespace, f"job-name in ({','.join(jobs)})"):
            if not any(self._owns_via_job(pod, job) for job in jobs):
                continue
            for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                message = ((cs.get("state") or {}).get("terminated") or {}).get("message") or ""
                try:
                    report = json.loads(message)
                except ValueError:
                    continue
                if isinstance(report, dict) and str(report.get("version")) == str(version) \
                        and isinstance(report.get("verdictSha256"), str):
                    kept_all = dict(self.status.get("verifiedVerdicts") or {})
                    kept_all[str(version)] = report["verdictSha256"]
                    # The last few versions; written whatever else the pass says.
                    kept_all = dict(sorted(kept_all.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0)[-10:])
                    self.out["verifiedVerdicts"] = self.patch.status["verifiedVerdicts"] = kept_all
                    return report["verdictSha256"]
        return None

    @staticmethod
    def _owns_via_job(pod: dict[str, Any], job: str) -> bool:
        return any(ref.get("kind") == "Job" and ref.get("name") == job and ref.get("controller")
                   for ref in (pod.get("metadata") or {}).get("ownerReferences") or [])

    async def _regate(self, model: str, version: str, rel: dict[str, Any], digest: str, al: dict[str, str]) -> bool:
        """A passing verdict whose gate Job left no report (the Job is gone: its TTL ran out, or
        the verdict was written into MLflow by hand): gate the release again. False when the Job
        is still there but finished without a report (then the verdict stays unverified)."""
        live = await self._finished_gate_job(digest)
        finished = live is not None and any(cd.get("type") in ("Complete", "Failed") and cd.get("status") == "True"
                                            for cd in (live.get("status") or {}).get("conditions") or [])
        if finished:
            return False
        if live is None:
            self.event("Warning", "Regating", f"v{version}: MLflow says it passed, but no gate Job reported that "
                       "verdict; gating it again")
        await self._gate(model, version, rel, digest, al)
        if self.out.get("phase") == "Gating":
            await self._serve(model, al, desired=None, desired_reason="", watch_only=True)
        return True

    async def _gate_attempts(self, digest: str) -> list[dict[str, Any]]:
        """The release's gate Jobs, one per attempt in order, read once per pass."""
        if digest not in self.gate_jobs:
            chain: list[dict[str, Any]] = []
            for attempt in range(1, gate_attempts.Policy.from_env().attempts + 1):
                job = await self.rt.kube.get("batch/v1", "jobs", self.namespace,
                                             manifests.gate_job_name(self.name, digest, attempt))
                if job is None:
                    break
                chain.append(job)
            self.gate_jobs[digest] = chain
        return self.gate_jobs[digest]

    async def _finished_gate_job(self, digest: str) -> dict[str, Any] | None:
        """The release's latest gate Job (the one a verdict comes from), for the records that need it."""
        chain = await self._gate_attempts(digest)
        return chain[-1] if chain else None

    async def _gate_failure(self, job: dict[str, Any], version: str, job_message: str) -> gate_attempts.Failure:
        """Why a gate attempt ended without a verdict: its runner's report (termination message)."""
        name = job["metadata"]["name"]
        messages = [((cs.get("state") or {}).get("terminated") or {}).get("message") or ""
                    for pod in await self.rt.kube.list("v1", "pods", self.namespace, f"job-name={name}")
                    if self._owns_via_job(pod, name)
                    for cs in (pod.get("status") or {}).get("containerStatuses") or []]
        return gate_attempts.failure_of(messages, version, job_message)

    async def _record_gate_result(self, version: str, digest: str, outcome: gate_verdict.GateOutcome) -> None:
        """A gate's result is an Event and a history entry, once per release, and its Job's run
        time goes to specpair_gate_duration_seconds."""
        action = "GatePassed" if outcome.passed else \
            gate_verdict.GATE_ERROR if outcome.reason == gate_verdict.GATE_ERROR else "GateFailed"
        if self.was_recorded(action, version, version):
            return
        job = await self._finished_gate_job(digest)
        st = (job or {}).get("status") or {}
        if job is not None and self._owns(job) and st.get("startTime"):
            # The verdict lands just before the gate pod exits: without a completion time yet, now
            # is when the gate finished.
            end = c.parse_iso(st["completionTime"]) if st.get("completionTime") else c.parse_iso(c.now_iso())
            seconds = (end - c.parse_iso(st["startTime"])).total_seconds()
            metrics.GATE_DURATION.labels(self.namespace, self.name, "passed" if outcome.passed else "failed").observe(seconds)
        self.record(action, f"v{version}: {outcome.message}", None, version, warning=not outcome.passed, key=version)

    async def _record_gate_started_late(self, version: str, digest: str) -> None:
        """A gate Job can finish while the operator that created it is down (it died right after
        the create): its GateStarted still belongs in history, once."""
        if self.was_recorded("GateStarted", version, version):
            return
        name = manifests.gate_job_name(self.name, digest)
        job = await self._finished_gate_job(digest)
        if job is not None and self._owns(job):
            self.record("GateStarted", f"gating v{version} ({digest[:12]}) in Job {name}", None, version, key=version)

    def _record_promotion(self, version: str, tags: dict[str, str], al: dict[str, str],
                          outcome: gate_verdict.GateOutcome) -> None:
        """Promoted goes into history and Events once per promotion (keyed by its mark), also
        when the pass that moved the aliases died before writing its status."""
        at = tags.get(TAG_PROMOTED_AT)
        if not at or al.get(aliases_mod.CHAMPION) != version or self.was_recorded("Promoted", f"{version}@{at}", version):
            return
        self.record("Promoted", f"v{version} passed the gate ({outcome.message}) and is champion",
                    al.get(aliases_mod.PREVIOUS), version, key=f"{version}@{at}")

    def _ensure_release(self, reg: ReleaseRegistry, model: str, rel: dict[str, Any], digest: str) -> str:
        version = reg.ensure_release(model, rel, digest)
        # The full release JSON rides along as a tag so a rollback can rebuild the Deployment
        # of any version without the spec that made it.
        if TAG_RELEASE not in reg.version_tags(model, version):
            reg.set_tags(model, version, {TAG_RELEASE: json.dumps(rel, sort_keys=True, separators=(",", ":"))})
        return version

    def _record_gate(self, version: str, outcome: gate_verdict.GateOutcome, verdict: dict[str, Any],
                     tags: dict[str, str]) -> None:
        verdict = gate_verdict.usable_verdict(verdict)  # an unusable one reports no numbers
        self.cond(c.GATED, outcome.passed, outcome.reason, f"v{version}: {outcome.message}")
        if outcome.tokenizer_compatible is not None:
            self.cond(c.TOKENIZER_COMPATIBLE, outcome.tokenizer_compatible,
                      "Identical" if outcome.tokenizer_compatible else "Mismatch", outcome.tokenizer_message)
        self.out["lastGate"] = {
            "version": version, "passed": outcome.passed, "message": outcome.message,
            "acceptanceRate": verdict.get("acceptanceRate"), "speedup": verdict.get("speedup"),
            "greedyIdentity": verdict.get("greedyIdentity"),
            "categories": {k: (v or {}).get("acceptanceRate") for k, v in (verdict.get("categories") or {}).items()},
            "bestSpeculation": verdict.get("bestSpeculation"), "runId": tags.get(TAG_GATE_RUN, verdict.get("mlflowRunId")),
        }

    async def _gate(self, model: str, version: str, rel: dict[str, Any], digest: str, al: dict[str, str]) -> None:
        reg = self.rt.registry
        if al.get(aliases_mod.CANDIDATE) != version:
            await self.registry(reg.set_alias, model, aliases_mod.CANDIDATE, version)
        gating = self.spec.get("gating") or {}
        placement = {**self.rollout, **({"resources": gating["resources"]} if "resources" in gating else {})}

        def gate_job(attempt: int) -> dict[str, Any]:
            job = manifests.gate_job(self.name, self.namespace,
                                     release_mod.with_mlflow(rel, self.rt.gate_tracking_uri, model, version),
                                     digest, version, placement, self.rt.gate_tracking_uri,
                                     int(gating.get("activeDeadlineSeconds", 3600)), self.credentials(),
                                     self.rt.pods, attempt=attempt)
            kopf.adopt(job, owner=self.body)
            return job
        attempts = await self._gate_attempts(digest)
        attempt = max(1, len(attempts))
        job = gate_job(attempt)
        # Gate pods take no ingress; the policy exists before the first gate pod does.
        conflict = await self._ensure_policy(manifests.gate_network_policy(self.name, self.namespace))
        if conflict:
            self._name_conflict("NetworkPolicy", conflict)
            return
        live = attempts[-1] if attempts else None
        if live is not None and not self._owns(live):
            self._name_conflict("Job", job["metadata"]["name"])
            return
        started = f"gating v{version} ({digest[:12]}) in Job {job['metadata']['name']}"
        if live is None:
            await self.rt.kube.create(job)
            self.record("GateStarted", started, None, version, key=version)
        elif not self.was_recorded("GateStarted", version, version):
            self.record("GateStarted", started, None, version, key=version)  # its pass died after the create
        elif attempt > 1 and not self.was_recorded("GateRetrying", f"{version}#{attempt}", version):
            # The pass that started this attempt died before recording it.
            job_message = gate_attempts.job_failed(attempts[-2])[1]
            self._record_retry(version, attempt, await self._gate_failure(attempts[-2], version, job_message),
                               job["metadata"]["name"])
        elif gate_attempts.job_failed(live)[0]:
            # No verdict (the gate crashed, MLflow stayed unreachable, the pod was killed): not a
            # result. The release is gated again, a bounded number of times.
            _, job_message, failed_at = gate_attempts.job_failed(live)
            failure = await self._gate_failure(live, version, job_message)
            policy = gate_attempts.Policy.from_env()
            since = (c.parse_iso(c.now_iso()) - c.parse_iso(failed_at)).total_seconds() if failed_at else float("inf")
            step, wait = gate_attempts.next_step(policy, attempt, since)
            why = failure.describe()
            if step == gate_attempts.GIVE_UP:
                reason = f"{attempt} gate attempt(s) ended without a verdict; the last: {why}"
                await self.registry(reg.record_gate_error, model, version, reason)
                self.cond(c.GATED, False, "GateError", f"v{version}: {reason}")
                self.finish("Failed", (False, "GateError", reason), (False, "GateError", ""),
                            (True, "GateError", f"gate of v{version}: {reason}"))
                return
            if step == gate_attempts.WAIT:
                msg = (f"v{version}: gate attempt {attempt} of {policy.attempts} ended without a verdict: {why}; "
                       f"attempt {attempt + 1} in {wait:.0f}s")
                self.cond(c.GATED, "Unknown", "GateRetrying", msg)
                self._versions(al)
                self.finish("Gating", (False, "GateRetrying", msg), (True, "GateRetrying", msg),
                            (False, "GateRetrying", ""))
                return
            job = gate_job(attempt + 1)
            await self.rt.kube.create(job)
            self._record_retry(version, attempt + 1, failure, job["metadata"]["name"])
        waiting = await self._unschedulable(f"job-name={job['metadata']['name']}")
        reason = "GatePending" if waiting else "Gating"
        self.cond(c.GATED, "Unknown", reason, f"v{version} is being gated by Job {job['metadata']['name']}"
                  + (f" ({waiting})" if waiting else ""))
        serving = al.get(aliases_mod.CHAMPION)
        self._versions(al)
        self.finish("Gating", (False, reason, f"gating v{version}" + (f"; v{serving} keeps serving" if serving else "")),
                    (True, reason, f"gate Job {job['metadata']['name']} "
                     + (f"waiting: {waiting}" if waiting else "running") + f" for v{version}"),
                    (False, reason, ""))

    def _record_retry(self, version: str, attempt: int, failure: gate_attempts.Failure, job: str) -> None:
        policy = gate_attempts.Policy.from_env()
        self.record("GateRetrying", f"v{version}: gate attempt {attempt - 1} of {policy.attempts} ended without a "
                    f"verdict: {failure.describe()}; attempt {attempt} in Job {job}", None, version, warning=True,
                    key=f"{version}#{attempt}")

    def _owns(self, obj: dict[str, Any]) -> bool:
        return any(ref.get("uid") == self.uid and ref.get("controller")
                   for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])

    def _name_conflict(self, kind: str, name: str) -> None:
        """An object with our child's name that this pair does not own: never touch it."""
        msg = (f"{kind} {self.namespace}/{name} exists and is not owned by SpecModelPair {self.name}; "
               f"rename or delete it (the operator never changes objects it does not own)")
        if self.status.get("message") != msg:
            self.event("Warning", "NameConflict", msg)
        self.finish("Failed", (False, "NameConflict", msg), (False, "NameConflict", ""), (True, "NameConflict", msg))

    async def _unschedulable(self, selector: str) -> str:
        """Why pods matching `selector` cannot start ('' when nothing stops them): the
        scheduler's reason, or the kubelet's for a container it cannot create (a missing
        credentials Secret or key, an image it cannot pull)."""
        for pod in await self.rt.kube.list("v1", "pods", self.namespace, selector):
            st = pod.get("status") or {}
            for cd in st.get("conditions") or []:
                if cd.get("type") == "PodScheduled" and cd.get("status") == "False":
                    return f"pod {pod['metadata']['name']} is Pending: {cd.get('reason')}: {cd.get('message', '')}"
            for cs in st.get("containerStatuses") or []:
                waiting = (cs.get("state") or {}).get("waiting") or {}
                if waiting.get("reason") in STUCK_CONTAINER_REASONS:
                    return (f"pod {pod['metadata']['name']} cannot start: {waiting['reason']}: "
                            f"{waiting.get('message', '')}")
        return ""

    def _versions(self, al: dict[str, str]) -> None:
        self.out["servingVersion"] = al.get(aliases_mod.CHAMPION, "")
        self.out["previousVersion"] = al.get(aliases_mod.PREVIOUS, "")

    async def _serve(self, model: str, al: dict[str, str], desired: str | None, desired_reason: str,
                     watch_only: bool = False) -> None:
        """Roll the engine to the champion and judge its health; `desired` None means the
        spec's release is not servable (failed gate, rolled back) and the champion carries on.
        The champion's drift is watched either way. `watch_only` (while a new release is being
        gated) leaves the pass's status alone unless the champion needs an action."""
        reg = self.rt.registry
        champion = al.get(aliases_mod.CHAMPION)
        self._versions(al)
        if champion is None:
            if watch_only:
                return
            self.finish("Failed", (False, "NoRelease", desired_reason or "no release has passed the gate"),
                        (False, "NoRelease", ""), (True, "NoRelease", desired_reason or "no release has passed the gate"))
            return
        tags = await self.registry(reg.version_tags, model, champion)
        if tags.get(TAG_ROLLED_BACK):
            # Rolled back, but the pass that tagged it died before moving the alias: finish it.
            await self._rollback(model, al, champion, tags[TAG_ROLLED_BACK], marked=True)
            return
        rel = json.loads(tags[TAG_RELEASE])
        digest = tags[TAG_HASH]
        self.kind = release_mod.engine_kind(rel)
        _, verdict, _ = await self.registry(reg.gate_result, model, champion)
        # A champion's verdict edited in MLflow after its promotion serves with the spec's
        # speculation and no gated numbers, rather than with whatever the tag now says.
        verdict = gate_verdict.usable_verdict(verdict)
        served = json.loads(json.dumps(rel))
        best = verdict.get("bestSpeculation") or {}
        # The gate tuned k and the batch threshold on real hardware: serve with what it found
        # (a threshold of 0 means speculation did not pay at any batch size there).
        if self.rollout.get("applyGateTuning", True):
            served["speculation"].update({k: v for k, v in best.items() if k in ("k", "batchSizeThreshold")})
        served = release_mod.with_mlflow(served, self.rt.gate_tracking_uri, model, champion)
        if isinstance(verdict.get("speedup"), (int, float)):
            self.out["speedup"] = float(verdict["speedup"])
        self._export_speedup(champion, verdict)
        # Until live traffic has been measured, the printer column shows the gated acceptance.
        if isinstance(verdict.get("acceptanceRate"), (int, float)) and \
                (self.status.get("servingVersion") != champion or "acceptance" not in self.status):
            self.out["acceptance"] = float(verdict["acceptanceRate"])
        state, msg = await self._ensure_engine(served, digest, champion)
        if state == "conflict":
            kind, name = msg.split(" ", 1)
            self._name_conflict(kind, name)
            return
        if state == "failed":
            await self._rollback(model, al, champion, f"rollout of v{champion} failed: {msg}")
            return
        if state != "available":
            if watch_only:
                return
            self.finish("RollingOut", (False, "RollingOut", msg), (True, "RollingOut", f"rolling out v{champion}: {msg}"),
                        (False, "RollingOut", ""))
            return
        pods = await self._engine_pods()
        served_hash = release_mod.content_hash(served)
        ok, why, infos = await self._verify_identity(pods, champion, served_hash, tags)
        if ok:
            self.rt.watch_cache[self.uid] = (model, dict(al), champion, dict(tags), verdict, served_hash)
        if why.startswith("tokenizer"):
            await self._rollback(model, al, champion, why)
            return
        if not ok:
            if watch_only:
                return
            self.finish("RollingOut", (False, "IdentityUnverified", why), (True, "IdentityUnverified", why),
                        (False, "IdentityUnverified", ""))
            return
        # The champion is watched whatever the spec's release is doing (gated, failed, rolled back).
        self.watching = watch_only or desired is None
        drifted = await self._drift(model, al, champion, verdict, tags, pods, infos)
        unreconciled = await self._reconcile_speculation(champion, pods, infos)
        if watch_only or (desired is None and drifted and "phase" in self.out):
            return  # nothing to say beyond what a drift action this pass already said
        if desired is None:
            self.finish("Degraded", (False, "ChampionKeepsServing", f"{desired_reason}; v{champion} keeps serving"),
                        (False, "ChampionKeepsServing", ""), (True, "ReleaseNotServable", f"{desired_reason}; v{champion} keeps serving"))
            return
        if unreconciled:
            self.finish("Degraded", (False, "SpeculationNotReconciled", unreconciled),
                        (True, "SpeculationNotReconciled", unreconciled), (False, "SpeculationNotReconciled", ""))
            return
        if drifted:
            return
        self.finish("Serving", (True, "Serving", f"v{champion} serving on {len(pods)} pod(s), identity verified"),
                    (False, "Serving", ""), (False, "Serving", ""))

    def _export_speedup(self, champion: str, verdict: dict[str, Any]) -> None:
        """specpair_release_speedup for the serving release only (the last one's series go)."""
        speedups = {"all": verdict.get("speedup")}
        speedups.update({cat: (v or {}).get("speedup") for cat, v in (verdict.get("categories") or {}).items()})
        speedups = {cat: float(v) for cat, v in speedups.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        series = (str(champion), tuple(sorted(speedups)))
        old = self.rt.speedup_series.get(self.uid)
        if old is not None and old != series:
            for cat in old[1]:
                try:
                    metrics.RELEASE_SPEEDUP.remove(self.name, old[0], cat, self.namespace)
                except KeyError:
                    pass
        for cat, value in speedups.items():
            metrics.RELEASE_SPEEDUP.labels(self.name, str(champion), cat, self.namespace).set(value)
        self.rt.speedup_series[self.uid] = series

    async def _ensure_engine(self, served: dict[str, Any], digest: str, version: str) -> tuple[str, str]:
        kube = self.rt.kube
        dep = manifests.engine_deployment(self.name, self.namespace, served, digest, version, self.rollout,
                                          self.rt.gate_tracking_uri,
                                          # Engine pods need MLflow only to download a model from it.
                                          self.credentials() if release_mod.reads_from_mlflow(served) else None,
                                          self.rt.pods, speculation=self._desired_speculation(version))
        svc = manifests.engine_service(self.name, self.namespace, self.rollout, self.kind)
        fingerprint = hashlib.sha256(json.dumps(dep, sort_keys=True).encode()).hexdigest()[:16]
        dep["metadata"]["annotations"][ANN_MANIFEST] = fingerprint
        kopf.adopt(dep, owner=self.body)
        kopf.adopt(svc, owner=self.body)
        live = await kube.get("apps/v1", "deployments", self.namespace, dep["metadata"]["name"])
        if live is not None and not self._owns(live):
            return "conflict", f"Deployment {dep['metadata']['name']}"
        live_svc = await kube.get("v1", "services", self.namespace, svc["metadata"]["name"])
        if live_svc is not None and not self._owns(live_svc):
            return "conflict", f"Service {svc['metadata']['name']}"
        # The control listener's certificate, before the first engine pod needs it (vLLM pods
        # have no control listener).
        conflict = await self._ensure_engine_tls() if self.kind != "vllm" else ""
        if conflict:
            return "conflict", f"Secret {conflict}"
        # Ingress to engine pods on their ports only; in place before the first engine pod is.
        conflict = await self._ensure_policy(manifests.engine_network_policy(self.name, self.namespace, self.rt.pods))
        if conflict:
            return "conflict", f"NetworkPolicy {conflict}"
        key = f"{version}@{fingerprint}"
        if live is None:
            live = await kube.create(dep)
            self.record("RolloutStarted", f"engine Deployment created for v{version}", None, version, key=key)
        elif (live["metadata"].get("annotations") or {}).get(ANN_MANIFEST) != fingerprint:
            live = await kube.merge_patch("apps/v1", "deployments", self.namespace, dep["metadata"]["name"],
                                          {"metadata": {"labels": dep["metadata"]["labels"],
                                                        "annotations": dep["metadata"]["annotations"]},
                                           "spec": dep["spec"]})
            self.record("RolloutStarted", f"engine Deployment rolled to v{version}", None, version, key=key)
        elif not self.was_recorded("RolloutStarted", key, version):
            # The pass that created or rolled the Deployment died before writing its status.
            self.record("RolloutStarted", f"engine Deployment rolled to v{version}", None, version, key=key)
        if live_svc is None:
            await kube.create(svc)
        state, msg = manifests.deployment_rollout_state(live, digest)
        if state == "progressing":
            waiting = await self._unschedulable(",".join(f"{k}={v}" for k, v in manifests.engine_selector(self.name).items()))
            if waiting:
                msg = f"{msg}; {waiting}"
        if state == "available":
            await self._retire_legacy_engine(dep["metadata"]["name"])
        return state, msg

    async def _retire_legacy_engine(self, current: str) -> None:
        """A pair whose name is not a DNS label had its engine Deployment under another name
        (names.legacy_object_name). Once the one under `current` is available, that one is
        scaled to zero (the operator may patch Deployments, not delete them): its pods carry the
        pair's labels and would serve, and be verified, beside the current ones."""
        legacy = names.legacy_object_name(self.name, "engine")
        if legacy == current:
            return
        old = await self.rt.kube.get("apps/v1", "deployments", self.namespace, legacy)
        if old is None or not self._owns(old) or not (old.get("spec") or {}).get("replicas"):
            return
        await self.rt.kube.merge_patch("apps/v1", "deployments", self.namespace, legacy, {"spec": {"replicas": 0}})
        self.event("Normal", "LegacyEngineRetired", f"Deployment {legacy} scaled to 0: the engine is Deployment "
                   f"{current} now (a pair name that is not a DNS label gets a hash in its objects' names); the "
                   f"objects named {names.legacy_object_name(self.name)}-* this pair owns are unused and may be deleted")

    async def _ensure_engine_tls(self) -> str:
        """Issue the engine's control-listener certificate when it has none, was issued by another
        CA or for other names, or nears its end; '' or the name of a Secret this pair does not own.

        What was issued is kept in status.engineTLS, so the operator never reads a Secret in the
        pair's namespace (RBAC: create and patch, no get); a patch only goes through if the Secret
        is owned by this pair (a JSON-patch test on its owner's uid). Engine pods pick a renewed
        certificate up from their volume without restarting."""
        ca = await control_ca(self.rt)
        secret_name = manifests.engine_tls_secret_name(self.name)
        dns = tls_mod.engine_dns_names(manifests.engine_name(self.name), self.namespace)
        have = self.status.get("engineTLS") or {}
        reason = ""
        if have.get("secret") != secret_name or have.get("caFingerprint") != tls_mod.fingerprint(ca.cert_pem):
            reason = "no certificate from this CA yet"
        elif list(have.get("names") or []) != list(dns):
            reason = "the Service's names changed"
        elif c.parse_iso(have.get("notAfter") or "1970-01-01T00:00:00Z") - c.parse_iso(c.now_iso()) \
                < datetime.timedelta(days=tls_mod.RENEW_DAYS):
            reason = f"it expires {have.get('notAfter')}"
        elif await self._tls_secret_missing(secret_name):
            reason = f"engine pods cannot find Secret {secret_name}"
        if not reason:
            self.out["engineTLS"] = have
            return ""
        leaf = tls_mod.issue(ca, manifests.engine_name(self.name), dns, server=True, days=tls_mod.SERVER_DAYS)
        secret = manifests.engine_tls_secret(self.name, self.namespace, leaf.cert_pem, leaf.key_pem, ca.cert_pem)
        kopf.adopt(secret, owner=self.body)
        try:
            await self.rt.kube.create(secret, read_existing=False)
        except KubeError as exc:
            if exc.status != 409:
                raise
            try:
                await self.rt.kube.json_patch("v1", "secrets", self.namespace, secret_name, [
                    {"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": self.uid},
                    {"op": "replace", "path": "/data", "value": secret["data"]}])
            except KubeError as patch_exc:
                if patch_exc.status in (400, 409, 422):  # the test failed: not ours
                    return secret_name
                raise
        until = tls_mod.not_after(leaf.cert_pem).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.out["engineTLS"] = {"secret": secret_name, "caFingerprint": tls_mod.fingerprint(ca.cert_pem),
                                 "names": list(dns), "notAfter": until}
        # Written whatever else the pass says: without it the next pass would issue another.
        self.patch.status["engineTLS"] = self.out["engineTLS"]
        self.event("Normal", "CertificateIssued",
                   f"engine control-listener certificate in Secret {secret_name} ({reason}), valid until {until}")
        return ""

    async def _tls_secret_missing(self, secret_name: str) -> bool:
        """Whether the Secret is gone (deleted by hand), asked every CA_REFRESH_S by trying to
        create it: the operator may not read Secrets, and engine pods cannot start without it."""
        if time.monotonic() - self.rt.tls_checked_at.get(self.uid, 0.0) < CA_REFRESH_S:
            return False
        probe = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret_name, "namespace": self.namespace}}
        try:
            # dryRun: nothing is written; 409 means it is there.
            await self.rt.kube.create(probe, read_existing=False, dry_run=True)
        except KubeError as exc:
            if exc.status != 409:
                raise
            self.rt.tls_checked_at[self.uid] = time.monotonic()
            return False
        return True

    async def _ensure_policy(self, policy: dict[str, Any]) -> str:
        """Create the NetworkPolicy, or patch it when the operator's settings changed (the chart's
        engine.networkPolicy.from); the name of one this pair does not own ('' otherwise).
        Part of _gate and _ensure_engine."""
        kube, name = self.rt.kube, policy["metadata"]["name"]
        fingerprint = hashlib.sha256(json.dumps(policy, sort_keys=True).encode()).hexdigest()[:16]
        policy["metadata"]["annotations"] = {ANN_MANIFEST: fingerprint}
        kopf.adopt(policy, owner=self.body)
        live = await kube.get("networking.k8s.io/v1", "networkpolicies", self.namespace, name)
        if live is not None and not self._owns(live):
            return name
        if live is None:
            await kube.create(policy)
        elif (live["metadata"].get("annotations") or {}).get(ANN_MANIFEST) != fingerprint:
            await kube.merge_patch("networking.k8s.io/v1", "networkpolicies", self.namespace, name,
                                   {"metadata": {"annotations": policy["metadata"]["annotations"]},
                                    "spec": policy["spec"]})
        return ""

    async def _engine_pods(self) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in manifests.engine_selector(self.name).items())
        pods = await self.rt.kube.list("v1", "pods", self.namespace, selector)

        def ready(p: dict[str, Any]) -> bool:
            st = p.get("status") or {}
            return st.get("phase") == "Running" and bool(st.get("podIP")) and not p["metadata"].get("deletionTimestamp") \
                and any(cd.get("type") == "Ready" and cd.get("status") == "True" for cd in st.get("conditions") or [])
        return [p for p in pods if ready(p)]

    def _address(self, pod: dict[str, Any]) -> str:
        """The pod's control listener (mutual TLS): the operator never uses the serving port. A
        vLLM pod has none: its HTTP port, read only (/v1/models, /metrics)."""
        if self.kind == "vllm":
            return f"{pod['status']['podIP']}:{int(self.rollout.get('httpPort') or manifests.HTTP_PORT)}"
        return f"{pod['status']['podIP']}:{int(self.rollout.get('controlPort', manifests.CONTROL_PORT))}"

    def _server_name(self) -> str:
        return tls_mod.server_name(manifests.engine_name(self.name), self.namespace)

    async def _verify_identity(self, pods: list[dict[str, Any]], version: str, digest: str, tags: dict[str, str]
                               ) -> tuple[bool, str, list[dict[str, Any]]]:
        if not pods:
            return False, "no ready engine pods", []
        infos = []
        expected = {"target": tags.get(TAG_TOKENIZER_TARGET), "draft": tags.get(TAG_TOKENIZER_DRAFT)}
        for pod in pods:
            try:
                info = await self._probe().model_info(self._address(pod), server_name=self._server_name())
            except EngineUnreachable as exc:
                return False, f"pod {pod['metadata']['name']}: model identity not verified: {exc}", infos
            # `digest` is the hash of the release document this pod was given; the engine hashes
            # the file it loaded, so a pod serving anything else is caught here.
            served = (info.get("pair"), str(info.get("releaseVersion")), info.get("contentHash") or "")
            if served != (self.name, version, digest):
                return False, (f"pod {pod['metadata']['name']} serves {served[0]} v{served[1]} with content hash "
                               f"{served[2][:12] or '(none)'}; release is {self.name} v{version} "
                               f"({digest[:12]})"), infos
            mismatch = drift_mod.fingerprint_mismatch(expected, info.get("tokenizer") or {})
            if mismatch:
                return False, f"tokenizer mismatch on pod {pod['metadata']['name']}: " + "; ".join(mismatch), infos
            infos.append(info)
        return True, "", infos

    async def _rollback(self, model: str, al: dict[str, str], champion: str, reason: str,
                        marked: bool = False) -> None:
        reg = self.rt.registry
        target = aliases_mod.rollback_target(al)
        self.cond(c.DRIFTED, True, "RolledBack" if target else "NoPreviousRelease", reason)
        if target is None:
            self.finish("Failed", (False, "NoPreviousRelease", f"{reason}; no previous release to roll back to"),
                        (False, "NoPreviousRelease", ""), (True, "NoPreviousRelease", f"{reason}; no previous release"))
            return
        # The tag first: it is what keeps a restarted operator from re-promoting this version,
        # and what makes the next pass finish the alias move if this one dies before it.
        if not marked:
            await self.registry(reg.set_tags, model, champion, {TAG_ROLLED_BACK: reason[:4000]})
        for move in aliases_mod.plan_rollback(al):
            await self.registry(reg.set_alias, model, move.alias, move.version)
        self.record("RolledBack", reason, champion, target, warning=True, key=champion)
        self.rt.samples.pop(self.uid, None)
        self.out["drift"] = drift_mod.DriftState().as_dict()
        self.out["speculationEnabled"] = True
        self._versions({**al, aliases_mod.CHAMPION: target})
        self.finish("RollingOut", (False, "RolledBack", reason), (True, "RolledBack", f"rolling back to v{target}"),
                    (False, "RolledBack", ""))

    def _desired_speculation(self, champion: str) -> bool:
        if "speculationEnabled" in self.out:
            return bool(self.out["speculationEnabled"])
        if str((self.status.get("drift") or {}).get("version", "")) == str(champion):
            return bool(self.status.get("speculationEnabled", True))
        return True  # a release the drift ladder has not acted on speculates

    def _probe(self) -> EngineProbe:
        return self.rt.vllm_probe if self.kind == "vllm" else self.rt.probe

    async def _reconcile_speculation(self, champion: str, pods: list[dict[str, Any]],
                                     infos: list[dict[str, Any]]) -> str:
        """Every pod speculates exactly when the operator wants it to (level-triggered: a pod that
        restarted after SpeculationOff speculates again until told otherwise). Returns what is
        still off-target ('' when every pod matches)."""
        desired = self._desired_speculation(champion)
        stuck = []
        for pod, info in zip(pods, infos):
            if bool(info.get("speculationEnabled", True)) == desired:
                continue
            name = pod["metadata"]["name"]
            if self.kind == "vllm":
                # No runtime switch: the Deployment is rendered with the desired state and rolls.
                stuck.append(f"pod {name} is replaced by one {'with' if desired else 'without'} speculation "
                             "(vLLM cannot switch it at run time)")
                continue
            try:
                await self._probe().set_speculation(self._address(pod), desired,
                                                    "operator: reconcile to the desired speculation state",
                                                    server_name=self._server_name())
                after = await self._probe().model_info(self._address(pod), server_name=self._server_name())
            except EngineUnreachable as exc:
                stuck.append(f"pod {name}: {exc}")
                continue
            if bool(after.get("speculationEnabled", True)) != desired:
                stuck.append(f"pod {name} still reports speculation {'off' if desired else 'on'}")
                continue
            msg = (f"pod {name} of v{champion} had speculation {'off' if desired else 'on'}; turned it "
                   f"{'on' if desired else 'off'} as the pair's drift state requires")
            self.event("Warning", "SpeculationReconciled", msg)
            self.logger.warning(msg)
        if not stuck:
            return ""
        return (f"speculation should be {'on' if desired else 'off'} on every pod of v{champion}; not yet: "
                + "; ".join(stuck))

    async def _drift(self, model: str, al: dict[str, str], champion: str, verdict: dict[str, Any],
                     tags: dict[str, str], pods: list[dict[str, Any]], infos: list[dict[str, Any]]) -> bool:
        """Observe each pod's counters, let drift.decide pick the ladder's step, apply it.
        True when this pass took a drift action or the champion serves target-only after one."""
        policy_spec = self.spec.get("drift") or {}
        if not policy_spec.get("enabled", True):
            return False
        policy = drift_mod.DriftPolicy.from_spec(policy_spec)
        now = time.monotonic()
        previous = drift_mod.state_for_release(self.status.get("drift"), champion)
        off = drift_mod.SPECULATION_OFF in policy.ladder[:previous.steps_taken]
        if tags.get(TAG_SPECULATION_OFF) and not off and drift_mod.SPECULATION_OFF in policy.ladder:
            # The pass that turned speculation off died before writing its status: adopt its step.
            previous = replace(previous, steps_taken=policy.ladder.index(drift_mod.SPECULATION_OFF) + 1,
                               since=time.time())
            off = True
            self.out["speculationEnabled"] = False
            self.out["drift"] = {**previous.as_dict(), "version": str(champion), "probing": False}
            self.record("SpeculationOff", tags[TAG_SPECULATION_OFF], champion, champion, warning=True)

        def degraded(extra: str = "") -> bool:
            if self.watching:  # the pass reports the spec's release; the Drifted condition says the rest
                return True
            self.finish("Degraded", (True, "SpeculationOff", f"v{champion} serving target-only after drift{extra}"),
                        (False, "SpeculationOff", ""), (False, "SpeculationOff", ""))
            return True
        if now - self.rt.last_drift_check.get(self.uid, 0.0) < float(policy_spec.get("intervalSeconds", 30)):
            return degraded() if off else False
        self.rt.last_drift_check[self.uid] = now
        observed = []
        try:
            for pod in pods:
                stats = await self._probe().stats(self._address(pod), server_name=self._server_name())
                uptime = stats.get("uptimeSeconds")
                meta = pod["metadata"]
                observed.append(drift_mod.PodStats(
                    f"{meta['name']}/{meta.get('uid', '')}",
                    {cat: RequestMoments.from_stats(v) for cat, v in (stats.get("categories") or {}).items()},
                    time.time() - float(uptime) if uptime else None))
        except EngineUnreachable as exc:
            self.logger.warning(f"drift check skipped: {exc}")
            return degraded() if off else False
        version, memory = self.rt.samples.get(self.uid, ("", drift_mod.Memory()))
        if version != champion:
            memory = drift_mod.Memory()
        previous_baseline, same_models = None, False
        next_step = policy.ladder[previous.steps_taken] if previous.steps_taken < len(policy.ladder) else None
        if self.registry_down and next_step != drift_mod.SPECULATION_OFF:
            return off  # without MLflow only the protective first step is taken
        target = al.get(aliases_mod.PREVIOUS)
        if next_step == drift_mod.ROLLBACK and target and target != champion:
            # Rolling back only helps if the previous release does better on this traffic: its
            # gated baseline per category, and whether it serves the very same models.
            reg = self.rt.registry
            _, prev_verdict, _ = await self.registry(reg.gate_result, model, target)
            previous_baseline = gate_verdict.baseline_from_verdict(prev_verdict) if prev_verdict else None
            tags_prev = await self.registry(reg.version_tags, model, target)
            tags_cur = await self.registry(reg.version_tags, model, champion)

            def models(tags: dict[str, str]) -> Any:
                rel = json.loads(tags.get(TAG_RELEASE) or "{}")
                return rel.get("target"), rel.get("draft"), tags.get(TAG_TOKENIZER_DRAFT)
            same_models = TAG_RELEASE in tags_prev and models(tags_prev) == models(tags_cur)
        baseline = gate_verdict.baseline_from_verdict(verdict)
        if self.kind == "vllm":
            # vLLM counts drafts for the whole server, not per category: judge them against the
            # gated overall acceptance (and the previous release's, likewise).
            baseline = {k: v for k, v in baseline.items() if k == "*"}
            previous_baseline = {k: v for k, v in (previous_baseline or {}).items() if k == "*"} or None
        decision = drift_mod.decide(policy, previous, memory, time.time(), observed, baseline,
                                    previous_baseline, same_models)
        if self.registry_down and decision.action and decision.action != drift_mod.SPECULATION_OFF:
            return off
        self.rt.samples[self.uid] = (champion, decision.memory)
        state = decision.state
        probing = decision.memory.probe_started is not None
        self.out["drift"] = {**state.as_dict(), "version": str(champion), "probing": probing}
        last = decision.memory.last
        live = {cat: round(j.live, 4) for cat, j in last.items() if cat != drift_mod.OVERALL}
        if drift_mod.OVERALL in last:
            self.out["acceptance"] = round(last[drift_mod.OVERALL].live, 4)
        shift = dict((self.status.get("live") or {}).get("trafficShift") or {})
        for cat, n in decision.shift.items():
            shift[cat] = int(shift.get(cat, 0)) + n
        self.out["live"] = {"acceptance": live, "draftedTokens": {cat: j.drafted for cat, j in last.items()
                                                                  if cat != drift_mod.OVERALL},
                            "trafficShift": shift}
        messages = [j.message() for j in decision.breaches]
        if messages:
            self.cond(c.DRIFTED, True, "AcceptanceBelowBaseline", "; ".join(messages))
        elif any(j.verdict == drift_mod.FINE for j in decision.judged) and not off:
            self.cond(c.DRIFTED, False, "WithinBaseline", "live acceptance within the gated baseline"
                      + (f"; traffic shift, not judged: {', '.join(sorted(shift))}" if shift else ""))
        addresses = [self._address(pod) for pod in pods]
        if decision.action == drift_mod.SPECULATION_OFF:
            reason = "sustained drift: " + decision.reason
            # The mark first (see TAG_SPECULATION_OFF), then the pods. With MLflow down the status
            # alone carries the step (a crash before it is written loses it; the pods turn back on).
            if not self.registry_down:
                await self.registry(self.rt.registry.set_tags, model, champion, {TAG_SPECULATION_OFF: reason[:4000]})
            for address in addresses:
                await self._probe().set_speculation(address, False, reason[:500], server_name=self._server_name())
            self.out["speculationEnabled"] = False
            self.cond(c.DRIFTED, True, "SpeculationOff", reason)
            self.record("SpeculationOff", reason, champion, champion, warning=True)
            self.finish("Degraded", (True, "SpeculationOff", f"v{champion} serving target-only: {reason}"),
                        (False, "SpeculationOff", ""), (False, "SpeculationOff", ""))
            return True
        if decision.action == drift_mod.ROLLBACK:
            await self._rollback(model, al, champion, "drift persisted after speculation off: " + decision.reason)
            return True
        if decision.action == drift_mod.SPECULATION_ON:
            await self.registry(self.rt.registry.set_tags, model, champion, {TAG_SPECULATION_OFF: ""})
            for address in addresses:
                await self._probe().set_speculation(address, True, decision.reason[:500], server_name=self._server_name())
            self.out["speculationEnabled"] = True
            self.cond(c.DRIFTED, False, "Recovered", decision.reason)
            self.record("SpeculationOn", decision.reason, champion, champion)
            return False
        if decision.reason:
            self.cond(c.DRIFTED, True, "RollbackWouldNotHelp", decision.reason)
        if off:
            # Speculation stays off but keeps being measured: probes turn it on for a while
            # when the engine drafted nothing since.
            if self.status.get("speculationEnabled", True) != decision.speculation:
                for address in addresses:
                    await self._probe().set_speculation(address, decision.speculation,
                                                        "drift probe" if decision.speculation else "drift probe over",
                                                        server_name=self._server_name())
                self.logger.info(f"drift probe {'started' if decision.speculation else 'over'} for v{champion}")
            self.out["speculationEnabled"] = decision.speculation
            return degraded(" (probing with the draft)" if probing else "")
        return False
