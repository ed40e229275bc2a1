"""What scales a pair's engine pods: a KEDA ScaledObject where KEDA is installed, an HPA otherwise.

Both point at the SpecModelPair itself through its scale subresource, never at the Deployment:
the autoscaler writes `spec.rollout.replicas` (as `kubectl scale smp/NAME` does), and the
operator rolls that number into the engine Deployment like any other replica count. So one
field says how many pods serve, the operator never fights an autoscaler over the Deployment,
and scaling is outside the release (its content hash, and so its gate, never sees replicas).

The signals are each engine's own gauges and counters, read per pair: queued requests, running
requests, streamed tokens per second, the share of the KV cache in use, and the effective load
(queued requests over the tokens each step yields at the live acceptance). One
`rollout.autoscaling.metric` name means the same on both engines; SIGNALS maps it to each
engine's series (the specpair engine's engine/specpair/server/metrics.py, vLLM's
vllm/v1/metrics/loggers.py), and a metric an engine cannot export is refused
(`metric_refusal`, which the operator's spec check calls through engine_limits.refusals) rather
than written into an autoscaler that never scales. KEDA reads them from Prometheus with a query over the pair's pods; an HPA reads one
series per pod through the custom metrics API (prometheus-adapter's default rules serve a gauge
under its own name and a `_total` counter as its per-second rate without the suffix), so it
averages them itself, and a signal made of several series needs KEDA.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

from specpair_operator.desired import manifests
from specpair_operator.crd import names, validation
from specpair_operator.desired.manifests import engine_name

# The CRD's group/version for scaleTargetRef (the scale subresource is served there).
PAIR_API_VERSION = "specpair.io/v1alpha1"
PAIR_KIND = "SpecModelPair"
KEDA_API_VERSION = "keda.sh/v1alpha1"
HPA_API_VERSION = "autoscaling/v2"
API_VERSIONS = {"ScaledObject": KEDA_API_VERSION, "HorizontalPodAutoscaler": HPA_API_VERSION}
# The pair's condition: its autoscaler is in place (reason: the kind), or why it is not.
AUTOSCALED = "Autoscaled"
# How long the answer to "is KEDA installed?" stands: KEDA installed (or removed) after the
# operator started is seen within this long, and the pair's autoscaler switches kind.
KEDA_RECHECK_S = 60.0
# The chart's autoscaling.prometheusAddress: where KEDA asks for a pair's signal, unless the
# pair names its own.
PROMETHEUS_ENV = "SPECPAIR_PROMETHEUS_ADDRESS"


# How far back a rate looks: the counters' per-second rates, and the live acceptance.
RATE_WINDOW = "1m"


@dataclass(frozen=True)
class Series:
    """One signal on one engine: how KEDA queries it over a pair's pods (a sum, divided by the
    target per replica), and the per-pod series an HPA averages (None: the signal is several
    series, which only a query can combine)."""
    promql: str                # {selector}: the pair's label matchers; {window}: RATE_WINDOW
    pod_metric: str | None


@dataclass(frozen=True)
class Signal:
    meaning: str
    engines: Mapping[str, Series]   # engine kind -> its series; an engine absent cannot export it


def _effective_load(waiting: str, emitted: str, accepted: str) -> str:
    """Queued requests over the tokens a step yields at the live acceptance. Each step of a row
    emits its accepted draft tokens plus one, so steps = emitted - accepted and tokens per step =
    emitted / (emitted - accepted): 1 target-only, ~3 at acceptance length 3. A pair whose
    acceptance collapses serves its queue slower: the same queue is more load. Idle, or with
    no accepted series (speculation off, vLLM without a drafter), a step yields one token."""
    rate = "sum(rate({name}{{{{{{selector}}}}}}[{{window}}]))"
    emitted_rate, accepted_rate = rate.format(name=emitted), rate.format(name=accepted)
    return (f"sum({waiting}{{{{{{selector}}}}}}) / (({emitted_rate} / ({emitted_rate} - {accepted_rate} > 0)) "
            "or vector(1))")


SPECPAIR, VLLM = "specpair", "vllm"
SIGNALS: dict[str, Signal] = {
    "queueLength": Signal("requests queued for a batch slot", {
        SPECPAIR: Series("sum(specpair_num_requests_waiting{{{selector}}})", "specpair_num_requests_waiting"),
        VLLM: Series("sum(vllm:num_requests_waiting{{{selector}}})", "vllm:num_requests_waiting")}),
    "runningRequests": Signal("requests in the running batch", {
        SPECPAIR: Series("sum(specpair_num_requests_running{{{selector}}})", "specpair_num_requests_running"),
        VLLM: Series("sum(vllm:num_requests_running{{{selector}}})", "vllm:num_requests_running")}),
    "tokensPerSecond": Signal("tokens streamed to clients per second", {
        SPECPAIR: Series("sum(rate(specpair_num_emitted_tokens_total{{{selector}}}[{window}]))",
                         "specpair_num_emitted_tokens"),
        VLLM: Series("sum(rate(vllm:generation_tokens_total{{{selector}}}[{window}]))", "vllm:generation_tokens")}),
    # The specpair engine has a KV budget on CUDA (by default) or with rollout.kvBudget (its
    # --kv-budget), vLLM always (its KV cache blocks).
    "kvCacheUsage": Signal("share of the KV cache the running requests hold", {
        SPECPAIR: Series("sum(specpair_kv_cache_usage_ratio{{{selector}}})", "specpair_kv_cache_usage_ratio"),
        VLLM: Series("sum(vllm:kv_cache_usage_perc{{{selector}}})", "vllm:kv_cache_usage_perc")}),
    "effectiveLoad": Signal("queued requests over the tokens each step yields at the live acceptance", {
        SPECPAIR: Series(_effective_load("specpair_num_requests_waiting", "specpair_num_emitted_tokens_total",
                                         "specpair_num_accepted_tokens_total"), None),
        VLLM: Series(_effective_load("vllm:num_requests_waiting", "vllm:generation_tokens_total",
                                     "vllm:spec_decode_num_accepted_tokens_total"), None)}),
}


def engine_of(spec: Mapping[str, Any]) -> str:
    """The engine kind that serves the pair (spec.engine; the CRD's default)."""
    return str(spec.get("engine") or SPECPAIR)


def spec_refusals(spec: Any) -> list[str]:
    """metric_refusal in the words of validation.validate_spec (which calls it): a spec the
    CRD's schema lets through whose metric its engine cannot export."""
    why = metric_refusal(spec) if isinstance(spec, dict) else None
    if why is None:
        return []
    metric = validation.autoscaling_with_defaults(spec["rollout"]["autoscaling"])["metric"]
    return [f'spec.rollout.autoscaling.metric: Invalid value: "{metric}": {why}']


def metric_refusal(spec: Mapping[str, Any]) -> str | None:
    """Why the pair's engine cannot export the series its `rollout.autoscaling.metric` scales on
    (None: it can, or the pair is not autoscaled, or the metric is not one of SIGNALS: the CRD's
    enum says that). An autoscaler on a series that never exists is written and never scales."""
    raw = (spec.get("rollout") or {}).get("autoscaling") if isinstance(spec.get("rollout"), dict) else None
    if not isinstance(raw, dict):
        return None
    metric, engine = validation.autoscaling_with_defaults(raw).get("metric"), engine_of(spec)
    signal = SIGNALS.get(metric) if isinstance(metric, str) else None
    if signal is None:
        return None
    if engine not in signal.engines:
        return (f"rollout.autoscaling.metric {metric} ({signal.meaning}) is not a series engine {engine} exports; "
                f"engine {engine} offers {', '.join(m for m, s in SIGNALS.items() if engine in s.engines)}")
    rollout = dict(spec.get("rollout") or {})
    if metric == "kvCacheUsage" and engine == SPECPAIR and not manifests.has_gpu(rollout) \
            and rollout.get("kvBudget") is None:
        return (f"rollout.autoscaling.metric {metric}: engine {engine} exports specpair_kv_cache_usage_ratio only "
                f"with a KV budget, which it has on a GPU or with rollout.kvBudget (this pair has neither): the "
                f"autoscaler would never scale; set rollout.kvBudget, or use queueLength, runningRequests, "
                f"tokensPerSecond or effectiveLoad")
    return None


class AutoscalingError(ValueError):
    """A `rollout.autoscaling` the operator cannot turn into an autoscaler (said to the user as is)."""


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int
    max_replicas: int
    metric: str
    target: float
    prometheus: str | None     # KEDA's Prometheus address; None: the operator's default
    scale_down_stabilization_s: int
    polling_interval_s: int
    engine: str = SPECPAIR     # the engine whose series the metric is read from

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> "Autoscaling | None":
        """`spec.rollout.autoscaling` read and checked (the CRD refuses the same; a pair written past
        an older CRD still meets these words). None: the pair is not autoscaled."""
        raw = (spec.get("rollout") or {}).get("autoscaling")
        if not raw:
            return None
        raw = validation.autoscaling_with_defaults(raw)
        lo, hi = raw.get("minReplicas"), raw.get("maxReplicas")
        metric, target = raw.get("metric"), raw.get("target")
        if not isinstance(hi, int) or isinstance(hi, bool):
            raise AutoscalingError("rollout.autoscaling.maxReplicas is required (an integer)")
        if not isinstance(lo, int) or isinstance(lo, bool) or lo < 1:
            raise AutoscalingError(f"rollout.autoscaling.minReplicas must be an integer >= 1, got {lo!r}")
        if hi < lo:
            raise AutoscalingError(f"rollout.autoscaling.maxReplicas ({hi}) is below minReplicas ({lo})")
        if metric not in SIGNALS:
            raise AutoscalingError(f"rollout.autoscaling.metric {metric!r} is not one of {', '.join(SIGNALS)}")
        refusal = metric_refusal(spec)
        if refusal:
            raise AutoscalingError(refusal)
        if not isinstance(target, (int, float)) or isinstance(target, bool) or not target > 0:
            raise AutoscalingError(f"rollout.autoscaling.target must be a number > 0 (per replica), got {target!r}")
        window, polling = raw.get("scaleDownStabilizationSeconds"), raw.get("pollingIntervalSeconds")
        if not isinstance(window, int) or isinstance(window, bool) or not 0 <= window <= 3600:
            raise AutoscalingError("rollout.autoscaling.scaleDownStabilizationSeconds must be an integer "
                                   f"from 0 to 3600, got {window!r}")
        if not isinstance(polling, int) or isinstance(polling, bool) or polling < 1:
            raise AutoscalingError("rollout.autoscaling.pollingIntervalSeconds must be an integer >= 1, "
                                   f"got {polling!r}")
        return cls(lo, hi, metric, float(target), raw.get("prometheusAddress"), window, polling, engine_of(spec))


def selector(pair: str, namespace: str, engine: str = SPECPAIR) -> str:
    """The label matchers of one pair's engine series (`namespace` is the scrape target's, as the
    chart's ServiceMonitor keeps it). The specpair engine labels its series `pair`; vLLM labels
    them `model_name`, its first served name, which is the pod's identity
    (specpair.vllm_serve.identity_name: "specpair:<pair>:v<version>:<hash>:<spec|nospec>")."""
    if engine == VLLM:
        # A pair name is a DNS subdomain: only its dots are special in a (RE2) regex; the PromQL
        # string needs the backslash doubled.
        return f'namespace="{namespace}",model_name=~"specpair:{pair.replace(".", chr(92) * 2 + ".")}:.+"'
    return f'namespace="{namespace}",pair="{pair}"'


def query(pair: str, namespace: str, metric: str, engine: str = SPECPAIR) -> str:
    """The PromQL that sums a signal over one pair's engine pods, in its engine's series."""
    return SIGNALS[metric].engines[engine].promql.format(selector=selector(pair, namespace, engine), window=RATE_WINDOW)


def _target_value(target: float) -> str:
    return str(int(target)) if float(target).is_integer() else f"{target:g}"


def _behavior(scaling: Autoscaling) -> dict[str, Any]:
    """How long the replica count must have been wanted lower before it is lowered."""
    return {"scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_stabilization_s}}


# Each kind's names for the replica bounds (KEDA's ScaledObject, the autoscaling/v2 HPA).
REPLICA_FIELDS = {"ScaledObject": ("minReplicaCount", "maxReplicaCount"),
                  "HorizontalPodAutoscaler": ("minReplicas", "maxReplicas")}


def desired_autoscaler(pair: str, namespace: str, scaling: Autoscaling, *, keda: bool,
                       default_prometheus: str | None, labels: dict[str, str]) -> dict[str, Any]:
    """The ScaledObject (keda) or HPA for a pair, without owner reference (ensure_owned adds it).
    Both scale the pair itself between the same bounds; they differ in where the signal comes
    from (how: `_keda_spec`, `_hpa_spec`)."""
    kind = "ScaledObject" if keda else "HorizontalPodAutoscaler"
    lowest, highest = REPLICA_FIELDS[kind]
    how = _keda_spec(pair, namespace, scaling, default_prometheus) if keda else _hpa_spec(scaling)
    return {"apiVersion": API_VERSIONS[kind], "kind": kind,
            "metadata": {"name": engine_name(pair), "namespace": namespace, "labels": dict(labels)},
            "spec": {"scaleTargetRef": {"apiVersion": PAIR_API_VERSION, "kind": PAIR_KIND, "name": pair},
                     lowest: scaling.min_replicas, highest: scaling.max_replicas, **how}}


def _keda_spec(pair: str, namespace: str, scaling: Autoscaling, default_prometheus: str | None) -> dict[str, Any]:
    """KEDA polls a Prometheus query over the pair's pods."""
    address = scaling.prometheus or default_prometheus
    if not address:
        raise AutoscalingError("KEDA scales from Prometheus: set rollout.autoscaling.prometheusAddress "
                               "or the operator's prometheus address (chart value autoscaling.prometheusAddress)")
    return {
        "pollingInterval": scaling.polling_interval_s,
        # KEDA hands this to the HPA it creates for the ScaledObject.
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(scaling)}},
        "triggers": [{"type": "prometheus", "metadata": {
            "serverAddress": address,
            "query": query(pair, namespace, scaling.metric, scaling.engine),
            "threshold": _target_value(scaling.target),
        }}],
    }


