"""The autoscaler a pair gets: read from `rollout.autoscaling` (bad values refused in words), rendered
as KEDA's ScaledObject or an HPA on the pair's scale subresource, and accepted by the real API
server against KEDA's own CRD (from the pinned KEDA Go module) and the built-in HPA schema."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml
from ci_skips import skip_unless_ci

from specpair_devcluster.client import ApiError, resource_path
from specpair_operator.desired import autoscaling as autoscaling_mod
from specpair_operator.observe import keda as keda_mod
from specpair_operator.desired.autoscaling import (SIGNALS, Autoscaling, AutoscalingError, desired_autoscaler,
                                           query)
from specpair_operator.desired.manifests import engine_name
from specpair_operator.crd.validation import spec_schema, validate_spec
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
    """The specpair engine's queries name its series by their exposed names (a counter with `_total`)."""
    from prometheus_client import generate_latest

    from specpair.server.metrics import EngineMetrics
    metrics = EngineMetrics("chat", "1")
    metrics.num_emitted_tokens.labels(pair="chat", version="1", engine="specpair", category="general").inc()
    metrics.num_accepted_tokens.labels(pair="chat", version="1", engine="specpair", category="general").inc()
    metrics.num_requests_waiting.labels(pair="chat", version="1", engine="specpair").set(2)
    metrics.num_requests_running.labels(pair="chat", version="1", engine="specpair").set(1)
    metrics.set_state(running=1, waiting=2, k=4, speculating=True, window_rate=None, category_rates={},
                      kv_usage=0.25)
    exposed = generate_latest(metrics.registry).decode()
    for name, signal in SIGNALS.items():
        series = signal.engines["specpair"]
        named = set(re.findall(r"([a-z_:]+)\{", query("chat", "team-a", name)))
        assert named and all(f"\n{n}{{" in exposed for n in named), (name, named)
        if series.pod_metric is not None:
            assert {series.pod_metric} == {n.removesuffix("_total") for n in named}, name


# vLLM 0.32's Prometheus names (vllm/v1/metrics/loggers.py): gauges as named, counters exposed
# with `_total`; each sample labelled model_name (its first served name) and engine.
VLLM_EXPORTS = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                "vllm:generation_tokens", "vllm:spec_decode_num_accepted_tokens"}


def test_every_signal_maps_to_each_engine_s_own_series():
    """One metric name, every engine: the vLLM side names only vLLM's series, the specpair side
    only ours, and a signal made of several series has no per-pod metric (KEDA only)."""
    for name, signal in SIGNALS.items():
        assert set(signal.engines) == {"specpair", "vllm"}, name
        vllm = set(re.findall(r"([a-z_:]+)\{", query("chat", "team-a", name, "vllm")))
        ours = set(re.findall(r"([a-z_:]+)\{", query("chat", "team-a", name, "specpair")))
        assert vllm and all(n.startswith("vllm:") and n.removesuffix("_total") in VLLM_EXPORTS for n in vllm), vllm
        assert ours and all(n.startswith("specpair_") for n in ours), ours
        assert (signal.engines["vllm"].pod_metric is None) == (len(vllm) > 1) == (name == "effectiveLoad")


def test_vllm_exports_the_series_the_table_names():
    """The names checked against the installed vLLM's own source, where scripts/setup-vllm.sh
    installed it."""
    from specpair.vllm_peer import default_python

    found = list(default_python().parent.parent.glob("lib/python*/site-packages/vllm/v1/metrics/loggers.py"))
    if not found:
        pytest.skip("vLLM not installed here (scripts/setup-vllm.sh)")
    source = found[0].read_text() + (found[0].parent.parent / "spec_decode" / "metrics.py").read_text()
    for name in VLLM_EXPORTS:
        assert f'"{name}"' in source, name


def test_a_vllm_pair_scales_on_vllm_s_series_of_its_own_pods():
    from specpair.vllm_serve import identity_name

    vllm = {"engine": "vllm", "rollout": {"autoscaling": SCALED}}
    scaling = Autoscaling.from_spec(vllm)
    assert scaling.engine == "vllm"
    obj = desired_autoscaler("chat.v2", "team-a", scaling, keda=True, default_prometheus="http://prom:9090", labels={})
    q = obj["spec"]["triggers"][0]["metadata"]["query"]
    assert q == 'sum(vllm:num_requests_waiting{namespace="team-a",model_name=~"specpair:chat\\\\.v2:.+"})'
    # The matcher, as Prometheus reads the string (RE2, anchored), takes the pair's pods in every
    # version and speculation state, and no other pair's.
    regex = re.search(r'model_name=~"(.*)"', q).group(1).replace("\\\\", "\\")
    for pair, ours in (("chat.v2", True), ("chatxv2", False), ("chat.v22", False), ("other", False)):
        for speculating in (True, False):
            assert bool(re.fullmatch(regex, identity_name(pair, "3", "ab" * 32, speculating))) == ours, pair
    hpa = desired_autoscaler("chat", "team-a", Autoscaling.from_spec(
        {**vllm, "rollout": {"autoscaling": {**SCALED, "metric": "tokensPerSecond"}}}), keda=False,
        default_prometheus=None, labels={})
    assert hpa["spec"]["metrics"][0]["pods"]["metric"] == {"name": "vllm:generation_tokens"}


