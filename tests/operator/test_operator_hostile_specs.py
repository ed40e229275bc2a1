"""Hostile and broken specs against the operator: references that try to leave the pair's
namespace, gate verdicts that are not verdicts (NaN, Infinity, strings), requests the API server
refuses for good, and pair names that would share child objects.

Decisions are tested as tables (names, request paths, error classes); the rest on the real
control plane with the chart's RBAC, real Kopf, real MLflow and the stand-in gate.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner

from cluster_env import OPERATOR, REPO, Namespace, cond, kubectl, pair
from specpair_operator.crd import names
from specpair_operator.release import content as release
from specpair_operator.clients.kube import Kube, KubeError, _path
from specpair_operator.desired.manifests import METRICS_PORT
from specpair_operator.crd.validation import CEL_EQUIVALENTS, validate_spec

NAN, INF = float("nan"), float("inf")
MODELS = {
    "good-draft": {"acceptanceRate": 0.7, "speedup": 1.6, "categories": {"code": 0.8, "chat": 0.6}, "live": {}},
    # Gates that exit 0 with what the issue found promoted or crashing the pass.
    "nan-draft": {"acceptanceRate": NAN, "speedup": INF, "categories": {"code": 0.8, "chat": 0.6}, "live": {}},
    "string-draft": {"acceptanceRate": 0.7, "speedup": 1.6, "categories": {"code": 0.8, "chat": 0.6}, "live": {},
                     "verdictFields": {"categories": "code: 0.8, chat: 0.6", "tokenizer": "compatible"}},
}


# -- decisions, as tables ------------------------------------------------------------------------

@pytest.mark.parametrize("pair, engine", [
    ("chat", "chat-engine"),                         # a DNS label: kept as it is (no rollout churn)
    ("a-b", "a-b-engine"),
    ("chat-2", "chat-2-engine"),
    # A long label: shortened as before the hash of non-labels existed (the same children).
    ("chat-" + "x" * 60, "chat-" + "x" * 42 + "-11234507-engine"),
    ("a.b", "a-b-2e7336dc-engine"),                  # not a label: sanitized + hash of the real name
    ("1abc", "p-1abc-57cb980e-engine"),              # a label must start with a letter
])
def test_child_names_keep_a_label_and_hash_anything_else(pair, engine):
    assert names.object_name(pair, "engine") == engine


@pytest.mark.parametrize("pair, legacy", [("a.b", "a-b-engine"), ("1abc", "p-1abc-engine"), ("chat", "chat-engine")])
def test_the_legacy_name_is_what_a_non_label_pair_had(pair, legacy):
    assert names.legacy_object_name(pair, "engine") == legacy
    assert (legacy == names.object_name(pair, "engine")) is bool(names.DNS_LABEL.fullmatch(pair))


def test_child_names_are_injective_and_valid():
    """Pairs whose names differ get different children, whatever the sanitizing folds together
    (dots and dashes, a leading digit, a common 200-character prefix)."""
    pairs = ["a.b", "a-b", "a.b.c", "a-b.c", "a.b-c", "a-b-c", "1abc", "p-1abc", "0", "p-0", "x.y", "x-y",
             "chat", "chat.v2", "chat-v2", "a" * 63, "a" * 64, "a" * 200 + ".x", "a" * 200 + "-x",
             "a" * 70 + ".b", "a" * 70 + "-b"]
    for suffix in (("engine",), ("engine-tls",), ("gate",), ("gate", "0123456789")):
        made = [names.object_name(p, *suffix) for p in pairs]
        assert len(set(made)) == len(pairs), [(p, m) for p, m in zip(pairs, made) if made.count(m) > 1]
        for name in made:
            assert len(name) <= names.LABEL_LIMIT and names.DNS_LABEL.fullmatch(name), name


@pytest.mark.parametrize("args, path", [
    (("v1", "configmaps", "ns", "golden"), "/api/v1/namespaces/ns/configmaps/golden"),
    (("apps/v1", "deployments", "ns", "x-engine"), "/apis/apps/v1/namespaces/ns/deployments/x-engine"),
    (("specpair.io/v1alpha1", "specmodelpairs", "ns", "chat", "status"),
     "/apis/specpair.io/v1alpha1/namespaces/ns/specmodelpairs/chat/status"),
    (("v1", "configmaps", "ns", "../../other/configmaps/x"), "/api/v1/namespaces/ns/configmaps/..%2F..%2Fother%2Fconfigmaps%2Fx"),
    (("v1", "configmaps", "a/b", "x?watch=1#y"), "/api/v1/namespaces/a%2Fb/configmaps/x%3Fwatch%3D1%23y"),
    (("v1", "secrets", "ns", "%2e%2e"), "/api/v1/namespaces/ns/secrets/%252e%252e"),
    (("v1", "pods", "ns"), "/api/v1/namespaces/ns/pods"),
])
def test_every_path_segment_is_quoted(args, path):
    assert _path(*args) == path


@pytest.mark.parametrize("name", ["", ".", ".."])
def test_names_that_mean_here_or_up_are_refused_before_any_request(name):
    with pytest.raises(KubeError) as err:
        _path("v1", "configmaps", "ns", name)
    assert err.value.permanent and "is not a valid name" in err.value.message


@pytest.mark.parametrize("status, permanent", [
    (400, True), (403, True), (422, True),
    (0, False), (404, False), (409, False), (429, False), (500, False), (503, False), (504, False),
])
def test_refusals_are_permanent_and_outages_are_not(status, permanent):
    assert KubeError(status, {"message": "m"}).permanent is permanent


def test_the_servers_words_are_the_message():
    assert KubeError(422, {"kind": "Status", "message": "Job.batch \"x\" is invalid"}).message == 'Job.batch "x" is invalid'
    assert KubeError(0, "ClientConnectorError: refused").message == "ClientConnectorError: refused"


def test_every_cel_rule_of_the_crd_has_the_operators_equivalent():
    crd = yaml.safe_load((REPO / "crds" / "specmodelpair.yaml").read_text())

    def rules(schema: Any) -> list[str]:
        if isinstance(schema, dict):
            own = [r["rule"] for r in schema.get("x-kubernetes-validations") or []]
            return own + [r for v in schema.values() for r in rules(v)]
        if isinstance(schema, list):
            return [r for v in schema for r in rules(v)]
        return []
    found = rules(crd["spec"]["versions"][0]["schema"])
    assert found and set(found) == set(CEL_EQUIVALENTS)


@pytest.mark.parametrize("rollout, refused", [
    ({"port": 50051, "httpPort": 8000, "controlPort": 50052}, False),
    ({"port": 50051, "httpPort": 0, "controlPort": 50052}, False),
    ({"port": 50052, "httpPort": 8000, "controlPort": 50052}, True),
    ({"port": 8000, "httpPort": 8000, "controlPort": 50052}, True),
    ({"port": 50051, "httpPort": 50052, "controlPort": 50052}, True),
    ({"port": METRICS_PORT, "httpPort": 8000, "controlPort": 50052}, True),
    ({"port": 50051, "httpPort": METRICS_PORT, "controlPort": 50052}, True),
    ({"port": 50051, "httpPort": 8000, "controlPort": METRICS_PORT}, True),
])
def test_port_collisions_are_refused_by_the_operators_check(rollout, refused):
    errors = validate_spec({"target": {"source": "default"}, "draft": {"drafter": "ngram"}, "rollout": rollout})
    assert bool(errors) is refused and all(e.startswith("spec.rollout: Invalid value: rollout.") for e in errors)


def _one_pass(monkeypatch, spec: dict[str, Any]) -> dict[str, Any]:
    """One reconcile pass over a pair with `spec`, the operator's client pointed at a port where
    nothing listens (every request fails: a read would show in the outcome); the conditions."""
    import logging
    import socket

    import kopf

    from specpair_operator.act.reconciler import PairReconciler
    from specpair_operator.state import STATE

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    body = {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair",
            "metadata": {"name": "p", "namespace": "ns", "uid": f"u-{uuid.uuid4().hex}", "generation": 1},
            "spec": spec, "status": {}}
    patch = kopf.Patch()

    async def run() -> None:
        kube = Kube(f"http://127.0.0.1:{port}", timeout_s=5)
        monkeypatch.setattr(STATE, "kube", kube)
        try:
            await PairReconciler(kopf.Body(body), patch, logging.getLogger("test")).reconcile()
        finally:
            await kube.close()
    asyncio.run(run())
    return {c["type"]: c for c in patch.status["conditions"]}


def test_a_bad_reference_past_an_older_crd_is_stalled_before_anything_is_read(monkeypatch):
    conds = _one_pass(monkeypatch, {"target": {"source": "default"}, "draft": {"drafter": "ngram"},
                                    "gating": {"configMapRef": {"name": "../../kube-system/configmaps/coredns"}}})
    assert conds["Stalled"]["status"] == "True" and conds["Stalled"]["reason"] == "InvalidSpec"
    assert 'spec.gating.configMapRef.name: Invalid value: "../../kube-system/configmaps/coredns"' \
        in conds["Stalled"]["message"]
    assert conds["Reconciling"]["status"] == "False"


def test_an_api_server_that_does_not_answer_is_retried_not_stalled(monkeypatch):
    conds = _one_pass(monkeypatch, {"target": {"source": "default"}, "draft": {"drafter": "ngram"},
                                    "gating": {"configMapRef": {"name": "golden"}}})
    assert conds["Reconciling"]["status"] == "True" and conds["Reconciling"]["reason"] == "KubernetesAPIError"
    assert "no answer from the API server" in conds["Reconciling"]["message"]
    assert "Stalled" not in conds or conds["Stalled"]["status"] == "False"


def test_a_verdict_tag_nested_too_deeply_for_json_reads_as_no_verdict(mlflow_server):
    """A tag anyone with MLflow access may write: 2,400 nested lists (MLflow stores it) make
    Python's JSON reader raise RecursionError; the verdict reads as absent, a GateError."""
    from specpair_operator.gate.verdict import evaluate_verdict
    from specpair_operator.clients.registry import ReleaseRegistry
    from specpair_operator.release.registry_contract import TAG_GATE_STATUS, TAG_GATE_VERDICT

    reg = ReleaseRegistry(mlflow_server.url)
    model = f"deep-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/deep")
    rel = release.build_release("deep", "ns", {"target": {"source": "default"}, "draft": {"drafter": "ngram"}},
                                [{"prompt": "a", "category": "code"}])
    version = reg.ensure_release(model, rel, release.content_hash(rel))
    reg.set_tags(model, version, {TAG_GATE_VERDICT: "[" * 2400 + "]" * 2400, TAG_GATE_STATUS: "passed"})
    status, verdict, _ = reg.gate_result(model, version)
    assert status == "passed" and verdict is None
    assert evaluate_verdict(verdict or {}, {}).reason == "GateError"


