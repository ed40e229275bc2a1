"""Pure decisions of the operator: releases, verdicts, aliases, drift, conditions, manifests."""

import json
from pathlib import Path

import kubernetes_validate
import pytest
from specpair import vllm_serve

from specpair_operator.release import aliases, content as release
from specpair_operator.crd import conditions
from specpair_operator.policy import drift
from specpair_operator.gate import verdict as gate_verdict
from specpair_operator.desired import engine_objects, gate_objects, manifests

SPEC = {
    "target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "abc123"},
    "draft": {"drafter": "ngram"},
    "speculation": {"k": 5},
    "gating": {"thresholds": {"minAcceptance": 0.3, "minCategoryAcceptance": {"code": 0.4}}},
    "rollout": {"replicas": 2},
}
PROMPTS = [{"prompt": "def f(x):", "category": "code"}, {"prompt": "Hello"}]


def test_same_spec_same_hash_and_rollout_changes_do_not_make_a_release():
    a = release.build_release("p", "ns", SPEC, PROMPTS)
    b = release.build_release("other", "ns2", {**SPEC, "rollout": {"replicas": 7, "nodeSelector": {"a": "b"}},
                                               "drift": {"tolerance": 0.3}}, PROMPTS)
    assert release.content_hash(a) == release.content_hash(b)
    assert a["engine"] == {"image": release.ENGINE_IMAGE}
    assert a["speculation"] == {"k": 5, "dynamicK": True, "fallbackThreshold": 0.5, "batchSizeThreshold": 8}
    assert a["gating"]["prompts"][1]["category"] == "general"
    assert a["draft"] == {"drafter": "ngram"}


@pytest.mark.parametrize("change", [
    {"speculation": {"k": 6}},
    {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "def456"}},
    {"draft": {"source": "some/draft"}},
    {"gating": {"thresholds": {"minAcceptance": 0.31}}},
    # A new engine image is new code: it is a new release and is gated again.
    {"rollout": {"replicas": 2, "image": "registry.example.com/specpair/engine:0.2.0"}},
])
def test_changed_content_changes_the_hash(change):
    base = release.content_hash(release.build_release("p", "ns", SPEC, PROMPTS))
    assert release.content_hash(release.build_release("p", "ns", {**SPEC, **change}, PROMPTS)) != base
    assert release.content_hash(release.build_release("p", "ns", SPEC, PROMPTS[:1])) != base


def test_gate_tuning_is_in_a_release_only_where_the_spec_sets_it():
    """A pair without gating.tuning makes the release it made before tuning existed (same
    hash); one that sets it carries what it set, in one order, and the gate fills in the rest."""
    from specpair.contract import TUNING_DEFAULTS, gate_tuning

    plain = release.build_release("p", "ns", SPEC, PROMPTS)
    assert "tuning" not in plain["gating"]
    assert gate_tuning(plain) == {key: list(values) for key, values in TUNING_DEFAULTS.items()}
    empty = {**SPEC, "gating": {**SPEC["gating"], "tuning": {}}}
    assert release.content_hash(release.build_release("p", "ns", empty, PROMPTS)) == release.content_hash(plain)
    tuned = {**SPEC, "gating": {**SPEC["gating"], "tuning": {"kValues": [4, 2, 4], "batchSizes": []}}}
    rel = release.build_release("p", "ns", tuned, PROMPTS)
    assert rel["gating"]["tuning"] == {"kValues": [2, 4], "batchSizes": []}
    assert release.content_hash(rel) != release.content_hash(plain)
    assert gate_tuning(rel) == {"kValues": [2, 4], "batchSizes": []}
    only_k = {**SPEC, "gating": {**SPEC["gating"], "tuning": {"kValues": [3]}}}
    assert gate_tuning(release.build_release("p", "ns", only_k, PROMPTS)) == \
        {"kValues": [3], "batchSizes": list(TUNING_DEFAULTS["batchSizes"])}


def test_model_name_defaults_and_tags_and_description():
    assert release.effective_model_name("p", "ns", SPEC) == "ns.p"
    assert release.effective_model_name("p", "ns", {"mlflow": {"modelName": "m"}}) == "m"
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    digest = release.content_hash(rel)
    tags = release.release_tags(rel, digest)
    assert tags["specpair.content_hash"] == digest and tags["specpair.draft.drafter"] == "ngram"
    assert all(isinstance(v, str) for v in tags.values())
    text = release.describe_release(rel, digest)
    assert "abc123" in text and "n-gram" not in text and "ngram" in text and "code >= 0.4" in text
    gated = release.with_mlflow(rel, "http://m", "ns.p", 3)
    assert gated["mlflow"]["version"] == "3" and release.content_hash(gated) == digest