def test_effective_load_divides_the_queue_by_the_tokens_a_step_yields():
    for engine, waiting, emitted, accepted in (
            ("specpair", "specpair_num_requests_waiting", "specpair_num_emitted_tokens_total",
             "specpair_num_accepted_tokens_total"),
            ("vllm", "vllm:num_requests_waiting", "vllm:generation_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total")):
        sel = autoscaling_mod.selector("chat", "team-a", engine)
        live, history = (f"sum(rate({{}}{{{{{sel}}}}}[{window}]))" for window in ("1m", "1h"))
        # The live acceptance; else, where the pair emitted nothing in the live window (idle), its
        # last hour's (test_effective_load_promql.py); else one token a step.
        assert query("chat", "team-a", "effectiveLoad", engine) == (
            f"sum({waiting}{{{sel}}}) / (({live.format(emitted)} / ({live.format(emitted)} - {live.format(accepted)} "
            f"> 0)) or (({history.format(emitted)} / ({history.format(emitted)} - {history.format(accepted)} > 0)) "
            f"unless {live.format(emitted)} > 0) or vector(1))")
    # Made of several series: KEDA runs it; an HPA (one series per pod) cannot.
    scaling = Autoscaling.from_spec(spec(**{**SCALED, "metric": "effectiveLoad"}))
    assert desired_autoscaler("chat", "team-a", scaling, keda=True, default_prometheus="http://p", labels={})
    with pytest.raises(AutoscalingError, match="effectiveLoad is a query over several series.*install KEDA"):
        desired_autoscaler("chat", "team-a", scaling, keda=False, default_prometheus=None, labels={})


@pytest.mark.parametrize("pair, refused", [
    ({"rollout": {"autoscaling": {**SCALED, "metric": "kvCacheUsage"}}},
     'spec.rollout.autoscaling.metric: Invalid value: "kvCacheUsage": rollout.autoscaling.metric kvCacheUsage: '
     "engine specpair exports specpair_kv_cache_usage_ratio only with a KV budget, which it has on a GPU or with "
     "rollout.kvBudget (this pair has neither)"),
    ({"rollout": {"autoscaling": {**SCALED, "metric": "kvCacheUsage"}, "resources": {"limits": {"nvidia.com/gpu": 1}}}},
     None),
    ({"rollout": {"autoscaling": {**SCALED, "metric": "kvCacheUsage"}, "kvBudget": "512Mi"}}, None),
    ({"engine": "vllm", "rollout": {"autoscaling": {**SCALED, "metric": "kvCacheUsage"}}}, None),
    ({"engine": "vllm", "rollout": {"autoscaling": {**SCALED, "metric": "effectiveLoad"}}}, None),
])
def test_a_metric_the_pair_s_engine_cannot_export_is_refused(pair, refused):
    full = {"target": {"source": "t"}, "draft": {"drafter": "ngram"}, **pair}
    errors = validate_spec(full)
    assert errors == ([] if refused is None else [errors[0]]) and (refused is None or errors[0].startswith(refused))
    if refused:
        # The autoscaler's own reading says the same (a pair past the operator's check: left as it was).
        plan = autoscaling_mod.plan_autoscaler(full, "chat", "team-a", keda=False, default_prometheus=None)
        assert plan.desired is None and "only with a KV budget" in plan.invalid


def test_a_metric_missing_from_an_engine_s_table_is_refused_naming_both(monkeypatch):
    """An engine the table has no series for (a signal only one engine exports) is refused by name."""
    monkeypatch.setitem(SIGNALS, "queueLength", autoscaling_mod.Signal(
        "requests queued", {"specpair": SIGNALS["queueLength"].engines["specpair"]}))
    why = autoscaling_mod.metric_refusal({"engine": "vllm", "rollout": {"autoscaling": SCALED}})
    assert why == ("rollout.autoscaling.metric queueLength (requests queued) is not a series engine vllm exports; "
                   "engine vllm offers runningRequests, tokensPerSecond, kvCacheUsage, effectiveLoad")


