"""An autoscaled pair's whole life on the real control plane, with KEDA's CRD absent, then
installed, then gone: what tests/operator/test_operator_autoscaler.py checks, and what the
audit-log RBAC test (test_operator_e2e.py) runs to see every autoscaler verb the chart grants
used. The operator runs in-process (KopfRunner) with the chart's RBAC."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from functools import lru_cache
from typing import Any

import yaml
from kopf.testing import KopfRunner
from mlflow import MlflowClient

from cluster_env import OPERATOR, Namespace, cond, model_name, pair, serving, set_spec, wait_until
from specpair_devcluster.client import ApiError, resource_path
from specpair_operator.desired import autoscaling
from specpair_operator.observe import keda
from specpair_operator.desired.manifests import engine_name
from specpair_operator.state import STATE

KEDA_MODULE = "github.com/kedacore/keda/v2@v2.21.0"
KEDA_CRD = "scaledobjects.keda.sh"
HPA, SO = ("autoscaling/v2", "horizontalpodautoscalers"), ("keda.sh/v1alpha1", "scaledobjects")
PROMETHEUS = "http://prometheus.monitoring:9090"


@lru_cache(maxsize=1)
def keda_crd() -> dict[str, Any]:
    """KEDA's ScaledObject CRD as KEDA ships it, from its Go module (the module proxy serves it)."""
    go = shutil.which("go")
    assert go is not None, "go is needed to fetch KEDA's CRD from its module"
    out = subprocess.run([go, "mod", "download", "-json", KEDA_MODULE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    with open(os.path.join(json.loads(out.stdout)["Dir"], "config/crd/bases/keda.sh_scaledobjects.yaml")) as f:
        return yaml.safe_load(f)


def _keda_served(kube: Any) -> bool:
    try:
        resources = kube.request("GET", "/apis/keda.sh/v1alpha1").get("resources") or []
    except ApiError:
        return False
    return any(r.get("name") == "scaledobjects" for r in resources)


def install_keda_crd(kube: Any) -> None:
    try:
        kube.request("POST", resource_path("apiextensions.k8s.io/v1", "customresourcedefinitions"), body=keda_crd())
    except ApiError as exc:
        if exc.status != 409:
            raise
    wait_until("KEDA's ScaledObject served", lambda: _keda_served(kube), 60)


def remove_keda_crd(kube: Any) -> None:
    try:
        kube.request("DELETE", resource_path("apiextensions.k8s.io/v1", "customresourcedefinitions", None, KEDA_CRD))
    except ApiError as exc:
        if exc.status != 404:
            raise
    wait_until("KEDA's ScaledObject no longer served", lambda: not _keda_served(kube), 60)


def get_autoscaler(ns: Namespace, api: tuple[str, str], name: str) -> dict[str, Any] | None:
    try:
        return ns.kube.request("GET", resource_path(api[0], api[1], ns.name, name))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def _messages(ns: Namespace, reason: str) -> list[str]:
    return [e.get("message", "") for e in ns.events(reason)]


def autoscaled_pair_lifecycle(ns: Namespace, devcluster: Any, mlflow_url: str, monkeypatch: Any,
                              name: str) -> None:
    kube = ns.kube
    child = engine_name(name)
    monkeypatch.setattr(keda, "KEDA_RECHECK_S", 0.5)  # KEDA coming and going is seen at once
    monkeypatch.delenv(autoscaling.PROMETHEUS_ENV, raising=False)
    remove_keda_crd(kube)
    scaling = {"minReplicas": 1, "maxReplicas": 3, "metric": "queueLength", "target": 4,
               "scaleDownStabilizationSeconds": 5}
    try:
        with KopfRunner(OPERATOR, timeout=60) as runner:
            created = ns.create(pair(name, "good-draft", rollout={"autoscaling": scaling}))
            before = ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)

            # Without KEDA: an HPA on the pair's scale subresource, owned by the pair.
            hpa = ns.wait_for("the HPA", lambda: get_autoscaler(ns, HPA, child))
            assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair",
                                                     "name": name}
            assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
            assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 5
            assert [r["uid"] for r in hpa["metadata"]["ownerReferences"] if r.get("controller")] == \
                [created["metadata"]["uid"]]
            # The real HPA controller (kube-controller-manager) reads the pair through its scale
            # subresource: the replica count and, for its pod metric, the pods' selector. No custom
            # metrics API is served here, so it can read no value and scales nothing.
            def controller_read_the_pair() -> dict[str, Any] | None:
                status = (get_autoscaler(ns, HPA, child) or {}).get("status") or {}
                conditions = {c["type"]: c for c in status.get("conditions") or []}
                able, active = conditions.get("AbleToScale", {}), conditions.get("ScalingActive", {})
                return status if able.get("reason") == "SucceededGetScale" and active.get("reason") == \
                    "FailedGetPodsMetric" else None
            status = ns.wait_for("the HPA controller reads the pair's scale", controller_read_the_pair, timeout=60)
            assert status["currentReplicas"] == ns.pair(name)["spec"]["rollout"]["replicas"] == 1
            assert cond(ns.pair(name), "Autoscaled")["reason"] == "HorizontalPodAutoscaler"
            assert any(f"HorizontalPodAutoscaler {child} scales the pair from 1 to 3 replicas on queueLength" in m
                       for m in _messages(ns, "AutoscalerCreated"))

            # A bad autoscaling is refused by the API server in words; nothing changes.
            try:
                set_spec(ns, name, {"rollout": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}})
                raise AssertionError("maxReplicas below minReplicas was accepted")
            except ApiError as exc:
                assert exc.status == 422 and "maxReplicas must be at least minReplicas" in str(exc), exc

            # Changing the autoscaler is not a release: nothing is gated or rolled again.
            template = ns.get("apps/v1", "Deployment", child)["metadata"]["annotations"]["specpair.io/template-hash"]
            set_spec(ns, name, {"rollout": {"autoscaling": {"maxReplicas": 4}}})
            ns.wait_for("the HPA updated", lambda: (get_autoscaler(ns, HPA, child) or {}).get("spec", {}).get("maxReplicas") == 4)
            ns.wait_for_event("AutoscalerUpdated", "1 to 4 replicas")
            # The real HPA controller scales the pair through its scale subresource (a minimum above
            # the pair's replicas needs no metric); the operator scales the engine Deployment to it.
            set_spec(ns, name, {"rollout": {"autoscaling": {"minReplicas": 2}}})
            ns.wait_for("the HPA controller scales the pair to 2",
                        lambda: ns.pair(name)["spec"]["rollout"]["replicas"] == 2, timeout=60)
            ns.wait_for("the engine Deployment at 2",
                        lambda: ns.get("apps/v1", "Deployment", child)["spec"]["replicas"] == 2, timeout=60)
            ns.wait_for_event("Scaled", "scaled from 1 to 2 replicas")
            after = ns.wait_for("still serving v1", lambda: serving(ns, name, "1"), timeout=60)
            assert after["status"]["history"] == before["status"]["history"]
            assert after["status"]["contentHash"] == before["status"]["contentHash"]
            assert ns.get("apps/v1", "Deployment", child)["metadata"]["annotations"]["specpair.io/template-hash"] \
                == template
            assert len(ns.list("batch/v1", "Job")) == 1
            assert [v.version for v in MlflowClient(mlflow_url).search_model_versions(
                f"name='{model_name(ns, name)}'")] == ["1"]

            # KEDA installed, but nowhere to ask for the metric: said on the pair, the HPA stays.
            install_keda_crd(kube)
            stuck = ns.wait_for("no Prometheus address said", lambda: (o := ns.pair(name)) and
                                cond(o, "Autoscaled").get("reason") == "InvalidAutoscaling" and o, timeout=60)
            assert "KEDA scales from Prometheus" in cond(stuck, "Autoscaled")["message"]
            assert cond(stuck, "Autoscaled")["status"] == "False" and _messages(ns, "InvalidAutoscaling")
            assert get_autoscaler(ns, HPA, child) is not None and serving(ns, name, "1")

            # With the operator's Prometheus address: a ScaledObject replaces the HPA.
            monkeypatch.setenv(autoscaling.PROMETHEUS_ENV, PROMETHEUS)
            so = ns.wait_for("the ScaledObject", lambda: get_autoscaler(ns, SO, child), timeout=60)
            ns.wait_for("the HPA deleted", lambda: get_autoscaler(ns, HPA, child) is None)
            assert so["spec"]["scaleTargetRef"]["kind"] == "SpecModelPair" and so["spec"]["maxReplicaCount"] == 4
            assert so["spec"]["pollingInterval"] == 30
            assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == \
                {"stabilizationWindowSeconds": 5}
            assert so["spec"]["triggers"][0]["metadata"]["serverAddress"] == PROMETHEUS
            ns.wait_for_event("AutoscalerRemoved", "replaced by a ScaledObject")
            ns.wait_for("Autoscaled by the ScaledObject",
                        lambda: cond(ns.pair(name), "Autoscaled").get("reason") == "ScaledObject")

            set_spec(ns, name, {"rollout": {"autoscaling": {"pollingIntervalSeconds": 2}}})
            ns.wait_for("the ScaledObject updated",
                        lambda: (get_autoscaler(ns, SO, child) or {}).get("spec", {}).get("pollingInterval") == 2)

            # Autoscaling removed: the ScaledObject goes, and so does the condition.
            set_spec(ns, name, {"rollout": {"autoscaling": None}})
            ns.wait_for("the ScaledObject deleted", lambda: get_autoscaler(ns, SO, child) is None)
            ns.wait_for("no Autoscaled condition", lambda: not cond(ns.pair(name), "Autoscaled"))
            ns.wait_for_event("AutoscalerRemoved", "autoscaling removed from the spec")
            assert serving(ns, name, "1")["status"]["history"] == before["status"]["history"]
        assert runner.exception is None
    finally:
        remove_keda_crd(kube)
        STATE.keda_seen = None  # the next operator in this process asks again
