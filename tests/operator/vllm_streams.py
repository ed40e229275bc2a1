"""Clients streaming OpenAI completions through a vLLM pair's pods, every request recorded.

The devcluster has no kube-proxy: each client picks the address itself, as a Service's load
balancing would, round robin over the pods that are ready and not being deleted (listed every
LIST_SECONDS; a deletion seen at once by a watch, as endpoints drop a terminating pod). A request
refused by a pod that is going away (the node stops a deleted pod's programs as soon as its own
watch sees the deletion, which can be before this client's watch does: a refused connection, or
the companion's 503 with Retry-After) is counted in `refused` and sent again elsewhere, as a
client retrying a refused request would. Every other error, and any reply that ends unfinished
(a 200 stream closed before its first token included: the companion never lets one reach a
client), is a failure.
"""

from __future__ import annotations

import threading
import time
from typing import Any

LIST_SECONDS = 0.5


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


class Streams:
    def __init__(self, cluster: Any, namespace: str, pair: str, token: str, *, http_port: int = 8000):
        from specpair_devcluster.client import Kube
        self.namespace, self.pair, self.token, self.http_port = namespace, pair, token, http_port
        self.lister, self.watcher = Kube.from_kubeconfig(cluster.kubeconfig), Kube.from_kubeconfig(cluster.kubeconfig)
        self.lock = threading.Lock()
        self.turn = 0
        self.ready: list[tuple[str, str]] = []              # (pod, ip) of ready pods, sorted
        self.deleted_at: dict[str, float] = {}              # pod -> when the watch saw its deletion
        self.done: list[tuple[str, float, float]] = []      # (pod, started, ended) of finished replies
        self.failed: list[tuple[str, str]] = []             # (pod, what went wrong)
        self.refused: list[tuple[str, str]] = []            # (pod, error) refused before a token while going away
        self.closing = threading.Event()
        self.threads: list[tuple[threading.Thread, threading.Event]] = []
        for loop in (self._list, self._watch):
            threading.Thread(target=loop, daemon=True).start()

    def _list(self) -> None:
        while not self.closing.wait(LIST_SECONDS):
            pods = self.lister.list("v1", "Pod", self.namespace,
                                    labels=f"specpair.io/pair={self.pair},specpair.io/role=engine")
            self.ready = sorted((p["metadata"]["name"], p["status"]["podIP"]) for p in pods
                                if ready(p) and not p["metadata"].get("deletionTimestamp"))

    def _watch(self) -> None:
        while not self.closing.is_set():
            for event in self.watcher.watch("v1", "Pod", self.namespace, timeout_seconds=2):
                meta = (event.get("object") or {}).get("metadata") or {}
                if (meta.get("labels") or {}).get("specpair.io/pair") == self.pair and meta.get("deletionTimestamp"):
                    self.deleted_at.setdefault(meta["name"], time.monotonic())

    def _stream(self, stop: threading.Event, body: dict[str, Any]) -> None:
        import openai

        while not stop.is_set():
            targets = [(pod, ip) for pod, ip in self.ready if pod not in self.deleted_at]
            if not targets:
                time.sleep(0.1)
                continue
            with self.lock:
                pod, ip = targets[self.turn % len(targets)]
                self.turn += 1
            client = openai.OpenAI(base_url=f"http://{ip}:{self.http_port}/v1", api_key=self.token, max_retries=0,
                                   timeout=120)
            started, tokens, finish = time.monotonic(), 0, None
            try:
                for chunk in client.completions.create(stream=True, **body):
                    for choice in chunk.choices:
                        tokens += bool(choice.text)
                        finish = choice.finish_reason or finish
                with self.lock:
                    if finish in ("length", "stop"):
                        self.done.append((pod, started, time.monotonic()))
                    else:
                        self.failed.append((pod, f"the stream ended unfinished ({finish}) after {tokens} chunks"))
            except openai.APIError as exc:
                time.sleep(0.5)   # the watch catches up with a deletion the node saw first
                with self.lock:
                    if not tokens and pod in self.deleted_at:
                        self.refused.append((pod, f"{type(exc).__name__}: {exc}"))
                    else:
                        self.failed.append((pod, f"{type(exc).__name__}: {exc} after {tokens} chunks"))
            finally:
                client.close()

    def run(self, streams: int, **body: Any) -> threading.Event:
        """`streams` clients sending the completion `body` (openai's create arguments) one after
        another until the returned event is set."""
        stop = threading.Event()
        for _ in range(streams):
            t = threading.Thread(target=self._stream, args=(stop, body), daemon=True)
            t.start()
            self.threads.append((t, stop))
        return stop

    def stop_all(self) -> None:
        for _, stop in self.threads:
            stop.set()
        for t, _ in self.threads:
            t.join(150)

    def served_by(self) -> set[str]:
        with self.lock:
            return {pod for pod, _, _ in self.done}

    def close(self) -> None:
        self.stop_all()
        self.closing.set()
        self.lister.close()
        self.watcher.close()
