"""Act: the pair's autoscaler as its plan says (desired/autoscaling.plan_autoscaler, planned in
plan/serving_rollout from what observe read: the spec, whether KEDA is served, the installation's
Prometheus address).

The planned object is written through ensure_owned (owned by the pair), the unwanted kind through
delete_owned (only while the pair owns it, by its uid). What it finds is the pair's Autoscaled
condition, with an Event for each object written or deleted. A spec the plan cannot turn into an
autoscaler, a name taken, or a request refused leaves the existing autoscaler as it is and serving
untouched: Autoscaled is False with the reason, and a Warning Event says it once."""

from __future__ import annotations

from typing import Any

from specpair_operator.act import owned
from specpair_operator.clients.kube import KubeError
from specpair_operator.desired.autoscaling import API_VERSIONS, AUTOSCALED, AutoscalerPlan, describe
from specpair_operator.desired.manifests import engine_name


async def apply_autoscaler_plan(kube: Any, body: Any, ledger: Any, plan: AutoscalerPlan) -> None:
    meta = body["metadata"]
    pair, namespace = meta["name"], meta["namespace"]
    if plan.invalid:
        _not_autoscaled(ledger, "InvalidAutoscaling", plan.invalid)
        return
    try:
        for kind in plan.remove:
            unwanted = {"apiVersion": API_VERSIONS[kind], "kind": kind,
                        "metadata": {"namespace": namespace, "name": engine_name(pair)}}
            gone = await owned.delete_owned(kube, body, unwanted)
            if gone.outcome == owned.DELETED:
                ledger.event("Normal", "AutoscalerRemoved", f"{kind} {gone.name} deleted: {plan.why}")
        done = None if plan.desired is None else await owned.ensure_owned(kube, body, dict(plan.desired))
    except KubeError as exc:
        if not exc.permanent:
            raise  # an outage: the pass is retried
        _not_autoscaled(ledger, "KubernetesAPIRefused", f"the Kubernetes API refused a request about the pair's "
                        f"autoscaler (HTTP {exc.status}): {exc.message[:600]}")
        return
    if done is None:
        ledger.conditions = [cond for cond in ledger.conditions if cond.get("type") != AUTOSCALED]
        return
    if done.conflict:
        _not_autoscaled(ledger, "NameConflict",
                        f"{done.kind} {done.name} exists and is not this pair's: it is left alone")
        return
    assert plan.scaling is not None     # a desired autoscaler comes with its scaling
    what = f"{done.kind} {done.name} scales the pair from {describe(plan.scaling)}"
    if done.changed:
        ledger.event("Normal", "AutoscalerCreated" if done.outcome == owned.CREATED else "AutoscalerUpdated", what)
    ledger.cond(AUTOSCALED, True, done.kind, what)


def _not_autoscaled(ledger: Any, reason: str, message: str) -> None:
    old = next((cond for cond in ledger.conditions if cond.get("type") == AUTOSCALED), None)
    if old is None or old.get("message") != message:
        ledger.event("Warning", reason, message[:1000])
    ledger.cond(AUTOSCALED, False, reason, message)
