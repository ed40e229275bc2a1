"""Real Flux on the real control plane (issue 54, "GitOps, for real"; docs/install.md, "GitOps"):
Flux's source-controller clones a repository from a git server on loopback, and its
kustomize-controller applies the pair it holds and waits on its health (kstatus), while the
operator (in-process Kopf, the chart's RBAC, real MLflow, the stand-in engine and gate) gates and
serves what Git says.

- A commit that changes the pair's draft becomes a gated release: Flux's Kustomization reads Ready
  for that commit only once the pair serves the new release, and not before it was gated.
- A release whose gate fails makes the Kustomization fail its health check with the pair's reason
  (kstatus reads the pair's Stalled condition).
- A pair scaled through its scale subresource (what an autoscaler writes) keeps its replicas across
  Flux's applies of a manifest that leaves `replicas` out, commit after commit; a manifest that
  names them takes them back (the fight docs/install.md tells how to avoid).

Flux's binaries come from scripts/build-flux.sh, named by $SPECPAIR_FLUX_BIN (scripts/test.sh).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner

from cluster_env import OPERATOR, REPLACE, Namespace, cond, kubectl, pair, serving

# Only where $SPECPAIR_FLUX_BIN names the built controllers (scripts/test.sh builds them and sets
# it): their cold build is long (docs/devcluster.md, "Flux").
pytestmark = pytest.mark.skipif(not os.environ.get("SPECPAIR_FLUX_BIN"),
                                reason="SPECPAIR_FLUX_BIN is not set: export SPECPAIR_FLUX_BIN=$(bash scripts/build-flux.sh)")

KUSTOMIZATIONS = "kustomize.toolkit.fluxcd.io/v1"
SOURCES = "source.toolkit.fluxcd.io/v1"
# Long enough for a gate and a rollout beside other tests on two cores; a health check that runs
# out fails the Kustomization (Flux retries it after retryInterval).
HEALTH_TIMEOUT = "5m"
# docs/install.md's health expressions for the pair: kstatus alone counts a resource without a
# status as Current, so a new pair would read healthy before the operator wrote a word about it.
HEALTH_EXPRS = [{"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair",
                 "current": "status.conditions.exists(c, c.type == 'Ready' && c.status == 'True'"
                            " && c.observedGeneration == metadata.generation)",
                 "failed": "status.conditions.exists(c, c.type == 'Stalled' && c.status == 'True'"
                           " && c.observedGeneration == metadata.generation)"}]
# docs/install.md's Flux setting for a manifest that must name replicas.
IGNORE_REPLICAS = [{"paths": ["/spec/rollout/replicas"], "target": {"group": "specpair.io", "kind": "SpecModelPair"}}]


@pytest.fixture(scope="module")
def flux(devcluster, tmp_path_factory):
    """Flux's two controllers on the session's cluster (specpair_devcluster.flux), for this file."""
    from specpair_devcluster.flux import DevFlux

    running = DevFlux(devcluster, tmp_path_factory.mktemp("flux")).start()
    yield running
    running.stop()


class Repository:
    """A bare repository the loopback git server serves, and a working copy the test commits in."""

    def __init__(self, root: Path, url: str):
        self.bare, self.work, self.url = root / "pairs.git", root.parent / "work", url
        self._git(root, "init", "--quiet", "--bare", "--initial-branch=main", str(self.bare))
        self._git(root.parent, "init", "--quiet", "--initial-branch=main", str(self.work))

    @staticmethod
    def _git(cwd: Path, *args: str) -> str:
        done = subprocess.run(["git", "-c", "user.name=specpair-test", "-c", "user.email=test@specpair.invalid", *args],
                              cwd=cwd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (args, done.stderr)
        return done.stdout.strip()

    def commit(self, message: str, files: dict[str, Any]) -> str:
        """Writes `files` (path -> object, as YAML), commits, pushes; the commit's id."""
        for path, obj in files.items():
            target = self.work / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(yaml.safe_dump(obj, sort_keys=False))
        self._git(self.work, "add", "--all")
        self._git(self.work, "commit", "--quiet", "-m", message)
        self._git(self.work, "push", "--quiet", str(self.bare), "main")
        return self._git(self.work, "rev-parse", "HEAD")