def _hpa_spec(scaling: Autoscaling) -> dict[str, Any]:
    """An HPA averages one series per pod (the custom metrics API)."""
    pod_metric = SIGNALS[scaling.metric].engines[scaling.engine].pod_metric
    if pod_metric is None:
        raise AutoscalingError(f"rollout.autoscaling.metric {scaling.metric} is a query over several series, which "
                               "KEDA runs against Prometheus; without KEDA an HPA averages one series per pod: "
                               "install KEDA or choose queueLength, runningRequests, tokensPerSecond or kvCacheUsage")
    return {
        # An HPA is polled at the controller manager's --horizontal-pod-autoscaler-sync-period
        # (15 s by default): pollingIntervalSeconds is KEDA's alone.
        "behavior": _behavior(scaling),
        "metrics": [{"type": "Pods", "pods": {
            "metric": {"name": pod_metric},
            "target": {"type": "AverageValue", "averageValue": _target_value(scaling.target)},
        }}],
    }


def describe(scaling: Autoscaling) -> str:
    return (f"{scaling.min_replicas} to {scaling.max_replicas} replicas on {scaling.metric} "
            f"(target {_target_value(scaling.target)} per replica)")


async def keda_installed(state: Any) -> bool:
    """Whether the API server serves KEDA's ScaledObject (API discovery), asked again every
    KEDA_RECHECK_S so that installing or removing KEDA needs no operator restart."""
    seen, now = state.keda_seen, time.monotonic()
    if seen is None or now - seen[1] >= KEDA_RECHECK_S:
        seen = state.keda_seen = ("scaledobjects" in await state.kube.served_resources(KEDA_API_VERSION), now)
    return seen[0]


