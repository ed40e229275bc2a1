"""Leader election on a coordination.k8s.io/v1 Lease: however many operator processes run, one acts.

The decision is pure (`decide`: given the Lease, who I am, and my clock, do I create it, renew
it, take it over, or wait?) and the adapter is thin (`Elector`: read the Lease, write what the
decision says with the Lease's resourceVersion as a precondition, so of two candidates writing
at once the API server lets exactly one through).

As in client-go, a Lease is judged expired on the candidate's own clock: a record (holder,
renewTime, transitions) that has not changed for leaseDurationSeconds since this candidate first
saw it. Clocks of other machines are never compared with ours.

A leader fences itself: it acts only until `renew_deadline_s` after the start of its last
successful renewal (`Fence`), which is shorter than the lease duration, so it has stopped before
any other candidate may take over. The entry point (__main__.py) starts Kopf only once this
process leads and ends the process the moment the fence closes (exit, like a kill: every pass is
idempotent and the next leader redoes what was half done); handlers.reconcile also asks
`acting()` before each pass.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from specpair_operator.clients.kube import Kube, KubeError

LEASE_API = "coordination.k8s.io/v1"
CREATE, RENEW, TAKE, WAIT = "create", "renew", "take", "wait"
log = logging.getLogger("specpair.operator.leadership")


@dataclass(frozen=True)
class Timing:
    """client-go's defaults: a leader renews every retry period and gives up leading when it has
    not renewed for renew_deadline_s; others take over after lease_duration_s of silence."""
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(f"leader election needs 0 < retry period ({self.retry_period_s:g}s) < renew deadline "
                             f"({self.renew_deadline_s:g}s) < lease duration ({self.lease_duration_s:g}s): a leader "
                             "must stop acting before anyone may take its lease over")


@dataclass(frozen=True)
class Lease:
    """What the decision needs of a Lease object."""
    holder: str
    duration_s: float
    renew_time: str
    transitions: int
    resource_version: str = ""

    @property
    def record(self) -> tuple[str, str, int]:
        """What changes whenever anyone holds, renews or hands the Lease over."""
        return self.holder, self.renew_time, self.transitions

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> "Lease":
        spec = obj.get("spec") or {}
        return cls(holder=spec.get("holderIdentity") or "", duration_s=float(spec.get("leaseDurationSeconds") or 0),
                   renew_time=spec.get("renewTime") or "", transitions=int(spec.get("leaseTransitions") or 0),
                   resource_version=(obj.get("metadata") or {}).get("resourceVersion", ""))


@dataclass(frozen=True)
class Step:
    action: str  # CREATE, RENEW, TAKE or WAIT
    reason: str
    holder: str = ""  # who else holds the Lease (WAIT), when someone does


def decide(lease: Lease | None, me: str, now: float, seen_at: float) -> Step:
    """What a candidate does with the Lease as it reads it now. `now` and `seen_at` are the
    candidate's monotonic clock; `seen_at` is when it first saw this Lease's record."""
    if lease is None:
        return Step(CREATE, "no Lease yet")
    if lease.holder == me:
        return Step(RENEW, "held by this process")
    if not lease.holder:
        return Step(TAKE, "released by its last holder")
    silent = now - seen_at
    if silent >= lease.duration_s:
        return Step(TAKE, f"{lease.holder} has not renewed for {silent:.1f}s (lease {lease.duration_s:g}s)")
    return Step(WAIT, f"held by {lease.holder} (renewed {silent:.1f}s ago as seen here)", lease.holder)


@dataclass
class Fence:
    """Whether the leader may still act: until renew_deadline_s after the start of its last
    successful renewal (the API server wrote renewTime after that start)."""
    renew_deadline_s: float
    renewed_at: float | None = None

    def open(self, now: float) -> bool:
        return self.renewed_at is not None and now - self.renewed_at < self.renew_deadline_s


def _micro_time() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_identity(env: dict[str, str] | None = None) -> str:
    """The pod's name (POD_NAME, else the host's) plus a random part, so a restarted container is
    a new candidate that waits for its predecessor's Lease to expire instead of renewing it."""
    env = dict(os.environ) if env is None else env
    return f"{env.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class Elector:
    """The adapter: one Lease, one candidate identity, writes only with a resourceVersion
    precondition (a merge patch carrying metadata.resourceVersion is refused with 409 when the
    Lease changed since it was read)."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, timing: Timing):
        self.kube, self.namespace, self.name, self.identity, self.timing = kube, namespace, name, identity, timing
        self.fence = Fence(timing.renew_deadline_s)
        self._seen: tuple[tuple[str, str, int], float] | None = None

    async def read(self) -> Lease | None:
        obj = await self.kube.get(LEASE_API, "leases", self.namespace, self.name)
        return None if obj is None else Lease.from_object(obj)

    async def try_once(self) -> Step:
        """Read the Lease, decide, write. The fence opens only on a write the API server took."""
        started = time.monotonic()
        lease = await self.read()
        if lease is not None and (self._seen is None or self._seen[0] != lease.record):
            self._seen = (lease.record, started)
        step = decide(lease, self.identity, started, self._seen[1] if self._seen else started)
        if step.action == WAIT:
            return step
        now = _micro_time()
        spec: dict[str, Any] = {"holderIdentity": self.identity, "renewTime": now,
                                "leaseDurationSeconds": int(round(self.timing.lease_duration_s))}
        try:
            if step.action == CREATE:
                await self.kube.create({"apiVersion": LEASE_API, "kind": "Lease",
                                        "metadata": {"name": self.name, "namespace": self.namespace},
                                        "spec": {**spec, "acquireTime": now, "leaseTransitions": 0}},
                                       read_existing=False)
            else:
                if step.action == TAKE:
                    spec.update(acquireTime=now, leaseTransitions=lease.transitions + 1)
                await self.kube.merge_patch(LEASE_API, "leases", self.namespace, self.name,
                                            {"metadata": {"resourceVersion": lease.resource_version}, "spec": spec})
        except KubeError as exc:
            if exc.status != 409:
                raise
            return Step(WAIT, f"another candidate wrote the Lease first ({step.action} refused)")
        self.fence.renewed_at = started
        return step

    async def acquire(self, stop: threading.Event | None = None) -> None:
        """Until this process leads (or `stop` is set)."""
        said: tuple[str, str] | None = None
        while stop is None or not stop.is_set():
            try:
                step = await self.try_once()
            except (KubeError, OSError, asyncio.TimeoutError) as exc:
                step = Step(WAIT, f"Lease {self.namespace}/{self.name} not readable: {exc}")
            if step.action != WAIT:
                log.info(f"leading as {self.identity} (Lease {self.namespace}/{self.name}: {step.reason})")
                return
            if said != (step.holder, step.reason if not step.holder else ""):  # once per holder
                said = (step.holder, step.reason if not step.holder else "")
                log.info(f"not leading: {step.reason}")
            await asyncio.sleep(self.timing.retry_period_s)

    async def keep(self, stop: threading.Event, lost: Callable[[str], None]) -> None:
        """Renew every retry period; call `lost` (which ends the process) the moment the fence
        closes or the Lease is someone else's."""
        while not stop.is_set():
            await asyncio.sleep(self.timing.retry_period_s)
            if stop.is_set():
                break
            remaining = self.timing.renew_deadline_s - (time.monotonic() - (self.fence.renewed_at or 0.0))
            try:
                step = await asyncio.wait_for(self.try_once(), timeout=max(0.1, remaining))
            except (KubeError, OSError, asyncio.TimeoutError) as exc:
                step = Step(WAIT, f"renewal failed: {exc or type(exc).__name__}")
            if step.action != WAIT:
                continue  # renewed (or taken back after someone released it): the fence moved on
            if step.holder:
                lost(f"Lease {self.namespace}/{self.name} is held by {step.holder}")
                return
            if not self.fence.open(time.monotonic()):
                lost(f"not renewed for {self.timing.renew_deadline_s:g}s: {step.reason}")
                return

    async def release(self) -> None:
        """Hand the Lease over at once on a clean shutdown (no wait for it to expire)."""
        lease = await self.read()
        if lease is None or lease.holder != self.identity:
            return
        self.fence.renewed_at = None
        await self.kube.merge_patch(LEASE_API, "leases", self.namespace, self.name,
                                    {"metadata": {"resourceVersion": lease.resource_version},
                                     "spec": {"holderIdentity": "", "renewTime": _micro_time()}})
        log.info(f"released Lease {self.namespace}/{self.name}")