@pytest.fixture
def repository(tmp_path):
    from specpair_devcluster.git_server import LoopbackGitServer

    with LoopbackGitServer(tmp_path / "served") as server:
        yield Repository(tmp_path / "served", server.url("pairs.git"))


def manifest(ns: Namespace, name: str, draft: str, replicas: int | None = None) -> dict[str, Any]:
    """The pair as a user keeps it in Git: no status, no replicas unless named."""
    obj = pair(name, draft, rollout=dict(REPLACE))
    obj["metadata"]["namespace"] = ns.name
    if replicas is not None:
        obj["spec"]["rollout"]["replicas"] = replicas
    return obj


def pair_files(ns: Namespace, name: str, draft: str, replicas: int | None = None) -> dict[str, Any]:
    return {"pairs/kustomization.yaml": {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                         "resources": ["pair.yaml"]},
            "pairs/pair.yaml": manifest(ns, name, draft, replicas)}


def source(ns: Namespace, url: str) -> dict[str, Any]:
    return {"apiVersion": SOURCES, "kind": "GitRepository", "metadata": {"name": "pairs", "namespace": ns.name},
            "spec": {"url": url, "ref": {"branch": "main"}, "interval": "1m", "timeout": "30s"}}


def kustomization_of(ns: Namespace, name: str = "pairs", path: str = "./pairs", timeout: str = HEALTH_TIMEOUT,
                     exprs: bool = True) -> dict[str, Any]:
    """The Kustomization docs/install.md recommends: `wait: true` and the pair's health
    expressions, so Flux waits on the pair's Ready for its generation."""
    spec = {"sourceRef": {"kind": "GitRepository", "name": "pairs"}, "path": path, "interval": "1m",
            "retryInterval": "10s", "timeout": timeout, "prune": True, "wait": True}
    if exprs:
        spec["healthCheckExprs"] = HEALTH_EXPRS
    return {"apiVersion": KUSTOMIZATIONS, "kind": "Kustomization", "metadata": {"name": name, "namespace": ns.name},
            "spec": spec}


