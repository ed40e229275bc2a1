"""The operator's world in the tests: the real control plane (devcluster), the chart installed
by the real helm, and the operator logged in with its ServiceAccount's token, so every API call
it makes is authorised by exactly the RBAC the chart ships."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from specpair_devcluster import DevCluster
from specpair_devcluster.client import ApiError, Kube
from specpair_operator.release import content as release
from gate_tuning import NO_SWEEPS
from waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "specpair"
OPERATOR_NAMESPACE = "specpair-system"
RELEASE = "specpair"
OPERATOR_ACCOUNT = "specpair"  # the chart's fullname for release "specpair"
# `kopf run` as the chart's Deployment runs it, in the test process (its exceptions fail the test).
OPERATOR = ["run", "--all-namespaces", "--standalone", "-m", "specpair_operator.handlers"]


def helm(*args: str, kubeconfig: Path, input: str | None = None) -> str:
    tools = REPO / ".tools" / "bin" / "helm"
    exe = str(tools) if tools.exists() else "helm"
    done = subprocess.run([exe, "--kubeconfig", str(kubeconfig), *args], input=input, capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed: {done.stderr[-3000:]}")
    return done.stdout


def install_chart(cluster: DevCluster, mlflow_url: str, workdir: Path) -> Path:
    """`helm upgrade --install` of charts/specpair (CRD included) with no operator replica, then
    a kubeconfig holding a token of the chart's ServiceAccount for the in-process operator."""
    # All namespaces (the tests make one per test), so one ClusterRole; test_operator_rbac_scope.py
    # proves the chart's default, a list of namespaces.
    values = {"replicaCount": 0, "mlflow": {"trackingUri": mlflow_url}, "watchNamespaces": []}
    helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
         "--wait", "--timeout", "120s", "--values", "-", kubeconfig=cluster.kubeconfig, input=json.dumps(values))
    wait_until("the SpecModelPair CRD to be served", lambda: _crd_served(cluster.kube), timeout=60)
    return cluster.service_account_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_ACCOUNT, workdir / "operator.kubeconfig")


def _crd_served(kube: Kube) -> bool:
    try:
        kube.list("specpair.io/v1alpha1", "SpecModelPair", "default")
        return True
    except ApiError:
        return False


