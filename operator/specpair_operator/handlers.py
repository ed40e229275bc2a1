"""Kopf's wiring for SpecModelPair: settings and clients at start-up, the change handlers, the
watch that keeps each pair's latest body, and the periodic loop; each pass is a PairReconciler
(act/reconciler.py), run one at a time per pair and only while this operator leads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import hashlib
import json
import logging
import os
import threading
import time
from typing import Any

import kopf

from specpair_operator.gate import attempts as gate_attempts
from specpair_operator import leadership
from specpair_operator.desired import manifests
from specpair_operator.act import capture_cleanup, metrics
from specpair_operator.release import content as release_mod
from specpair_operator.desired import tls as tls_mod
from specpair_operator.clients.kube import KubeError
from specpair_operator.clients.pod_watch import watch_timeout
from specpair_operator.clients.read_cache import (CURRENT, CachingKube, PassReads, RememberingProbe,
                                                  RememberingRegistry, replays)
from specpair_operator.act.reconciler import PairReconciler
from specpair_operator.clients.registry import ReleaseRegistry
from specpair_operator.state import STATE, operator_namespace

GROUP, VERSION, PLURAL = "specpair.io", "v1alpha1", "specmodelpairs"
# How long a body that does not show the records the last pass wrote is left alone (a write
# that failed is not waited on longer than this).
STALE_BODY_S = 10.0


# Kopf's last-handled configuration (the pair's spec, to tell an update from a resumption) is kept
# as it is up to this size, and above it as a digest: a spec that weighs more than an object's
# annotations may hold (256 KiB) would make every write of the annotation, and the status Kopf
# writes with it, a 422, again and again. A pair that large is refused by validation anyway
# (MAX_SPEC_BYTES); this keeps that refusal writable.
DIFFBASE_INLINE_BYTES = 64 * 1024
DIFFBASE_DIGEST = "specpair.io/essence-sha256"


def _essence_digest(essence: Any) -> str:
    return hashlib.sha256(json.dumps(essence, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class BoundedDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """Kopf's annotation storage, with a large essence stored as its digest: on reading it back,
    the current essence if it has that digest (nothing changed), else an empty one (changed; the
    old one is not known, and the handlers use no diff)."""

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        if len(json.dumps(essence, separators=(",", ":")).encode()) > DIFFBASE_INLINE_BYTES:
            essence = {DIFFBASE_DIGEST: _essence_digest(essence)}
        super().store(body=body, patch=patch, essence=essence)

    def fetch(self, *, body: kopf.Body) -> Any:
        stored = super().fetch(body=body)
        if isinstance(stored, dict) and DIFFBASE_DIGEST in stored:
            current = self.build(body=body)
            return current if _essence_digest(current) == stored[DIFFBASE_DIGEST] else {}
        return stored


# The cyclic garbage collector, tuned for a long-running process that keeps much and makes more:
# what exists once the operator has started (its imports, Kopf's, MLflow's, gRPC's: ~190,000
# objects) is frozen out of every collection (gc.freeze), and a young collection waits for
# GC_YOUNG_THRESHOLD new objects rather than Python's 700. Each pass makes tens of thousands of
# short-lived dicts while eight passes await their reads, so at 700 the young collections
# promoted the passes' live temporaries, and the full collections that followed walked the whole
# import-time heap each time: in a simulation of eight concurrent passes over a 100-pair heap a
# third of the CPU went to the collector, 8% with the heap frozen, 5% with the threshold too.
GC_YOUNG_THRESHOLD = 7000


def tune_garbage_collector() -> bool:
    """Only where the operator owns its process (Kopf on the main thread: `kopf run`, the chart's
    entry point): an operator embedded in another program's thread (kopf.testing.KopfRunner in a
    test process) leaves that program's collector as it is."""
    if threading.current_thread() is not threading.main_thread():
        return False
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    return True


