"""What a settled pair's pass reads again, and what it takes from its last full pass.

A settled pair (handlers.settled: Serving its candidate, Ready for its generation) is passed over
at its drift interval so that drift is judged every window. What that judgement needs changes
between passes: the engine pods (readiness, IPs) and their counters, read every pass. What the
rest of the pass reads does not change unless someone changes it: the registered model's aliases
and the versions' tags in MLflow (the operator's own writes aside), the engine's Deployment,
Service, NetworkPolicy, autoscaler and the prompts' ConfigMap. Those come, on such a pass, from
the last full pass over the pair (a `PassReads`), so a settled pass makes no API request and
no MLflow request. A full pass reads its engine pods, Deployments, Services, NetworkPolicies and
autoscalers from watches too (clients/pod_watch.py), so it asks the API server only, with
gating.configMapRef, for its prompts, and MLflow twice.

A pass is full, and records afresh, when any of these holds (`replays`):
- the pair is not settled (in motion, every step reads what it acts on);
- a watch woke it (its Deployment or a Job changed: Kopf delivers the object's change) or Kopf's
  own handler runs it (a spec changed, the operator resumed);
- its generation is not the one its reads were taken for;
- its reads are older than the resync backstop (handlers.resync_interval): what no watch shows,
  an alias moved or a tag edited in MLflow by hand, is seen then (a Service or NetworkPolicy
  edited or deleted by hand wakes the pair's pass: handlers.wake_owner).
A write the pass makes through these clients drops what it wrote from the reads, so the pass and
the next read it back from the server.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from specpair_operator.clients.engine_probe import GrpcEngineProbe
from specpair_operator.clients.kube import PLURALS, Kube
from specpair_operator.clients.pod_watch import (GONE, NAMED_KINDS, NamespacedWatch, OnChange, PodWatch, copied,
                                                 watch_timeout, watched_reads)
from specpair_operator.clients.registry import PassRegistry, ReleaseRegistry

# The kinds read by name whose answer a settled pass may take from the last full pass: the
# operator's own children that stand still while a pair serves, and the prompts' ConfigMap. Not
# Jobs (they finish by themselves), not pods (listed every pass), never Secrets or Leases.
REPLAYED_PLURALS = frozenset({"deployments", "services", "networkpolicies", "horizontalpodautoscalers",
                              "scaledobjects", "configmaps"})


@dataclass
class PassReads:
    """The reads of a pair's last full pass, taken at `fetched_at` (monotonic) for `generation`;
    `replaying` while a settled pass answers from them."""
    fetched_at: float
    generation: Any
    replaying: bool = False
    objects: dict[tuple[str, str, str], dict[str, Any] | None] = field(default_factory=dict)
    aliases: dict[str, dict[str, str]] = field(default_factory=dict)
    tags: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    # The settled passes made on these reads, and what they still asked the servers (by kind,
    # "list pods", "mlflow", or an engine call: "GetModelInfo", "GetStats"): what a test and the
    # operator's log can show; and the pod lists they took from the pod watch instead.
    replayed: int = 0
    asked_replaying: dict[str, int] = field(default_factory=dict)
    pods_from_watch: int = 0
    # The GETs by name a watch answered instead (Deployments, Services, NetworkPolicies, autoscalers).
    from_watch: int = 0
    # What each engine pod (by its control address) said it is, in the last full pass or since:
    # a settled pass takes it from here and asks the pod for its counters only (RememberingProbe).
    pod_info: dict[str, dict[str, Any]] = field(default_factory=dict)

    def count(self, what: str) -> None:
        if self.replaying:
            self.asked_replaying[what] = self.asked_replaying.get(what, 0) + 1


def replays(settled: bool, woken: bool, reads: PassReads | None, generation: Any, now: float,
            resync: float) -> bool:
    """Whether a pass takes what stands still from `reads` (see the module's docstring)."""
    return settled and not woken and reads is not None and reads.generation == generation \
        and now - reads.fetched_at < resync


# The pass this task runs, if any: set by handlers.reconcile around one pair's pass (asyncio copies
# it into what the pass awaits), None outside passes (leadership, the CA, Kopf's own calls).
CURRENT: contextvars.ContextVar[PassReads | None] = contextvars.ContextVar("specpair_pass_reads", default=None)


class CachingKube(Kube):
    """The operator's Kubernetes client. Inside a pass:
    - a LIST of engine pods is answered by the pod watch (clients/pod_watch.py) once it is synced,
      on every pass (a full one too, unless SPECPAIR_WATCHED_READS=0: the watch is as fresh as a
      LIST, and the operator never writes pods);
    - a GET of a Deployment, Service, NetworkPolicy, HPA or ScaledObject is answered by that kind's
      watch (present or absent) once synced and while no write of the name is pending (pod_watch's
      read-your-writes);
    - a settled pass answers a GET of the other REPLAYED_PLURALS from its last full pass's record
      (a kind not recorded yet is read and recorded);
    - any write drops the record of what it wrote and marks the name in its kind's watch.
    `on_change` (set by handlers.login) hears every change the watches apply: a Service or
    NetworkPolicy deleted or edited by hand, or an autoscaler deleted, wakes its pair's pass."""

    _pod_watch: PodWatch | None = None
    _named: dict[str, NamespacedWatch] | None = None
    on_change: OnChange | None = None

    @property
    def pod_watch(self) -> PodWatch:
        if self._pod_watch is None:
            self._pod_watch = PodWatch(self, watch_timeout())
        return self._pod_watch

    def named_watch(self, plural: str) -> NamespacedWatch | None:
        """The watch that answers GETs of `plural` by name, if that kind is watched (NAMED_KINDS)."""
        kind = NAMED_KINDS.get(plural)
        if kind is None or not watched_reads():
            return None
        if self._named is None:
            self._named = {}
        if plural not in self._named:
            self._named[plural] = NamespacedWatch(self, kind, watch_timeout(), self._changed)
        return self._named[plural]

    def _changed(self, plural: str, event_type: str, obj: dict[str, Any]) -> None:
        if self.on_change is not None:
            self.on_change(plural, event_type, obj)

    async def close(self) -> None:
        if self._pod_watch is not None:
            await self._pod_watch.close()
        for watch in (self._named or {}).values():
            await watch.close()
        await super().close()

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        reads = CURRENT.get()
        if reads is None:
            return await super().get(api_version, plural, namespace, name)
        key = (plural, namespace or "", name)
        if plural in REPLAYED_PLURALS and reads.replaying and key in reads.objects:
            return copied(reads.objects[key])
        watch = self.named_watch(plural) if namespace else None
        answered, obj = watch.named(namespace, name) if watch is not None and namespace else (False, None)
        if answered:
            reads.from_watch += 1
        elif plural in REPLAYED_PLURALS:
            reads.count(plural)
            obj = await super().get(api_version, plural, namespace, name)
        else:
            return await super().get(api_version, plural, namespace, name)
        if plural in REPLAYED_PLURALS:
            reads.objects[key] = copied(obj)
        return obj

    def _drop(self, plural: str, namespace: str | None, name: str) -> None:
        reads = CURRENT.get()
        if reads is not None:
            reads.objects.pop((plural, namespace or "", name), None)

    def _wrote(self, plural: str, namespace: str | None, name: str, written: Any) -> None:
        """Mark a write in its kind's watch, with the version the server returned (GONE: deleted)."""
        watch = (self._named or {}).get(plural)
        if watch is None or not namespace:
            return
        version = written if written == GONE else str(((written or {}).get("metadata") or {}).get("resourceVersion") or "")
        watch.wrote(namespace, name, version)

    async def _marked(self, plural: str, namespace: str | None, name: str, write: Any) -> Any:
        """Awaits a write and marks it in its kind's watch: what the server returned, or (the write
        failed; it may have been made) an unknown version."""
        try:
            written = await write
        except BaseException:
            self._wrote(plural, namespace, name, None)
            raise
        self._wrote(plural, namespace, name, written)
        return written

    async def create(self, obj: dict[str, Any], read_existing: bool = True, dry_run: bool = False) -> dict[str, Any]:
        meta = obj["metadata"]
        plural = PLURALS.get(obj["kind"], "")
        self._drop(plural, meta.get("namespace"), meta["name"])
        if dry_run:
            return await super().create(obj, read_existing=read_existing, dry_run=dry_run)
        return await self._marked(plural, meta.get("namespace"), meta["name"],
                                  super().create(obj, read_existing=read_existing, dry_run=dry_run))

    async def merge_patch(self, api_version: str, plural: str, namespace: str | None, name: str,
                          patch: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        self._drop(plural, namespace, name)
        return await self._marked(plural, namespace, name, super().merge_patch(
            api_version, plural, namespace, name, patch, subresource=subresource))

    async def json_patch(self, api_version: str, plural: str, namespace: str | None, name: str,
                         operations: list[dict[str, Any]], dry_run: bool = False) -> dict[str, Any]:
        self._drop(plural, namespace, name)
        if dry_run:
            return await super().json_patch(api_version, plural, namespace, name, operations, dry_run=dry_run)
        return await self._marked(plural, namespace, name, super().json_patch(
            api_version, plural, namespace, name, operations, dry_run=dry_run))

    async def delete(self, api_version: str, plural: str, namespace: str | None, name: str, uid: str) -> bool:
        self._drop(plural, namespace, name)
        try:
            deleted = await super().delete(api_version, plural, namespace, name, uid)
        except BaseException:
            self._wrote(plural, namespace, name, None)
            raise
        self._wrote(plural, namespace, name, GONE)
        return deleted

    async def list(self, api_version: str, plural: str, namespace: str | None,
                   label_selector: str | None = None) -> list[dict[str, Any]]:
        reads = CURRENT.get()
        if reads is not None and (reads.replaying or watched_reads()) and plural == "pods" and api_version == "v1" \
                and namespace and label_selector:
            watched = self.pod_watch.pods(namespace, label_selector)
            if watched is not None:
                reads.pods_from_watch += 1
                return watched
        if reads is not None:
            reads.count(f"list {plural}")
        return await super().list(api_version, plural, namespace, label_selector)


class RememberingProbe(GrpcEngineProbe):
    """The operator's engine probe: inside a pass, what a pod says it is (GetModelInfo: its
    release, content hash, tokenizers, speculation switch) is recorded, and a settled pass takes
    it from the record, so its only call to a pod is GetStats, once per pod per drift window
    (the window is what brings a settled pair's pass). A pod says the same for its whole life
    but for the speculation switch, which only the operator throws: a switch drops the pod's
    record. A pod replaced or restarted changes its Deployment's status, whose watch wakes a full
    pass (handlers.on_owned_event), and the resync backstop reads everything again."""

    async def model_info(self, address: str, server_name: str = "") -> dict[str, Any]:
        reads = CURRENT.get()
        if reads is None:
            return await super().model_info(address, server_name)
        if reads.replaying and address in reads.pod_info:
            return copied(reads.pod_info[address])
        reads.count("GetModelInfo")
        info = await super().model_info(address, server_name)
        reads.pod_info[address] = copied(info)
        return info

    async def stats(self, address: str, server_name: str = "") -> dict[str, Any]:
        reads = CURRENT.get()
        if reads is not None:
            reads.count("GetStats")
        return await super().stats(address, server_name)

    async def set_speculation(self, address: str, enabled: bool, reason: str = "", server_name: str = "") -> None:
        reads = CURRENT.get()
        if reads is not None:
            reads.pod_info.pop(address, None)
        await super().set_speculation(address, enabled, reason, server_name)
        if reads is not None:
            reads.pod_info.pop(address, None)     # a GetModelInfo that raced the switch

    async def swap_draft(self, address: str, release_json: str, reason: str = "", server_name: str = "") -> dict[str, Any]:
        reads = CURRENT.get()
        try:
            return await super().swap_draft(address, release_json, reason, server_name)
        finally:
            if reads is not None:
                reads.pod_info.pop(address, None)     # the pod reports another draft now


class RememberingRegistry(PassRegistry):
    """A pass's view of the registry (PassRegistry: each alias set and version's tags read once,
    a write drops what it wrote) that starts, on a settled pass, from what the last full pass read,
    and leaves what it read in `reads` for the next one. The registered model's ownership was
    checked by that full pass; a settled pass does not ask again."""

    def __init__(self, registry: ReleaseRegistry, reads: PassReads):
        super().__init__(registry)
        self.pass_reads = reads
        if reads.replaying:
            self._aliases = copied(reads.aliases)
            self._tags = copied(reads.tags)

    def answered(self, method: str, *args: Any) -> bool:
        if method == "ensure_model":
            return self.pass_reads.replaying and args[0] in self._aliases
        return super().answered(method, *args)

    def ensure_model(self, model_name: str, pair_ref: str, pair_uid: str = "") -> None:
        if self.pass_reads.replaying and model_name in self._aliases:
            return
        self.pass_reads.count("mlflow")
        super().ensure_model(model_name, pair_ref, pair_uid)

    def aliases(self, model_name: str) -> dict[str, str]:
        if model_name not in self._aliases and not self._local_only:
            self.pass_reads.count("mlflow")
        return super().aliases(model_name)

    def version_tags(self, model_name: str, version: str) -> dict[str, str]:
        if (model_name, str(version)) not in self._tags and not self._local_only:
            self.pass_reads.count("mlflow")
        return super().version_tags(model_name, version)

    def keep(self) -> None:
        """What this pass read (and did not write since) is what the next settled pass starts from."""
        self.pass_reads.aliases = copied(self._aliases)
        self.pass_reads.tags = copied(self._tags)
