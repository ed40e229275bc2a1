"""`kubectl scale smp/NAME --replicas N` on the real control plane: the CRD's scale subresource
writes spec.rollout.replicas, the operator rolls the number into the engine Deployment, and
nothing else moves (no gate Job, no model version, no history entry: replicas are outside the
release)."""

from __future__ import annotations

import json

from cluster_env import engine_pods, kubectl, operator_with_new_pair, released_once, serving


def test_kubectl_scale_scales_the_engine_and_nothing_else(env, devcluster, mlflow_server):
    ns = env
    with operator_with_new_pair(ns, "scale") as name:
        before = ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)
        history = [h["action"] for h in before["status"]["history"]]

        done = kubectl(devcluster, "scale", f"specmodelpair/{name}", "-n", ns.name, "--replicas", "2")
        assert done.returncode == 0, done.stderr
        assert ns.get("specpair.io/v1alpha1", "SpecModelPair", name)["spec"]["rollout"]["replicas"] == 2
        ns.wait_for("two engine pods ready", lambda: len([
            p for p in engine_pods(ns, "1")
            if any(c["type"] == "Ready" and c["status"] == "True" for c in (p.get("status") or {}).get("conditions") or [])
        ]) == 2, timeout=120)
        dep = ns.get("apps/v1", "Deployment", f"{name}-engine")
        assert dep["spec"]["replicas"] == 2

        def scale() -> dict:
            return json.loads(kubectl(devcluster, "get", f"specmodelpair/{name}", "-n", ns.name,
                                      "--subresource=scale", "-o", "json").stdout)
        # The scale subresource's status (what an autoscaler reads) follows the Deployment.
        got = ns.wait_for("scale status at 2", lambda: (s := scale())["status"].get("replicas") == 2 and s)
        assert got["kind"] == "Scale" and got["spec"]["replicas"] == 2
        assert got["status"]["selector"] == f"specpair.io/pair={name},specpair.io/role=engine"
        ns.wait_for_event("Scaled", "scaled from 1 to 2 replicas")

        after = ns.wait_for("still serving v1", lambda: serving(ns, name, "1"), timeout=60)
        assert [h["action"] for h in after["status"]["history"]] == history
        released_once(ns, name, mlflow_server.url)