def kubectl(cluster: DevCluster, *args: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real kubectl (scripts/install-k8s-tools.sh puts it in .tools/bin) against the cluster as
    its admin; the result is returned, not checked (refusals are what some tests look for)."""
    tools = REPO / ".tools" / "bin" / "kubectl"
    return subprocess.run([str(tools) if tools.exists() else "kubectl", "--kubeconfig", str(cluster.kubeconfig), *args],
                          input=input, capture_output=True, text=True, timeout=timeout)


class Namespace:
    """One test's namespace on the shared cluster, with the verbs the tests use."""

    def __init__(self, cluster: DevCluster, name: str | None = None):
        self.cluster = cluster
        self.kube = cluster.kube
        self.name = name or f"t-{uuid.uuid4().hex[:8]}"
        cluster.ensure_namespace(self.name)

    def get(self, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        return self.kube.get(api_version, kind, self.name, name)

    def list(self, api_version: str, kind: str, labels: str | None = None) -> list[dict[str, Any]]:
        return self.kube.list(api_version, kind, self.name, labels=labels)

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = json.loads(json.dumps(obj))
        obj.setdefault("metadata", {})["namespace"] = self.name
        return self.kube.create(obj)

    def patch(self, api_version: str, kind: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.kube.patch(api_version, kind, self.name, name, patch)

    def pair(self, name: str) -> dict[str, Any]:
        return self.get("specpair.io/v1alpha1", "SpecModelPair", name) or {}

    def pods(self, labels: str | None = None) -> list[dict[str, Any]]:
        return self.list("v1", "Pod", labels)

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.list("v1", "Event") if reason is None or e.get("reason") == reason]

    def wait_for_event(self, reason: str, text: str = "", timeout: float = 120.0) -> list[str]:
        """The messages of this reason's Events once one says `text`. Kopf posts Events from a
        queue of its own, after the write they report, so an Event can land after the object it
        tells of is already visible: asserting on it at once is a race."""
        def said() -> list[str] | None:
            messages = [e.get("message", "") for e in self.events(reason)]
            return messages if any(text in m for m in messages) else None
        return self.wait_for(f"a {reason} Event saying {text!r}", said, timeout=timeout)

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float = 90.0) -> Any:
        return wait_until(what, predicate, timeout, show=lambda: {
            "pairs": [o.get("status") for o in self.list("specpair.io/v1alpha1", "SpecModelPair")],
            "pods": [(p["metadata"]["name"], (p.get("status") or {}).get("phase"),
                      [c.get("state") for c in (p.get("status") or {}).get("containerStatuses") or []])
                     for p in self.pods()],
            "node errors": self.cluster.node_errors()[-3:]})

    def wait_for_during(self, what: str, predicate: Callable[[], Any], during: Callable[[], None],
                        timeout: float = 90.0) -> Any:
        """wait_for, doing `during` (traffic) between looks."""
        def look() -> Any:
            during()
            return predicate()
        return self.wait_for(what, look, timeout)

    def assert_refused_in_the_operators_words(self, bad: dict[str, Any]) -> None:
        """The API server refuses `bad` (422, the CRD's schema and CEL rules), and the operator's
        own check (for a pair that got past an older CRD) finds the same violations worded the
        same: a user reads one message whichever of the two stopped the pair."""
        from specpair_operator.crd.validation import validate_spec

        try:
            self.create(bad)
        except ApiError as err:
            refused = err
        else:
            raise AssertionError(f"the API server accepted {bad['metadata']['name']}: {bad['spec']}")
        assert refused.status == 422, (refused.status, refused.message)
        ours = validate_spec(bad["spec"])
        assert ours, f"the operator's check let through what the API server refused: {refused.message}"
        for message in ours:
            assert message in refused.message, (message, refused.message)

    def delete(self) -> None:
        try:
            self.kube.delete("v1", "Namespace", None, self.name)
        except ApiError:
            pass


def crd_yaml() -> dict[str, Any]:
    return yaml.safe_load((REPO / "crds" / "specmodelpair.yaml").read_text())


def operator_env(kubeconfig: Path, mlflow_url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    # The operator runs outside the cluster here, so it is told where its CA Secret lives.
    return {"KUBECONFIG": str(kubeconfig), "SPECPAIR_MLFLOW_TRACKING_URI": mlflow_url,
            "SPECPAIR_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE, **(extra or {})}


def apply_env(env: dict[str, str], monkeypatch: Any) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)


# -- the stand-in engine image -------------------------------------------------------------------

STANDIN_IMAGE = "specpair/engine-standin:test"
HERE = Path(__file__).resolve().parent


class World:
    """The model world the stand-in gate and engine read (one file per session; tests run one at
    a time). Keys starting with '_' steer the stand-in engine (see engine_standin.py)."""

    def __init__(self, path: Path, models: dict[str, Any]):
        self.path = path
        self.data: dict[str, Any] = json.loads(json.dumps(models))
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)

    def update(self, **changes: Any) -> None:
        self.data.update(changes)
        self.save()


def register_standin_image(cluster: DevCluster, world_file: Path) -> None:
    """Puts the stand-in engine image on the cluster's nodes: `specpair` in it is the stand-in
    engine, `python` runs the operator's gate runner, whose gate command is the stand-in gate."""
    import sys

    from specpair_devcluster.node_agent import LocalImage, project_programs
    programs = {**project_programs(sys.executable), "specpair": [sys.executable, str(HERE / "engine_standin.py")]}
    cluster.images.images["specpair/engine-standin"] = LocalImage(
        ["specpair"], ["engine", "serve"], programs=programs,
        env={"SPECPAIR_STANDIN_WORLD": str(world_file),
             "SPECPAIR_GATE_COMMAND": f"{sys.executable} {HERE / 'gate_standin.py'}"})


# Granted for an admission check, never requested: OwnerReferencesPermissionEnforcement (OpenShift,
# not enabled on the devcluster's API server) asks the authorizer whether the operator may update
# the pair's finalizers when it creates a child with blockOwnerDeletion. The audit log never shows
# it, so it is left out of what the audit-log test expects to see used.
ADMISSION_ONLY_GRANTS = {("specpair.io", "specmodelpairs/finalizers", "update")}


def rendered_rbac_rules(values: dict[str, Any] | None = None) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the chart's Roles/ClusterRoles grant, from `helm template`, less
    ADMISSION_ONLY_GRANTS (what admission checks but no request ever uses)."""
    tools = REPO / ".tools" / "bin" / "helm"
    done = subprocess.run([str(tools) if tools.exists() else "helm", "template", RELEASE, str(CHART),
                           "--namespace", OPERATOR_NAMESPACE, "--values", "-"], input=json.dumps(values or {}),
                          capture_output=True, text=True, timeout=120, check=True)
    granted = set()
    for doc in yaml.safe_load_all(done.stdout):
        if doc and doc.get("kind") in ("Role", "ClusterRole"):
            for rule in doc.get("rules") or []:
                for group in rule.get("apiGroups") or [""]:
                    for resource in rule.get("resources") or []:
                        for verb in rule.get("verbs") or []:
                            granted.add((group, resource, verb))
    return granted - ADMISSION_ONLY_GRANTS


def operator_metrics() -> dict[tuple[str, frozenset], float]:
    """The in-test operator's /metrics (SPECPAIR_METRICS_PORT), parsed: {(name, labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port = os.environ["SPECPAIR_METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}



# -- pairs and what tests read from them ----------------------------------------------------------

# draft -> what the stand-in gate measures, and the live acceptance per category under traffic
MODELS = {
    "good-draft": {"acceptanceRate": 0.7, "speedup": 1.6, "categories": {"code": 0.8, "chat": 0.6},
                   "live": {"code": 0.78, "chat": 0.6}},
    "faster-draft": {"acceptanceRate": 0.75, "speedup": 1.8, "categories": {"code": 0.85, "chat": 0.65},
                     "live": {"code": 0.84, "chat": 0.66}},
    "bad-draft": {"acceptanceRate": 0.2, "speedup": 0.9, "categories": {"code": 0.25, "chat": 0.15}, "live": {}},
    "foreign-draft": {"acceptanceRate": 0.7, "speedup": 1.5, "categories": {"code": 0.8}, "live": {},
                      "tokenizerOf": "meta-llama/Llama-3.2-1B"},
}


# spec.rollout for a test about promotion by replacement whose next release changes only the draft
# side: left to the operator, such a candidate is scored in shadow first (docs/shadow.md).
REPLACE = {"strategy": {"type": "Replace"}}


def pair(name: str, draft: str, **spec: Any) -> dict[str, Any]:
    """A SpecModelPair on the stand-in image; `spec` keys replace the defaults'."""
    rollout = {"image": STANDIN_IMAGE, **spec.pop("rollout", {})}
    return {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": name},
            "spec": {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "main"},
                     "draft": {"source": draft},
                     "gating": {"prompts": [{"prompt": "def fib(n):", "category": "code"},
                                            {"prompt": "Hi! How are you?", "category": "chat"}],
                                "thresholds": {"minAcceptance": 0.5, "minCategoryAcceptance": {"code": 0.6}}},
                     "rollout": rollout, **spec}}