# -- on the real control plane --------------------------------------------------------------------

@pytest.fixture
def env(env, world):
    """The shared model world with this module's verdicts that are not verdicts (NaN, strings)."""
    world.update(**MODELS)
    return env


def code_pair(name: str, draft: str, **spec: Any) -> dict[str, Any]:
    """A pair gated on one code prompt."""
    gating = {"prompts": [{"prompt": "def fib(n):", "category": "code"}],
              "thresholds": {"minAcceptance": 0.5, "minCategoryAcceptance": {"code": 0.6}}}
    return pair(name, draft, **{"gating": gating, **spec})


@pytest.mark.parametrize("change", [
    {"gating": {"configMapRef": {"name": "../../kube-system/configmaps/coredns"}}},
    {"gating": {"configMapRef": {"name": "golden/../x"}}},
    {"gating": {"configMapRef": {"name": "Golden"}}},
    {"gating": {"configMapRef": {"name": "golden", "key": "../prompts"}}},
    {"gating": {"configMapRef": {"name": "g" * 254}}},
    {"mlflow": {"credentialsSecretRef": {"name": "../specpair-system/secrets/specpair-ca"}}},
    {"mlflow": {"credentialsSecretRef": {"name": "creds", "tokenKey": "a/b"}}},
    {"rollout": {"modelCache": {"hubTokenSecretRef": {"name": "hub token"}}}},
    {"rollout": {"modelCache": {"persistentVolumeClaim": ".."}}},
    {"rollout": {"port": 50052}},
    {"rollout": {"httpPort": METRICS_PORT}},
    {"drift": {"latency": {"ttftP95Ratio": 1.0, "maxErrorRate": 1.0}}},
    {"drift": {"latency": {"tpotP95Ratio": 0.5, "minRequests": 5}}},
    {"gating": {"tuning": {"kValues": [0, 17]}}},
    {"gating": {"tuning": {"batchSizes": list(range(1, 10))}}},
    # Model sources the model-cache fill Job would read outside the cache with (issue 54).
    {"target": {"source": "mlflow:file:///var/run/secrets"}},
    {"target": {"source": "mlflow:/etc"}},
    {"draft": {"source": "mlflow:."}},
    {"draft": {"source": "mlflow:.."}},
    {"target": {"source": "models:/chat/../other"}},
    # A token Secret that is another pair's certificate, the CA, a key file, or another namespace's.
    {"rollout": {"auth": {"tokenSecretRef": {"name": "other-engine-tls", "key": "tls.key"}}}},
    {"rollout": {"auth": {"tokenSecretRef": {"name": "specpair-operator-ca"}}}},
    {"rollout": {"auth": {"tokenSecretRef": {"name": "serving-token", "key": "ca.crt"}}}},
    {"rollout": {"auth": {"tokenSecretRef": {"name": "serving-token", "namespace": "kube-system"}}}},
    # Captured traffic (spec.learning, issue 58): somewhere to keep it, a rate that draws, a claim in the namespace.
    {"learning": {"enabled": True}},
    {"learning": {"enabled": True, "persistentVolumeClaim": "traffic", "sampleRate": 0}},
    {"learning": {"persistentVolumeClaim": "../traffic", "retentionSeconds": 10, "perCategoryCap": 0}},
    # A training schedule: only where traffic is captured, at most hourly, naming what it trains.
    {"learning": {"schedule": {"intervalSeconds": 60, "categories": []}}},
])
def test_references_and_ports_are_refused_by_the_api_server_and_the_operator_in_the_same_words(env, change):
    """Nothing a pair names can leave its namespace: the API server refuses such a pair, and the
    operator's own check (for a pair that got past an older CRD: InvalidSpec, before any read)
    finds the same violations in the same words."""
    ns = env
    bad = code_pair("hostile", "good-draft")
    for key, value in change.items():
        bad["spec"][key] = {**bad["spec"].get(key, {}), **value}
    ns.assert_refused_in_the_operators_words(bad)
    assert ns.pair("hostile") == {}


