"""End to end on the real control plane: real Kopf running the operator with the chart's RBAC
(helm-installed, ServiceAccount token), a real MLflow server, the real Deployment/Job
controllers and scheduler, and pods run by the devcluster node.

The pods use the stand-in engine image (tests/operator/engine_standin.py, gate_standin.py): the
gate Job runs the operator's own gate runner with a gate that reads the test's model world, and
the engine pods speak the real gRPC API (probed by the node's real gRPC probes) with numbers from
that world. test_operator_real_engine.py runs the real gate and engine on tiny models instead.
"""

from __future__ import annotations

import collections
import json
import uuid
from typing import Any

import pytest
from kopf.testing import KopfRunner
from mlflow import MlflowClient

from cluster_env import OPERATOR, STANDIN_IMAGE, Namespace, World, cond, engine_pods, model_name, operator_metrics
from cluster_env import REPLACE, pair, serving, set_spec
from specpair_devcluster.client import ApiError
from specpair_operator.gate.record import GateRecord
from specpair_operator.release.registry_contract import gate_experiment


@pytest.fixture
def passes(monkeypatch) -> collections.Counter:
    """Completed reconcile passes per pair uid, of the operator KopfRunner runs in this process:
    a check that the operator left something alone waits for passes that could have changed it,
    not for a stretch of time that may hold none."""
    from specpair_operator.act import reconciler

    counts: collections.Counter = collections.Counter()
    reconcile = reconciler.PairReconciler.reconcile

    async def counted(self, *args, **kwargs):
        try:
            return await reconcile(self, *args, **kwargs)
        finally:
            counts[self.uid] += 1

    monkeypatch.setattr(reconciler.PairReconciler, "reconcile", counted)
    return counts


def wait_for_passes(ns: Namespace, passes: collections.Counter, uid: str, n: int = 2, timeout: float = 60) -> None:
    """`n` more completed passes over the pair `uid` than counted now."""
    start = passes[uid]
    ns.wait_for(f"{n} more passes over the pair", lambda: passes[uid] >= start + n, timeout=timeout)


