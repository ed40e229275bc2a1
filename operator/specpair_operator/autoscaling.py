"""What scales a pair's engine pods: a KEDA ScaledObject where KEDA is installed, an HPA otherwise.

Both point at the SpecModelPair itself through its scale subresource, never at the Deployment:
the autoscaler writes `spec.rollout.replicas` (as `kubectl scale smp/NAME` does), and the
operator rolls that number into the engine Deployment like any other replica count. So one
field says how many pods serve, the operator never fights an autoscaler over the Deployment,
and scaling is outside the release (its content hash, and so its gate, never sees replicas).

The signals are the engine's own gauges and counters (engine/specpair/server/metrics.py), read
per pair: queued requests, running requests, streamed tokens per second. KEDA reads them from
Prometheus with a query over the pair's pods; an HPA reads the same series per pod through the
custom metrics API (prometheus-adapter's default rules serve a gauge under its own name and a
`_total` counter as its per-second rate without the suffix), so it averages them itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .manifests import engine_name

# The CRD's group/version for scaleTargetRef (the scale subresource is served there).
PAIR_API_VERSION = "specpair.io/v1alpha1"
PAIR_KIND = "SpecModelPair"
KEDA_API_VERSION = "keda.sh/v1alpha1"
HPA_API_VERSION = "autoscaling/v2"


@dataclass(frozen=True)
class Signal:
    """One scaling signal: how KEDA queries it over a pair's pods (a sum, divided by the target per
    replica), and the per-pod series an HPA averages."""
    promql: str          # {selector} is the pair's label matchers
    pod_metric: str
    meaning: str


SIGNALS: dict[str, Signal] = {
    "queueLength": Signal("sum(specpair_num_requests_waiting{{{selector}}})",
                          "specpair_num_requests_waiting", "requests queued for a batch slot"),
    "runningRequests": Signal("sum(specpair_num_requests_running{{{selector}}})",
                              "specpair_num_requests_running", "requests in the running batch"),
    "tokensPerSecond": Signal("sum(rate(specpair_num_emitted_tokens_total{{{selector}}}[1m]))",
                              "specpair_num_emitted_tokens", "tokens streamed to clients per second"),
}
DEFAULT_SIGNAL = "queueLength"


class AutoscalingError(ValueError):
    """A `rollout.autoscaling` the operator cannot turn into an autoscaler (said to the user as is)."""


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int
    max_replicas: int
    metric: str
    target: float
    prometheus: str | None     # KEDA's Prometheus address; None: the operator's default

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> "Autoscaling | None":
        """`spec.rollout.autoscaling` read and checked (the CRD refuses the same; a pair written past
        an older CRD still meets these words). None: the pair is not autoscaled."""
        raw = (spec.get("rollout") or {}).get("autoscaling")
        if not raw:
            return None
        lo, hi = raw.get("minReplicas", 1), raw.get("maxReplicas")
        metric, target = raw.get("metric", DEFAULT_SIGNAL), raw.get("target")
        if not isinstance(hi, int) or isinstance(hi, bool):
            raise AutoscalingError("rollout.autoscaling.maxReplicas is required (an integer)")
        if not isinstance(lo, int) or isinstance(lo, bool) or lo < 1:
            raise AutoscalingError(f"rollout.autoscaling.minReplicas must be an integer >= 1, got {lo!r}")
        if hi < lo:
            raise AutoscalingError(f"rollout.autoscaling.maxReplicas ({hi}) is below minReplicas ({lo})")
        if metric not in SIGNALS:
            raise AutoscalingError(f"rollout.autoscaling.metric {metric!r} is not one of {', '.join(SIGNALS)}")
        if not isinstance(target, (int, float)) or isinstance(target, bool) or not target > 0:
            raise AutoscalingError(f"rollout.autoscaling.target must be a number > 0 (per replica), got {target!r}")
        return cls(lo, hi, metric, float(target), raw.get("prometheusAddress"))


def query(pair: str, namespace: str, metric: str) -> str:
    """The PromQL that sums a signal over one pair's engine pods (the `pair` label is the engine's
    own; `namespace` is the scrape target's, as the chart's ServiceMonitor keeps it)."""
    selector = f'namespace="{namespace}",pair="{pair}"'
    return SIGNALS[metric].promql.format(selector=selector)


def _target_value(target: float) -> str:
    return str(int(target)) if float(target).is_integer() else f"{target:g}"


def desired_autoscaler(pair: str, namespace: str, scaling: Autoscaling, *, keda: bool,
                       default_prometheus: str | None, labels: dict[str, str]) -> dict[str, Any]:
    """The ScaledObject (keda) or HPA for a pair, without owner reference (ensure_owned adds it)."""
    target_ref = {"apiVersion": PAIR_API_VERSION, "kind": PAIR_KIND, "name": pair}
    meta = {"name": engine_name(pair), "namespace": namespace, "labels": dict(labels)}
    if keda:
        address = scaling.prometheus or default_prometheus
        if not address:
            raise AutoscalingError("KEDA scales from Prometheus: set rollout.autoscaling.prometheusAddress "
                                   "or the operator's prometheus address (chart value autoscaling.prometheusAddress)")
        return {
            "apiVersion": KEDA_API_VERSION, "kind": "ScaledObject", "metadata": meta,
            "spec": {
                "scaleTargetRef": target_ref,
                "minReplicaCount": scaling.min_replicas,
                "maxReplicaCount": scaling.max_replicas,
                "triggers": [{"type": "prometheus", "metadata": {
                    "serverAddress": address,
                    "query": query(pair, namespace, scaling.metric),
                    "threshold": _target_value(scaling.target),
                }}],
            },
        }
    return {
        "apiVersion": HPA_API_VERSION, "kind": "HorizontalPodAutoscaler", "metadata": meta,
        "spec": {
            "scaleTargetRef": target_ref,
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": SIGNALS[scaling.metric].pod_metric},
                "target": {"type": "AverageValue", "averageValue": _target_value(scaling.target)},
            }}],
        },
    }