def test_prompt_lines_parse_jsonl_and_array_and_reject_garbage():
    assert release.parse_prompt_lines('{"prompt": "a", "category": "c"}\n\n{"prompt": "b"}\n') == [
        {"prompt": "a", "category": "c"}, {"prompt": "b", "category": "general"}]
    assert release.parse_prompt_lines('[{"prompt": "a"}]') == [{"prompt": "a", "category": "general"}]
    with pytest.raises(ValueError):
        release.parse_prompt_lines('{"text": "a"}')


GOOD = {"passed": True, "reasons": [], "tokenizer": {"compatible": True, "differences": []},
        "greedyIdentity": 1.0, "acceptanceRate": 0.7, "speedup": 1.4,
        "categories": {"code": {"acceptanceRate": 0.8}, "chat": {"acceptanceRate": 0.5}}}
TH = {"requireGreedyIdentity": True, "minAcceptance": 0.5, "minCategoryAcceptance": {"code": 0.6}, "minSpeedup": 1.1}


def test_passing_verdict():
    out = gate_verdict.evaluate_verdict(GOOD, TH)
    assert out.passed and out.reason == "GatePassed" and "speedup 1.40x" in out.message
    assert gate_verdict.baseline_from_verdict(GOOD) == {"*": 0.7, "code": 0.8, "chat": 0.5}


def test_operator_rechecks_thresholds_even_if_gate_said_pass():
    lax = {**GOOD, "acceptanceRate": 0.42, "speedup": 0.9, "categories": {"code": {"acceptanceRate": 0.55}}}
    out = gate_verdict.evaluate_verdict(lax, TH)
    assert not out.passed and out.reason == "ThresholdsNotMet"
    assert "acceptance 0.420 < minAcceptance 0.500 (short by 0.080)" in out.message
    assert "category 'code' acceptance 0.550 < 0.600 (short by 0.050)" in out.message
    assert "speedup 0.900x < minSpeedup 1.100x (short by 0.200x)" in out.message


def test_identity_failure_and_tokenizer_mismatch_and_garbage():
    out = gate_verdict.evaluate_verdict({**GOOD, "passed": False, "greedyIdentity": 0.9, "reasons": ["identity 0.9"]}, TH)
    assert not out.passed and "identity 0.9" in out.failures and any("greedy identity 0.900" in f for f in out.failures)
    tok = {**GOOD, "passed": False, "tokenizer": {"compatible": False, "differences": ["vocab size 49152 != 32000"]}}
    out = gate_verdict.evaluate_verdict(tok, TH)
    assert out.reason == "TokenizerMismatch" and out.tokenizer_compatible is False and "49152 != 32000" in out.message
    assert gate_verdict.evaluate_verdict({"passed": "yes"}, TH).reason == "GateError"


def test_promotion_moves_previous_before_champion_and_is_idempotent():
    assert aliases.plan_promotion({}, "1") == [aliases.AliasMove("champion", "1")]
    moves = aliases.plan_promotion({"champion": "1", "candidate": "2"}, "2")
    assert moves == [aliases.AliasMove("previous", "1"), aliases.AliasMove("champion", "2")]
    # killed after the first move: redoing finishes the job without touching previous again
    assert aliases.plan_promotion({"champion": "1", "previous": "1"}, "2") == [aliases.AliasMove("champion", "2")]
    assert aliases.plan_promotion({"champion": "2", "previous": "1"}, "2") == []


def test_rollback_goes_to_previous_once():
    assert aliases.plan_rollback({"champion": "2", "previous": "1"}) == [aliases.AliasMove("champion", "1")]
    assert aliases.plan_rollback({"champion": "1", "previous": "1"}) == []
    assert aliases.rollback_target({"champion": "1"}) is None


# The drift decision itself (windows, bounds, ladder, rollback rule): test_drift_policy.py.


def test_fingerprint_mismatch_ignores_unknown_sides():
    assert drift.fingerprint_mismatch({"target": "a" * 64, "draft": None}, {"target": "a" * 64, "draft": "b" * 64}) == []
    msg = drift.fingerprint_mismatch({"target": "a" * 64, "draft": "c" * 64}, {"target": "a" * 64, "draft": "b" * 64})
    assert msg == ["draft tokenizer fingerprint bbbbbbbbbbbb != released cccccccccccc"]


def test_conditions_keep_transition_time_unless_status_flips():
    c = conditions.set_condition([], "Ready", False, "Gating", "m", 1, now="t1")
    c = conditions.set_condition(c, "Ready", False, "Gating", "m2", 2, now="t2")
    assert c[0]["lastTransitionTime"] == "t1" and c[0]["observedGeneration"] == 2 and c[0]["message"] == "m2"
    c = conditions.set_condition(c, "Ready", True, "Serving", "ok", 2, now="t3")
    assert c[0]["lastTransitionTime"] == "t3" and c[0]["status"] == "True"
    c = conditions.summary(c, 2, ready=(True, "A", ""), reconciling=(False, "B", ""), stalled=(False, "C", ""))
    assert [x["type"] for x in c] == ["Ready", "Reconciling", "Stalled"]