def test_kubectl_apply_refuses_a_serving_port_on_the_metrics_port(env, devcluster):
    ns = env
    bad = code_pair("ports", "good-draft", rollout={"port": METRICS_PORT})
    bad["metadata"]["namespace"] = ns.name
    done = kubectl(devcluster, "apply", "-f", "-", input=json.dumps(bad))
    assert done.returncode != 0
    assert f"rollout.port must differ from rollout.httpPort and the metrics port {METRICS_PORT}" in done.stderr
    assert ns.pair("ports") == {}


def test_the_api_server_defaults_learning_off_and_keeps_a_capturing_spec_as_given(env, devcluster):
    """spec.learning as the API server stores it (a server-side dry run: nothing is made): off
    and not kept when absent; given, only `keepOnDelete` is added (the capture's own defaults are
    the engine's, desired/learning.py)."""
    ns = env
    given = {"enabled": True, "persistentVolumeClaim": "traffic", "sampleRate": 0.5,
             "schedule": {"intervalSeconds": 86400, "categories": ["code"]}}
    for learning, stored in ((None, {"enabled": False, "keepOnDelete": False}), (given, {**given, "keepOnDelete": False})):
        good = code_pair("learning", "good-draft", **({"learning": learning} if learning else {}))
        good["metadata"]["namespace"] = ns.name
        done = kubectl(devcluster, "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(good))
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["spec"]["learning"] == stored
    assert ns.pair("learning") == {}


def test_the_operators_client_reads_only_in_the_namespace_it_names(env, devcluster, monkeypatch):
    """The issue's traversal through the operator's client, logged in as the cluster's admin so
    that RBAC refuses nothing: a name with '/' in it stays one name in the namespace the request
    names, so another namespace's ConfigMap is neither read nor found to exist."""
    import kopf

    ns = env
    monkeypatch.setenv("KUBECONFIG", str(devcluster.kubeconfig))
    other = Namespace(devcluster)
    try:
        other.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "private"},
                      "data": {"prompts.jsonl": json.dumps({"prompt": "secret"})}})

        async def look() -> list[Any]:
            kube = Kube.from_connection_info(kopf.login_with_kubeconfig(settings=kopf.OperatorSettings()))
            try:
                straight = await kube.get("v1", "configmaps", other.name, "private")
                seen = [straight is not None]
                for name in (f"../../{other.name}/configmaps/private", f"..%2F..%2F{other.name}%2Fconfigmaps%2Fprivate"):
                    try:
                        seen.append(await kube.get("v1", "configmaps", ns.name, name))
                    except KubeError as exc:
                        seen.append(exc.status)
                return seen
            finally:
                await kube.close()
        found = asyncio.run(look())
        # The client reads it where it is asked for by its namespace ...
        assert found[0] is True
        # ... and never through a name in another namespace's path: not found, or refused.
        assert all(seen is None or seen in (400, 404) for seen in found[1:]), found
    finally:
        other.delete()