def registry_threads() -> int:
    """How many MLflow calls the operator makes at once (SPECPAIR_REGISTRY_THREADS, default 32)."""
    return int(os.environ.get("SPECPAIR_REGISTRY_THREADS", "32"))


def reconcile_interval() -> float:
    return float(os.environ.get("SPECPAIR_RECONCILE_INTERVAL", "10"))


# A settled pair (pass_delay) is passed over at least this often, whatever its drift interval,
# and its reads taken afresh (a full pass), for what no watch shows: MLflow edited by hand, a
# Service or NetworkPolicy deleted by hand. Thirty intervals by default (300 s at the default
# 10 s): a full pass costs about three replayed ones (two MLflow calls and six API requests), and
# at six intervals half of a settled pair's passes were full, which put 1,000 pairs at ~0.8 core
# instead of ~0.5 (docs/measurements/2026-12-06-operator-scale.md).
RESYNC_INTERVALS = 30.0


def resync_interval(interval: float) -> float:
    return float(os.environ.get("SPECPAIR_RESYNC_INTERVAL", interval * RESYNC_INTERVALS))


def settled(body: dict[str, Any], status: dict[str, Any]) -> bool:
    """Serving its candidate, Ready for its generation: a pair nothing moves until something
    changes (its spec, its objects, MLflow, its engines' counters)."""
    ready = next((cd for cd in status.get("conditions") or [] if cd.get("type") == "Ready"), {})
    return status.get("phase") == "Serving" and ready.get("status") == "True" \
        and ready.get("observedGeneration") == (body.get("metadata") or {}).get("generation") \
        and bool(status.get("servingVersion")) and status.get("servingVersion") == status.get("candidateVersion")


def replay_settled_reads() -> bool:
    """Whether a settled pair's passes between full ones replay their reads (clients/read_cache.py)."""
    return os.environ.get("SPECPAIR_REPLAY_SETTLED_READS", "1") != "0"