@dataclass(frozen=True)
class AutoscalerPlan:
    """What a pass does about a pair's autoscaler: write `desired` (None: none wanted), delete the
    pair's own autoscaler of each kind in `remove` (saying `why`), or, `invalid`, touch nothing and
    say why."""
    desired: dict[str, Any] | None = None
    scaling: Autoscaling | None = None
    remove: tuple[str, ...] = ()
    why: str = ""
    invalid: str | None = None


def plan_autoscaler(spec: dict[str, Any], pair: str, namespace: str, *, keda: bool,
                    default_prometheus: str | None) -> AutoscalerPlan:
    """The pair's autoscaler as its `rollout.autoscaling` says: a ScaledObject where KEDA is
    installed, an HPA otherwise; the other kind, or both when autoscaling is removed, deleted
    (without KEDA there are no ScaledObjects to look for)."""
    try:
        scaling = Autoscaling.from_spec(spec)
        desired = None if scaling is None else desired_autoscaler(
            pair, namespace, scaling, keda=keda, default_prometheus=default_prometheus,
            labels={"app.kubernetes.io/managed-by": "specpair-operator", manifests.LABEL_PAIR: names.label_value(pair),
                    manifests.LABEL_ROLE: "autoscaler"})
    except AutoscalingError as exc:
        return AutoscalerPlan(invalid=f"{exc}; the autoscaler, if any, is left as it was")
    kinds = ("ScaledObject", "HorizontalPodAutoscaler") if keda else ("HorizontalPodAutoscaler",)
    if desired is None:
        return AutoscalerPlan(remove=kinds, why="autoscaling removed from the spec")
    return AutoscalerPlan(desired, scaling, tuple(k for k in kinds if k != desired["kind"]),
                          f"replaced by a {desired['kind']}")


def default_prometheus() -> str | None:
    """The installation's Prometheus address for KEDA (the chart's autoscaling.prometheusAddress)."""
    return os.environ.get(PROMETHEUS_ENV) or None
