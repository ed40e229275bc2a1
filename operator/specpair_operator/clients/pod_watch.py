"""The operator's children from watches: an informer-style cache per namespace and kind, so a
pass reads its engine pods, Deployments, Services, NetworkPolicies and autoscalers (HPA, KEDA's
ScaledObject) without asking the API server (clients/read_cache.CachingKube answers from it inside passes).

For each namespace a pass has asked about, one task per kind LISTs the objects (`WatchedKind`:
the engine pods by their label, every Deployment, Service and NetworkPolicy of the namespace)
and then WATCHes them from the list's resourceVersion, applying each event; a watch that ends is
resumed from the last version seen (bookmarks keep it fresh), one that is refused (410 Gone) or
broken lists again. Until its first list has been applied, and after any failure until the next
list is, a namespace's cache is not `synced` and answers nothing: the caller asks the API
server, as it would without the cache. 1,000 pairs in 20 namespaces are 120 watches and no
request per pass, where a LIST of pods and five GETs per full pass were ~6 requests a second.

Read-your-writes: the operator's own write of an object (create, patch, delete) marks its name
(`written`) until the watch delivers that write (the resourceVersion the write returned, or the
DELETED event): a pass right after a write must not take the object from before it for the
current one. While marked, the cache does not answer for that name: the caller GETs it.

The kinds held whole (every object of the namespace, not only labelled ones) answer absence too:
an object not in a synced cache is not there, so a full pass of a settled pair makes no GET for
a canary Deployment it has none of. The engine pods are held by label (a namespace may have many
other pods), so only that selector is answered.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from specpair_operator.clients.kube import Kube, KubeError


def copied(obj: Any) -> Any:
    """A copy of an object as the API server or an engine pod gave it (JSON's types: dicts,
    lists, strings, numbers), for a pass that may change it: through pickle, 3x faster than
    copy's deepcopy (23 against 77 us a Deployment), which a settled pass paid for each pod,
    child and record it read."""
    return pickle.loads(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))

# What the pod cache holds: every pair's engine pods (champion and canary), nothing else.
ENGINE_POD_LABEL = ("specpair.io/role", "engine")
ENGINE_PODS = f"{ENGINE_POD_LABEL[0]}={ENGINE_POD_LABEL[1]}"
# How long one watch request lasts before the API server ends it and it is resumed (Kopf's own
# watches too: handlers.configure).
WATCH_TIMEOUT_ENV, WATCH_TIMEOUT_S = "SPECPAIR_WATCH_TIMEOUT", 300
# Whether passes read Deployments, Services and NetworkPolicies from watches (the A/B switch of
# bench/operator_scale.py; "0": every full pass GETs them, as before).
WATCHED_READS_ENV = "SPECPAIR_WATCHED_READS"
# A write's mark is dropped after this long even if the watch never showed the write (a write
# that failed after reaching the server, a version the watch skipped in a relist): the name is
# then answered from the cache again, which by then has had ample time to catch up.
WRITTEN_MARK_S = 30.0


def watch_timeout() -> int:
    return int(os.environ.get(WATCH_TIMEOUT_ENV, str(WATCH_TIMEOUT_S)))


def watched_reads() -> bool:
    return os.environ.get(WATCHED_READS_ENV, "1") != "0"


# A failed list or watch is tried again after this long (doubling to the cap).
RETRY_S, RETRY_CAP_S = 1.0, 30.0

log = logging.getLogger("specpair.operator.watch")


@dataclass(frozen=True)
class WatchedKind:
    """A kind kept by a watch per namespace: all its objects (`label` None) or those with one label."""
    api_version: str
    plural: str
    label: tuple[str, str] | None = None

    @property
    def selector(self) -> str | None:
        return None if self.label is None else f"{self.label[0]}={self.label[1]}"


ENGINE_POD_KIND = WatchedKind("v1", "pods", ENGINE_POD_LABEL)
DEPLOYMENTS = WatchedKind("apps/v1", "deployments")
SERVICES = WatchedKind("v1", "services")
NETWORK_POLICIES = WatchedKind("networking.k8s.io/v1", "networkpolicies")
# A pair's autoscaler (desired/autoscaling.py): every full pass asks for it by name, present or
# not (a pair without autoscaling asks so as to delete a leftover one). KEDA's kind exists only
# while its CRD is installed: its watch is started by the first GET of one (plan_autoscaler asks
# only then), and while the kind is not served its list fails (404) and the cache answers nothing.
HORIZONTAL_POD_AUTOSCALERS = WatchedKind("autoscaling/v2", "horizontalpodautoscalers")
SCALED_OBJECTS = WatchedKind("keda.sh/v1alpha1", "scaledobjects")
# The kinds a pass reads by name from watches (CachingKube.get).
NAMED_KINDS = {k.plural: k for k in (DEPLOYMENTS, SERVICES, NETWORK_POLICIES, HORIZONTAL_POD_AUTOSCALERS,
                                     SCALED_OBJECTS)}


def equality_selector(selector: str) -> dict[str, str] | None:
    """`a=b,c=d` as {a: b, c: d}; None for any other form (sets, inequalities, existence), which
    the cache does not answer."""
    labels = {}
    for term in selector.split(","):
        key, eq, value = term.partition("=")
        if not eq or not key.strip() or any(ch in term for ch in "!()") or value.startswith("="):
            return None
        labels[key.strip()] = value.strip()
    return labels


def matches(obj: dict[str, Any], labels: dict[str, str]) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


# A mark's version for a delete: cleared by the name's DELETED event.
GONE = "deleted"


@dataclass
class Written:
    """The operator's own write of a name, not yet seen on the watch: the version it returned
    (GONE for a delete, "" when unknown: any event of the name clears it), and when (monotonic)."""
    version: str
    at: float


def mark_cleared(mark: Written, event_type: str, version: str, now: float) -> bool:
    """Whether a watch event (`event_type`, the object's `version`) shows the marked write, or
    the mark is old enough to drop (WRITTEN_MARK_S)."""
    if now - mark.at >= WRITTEN_MARK_S:
        return True
    if mark.version == GONE:
        return event_type == "DELETED"
    return mark.version == "" or version == mark.version


def kept_form(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as a cache holds it: without metadata.managedFields (who set which field, by
    server-side apply), which the operator never reads; it is most of a Deployment's bytes, and
    every object a cache holds is copied for each answer (and held for every pair)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        obj = {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
    return obj


@dataclass
class NamespaceObjects:
    """One namespace's objects of a kind by name, as of `resource_version`; `synced` once a list
    is in; the operator's writes not yet seen (`written`, by name)."""
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    resource_version: str = ""
    synced: bool = False
    task: asyncio.Task | None = None
    written: dict[str, Written] = field(default_factory=dict)

    def apply(self, event: dict[str, Any], now: float | None = None) -> None:
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        version = meta.get("resourceVersion") or ""
        if version:
            self.resource_version = version
        kind = event.get("type")
        if kind == "BOOKMARK":
            return
        name = meta.get("name", "")
        if kind == "DELETED":
            self.objects.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self.objects[name] = kept_form(obj)
        else:
            return
        mark = self.written.get(name)
        if mark is not None and mark_cleared(mark, kind, version, time.monotonic() if now is None else now):
            del self.written[name]

    def listed(self, items: list[dict[str, Any]], version: str, started: float) -> None:
        """A fresh list (begun at `started`): the cache is what it says; writes made before the
        list began are in it."""
        self.objects = {(o.get("metadata") or {}).get("name", ""): kept_form(o) for o in items}
        self.resource_version, self.synced = version, True
        self.written = {n: m for n, m in self.written.items() if m.at >= started}

    def answers(self, name: str, now: float) -> bool:
        """Whether the cache may answer for `name`: synced, and no write of it pending."""
        if not self.synced:
            return False
        mark = self.written.get(name)
        if mark is not None and now - mark.at >= WRITTEN_MARK_S:
            del self.written[name]
            mark = None
        return mark is None

    def mark(self, name: str, version: str, now: float) -> None:
        """The operator wrote `name` (its returned `version`; GONE: deleted). Already seen on the
        watch (a create answered by the existing object, a delete of what is gone): no mark."""
        held = self.objects.get(name)
        if version == GONE and held is None and self.synced:
            return
        if version and version != GONE and held is not None \
                and (held.get("metadata") or {}).get("resourceVersion") == version:
            return
        self.written[name] = Written(version, now)


# Called with (kind's plural, event type, object) for each change a synced watch applies.
OnChange = Callable[[str, str, dict[str, Any]], None]


class NamespacedWatch:
    """One kind's objects in the namespaces asked about, each namespace kept by a watch (see the
    module)."""

    def __init__(self, kube: Kube, kind: WatchedKind, watch_timeout_s: int = WATCH_TIMEOUT_S,
                 on_change: OnChange | None = None):
        self.kube, self.kind = kube, kind
        self.watch_timeout_s = watch_timeout_s
        self.on_change = on_change
        self.namespaces: dict[str, NamespaceObjects] = {}

    def _kept(self, namespace: str) -> NamespaceObjects:
        """The namespace's cache; the first question about a namespace starts its watch."""
        kept = self.namespaces.get(namespace)
        loop = asyncio.get_running_loop()
        if kept is None or kept.task is None or kept.task.done() or kept.task.get_loop() is not loop:
            kept = self.namespaces[namespace] = NamespaceObjects(written=kept.written if kept else {})
            # In a context of its own: not the pass's (clients/read_cache.CURRENT) that asked first.
            kept.task = loop.create_task(self._keep(namespace, kept), context=contextvars.Context())
        return kept

    def selected(self, namespace: str, label_selector: str) -> list[dict[str, Any]] | None:
        """The cached objects of `namespace` matching `label_selector` (copies), or None when the
        cache cannot answer (not synced yet, a selector it does not hold): the caller lists."""
        labels = equality_selector(label_selector)
        if labels is None or (self.kind.label is not None and labels.get(self.kind.label[0]) != self.kind.label[1]):
            return None
        kept = self._kept(namespace)
        if not kept.synced:
            return None
        return [copied(o) for o in kept.objects.values() if matches(o, labels)]

    def named(self, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
        """(answered, the object or None when absent) for a kind held whole; (False, None) when
        the cache cannot answer (not synced, a write of the name not seen yet): the caller GETs."""
        if self.kind.label is not None:
            return False, None
        kept = self._kept(namespace)
        if not kept.answers(name, time.monotonic()):
            return False, None
        obj = kept.objects.get(name)
        return True, (copied(obj) if obj is not None else None)

    def wrote(self, namespace: str, name: str, version: str) -> None:
        """The operator wrote `name` in `namespace` (see NamespaceObjects.mark)."""
        kept = self.namespaces.get(namespace)
        if kept is not None:
            kept.mark(name, version, time.monotonic())

    async def _keep(self, namespace: str, kept: NamespaceObjects) -> None:
        delay = RETRY_S
        api_version, plural, selector = self.kind.api_version, self.kind.plural, self.kind.selector
        while True:
            try:
                if not kept.synced:
                    started = time.monotonic()
                    items, version = await self.kube.list_versioned(api_version, plural, namespace, selector)
                    kept.listed(items, version, started)
                async for event in self.kube.watch(api_version, plural, namespace, kept.resource_version, selector,
                                                   self.watch_timeout_s):
                    kept.apply(event)
                    if self.on_change is not None and event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self.on_change(plural, event["type"], event.get("object") or {})
                delay = RETRY_S       # the server ended the watch: go on from the last version seen
            except asyncio.CancelledError:
                raise
            except KubeError as exc:
                # 410: the version is gone; anything else: the stream broke. Either way the
                # cache may have missed events: it answers nothing until the next list is in.
                kept.synced = False
                if exc.status != 410:
                    # 404: the kind is not served (KEDA's CRD removed): said quietly, tried again.
                    log.log(logging.DEBUG if exc.status == 404 else logging.WARNING,
                            f"{plural} of {namespace}: watch failed ({exc}); listing again in {delay:g} s")
                    await asyncio.sleep(delay)
                    delay = min(RETRY_CAP_S, delay * 2)
            except Exception:  # noqa: BLE001  (a bug here must not stop the passes: they read instead)
                kept.synced = False
                log.exception(f"{plural} of {namespace}: watch failed; listing again in {delay:g} s")
                await asyncio.sleep(delay)
                delay = min(RETRY_CAP_S, delay * 2)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        mine = [kept.task for kept in self.namespaces.values() if kept.task is not None and kept.task.get_loop() is loop]
        for task in mine:
            task.cancel()
        for task in mine:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001  (stopping)
                pass
        self.namespaces.clear()


class PodWatch(NamespacedWatch):
    """The engine pods (ENGINE_PODS) of the namespaces asked about."""

    def __init__(self, kube: Kube, watch_timeout_s: int = WATCH_TIMEOUT_S, on_change: OnChange | None = None):
        super().__init__(kube, ENGINE_POD_KIND, watch_timeout_s, on_change)

    def pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]] | None:
        return self.selected(namespace, label_selector)