def test_manifests_validate_against_kubernetes_schemas_and_run_unprivileged():
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    digest = release.content_hash(rel)
    rollout = {"replicas": 2, "image": "img:1", "resources": {"limits": {"nvidia.com/gpu": 1}},
               "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}], "port": 6000}
    job = gate_objects.gate_job("p", "ns", rel, digest, "3", rollout, "http://mlflow:5000")
    dep = engine_objects.engine_deployment("p", "ns", rel, digest, "3", rollout, "http://mlflow:5000")
    svc = engine_objects.engine_service("p", "ns", rollout)
    installation = manifests.MlflowCredentials.from_env({"SPECPAIR_MLFLOW_CREDENTIALS_SECRET": "mlflow-creds"})
    with_secret = gate_objects.gate_job("p", "ns", rel, digest, "3", rollout, "http://mlflow:5000", credentials=installation)
    kubernetes_validate.validate(with_secret, "1.33.0", strict=True)
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in with_secret["spec"]["template"]["spec"]["containers"][0]["env"]
            if "valueFrom" in e}
    # Not optional: a missing Secret stops the pod with a reason instead of an unauthenticated gate.
    assert refs == {"MLFLOW_TRACKING_USERNAME": {"name": "mlflow-creds", "key": "username"},
                    "MLFLOW_TRACKING_PASSWORD": {"name": "mlflow-creds", "key": "password"}}
    for obj in (job, dep, svc):
        kubernetes_validate.validate(obj, "1.33.0", strict=True)
    for obj in (job, dep):
        pod = obj["spec"]["template"]
        assert json.loads(pod["metadata"]["annotations"][manifests.ANN_RELEASE]) == rel
        c = pod["spec"]["containers"][0]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert job["spec"]["backoffLimit"] == 0 and len(job["metadata"]["name"]) <= 63
    long_a, long_b = "a" * 60 + "-one", "a" * 60 + "-two"
    for make in (lambda p: manifests.gate_job_name(p, digest), manifests.engine_name,
                 lambda p: manifests.engine_selector(p)[manifests.LABEL_PAIR]):
        made = {make(long_a), make(long_b)}
        assert len(made) == 2 and all(len(n) <= 63 and n[-1].isalnum() for n in made)
    assert manifests.engine_name("a.b") != manifests.engine_name("a-b") == "a-b-engine"
    assert manifests.engine_name("9x").startswith("p-9x-") and manifests.engine_name("9x") != "p-9x-engine"
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    # What is served is the release file the pod mounts (the annotation), not command-line copies.
    tls_dir = manifests.TLS_DIR
    assert cmd == ["specpair", "engine", "serve", "--release", manifests.RELEASE_FILE, "--port", "6000",
                   "--metrics-port", str(manifests.METRICS_PORT), "--http-port", str(manifests.HTTP_PORT), "--insecure",
                   "--control-port", str(manifests.CONTROL_PORT), "--control-tls-cert", f"{tls_dir}/tls.crt",
                   "--control-tls-key", f"{tls_dir}/tls.key", "--control-tls-client-ca", f"{tls_dir}/ca.crt",
                   # rollout.shutdown's defaults (the CRD): serve 5 s unready, then drain up to 30 s
                   "--stop-delay", "5", "--drain-timeout", "30"]
    # The control listener's certificate comes from the pair's TLS Secret, mounted read-only.
    pod_spec = dep["spec"]["template"]["spec"]
    (tls_volume,) = [v for v in pod_spec["volumes"] if v["name"] == "tls"]
    assert tls_volume["secret"]["secretName"] == manifests.engine_tls_secret_name("p") == "p-engine-tls"
    assert {"name": "tls", "mountPath": tls_dir, "readOnly": True} in pod_spec["containers"][0]["volumeMounts"]
    # The OpenAI-compatible HTTP API: a named container port the Service exposes; httpPort 0 turns it off.
    # The control port is not in the Service: the operator dials each pod.
    ports = {p["name"]: p["containerPort"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"grpc": 6000, "metrics": manifests.METRICS_PORT, "http": manifests.HTTP_PORT,
                     "control": manifests.CONTROL_PORT}
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == \
        {"grpc": (6000, "grpc"), "metrics": (manifests.METRICS_PORT, "metrics"), "http": (manifests.HTTP_PORT, "http")}
    off = {**rollout, "httpPort": 0}
    dep_off = engine_objects.engine_deployment("p", "ns", rel, digest, "3", off, "http://mlflow:5000")
    container = dep_off["spec"]["template"]["spec"]["containers"][0]
    assert "--http-port" not in container["command"] and "http" not in {p["name"] for p in container["ports"]}
    assert "http" not in {p["name"] for p in engine_objects.engine_service("p", "ns", off)["spec"]["ports"]}
    assert set(dep["spec"]["selector"]["matchLabels"].items()) <= set(dep["spec"]["template"]["metadata"]["labels"].items())


def test_deployment_rollout_state():
    dep = {"metadata": {"generation": 2, "annotations": {manifests.ANN_HASH: "h"}}, "spec": {"replicas": 2},
           "status": {"observedGeneration": 1}}
    assert engine_objects.deployment_rollout_state(None, "h")[0] == "absent"
    assert engine_objects.deployment_rollout_state(dep, "other")[0] == "progressing"
    assert engine_objects.deployment_rollout_state(dep, "h")[0] == "progressing"
    dep["status"] = {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2}
    assert engine_objects.deployment_rollout_state(dep, "h")[0] == "available"
    dep["status"]["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]
    assert engine_objects.deployment_rollout_state(dep, "h")[0] == "failed"


def test_drift_state_belongs_to_one_release():
    from specpair_operator.policy import drift
    stored = {"breachesInRow": 2, "streaks": {"code": 2}, "stepsTaken": 1, "version": "3"}
    assert drift.state_for_release(stored, "3") == drift.DriftState(1, {"code": 2})
    # A newly promoted champion never inherits the previous release's ladder.
    assert drift.state_for_release(stored, "4") == drift.DriftState()
    assert drift.state_for_release({"breachesInRow": 2, "stepsTaken": 1}, "4") == drift.DriftState()
    assert drift.state_for_release(None, "1") == drift.DriftState()


def test_a_release_runs_the_image_it_was_gated_with():
    """A rollback serves the previous release's image even when the spec now names another."""
    old = release.build_release("p", "ns", {**SPEC, "rollout": {"image": "reg/specpair/engine:1"}}, PROMPTS)
    now = {"image": "reg/specpair/engine:2"}
    dep = engine_objects.engine_deployment("p", "ns", old, "d" * 64, "1", now, "http://mlflow")
    job = gate_objects.gate_job("p", "ns", old, "d" * 64, "1", now, "http://mlflow")
    for obj in (dep, job):
        assert obj["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/specpair/engine:1"


def test_the_operators_spec_check_accepts_every_shipped_example_and_refuses_bad_ones():
    """No false alarm on the specs we ship (a wrong InvalidSpec would stall a good pair); the
    wording against the real API server is tested in test_operator_e2e.py."""
    import glob

    import yaml

    from specpair_operator.crd.validation import validate_spec

    shipped = [doc for path in sorted(glob.glob(str(Path(__file__).resolve().parents[2] / "examples" / "*.yaml")))
               for doc in yaml.safe_load_all(open(path)) if doc and doc.get("kind") == "SpecModelPair"]
    assert shipped
    for doc in shipped:
        assert validate_spec(doc["spec"]) == [], doc["metadata"]["name"]
    assert validate_spec({**SPEC, "speculation": {"k": 17}}) == [
        "spec.speculation.k: Invalid value: 17: spec.speculation.k in body should be less than or equal to 16"]
    assert validate_spec({"draft": {}}) == ["spec.target: Required value",
                                            "spec.draft: Invalid value: set exactly one of draft.source and draft.drafter"]


@pytest.fixture
def installation_image():
    """The operator's default engine image, as the chart's engine.image sets it at startup."""
    release.set_default_engine_image("registry.example.com/mirror/engine:0.1.0")
    yield "registry.example.com/mirror/engine:0.1.0"
    release.set_default_engine_image(None)


def test_an_absent_image_is_the_installations_and_part_of_the_release_hash(installation_image):
    """Behind a private registry: pairs that name no image run the chart's engine.image, pulled
    with its pull secrets; the image is in the release (a new default is gated again)."""
    mirrored = release.build_release("p", "ns", SPEC, PROMPTS)
    assert mirrored["engine"] == {"image": installation_image}
    release.set_default_engine_image(None)
    plain = release.build_release("p", "ns", SPEC, PROMPTS)
    assert plain["engine"] == {"image": release.ENGINE_IMAGE}
    assert release.content_hash(plain) != release.content_hash(mirrored)
    # The spec's own image wins over any default.
    named = release.build_release("p", "ns", {**SPEC, "rollout": {"image": "reg/own:1"}}, PROMPTS,
                                  default_image=installation_image)
    assert named["engine"] == {"image": "reg/own:1"}
    defaults = manifests.PodDefaults.from_env({"SPECPAIR_IMAGE_PULL_SECRETS": " regcred, mirror-creds ,"})
    digest = release.content_hash(mirrored)
    for obj in (engine_objects.engine_deployment("p", "ns", mirrored, digest, "1", {}, "http://m", defaults=defaults),
                gate_objects.gate_job("p", "ns", mirrored, digest, "1", {}, "http://m", defaults=defaults)):
        kubernetes_validate.validate(obj, "1.33.0", strict=True)
        pod = obj["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == installation_image
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror-creds"}]
        assert pod["automountServiceAccountToken"] is False
    assert "imagePullSecrets" not in gate_objects.gate_job("p", "ns", mirrored, digest, "1", {}, "http://m")[
        "spec"]["template"]["spec"]


def test_finished_gate_jobs_are_deleted_after_a_day_unless_the_chart_says():
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    digest = release.content_hash(rel)
    job = gate_objects.gate_job("p", "ns", rel, digest, "1", {}, "http://m")
    assert job["spec"]["ttlSecondsAfterFinished"] == manifests.GATE_TTL_SECONDS == 86400
    short = gate_objects.gate_job("p", "ns", rel, digest, "1", {}, "http://m",
                               defaults=manifests.PodDefaults.from_env({"SPECPAIR_GATE_TTL_SECONDS": "600"}))
    assert short["spec"]["ttlSecondsAfterFinished"] == 600
    kubernetes_validate.validate(short, "1.33.0", strict=True)


def test_engine_pods_take_ingress_on_their_ports_only_and_gate_pods_none():
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    digest = release.content_hash(rel)
    rollout = {"port": 6000}
    dep = engine_objects.engine_deployment("p", "ns", rel, digest, "1", rollout, "http://m")
    job = gate_objects.gate_job("p", "ns", rel, digest, "1", rollout, "http://m")
    policy = engine_objects.engine_network_policy("p", "ns")
    gate = gate_objects.gate_network_policy("p", "ns")
    for obj in (policy, gate):
        kubernetes_validate.validate(obj, "1.33.0", strict=True)
    # Each selects exactly its pods: every engine pod (any release), every gate pod of this pair.
    engine_labels = dep["spec"]["template"]["metadata"]["labels"]
    gate_labels = job["spec"]["template"]["metadata"]["labels"]
    assert set(policy["spec"]["podSelector"]["matchLabels"].items()) <= set(engine_labels.items())
    assert not set(policy["spec"]["podSelector"]["matchLabels"].items()) <= set(gate_labels.items())
    assert set(gate["spec"]["podSelector"]["matchLabels"].items()) <= set(gate_labels.items())
    assert not set(gate["spec"]["podSelector"]["matchLabels"].items()) <= set(engine_labels.items())
    assert gate["spec"]["policyTypes"] == ["Ingress"] and gate["spec"]["ingress"] == []
    # Named ports: the policy follows rollout.port and httpPort without naming numbers.
    rule, control = policy["spec"]["ingress"]
    assert "from" not in rule  # out of the box: any source, on these ports only
    container_ports = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["port"] for p in rule["ports"] + control["ports"]} == container_ports == {"grpc", "http", "metrics",
                                                                                       "control"}
    # The control port: from the operator's pods only, when the operator knows where it runs.
    assert control["ports"] == [{"protocol": "TCP", "port": "control"}] and "from" not in control
    located = engine_objects.engine_network_policy("p", "ns", manifests.PodDefaults.from_env({
        "SPECPAIR_OPERATOR_NAMESPACE": "specpair-system",
        "SPECPAIR_OPERATOR_POD_LABELS": json.dumps({"app.kubernetes.io/component": "operator"})}))
    kubernetes_validate.validate(located, "1.33.0", strict=True)
    assert located["spec"]["ingress"][1]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "specpair-system"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}}}]
    assert "from" not in located["spec"]["ingress"][0]
    assert policy["metadata"]["name"] == manifests.engine_name("p") and gate["metadata"]["name"] == "p-gate"
    assert gate["metadata"]["name"] != manifests.gate_job_name("p", digest)
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "web"}}}]
    narrowed = engine_objects.engine_network_policy(
        "p", "ns", manifests.PodDefaults.from_env({"SPECPAIR_ENGINE_INGRESS_FROM": json.dumps(peers)}))
    kubernetes_validate.validate(narrowed, "1.33.0", strict=True)
    assert narrowed["spec"]["ingress"][0]["from"] == peers
    with pytest.raises(ValueError):
        manifests.PodDefaults.from_env({"SPECPAIR_ENGINE_INGRESS_FROM": '{"podSelector": {}}'})