def test_apply_gate_promote_serve_then_new_release_then_failed_gate_keeps_champion(env, mlflow_server, passes):
    ns = env
    name = f"chat-{uuid.uuid4().hex[:5]}"
    model = model_name(ns, name)
    mlflow = MlflowClient(mlflow_server.url)
    with KopfRunner(OPERATOR, timeout=60) as runner:
        # Replace: v2 changes only the draft, which the operator would otherwise score in shadow.
        ns.create(pair(name, "good-draft", rollout=REPLACE))
        obj = ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)
        st = obj["status"]
        assert st["lastGate"]["passed"] and st["lastGate"]["acceptanceRate"] == 0.7 and st["speedup"] == 1.6
        assert st["acceptance"] == 0.7  # gated value until live traffic is measured
        assert cond(obj, "Gated")["status"] == "True" and cond(obj, "TokenizerCompatible")["status"] == "True"
        assert cond(obj, "Reconciling")["status"] == "False" and cond(obj, "Stalled")["status"] == "False"
        assert [h["action"] for h in st["history"]] == ["GateStarted", "GatePassed", "Promoted", "RolloutStarted"]
        assert mlflow.get_registered_model(model).aliases == {"candidate": "1", "champion": "1"}
        jobs = ns.list("batch/v1", "Job")
        assert len(jobs) == 1 and jobs[0]["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        # The verdict is in MLflow before the gate pod exits, so the Job may complete a little later.
        ns.wait_for("the gate Job complete", lambda: any(
            c["type"] == "Complete" and c["status"] == "True"
            for c in (ns.list("batch/v1", "Job")[0].get("status") or {}).get("conditions") or []), timeout=60)
        dep = ns.get("apps/v1", "Deployment", f"{name}-engine")
        assert dep["metadata"]["ownerReferences"][0]["kind"] == "SpecModelPair"
        assert ns.get("v1", "Service", f"{name}-engine") is not None
        (pod,) = engine_pods(ns)
        assert pod["metadata"]["labels"]["specpair.io/release-version"] == "1" and pod["spec"]["nodeName"]
        assert any(e.get("reason") == "Promoted" for e in ns.events())
        # No finalizer: deleting the pair never waits for the operator (test_deleting_a_pair_...).
        assert not obj["metadata"].get("finalizers")
        the_control_listener_takes_only_the_operator(ns, name, obj, pod)

        # A changed spec is a new release, gated and promoted; the old champion becomes previous.
        set_spec(ns, name, {"draft": {"source": "faster-draft"}})
        obj = ns.wait_for("v2 serving", lambda: serving(ns, name, "2"), timeout=120)
        assert obj["status"]["previousVersion"] == "1"
        assert mlflow.get_registered_model(model).aliases == {"candidate": "2", "champion": "2", "previous": "1"}
        ns.wait_for("v1's pod gone", lambda: [p["metadata"]["labels"]["specpair.io/release-version"]
                                              for p in engine_pods(ns)] == ["2"])

        # A release that fails its gate never serves; the condition says which threshold by how much.
        set_spec(ns, name, {"draft": {"source": "bad-draft"}})
        obj = ns.wait_for("v3 gate failed", lambda: (o := ns.pair(name)) and cond(o, "Gated").get("status") == "False"
                          and o["status"].get("phase") == "Degraded" and o)
        msg = cond(obj, "Gated")["message"]
        assert "acceptance 0.200 < minAcceptance 0.500 (short by 0.300)" in msg
        assert "category 'code' acceptance 0.250 < 0.600 (short by 0.350)" in msg
        assert cond(obj, "Ready")["status"] == "False" and cond(obj, "Stalled")["status"] == "True"
        assert obj["status"]["servingVersion"] == "2" and obj["status"]["candidateVersion"] == "3"
        assert mlflow.get_registered_model(model).aliases["champion"] == "2"
        assert [p["metadata"]["labels"]["specpair.io/release-version"] for p in engine_pods(ns)] == ["2"]
        assert mlflow.get_model_version(model, "3").tags["specpair.gate.status"] == "failed"
        assert len(mlflow.search_model_versions(f"name='{model}'")) == 3
        assert ns.events("GateFailed") and len(ns.events("GatePassed")) >= 1

        # Someone with MLflow write access turns v3's failed verdict into a pass: the verdict is
        # not the one v3's gate Job reported (its pod's termination message), so nothing moves.
        forged = {"passed": True, "reasons": [], "greedyIdentity": 1.0, "acceptanceRate": 0.9, "speedup": 2.0,
                  "categories": {"code": {"acceptanceRate": 0.9}}, "tokenizer": {"compatible": True, "differences": []}}
        GateRecord(mlflow_server.url).record_gate(model, "3", forged)
        obj = ns.wait_for("the forged verdict refused", lambda: (o := ns.pair(name)) and
                          cond(o, "Gated").get("reason") == "VerdictMismatch" and o, timeout=60)
        assert "changed after the gate" in cond(obj, "Gated")["message"] and ns.events("VerdictMismatch")
        wait_for_passes(ns, passes, obj["metadata"]["uid"])   # each one could have promoted v3
        assert mlflow.get_registered_model(model).aliases["champion"] == "2"
        assert ns.pair(name)["status"]["servingVersion"] == "2"
        assert set(ns.pair(name)["status"]["verifiedVerdicts"]) >= {"1", "2"}

        # What the operator did, in its Prometheus metrics (the dashboard's promotions panel,
        # gate duration and the serving release's gated speedup).
        metrics = operator_metrics()
        who = {"namespace": ns.name, "pair": name}

        def value(metric: str, **labels: str) -> float | None:
            return metrics.get((metric, frozenset({**who, **labels}.items())))
        assert value("specpair_promotions_total") == 2
        assert value("specpair_gate_duration_seconds_count", result="passed") == 2
        assert value("specpair_gate_duration_seconds_count", result="failed") == 1
        assert 0 < value("specpair_gate_duration_seconds_sum", result="passed") < 600
        assert value("specpair_release_speedup", version="2", category="all") == 1.8
        assert not [k for k in metrics if k[0] == "specpair_release_speedup" and ("pair", name) in k[1]
                    and ("version", "2") not in k[1]], "the previous release's speedup series is gone"
    assert runner.exception is None


def test_restarted_operator_makes_no_duplicates_and_mlflow_outage_recovers(env, mlflow_server):
    ns = env
    name = f"restart-{uuid.uuid4().hex[:5]}"
    model = model_name(ns, name)
    mlflow = MlflowClient(mlflow_server.url)
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(pair(name, "good-draft", rollout=REPLACE))
        # Killed while the gate is running: the Job exists, no verdict yet.
        ns.wait_for("the gate Job", lambda: ns.list("batch/v1", "Job"), timeout=60)
    assert runner.exception is None
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.wait_for("v1 serving after restart", lambda: serving(ns, name, "1"), timeout=120)
        assert len(ns.list("batch/v1", "Job")) == 1 and len(ns.pods("specpair.io/role=gate")) == 1
        assert len(mlflow.search_model_versions(f"name='{model}'")) == 1

        mlflow_server.stop()
        try:
            set_spec(ns, name, {"draft": {"source": "faster-draft"}})
            obj = ns.wait_for("MLflow outage reported",
                              lambda: (o := ns.pair(name)) and cond(o, "Reconciling").get("reason") == "MLflowUnavailable" and o)
            assert obj["status"]["servingVersion"] == "1" and len(ns.list("batch/v1", "Job")) == 1
        finally:
            mlflow_server.start()
        ns.wait_for("v2 serving after the outage", lambda: serving(ns, name, "2"), timeout=150)
        assert len(mlflow.search_model_versions(f"name='{model}'")) == 2
        assert mlflow.get_registered_model(model).aliases["previous"] == "1"
    assert runner.exception is None


def test_configmap_prompts_and_a_tokenizer_mismatch_on_a_pod_roll_back(env, world, mlflow_server):
    """Golden prompts from a ConfigMap make the release; a pod that reports a draft tokenizer
    other than the gated one (over its control listener) has its release rolled back. (Every
    rollback decision, a Deployment past its progress deadline included, is a table in
    test_operator_serving_plan.py.)"""
    ns = env
    name = f"guard-{uuid.uuid4().hex[:5]}"
    model = model_name(ns, name)
    mlflow = MlflowClient(mlflow_server.url)
    prompts = [{"prompt": "class Stack:", "category": "code"}, {"prompt": "Tell me a joke", "category": "chat"},
               {"prompt": "import os", "category": "code"}]
    ns.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "golden"},
               "data": {"prompts.jsonl": "\n".join(json.dumps(p) for p in prompts)}})
    spec = pair(name, "good-draft", rollout=REPLACE)
    spec["spec"]["gating"] = {"configMapRef": {"name": "golden"}, "thresholds": {"minAcceptance": 0.5}}
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(spec)
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)
        released = json.loads(mlflow.get_model_version(model, "1").tags["specpair.release"])
        assert released["gating"]["prompts"] == prompts

        set_spec(ns, name, {"draft": {"source": "faster-draft"}})
        ns.wait_for("v2 serving", lambda: serving(ns, name, "2"), timeout=120)
        # The pod now reports a draft tokenizer that is not the one the release was gated with.
        world.update(_fingerprint_overrides={"faster-draft": "f" * 64})
        obj = ns.wait_for("rolled back on tokenizer mismatch",
                          lambda: (o := ns.pair(name)) and o["status"].get("servingVersion") == "1"
                          and cond(o, "Stalled").get("status") == "True" and o)
        last = [h for h in obj["status"]["history"] if h["action"] == "RolledBack"][-1]
        assert "tokenizer mismatch" in last["reason"] and (last["fromVersion"], last["toVersion"]) == ("2", "1")
        rolled_back = mlflow.get_model_version(model, "2")
        assert "specpair.rolled_back" in rolled_back.tags
        # What a reviewer reads on v2's page: why it lost the champion alias (docs/mlflow.md).
        assert "**rollback**: v2 rolled back (lost the champion alias): " in rolled_back.description
        assert "tokenizer mismatch" in rolled_back.tags["specpair.event.rollback"]
        who = {("namespace", ns.name), ("pair", name)}
        assert operator_metrics().get(("specpair_rollbacks_total", frozenset(who | {("reason", "tokenizer")}))) == 1
        world.update(_fingerprint_overrides={})
    assert runner.exception is None


