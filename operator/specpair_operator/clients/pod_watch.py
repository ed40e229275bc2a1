"""Engine pods from a watch: an informer-style cache per namespace, so a settled pair's pass
reads its pods without asking the API server (clients/read_cache.py uses it on replayed passes).

For each namespace a settled pass has asked about, one task LISTs the engine pods
(ENGINE_PODS) and then WATCHes them from the list's resourceVersion, applying each event; a
watch that ends is resumed from the last version seen (bookmarks keep it fresh), one that is
refused (410 Gone) or broken lists again. Until its first list has been applied, and after any
failure until the next list is, a namespace's cache is not `synced` and answers nothing: the
caller lists, as it would without the cache. 1,000 pairs in 20 namespaces are 20 watches and
no request per pass, where a LIST per pass was 33 requests a second.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from specpair_operator.clients.kube import Kube, KubeError

# What the cache holds: every pair's engine pods (champion and canary), nothing else.
ENGINE_POD_LABEL = ("specpair.io/role", "engine")
ENGINE_PODS = f"{ENGINE_POD_LABEL[0]}={ENGINE_POD_LABEL[1]}"
# How long one watch request lasts before the API server ends it and it is resumed (Kopf's own
# watches too: handlers.configure).
WATCH_TIMEOUT_ENV, WATCH_TIMEOUT_S = "SPECPAIR_WATCH_TIMEOUT", 300


def watch_timeout() -> int:
    return int(os.environ.get(WATCH_TIMEOUT_ENV, str(WATCH_TIMEOUT_S)))


# A failed list or watch is tried again after this long (doubling to the cap).
RETRY_S, RETRY_CAP_S = 1.0, 30.0

log = logging.getLogger("specpair.operator.pods")


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


def matches(pod: dict[str, Any], labels: dict[str, str]) -> bool:
    have = (pod.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


@dataclass
class NamespacePods:
    """One namespace's engine pods by uid, as of `resource_version`; `synced` once a list is in."""
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    resource_version: str = ""
    synced: bool = False
    task: asyncio.Task | None = None

    def apply(self, event: dict[str, Any]) -> None:
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.resource_version = meta["resourceVersion"]
        if event.get("type") == "BOOKMARK":
            return
        if event.get("type") == "DELETED":
            self.pods.pop(meta.get("uid", ""), None)
        elif event.get("type") in ("ADDED", "MODIFIED"):
            self.pods[meta.get("uid", "")] = obj


class PodWatch:
    """The engine pods of the namespaces asked about, each kept by a watch (see the module)."""

    def __init__(self, kube: Kube, watch_timeout_s: int = WATCH_TIMEOUT_S):
        self.kube = kube
        self.watch_timeout_s = watch_timeout_s
        self.namespaces: dict[str, NamespacePods] = {}

    def pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]] | None:
        """The cached engine pods of `namespace` matching `label_selector` (copies), or None when
        the cache cannot answer (not synced yet, a selector it does not hold): the caller lists.
        The first question about a namespace starts its watch."""
        labels = equality_selector(label_selector)
        if labels is None or labels.get(ENGINE_POD_LABEL[0]) != ENGINE_POD_LABEL[1]:
            return None
        kept = self.namespaces.get(namespace)
        loop = asyncio.get_running_loop()
        if kept is None or kept.task is None or kept.task.done() or kept.task.get_loop() is not loop:
            kept = self.namespaces[namespace] = NamespacePods()
            # In a context of its own: not the pass's (clients/read_cache.CURRENT) that asked first.
            kept.task = loop.create_task(self._keep(namespace, kept), context=contextvars.Context())
        if not kept.synced:
            return None
        return [copy.deepcopy(p) for p in kept.pods.values() if matches(p, labels)]

    async def _keep(self, namespace: str, kept: NamespacePods) -> None:
        delay = RETRY_S
        while True:
            try:
                if not kept.synced:
                    items, version = await self.kube.list_versioned("v1", "pods", namespace, ENGINE_PODS)
                    kept.pods = {(p.get("metadata") or {}).get("uid", ""): p for p in items}
                    kept.resource_version, kept.synced = version, True
                async for event in self.kube.watch("v1", "pods", namespace, kept.resource_version, ENGINE_PODS,
                                                   self.watch_timeout_s):
                    kept.apply(event)
                delay = RETRY_S       # the server ended the watch: go on from the last version seen
            except asyncio.CancelledError:
                raise
            except KubeError as exc:
                # 410: the version is gone; anything else: the stream broke. Either way the
                # cache may have missed events: it answers nothing until the next list is in.
                kept.synced = False
                if exc.status != 410:
                    log.warning(f"engine pods of {namespace}: watch failed ({exc}); listing again in {delay:g} s")
                    await asyncio.sleep(delay)
                    delay = min(RETRY_CAP_S, delay * 2)
            except Exception:  # noqa: BLE001  (a bug here must not stop the passes: they list instead)
                kept.synced = False
                log.exception(f"engine pods of {namespace}: watch failed; listing again in {delay:g} s")
                await asyncio.sleep(delay)
                delay = min(RETRY_CAP_S, delay * 2)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        mine = [kept.task for kept in self.namespaces.values() if kept.task is not None and kept.task.get_loop() is loop]
        for task in mine:
            task.cancel()
        for task in mine:
            if True:
                try:
                    await task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001  (stopping)
                    pass
        self.namespaces.clear()