def test_the_model_cache_has_a_size_limit_and_can_be_a_read_only_volume_claim():
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    digest = release.content_hash(rel)

    def cache(obj):
        pod = obj["spec"]["template"]["spec"]
        return ({v["name"]: v for v in pod["volumes"]}, {m["name"]: m for m in pod["containers"][0]["volumeMounts"]},
                {e["name"]: e.get("value") for e in pod["containers"][0]["env"]})

    volumes, mounts, env = cache(engine_objects.engine_deployment("p", "ns", rel, digest, "1", {}, "http://m"))
    assert volumes["cache"]["emptyDir"] == {"sizeLimit": manifests.CACHE_SIZE_LIMIT}
    assert "hub" not in volumes and "HF_HUB_OFFLINE" not in env
    chart = manifests.PodDefaults.from_env({"SPECPAIR_MODEL_CACHE_SIZE_LIMIT": "200Gi"})
    volumes, _, _ = cache(engine_objects.engine_deployment("p", "ns", rel, digest, "1", {}, "http://m", defaults=chart))
    assert volumes["cache"]["emptyDir"] == {"sizeLimit": "200Gi"}
    rollout = {"modelCache": {"sizeLimit": "20Gi", "persistentVolumeClaim": "smollm2-abc123"}}
    for obj in (engine_objects.engine_deployment("p", "ns", rel, digest, "1", rollout, "http://m", defaults=chart),
                gate_objects.gate_job("p", "ns", rel, digest, "1", rollout, "http://m", defaults=chart)):
        kubernetes_validate.validate(obj, "1.33.0", strict=True)
        volumes, mounts, env = cache(obj)
        assert volumes["cache"]["emptyDir"] == {"sizeLimit": "20Gi"}
        assert volumes["hub"]["persistentVolumeClaim"] == {"claimName": "smollm2-abc123", "readOnly": True}
        assert mounts["hub"] == {"name": "hub", "mountPath": manifests.HUB_CACHE_DIR, "readOnly": True}
        assert env["HF_HUB_CACHE"] == manifests.HUB_CACHE_DIR and env["HF_HUB_OFFLINE"] == "1"
    # The claim is placement, not content: it never makes a new release.
    assert release.content_hash(release.build_release("p", "ns", {**SPEC, "rollout": rollout}, PROMPTS)) == digest