# -- failing cases the emulator hid (each failed on the operator before this control plane) --------

def test_a_pair_name_of_70_characters_is_served(env):
    ns = env
    # 63 characters then a dash: cut at 63, the name is no valid label value (the API server refuses it).
    name = f"long-{uuid.uuid4().hex[:8]}".ljust(62, "x") + "-" + "y" * 7
    assert len(name) == 70
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(pair(name, "good-draft"))
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)
        (dep,) = ns.list("apps/v1", "Deployment")
        assert len(dep["metadata"]["name"]) <= 63 and dep["metadata"]["labels"]["specpair.io/pair"] != name
    assert runner.exception is None


def test_owned_jobs_and_deployments_wake_their_pair_between_periodic_passes(env, monkeypatch):
    """With the periodic pass an hour away, a new pair is still gated, promoted and served: its
    gate Job finishing and its engine Deployment's pods turning ready wake a pass over it
    (handlers.on_owned_event)."""
    monkeypatch.setenv("SPECPAIR_RECONCILE_INTERVAL", "3600")
    ns = env
    name = f"woken-{uuid.uuid4().hex[:5]}"
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(pair(name, "good-draft"))
        obj = ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)
        assert [h["action"] for h in obj["status"]["history"]] == ["GateStarted", "GatePassed", "Promoted",
                                                                     "RolloutStarted"]
    assert runner.exception is None


def test_a_deployment_the_pair_does_not_own_is_never_touched(env, passes):
    ns = env
    name = f"taken-{uuid.uuid4().hex[:5]}"
    theirs = ns.create({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"{name}-engine"},
                        "spec": {"replicas": 0, "selector": {"matchLabels": {"team": "other"}},
                                 "template": {"metadata": {"labels": {"team": "other"}},
                                              "spec": {"containers": [{"name": "c", "image": "registry.example.com/theirs:1"}]}}}})
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(pair(name, "good-draft"))
        obj = ns.wait_for("name conflict reported", lambda: (o := ns.pair(name)) and
                          cond(o, "Stalled").get("reason") == "NameConflict" and o, timeout=120)
        assert "not owned by SpecModelPair" in cond(obj, "Stalled")["message"]
        assert cond(obj, "Ready")["status"] == "False"
        assert ns.events("NameConflict")
        wait_for_passes(ns, passes, obj["metadata"]["uid"])   # each one could have taken it over
        now = ns.get("apps/v1", "Deployment", f"{name}-engine")
        # Only the Deployment controller has written to it since (its status), never the operator.
        assert now["spec"] == theirs["spec"] and not now["metadata"].get("ownerReferences")
        assert now["metadata"].get("labels") == theirs["metadata"].get("labels")
        assert not any(k.startswith("specpair.io/") for k in now["metadata"].get("annotations") or {})
        writers = {f["manager"] for f in now["metadata"]["managedFields"]} - \
            {f["manager"] for f in theirs["metadata"]["managedFields"]}
        assert writers <= {"kube-controller-manager"}, writers
    assert runner.exception is None


def test_a_gpu_engine_rolls_from_v1_to_v2_on_a_node_with_one_gpu(env):
    ns = env
    name = f"gpu-{uuid.uuid4().hex[:5]}"
    spec = pair(name, "good-draft", rollout={"resources": {"limits": {"nvidia.com/gpu": 1}},
                                             "nodeSelector": {"node.specpair.io/pool": "gpu"},
                                             "progressDeadlineSeconds": 60, **REPLACE})
    spec["spec"]["gating"]["resources"] = {}  # gate on CPU: the engine holds the cluster's one GPU
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(spec)
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)
        set_spec(ns, name, {"draft": {"source": "faster-draft"}})
        obj = ns.wait_for("v2 serving", lambda: serving(ns, name, "2"), timeout=180)
        assert not [h for h in obj["status"]["history"] if h["action"] == "RolledBack"]
        (pod,) = engine_pods(ns)
        assert pod["spec"]["nodeName"] == "devcluster-gpu-1"
        assert pod["metadata"]["labels"]["specpair.io/release-version"] == "2"
    assert runner.exception is None