def pass_delay(body: dict[str, Any], status: dict[str, Any], interval: float, resync: float) -> float:
    """Seconds until a pair's next periodic pass, from the status its last pass left. A pair in
    motion (being gated, scored, rolled out, failing, a spec not yet observed) is passed over
    every interval. A settled one (Serving its candidate, Ready for its generation) waits on
    events (its Jobs' and Deployments' changes wake it, a spec change is handled at once),
    with a pass when its drift check is due (spec.drift.intervalSeconds: drift is still judged
    every window) and every `resync` at the latest."""
    if not settled(body, status):
        return interval
    drift = (body.get("spec") or {}).get("drift") or {}
    delay = resync
    if drift.get("enabled", True):
        delay = min(delay, float(drift.get("intervalSeconds", 30)))
    return max(interval, delay)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Annotations, not status: status belongs to the CRD's documented fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="specpair.io")
    settings.persistence.diffbase_storage = BoundedDiffBaseStorage(prefix="specpair.io", key="last-handled-configuration")
    settings.posting.level = logging.INFO
    # No cluster-wide watching of CRDs and namespaces: the chart installs the CRD before the
    # operator starts and names the namespaces, so the least-privilege RBAC needs neither.
    settings.scanning.disabled = True
    settings.watching.server_timeout = watch_timeout()
    settings.networking.error_backoffs = [0.5, 1, 2, 5]
    STATE.tracking_uri = os.environ.get("SPECPAIR_MLFLOW_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not STATE.tracking_uri:
        raise kopf.PermanentError("set SPECPAIR_MLFLOW_TRACKING_URI (or MLFLOW_TRACKING_URI)")
    STATE.gate_tracking_uri = os.environ.get("SPECPAIR_GATE_MLFLOW_TRACKING_URI", STATE.tracking_uri)
    # A Secret (expected in each pair's namespace) with MLflow credentials for gate and engine
    # pods, and its keys; a pair's spec.mlflow.credentialsSecretRef takes precedence.
    try:
        STATE.credentials = manifests.MlflowCredentials.from_env(os.environ)
    except ValueError as exc:
        raise kopf.PermanentError(str(exc)) from exc
    # The chart's engine.* and gate.* values: the image for pairs that name none (it goes into
    # their releases), pull secrets, the model cache limit, who may reach engine pods.
    release_mod.set_default_engine_image(os.environ.get("SPECPAIR_ENGINE_IMAGE"))
    try:
        STATE.pods = manifests.PodDefaults.from_env(os.environ)
        gate_attempts.Policy.from_env(os.environ)  # read again where used; refused here when malformed
    except ValueError as exc:
        raise kopf.PermanentError(str(exc)) from exc
    STATE.registry = ReleaseRegistry(STATE.tracking_uri)
    STATE.forget_all()   # a (re)started operator remembers nothing: all it needs is in the cluster and MLflow
    STATE.wake = asyncio.Event()   # this run's loop (an operator restarted in-process has a new one)
    STATE.probe = RememberingProbe()
    STATE.operator_namespace = operator_namespace()
    if not STATE.operator_namespace:
        raise kopf.PermanentError("set SPECPAIR_OPERATOR_NAMESPACE: the namespace of the operator's CA Secret "
                                  f"({tls_mod.CA_SECRET}); in a pod it is read from the service account")
    STATE.ca, STATE.client_cert, STATE.ca_lock = None, None, None
    metrics.serve_from_env()
    # MLflow's client is synchronous: every registry call of a pass runs in the loop's default
    # executor (asyncio.to_thread), whose default size is the CPU count + 4: on a 2-core node,
    # six calls at once for all the pairs being created, gated and promoted, each call waiting
    # on MLflow rather than on this process's CPU.
    asyncio.get_running_loop().set_default_executor(
        concurrent.futures.ThreadPoolExecutor(max_workers=registry_threads(), thread_name_prefix="specpair-registry"))
    STATE.periodic = asyncio.create_task(periodic_passes(reconcile_interval()))
    if tune_garbage_collector():
        logging.getLogger("specpair.operator").info(
            f"garbage collector: {gc.get_freeze_count()} start-up objects frozen, young threshold {GC_YOUNG_THRESHOLD}")


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Kopf's own credential discovery, shared with the operator's client for child objects."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        STATE.kube = CachingKube.from_connection_info(info)
        STATE.kube.on_change = wake_owner
    return info


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if STATE.periodic is not None:
        STATE.periodic.cancel()
        try:
            await STATE.periodic
        except (asyncio.CancelledError, Exception):  # noqa: BLE001  (stopping; it logged its own errors)
            pass
        STATE.periodic = None
    if STATE.probe is not None:
        await STATE.probe.close()
    if STATE.kube is not None:
        await STATE.kube.close()


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
        # Nothing of a deleted pair stays: its memory, and its metric series.
        STATE.forget(uid)
        metrics.forget_pair(body.metadata.namespace, body.metadata.name)
    else:
        STATE.bodies[uid] = json.loads(json.dumps(dict(body)))
        if body.metadata.get("deletionTimestamp") and capture_cleanup.waits_on_us(body):
            # Deleted, and it waits on its captured traffic's clean-up: at once, not when next due.
            STATE.woken.add(uid)
            STATE.wake.set()


# What a pair's next step waits on, most of the time, is one of its own objects changing: its gate
# Job (or model-fetch Job) finishing, its engine Deployment's pods turning ready or failing. Their
# watch wakes a pass over the owner at once, as an Owns() watch does in controller-runtime, instead
# of leaving it to the next tick of the periodic loop (SPECPAIR_RECONCILE_INTERVAL, 10 s by
# default), which is left to what only polling sees: MLflow, the engines' own counters, time.
OWNED = {"app.kubernetes.io/managed-by": "specpair-operator"}


@kopf.on.event("batch", "v1", "jobs", labels=OWNED)
@kopf.on.event("apps", "v1", "deployments", labels=OWNED)
async def on_owned_event(body: kopf.Body, **_: Any) -> None:
    for ref in body.metadata.get("ownerReferences") or []:
        if ref.get("kind") == "SpecModelPair" and ref.get("uid") in STATE.bodies:
            STATE.woken.add(ref["uid"])
            STATE.wake.set()


def wake_owner(plural: str, event_type: str, obj: dict[str, Any]) -> None:
    """A pair's Service or NetworkPolicy edited or deleted, or its autoscaler deleted (the
    operator's watches of them, clients/pod_watch.py): wake its pair's pass, which puts it back at
    once instead of at the resync backstop. Deployments wake through Kopf's watch
    (on_owned_event); an object's creation is the operator's own doing; an autoscaler's other
    changes are its controller's status writes (every few seconds, nothing to put back)."""
    if event_type == "ADDED" or not (plural in ("services", "networkpolicies") or (
            plural in ("horizontalpodautoscalers", "scaledobjects") and event_type == "DELETED")):
        return
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "SpecModelPair" and ref.get("uid") in STATE.bodies:
            STATE.woken.add(ref["uid"])
            STATE.wake.set()


class _PairLogger(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['pair']}] {msg}", kwargs


