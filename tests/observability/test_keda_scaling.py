"""Real KEDA scales a served pair 1 -> 3 -> 1 from the engines' own metrics in a real Prometheus.

The devcluster runs KEDA's operator and metrics API server (built from the kedacore/keda/v2
module; specpair_devcluster.keda), registered as the external metrics API. The pair asks for
`rollout.autoscaling`; the operator (the chart's Deployment) finds KEDA's CRD and writes a
ScaledObject owned by the pair, from which KEDA makes an HPA; the HPA controller in
kube-controller-manager reads KEDA's metric through the API server and writes the pair's scale
subresource, and the operator rolls that count into the engine Deployment. Prometheus scrapes the engines through the chart's ServiceMonitor. The pair is served
by real `specpair engine serve` pods on tiny models, gated by the real `specpair gate`.

Traffic reaches the pods the way a Service spreads it, round-robin over the ready addresses of
pods not being deleted, picked by the client itself: the devcluster has no kube-proxy.

The scenario: a burst of concurrent streams keeps more requests running than one replica is
meant to hold, KEDA's HPA scales the pair to 3, and each new pod serves the same release
(version, content hash verified by the operator's identity check, drift watch on that release)
without a gate or a history entry; the burst ends, a trickle of streams goes on, and the HPA
scales back to 1 after its (shortened) stabilization window: the pods removed drain (the
engine finishes the streams it admitted on SIGTERM), and no client request fails.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from gate_tuning import NO_SWEEPS
from obs_helpers import CHART, helm, render

pytestmark = pytest.mark.slow

RELEASE, OPERATOR_NAMESPACE = "keda-scaling", "specpair-keda-scaling"
PAIR_API = "specpair.io/v1alpha1"
PAIR = "scaled"
HTTP_PORT = 8000   # the engine pods' OpenAI-compatible API (the operator's default rollout.httpPort)
SCRAPE = "1s"
OPERATOR_ENV = {"SPECPAIR_RECONCILE_INTERVAL": "1", "SPECPAIR_WATCH_TIMEOUT": "30"}
# Requests running per replica that the pair is sized for; the burst runs BURST_STREAMS at once
# (wanting ceil(8 running / 3) = 3 replicas: an engine runs 8 at a time), the trickle one stream
# on each of the 3 pods (wanting ceil(3 / 3) = 1), so each pod the scale-down removes has a
# stream running when it is deleted. A trickle stream ends with its pod: moved to the pod that
# stays, its requests and the draining pods' last ones made 5 running, and the HPA scaled back to 2.
TARGET_RUNNING, BURST_STREAMS = 3, 9
# Long requests: a stream spends its time running, not between requests, so the running count
# Prometheus samples is the number of streams. The trickle's are longer still (the models' copies
# here take TRICKLE_POSITIONS): the scale-down must find a request running on a pod it removes.
MAX_NEW_TOKENS, TRICKLE_NEW_TOKENS, TRICKLE_POSITIONS = 400, 1000, 1100
# Seconds, for a test: KEDA's own polling and the HPA's scale-down window (production: 30 s, 300 s).
# The window is HELD_WINDOW until a trickle request runs on each pod (the test's own doing, below).
POLLING, SCALE_DOWN_WINDOW, HELD_WINDOW = 1, 5, 600
# One golden prompt of 4 tokens (the gate generates each some thirty times in its k sweep): the gate
# must pass (greedy identity), and nothing here reads its numbers.
GATE_TOKENS = 4
# How often the client lists the ready pods: a new pod gets streams within this, a deleted one none
# at once (the watch); listing every 0.2 s was 5 lists a second of API server and client work.
LIST_SECONDS = 0.5
PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n    print(", "import json\n\ndef load(path):"]


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


class Load:
    """Client streams spread over the pair's ready pods (no kube-proxy here: the client picks the
    address, as a Service's load balancing would). The addresses are those of ready pods, listed
    every LIST_SECONDS, less any pod a watch has seen deleted (at once: the node stops a deleted pod's
    program as soon as its own watch sees the deletion, as endpoints drop a terminating pod). That
    watch can be ahead of this one: a request a draining pod refuses before it starts (gRPC
    UNAVAILABLE or HTTP 503, "shutting down") is counted in `refused` and sent to another pod, as a
    client retrying a refusal would. Every request is recorded; a failed one is any other error or a
    reply that ended unfinished.

    The burst streams gRPC Generate round robin; each sticky (trickle) stream sends OpenAI
    completions, not streamed, to its own pod over one connection. Streamed, this process (its
    node agents' threads among others) read a reply's tokens slower than a pod made them: a pod had
    sent its whole reply and sat idle while its client still read, and a scale-down found nothing
    running on it in one run of three."""

    def __init__(self, kubeconfig: Path, namespace: str):
        from specpair_devcluster.client import Kube
        self.ns = namespace
        self.lister, self.watcher = Kube.from_kubeconfig(kubeconfig), Kube.from_kubeconfig(kubeconfig)
        self.lock = threading.Lock()
        self.turn = 0
        self.ready: list[tuple[str, str]] = []           # (pod, address), sorted
        self.deleted_at: dict[str, float] = {}           # pod -> when the watch saw it deleted
        self.done: list[tuple[str, float, float]] = []   # (pod, started, ended) on time.monotonic()
        self.failed: list[tuple[str, str]] = []          # (pod, what went wrong)
        self.refused: list[str] = []                     # pods that refused a request while draining
        self.sticky_running: dict[int, str] = {}         # sticky stream -> the pod its request runs on now
        self.closing = threading.Event()
        self.threads: list[tuple[threading.Thread, threading.Event]] = []
        for loop in (self._list, self._watch):
            threading.Thread(target=loop, daemon=True).start()

    def _list(self) -> None:
        while not self.closing.wait(LIST_SECONDS):
            pods = self.lister.list("v1", "Pod", self.ns, labels=f"specpair.io/pair={PAIR},specpair.io/role=engine")
            self.ready = sorted((p["metadata"]["name"], f"{p['status']['podIP']}:50051") for p in pods
                                if ready(p) and not p["metadata"].get("deletionTimestamp"))

    def _watch(self) -> None:
        while not self.closing.is_set():
            for event in self.watcher.watch("v1", "Pod", self.ns, timeout_seconds=2):
                meta = (event.get("object") or {}).get("metadata") or {}
                if (meta.get("labels") or {}).get("specpair.io/pair") == PAIR and meta.get("deletionTimestamp"):
                    self.deleted_at.setdefault(meta["name"], time.monotonic())

    def _stream(self, stop: threading.Event, index: int, max_new_tokens: int, sticky: bool) -> None:
        own, client = None, None   # a sticky stream's pod, and its connection to it
        try:
            while not stop.is_set():
                if own is not None and own in self.deleted_at:
                    return   # its pod is going away: the stream ends with it (TARGET_RUNNING says why)
                targets = [(pod, address) for pod, address in self.ready
                           if pod not in self.deleted_at and pod not in self.refused]
                if not targets:
                    time.sleep(0.1)
                    continue
                with self.lock:
                    if sticky:
                        # The stream's own pod while it is there, as a client holding a connection.
                        pod, address = next(((p, a) for p, a in targets if p == own), None) or targets[index % len(targets)]
                    else:
                        pod, address = targets[self.turn % len(targets)]
                    self.turn += 1
                if sticky:
                    if client is None or pod != own:
                        if client is not None:
                            client.close()
                        client = openai.OpenAI(base_url=f"http://{address.rsplit(':', 1)[0]}:{HTTP_PORT}/v1",
                                               api_key="none", max_retries=0, timeout=60)
                    own = pod
                    self.sticky_running[index] = pod
                    try:
                        self._complete(client, pod, index, max_new_tokens)
                    finally:
                        self.sticky_running.pop(index, None)
                else:
                    self._generate(pod, address, index, max_new_tokens)
                if sticky and pod in self.refused:
                    return   # as when the watch sees the deletion first: it ends with its pod
        finally:
            if client is not None:
                client.close()

    def _generate(self, pod: str, address: str, index: int, max_new_tokens: int) -> None:
        """One streamed gRPC Generate."""
        from specpair._proto import engine_pb2, engine_pb2_grpc
        tokens, finished, started = 0, False, time.monotonic()
        try:
            with grpc.insecure_channel(address) as channel:
                request = engine_pb2.GenerateRequest(prompt=PROMPTS[index % len(PROMPTS)],
                                                     max_new_tokens=max_new_tokens, category="code")
                for reply in engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60):
                    tokens += len(reply.token_ids)
                    finished = finished or reply.finish_reason != 0
            self._record(pod, started, finished and tokens, f"the stream ended unfinished after {tokens} tokens")
        except grpc.RpcError as exc:
            refused = exc.code() == grpc.StatusCode.UNAVAILABLE and not tokens and "shutting down" in exc.details()
            self._record(pod, started, False, f"{exc.code().name}: {exc.details()} after {tokens} tokens", refused)

    def _complete(self, client: openai.OpenAI, pod: str, index: int, max_new_tokens: int) -> None:
        """One OpenAI completion, not streamed: the pod holds it until the whole reply is sent."""
        started = time.monotonic()
        try:
            reply = client.completions.create(model=PAIR, prompt=PROMPTS[index % len(PROMPTS)],
                                              max_tokens=max_new_tokens, temperature=0)
            done = reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens > 0
            self._record(pod, started, done, f"unfinished: {reply.choices[0].finish_reason}")
        except openai.APIStatusError as exc:
            self._record(pod, started, False, f"HTTP {exc.status_code}: {exc.message}",
                         refused=exc.status_code == 503 and "shutting down" in exc.message)
        except openai.APIError as exc:
            self._record(pod, started, False, f"{type(exc).__name__}: {exc}")

    def _record(self, pod: str, started: float, done: Any, failure: str, refused: bool = False) -> None:
        with self.lock:
            if done:
                self.done.append((pod, started, time.monotonic()))
            elif refused:
                self.refused.append(pod)
            else:
                self.failed.append((pod, failure))

    def run(self, streams: int, max_new_tokens: int, sticky: bool = False) -> threading.Event:
        stop = threading.Event()
        for i in range(streams):
            t = threading.Thread(target=self._stream, args=(stop, i, max_new_tokens, sticky), daemon=True)
            t.start()
            self.threads.append((t, stop))
        return stop

    def stop_all(self) -> None:
        for _, stop in self.threads:
            stop.set()
        for t, _ in self.threads:
            t.join(90)

    def close(self) -> None:
        self.stop_all()
        self.closing.set()
        self.lister.close()
        self.watcher.close()


def quantity(metric_list: dict[str, Any]) -> float:
    """The one value of an ExternalMetricValueList (a Kubernetes quantity: "6", "1500m")."""
    (item,) = metric_list["items"]
    value = item["value"]
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


@pytest.fixture
def models(tiny_pair_dirs):
    """The tiny models where pods can read them (each pod has /tmp as its own emptyDir)."""
    root = Path.home() / ".cache" / "specpair-test-models" / f"keda-{uuid.uuid4().hex[:8]}"
    out = {k: str(shutil.copytree(v, root / k)) for k, v in tiny_pair_dirs.items()}
    for folder in out.values():   # rotary positions: any length works, the weights being random
        config = Path(folder) / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": TRICKLE_POSITIONS}))
    yield out
    shutil.rmtree(root, ignore_errors=True)


def test_keda_scales_a_served_pair_up_under_load_and_back_down_draining(devcluster, mlflow_server, models, tmp_path,
                                                                      prometheus_bin):
    from specpair_devcluster.keda import DevKeda
    from specpair_devcluster.prometheus import DevPrometheus

    t0 = time.monotonic()
    kube = devcluster.kube
    namespace = f"keda-{uuid.uuid4().hex[:6]}"
    devcluster.ensure_namespace(namespace)
    prom, keda, load = None, None, Load(devcluster.kubeconfig, namespace)

    def log(what: str) -> None:
        print(f"{time.monotonic() - t0:6.1f} s  {what}")

    def pair() -> dict[str, Any]:
        return kube.get(PAIR_API, "SpecModelPair", namespace, PAIR) or {}

    def engine_pods() -> list[dict[str, Any]]:
        return kube.list("v1", "Pod", namespace, labels=f"specpair.io/pair={PAIR},specpair.io/role=engine")

    def wait(what: str, predicate: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = predicate()
            if got:
                log(what)
                return got
            time.sleep(0.5)
        hpas = kube.list("autoscaling/v2", "horizontalpodautoscalers", namespace)
        state = {"pair": pair().get("status"), "hpa": [h.get("status") for h in hpas],
                 "pods": [(p["metadata"]["name"], (p.get("status") or {}).get("phase"), ready(p)) for p in engine_pods()],
                 "load": {"done": len(load.done), "failed": load.failed[-3:]}}
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}: {json.dumps(state, default=str)[-4000:]}")

    def serving_on(n: int) -> dict[str, Any] | None:
        """The pair when v1 serves from exactly n ready pods, all of v1, identity verified on n."""
        obj = pair()
        st = obj.get("status") or {}
        pods = [p for p in engine_pods() if not p["metadata"].get("deletionTimestamp")]
        conditions = {c["type"]: c for c in st.get("conditions") or []}
        ok = (st.get("phase") == "Serving" and st.get("servingVersion") == "1" and st.get("replicas") == n
              and len(pods) == n and all(ready(p) for p in pods)
              and {p["metadata"]["labels"].get("specpair.io/release-version") for p in pods} == {"1"}
              and f"serving on {n} pod(s), identity verified" in conditions.get("Ready", {}).get("message", ""))
        return obj if ok else None

    def values(mlflow_url: str) -> dict[str, Any]:
        return {"mlflow": {"trackingUri": mlflow_url}, "watchNamespaces": [namespace],
                "operator": {"extraEnv": [{"name": k, "value": v} for k, v in OPERATOR_ENV.items()]}}

    def install_operator() -> None:
        # On the session's MLflow: the pair's model is named from this test's namespace.
        helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
             values=values(mlflow_server.url), kubeconfig=devcluster.kubeconfig)

    # The operator starts while Prometheus and KEDA do: nothing in either waits on the other.
    pool = ThreadPoolExecutor(1)
    installing = pool.submit(install_operator)
    try:
        # The monitor rendered before MLflow's address is known: no monitor reads it (the chart requires one).
        monitors = [m for m in render({**values("http://mlflow.invalid:5000"),
                                       "metrics": {"serviceMonitor": {"enabled": True, "interval": SCRAPE}}},
                                      RELEASE, OPERATOR_NAMESPACE) if m["kind"] == "ServiceMonitor"]
        prom = DevPrometheus(devcluster, tmp_path / "prometheus", monitors, interval=SCRAPE).start()
        keda = DevKeda(devcluster, tmp_path / "keda").start()
        installing.result()
        log("operator installed, Prometheus and KEDA ready")

        kube.create({"apiVersion": PAIR_API, "kind": "SpecModelPair", "metadata": {"name": PAIR, "namespace": namespace},
                     "spec": {"target": {"source": models["target"]}, "draft": {"source": models["draft"]},
                              "speculation": {"k": 3},
                              "gating": {"prompts": [{"prompt": PROMPTS[0], "category": "code"}],
                                         "maxNewTokens": GATE_TOKENS, "thresholds": {"requireGreedyIdentity": True},
                                         "tuning": NO_SWEEPS},
                              # No stop delay: a removed pod drains at once, so a stream is still
                              # running on it when told to stop (with the default 5 s delay, unready
                              # but serving, its streams often ended before the drain began: CI at
                              # 687c8a4). The delay itself: test_server_stop_delay, test_gateway_canary.
                              "rollout": {"applyGateTuning": False, "shutdown": {"stopDelaySeconds": 0},
                                          "autoscaling": {
                                  "minReplicas": 1, "maxReplicas": 3, "metric": "runningRequests",
                                  "target": TARGET_RUNNING, "prometheusAddress": prom.url,
                                  "pollingIntervalSeconds": POLLING,
                                  "scaleDownStabilizationSeconds": HELD_WINDOW}}}})
        served = wait("v1 serving on 1 pod", lambda: serving_on(1), timeout=300)
        history = served["status"].get("history")
        drift_version = str((served["status"].get("drift") or {}).get("version", ""))
        log(f"drift watch: {served['status'].get('drift')}")

        # The operator found KEDA's CRD and wrote a ScaledObject owned by the pair, on its scale subresource.
        (scaled,) = wait("the operator's ScaledObject", lambda: kube.list("keda.sh/v1alpha1", "scaledobjects", namespace),
                         timeout=60)
        assert [o["uid"] for o in scaled["metadata"]["ownerReferences"]] == [served["metadata"]["uid"]]
        assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": PAIR_API, "kind": "SpecModelPair", "name": PAIR}
        (trigger,) = scaled["spec"]["triggers"]
        assert (trigger["type"], trigger["metadata"]["serverAddress"]) == ("prometheus", prom.url)
        (hpa,) = wait("KEDA's HPA for it", lambda: kube.list("autoscaling/v2", "horizontalpodautoscalers", namespace),
                      timeout=60)
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": PAIR_API, "kind": "SpecModelPair", "name": PAIR}
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "External"

        def read_metric() -> float:
            """What the HPA reads: KEDA's external metric, through the API server, from Prometheus."""
            selector = metric["external"]["metric"]["selector"]["matchLabels"]
            return quantity(keda.external_metric(namespace, metric["external"]["metric"]["name"],
                                                 ",".join(f"{k}={v}" for k, v in selector.items())))

        burst = load.run(BURST_STREAMS, MAX_NEW_TOKENS)
        specs: list[int | None] = []

        def scaled_up() -> dict[str, Any] | None:
            specs.append(pair()["spec"]["rollout"].get("replicas"))
            return serving_on(3)
        up = wait("scaled to 3 and serving v1 on 3 pods", scaled_up, timeout=120)
        # The HPA scaled the pair itself (its scale subresource: spec.rollout.replicas) to 3.
        assert max(r or 0 for r in specs) == 3, specs
        assert read_metric() > 0
        # Scaling is not a release: no gate, no history entry, the same release watched for drift.
        assert up["status"].get("history") == history
        assert str((up["status"].get("drift") or {}).get("version", "")) == drift_version
        # Each pod the scale-down removes must be running a request when told to stop: a trickle
        # stream on each pod first, then the scale-down. The trickle streams take one pod each from
        # the client's own list of ready pods (listed every LIST_SECONDS, later on a loaded
        # machine), so that list holds the three pods first; and until each stream has a request
        # running on its pod the HPA's window is HELD_WINDOW: a burst whose clients a loaded machine
        # slows reads fewer running requests, which a 5 s window can act on before the trickle runs.
        # (CI at stop 67, with both left to chance: neither removed pod had a request running.) Then
        # the burst ends and the window is SCALE_DOWN_WINDOW again: the HPA wants one replica.
        wait("the client listing the 3 pods", lambda: len(load.ready) == 3, timeout=60)
        load.run(3, TRICKLE_NEW_TOKENS, sticky=True)
        wait("a trickle request running on each of the 3 pods",
             lambda: len(set(dict(load.sticky_running).values())) == 3, timeout=120)
        assert not load.deleted_at, load.deleted_at
        burst_ended = time.monotonic()
        burst.set()
        kube.patch(PAIR_API, "SpecModelPair", namespace, PAIR, {"spec": {"rollout": {"autoscaling": {
            "scaleDownStabilizationSeconds": SCALE_DOWN_WINDOW}}}})
        down = wait("scaled back to 1", lambda: serving_on(1), timeout=180)
        deleted_at = dict(load.deleted_at)
        assert down["status"].get("history") == history
        load.stop_all()
        trickle = sorted(round(ended - started, 1) for _, started, ended in load.done if started > burst_ended)
        log(f"trickle requests served: {len(trickle)}, seconds each {trickle}")
        log(f"{len(load.done)} requests served, {len(load.failed)} failed, {len(load.refused)} refused by a "
            f"draining pod and retried on another {sorted(set(load.refused))}")

        # Every replica served; no request failed, the removed pods' among them.
        served_by = {pod for pod, _, _ in load.done}
        assert len(served_by) == 3, served_by
        assert not load.failed, load.failed[:5]
        # The scale-down removed two pods that had served.
        removed = sorted(set(deleted_at) & served_by)
        assert len(removed) == 2, (removed, deleted_at)
        # Client-side times say little about which streams were in flight: the node acts on a
        # deletion within milliseconds of its watch event, and this test's watch may see it later
        # than a short drain takes. Each removed pod's own count says it.
        wait("the removed pods gone", lambda: not set(removed) & {p["metadata"]["name"] for p in engine_pods()}, timeout=60)
        drained = {}
        for name in removed:
            text = devcluster.pod_log(namespace, name)
            stopped = re.search(r"stopped \((\d+) in-flight requests finished while draining, "
                                r"0 ended by the drain timeout\)", text)
            assert re.search(r"SIGTERM: (leaving for [\d.]+ s, then )?draining", text) and stopped, text[-1500:]
            drained[name] = int(stopped.group(1))
        log(f"in-flight requests each removed pod finished after SIGTERM: {drained}")
        assert sum(drained.values()) >= 1, ("no stream was running on a removed pod when it was told to stop", drained)
        # Without load the metric falls to 0 (Prometheus' next scrapes of the idle pod).
        wait("KEDA's metric at 0 without load", lambda: read_metric() == 0, timeout=120)
        log("done")
    finally:
        pool.shutdown()  # waits for it: what it started is stopped below
        load.close()
        helm("uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait", kubeconfig=devcluster.kubeconfig, check=False)
        if keda is not None:
            keda.stop()  # its CRDs with it: later tests on this cluster see no KEDA
        if prom is not None:
            prom.stop()
        try:
            kube.delete("v1", "Namespace", None, namespace)
        except Exception:  # noqa: BLE001 - best effort; the session cluster goes away anyway
            pass