def narrow_engine_ingress(ns: Namespace, name: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """An operator restarted with the chart's engine.networkPolicy.from set patches the pair's
    engine NetworkPolicy to those peers (and only its own)."""
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "web"}}}]
    monkeypatch.setenv("SPECPAIR_ENGINE_INGRESS_FROM", json.dumps(peers))
    with KopfRunner(OPERATOR, timeout=60) as runner:
        policy = ns.wait_for("engine NetworkPolicy narrowed", lambda: (p := ns.get(
            "networking.k8s.io/v1", "networkpolicies", f"{name}-engine")) and p["spec"]["ingress"][0].get("from") == peers
            and p, timeout=60)
    assert runner.exception is None
    return policy


def test_a_pair_without_an_image_runs_the_installations_behind_network_policies(env, monkeypatch):
    """Behind a private registry: the chart's engine.image and pull secrets reach the pods of a pair
    that names no image (and no default is persisted into the pair); each pair's engine pods take
    ingress on their ports only, its gate pods none, and finished gate Jobs have a TTL."""
    ns = env
    name = f"mirror-{uuid.uuid4().hex[:5]}"
    monkeypatch.setenv("SPECPAIR_ENGINE_IMAGE", STANDIN_IMAGE)
    monkeypatch.setenv("SPECPAIR_IMAGE_PULL_SECRETS", "regcred")
    spec = pair(name, "good-draft")
    del spec["spec"]["rollout"]["image"]
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(spec)
        obj = ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)
        assert "image" not in obj["spec"]["rollout"]
        (pod,) = engine_pods(ns)
        assert pod["spec"]["containers"][0]["image"] == STANDIN_IMAGE
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod["spec"]["automountServiceAccountToken"] is False
        (job,) = ns.list("batch/v1", "Job")
        assert job["spec"]["ttlSecondsAfterFinished"] == 86400
        assert job["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        policies = {p["metadata"]["name"]: p for p in ns.list("networking.k8s.io/v1", "networkpolicies")}
        assert set(policies) == {f"{name}-engine", f"{name}-gate"}
        assert all(p["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"] for p in policies.values())
        assert policies[f"{name}-gate"]["spec"].get("ingress", []) == []
        assert {p["port"] for p in policies[f"{name}-engine"]["spec"]["ingress"][0]["ports"]} == {"grpc", "http", "metrics"}
    assert runner.exception is None
    narrow_engine_ingress(ns, name, monkeypatch)


@pytest.mark.parametrize("change", [
    {"speculation": {"k": 1000}},
    {"speculation": {"k": 0, "fallbackThreshold": 2}},
    {"draft": {"source": "a", "drafter": "ngram"}},
    {"draft": {"drafter": "eagle9"}},
    {"target": {"revision": "main"}},
    {"mlflow": {"modelName": "team/chat"}},
    {"speculation": {"k": "four"}},
    {"engine": "vllm", "speculation": {"treeWidth": 2}},
    {"engine": "vllm", "speculation": {"lookupMinMatch": 2}},
    {"speculation": {"lookupMinMatch": 4}},
])
def test_malformed_pairs_are_refused_by_the_api_server_and_the_operator_in_the_same_words(env, change):
    """The API server refuses a malformed pair with the CRD's messages; the operator's own check
    (for specs that get past an older CRD) finds the same violations and words them the same."""
    bad = pair("malformed", "good-draft")
    bad["spec"].update(change)
    env.assert_refused_in_the_operators_words(bad)


def test_a_release_mlflow_refuses_is_stalled_with_mlflows_reason(env, mlflow_server):
    """MLflow refuses the release's run when the pair's experiment was deleted in its UI (a
    refusal a valid spec can meet: a spec too large for MLflow's tags is refused before, by
    validation): the pair says so (Stalled, an Event) instead of leaving status empty while Kopf
    retries."""
    ns = env
    name = f"refused-{uuid.uuid4().hex[:5]}"
    mlflow = MlflowClient(mlflow_server.url)
    mlflow.delete_experiment(mlflow.create_experiment(gate_experiment(model_name(ns, name))))
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(pair(name, "good-draft"))
        obj = ns.wait_for("MLflow's refusal reported", lambda: (o := ns.pair(name)) and
                          cond(o, "Stalled").get("reason") == "MLflowRejected" and o, timeout=90)
        assert cond(obj, "Stalled")["status"] == "True" and cond(obj, "Ready")["status"] == "False"
        assert "MLflow refused a request" in cond(obj, "Stalled")["message"]
        assert ns.events("MLflowRejected")
    assert runner.exception is None


def test_a_draft_only_release_is_swapped_into_the_running_pods_and_one_they_cannot_swap_rolls_them(env, world):
    draft_swapped_in_place(env, world, "swap")


def test_the_chart_grants_exactly_what_the_operator_uses(env, world, devcluster, mlflow_server, monkeypatch):
    """Least privilege, proven: the operator's requests (audited by the API server) were never
    refused, and every verb the chart grants was used by it in this session."""
    from cluster_env import OPERATOR_ACCOUNT, OPERATOR_NAMESPACE, rendered_rbac_rules

    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"
    ns = env
    seen = {(e["verb"], (e.get("objectRef") or {}).get("resource")) for e in devcluster.audit_events(user)}
    if not {("create", "deployments"), ("get", "configmaps")} <= seen:
        # Run alone, or after tests that roll out without ConfigMap prompts: exercise the whole
        # lifecycle once (gate, promote, roll out, ConfigMap prompts).
        ns.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "golden"},
                   "data": {"prompts.jsonl": json.dumps({"prompt": "def f():", "category": "code"})}})
        spec = pair("rbac", "good-draft", rollout=REPLACE)
        spec["spec"]["gating"] = {"configMapRef": {"name": "golden"}, "thresholds": {"minAcceptance": 0.5}}
        with KopfRunner(OPERATOR, timeout=60) as runner:
            ns.create(spec)
            ns.wait_for("v1 serving", lambda: serving(ns, "rbac", "1"), timeout=120)
            set_spec(ns, "rbac", {"draft": {"source": "faster-draft"}})
            ns.wait_for("v2 serving", lambda: serving(ns, "rbac", "2"), timeout=180)
        assert runner.exception is None
    if not any(e["verb"] == "patch" and e["objectRef"].get("resource") == "networkpolicies"
               for e in devcluster.audit_events(user)):
        # A NetworkPolicy is patched only when the chart's engine.networkPolicy.from changes.
        if ns.get("specpair.io/v1alpha1", "SpecModelPair", "rbac") is None:
            ns.create(pair("rbac", "good-draft"))
            with KopfRunner(OPERATOR, timeout=60) as runner:
                ns.wait_for("v1 serving", lambda: serving(ns, "rbac", "1"), timeout=120)
            assert runner.exception is None
        narrow_engine_ingress(ns, "rbac", monkeypatch)
    if not any(e["verb"] == "patch" and e["objectRef"].get("resource") == "secrets"
               for e in devcluster.audit_events(user)):
        # An engine TLS Secret is patched only when it is issued again (renewal, a new CA, or
        # a pass that died before recording it): forget the record so the operator re-issues.
        if ns.get("specpair.io/v1alpha1", "SpecModelPair", "rbac") is None:
            ns.create(pair("rbac", "good-draft"))
        with KopfRunner(OPERATOR, timeout=60) as runner:
            ns.wait_for("a release serving", lambda: (ns.pair("rbac").get("status") or {}).get("phase") == "Serving"
                        and ns.pair("rbac")["status"].get("engineTLS"), timeout=120)
            ns.kube.patch("specpair.io/v1alpha1", "SpecModelPair", ns.name, "rbac", {"status": {"engineTLS": None}},
                          subresource="status")
            ns.wait_for("the certificate issued again", lambda: ns.pair("rbac")["status"].get("engineTLS"), timeout=60)
        assert runner.exception is None
    if not any(e["verb"] == "watch" and e["objectRef"].get("resource") == "pods"
               for e in devcluster.audit_events(user)):
        # Engine pods are watched once a settled pair's pass asks for them (clients/pod_watch.py):
        # a pair settled, its drift judged every second.
        from specpair_operator.state import STATE
        ns.create(pair("rbac-watch", "good-draft", rollout=REPLACE, drift={"intervalSeconds": 1}))
        with KopfRunner(OPERATOR, timeout=60) as runner:
            ns.wait_for("v1 serving", lambda: serving(ns, "rbac-watch", "1"), timeout=120)
            ns.wait_for("a settled pass's pods from the watch",
                        lambda: any(r.pods_from_watch for r in list(STATE.pass_reads.values())), timeout=60)
        assert runner.exception is None
    if not any(e["verb"] == "create" and e["objectRef"].get("resource") == "leases"
               for e in devcluster.audit_events(user)):
        # Leader election (the chart's default, outside Kopf): a candidate creates the Lease, then
        # hands it back on shutdown (a read and a patch).
        import asyncio

        import kopf

        from specpair_operator import leadership
        from specpair_operator.clients.kube import Kube
        try:
            devcluster.kube.delete("coordination.k8s.io/v1", "leases", OPERATOR_NAMESPACE, OPERATOR_ACCOUNT)
        except ApiError:
            pass

        async def elect() -> None:
            kube = Kube.from_connection_info(kopf.login_with_kubeconfig(settings=kopf.OperatorSettings()))
            elector = leadership.Elector(kube, OPERATOR_NAMESPACE, OPERATOR_ACCOUNT, "audit", leadership.Timing())
            try:
                assert (await elector.try_once()).action == leadership.CREATE
                await elector.release()
            finally:
                await kube.close()
        asyncio.run(elect())
    if not any(e["verb"] == "delete" and e["objectRef"].get("resource") == "scaledobjects"
               for e in devcluster.audit_events(user)):
        # Autoscalers: an HPA, then (KEDA's CRD installed) a ScaledObject, each written, updated
        # and deleted; in a namespace of its own, as the scenario counts its Jobs and Events.
        from autoscaler_scenario import autoscaled_pair_lifecycle
        own = Namespace(devcluster)
        try:
            autoscaled_pair_lifecycle(own, devcluster, mlflow_server.url, monkeypatch, "rbac-autoscaled")
        finally:
            own.delete()
    if not all(any(e["verb"] == verb and e["objectRef"].get("resource") == resource
                   for e in devcluster.audit_events(user))
               for verb, resource in (("patch", "grpcroutes"), ("delete", "grpcroutes"), ("delete", "services"))):
        # A pair naming a Gateway (rollout.gateway): its HTTPRoute and GRPCRoute read and created
        # once v1 serves, patched when the Gateway's listener changes, and deleted with their
        # Service when it names none any more. Gateway API's CRDs are all it needs (no gateway has
        # to run: test_gateway_canary.py runs Traefik).
        from pathlib import Path

        from specpair_devcluster.gateway import DevGateway, gateway_binaries
        from specpair_operator.desired import routes
        DevGateway(devcluster, Path("/nonexistent")).install(gateway_binaries().parent / "crds")
        name = "rbac-routes"
        ns.create(pair(name, "good-draft", rollout={**REPLACE, "gateway": {"parentRef": {"name": "edge"}}}))

        def route(kind: str) -> dict[str, Any]:
            return ns.get(routes.GATEWAY_API, kind, routes.route_name(name)) or {}
        with KopfRunner(OPERATOR, timeout=60) as runner:
            ns.wait_for("v1 serving through its routes", lambda: serving(ns, name, "1") and route("grpcroutes"),
                        timeout=120)
            set_spec(ns, name, {"rollout": {"gateway": {"parentRef": {"name": "edge", "sectionName": "web"}}}})
            ns.wait_for("the routes moved to the listener", lambda: all(
                route(kind).get("spec", {}).get("parentRefs", [{}])[0].get("sectionName") == "web"
                for kind in ("httproutes", "grpcroutes")), timeout=60)
            set_spec(ns, name, {"rollout": {"gateway": None}})
            ns.wait_for("the routes and their Service removed", lambda: not route("httproutes") and
                        not route("grpcroutes") and ns.get("v1", "Service", routes.champion_service_name(name)) is None,
                        timeout=60)
            ns.wait_for("the Routed condition saying so", lambda: any(
                c.get("type") == routes.ROUTED and c.get("reason") == "NoGateway"
                for c in (ns.pair(name).get("status") or {}).get("conditions") or []), timeout=60)
        assert runner.exception is None
    if not any(e["verb"] == "patch" and e["objectRef"].get("resource") == "replicasets"
               for e in devcluster.audit_events(user)):
        # A ReplicaSet is patched only by a promotion in place (a draft-only release swapped into
        # running pods that can swap it).
        draft_swapped_in_place(ns, world, "rbac-swap")
    events = devcluster.audit_events(user)
    # 403 also answers a create in a namespace being deleted (admission, not RBAC): earlier tests'
    # namespaces terminate while later operators still see their pairs.
    refused = {(e["verb"], e["requestURI"]) for e in events if e.get("responseStatus", {}).get("code") == 403
               and "being terminated" not in e["responseStatus"].get("message", "")}
    assert not refused, f"the chart's RBAC refused the operator: {sorted(refused)}"
    used = set()
    for e in events:
        ref = e.get("objectRef") or {}
        resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((ref.get("apiGroup", ""), resource, e["verb"]))
    granted = rendered_rbac_rules()
    unused = sorted(g for g in granted if g not in used)
    assert not unused, f"the chart grants what the operator never used: {unused}; used: {sorted(used)}"