def test_mlflow_credentials_come_from_the_pair_or_the_installation_with_their_keys():
    chart = manifests.MlflowCredentials.from_env({
        "SPECPAIR_MLFLOW_CREDENTIALS_SECRET": "shared",
        "SPECPAIR_MLFLOW_CREDENTIALS_KEYS": json.dumps({"MLFLOW_TRACKING_USERNAME": "user",
                                                        "MLFLOW_TRACKING_PASSWORD": "",
                                                        "MLFLOW_TRACKING_TOKEN": "api-token"})})
    assert chart == manifests.MlflowCredentials("shared", (("MLFLOW_TRACKING_USERNAME", "user"),
                                                           ("MLFLOW_TRACKING_TOKEN", "api-token")))
    assert manifests.MlflowCredentials.from_env({}) is None
    with pytest.raises(ValueError, match="JSON object"):
        manifests.MlflowCredentials.from_env({"SPECPAIR_MLFLOW_CREDENTIALS_SECRET": "s",
                                              "SPECPAIR_MLFLOW_CREDENTIALS_KEYS": "[1]"})
    own = manifests.MlflowCredentials.for_pair({"credentialsSecretRef": {"name": "team-mlflow", "passwordKey": "pw"}}, chart)
    assert own == manifests.MlflowCredentials("team-mlflow", (("MLFLOW_TRACKING_USERNAME", "username"),
                                                              ("MLFLOW_TRACKING_PASSWORD", "pw")))
    assert manifests.MlflowCredentials.for_pair({"modelName": "m"}, chart) is chart