CODE_PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n    print(", "import json\n\ndef load(path):",
                "class Point:\n    def __init__(self, x, y):"]


def tiny_pair(name: str, target: str, draft: str, **spec: Any) -> dict[str, Any]:
    """A SpecModelPair of the tiny models (tests/tiny_models.py) for the real engine image."""
    # fallbackThreshold 0: the engine keeps drafting under a bad draft, so the operator sees it.
    return {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": name},
            "spec": {"target": {"source": target}, "draft": {"source": draft},
                     "speculation": {"k": 3, "fallbackThreshold": 0},
                     "gating": {"prompts": [{"prompt": CODE_PROMPTS[0], "category": "code"},
                                            {"prompt": CODE_PROMPTS[1], "category": "code"},
                                            {"prompt": "The weather today is", "category": "chat"}],
                                "maxNewTokens": 12, "thresholds": {"requireGreedyIdentity": True}},
                     # Tiny models on CPU: speculation never pays, so the gate's tuning would switch it
                     # off in serving; these tests need it on to watch acceptance drift.
                     "rollout": {"applyGateTuning": False}, **spec}}


# spec.gating for a test that needs a passing gate, not its measurements: one golden prompt of
# 8 tokens (the gate generates each prompt some thirty times in its k sweep).
ONE_PROMPT_GATING = {"prompts": [{"prompt": CODE_PROMPTS[0], "category": "code"}], "maxNewTokens": 8,
                     "thresholds": {"requireGreedyIdentity": True}, "tuning": NO_SWEEPS}


