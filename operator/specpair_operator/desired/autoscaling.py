"""What scales a pair's engine pods: a KEDA ScaledObject where KEDA is installed, an HPA otherwise.

Both point at the SpecModelPair itself through its scale subresource, never at the Deployment:
the autoscaler writes `spec.rollout.replicas` (as `kubectl scale smp/NAME` does), and the
operator rolls that number into the engine Deployment like any other replica count. So one
field says how many pods serve, the operator never fights an autoscaler over the Deployment,
and scaling is outside the release (its content hash, and so its gate, never sees replicas).

The signals are each engine's own gauges and counters, read per pair: queued requests, running
requests, streamed tokens per second, the share of the KV cache in use, and the effective load
(queued requests over the tokens each step yields at the live acceptance). One
`rollout.autoscaling.metric` name means the same on both engines; the contract's SIGNALS
(crd/autoscaling_signals.py) maps it to each engine's series, and a metric an engine cannot
export is refused there rather than written into an autoscaler that never scales. Whether KEDA
is installed is observed (observe/keda.py) and handed in as `keda`. KEDA reads them from Prometheus with a query over the pair's pods; an HPA reads one
series per pod through the custom metrics API (prometheus-adapter's default rules serve a gauge
under its own name and a `_total` counter as its per-second rate without the suffix), so it
averages them itself, and a signal made of several series needs KEDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from specpair_operator.desired import manifests
from specpair_operator.crd import names
from specpair_operator.crd.schema import autoscaling_with_defaults
from specpair_operator.desired.manifests import engine_name
# The signal table and the metric refusal are the contract's (crd/autoscaling_signals.py).
from specpair_operator.crd.autoscaling_signals import (RATE_WINDOW, SIGNALS, SPECPAIR, VLLM, Series, Signal,  # noqa: F401
                                                       engine_of, metric_refusal, spec_refusals)

# The CRD's group/version for scaleTargetRef (the scale subresource is served there).
PAIR_API_VERSION = "specpair.io/v1alpha1"
PAIR_KIND = "SpecModelPair"
KEDA_API_VERSION = "keda.sh/v1alpha1"
HPA_API_VERSION = "autoscaling/v2"
API_VERSIONS = {"ScaledObject": KEDA_API_VERSION, "HorizontalPodAutoscaler": HPA_API_VERSION}
# The pair's condition: its autoscaler is in place (reason: the kind), or why it is not.
AUTOSCALED = "Autoscaled"
# The chart's autoscaling.prometheusAddress: where KEDA asks for a pair's signal, unless the
# pair names its own.
PROMETHEUS_ENV = "SPECPAIR_PROMETHEUS_ADDRESS"


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
        raw = autoscaling_with_defaults(raw)
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
