"""The operator across a kube-apiserver crash mid-rollout (issue 54): the API server is killed
while the pair's gate runs and started again in place (DevCluster.restart: same port, data and
certificates); the operator's watches and its client reconnect by themselves, and the pair
converges to serving v1 having done each step once: one model version, one gate Job, one engine
Deployment, GateStarted / Promoted / RolloutStarted each recorded once."""

from __future__ import annotations

import pytest

from cluster_env import operator_with_new_pair, released_once, serving
from failing_operator import history


@pytest.mark.timeout(420)
def test_the_operator_converges_once_across_an_api_server_crash(env, devcluster, mlflow_server):
    ns = env
    with operator_with_new_pair(ns, "apirst") as name:
        ns.wait_for("the gate Job to run", lambda: ns.list("batch/v1", "Job"), timeout=120)
        away = devcluster.restart("kube-apiserver")       # SIGKILL mid-rollout, started again in place
        assert away < 90
        obj = ns.wait_for("v1 serving after the restart", lambda: serving(ns, name, "1"), timeout=240)

    counts = history(obj)
    assert counts[("GateStarted", "1")] == 1 and counts[("Promoted", "1")] == 1, counts
    assert counts[("RolloutStarted", "1")] == 1, counts
    released_once(ns, name, mlflow_server.url)
    assert [d["metadata"]["name"] for d in ns.list("apps/v1", "Deployment")] == [f"{name}-engine"]
    assert len([e for e in ns.events("Promoted")]) == 1
