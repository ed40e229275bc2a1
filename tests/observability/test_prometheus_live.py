"""Every Grafana panel query and every alert rule we ship, evaluated by a real Prometheus against
live engines on the devcluster.

The operator runs as the chart's own Deployment (installed by the real helm); the engines are real
`specpair engine serve` pods on tiny models, gated by the real `specpair gate`. Prometheus (built
from its Go module) finds the operator and engine pods through the API server with the jobs the
chart's PodMonitor and ServiceMonitor become (specpair_devcluster.prometheus), scraping every
second and evaluating the shipped rule file every second. The scenario, on two pairs:

- `fails`: its gate demands a speedup no release reaches, so its only release fails the gate;
- `drifts`: v1 serves a mediocre draft. v2, the good draft (only the draft differs), passes its
  gate and is scored in shadow on v1's pod, on every request, and promoted on that evidence (the
  engine's `specpair_shadow_*` series, the operator's `specpair_shadow_verdicts_total`); v2 serves
  traffic. Then v2's draft files are replaced by an unrelated model and its pod restarted, so live
  acceptance drifts: the operator turns speculation off, then rolls back to v1, which was gated
  well above what v2 now does. v3, a new target (the same weights from another path) with the good
  draft, passes its gate and runs as a canary: its pod serves beside v1's behind the same Service,
  is judged against it on live traffic and promoted (the operator's
  `specpair_canary_decisions_total`).

Then: each panel query and annotation returns data for `drifts` over the scenario's time range, the
dashboard's variables list the pair, and the alerts that fired (Prometheus' own ALERTS series) are
exactly SpecpairGateFailed for `fails`, SpecpairSpeculationOff and SpecpairRolledBack (drift) for
`drifts`, each no earlier than the operator's action, and SpeculationOff no longer firing once
rolled back.

Traffic reaches the pods as the engine Service would deliver it: round robin over the ready pods its
selector picks, which is what its EndpointSlice would list. The devcluster has no kube-proxy, and
its API server refuses the loopback pod addresses in EndpointSlices (docs/devcluster.md), so the
test client spreads the requests itself.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from gate_tuning import NO_SWEEPS
from mlflow import MlflowClient
from obs_helpers import (CHART, RULES, alert_rules, annotation_queries, dashboard_variables, helm, panel_targets, render,
                         with_grafana_values)
from specpair_operator.release.content import effective_model_name
from specpair_operator.release.registry_contract import HISTORY_SECTION, gate_experiment

RELEASE, OPERATOR_NAMESPACE = "obs", "specpair-obs"
PAIR_API = "specpair.io/v1alpha1"
SCRAPE = 1.0  # seconds: Prometheus' scrape and rule evaluation interval here
# The operator reconciles every second (the demo's setting) instead of its production default.
OPERATOR_ENV = {"SPECPAIR_RECONCILE_INTERVAL": "1", "SPECPAIR_WATCH_TIMEOUT": "30"}
# The drift policy sized for seconds (docs/drift.md has the production defaults): the shortest
# windows the CRD admits (10 s), one breaching window per ladder step (the least the CRD admits:
# what is proven here is what the panels and alerts show of the ladder, whose pace the operator's
# tests prove), a probe after one quiet window while speculation is off.
DRIFT = {"intervalSeconds": 1, "windowSeconds": 10, "minDraftedTokens": 20, "minRequests": 4,
         "consecutiveBreaches": 1, "probeAfterWindows": 1}
CODE_PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n    print(", "import json\n\ndef load(path):",
                "class Point:\n    def __init__(self, x, y):"]
# Every request is scored in shadow, and a verdict needs 10 of them a side (and the verdict's 200
# first positions): seconds of traffic. maxSeconds is a backstop the scenario never reaches.
SHADOW = {"share": 1.0, "minRequests": 10, "maxSeconds": 600}
# Speculation stays off for a few drift windows before the rollback here, not the minute a
# production `for:` asks for: only that duration is shortened when the rules are loaded.
SHORT_FOR = "2s"
# Seconds between rounds of traffic (4 requests each): ~5 requests a second, more than any drift
# window (4 in 10 s) or the shadow's verdict (10 a side) needs. Unpaced, the rounds sent ~22 a
# second, a core's worth of decoding beside every engine pod starting meanwhile (28.6 s to ready
# against 13.3 s without).
TRAFFIC_PAUSE = 0.5
# The canary of v3: one step of one pod beside v1's (half the traffic), passed once its short pause
# is over and 10 requests a side (the least the CRD admits) judge its errors, TTFT and TPOT fine:
# seconds of the paced traffic. How a breach aborts is proven by the canary's own test
# (tests/operator/test_operator_canary_e2e.py); here its latency may be up to 10x v1's p95, so that
# a request slowed by whatever else this machine runs cannot abort what the panels are to show: at
# a few milliseconds one scheduling delay under CI's load (3 workers on 2 cores) moves a request
# two buckets, as the canary e2e found for its own same-weights canary at 3x (e688af1: 10x there).
CANARY_STRATEGY = {"type": "Canary", "steps": [{"replicas": 1, "pauseSeconds": 2}]}
CANARY_LATENCY = {"minRequests": 10, "ttftP95Ratio": 10.0, "tpotP95Ratio": 10.0}
# What the monitors are rendered with in place of MLflow's address, not known yet when Prometheus
# starts: no monitor reads it (the chart requires one).
NO_MLFLOW_YET = "http://mlflow.invalid:5000"


def pair_manifest(name: str, target: str, draft: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": PAIR_API, "kind": "SpecModelPair", "metadata": {"name": name},
            "spec": {"target": {"source": target}, "draft": {"source": draft},
                     # Below 5% acceptance over 200 draft tokens the engine falls back to target-only
                     # by itself (the Fallbacks panel); the good tiny draft is accepted far above that.
                     "speculation": {"k": 3, "fallbackThreshold": 0.05},
                     "gating": {"prompts": [{"prompt": CODE_PROMPTS[0], "category": "code"},
                                            {"prompt": CODE_PROMPTS[1], "category": "code"}],
                                "maxNewTokens": 12, "thresholds": {"requireGreedyIdentity": True},
                                "tuning": NO_SWEEPS},
                     # Tiny models on CPU never gain from speculation, so the gate's tuning would turn it
                     # off in serving; drift needs it on.
                     "rollout": {"applyGateTuning": False, "shadow": dict(SHADOW)}, "drift": dict(DRIFT), **spec}}


def chart_values(namespace: str, mlflow_url: str, monitors: bool) -> dict[str, Any]:
    return {"mlflow": {"trackingUri": mlflow_url}, "watchNamespaces": [namespace],
            "operator": {"extraEnv": [{"name": k, "value": v} for k, v in OPERATOR_ENV.items()],
                         "podMonitor": {"enabled": monitors, "interval": "1s"}},
            "metrics": {"serviceMonitor": {"enabled": monitors, "interval": "1s"}}}


def shortened_rules(path: Path) -> Path:
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = SHORT_FOR
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


class Scenario:
    def __init__(self, cluster: Any, namespace: str):
        self.cluster, self.kube, self.ns = cluster, cluster.kube, namespace
        self.turn = itertools.count()

    def pair(self, name: str) -> dict[str, Any]:
        return self.kube.get(PAIR_API, "SpecModelPair", self.ns, name) or {}

    def engine_pods(self, name: str) -> list[dict[str, Any]]:
        return [p for p in self.kube.list("v1", "Pod", self.ns, labels=f"specpair.io/pair={name},specpair.io/role=engine")
                if not p["metadata"].get("deletionTimestamp")]

    def address(self, name: str) -> str | None:
        pods = sorted((p for p in self.engine_pods(name) if ready(p)), key=lambda p: p["metadata"]["creationTimestamp"])
        return f"{pods[-1]['status']['podIP']}:50051" if pods else None

    def endpoints(self, name: str) -> list[str]:
        """The gRPC addresses of the ready pods the pair's Service selects (the module docstring)."""
        from specpair_operator.desired import manifests
        service = self.kube.get("v1", "Service", self.ns, manifests.engine_name(name))
        if service is None:
            return []
        selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
        return sorted(f"{p['status']['podIP']}:50051" for p in self.kube.list("v1", "Pod", self.ns, labels=selector)
                      if not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP") and ready(p))

    def ready_versions(self, name: str) -> list[str]:
        return sorted(p["metadata"]["labels"].get("specpair.io/release-version") for p in self.engine_pods(name) if ready(p))

    def serving(self, name: str, version: str, phase: str = "Serving") -> dict[str, Any] | None:
        """The pair when `version` serves from ready pods of its own alone (phase Degraded: a
        rolled-back release is still what the spec names)."""
        obj = self.pair(name)
        st = obj.get("status") or {}
        ok = st.get("phase") == phase and st.get("servingVersion") == version and \
            self.ready_versions(name) == [version]
        return obj if ok else None

    def traffic(self, name: str, n: int = 4) -> None:
        """n code requests, round robin over the Service's ready pods; each pod is sent every prompt
        in turn (a canary and its champion are judged on the same mix)."""
        from specpair._proto import engine_pb2, engine_pb2_grpc
        addresses = self.endpoints(name)
        if not addresses:
            time.sleep(0.5)
            return
        channels = {a: grpc.insecure_channel(a) for a in addresses}
        try:
            for _ in range(n):
                turn = next(self.turn)
                address = addresses[turn % len(addresses)]
                req = engine_pb2.GenerateRequest(prompt=CODE_PROMPTS[turn // len(addresses) % len(CODE_PROMPTS)],
                                                 max_new_tokens=12, category="code")
                try:
                    for _ in engine_pb2_grpc.EngineStub(channels[address]).Generate(req, timeout=30):
                        pass
                except grpc.RpcError:
                    return  # a pod being replaced; the next round reads the ready pods again
        finally:
            for channel in channels.values():
                channel.close()

    def wait(self, what: str, predicate: Any, timeout: float, traffic_to: str | None = None) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if traffic_to:
                self.traffic(traffic_to)
            got = predicate()
            if got:
                print(f"{time.strftime('%H:%M:%S')} {what} after {timeout - (deadline - time.monotonic()):.0f} s")
                return got
            time.sleep(TRAFFIC_PAUSE if traffic_to else 0.5)
        state = {"pairs": {p["metadata"]["name"]: p.get("status") for p in self.kube.list(PAIR_API, "SpecModelPair", self.ns)},
                 "pods": [(p["metadata"]["name"], (p.get("status") or {}).get("phase")) for p in self.kube.list("v1", "Pod", self.ns)],
                 "node errors": self.cluster.node_errors()[-3:]}
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}: {json.dumps(state, default=str)[-4000:]}")

    def action_time(self, name: str, action: str) -> float:
        from datetime import datetime
        (entry,) = [h for h in self.pair(name)["status"]["history"] if h["action"] == action]
        return datetime.fromisoformat(entry["time"].replace("Z", "+00:00")).timestamp()


def grafana_query(expr: str, pair: str, step: float, range_seconds: float) -> str:
    """A panel's PromQL as Grafana sends it: $pair set to one pair, $version to its "All" value
    (the variable's allValue), $__rate_interval as Grafana computes it for a Prometheus scraped
    every SCRAPE seconds (max(interval + scrape, 4 x scrape)) and $__range the whole range."""
    (version,) = [v for v in dashboard_variables() if v["name"] == "version"]
    rate_interval = max(step + SCRAPE, 4 * SCRAPE)
    return with_grafana_values(expr, pair=re.escape(pair), version=version["allValue"],
                               rate_interval=f"{rate_interval:.0f}s", range_=f"{range_seconds:.0f}s")


def finite_points(result: list[dict[str, Any]]) -> int:
    return sum(1 for series in result for _, v in series["values"] if math.isfinite(float(v)))


@pytest.fixture
def models(tiny_pair_dirs, tiny_tokenizer, tiny_target):
    """The tiny models where pods can read them (pytest's folders are under /tmp, which each pod
    has as its own emptyDir): the target, the good draft at a path of its own (`draft-v2`), a
    mediocre draft (the target's weights with more noise: it picks the target's greedy token at
    0.29 of the code prompts' positions, the good draft at 0.63), an unrelated model to replace a
    served draft's files with, and the target's weights at another path (`target-copy`: a new
    target to the operator)."""
    from tiny_models import make_model, perturbed_copy, save_tiny
    root = Path.home() / ".cache" / "specpair-test-models" / f"obs-{uuid.uuid4().hex[:8]}"
    out = {k: str(shutil.copytree(v, root / k)) for k, v in tiny_pair_dirs.items()}
    out["draft-v2"] = str(shutil.copytree(tiny_pair_dirs["draft"], root / "draft-v2"))
    out["target-copy"] = str(shutil.copytree(tiny_pair_dirs["target"], root / "target-copy"))
    out["draft-mediocre"] = str(save_tiny(perturbed_copy(tiny_target, seed=5, noise=0.07), root / "draft-mediocre"))
    out["unrelated"] = str(save_tiny(make_model(tiny_tokenizer, seed=9), root / "unrelated"))
    yield out
    shutil.rmtree(root, ignore_errors=True)


# 166 s in the last fresh-clone run, 420 s at load 11-16: past pyproject's 600 s where the cores
# are busier still, while every wait below stays within its own deadline.
@pytest.mark.timeout(900)
def test_every_panel_and_alert_against_live_engines(devcluster, mlflow_server, models, tmp_path, prometheus_bin):
    from specpair_devcluster.prometheus import DevPrometheus

    namespace = f"obs-{uuid.uuid4().hex[:6]}"
    devcluster.ensure_namespace(namespace)
    prom = None

    def install_operator() -> None:
        # The operator as users install it: the chart's Deployment, on the session's MLflow (its
        # models are named from this test's namespace).
        helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
             values=chart_values(namespace, mlflow_server.url, monitors=False), kubeconfig=devcluster.kubeconfig)

    # The operator starts while Prometheus does (nothing here depends on the order: Prometheus
    # discovers the operator's pod whenever it appears).
    pool = ThreadPoolExecutor(1)
    installing = pool.submit(install_operator)
    try:
        # The monitors' kinds are not on this cluster (no Prometheus Operator), so they are rendered
        # with the same values and turned into Prometheus' own scrape jobs.
        monitors = [m for m in render(chart_values(namespace, NO_MLFLOW_YET, monitors=True), RELEASE, OPERATOR_NAMESPACE)
                    if m["kind"] in ("PodMonitor", "ServiceMonitor")]
        assert sorted(m["kind"] for m in monitors) == ["PodMonitor", "ServiceMonitor"]
        prom = DevPrometheus(devcluster, tmp_path / "prometheus", monitors,
                             rule_files=[shortened_rules(tmp_path / "rules.yaml")], interval=f"{SCRAPE:.0f}s").start()
        installing.result()
        start = time.time()
        print(f"{time.strftime('%H:%M:%S')} Prometheus ready")
        s = Scenario(devcluster, namespace)
        prom.wait_for("the operator pod scraped", lambda: [t for t in prom.targets() if t["health"] == "up"
                                                            and t["scrapePool"].startswith("podMonitor/")], timeout=120)

        # Prometheus loaded every shipped alert, and evaluates each without error.
        loaded = {r["name"]: r for r in prom.rules() if r["type"] == "alerting"}
        assert sorted(loaded) == sorted(r["alert"] for r in alert_rules())

        kube = devcluster.kube
        fails = pair_manifest("fails", models["target"], models["draft"])
        fails["spec"]["gating"]["thresholds"]["minSpeedup"] = 1000  # no release is 1000x faster
        # Its verdict is a failure however long its prompts: one prompt of few tokens (the gate
        # generates each some thirty times in its k sweep) leaves the cores to drifts' gate.
        fails["spec"]["gating"]["prompts"] = fails["spec"]["gating"]["prompts"][:1]
        fails["spec"]["gating"]["maxNewTokens"] = 4
        for pair in (fails, pair_manifest("drifts", models["target"], models["draft-mediocre"])):
            kube.create({**pair, "metadata": {**pair["metadata"], "namespace": namespace}})

        # Generous: the operator's start, two gates side by side and an engine's start, on two cores
        # that other jobs may share.
        s.wait("drifts v1 serving", lambda: s.serving("drifts", "1"), timeout=600)
        # The engine Service the operator made carries the ServiceMonitor's selector, and its port of
        # the monitor's name targets the pods' port of that name: what Prometheus scrapes here as a
        # pod job (devcluster Services have no endpoints; specpair_devcluster.prometheus).
        (engines,) = [m for m in monitors if m["kind"] == "ServiceMonitor"]
        selector = engines["spec"]["selector"]["matchLabels"]
        (service,) = kube.list("v1", "Service", namespace, labels=",".join(f"{k}={v}" for k, v in selector.items())
                               + ",specpair.io/pair=drifts")
        assert [p["targetPort"] for p in service["spec"]["ports"] if p["name"] == engines["spec"]["endpoints"][0]["port"]] \
            == [engines["spec"]["endpoints"][0]["port"]]
        s.wait("fails' gate to fail", lambda: (s.pair("fails").get("status") or {}).get("lastGate", {}).get("passed") is False,
               timeout=300, traffic_to="drifts")
        # v2: only the draft differs, so once it passes its gate v1's pod scores it in shadow.
        # No traffic while v2 is gated: the gate's timing sweeps would share the two cores with it.
        kube.patch(PAIR_API, "SpecModelPair", namespace, "drifts", {"spec": {"draft": {"source": models["draft-v2"]}}})
        s.wait("v2 scored in shadow", lambda: condition(s.pair("drifts"), "ShadowScored").get("reason") == "Scoring",
               timeout=300)
        obj = s.wait("v2 promoted by shadow scoring and serving", lambda: s.serving("drifts", "2"), timeout=240,
                     traffic_to="drifts")
        scored = obj["status"]["shadow"]
        assert scored["version"] == "2" and scored["result"] == "Promote", scored
        assert scored["categories"]["code"]["candidateAlpha"] > scored["categories"]["code"]["championAlpha"], scored
        assert "ShadowPromoted" in [h["action"] for h in obj["status"]["history"]]
        for _ in range(3):
            s.traffic("drifts")

        # The files behind v2's draft are replaced; the pod restarts and loads them.
        shutil.rmtree(models["draft-v2"])
        shutil.copytree(models["unrelated"], models["draft-v2"])
        (old,) = s.engine_pods("drifts")
        kube.delete("v1", "Pod", namespace, old["metadata"]["name"])
        s.wait("a new v2 pod", lambda: (a := s.address("drifts")) and old["status"]["podIP"] not in a, timeout=180)
        s.wait("speculation off", lambda: (s.pair("drifts").get("status") or {}).get("speculationEnabled") is False,
               timeout=240, traffic_to="drifts")
        s.wait("rolled back to v1", lambda: s.serving("drifts", "1", phase="Degraded"), timeout=300, traffic_to="drifts")
        # Why v2 lost the champion alias, as a reviewer reads it in MLflow (docs/mlflow.md): its
        # history's lines in words, its rollback tag, and a run with the drift judgement's figures.
        # The record follows the rollback mark in the same step, before the alias moves.
        mlflow = MlflowClient(mlflow_server.url)
        model = effective_model_name("drifts", namespace, {})
        v2 = mlflow.get_model_version(model, "2")
        assert v2.tags["specpair.event.speculation-off"].startswith(
            "v2 serving target-only (speculation off): sustained drift: "), v2.tags
        # The newest line (MLflow's 5,000 characters drop the oldest first: probes may be many).
        history = v2.description.split(HISTORY_SECTION)[1]
        [rolled] = [line for line in history.splitlines() if "**rollback**" in line]
        # (The judgement names the pooled gated categories first, then each category.)
        assert re.search(r"v2 rolled back \(lost the champion alias\): (sustained drift|drift persisted after "
                         r"speculation off): .*category 'code' acceptance [\d.]+ \(upper bound", rolled), history
        assert v2.tags["specpair.event.rollback"].startswith("v2 rolled back")
        [rollback] = mlflow.search_runs([mlflow.get_experiment_by_name(gate_experiment(model)).experiment_id],
                                        filter_string="tags.`specpair.event` = 'rollback'")
        assert rollback.info.run_name == "rollback-v2" and \
            [k for k in rollback.data.metrics if k.startswith("live_acceptance.")], rollback.data.metrics
        for _ in range(3):
            s.traffic("drifts")
        # v3: a new target (v1's weights from another path) with the good draft, rolled out as a
        # canary beside v1. Its gate runs while the alerts below are awaited, without traffic (as v2's).
        kube.patch(PAIR_API, "SpecModelPair", namespace, "drifts", {"spec": {
            "target": {"source": models["target-copy"]}, "draft": {"source": models["draft"]},
            "drift": {"latency": CANARY_LATENCY}, "rollout": {"strategy": CANARY_STRATEGY}}})

        # What fired for this namespace, from Prometheus' own ALERTS series over the whole scenario.
        # (Only this namespace: a pod IP's port is free while its program starts or restarts, and a
        # program of another devcluster on this machine listening on 0.0.0.0 answers there, e.g. a
        # demo's operator with its own pairs.)
        def fired() -> dict[tuple[str, str, str], float]:
            first: dict[tuple[str, str, str], float] = {}
            for series in prom.query_range(f'ALERTS{{alertstate="firing", namespace="{namespace}"}}', start, time.time(), SCRAPE):
                m = series["metric"]
                key = (m["alertname"], m.get("pair", ""), m.get("reason", ""))
                first[key] = min([first.get(key, math.inf)] + [float(t) for t, _ in series["values"]])
            return first
        expected = {("SpecpairGateFailed", "fails", ""), ("SpecpairSpeculationOff", "drifts", ""),
                    ("SpecpairRolledBack", "drifts", "drift")}
        prom.wait_for("the alerts to fire", lambda: set(fired()) >= expected, timeout=60)
        print(f"{time.strftime('%H:%M:%S')} the alerts fired")
        # SpeculationOff resolves once the rolled-back release serves (its ladder starts at 0).
        prom.wait_for("SpeculationOff to resolve",
                      lambda: not [a for a in prom.alerts() if a["labels"]["alertname"] == "SpecpairSpeculationOff"],
                      timeout=60)
        got = fired()
        assert set(got) == expected, got
        # The operator's series name the pair's namespace (the PodMonitor keeps the operator's label,
        # where Prometheus would otherwise put the operator pod's own), so the alerts do.
        assert {r["metric"]["namespace"] for r in prom.query('specpair_gate_duration_seconds_count{pair=~"fails|drifts"}')} \
            == {namespace}
        # No alert before its cause: the operator's recorded action (a firing needs a scrape and an
        # evaluation after it, so the first firing sample is later).
        assert got[("SpecpairSpeculationOff", "drifts", "")] >= s.action_time("drifts", "SpeculationOff") - 1
        assert got[("SpecpairRolledBack", "drifts", "drift")] >= s.action_time("drifts", "RolledBack") - 1
        assert all(r["health"] == "ok" for r in prom.rules()), [(r["name"], r.get("lastError")) for r in prom.rules()]

        # v3's canary pod serves beside v1's, is judged against it on the traffic the two share, and
        # v3 is promoted: the engine Deployment rolls to it, then the canary is scaled to zero.
        s.wait("v3's canary pod beside v1's", lambda: s.ready_versions("drifts") == ["1", "3"], timeout=300)

        def promoted_by_canary() -> dict[str, Any] | None:
            obj = s.serving("drifts", "3")
            return obj if obj and (obj["status"].get("canary") or {}).get("phase") == "Promoted" else None
        obj = s.wait("v3 promoted by its canary and serving", promoted_by_canary, timeout=240, traffic_to="drifts")
        entry = obj["status"]["canary"]
        print(f"{time.strftime('%H:%M:%S')} the canary's last judgement: {json.dumps(entry['judged'])}")
        assert (entry["version"], entry["champion"], entry["trafficShare"]) == ("3", "1", 0.5), entry
        for key in ("errors:*", "ttft:*", "tpot:*"):
            assert entry["judged"][key]["verdict"] == "fine" and entry["judged"][key]["requests"] >= 10, entry
        history_v3 = [h["action"] for h in obj["status"]["history"] if h["toVersion"] == "3"]
        assert history_v3.index("CanaryStarted") < history_v3.index("CanaryPassed") < history_v3.index("Promoted"), \
            history_v3
        for _ in range(3):
            s.traffic("drifts")
        # The operator counted its one shadow start and verdict; v1's pods labelled what they scored with v2.
        verdicts = prom.query(f'specpair_shadow_verdicts_total{{namespace="{namespace}"}}')
        assert [(r["metric"]["pair"], r["metric"]["result"], r["value"][1]) for r in verdicts] == [("drifts", "promoted", "1")]
        starts = prom.query(f'specpair_shadow_starts_total{{namespace="{namespace}"}}')
        assert [(r["metric"]["pair"], r["value"][1]) for r in starts] == [("drifts", "1")]
        shadowed = prom.query_range('specpair_shadow_requests_total{pair="drifts"}', start, time.time(), SCRAPE)
        assert {(r["metric"]["version"], r["metric"]["candidate_version"]) for r in shadowed} == {("1", "2")}

        # Every panel query returns data for the pair over the scenario's range, as Grafana asks.
        end, step = time.time(), 2.0
        empty = []
        for title, expr in panel_targets():
            query = grafana_query(expr, "drifts", step, end - start)
            if not finite_points(prom.query_range(query, start, end, step)):
                empty.append((title, query))
        assert not empty, f"panel queries with no data: {json.dumps(empty, indent=1)}"
        # The operator counted the canary's start and its pass (one step: nothing to advance).
        decisions = prom.query(f'specpair_canary_decisions_total{{namespace="{namespace}"}}')
        assert sorted((r["metric"]["pair"], r["metric"]["decision"], r["value"][1]) for r in decisions) \
            == [("drifts", "passed", "1"), ("drifts", "started", "1")], decisions
        # The operator's counters count each decision, the first included (a counter's first sample,
        # which increase() reads as no change): three promotions (v1, v2 on its shadow verdict, v3
        # on its canary), one rollback, one shadow verdict.
        def panel_now(title: str, metric: str) -> list[tuple[str, str]]:
            (expr,) = [e for t, e in panel_targets() if t == title and metric in e]
            return [(r["metric"].get("reason") or r["metric"].get("result", ""), r["value"][1])
                    for r in prom.query(grafana_query(expr, "drifts", step, end - start), end)]
        assert panel_now("Promotions and rollbacks", "specpair_promotions_total") == [("", "3")]
        assert panel_now("Promotions and rollbacks", "specpair_rollbacks_total") == [("drift", "1")]
        assert panel_now("Shadow verdicts", "specpair_shadow_verdicts_total") == [("promoted", "1")]
        # Annotations mark the operator's decisions, each event at its first appearance too: the
        # canary's start and its pass each.
        marks = {name: prom.query_range(grafana_query(expr, "drifts", step, end - start), start, end, step)
                 for name, expr in annotation_queries()}
        assert not [name for name, result in marks.items() if not finite_points(result)], \
            {name: finite_points(result) for name, result in marks.items()}
        assert sorted(r["metric"]["decision"] for r in marks["Canary decisions"] if finite_points([r])) \
            == ["passed", "started"], marks["Canary decisions"]
        # The dashboard's variables (label_values(metric, label)) list the pair, its versions and
        # the engine that served them.
        for var in dashboard_variables():
            metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"]).groups()
            values = prom.api(f"label/{label}/values", **{"match[]": metric.replace("$pair", "drifts")})
            assert {"pair": "drifts", "version": "1", "engine": "specpair"}[label] in values, (var["name"], values)
    finally:
        pool.shutdown()  # waits for it: what it started is stopped below
        if prom is not None:
            prom.stop()
        helm("uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait", kubeconfig=devcluster.kubeconfig, check=False)
        try:
            devcluster.kube.delete("v1", "Namespace", None, namespace)
        except Exception:  # noqa: BLE001 - best effort; the session cluster goes away anyway
            pass