def apply_all(cluster, objects: list[dict[str, Any]]) -> None:
    done = kubectl(cluster, "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    assert done.returncode == 0, done.stderr


def request_reconcile(ns: Namespace, plural: str, api_version: str, name: str) -> str:
    """What `flux reconcile` does: the requestedAt annotation; the token it set."""
    token = dt.datetime.now(dt.timezone.utc).isoformat()
    ns.kube.patch(api_version, plural, ns.name, name,
                  {"metadata": {"annotations": {"reconcile.fluxcd.io/requestedAt": token}}})
    return token


def kustomization(ns: Namespace, name: str = "pairs") -> dict[str, Any]:
    return ns.get(KUSTOMIZATIONS, "kustomizations", name) or {}


def applied(ns: Namespace, commit: str, name: str = "pairs") -> dict[str, Any] | None:
    """The Kustomization when it is Ready for `commit` (applied and, with wait, healthy)."""
    k = kustomization(ns, name)
    st = k.get("status") or {}
    if cond(k, "Ready").get("status") == "True" and st.get("lastAppliedRevision", "").endswith(commit) \
            and st.get("observedGeneration") == k["metadata"]["generation"]:
        return k
    return None


def wait_applied_while_checking(ns: Namespace, flux, commit: str, name: str, version: str, timeout: float) -> dict[str, Any]:
    """Waits for Flux to call `commit` Ready; at every look where it does, the pair must already
    serve `version` for its current generation (Flux's health check never ran ahead of the gate)."""
    seen: list[str] = []

    def look() -> dict[str, Any] | None:
        k = applied(ns, commit)
        if k is None:
            c = cond(kustomization(ns), "Ready")
            seen.append(f"{c.get('reason')}: {c.get('message', '')[:120]}")
            return None
        assert serving(ns, name, version), (f"Flux called {commit[:8]} Ready while the pair did not serve v{version}",
                                            ns.pair(name).get("status"), k.get("status"))
        return k
    try:
        return ns.wait_for(f"Flux Ready for {commit[:8]} (v{version} serving)", look, timeout=timeout)
    except AssertionError:
        print(flux.logs())
        raise
    finally:
        print("Kustomization Ready reasons seen:", sorted(set(seen)))


def replicas_owner(obj: dict[str, Any]) -> list[str]:
    """The field managers that own spec.rollout.replicas."""
    return [m["manager"] for m in obj["metadata"].get("managedFields") or []
            if "f:replicas" in ((m.get("fieldsV1") or {}).get("f:spec", {}).get("f:rollout") or {})]


def test_flux_applies_commits_as_gated_releases_and_leaves_the_autoscalers_replicas(env, flux, repository, devcluster):
    ns = env
    name = f"flux-{uuid.uuid4().hex[:5]}"
    with KopfRunner(OPERATOR, timeout=60) as runner:
        first = repository.commit("a pair", pair_files(ns, name, "good-draft"))
        apply_all(devcluster, [source(ns, repository.url), kustomization_of(ns)])
        k = wait_applied_while_checking(ns, flux, first, name, "1", timeout=300)
        obj = ns.pair(name)
        # Flux's health check passed no earlier than the pair became Ready (kstatus waited on it).
        assert cond(k, "Healthy")["lastTransitionTime"] >= cond(obj, "Ready")["lastTransitionTime"], (
            cond(k, "Healthy"), cond(obj, "Ready"))
        assert "kustomize-controller" in [m["manager"] for m in obj["metadata"]["managedFields"]]

        # The autoscaler's write: the scale subresource.
        scaled = kubectl(devcluster, "-n", ns.name, "scale", f"specmodelpair/{name}", "--replicas=2")
        assert scaled.returncode == 0, scaled.stderr
        ns.wait_for("the engine Deployment at 2 replicas", lambda: (
            (ns.get("apps/v1", "Deployment", f"{name}-engine") or {}).get("spec", {}).get("replicas") == 2))

        # Flux applies the same commit again (its interval, here asked for): the replicas stay.
        token = request_reconcile(ns, "kustomizations", KUSTOMIZATIONS, "pairs")
        ns.wait_for("Flux's re-apply of the same commit", lambda: (
            (kustomization(ns).get("status") or {}).get("lastHandledReconcileAt") == token and applied(ns, first)),
            timeout=180)
        obj = ns.pair(name)
        assert obj["spec"]["rollout"]["replicas"] == 2 and "kustomize-controller" not in replicas_owner(obj)

        # A commit that changes the draft: a new release, gated and promoted, at the scaled replicas.
        second = repository.commit("a faster draft", pair_files(ns, name, "faster-draft"))
        request_reconcile(ns, "gitrepositories", SOURCES, "pairs")
        wait_applied_while_checking(ns, flux, second, name, "2", timeout=300)
        obj = ns.pair(name)
        assert obj["spec"]["draft"]["source"] == "faster-draft" and obj["spec"]["rollout"]["replicas"] == 2
        assert obj["status"]["previousVersion"] == "1"
        assert ns.get("apps/v1", "Deployment", f"{name}-engine")["spec"]["replicas"] == 2

        # Git names replicas: Flux takes them back on every apply (the fight to avoid).
        third = repository.commit("replicas in Git", pair_files(ns, name, "faster-draft", replicas=1))
        request_reconcile(ns, "gitrepositories", SOURCES, "pairs")
        ns.wait_for("Flux applied replicas: 1", lambda: (
            (kustomization(ns).get("status") or {}).get("lastAttemptedRevision", "").endswith(third)
            and ns.pair(name)["spec"]["rollout"]["replicas"] == 1), timeout=120)
        assert "kustomize-controller" in replicas_owner(ns.pair(name))

        # Where Git must name them: the Kustomization's drift ignore rule on the field keeps the
        # autoscaler's value (Flux adopts the value in the cluster instead of Git's).
        patched = kubectl(devcluster, "-n", ns.name, "patch", "kustomizations.kustomize.toolkit.fluxcd.io", "pairs",
                          "--type=merge", "-p", json.dumps({"spec": {"ignore": IGNORE_REPLICAS}}))
        assert patched.returncode == 0, patched.stderr
        scaled = kubectl(devcluster, "-n", ns.name, "scale", f"specmodelpair/{name}", "--replicas=2")
        assert scaled.returncode == 0, scaled.stderr
        token = request_reconcile(ns, "kustomizations", KUSTOMIZATIONS, "pairs")
        ns.wait_for("Flux's re-apply with the ignore rule", lambda: (
            (kustomization(ns).get("status") or {}).get("lastHandledReconcileAt") == token and applied(ns, third)),
            timeout=180)
        assert ns.pair(name)["spec"]["rollout"]["replicas"] == 2

        # A release whose gate fails: kstatus reads Stalled, Flux's health check fails with the
        # pair's reason; the champion keeps serving at the scaled replicas.
        fourth = repository.commit("a bad draft", pair_files(ns, name, "bad-draft", replicas=1))
        request_reconcile(ns, "gitrepositories", SOURCES, "pairs")
        k = ns.wait_for("Flux's health check failed on the bad draft", lambda: (
            (k := kustomization(ns)) and cond(k, "Ready").get("reason") == "HealthCheckFailed"
            and (k.get("status") or {}).get("lastAttemptedRevision", "").endswith(fourth) and k), timeout=300)
        assert name in cond(k, "Ready")["message"], cond(k, "Ready")
        obj = ns.pair(name)
        assert cond(obj, "Stalled")["status"] == "True" and obj["status"]["servingVersion"] == "2"
        assert obj["spec"]["draft"]["source"] == "bad-draft" and obj["spec"]["rollout"]["replicas"] == 2
    assert runner.exception is None


def test_kstatus_alone_calls_a_new_pair_healthy_before_the_operator_wrote_its_status(env, flux, repository, devcluster):
    """Why docs/install.md gives Flux health expressions for the pair: with no operator running,
    a new pair has no status; `wait: true` alone (kstatus) calls it Current at once, while the
    expressions keep the Kustomization waiting until its timeout."""
    ns = env
    files = {}
    for folder in ("plain", "checked"):
        files.update({f"{folder}/{k.split('/', 1)[1]}": v
                      for k, v in pair_files(ns, f"{folder}-{uuid.uuid4().hex[:5]}", "good-draft").items()})
    commit = repository.commit("two pairs", files)
    apply_all(devcluster, [source(ns, repository.url),
                           kustomization_of(ns, "plain", "./plain", timeout="30s", exprs=False),
                           kustomization_of(ns, "checked", "./checked", timeout="30s")])
    plain = ns.wait_for("kstatus alone: the status-less pair called healthy", lambda: applied(ns, commit, "plain"),
                        timeout=120)
    assert cond(plain, "Healthy")["status"] == "True"
    assert all(not (p.get("status") or {}).get("conditions") for p in ns.list("specpair.io/v1alpha1", "SpecModelPair"))
    checked = ns.wait_for("the expressions: the health check ran out", lambda: (
        (k := kustomization(ns, "checked")) and cond(k, "Ready").get("reason") == "HealthCheckFailed" and k), timeout=120)
    assert "timeout" in cond(checked, "Ready")["message"] and "SpecModelPair" in cond(checked, "Ready")["message"], \
        cond(checked, "Ready")