async def periodic_passes(interval: float) -> None:
    """Each known pair's pass when it is due (pass_delay: every `interval` while it is in
    motion, at its drift interval or the resync backstop once settled), a few at a time, and
    between those a pass over each pair an owned object's change woke (on_owned_event). A pass
    that fails unexpectedly is logged; the loop goes on (the pair is due again after `interval`)."""
    log = logging.getLogger("specpair.operator.periodic")
    limit = asyncio.Semaphore(int(os.environ.get("SPECPAIR_CONCURRENT_PASSES", "8")))
    resync = resync_interval(interval)

    async def one(raw: dict[str, Any], woken: bool) -> None:
        async with limit:
            if STATE.kube is None:
                return
            uid = raw["metadata"]["uid"]
            # Due again after an interval unless the pass says otherwise (a pass skipped, one
            # that raised): never sooner, so a pass that cannot run does not spin the loop.
            STATE.due_at[uid] = time.monotonic() + interval
            # Captured traffic (spec.learning): the one finalizer, and the clean-up Job of a pair
            # being deleted (act/capture_cleanup.py); a deleting pair gets no other pass.
            if leadership.acting():
                try:
                    await capture_cleanup.converge(STATE.kube, raw, STATE.pods)
                except KubeError as exc:
                    if exc.status != 404:
                        log.warning(f"capture clean-up of {raw['metadata']['namespace']}/{raw['metadata']['name']}: {exc}")
                except Exception:  # noqa: BLE001  (a bug must not stop every pair's passes)
                    log.exception(f"capture clean-up of {raw['metadata']['namespace']}/{raw['metadata']['name']} failed")
            if raw["metadata"].get("deletionTimestamp"):
                return
            body, patch = kopf.Body(raw), kopf.Patch()
            meta = raw["metadata"]
            logger = _PairLogger(log, {"pair": f"{meta['namespace']}/{meta['name']}"})
            try:
                await reconcile(body, patch, logger, resync=resync, interval=interval,  # type: ignore[arg-type]
                                woken=woken)
                if patch.status:
                    await STATE.kube.merge_patch(f"{GROUP}/{VERSION}", PLURAL, meta["namespace"], meta["name"],
                                                   {"status": dict(patch.status)}, subresource="status")
            except KubeError as exc:
                if exc.status != 404:  # deleted meanwhile: its DELETED event is on its way
                    log.warning(f"periodic pass over {meta['namespace']}/{meta['name']}: {exc}")
            except Exception:  # noqa: BLE001  (a bug must not stop every pair's passes)
                log.exception(f"periodic pass over {meta['namespace']}/{meta['name']} failed")

    while True:
        now = time.monotonic()
        next_due = min((STATE.due_at.get(uid, 0.0) for uid in STATE.bodies), default=now + interval)
        try:
            await asyncio.wait_for(STATE.wake.wait(), max(0.0, min(next_due, now + interval) - now))
        except asyncio.TimeoutError:
            pass
        STATE.wake.clear()
        now = time.monotonic()
        woken = set(STATE.woken)
        due = woken | {uid for uid in STATE.bodies if STATE.due_at.get(uid, 0.0) <= now}
        # A change that arrives during these passes wakes the loop again as soon as they end.
        STATE.woken.clear()
        await asyncio.gather(*(one(STATE.bodies[uid], uid in woken) for uid in due if uid in STATE.bodies))


