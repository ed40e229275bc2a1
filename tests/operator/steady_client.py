"""A steady client of a pair's engine on the devcluster: the ready engine pod's address, and
greedy 'code' requests one after another to it in a thread, for the end-to-end tests that change
what a running pair serves (a draft swapped in place, a learned draft promoted) and check that
its replies never change and what failed."""

from __future__ import annotations

import threading

import grpc

from specpair._proto import engine_pb2, engine_pb2_grpc
from cluster_env import CODE_PROMPTS, engine_pods


def ready_address(ns) -> str | None:
    """A ready engine pod's gRPC address (its pod IP: there is no kube-proxy on devcluster)."""
    for pod in engine_pods(ns):
        if any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])):
            return f"{pod['status']['podIP']}:50051"
    return None


class SteadyClient:
    """Greedy 'code' requests one after another to whichever engine pod is ready, in a thread.
    Each reply is kept by prompt (a drafter never changes a greedy reply, so every one must equal
    the first); each failure is kept with the address it went to (a pod a test deletes may fail
    the requests it was serving). `chat`: the prompts as chat messages, as the gate sends its
    golden prompts. `pause`: seconds between requests (back to back, one run of the learning loop's
    test sent 4,200 requests in 151 s, CPU the CI run needs). With no ready pod, or after a
    failure, it looks again a second later."""

    PROMPTS = CODE_PROMPTS[:2]

    def __init__(self, ns, *, chat: bool = False, pause: float = 0.0) -> None:
        self.ns, self.chat, self.pause = ns, chat, pause
        self.replies: dict[str, list[str]] = {}
        self.failed: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def request(self, prompt: str) -> engine_pb2.GenerateRequest:
        if self.chat:
            chat = engine_pb2.ChatMessages(messages=[engine_pb2.ChatMessage(role="user", content=prompt)])
            return engine_pb2.GenerateRequest(chat=chat, max_new_tokens=12, category="code")
        return engine_pb2.GenerateRequest(prompt=prompt, max_new_tokens=12, category="code")

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            address, prompt = ready_address(self.ns), self.PROMPTS[i % len(self.PROMPTS)]
            i += 1
            if address is None:
                self.stop.wait(1)
                continue
            try:
                with grpc.insecure_channel(address) as channel:
                    stream = engine_pb2_grpc.EngineStub(channel).Generate(self.request(prompt), timeout=60)
                    text = "".join(r.text for r in stream)
            except grpc.RpcError as exc:
                self.failed.append(f"{address}: {exc.code().name}: {exc.details()}")
                self.stop.wait(1)
                continue
            self.replies.setdefault(prompt, []).append(text)
            if self.pause:
                self.stop.wait(self.pause)

    def count(self) -> int:
        return sum(len(r) for r in self.replies.values())

    def __enter__(self) -> "SteadyClient":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)