def draft_swapped_in_place(ns: Namespace, world: World, name: str) -> None:
    """A release that changes only the draft, on stand-in pods that can swap it (their
    `_swappable_drafts`): SwapDraft on each pod, then the engine Deployment's template moved to v2
    through its ReplicaSet, with no pod restarted (the same pods, uids and ReplicaSet serve v2);
    then a draft they cannot swap rolls them, as any release (plan/serving_draft_swap.py)."""
    from specpair_operator.desired import manifests

    def pods(version: str = "") -> list[tuple[str, str]]:
        sel = f"{manifests.LABEL_ROLE}=engine,{manifests.LABEL_PAIR}={name}" + \
            (f",{manifests.LABEL_VERSION}={version}" if version else "")
        return sorted((p["metadata"]["name"], p["metadata"]["uid"]) for p in ns.pods(sel)
                      if not p["metadata"].get("deletionTimestamp"))
    world.update(_swappable_drafts=["good-draft", "faster-draft"], **{"unswappable-draft": world.data["good-draft"]})
    spec = pair(name, "good-draft", rollout={**REPLACE, "replicas": 2, "applyGateTuning": False})
    ns.create(spec)
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=300)
        before = pods()
        assert len(before) == 2
        set_spec(ns, name, {"draft": {"source": "faster-draft"}})
        obj = ns.wait_for("v2 serving", lambda: serving(ns, name, "2"), timeout=300)
        assert pods("2") == before
        dep = ns.get("apps/v1", "Deployment", f"{name}-engine")
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert json.loads(annotations["specpair.io/release"])["draft"]["source"] == "faster-draft"
        assert not dep["spec"].get("paused") and "specpair.io/paused-for-draft-swap" not in dep["metadata"]["annotations"]
        [replicaset] = [rs for rs in ns.list("apps/v1", "ReplicaSet") if rs["spec"].get("replicas")
                        and rs["metadata"]["name"].startswith(f"{name}-engine-")]
        assert replicaset["spec"]["template"]["metadata"]["annotations"]["specpair.io/release"] == \
            annotations["specpair.io/release"]
        actions = [(h["action"], h["toVersion"]) for h in obj["status"]["history"]]
        assert ("DraftSwapped", "2") in actions and ("RolloutStarted", "2") not in actions, actions
        assert ns.events("DraftSwapped")
        # A draft the pods cannot swap: refused by the engine, so they roll.
        set_spec(ns, name, {"draft": {"source": "unswappable-draft"}})
        obj = ns.wait_for("v3 rolled out", lambda: (o := ns.pair(name)) and any(
            h["action"] == "RolloutStarted" and h["toVersion"] == "3" for h in o["status"].get("history") or []) and o,
            timeout=300)
        rolled = next(h for h in obj["status"]["history"] if h["action"] == "RolloutStarted" and h["toVersion"] == "3")
        assert "not swapped in place: the engine refused to swap the draft" in rolled["reason"], rolled
        assert ("DraftSwapRefused", "3") in [(h["action"], h["toVersion"]) for h in obj["status"]["history"]]
    assert runner.exception is None