def test_an_invalid_quantity_is_stalled_with_the_api_servers_message(env):
    """A permanent refusal (422) when creating an owned object is Stalled with the server's
    words and an Event, not Reconciling for ever; a fixed spec goes on at once."""
    ns = env
    name = f"quantity-{uuid.uuid4().hex[:5]}"
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(code_pair(name, "good-draft", rollout={"resources": {"limits": {"cpu": "lots"}}}))
        obj = ns.wait_for("the refusal reported", lambda: (o := ns.pair(name)) and
                          cond(o, "Stalled").get("reason") == "KubernetesAPIRefused" and o, timeout=90)
        msg = cond(obj, "Stalled")["message"]
        assert cond(obj, "Stalled")["status"] == "True" and cond(obj, "Reconciling")["status"] == "False"
        assert "quantities must match the regular expression" in msg, msg
        assert obj["status"]["phase"] == "Failed" and cond(obj, "Ready")["status"] == "False"
        assert ns.events("KubernetesAPIRefused") and not ns.list("batch/v1", "Job")
        ns.patch("specpair.io/v1alpha1", "SpecModelPair", name,
                 {"spec": {"rollout": {"resources": {"limits": {"cpu": "1"}}}}})
        ns.wait_for("the fixed spec gated", lambda: ns.list("batch/v1", "Job") and
                    cond(ns.pair(name), "Stalled").get("status") == "False", timeout=90)
    assert runner.exception is None