def test_engine_pods_get_mlflow_credentials_only_to_download_a_model_from_mlflow():
    assert not release.reads_from_mlflow(release.build_release("p", "ns", SPEC, PROMPTS))
    from_mlflow = {**SPEC, "draft": {"source": "models:/team-draft/3"}}
    assert release.reads_from_mlflow(release.build_release("p", "ns", from_mlflow, PROMPTS))



def test_engine_certificates_are_issued_checked_and_renewed_by_the_operators_ca():
    import datetime as dt

    from cryptography import x509

    from specpair_operator.desired import tls
    ca, other = tls.new_ca(), tls.new_ca()
    assert tls.check_ca(ca) == "" and "does not belong" in tls.check_ca(tls.KeyPair(ca.cert_pem, other.key_pem))
    names = tls.engine_dns_names("p-engine", "ns")
    leaf = tls.issue(ca, "p-engine", names, server=True, days=tls.SERVER_DAYS)
    assert "not a CA" in tls.check_ca(leaf)
    assert tls.reissue_reason(leaf.cert_pem, ca.cert_pem, ca, names) == ""
    assert tls.reissue_reason(None, None, ca, names) == "no certificate yet"
    assert tls.reissue_reason(leaf.cert_pem, ca.cert_pem, other, names) == "issued by another CA"
    assert "needs" in tls.reissue_reason(leaf.cert_pem, ca.cert_pem, ca, tls.engine_dns_names("q-engine", "ns"))
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=tls.SERVER_DAYS - tls.RENEW_DAYS + 1)
    assert "days left" in tls.reissue_reason(leaf.cert_pem, ca.cert_pem, ca, names, now=later)
    cert = x509.load_pem_x509_certificate(leaf.cert_pem)
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]
    client = x509.load_pem_x509_certificate(tls.issue(ca, tls.OPERATOR_NAME, server=False, days=1).cert_pem)
    assert client.subject.rfc4514_string() == "CN=specpair-operator"
    assert tls.server_name("p-engine", "ns") == "p-engine.ns.svc" in names


