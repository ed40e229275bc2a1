"""Least privilege by namespace, on the real control plane.

The chart installed by the real helm with `watchNamespaces` (a second release beside the
session's) grants its ServiceAccount what it writes only in the listed namespace: `kubectl auth
can-i --list` for it in kube-system, and in a namespace it does not watch, shows no verb that
writes. With exactly those grants (its token, `--namespace` as the chart's Deployment passes it)
the real operator takes a pair to Serving, and the API server refused none of its requests.
"""

from __future__ import annotations

import json
import subprocess
import uuid

from kopf.testing import KopfRunner

from cluster_env import CHART, REPO, Namespace, helm, pair, serving

RELEASE = "specpair-scoped"          # its fullname too (it contains the chart's name)
RELEASE_NAMESPACE = "specpair-scoped"
WRITES = {"create", "update", "patch", "delete", "deletecollection", "escalate", "bind", "impersonate", "*"}
# Every authenticated user may ask the API server what it may do (system:basic-user): these
# create nothing but an answer, in no namespace.
SELF_REVIEWS = {"selfsubjectaccessreviews.authorization.k8s.io", "selfsubjectrulesreviews.authorization.k8s.io",
                "selfsubjectreviews.authentication.k8s.io"}


def can_i(kubeconfig, namespace: str) -> dict[str, set[str]]:
    """`kubectl auth can-i --list` as the scoped ServiceAccount: resource -> verbs."""
    kubectl = REPO / ".tools" / "bin" / "kubectl"
    done = subprocess.run([str(kubectl) if kubectl.exists() else "kubectl", "--kubeconfig", str(kubeconfig),
                           "auth", "can-i", "--list", "-n", namespace,
                           f"--as=system:serviceaccount:{RELEASE_NAMESPACE}:{RELEASE}"],
                          capture_output=True, text=True, timeout=60, check=True)
    rules: dict[str, set[str]] = {}
    for line in done.stdout.splitlines()[1:]:
        if "[" not in line:
            continue
        resource = line.split()[0]
        verbs = line[line.rindex("[") + 1:line.rindex("]")].split()
        rules.setdefault(resource, set()).update(verbs)
    return rules


def writes(rules: dict[str, set[str]]) -> dict[str, set[str]]:
    return {r: v & WRITES for r, v in rules.items() if v & WRITES and r not in SELF_REVIEWS}


def test_listed_namespaces_only_nothing_writable_in_kube_system_and_the_operator_works(
        env, devcluster, mlflow_server, monkeypatch, tmp_path):
    ns = env
    values = {"replicaCount": 0, "mlflow": {"trackingUri": mlflow_server.url}, "watchNamespaces": [ns.name]}
    helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
         "--wait", "--timeout", "120s", "--values", "-", kubeconfig=devcluster.kubeconfig, input=json.dumps(values))
    elsewhere = Namespace(devcluster)
    try:
        assert writes(can_i(devcluster.kubeconfig, "kube-system")) == {}
        assert writes(can_i(devcluster.kubeconfig, elsewhere.name)) == {}
        granted = writes(can_i(devcluster.kubeconfig, ns.name))
        for resource in ("jobs.batch", "deployments.apps", "secrets", "events", "specmodelpairs.specpair.io"):
            assert resource in granted, (resource, granted)
        # In its own namespace: the CA Secret and the leader-election Lease, nothing else written.
        own = writes(can_i(devcluster.kubeconfig, RELEASE_NAMESPACE))
        assert set(own) == {"secrets", "leases.coordination.k8s.io"}, own

        kubeconfig = devcluster.service_account_kubeconfig(RELEASE_NAMESPACE, RELEASE, tmp_path / "scoped.kubeconfig")
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.setenv("SPECPAIR_OPERATOR_NAMESPACE", RELEASE_NAMESPACE)
        name = f"scoped-{uuid.uuid4().hex[:5]}"
        with KopfRunner(["run", f"--namespace={ns.name}", "--standalone", "-m", "specpair_operator.handlers"],
                        timeout=60) as runner:
            ns.create(pair(name, "good-draft"))
            ns.wait_for("v1 serving with the namespace's grants alone", lambda: serving(ns, name, "1"), timeout=180)
        assert runner.exception is None
        user = f"system:serviceaccount:{RELEASE_NAMESPACE}:{RELEASE}"
        refused = {(e["verb"], e["requestURI"]) for e in devcluster.audit_events(user)
                   if e.get("responseStatus", {}).get("code") == 403}
        assert not refused, sorted(refused)
    finally:
        elsewhere.delete()
        helm("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, kubeconfig=devcluster.kubeconfig)
