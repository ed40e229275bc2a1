"""The Helm chart, rendered by the real helm v4: lint, defaults, every option, schema rejections,
Kubernetes schema validation, least-privilege RBAC, pod hardening, CRDs in sync, checkov."""

from __future__ import annotations

import json
import os
import re
import tarfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from ship_helpers import (CHART_DIR, KUBERNETES_VERSION, NON_DEFAULT_VALUES, RELEASE_NAMESPACE, REPO_ROOT,
                      TOOLS_BIN, by_kind, one, run)


def test_helm_is_v4(helm):
    assert run([helm, "version", "--short"]).stdout.startswith("v4.")


def test_kubectl_runs(kubectl):
    assert "Client Version: v1." in run([kubectl, "version", "--client"]).stdout


def test_helm_lint_strict(helm):
    result = run([helm, "lint", CHART_DIR, "--strict", "--namespace", RELEASE_NAMESPACE])
    assert "0 chart(s) failed" in result.stdout


def test_helm_lint_strict_with_non_default_values(helm, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(json.dumps(NON_DEFAULT_VALUES))
    run([helm, "lint", CHART_DIR, "--strict", "--values", values])


def test_default_render_has_exactly_the_operator_parts(render):
    kinds = sorted(m["kind"] for m in render())
    # Least privilege by default: a Role (and binding) in the one watched namespace, `default`, and
    # two in the operator's namespace (the control listeners' CA Secret, the leader-election
    # Lease); nothing cluster-wide.
    assert kinds == ["Deployment", "NetworkPolicy", "Role", "Role", "Role", "RoleBinding", "RoleBinding",
                     "RoleBinding", "ServiceAccount"]
    assert sorted(r["metadata"]["namespace"] for r in by_kind(render(), "Role")) == [
        "default", RELEASE_NAMESPACE, RELEASE_NAMESPACE]
    deployment = one(render(), "Deployment")
    assert deployment["metadata"]["namespace"] == RELEASE_NAMESPACE
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/specpair/operator:0.1.0"
    assert container["command"] == ["python", "-m", "specpair_operator"]
    # It watches `default` only. Leader election is on.
    assert container["args"] == ["--liveness=http://0.0.0.0:8080/healthz", "--log-format=full",
                                 "--namespace=default", "--leader-election",
                                 "--leader-election-lease=ship-specpair", "--lease-duration=15",
                                 "--renew-deadline=10", "--retry-period=2"]
    env = {e["name"]: e for e in container["env"]}
    assert env["MLFLOW_TRACKING_URI"]["value"].startswith("http://")
    assert not any(name.startswith("MLFLOW_TRACKING_") and name != "MLFLOW_TRACKING_URI" for name in env)


def test_non_default_render_wires_every_value(render):
    manifests = render(NON_DEFAULT_VALUES)
    kinds = sorted(m["kind"] for m in manifests)
    # A Role+RoleBinding per watched namespace, one pair for the MLflow Secret, one for the CA
    # Secret, one for the leader-election Lease, nothing cluster-wide.
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "Role", "Role", "Role", "Role", "Role",
                     "RoleBinding", "RoleBinding", "RoleBinding", "RoleBinding", "RoleBinding", "ServiceAccount",
                     "ServiceMonitor"]
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    pod_labels = one(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    container = pod["containers"][0]
    assert container["image"] == "registry.example.com/specpair/operator@sha256:" + "ab" * 32
    assert container["imagePullPolicy"] == "Always"
    assert [a for a in container["args"] if a.startswith("--namespace=")] == ["--namespace=team-a", "--namespace=team-b"]
    assert {"--verbose", "--log-format=json", "--log-refkey=k8s",
            "--mlflow-tracking-uri=https://mlflow.example.com"} <= set(container["args"])
    env = {e["name"]: e for e in container["env"]}
    assert env["MLFLOW_TRACKING_URI"]["value"] == "https://mlflow.example.com"
    assert env["MLFLOW_TRACKING_USERNAME"]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-credentials", "key": "user"}
    assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-credentials", "key": "pass"}
    assert "MLFLOW_TRACKING_TOKEN" not in env  # empty key: not set
    assert env["SPECPAIR_MLFLOW_CREDENTIALS_SECRET"]["value"] == "mlflow-credentials"
    # engine.* and gate.* reach the operator, which reads them as its defaults for child pods.
    from specpair_operator.desired.manifests import PodDefaults
    assert env["SPECPAIR_ENGINE_IMAGE"]["value"] == "registry.example.com/specpair/engine:0.1.0"
    pods = PodDefaults.from_env({k: v["value"] for k, v in env.items() if "value" in v})
    assert (pods.image_pull_secrets, pods.cache_size_limit, pods.gate_ttl_seconds) == (("regcred",), "200Gi", 3600)
    from specpair_operator.gate.attempts import Policy
    assert Policy.from_env({k: v["value"] for k, v in env.items() if "value" in v}) == Policy(5, 60.0)
    assert one(manifests, "Deployment")["spec"]["replicas"] == 2
    assert one(manifests, "Deployment")["spec"]["strategy"] == {"type": "RollingUpdate"}
    assert pods.hub_token == ("hf-token", "hf")
    from specpair_operator.desired.autoscaling import PROMETHEUS_ENV
    assert env[PROMETHEUS_ENV]["value"] == "http://prometheus.monitoring:9090"
    # The operator's own pods are added to the peers allowed to reach engine pods (its gRPC calls).
    assert pods.ingress_from[0] == {"namespaceSelector": {"matchLabels": {"team": "web"}}}
    assert pods.ingress_from[1]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": RELEASE_NAMESPACE}}
    assert pods.ingress_from[1]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    # The control port of engine pods admits the operator's pods only (their labels, namespace).
    assert env["SPECPAIR_OPERATOR_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert pods.operator_pod_labels and dict(pods.operator_pod_labels).items() <= pod_labels.items()
    assert container["resources"]["limits"] == {"cpu": "2", "memory": "2Gi"}
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"][0]["key"] == "dedicated"
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]

    monitor = one(manifests, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"

    dashboard = one(manifests, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["specpair.json"])["uid"] == "specpair-overview"
    policy = one(manifests, "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]


def _operator_engine_service() -> dict[str, Any]:
    from specpair_operator.desired import engine_objects, manifests  # the operator's own Service builder, pure function
    return engine_objects.engine_service("pair", "team-a", {})


def test_service_monitor_selects_the_engine_services_the_operator_creates(render):
    """The selector must match the labels operator/specpair_operator/desired/manifests.py puts on Services."""
    monitor = one(render({"metrics": {"serviceMonitor": {"enabled": True}}}), "ServiceMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["default"]}  # the watched namespaces
    every = one(render({"metrics": {"serviceMonitor": {"enabled": True}}, "watchNamespaces": []}), "ServiceMonitor")
    assert every["spec"]["namespaceSelector"] == {"any": True}
    selector = monitor["spec"]["selector"]["matchLabels"]
    labels = _operator_engine_service()["metadata"]["labels"]
    assert {k: labels.get(k) for k in selector} == selector


def test_service_monitor_port_exists_on_the_engine_service(render):
    monitor = one(render({"metrics": {"serviceMonitor": {"enabled": True}}}), "ServiceMonitor")
    port_names = {p.get("name") for p in _operator_engine_service()["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["port"] in port_names


# Each bad value and the schema path helm must name when refusing it.
BAD_VALUES = [
    ({"securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": False,
                          "allowPrivilegeEscalation": False}}, "/securityContext/readOnlyRootFilesystem"),
    ({"securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                          "allowPrivilegeEscalation": True}}, "/securityContext/allowPrivilegeEscalation"),
    ({"podSecurityContext": {"runAsNonRoot": False}}, "/podSecurityContext/runAsNonRoot"),
    ({"podSecurityContext": {"foo": "bar"}}, "additional properties 'foo' not allowed"),
    ({"podSecurityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}},
     "additional properties 'sysctls' not allowed"),
    ({"podSecurityContext": {"seccompProfile": {"type": "Unconfined"}}}, "/podSecurityContext/seccompProfile/type"),
    ({"podSecurityContext": {"runAsUser": 0}}, "/podSecurityContext/runAsUser"),
    ({"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}, "/securityContext/capabilities/add"),
    ({"securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}}}, "/securityContext/capabilities/add"),
    ({"securityContext": {"capabilities": {"drop": ["NET_RAW"]}}}, "/securityContext/capabilities/drop"),
    ({"securityContext": {"capabilities": {"drop": ["ALL"], "ambient": ["X"]}}},
     "additional properties 'ambient' not allowed"),
    ({"securityContext": {"privileged": True}}, "/securityContext/privileged"),
    ({"securityContext": {"procMount": "Unmasked"}}, "/securityContext/procMount"),
    ({"securityContext": {"seccompProfile": {"type": "Unconfined"}}}, "/securityContext/seccompProfile/type"),
    ({"securityContext": {"appArmorProfile": {"type": "Unconfined"}}}, "/securityContext/appArmorProfile/type"),
    ({"securityContext": {"readOnlyRootFilesystem": True, "runAsNonRoot": True, "allowPrivilegeEscalation": False,
                          "windowsOptions": {"hostProcess": True}}}, "additional properties 'windowsOptions' not allowed"),
    ({"mlflow": {"trackingUri": "mlflow:5000"}}, "/mlflow/trackingUri"),
    ({"mlflow": {"trackingUri": "http://m:5000", "credentialsSecret": {"name": "Not_A_Name"}}},
     "/mlflow/credentialsSecret/name"),
    ({"watchNamespaces": ["team-a", "*"]}, "/watchNamespaces/1"),
    ({"watchNamespaces": ["team-a", "kube-system"]}, "/watchNamespaces/1"),
    ({"image": {"repository": "r", "digest": "latest"}}, "/image/digest"),
    ({"image": {"repository": "r", "pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory"),
    ({"resources": {"limits": {"nvidia.com/gpu": -1}}}, "/resources/limits/nvidia.com~1gpu"),
    ({"operator": {"logLevel": "chatty"}}, "/operator/logLevel"),
    ({"operator": {"logFormat": "yaml"}}, "/operator/logFormat"),
    ({"engine": {"imag": "x"}}, "imag"),
    ({"engine": {"image": ""}}, "/engine/image"),
    ({"engine": {"modelCache": {"sizeLimit": "lots"}}}, "/engine/modelCache/sizeLimit"),
    ({"engine": {"networkPolicy": {"from": [{"pods": {}}]}}}, "pods"),
    ({"gate": {"ttlSecondsAfterFinished": -1}}, "/gate/ttlSecondsAfterFinished"),
    ({"gate": {"attempts": 0}}, "/gate/attempts"),
    ({"replicaCount": 2, "leaderElection": {"enabled": False}}, "/leaderElection/enabled"),
    ({"leaderElection": {"leaseDurationSeconds": 0}}, "/leaderElection/leaseDurationSeconds"),
    ({"metrics": {"serviceMonitor": {"interval": "soon"}}}, "/metrics/serviceMonitor/interval"),
    ({"imag": {"tag": "typo"}}, "imag"),
    ({"autoscaling": {"prometheusAddress": "prometheus:9090"}}, "/autoscaling/prometheusAddress"),
]


@pytest.mark.parametrize("values,where", BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_schema_rejects_bad_values(helm, values, where):
    result = run([helm, "template", "ship", CHART_DIR, "--values", "-"], input=json.dumps(values), check=False)
    assert result.returncode != 0, f"helm accepted {values}"
    assert "values don't meet the specifications of the schema" in result.stderr or "schema" in result.stderr
    assert where in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["template", "install"])
@pytest.mark.parametrize("setting,where", [
    ("podSecurityContext.foo=bar", "additional properties 'foo' not allowed"),
    ("securityContext.capabilities.add={SYS_ADMIN}", "/securityContext/capabilities/add"),
])
def test_schema_refuses_weakened_security_contexts_as_users_type_them(helm, command, setting, where):
    """`--set` as a user types it, for `helm template` and a client-side `helm install --dry-run`."""
    argv = [helm, command, "ship", CHART_DIR, "--set", setting]
    result = run(argv + (["--dry-run=client"] if command == "install" else []), check=False)
    assert result.returncode != 0, f"helm {command} accepted {setting}"
    assert "schema" in result.stderr and where in result.stderr, result.stderr


def test_schema_accepts_every_hardening_field_it_allows(render):
    """The closed schema still takes the stricter settings a platform may require, and the pod
    they render is valid Kubernetes."""
    values = {
        "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 20001, "runAsGroup": 20001, "fsGroup": 20001,
                               "fsGroupChangePolicy": "OnRootMismatch", "supplementalGroups": [20002],
                               "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/specpair.json"},
                               "appArmorProfile": {"type": "RuntimeDefault"},
                               "seLinuxOptions": {"level": "s0:c123,c456"}},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 20001, "runAsGroup": 20001,
                            "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False, "privileged": False,
                            "procMount": "Default", "capabilities": {"drop": ["ALL", "NET_RAW"], "add": []},
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    deployment = one(render(values), "Deployment")
    assert deployment["spec"]["template"]["spec"]["securityContext"]["seccompProfile"]["type"] == "Localhost"
    assert _validate_all([deployment]) == []


def _validate_all(manifests: list[dict[str, Any]]) -> list[str]:
    """Validate each manifest against the pinned Kubernetes OpenAPI schemas (strict: unknown
    fields are errors). Returns the kinds that have no Kubernetes schema."""
    unknown = []
    for manifest in manifests:
        try:
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unknown.append(manifest["kind"])
        except kubernetes_validate.ValidationError as error:
            raise AssertionError(f"{manifest['kind']}/{manifest['metadata']['name']}: {error.message} "
                                 f"at {list(error.path)}") from None
    return unknown


@pytest.mark.parametrize("variant", ["default", "non-default"])
def test_rendered_manifests_are_valid_kubernetes(render, variant):
    manifests = render(None if variant == "default" else NON_DEFAULT_VALUES, include_crds=True)
    unknown = _validate_all(manifests)
    # The Prometheus Operator's ServiceMonitor is not a Kubernetes API; checked field by field above.
    assert unknown == ([] if variant == "default" else ["ServiceMonitor"])
    assert "CustomResourceDefinition" in {m["kind"] for m in manifests}


def test_validation_catches_a_broken_manifest(render):
    """The validator is not a rubber stamp: a typo'd field in a rendered Deployment fails it."""
    deployment = json.loads(json.dumps(one(render(), "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"
    with pytest.raises(AssertionError, match="imagePulPolicy"):
        _validate_all([deployment])


@pytest.mark.parametrize("variant", ["default", "non-default"])
def test_pods_are_non_root_read_only_and_unprivileged(render, variant):
    pod = one(render(None if variant == "default" else NON_DEFAULT_VALUES), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] >= 1000
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context.get("privileged", False) is False
        assert context["capabilities"]["drop"] == ["ALL"]
        # A read-only root needs a writable /tmp, and the probes need Kopf's health port.
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def _operator_rules(kind: str = "ClusterRole", name: str = "") -> list[dict[str, Any]]:
    """The rules the operator says it uses (operator/rbac.yaml): its ClusterRole, or (Role) one of
    those in its own namespace, by name."""
    documents = [d for d in yaml.safe_load_all((REPO_ROOT / "operator" / "rbac.yaml").read_text()) if d]
    return [r for d in documents if d.get("kind") == kind and (not name or d["metadata"]["name"] == name)
            for r in d["rules"]]


def _side_roles(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Roles in the operator's namespace for one object each (the CA's and the MLflow credentials'
    Secrets, the leader-election Lease)."""
    return [r for r in by_kind(manifests, "Role")
            if r["metadata"]["name"].endswith(("-ca", "-mlflow-credentials", "-leader-election"))]


def _normalise(rules: list[dict[str, Any]]) -> set[tuple]:
    return {(group, resource, verb, tuple(sorted(rule.get("resourceNames", []))))
            for rule in rules for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


# The operator's file also grants namespaces get/list/watch for Kopf's namespace globs; the chart
# accepts exact namespace names only (a Role needs a name), and with those Kopf never lists
# namespaces (all-namespaces mode) or falls back to the given names, so the chart leaves it out.
NOT_NEEDED_BY_THE_CHART = {("", "namespaces", verb, ()) for verb in ("get", "list", "watch")}


@pytest.mark.parametrize("variant", ["all-namespaces", "listed-namespaces"])
def test_rbac_grants_exactly_what_the_operator_uses(render, variant):
    values = {"watchNamespaces": []} if variant == "all-namespaces" else {"watchNamespaces": ["team-a", "team-b"]}
    manifests = render(values)
    side = _side_roles(manifests)
    roles = [r for r in by_kind(manifests, "ClusterRole") + by_kind(manifests, "Role") if r not in side]
    (ca_role,) = [r for r in side if r["metadata"]["name"].endswith("-ca")]
    assert _normalise(ca_role["rules"]) == _normalise(_operator_rules("Role", "specpair-operator-ca"))
    assert ca_role["metadata"]["namespace"] == RELEASE_NAMESPACE
    # The Lease, by the name the chart passes to --leader-election-lease (operator/rbac.yaml says
    # specpair-operator, the entry point's default).
    (lease_role,) = [r for r in side if r["metadata"]["name"].endswith("-leader-election")]
    assert lease_role["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert _normalise(lease_role["rules"]) == {
        (g, r, v, ("ship-specpair",) if names else ())
        for g, r, v, names in _normalise(_operator_rules("Role", "specpair-operator-leader-election"))}
    expected = _normalise(_operator_rules()) - NOT_NEEDED_BY_THE_CHART
    assert expected, "operator/rbac.yaml has no rules"
    for role in roles:
        granted = _normalise(role["rules"])
        assert granted == expected, (f"{role['kind']} {role['metadata']['name']}: extra "
                                     f"{sorted(granted - expected)}, missing {sorted(expected - granted)}")
    if variant == "all-namespaces":
        assert [r["kind"] for r in roles] == ["ClusterRole"]
    else:
        assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
        assert not by_kind(manifests, "ClusterRoleBinding")
    for binding in by_kind(manifests, "ClusterRoleBinding") + by_kind(manifests, "RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ship-specpair",
                                        "namespace": RELEASE_NAMESPACE}]


@pytest.mark.parametrize("values", [{"watchNamespaces": []}, None], ids=["cluster", "namespaced"])
def test_rbac_lets_children_block_their_pairs_deletion(render, values):
    """kopf.adopt sets blockOwnerDeletion on every child; with OwnerReferencesPermissionEnforcement
    (OpenShift) creating one needs `update` on the owner's finalizers, else 403 on every child."""
    manifests = render(values)
    for role in by_kind(manifests, "ClusterRole") + by_kind(manifests, "Role"):
        if role not in _side_roles(manifests):
            assert ("specpair.io", "specmodelpairs/finalizers", "update", ()) in _normalise(role["rules"])


# The kinds the operator deletes (only objects a pair owns, by uid).
OWNED_AND_DELETED = {"horizontalpodautoscalers", "scaledobjects", "services", "httproutes", "grpcroutes"}


def test_rbac_has_no_wildcards_reads_secrets_only_by_name_and_deletes_only_what_pairs_own(render):
    """Secrets: engine TLS Secrets are created and patched in pairs' namespaces, never read; the
    only Secrets read are the CA's and (when asked) the MLflow credentials, by name, in the
    operator's own namespace. What is deleted is a pair's own: its autoscaler (autoscaling removed,
    or KEDA come or gone), and its Gateway routes and their per-version Services (the pair stops
    naming a Gateway, or no live route sends to a version any more), each only by its uid, as
    the pair's owner (act/owned.delete_owned)."""
    for values in (None, NON_DEFAULT_VALUES):
        for role in by_kind(render(values), "ClusterRole") + by_kind(render(values), "Role"):
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
                never = {"deletecollection", "escalate", "bind", "impersonate"}
                if not set(rule["resources"]) <= OWNED_AND_DELETED:
                    never.add("delete")
                assert not never & set(rule["verbs"]), rule
                if "secrets" not in rule["resources"]:
                    continue
                assert not {"list", "watch"} & set(rule["verbs"]), rule
                if "get" in rule["verbs"]:
                    assert rule["verbs"] == ["get"] and role["metadata"]["namespace"] == RELEASE_NAMESPACE
                    assert rule["resourceNames"] in (["specpair-operator-ca"], ["mlflow-credentials"])


def test_mlflow_secret_access_only_when_configured(render):
    def named_reads(manifests: list[dict[str, Any]]) -> set[str]:
        return {name for role in by_kind(manifests, "ClusterRole") + by_kind(manifests, "Role")
                for rule in role["rules"] if "secrets" in rule["resources"] and "get" in rule["verbs"]
                for name in rule.get("resourceNames", ["<any>"])}
    assert named_reads(render()) == {"specpair-operator-ca"}
    named_only = {"mlflow": {"trackingUri": "http://m:5000", "credentialsSecret": {"name": "mlflow-credentials"}}}
    assert named_reads(render(named_only)) == {"specpair-operator-ca"}
    assert named_reads(render(NON_DEFAULT_VALUES)) == {"specpair-operator-ca", "mlflow-credentials"}


def test_chart_crds_are_byte_identical_to_top_level_crds():
    """charts/specpair/crds/ holds copies, not symlinks: helm v4 logs every symlink it follows, and
    checkov takes any helm output on stderr for a failed render. This test keeps the copies honest."""
    top = {p.name: p.read_bytes() for p in sorted((REPO_ROOT / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_bytes() for p in sorted((CHART_DIR / "crds").glob("*.yaml"))}
    assert top, "no CRDs in crds/"
    assert chart.keys() == top.keys(), "charts/specpair/crds/ must hold the same files as crds/"
    stale = [name for name in top if chart[name] != top[name]]
    assert not stale, (f"{stale} differ: crds/ is the source; refresh the chart's copies with "
                       "`cp crds/*.yaml charts/specpair/crds/`")


def test_chart_has_no_symlinks():
    links = [str(p.relative_to(CHART_DIR)) for p in CHART_DIR.rglob("*") if p.is_symlink()]
    assert not links, f"helm v4 logs each followed symlink and checkov then refuses the chart: {links}"


def test_helm_template_writes_nothing_on_stderr(helm):
    """checkov's helm runner treats any stderr from `helm template` as a failed render."""
    result = run([helm, "template", CHART_DIR, "--include-crds"], cwd=REPO_ROOT)
    assert result.stderr == ""


def test_packaged_chart_carries_the_crd_bytes(helm, tmp_path):
    """`helm package` carries the CRD, so a chart pushed to a registry is complete on its own."""
    run([helm, "package", CHART_DIR, "--destination", tmp_path])
    (archive,) = tmp_path.glob("specpair-*.tgz")
    with tarfile.open(archive) as tar:
        member = tar.getmember("specpair/crds/specmodelpair.yaml")
        assert member.isfile()
        packaged = tar.extractfile(member).read()
    assert packaged == (REPO_ROOT / "crds" / "specmodelpair.yaml").read_bytes()
    assert "values.schema.json" in "".join(tarfile.open(archive).getnames())


def _checkov(checkov: Path, directory: Path, *extra: str) -> dict[str, Any]:
    result = run([checkov, "--directory", directory, "--output", "json", *extra], check=False, timeout=180)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    return {"failed": [(c["check_id"], c["check_name"], c["resource"]) for r in reports
                       for c in r["results"]["failed_checks"]],
            "passed": sum(r["summary"]["passed"] for r in reports),
            "parsing_errors": sum(r["summary"]["parsing_errors"] for r in reports)}


def test_checkov_finds_nothing_in_the_rendered_chart(helm, checkov, tmp_path):
    """Every skip is listed and justified in charts/specpair/.checkov.yaml."""
    for name, values in (("default", None), ("non-default", NON_DEFAULT_VALUES)):
        out = tmp_path / name
        argv = [helm, "template", "ship", CHART_DIR, "--namespace", RELEASE_NAMESPACE, "--output-dir", out]
        run(argv + (["--values", "-"] if values else []), input=json.dumps(values) if values else None)
        report = _checkov(checkov, out, "--config-file", CHART_DIR / ".checkov.yaml")
        assert report["parsing_errors"] == 0
        assert report["passed"] > 50, report
        assert report["failed"] == [], f"{name}: {report['failed']}"


def test_checkov_on_the_chart_as_users_run_it(checkov):
    """Exactly the command in docs/install.md: checkov renders the chart with helm itself and reads
    charts/specpair/.checkov.yaml (every skip there carries its reason)."""
    # checkov calls `helm` from PATH: the one the tests use.
    env = {**os.environ, "PATH": f"{TOOLS_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = run([checkov, "-d", "charts/specpair", "--framework", "helm", "--output", "json"],
                 cwd=REPO_ROOT, env=env, check=False, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Failed processing helm chart" not in result.stderr + result.stdout
    summary = json.loads(result.stdout)["summary"]
    assert summary["parsing_errors"] == 0 and summary["resource_count"] >= 5, summary
    assert summary["passed"] > 50, summary
    assert summary["failed"] == 0, result.stdout[-3000:]


def test_checkov_still_fails_an_unhardened_pod(checkov, tmp_path):
    """The checkov run above can fail: the same config flags a root, writable, privileged pod."""
    (tmp_path / "pod.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bad", "namespace": "x"},
        "spec": {"containers": [{"name": "c", "image": "busybox:1.36", "securityContext": {"privileged": True}}]}}))
    failed = {c[0] for c in _checkov(checkov, tmp_path, "--config-file", CHART_DIR / ".checkov.yaml")["failed"]}
    assert {"CKV_K8S_16", "CKV_K8S_22", "CKV_K8S_23"} <= failed, failed


def test_checkov_finds_nothing_in_the_dockerfiles(checkov):
    report = _checkov(checkov, REPO_ROOT / "deploy", "--framework", "dockerfile", "--skip-download", "--quiet")
    assert report["passed"] > 20
    assert report["failed"] == [], report["failed"]


def test_chart_refuses_clusters_older_than_the_crd_needs(helm):
    """The CRD's CEL rules need Kubernetes 1.29; Chart.yaml's kubeVersion says so to helm."""
    result = run([helm, "template", "ship", CHART_DIR, "--kube-version", "1.28.9"], check=False)
    assert result.returncode != 0 and "kubeVersion" in result.stderr, result.stderr
    run([helm, "template", "ship", CHART_DIR, "--kube-version", "1.29.0"])


def _notes(helm: Path, *flags: str) -> str:
    out = run([helm, "install", "ship", CHART_DIR, "--dry-run=client", "--namespace", RELEASE_NAMESPACE, *flags]).stdout
    return out[out.index("NOTES:"):]


@pytest.mark.parametrize("flags", [["--set-json", "watchNamespaces=[]"], ["--set", "watchNamespaces={team-a,team-b}"]],
                         ids=["all", "listed"])
def test_notes_declare_the_example_pair_they_wait_for(helm, flags):
    """NOTES.txt applies examples/default-pair.yaml (inline: the chart does not carry examples/)
    and waits for that pair by its name, in a namespace the operator watches."""
    notes = _notes(helm, *flags)
    (inline,) = re.findall(r"echo '(\{.*\})'", notes)
    example = yaml.safe_load((REPO_ROOT / "examples" / "default-pair.yaml").read_text())
    assert json.loads(inline) == example
    waited = re.findall(r"smp/([a-z0-9-]+)", notes)
    assert waited == [example["metadata"]["name"]]
    assert "kubectl get smp -A" in notes
    if "watchNamespaces={team-a,team-b}" in flags:
        assert "kubectl apply -n team-a -f -" in notes and "kubectl wait -n team-a " in notes


def test_documented_finalizer_removal_empties_the_finalizers(kubectl, tmp_path):
    """docs/install.md's patch for pairs left Terminating with no operator, applied by kubectl
    (--local: the same patch machinery, no API server) to a pair carrying Kopf's finalizer."""
    text = (REPO_ROOT / "docs" / "install.md").read_text()
    (patch_type, body), = re.findall(r"kubectl -n \"\$ns\" patch smp \"\$name\" --type (\w+) -p '([^']+)'", text)
    pair = tmp_path / "pair.yaml"
    pair.write_text(yaml.safe_dump({
        "apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair",
        "metadata": {"name": "default", "namespace": "team-a", "deletionTimestamp": "2026-01-01T00:00:00Z",
                     "finalizers": ["kopf.zalando.org/KopfFinalizerMarker"]},
        "spec": {"target": {"source": "default"}, "draft": {"drafter": "ngram"}}}))
    out = run([kubectl, "patch", "--local", "-f", pair, "--type", patch_type, "-p", body, "-o", "yaml"]).stdout
    patched = yaml.safe_load(out)
    assert "finalizers" not in patched["metadata"]
    assert patched["spec"] == {"target": {"source": "default"}, "draft": {"drafter": "ngram"}}


@pytest.mark.parametrize("values, peers", [
    (None, [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}}}]),
    ({"watchNamespaces": ["team-a", "team-b"]},
     [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}} for ns in ("team-a", "team-b")]),
    ({"watchNamespaces": [], "engine": {"networkPolicy": {"from": []}}}, None),  # all namespaces: any source
], ids=["default", "listed", "all-namespaces"])
def test_engine_ingress_defaults_to_the_watched_namespaces(render, values, peers):
    """The engine pods' NetworkPolicy, as the operator renders it from the chart's settings: by
    default only the watched namespaces (and the operator's pods) reach the serving ports."""
    from specpair_operator.desired.engine_objects import engine_network_policy
    from specpair_operator.desired.manifests import PodDefaults

    container = one(render(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    pods = PodDefaults.from_env({e["name"]: e["value"] for e in container["env"] if "value" in e})
    serving = engine_network_policy("p", "team-a", pods)["spec"]["ingress"][0]
    if peers is None:
        assert "from" not in serving
    else:
        assert serving["from"][:-1] == peers
        operator = serving["from"][-1]
        assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": RELEASE_NAMESPACE}}
        assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