async def reconcile(body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, force: bool = False,
                    resync: float | None = None, interval: float | None = None, woken: bool = False) -> None:
    uid = body.metadata.uid
    lock = STATE.locks.setdefault(uid, asyncio.Lock())
    if lock.locked():
        return  # the other trigger is on it; level-triggered, so nothing is lost
    async with lock:
        if not force and time.monotonic() < STATE.retry_at.get(uid, 0.0):
            return
        if not leadership.acting():
            return  # an elected operator whose Lease lapsed: it is about to exit, the next leader acts
        status = dict(body.get("status") or {})
        written = STATE.status_written.get(uid)
        if written is not None and written[0] != records_of(status) and time.monotonic() < written[1]:
            # The body does not show the records the last pass wrote yet (the watch has not
            # delivered that write, or Kopf's own patch came in between): a pass on it would take
            # those records for undone and repeat them, or write a history without them.
            return
        interval = reconcile_interval() if interval is None else interval
        resync = resync_interval(interval) if resync is None else resync
        await _pass(body, patch, logger, status, woken=force or woken, resync=resync)
        if "history" in patch.status or "recorded" in patch.status:
            STATE.status_written[uid] = (records_of({**status, **patch.status}), time.monotonic() + STALE_BODY_S)
        # From the status this pass leaves (a drift check's figures written or not: the pair is as
        # settled either way).
        STATE.due_at[uid] = time.monotonic() + pass_delay(dict(body), {**status, **dict(patch.status)}, interval, resync)
        if uid not in STATE.bodies:
            # Deleted during the pass (the watch delivers a body before any pass over it): what
            # the pass remembered or exported goes with the pair, as on_event's forgetting did.
            STATE.forget(uid)
            metrics.forget_pair(body.metadata.namespace, body.metadata.name)


async def _pass(body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, status: dict[str, Any], woken: bool,
                resync: float) -> None:
    """One PairReconciler pass, full or (a settled pair, between full passes) on the reads of its
    last full pass (clients/read_cache.py): the pass's registry view and, through CURRENT, the
    Kubernetes client answer from them."""
    uid, generation, now = body.metadata.uid, body.metadata.get("generation"), time.monotonic()
    reads = STATE.pass_reads.get(uid)
    if reads is not None and replays(replay_settled_reads() and settled(dict(body), status), woken, reads,
                                     generation, now, resync):
        reads.replaying, reads.replayed = True, reads.replayed + 1
    else:
        reads = STATE.pass_reads[uid] = PassReads(now, generation)
    reconciler = PairReconciler(body, patch, logger)
    view = RememberingRegistry(STATE.registry, reads)   # type: ignore[arg-type]
    reconciler.reads = view                              # the pass's view of MLflow (PairReconciler.reads)
    token = CURRENT.set(reads)
    try:
        await reconciler.reconcile()
    finally:
        CURRENT.reset(token)
        reads.replaying = False
        view.keep()


def records_of(status: dict[str, Any]) -> str:
    """What a status says was done: its history and the keys recorded per action."""
    return json.dumps([status.get("history") or [], status.get("recorded") or {}], sort_keys=True)
