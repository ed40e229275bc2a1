"""Why the operator does not write its own RoleBinding into each namespace as it appears
(docs/install.md, "Which namespaces are watched"), proven on the real API server's RBAC:

- an identity allowed to create RoleBindings, but not holding the operator's rules, is refused
  a RoleBinding to the chart's ClusterRole (the escalation check);
- given `bind` on that one ClusterRole, which per-namespace grants would need, it can bind it to
  itself in kube-system and then write there what the operator writes (Jobs, Secrets): no
  narrower than the ClusterRoleBinding of `watchNamespaces: []`.
"""

from __future__ import annotations

import json
import subprocess
import uuid

import yaml

from cluster_env import CHART, REPO, kubectl


def _rendered_cluster_role(name: str) -> dict:
    """The chart's ClusterRole for `watchNamespaces: []`, under a name of this test's."""
    tools = REPO / ".tools" / "bin" / "helm"
    rendered = subprocess.run([str(tools) if tools.exists() else "helm", "template", "specpair", str(CHART),
                               "--values", "-"], input=json.dumps({"watchNamespaces": []}),
                              capture_output=True, text=True, timeout=120, check=True).stdout
    for doc in yaml.safe_load_all(rendered):
        if doc and doc.get("kind") == "ClusterRole":
            return {**doc, "metadata": {"name": name}}
    raise AssertionError(f"no ClusterRole in the chart {CHART} with watchNamespaces: []")


def test_binding_the_operators_role_per_namespace_needs_bind_which_reaches_kube_system(devcluster, ns):
    tag = uuid.uuid4().hex[:6]
    role, granter, account = f"specpair-ops-{tag}", f"specpair-granter-{tag}", f"granter-{tag}"
    subject = f"system:serviceaccount:{ns.name}:{account}"
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": f"self-{tag}", "namespace": "kube-system"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
               "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns.name}]}
    may_write_rolebindings = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": granter},
        "rules": [{"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["rolebindings"], "verbs": ["create"]}]}
    granted_to_it = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                     "metadata": {"name": granter},
                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": granter},
                     "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns.name}]}
    try:
        for obj in (_rendered_cluster_role(role), may_write_rolebindings, granted_to_it):
            done = kubectl(devcluster, "apply", "-f", "-", input=json.dumps(obj))
            assert done.returncode == 0, done.stderr
        assert kubectl(devcluster, "-n", ns.name, "create", "serviceaccount", account).returncode == 0

        refused = kubectl(devcluster, "create", "-f", "-", f"--as={subject}", input=json.dumps(binding))
        assert refused.returncode != 0 and "attempting to grant RBAC permissions not currently held" in refused.stderr, \
            refused.stderr
        assert kubectl(devcluster, "auth", "can-i", "create", "jobs", "-n", "kube-system",
                       f"--as={subject}").stdout.strip() == "no"

        may_write_rolebindings["rules"].append({"apiGroups": ["rbac.authorization.k8s.io"],
                                                "resources": ["clusterroles"], "verbs": ["bind"],
                                                "resourceNames": [role]})
        assert kubectl(devcluster, "apply", "-f", "-", input=json.dumps(may_write_rolebindings)).returncode == 0
        bound = kubectl(devcluster, "create", "-f", "-", f"--as={subject}", input=json.dumps(binding))
        assert bound.returncode == 0, bound.stderr
        for verb, resource in (("create", "jobs"), ("create", "secrets"), ("patch", "deployments")):
            assert kubectl(devcluster, "auth", "can-i", verb, resource, "-n", "kube-system",
                           f"--as={subject}").stdout.strip() == "yes", (verb, resource)
    finally:
        kubectl(devcluster, "-n", "kube-system", "delete", "rolebinding", f"self-{tag}", "--ignore-not-found")
        kubectl(devcluster, "delete", "clusterrolebinding", granter, "--ignore-not-found")
        kubectl(devcluster, "delete", "clusterrole", granter, role, "--ignore-not-found")