def the_control_listener_takes_only_the_operator(ns: Namespace, name: str, obj: dict[str, Any],
                                                 pod: dict[str, Any]) -> None:
    """Engine pods answer the operator over mutual TLS on their control port, with a certificate
    from the operator's CA for the Service's name; SetSpeculation takes only the operator's
    client certificate, and the serving port refuses it."""
    import base64

    import grpc
    from cluster_env import OPERATOR_NAMESPACE
    from specpair._proto import engine_pb2, engine_pb2_grpc
    from specpair_operator.desired import tls

    st = obj["status"]["engineTLS"]
    assert st["secret"] == f"{name}-engine-tls" and f"{name}-engine.{ns.name}.svc" in st["names"]
    secret = ns.get("v1", "Secret", st["secret"])
    assert secret["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    ca_data = ns.kube.get("v1", "Secret", OPERATOR_NAMESPACE, tls.CA_SECRET)["data"]
    ca = tls.KeyPair(base64.b64decode(ca_data["tls.crt"]), base64.b64decode(ca_data["tls.key"]))
    assert base64.b64decode(secret["data"]["ca.crt"]) == ca.cert_pem and st["caFingerprint"] == tls.fingerprint(ca.cert_pem)
    control, serving_port = f"{pod['status']['podIP']}:50052", f"{pod['status']['podIP']}:50051"
    target = [("grpc.ssl_target_name_override", f"{name}-engine.{ns.name}.svc")]

    def call(channel: grpc.Channel, method: str, request: Any) -> Any:
        with channel:
            return getattr(engine_pb2_grpc.EngineStub(channel), method)(request, timeout=10)

    def mtls(cn: str) -> grpc.Channel:
        client = tls.issue(ca, cn, server=False, days=1)
        return grpc.secure_channel(control, grpc.ssl_channel_credentials(ca.cert_pem, client.key_pem, client.cert_pem),
                                   options=target)

    with pytest.raises(grpc.RpcError):  # plaintext to the control port
        call(grpc.insecure_channel(control), "GetModelInfo", engine_pb2.GetModelInfoRequest())
    with pytest.raises(grpc.RpcError):  # TLS without a client certificate
        call(grpc.secure_channel(control, grpc.ssl_channel_credentials(ca.cert_pem), options=target),
             "GetModelInfo", engine_pb2.GetModelInfoRequest())
    assert call(mtls("specpair-operator"), "GetModelInfo", engine_pb2.GetModelInfoRequest()).pair == name
    assert call(mtls("specpair-operator"), "SetSpeculation", engine_pb2.SetSpeculationRequest(enabled=True)).enabled
    for channel in (mtls("someone-else"), grpc.insecure_channel(serving_port)):
        with pytest.raises(grpc.RpcError) as refused:
            call(channel, "SetSpeculation", engine_pb2.SetSpeculationRequest(enabled=False))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_deleting_a_pair_never_waits_for_the_operator(env, passes):
    """No finalizer on pairs: with the operator stopped (uninstalled, scaled to zero), a deleted
    pair goes at once and the garbage collector takes its children."""
    ns = env
    name = f"bye-{uuid.uuid4().hex[:5]}"
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(pair(name, "good-draft"))
        obj = ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)
        wait_for_passes(ns, passes, obj["metadata"]["uid"])   # none of them adds a finalizer
        assert not ns.pair(name)["metadata"].get("finalizers")
    assert runner.exception is None
    ns.kube.delete("specpair.io/v1alpha1", "SpecModelPair", ns.name, name)
    ns.wait_for("the pair gone", lambda: ns.get("specpair.io/v1alpha1", "SpecModelPair", name) is None, timeout=60)
    ns.wait_for("its Deployment, Service and TLS Secret collected", lambda: all(
        ns.get(api, kind, n) is None for api, kind, n in (("apps/v1", "Deployment", f"{name}-engine"),
                                                          ("v1", "Service", f"{name}-engine"),
                                                          ("v1", "Secret", f"{name}-engine-tls"))), timeout=60)
    assert obj["metadata"]["uid"]