def test_a_verdict_is_promoted_only_if_it_is_the_one_the_gate_job_reported():
    verdict = {**GOOD, "mlflowRunId": "abc"}
    digest = gate_verdict.verdict_digest(GOOD)
    # The run id MLflow adds does not change the digest; any number changed after the gate does.
    assert gate_verdict.verdict_digest(verdict) == digest
    assert gate_verdict.verify_verdict(verdict, "3", digest) is None
    forged = gate_verdict.verify_verdict({**verdict, "acceptanceRate": 0.99}, "3", digest)
    assert forged.reason == "VerdictMismatch" and not forged.passed and "changed after the gate" in forged.message
    assert gate_verdict.verify_verdict(verdict, "3", None).reason == "VerdictUnverified"


def test_a_hub_token_reaches_engine_and_gate_pods_by_reference_only():
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    digest = release.content_hash(rel)

    def token(obj):
        env = obj["spec"]["template"]["spec"]["containers"][0]["env"]
        return [e for e in env if e["name"] == "HF_TOKEN"]
    installation = manifests.PodDefaults.from_env({"SPECPAIR_HUB_TOKEN_SECRET": "hf", "SPECPAIR_HUB_TOKEN_KEY": "t"})
    own = {"modelCache": {"hubTokenSecretRef": {"name": "team-hf"}}}
    for rollout, defaults, expected in (({}, manifests.PodDefaults(), None), ({}, installation, ("hf", "t")),
                                        (own, installation, ("team-hf", "token"))):
        for obj in (engine_objects.engine_deployment("p", "ns", rel, digest, "1", rollout, "http://m", defaults=defaults),
                    gate_objects.gate_job("p", "ns", rel, digest, "1", rollout, "http://m", defaults=defaults)):
            if expected is None:
                assert token(obj) == []
            else:
                (ref,) = token(obj)
                assert ref == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": expected[0], "key": expected[1]}}}
    # A token reference is how a pod downloads, not what it serves: the release is the same.
    assert release.content_hash(release.build_release("p", "ns", {**SPEC, "rollout": own}, PROMPTS)) == \
        release.content_hash(release.build_release("p", "ns", SPEC, PROMPTS))