def cond(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def serving(ns: Namespace, name: str, version: str) -> dict[str, Any] | None:
    """The pair when it is Ready and Serving `version` for its current generation, else None."""
    obj = ns.pair(name)
    st = obj.get("status") or {}
    ready = cond(obj, "Ready")
    if st.get("phase") == "Serving" and st.get("servingVersion") == version and ready.get("status") == "True" \
            and ready.get("observedGeneration") == obj["metadata"]["generation"]:
        return obj
    return None


@contextlib.contextmanager
def operator_with_new_pair(ns: Namespace, prefix: str, draft: str = "good-draft") -> Iterator[str]:
    """The operator running in-process (KopfRunner) and a new pair on `draft` in `ns`: its name.
    On leaving, the operator stopped and checked to have raised nothing."""
    from kopf.testing import KopfRunner
    name = f"{prefix}-{uuid.uuid4().hex[:5]}"
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(pair(name, draft))
        yield name
    assert runner.exception is None, runner.exception


def released_once(ns: Namespace, name: str, mlflow_url: str) -> None:
    """The pair's release was registered and gated once: one model version, one gate Job."""
    from mlflow import MlflowClient
    versions = MlflowClient(mlflow_url).search_model_versions(f"name='{model_name(ns, name)}'")
    assert [v.version for v in versions] == ["1"], [v.version for v in versions]
    assert len(ns.list("batch/v1", "Job")) == 1


def set_spec(ns: Namespace, name: str, spec_patch: dict[str, Any]) -> None:
    ns.patch("specpair.io/v1alpha1", "SpecModelPair", name, {"spec": spec_patch})


def engine_pods(ns: Namespace, version: str | None = None) -> list[dict[str, Any]]:
    sel = "specpair.io/role=engine" + (f",specpair.io/release-version={version}" if version else "")
    return [p for p in ns.pods(sel) if not p["metadata"].get("deletionTimestamp")]


def model_name(ns: Namespace, name: str) -> str:
    return release.effective_model_name(name, ns.name, {})


def service_endpoints(ns: Namespace, name: str) -> list[str]:
    """The gRPC addresses of the ready pods the pair's Service selects: what its EndpointSlice
    lists as ready. The devcluster has no kube-proxy, and its API server refuses the loopback pod
    addresses in EndpointSlices (docs/devcluster.md), so test clients spread requests over these
    themselves, round robin, as the Service would."""
    from specpair_operator.desired import manifests

    service = ns.get("v1", "Service", manifests.engine_name(name))
    if service is None:
        return []
    selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
    return sorted(f"{p['status']['podIP']}:50051" for p in ns.pods(selector)
                  if not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP")
                  and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", [])))