def test_every_query_parses_as_promql():
    """promtool (built from the pinned Prometheus module by scripts/build-prometheus.sh) checks each
    query as a rule expression."""
    promtool = shutil.which("promtool", path=os.environ.get("SPECPAIR_PROMETHEUS_BIN"))
    if promtool is None:
        skip_unless_ci("promtool not built here (scripts/build-prometheus.sh; scripts/test.sh builds it)")
    rules = {"groups": [{"name": "autoscaling", "rules": [
        {"record": f"specpair:autoscaling:{name}:{engine}", "expr": query("chat", "team-a", name, engine)}
        for name in SIGNALS for engine in SIGNALS[name].engines]}]}
    out = subprocess.run([promtool, "check", "rules", "/dev/stdin"], input=yaml.safe_dump(rules),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _promtool() -> str:
    promtool = shutil.which("promtool", path=os.environ.get("SPECPAIR_PROMETHEUS_BIN"))
    if promtool is None:
        skip_unless_ci("promtool not built here (scripts/build-prometheus.sh; scripts/test.sh builds it)")
    return promtool


@pytest.mark.parametrize("engine", ["specpair", "vllm"])
def test_effective_load_rises_as_acceptance_collapses_in_prometheus(engine, tmp_path):
    """Prometheus' own engine (promtool's rule tests) evaluates the effectiveLoad query over series
    named and labelled as each engine exports them: 6 requests waiting on a pair whose steps yield
    3 tokens (200 of every 300 emitted were accepted drafts) are a load of 2; the same queue at
    acceptance collapsed (20 of 300) is 6 / (300 / 280) = 5.6; without accepted drafts, 6. Another
    pair's pods, and the same pair's in another namespace, are not counted."""
    from specpair.vllm_serve import identity_name

    names = {"specpair": ("specpair_num_requests_waiting", "specpair_num_emitted_tokens_total",
                          "specpair_num_accepted_tokens_total"),
             "vllm": ("vllm:num_requests_waiting", "vllm:generation_tokens_total",
                      "vllm:spec_decode_num_accepted_tokens_total")}[engine]

    def labels(pair: str, namespace: str = "team-a", pod: str = "p0") -> str:
        own = (f'pair="{pair}",version="3",engine="specpair",category="general"' if engine == "specpair" else
               f'model_name="{identity_name(pair, "3", "ab" * 32, True)}",engine="0"')
        return f'{{namespace="{namespace}",pod="{pod}",{own}}}'

    def pods(pair: str, waiting: int, accepted: int | None, namespace: str = "team-a") -> list[dict]:
        """Two pods of `pair`, each with half the queue, 300 tokens emitted per 15 s and `accepted`
        of them accepted drafts (None: no such series)."""
        out = []
        for pod in ("p0", "p1"):
            out += [{"series": names[0] + labels(pair, namespace, pod), "values": f"{waiting // 2}x20"},
                    {"series": names[1] + labels(pair, namespace, pod), "values": "0+300x20"}]
            if accepted is not None:
                out.append({"series": names[2] + labels(pair, namespace, pod), "values": f"0+{accepted}x20"})
        return out
    noise = pods("other", 100, 10) + pods("chat", 100, 10, namespace="team-b")
    effective = query("chat", "team-a", "effectiveLoad", engine)
    tests = [{"interval": "15s", "input_series": pods("chat", 6, accepted) + noise, "promql_expr_test": [{
        # Compared within 1e-9, not bit for bit: rate() extrapolates.
        "expr": f"abs(({effective}) - {expected}) < bool 1e-9", "eval_time": "5m",
        "exp_samples": [{"labels": "{}", "value": 1}]}]}
        for accepted, expected in ((200, 2), (20, 6 / (300 / 280)), (None, 6), (0, 6))]
    (tmp_path / "rules.yaml").write_text("groups: []\n")
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": tests}))
    out = subprocess.run([_promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("engine", ["specpair", "vllm"])
def test_a_collapsing_acceptance_scales_out_on_effective_load_before_the_queue_grows(engine, tmp_path):
    """One pair's two pods over 10 minutes, in Prometheus' own engine (promtool): 2 requests wait
    on each, 300 tokens are emitted per 15 s; 200 of them are accepted drafts (3 tokens a step)
    until minute 4, then 20 (acceptance collapsed); at minute 8.25 the queue grows to 5 a pod.
    KEDA wants ceil(signal / target) replicas. Effective load at target 3 asks for 1 replica while
    acceptance holds (4 / 3), and for 2 at minute 6 (4 / (300 / 280) = 3.73), while the queue is
    still 4: a queueLength autoscaler sized for the same pair (9 a replica: 3 effective at 3
    tokens a step) still wants 1, and asks for 2 only once the queue has grown (10 at minute 9)."""
    from specpair.vllm_serve import identity_name

    waiting, emitted, accepted = {"specpair": ("specpair_num_requests_waiting", "specpair_num_emitted_tokens_total",
                                               "specpair_num_accepted_tokens_total"),
                                  "vllm": ("vllm:num_requests_waiting", "vllm:generation_tokens_total",
                                           "vllm:spec_decode_num_accepted_tokens_total")}[engine]
    series = []
    for pod in ("p0", "p1"):
        own = (f'pair="chat",version="3",engine="specpair",category="general"' if engine == "specpair" else
               f'model_name="{identity_name("chat", "3", "ab" * 32, True)}",engine="0"')
        labels = f'{{namespace="team-a",pod="{pod}",{own}}}'
        # 15 s samples: 0..16 are minutes 0-4, 17..40 minutes 4.25-10.
        series += [{"series": waiting + labels, "values": "2x32 5x7"},
                   {"series": emitted + labels, "values": "0+300x40"},
                   {"series": accepted + labels, "values": "0+200x16 3220+20x23"}]
    effective, queue = query("chat", "team-a", "effectiveLoad", engine), query("chat", "team-a", "queueLength", engine)

    def replicas(expr: str, target: int, at: str, want: int) -> dict:
        return {"expr": f"ceil(({expr}) / {target})", "eval_time": at, "exp_samples": [{"labels": "{}", "value": want}]}
    checks = [replicas(effective, 3, "3m", 1), replicas(queue, 9, "3m", 1),
              {"expr": f"abs(({effective}) - {4 * 280 / 300}) < bool 1e-9", "eval_time": "6m",
               "exp_samples": [{"labels": "{}", "value": 1}]},
              replicas(effective, 3, "6m", 2), replicas(queue, 9, "6m", 1),    # scaled out, queue unchanged
              replicas(queue, 9, "9m", 2)]                                     # the queue only now
    (tmp_path / "rules.yaml").write_text("groups: []\n")
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": [
        {"interval": "15s", "input_series": series, "promql_expr_test": checks}]}))
    out = subprocess.run([_promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
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
    # A vLLM pair's: an HPA on a per-pod series named with vLLM's colon, a ScaledObject on the
    # effective load's query.
    for metric, keda, plural in (("queueLength", False, "horizontalpodautoscalers"),
                                 ("effectiveLoad", True, "scaledobjects")):
        vllm = Autoscaling.from_spec({"engine": "vllm", "rollout": {"autoscaling": {**SCALED, "metric": metric}}})
        obj = desired_autoscaler("served-by-vllm", ns.name, vllm, keda=keda, default_prometheus="http://prom:9090",
                                 labels={})
        created = kube.request("POST", resource_path(obj["apiVersion"], plural, ns.name), body=obj)
        key = "triggers" if keda else "metrics"
        assert created["spec"][key] == obj["spec"][key]
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

    from specpair_operator.act.ledger import StatusLedger
    from specpair_operator.state import OperatorState

    from specpair_operator.act.autoscaler import apply_autoscaler_plan

    monkeypatch.delenv(autoscaling_mod.PROMETHEUS_ENV, raising=False)
    state = OperatorState(keda_seen=(True, time.monotonic()))
    body = {"metadata": {"name": "chat", "namespace": "team-a", "uid": "u1"},
            "spec": {"rollout": {"autoscaling": SCALED}}}
    status: dict = {}
    for passes in (1, 2):
        ledger = StatusLedger(status, 3, "team-a", "chat", logging.getLogger("test"))
        plan = autoscaling_mod.plan_autoscaler(body["spec"], "chat", "team-a",
                                               keda=asyncio.run(keda_mod.keda_installed(state)),
                                               default_prometheus=autoscaling_mod.default_prometheus())
        asyncio.run(apply_autoscaler_plan(state.kube, body, ledger, plan))
        status = {**status, **ledger.status_patch()}
        condition = next(c for c in status["conditions"] if c["type"] == "Autoscaled")
        assert (condition["status"], condition["reason"], condition["observedGeneration"]) == \
            ("False", "InvalidAutoscaling", 3)
        assert [e[:2] for e in ledger.events] == ([("Warning", "InvalidAutoscaling")] if passes == 1 else [])
        assert ledger.report is None