# This process's elector, when it elects (None: standalone, e.g. tests running Kopf directly).
_ELECTOR: Elector | None = None


def acting() -> bool:
    """Whether this process may act now: it does not elect, or it leads within its fence."""
    return _ELECTOR is None or _ELECTOR.fence.open(time.monotonic())


class Leadership:
    """Block until this process leads, then renew in a thread of its own (Kopf's event loop may
    be busy); end the process at once when leadership is lost."""

    def __init__(self, elector: Elector, exit_code: int = 1):
        self.elector, self.exit_code = elector, exit_code
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        global _ELECTOR
        asyncio.run(self._acquire())
        _ELECTOR = self.elector
        self._thread = threading.Thread(target=lambda: asyncio.run(self._keep()), name="lease-renewal", daemon=True)
        self._thread.start()

    async def _acquire(self) -> None:
        try:
            await self.elector.acquire()
        finally:
            await self.elector.kube.close()  # its session belongs to this event loop

    async def _keep(self) -> None:
        try:
            await self.elector.keep(self._stop, self._lost)
            if self._stop.is_set():
                try:
                    await self.elector.release()
                except (KubeError, OSError, asyncio.TimeoutError) as exc:
                    log.warning(f"Lease not released (it expires instead): {exc}")
        finally:
            await self.elector.kube.close()

    def _lost(self, reason: str) -> None:
        log.error(f"leadership lost: {reason}; exiting so that only the leader acts")
        logging.shutdown()
        os._exit(self.exit_code)

    def release(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