def test_a_nan_verdict_and_a_string_typed_verdict_are_never_promoted(env, mlflow_server):
    """Gates that exit 0 with acceptance NaN and speedup Infinity (NaN passes every threshold),
    or with categories and tokenizer as strings: each is a GateError naming what is wrong, and
    nothing is promoted or rolled out. The same verdict put into MLflow as a pass (an older gate
    runner, or anyone with MLflow access) is refused by the operator alike."""
    from mlflow import MlflowClient

    from specpair_operator.gate.record import GateRecord

    ns = env
    mlflow = MlflowClient(mlflow_server.url)
    nan_pair, str_pair = f"nan-{uuid.uuid4().hex[:5]}", f"str-{uuid.uuid4().hex[:5]}"

    def gate_error(name: str, start: str) -> Any:
        return lambda: (o := ns.pair(name)) and cond(o, "Gated").get("reason") == "GateError" \
            and cond(o, "Gated")["message"].startswith(start) and o

    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(code_pair(nan_pair, "nan-draft"))
        ns.create(code_pair(str_pair, "string-draft"))
        for name, problems in ((nan_pair, ["acceptanceRate is NaN, must be a finite number in [0, 1]",
                                           "speedup is Infinity, must be a finite number > 0"]),
                               (str_pair, ['categories is "code: 0.8, chat: 0.6", must be a mapping',
                                           'tokenizer is "compatible", must be a mapping'])):
            obj = ns.wait_for(f"{name}'s gate error",
                              gate_error(name, "gate of v1 errored: the gate's verdict is unusable: "), timeout=120)
            for problem in problems:
                assert problem in cond(obj, "Gated")["message"]
            assert cond(obj, "Stalled")["status"] == "True" and obj["status"]["phase"] == "Failed"
            model = release.effective_model_name(name, ns.name, {})
            assert "champion" not in mlflow.get_registered_model(model).aliases
            assert mlflow.get_model_version(model, "1").tags["specpair.gate.status"] == "error"
            assert [h["action"] for h in obj["status"]["history"]] == ["GateStarted", "GateError"]

        # The NaN verdict written into MLflow as a pass: the operator's own schema refuses it.
        model = release.effective_model_name(nan_pair, ns.name, {})
        forged = {"passed": True, "reasons": [], "greedyIdentity": 1.0, "acceptanceRate": NAN, "speedup": INF,
                  "categories": {"code": {"acceptanceRate": 0.8}}, "tokenizer": {"compatible": True, "differences": []}}
        GateRecord(mlflow_server.url).record_gate(model, "1", forged)
        obj = ns.wait_for("the forged NaN verdict refused",
                          gate_error(nan_pair, "v1: the gate's verdict is unusable: acceptanceRate is NaN"), timeout=60)
        assert obj["status"]["lastGate"].get("acceptanceRate") is None and "speedup" not in obj["status"]
        assert "champion" not in mlflow.get_registered_model(model).aliases
        assert ns.get("apps/v1", "Deployment", f"{nan_pair}-engine") is None
        assert ns.get("apps/v1", "Deployment", f"{str_pair}-engine") is None
        assert not ns.events("Promoted") and not ns.events("RolloutStarted") and ns.events("GateError")
    assert runner.exception is None
    assert "invalid JSON patch" not in runner.stdout