def ready_engine_address(ns: Namespace) -> str | None:
    ready = [p for p in engine_pods(ns) if any(c["type"] == "Ready" and c["status"] == "True"
                                               for c in p["status"].get("conditions", []))]
    return f"{ready[0]['status']['podIP']}:50051" if ready else None


def code_traffic(ns: Namespace, requests: int = 4) -> None:
    """A few 'code' requests to the first ready engine pod (the stand-in answers from the world)."""
    import grpc

    from specpair._proto import engine_pb2, engine_pb2_grpc

    if (a := ready_engine_address(ns)) is None:
        return
    with grpc.insecure_channel(a) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for _ in range(requests):
            try:
                list(stub.Generate(engine_pb2.GenerateRequest(prompt="def f():", max_new_tokens=32, category="code"),
                                   timeout=5))
            except grpc.RpcError:
                return


FAST_DRIFT = {"intervalSeconds": 1, "windowSeconds": 10, "minRequests": 4, "minDraftedTokens": 40,
              "consecutiveBreaches": 1, "probeAfterWindows": 1000, "ladder": ["SpeculationOff"]}


def drifting_pair(world: World, name: str) -> dict[str, Any]:
    """A pair whose draft passes its gate (0.8 on code) and accepts 0.05 live, judged fast."""
    world.update(**{"drifting-draft": {"acceptanceRate": 0.7, "speedup": 1.5, "categories": {"code": 0.8},
                                       "live": {"code": 0.05}}})
    spec = pair(name, "drifting-draft", drift=FAST_DRIFT)
    spec["spec"]["gating"]["thresholds"] = {"minAcceptance": 0.5}
    return spec


