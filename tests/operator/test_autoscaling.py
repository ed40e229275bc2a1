"""The autoscaler a pair gets: read from `rollout.autoscaling` (bad values refused in words), rendered
as KEDA's ScaledObject or an HPA on the pair's scale subresource, and accepted by the real API
server against KEDA's own CRD (from the pinned KEDA Go module) and the built-in HPA schema."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from specpair_devcluster.client import ApiError, resource_path
from specpair_operator import autoscaling as autoscaling_mod
from specpair_operator.autoscaling import (SIGNALS, Autoscaling, AutoscalingError, desired_autoscaler,
                                           query)
from specpair_operator.manifests import engine_name
from specpair_operator.validation import spec_schema, validate_spec
SCALED = {"minReplicas": 1, "maxReplicas": 3, "metric": "queueLength", "target": 4}


def spec(**autoscaling):
    return {"rollout": {"autoscaling": autoscaling}} if autoscaling else {"rollout": {}}


def test_absent_autoscaling_is_none():
    assert Autoscaling.from_spec({}) is None
    assert Autoscaling.from_spec(spec()) is None


@pytest.mark.parametrize("fields, words", [
    ({"minReplicas": 1}, "maxReplicas is required"),
    ({"minReplicas": 0, "maxReplicas": 2, "target": 1}, "minReplicas must be an integer >= 1, got 0"),
    ({"minReplicas": 3, "maxReplicas": 2, "target": 1}, "maxReplicas (2) is below minReplicas (3)"),
    ({"maxReplicas": 2, "metric": "gpuUtilization", "target": 1}, "'gpuUtilization' is not one of queueLength"),
    ({"maxReplicas": 2, "target": 0}, "target must be a number > 0 (per replica), got 0"),
    ({"maxReplicas": 2, "target": True}, "target must be a number > 0"),
    ({"maxReplicas": "3", "target": 1}, "maxReplicas is required (an integer)"),
])
def test_bad_autoscaling_is_refused_in_words(fields, words):
    with pytest.raises(AutoscalingError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Autoscaling.from_spec(spec(**fields))


def test_the_crd_offers_exactly_the_signals_and_holds_the_defaults():
    schema = spec_schema()["properties"]["rollout"]["properties"]["autoscaling"]
    assert schema["properties"]["metric"]["enum"] == list(SIGNALS)
    defaults = {k: v["default"] for k, v in schema["properties"].items() if "default" in v}
    scaling = Autoscaling.from_spec(spec(maxReplicas=2, target=1))
    assert (scaling.min_replicas, scaling.metric, scaling.scale_down_stabilization_s, scaling.polling_interval_s) == \
        (defaults["minReplicas"], defaults["metric"], defaults["scaleDownStabilizationSeconds"],
         defaults["pollingIntervalSeconds"])


@pytest.mark.parametrize("fields, words", [
    ({"scaleDownStabilizationSeconds": 3601},
     "scaleDownStabilizationSeconds must be an integer from 0 to 3600, got 3601"),
    ({"scaleDownStabilizationSeconds": -1}, "from 0 to 3600, got -1"),
    ({"pollingIntervalSeconds": 0}, "pollingIntervalSeconds must be an integer >= 1, got 0"),
    ({"pollingIntervalSeconds": 1.5}, "pollingIntervalSeconds must be an integer >= 1, got 1.5"),
])
def test_bad_windows_are_refused_in_words(fields, words):
    with pytest.raises(AutoscalingError, match=words):
        Autoscaling.from_spec(spec(maxReplicas=2, target=1, **fields))


def test_the_scale_down_window_and_polling_reach_both_autoscalers():
    scaling = Autoscaling.from_spec(spec(**SCALED, scaleDownStabilizationSeconds=9, pollingIntervalSeconds=7))
    keda = desired_autoscaler("chat", "team-a", scaling, keda=True, default_prometheus="http://prom:9090", labels={})
    assert keda["spec"]["pollingInterval"] == 7
    assert keda["spec"]["advanced"] == {"horizontalPodAutoscalerConfig": {"behavior": {
        "scaleDown": {"stabilizationWindowSeconds": 9}}}}
    hpa = desired_autoscaler("chat", "team-a", scaling, keda=False, default_prometheus=None, labels={})
    assert hpa["spec"]["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 9}}


def test_keda_scales_the_pair_from_a_prometheus_query_over_its_own_pods():
    scaling = Autoscaling.from_spec(spec(**SCALED))
    obj = desired_autoscaler("chat", "team-a", scaling, keda=True, default_prometheus="http://prom:9090",
                             labels={"app": "x"})
    assert obj["kind"] == "ScaledObject" and obj["metadata"]["name"] == engine_name("chat")
    assert obj["spec"]["scaleTargetRef"] == {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair",
                                             "name": "chat"}
    trigger = obj["spec"]["triggers"][0]
    assert trigger["metadata"] == {"serverAddress": "http://prom:9090", "threshold": "4",
                                   "query": 'sum(specpair_num_requests_waiting{namespace="team-a",pair="chat"})'}
    assert (obj["spec"]["minReplicaCount"], obj["spec"]["maxReplicaCount"]) == (1, 3)
    # The pair's own address wins over the operator's default; with neither, KEDA has nothing to ask.
    own = desired_autoscaler("chat", "team-a", Autoscaling.from_spec(spec(**SCALED, prometheusAddress="http://p2")),
                             keda=True, default_prometheus="http://prom:9090", labels={})
    assert own["spec"]["triggers"][0]["metadata"]["serverAddress"] == "http://p2"
    with pytest.raises(AutoscalingError, match="KEDA scales from Prometheus"):
        desired_autoscaler("chat", "team-a", scaling, keda=True, default_prometheus=None, labels={})


def test_without_keda_an_hpa_averages_the_same_signal_per_pod():
    scaling = Autoscaling.from_spec(spec(**{**SCALED, "metric": "tokensPerSecond", "target": 12.5}))
    obj = desired_autoscaler("chat", "team-a", scaling, keda=False, default_prometheus=None, labels={})
    assert obj["kind"] == "HorizontalPodAutoscaler"
    assert obj["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "specpair_num_emitted_tokens"},
        "target": {"type": "AverageValue", "averageValue": "12.5"}}}]


def test_every_signal_is_a_series_the_engine_exports():
    """The queries name engine series by their exposed names (a counter with `_total`)."""
    from prometheus_client import generate_latest

    from specpair.server.metrics import EngineMetrics
    metrics = EngineMetrics("chat", "1")
    metrics.num_emitted_tokens.labels(pair="chat", version="1", category="general").inc()
    metrics.num_requests_waiting.labels(pair="chat", version="1").set(2)
    metrics.num_requests_running.labels(pair="chat", version="1").set(1)
    metrics.set_state(running=1, waiting=2, k=4, speculating=True, window_rate=None, category_rates={},
                      kv_usage=0.25)
    exposed = generate_latest(metrics.registry).decode()
    for name, signal in SIGNALS.items():
        series = query("chat", "team-a", name).split("(")[-1].split("{")[0]
        assert f"\n{series}{{" in exposed, (name, series)
        assert signal.pod_metric == series.removesuffix("_total"), name


def test_every_query_parses_as_promql():
    """promtool (built from the pinned Prometheus module by scripts/build-prometheus.sh) checks each
    query as a rule expression."""
    promtool = shutil.which("promtool", path=os.environ.get("SPECPAIR_PROMETHEUS_BIN"))
    if promtool is None:
        pytest.skip("promtool not built here (scripts/build-prometheus.sh; scripts/test.sh builds it)")
    rules = {"groups": [{"name": "autoscaling", "rules": [
        {"record": f"specpair:autoscaling:{name}", "expr": query("chat", "team-a", name)} for name in SIGNALS]}]}
    out = subprocess.run([promtool, "check", "rules", "/dev/stdin"], input=yaml.safe_dump(rules),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture
def keda_installed(devcluster):
    """KEDA's ScaledObject CRD as KEDA ships it (its Go module), removed again after the test: an
    operator test elsewhere in the session must not find KEDA it did not install."""
    from autoscaler_scenario import install_keda_crd, remove_keda_crd
    install_keda_crd(devcluster.kube)
    yield
    remove_keda_crd(devcluster.kube)


def test_the_api_server_accepts_both_autoscalers(devcluster, ns, keda_installed):
    kube = devcluster.kube
    scaling = Autoscaling.from_spec(spec(**SCALED))
    for keda, plural in ((True, "scaledobjects"), (False, "horizontalpodautoscalers")):
        obj = desired_autoscaler("chat", ns.name, scaling, keda=keda, default_prometheus="http://prom:9090",
                                 labels={"app.kubernetes.io/name": "specpair-engine"})
        created = kube.request("POST", resource_path(obj["apiVersion"], plural, ns.name), body=obj)
        assert created["spec"]["scaleTargetRef"]["kind"] == "SpecModelPair"
    # The server's schema refuses what KEDA would never run (a strict field check, not ours).
    bad = desired_autoscaler("other", ns.name, scaling, keda=True, default_prometheus="http://prom:9090", labels={})
    bad["spec"]["minReplicaCount"] = "one"
    with pytest.raises(ApiError) as refused:
        kube.request("POST", resource_path(bad["apiVersion"], "scaledobjects", ns.name), body=bad)
    assert refused.value.status == 422



@pytest.mark.parametrize("autoscaling, words", [
    ({"minReplicas": 3, "maxReplicas": 2, "target": 1}, "rollout.autoscaling.maxReplicas must be at least minReplicas"),
    ({"maxReplicas": 2, "target": 0}, "rollout.autoscaling.target must be above 0"),
    ({"maxReplicas": 2, "target": 1, "metric": "gpuUtilization"}, 'Unsupported value: "gpuUtilization"'),
    ({"maxReplicas": 2, "target": 1, "prometheusAddress": "prom:9090"}, "should match '^https?://'"),
    ({"maxReplicas": 2, "target": 1, "scaleDownStabilizationSeconds": 3601}, "less than or equal to 3600"),
    ({"target": 1}, "spec.rollout.autoscaling.maxReplicas: Required value"),
])
def test_the_api_server_and_the_operator_refuse_a_bad_autoscaling_alike(devcluster, operator_kubeconfig, ns,
                                                                      autoscaling, words):
    """The CRD (installed by the chart) refuses it with these words (a dry-run create), and
    validation.py, its twin for a pair written past an older CRD, says the same."""
    body = {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": "bad"},
            "spec": {"target": {"source": "t"}, "draft": {"source": "d"}, "rollout": {"autoscaling": autoscaling}}}
    with pytest.raises(ApiError) as refused:
        devcluster.kube.request("POST", resource_path("specpair.io/v1alpha1", "specmodelpairs", ns.name), body=body,
                                params={"dryRun": "All"})
    assert refused.value.status == 422 and words in str(refused.value), refused.value
    assert any(words in e for e in validate_spec(body["spec"])), validate_spec(body["spec"])


# -- what a pass does about the autoscaler (pure) -------------------------------------------------

@pytest.mark.parametrize("autoscaling, keda, prometheus, kind, remove", [
    (SCALED, False, None, "HorizontalPodAutoscaler", ()),
    (SCALED, True, "http://prom:9090", "ScaledObject", ("HorizontalPodAutoscaler",)),
    ({**SCALED, "prometheusAddress": "http://p2"}, True, None, "ScaledObject", ("HorizontalPodAutoscaler",)),
    (None, False, None, None, ("HorizontalPodAutoscaler",)),
    (None, True, "http://prom:9090", None, ("ScaledObject", "HorizontalPodAutoscaler")),
])
def test_the_plan_writes_one_kind_and_removes_the_other(autoscaling, keda, prometheus, kind, remove):
    rollout = {"autoscaling": autoscaling} if autoscaling else {}
    plan = autoscaling_mod.plan_autoscaler({"rollout": rollout}, "chat", "team-a", keda=keda,
                                           default_prometheus=prometheus)
    assert plan.invalid is None and plan.remove == remove
    assert (plan.desired or {}).get("kind") == kind
    assert plan.why == ("autoscaling removed from the spec" if kind is None else f"replaced by a {kind}")


@pytest.mark.parametrize("autoscaling, keda, words", [
    (SCALED, True, "KEDA scales from Prometheus"),                      # nowhere to ask
    ({**SCALED, "minReplicas": 5}, False, "maxReplicas (3) is below minReplicas (5)"),  # past an older CRD
])
def test_a_plan_it_cannot_make_touches_nothing_and_says_why(autoscaling, keda, words):
    plan = autoscaling_mod.plan_autoscaler({"rollout": {"autoscaling": autoscaling}}, "chat", "team-a", keda=keda,
                                           default_prometheus=None)
    assert plan.desired is None and plan.remove == () and words in plan.invalid
    assert plan.invalid.endswith("the autoscaler, if any, is left as it was")


def test_an_unusable_autoscaling_is_a_condition_and_one_warning(monkeypatch):
    """No API request is made (KEDA's presence is already known): the pair's Autoscaled condition
    says why, a Warning Event says it once, and the pass's report is left to the rest of the pass."""
    import asyncio
    import logging
    import time

    from specpair_operator.ledger import StatusLedger
    from specpair_operator.state import OperatorState

    monkeypatch.delenv(autoscaling_mod.PROMETHEUS_ENV, raising=False)
    state = OperatorState(keda_seen=(True, time.monotonic()))
    body = {"metadata": {"name": "chat", "namespace": "team-a", "uid": "u1"},
            "spec": {"rollout": {"autoscaling": SCALED}}}
    status: dict = {}
    for passes in (1, 2):
        ledger = StatusLedger(status, 3, "team-a", "chat", logging.getLogger("test"))
        asyncio.run(autoscaling_mod.ensure_autoscaler(state, body, ledger))
        status = {**status, **ledger.status_patch()}
        condition = next(c for c in status["conditions"] if c["type"] == "Autoscaled")
        assert (condition["status"], condition["reason"], condition["observedGeneration"]) == \
            ("False", "InvalidAutoscaling", 3)
        assert [e[:2] for e in ledger.events] == ([("Warning", "InvalidAutoscaling")] if passes == 1 else [])
        assert ledger.report is None