def test_a_vllm_release_is_its_own_release_and_renders_vllms_server():
    # Releases of our engine keep their hash (no kind written), so nothing is gated again.
    plain = release.build_release("p", "ns", SPEC, PROMPTS)
    assert release.build_release("p", "ns", {**SPEC, "engine": "specpair"}, PROMPTS) == plain
    assert "kind" not in plain["engine"] and release.engine_kind(plain) == "specpair"
    rel = release.build_release("p", "ns", {**SPEC, "engine": "vllm", "vllm": {"dtype": "float32"}}, PROMPTS)
    assert rel["engine"]["kind"] == "vllm" and rel["engine"]["dtype"] == "float32"
    assert release.content_hash(rel) != release.content_hash(plain)
    digest = release.content_hash(rel)
    rollout = {"httpPort": 8000}
    dep = engine_objects.engine_deployment("p", "ns", rel, digest, "2", rollout, "http://m")
    kubernetes_validate.validate(dep, "1.33.0", strict=True)
    pod = dep["spec"]["template"]["spec"]
    # vLLM on a Unix socket in a volume it shares with its companion, which takes the pair's port
    # (and the control port, mutual TLS from the engine certificate's Secret).
    c, companion = pod["containers"]
    # Both containers know the pod's stop delay and drain: vLLM stops only after its companion drained.
    shutdown = ["--stop-delay", "5", "--drain-timeout", "30"]
    assert c["command"] == ["python", "-m", "specpair.vllm_serve", "--release", manifests.RELEASE_FILE,
                            "--uds", vllm_serve.VLLM_SOCKET, "--enforce-eager", *shutdown]
    assert companion["command"][-4:] == shutdown and pod["terminationGracePeriodSeconds"] == 5 + 30 + 10
    assert "ports" not in c and c["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert companion["command"][:9] == ["python", "-m", "specpair.vllm_companion", "--release", manifests.RELEASE_FILE,
                                        "--uds", vllm_serve.VLLM_SOCKET, "--host", "0.0.0.0"]
    assert companion["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                                  {"name": "metrics", "containerPort": manifests.METRICS_PORT, "protocol": "TCP"},
                                  {"name": "control", "containerPort": manifests.CONTROL_PORT, "protocol": "TCP"}]
    assert companion["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    socket_mount = {"name": "vllm-socket", "mountPath": vllm_serve.VLLM_SOCKET_DIR}
    assert socket_mount in c["volumeMounts"] and socket_mount in companion["volumeMounts"]
    assert json.loads(dep["spec"]["template"]["metadata"]["annotations"][manifests.ANN_RELEASE]) == rel
    assert pod["securityContext"]["runAsNonRoot"]
    (tls_volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert tls_volume["secret"]["secretName"] == manifests.engine_tls_secret_name("p")
    # SpeculationOff for vLLM: the same release rendered without speculation (a rollout).
    off = engine_objects.engine_deployment("p", "ns", rel, digest, "2", rollout, "http://m", speculation=False)
    assert "--no-speculation" in off["spec"]["template"]["spec"]["containers"][0]["command"]
    # On a GPU, vLLM compiles and captures graphs: no eager mode.
    gpu = engine_objects.engine_deployment("p", "ns", rel, digest, "2", {**rollout, "resources": {
        "limits": {"nvidia.com/gpu": 1}}}, "http://m")
    assert "--enforce-eager" not in gpu["spec"]["template"]["spec"]["containers"][0]["command"]
    svc = engine_objects.engine_service("p", "ns", rollout, "vllm")
    kubernetes_validate.validate(svc, "1.33.0", strict=True)
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"http": "http", "metrics": "metrics"}


def test_serving_tls_hands_the_engine_certificate_to_both_serving_ports_and_probes_over_https():
    from specpair_operator.desired import tls
    from specpair_operator.crd.validation import validate_spec

    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    digest = release.content_hash(rel)
    rollout = {"replicas": 1, "image": "img:1", "tls": {"enabled": True}}
    dep = engine_objects.engine_deployment("p", "ns", rel, digest, "3", rollout, "http://mlflow:5000")
    svc = engine_objects.engine_service("p", "ns", rollout)
    for obj in (dep, svc):
        kubernetes_validate.validate(obj, "1.33.0", strict=True)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    cmd, tls_dir = container["command"], manifests.TLS_DIR
    assert "--insecure" not in cmd
    serving = cmd[cmd.index("--tls-cert"):cmd.index("--tls-cert") + 4]
    assert serving == ["--tls-cert", f"{tls_dir}/tls.crt", "--tls-key", f"{tls_dir}/tls.key"]
    assert "--tls-client-ca" not in cmd       # clients are not asked for certificates; the token is theirs
    assert {"name": "tls", "mountPath": tls_dir, "readOnly": True} in container["volumeMounts"]
    # The kubelet's gRPC probe speaks no TLS: the probes read /health over HTTPS on the HTTP port.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
        assert "grpc" not in container[probe]
    assert {p["name"]: p.get("appProtocol") for p in svc["spec"]["ports"]} == \
        {"grpc": "grpc", "metrics": None, "http": "https"}
    # The certificate answers to the names clients dial: the Service's.
    service = svc["metadata"]["name"]
    assert {service, f"{service}.ns", f"{service}.ns.svc", f"{service}.ns.svc.cluster.local"} <= \
        set(tls.engine_dns_names(service, "ns"))

    # Off (the default, or an older CRD without the field): plaintext and the gRPC probe, unchanged.
    for off in ({"replicas": 1, "image": "img:1"}, {"replicas": 1, "image": "img:1", "tls": {"enabled": False}}):
        (plain,) = engine_objects.engine_deployment("p", "ns", rel, digest, "3", off,
                                               "http://mlflow:5000")["spec"]["template"]["spec"]["containers"]
        assert "--insecure" in plain["command"] and "--tls-cert" not in plain["command"]
        assert plain["readinessProbe"] == {"grpc": {"port": 50051}, "periodSeconds": 5,
                                           "timeoutSeconds": engine_objects.READINESS_TIMEOUT_S}
        assert engine_objects.engine_service("p", "ns", off)["spec"]["ports"][-1]["appProtocol"] == "http"

    # The operator's twin of the CRD's rule: TLS needs the HTTP port (the probes); a vLLM pair may
    # have it (its companion serves it).
    base = {"target": {"source": "t"}, "draft": {"drafter": "ngram"}}
    assert validate_spec({**base, "rollout": {"tls": {"enabled": True}}}) == []
    assert validate_spec({**base, "rollout": {"tls": {"enabled": False}, "httpPort": 0}}) == []
    assert validate_spec({**base, "rollout": {"tls": {"enabled": True}, "httpPort": 0}}) == [
        "spec.rollout: Invalid value: rollout.tls needs rollout.httpPort (not 0): with TLS on, the probes read "
        "the engine's /health over HTTPS, as the kubelet's gRPC probe cannot speak TLS"]
    assert validate_spec({**base, "engine": "vllm", "rollout": {"tls": {"enabled": True}}}) == []
    assert validate_spec({**base, "engine": "vllm", "rollout": {"tls": {"enabled": False}}}) == []
    assert validate_spec({**base, "rollout": {"tls": {"enabled": "yes"}}}) == [
        'spec.rollout.tls.enabled: Invalid value: "string": spec.rollout.tls.enabled in body must be of type '
        'boolean: "string"']