def test_a_dotted_pair_serves_from_its_hashed_name_and_retires_its_legacy_engine(env):
    """`a.b` and `a-b` no longer share children: a dotted pair's engine is `<a-b>-<hash>-engine`.
    A Deployment it owns under the name it had before (`a-b-engine`) is scaled to zero once the
    current one is available, so that only the current pods serve; once a person deletes it, a
    pair named `a-b` is served beside the dotted one."""
    ns = env
    dotted = f"chat.{uuid.uuid4().hex[:5]}"
    dashed = dotted.replace(".", "-")
    with KopfRunner(OPERATOR, timeout=60) as runner:
        obj = ns.create(code_pair(dotted, "good-draft"))
        legacy = names.legacy_object_name(dotted, "engine")
        ns.create({"apiVersion": "apps/v1", "kind": "Deployment",
                   "metadata": {"name": legacy, "ownerReferences": [
                       {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "name": dotted,
                        "uid": obj["metadata"]["uid"], "controller": True}]},
                   "spec": {"replicas": 1, "selector": {"matchLabels": {"app": legacy}},
                            "template": {"metadata": {"labels": {"app": legacy}},
                                         "spec": {"containers": [{"name": "c", "image": "registry.example.com/old:1"}]}}}})
        current = names.object_name(dotted, "engine")
        assert current != legacy == names.object_name(dashed, "engine") and current.startswith(dashed + "-")
        ns.wait_for("the legacy engine scaled to 0", lambda: (ns.get("apps/v1", "Deployment", legacy) or {})
                    .get("spec", {}).get("replicas") == 0 and ns.events("LegacyEngineRetired"), timeout=150)
        ns.wait_for(f"{dotted} ready", lambda: cond(ns.pair(dotted), "Ready").get("status") == "True", timeout=120)
        assert ns.get("apps/v1", "Deployment", current)["spec"]["replicas"] == 1

        ns.kube.delete("apps/v1", "Deployment", ns.name, legacy)
        # Other ports: the devcluster's one node runs both pairs' engines as local processes.
        ns.create(code_pair(dashed, "good-draft", rollout={"port": 50061, "controlPort": 50062, "httpPort": 8010}))
        ns.wait_for(f"{dashed} ready", lambda: cond(ns.pair(dashed), "Ready").get("status") == "True", timeout=150)
        assert {d["metadata"]["name"] for d in ns.list("apps/v1", "Deployment")
                if not d["metadata"].get("deletionTimestamp")} == {current, legacy}
        assert cond(ns.pair(dotted), "Ready").get("status") == "True"
    assert runner.exception is None