def speculating(address: str) -> bool | None:
    """What the engine pod at `address` (its serving port) says about its speculation; None where
    it does not answer within 30 s (a pod just started, or a loaded machine: look again)."""
    import grpc

    from specpair._proto import engine_pb2, engine_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            return engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(),
                                                                    timeout=30).speculation.enabled
    except grpc.RpcError:
        return None


def test_drift_is_judged_while_mlflow_is_down_and_speculation_off_reaches_a_restarted_pod(env, world, mlflow_server):
    """MLflow down does not stop serving, so it must not stop watching: the champion's drift is
    judged on what MLflow said last, and the protective first step (SpeculationOff) is taken
    (anything that needs MLflow waits for it: test_operator_serving_plan.py). After it, a
    replaced pod starts speculating again: the operator turns it off on the next pass (and says
    so), instead of reporting Ready with speculation silently on."""
    ns = env
    name = f"down-{uuid.uuid4().hex[:5]}"
    spec = drifting_pair(world, name)
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(spec)
        # (At load 64-126 here the engine pod was not ready within 120 s.)
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=300)
        mlflow_server.stop()
        try:
            obj = ns.wait_for_during("speculation off with MLflow down", lambda: (o := ns.pair(name)) and
                                     o["status"].get("speculationEnabled") is False and o,
                                     during=lambda: code_traffic(ns), timeout=120)
            assert cond(obj, "Reconciling")["reason"] == "MLflowUnavailable"
            assert cond(obj, "Drifted")["status"] == "True"
            assert [h for h in obj["status"]["history"] if h["action"] == "SpeculationOff"]
        finally:
            mlflow_server.start()
        ns.wait_for("back to normal passes, still off", lambda: (o := ns.pair(name)) and
                    cond(o, "Reconciling").get("reason") != "MLflowUnavailable" and
                    o["status"].get("speculationEnabled") is False and o, timeout=120)
        who = {("namespace", ns.name), ("pair", name)}
        assert operator_metrics().get(("specpair_speculation_off_total", frozenset(who))) == 1

        old = ready_engine_address(ns)
        assert old
        ns.wait_for("the pod saying it does not speculate", lambda: speculating(old) is False, timeout=60)
        (pod,) = engine_pods(ns)
        ns.kube.delete("v1", "Pod", ns.name, pod["metadata"]["name"])
        new = ns.wait_for("a new pod", lambda: (a := ready_engine_address(ns)) and a != old and a, timeout=120)
        ns.wait_for("the new pod told to stop speculating", lambda: speculating(new) is False, timeout=120)
        assert ns.events("SpeculationReconciled")
        assert ns.pair(name)["status"]["speculationEnabled"] is False
    assert runner.exception is None


def test_a_registered_model_belongs_to_one_pair(env, mlflow_server):
    """Two pairs naming the same registered model would move each other's aliases: the second
    is Stalled, saying whose the model is, and the first keeps serving undisturbed."""
    ns = env
    first, second = f"owner-{uuid.uuid4().hex[:5]}", f"claimer-{uuid.uuid4().hex[:5]}"
    shared = f"shared-{uuid.uuid4().hex[:6]}"
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(pair(first, "good-draft", mlflow={"modelName": shared}))
        ns.wait_for("the first pair serving", lambda: serving(ns, first, "1"), timeout=120)
        ns.create(pair(second, "faster-draft", mlflow={"modelName": shared}))
        obj = ns.wait_for("the second pair stalled", lambda: (o := ns.pair(second)) and
                          cond(o, "Stalled").get("reason") == "ModelOwnedByAnotherPair" and o, timeout=60)
        assert f"belongs to SpecModelPair {ns.name}/{first}" in cond(obj, "Stalled")["message"]
        assert ns.events("ModelOwnedByAnotherPair")
        aliases = MlflowClient(mlflow_server.url).get_registered_model(shared).aliases
        assert aliases == {"candidate": "1", "champion": "1"}
        assert serving(ns, first, "1") and not ns.get("apps/v1", "Deployment", f"{second}-engine")
    assert runner.exception is None
