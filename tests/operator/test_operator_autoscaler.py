"""The operator's autoscaler for a pair with `rollout.autoscaling`, on the real control plane: an
HPA the real HPA controller reads and scales the pair through (its scale subresource; the operator
scales the engine Deployment to what it writes), a ScaledObject once KEDA's CRD is installed,
nothing once autoscaling is removed, and no release moved by any of it
(tests/operator/autoscaler_scenario.py)."""

from __future__ import annotations

import uuid

from autoscaler_scenario import autoscaled_pair_lifecycle


def test_an_autoscaled_pair_gets_its_autoscaler_and_keeps_its_release(env, devcluster, mlflow_server, monkeypatch):
    autoscaled_pair_lifecycle(env, devcluster, mlflow_server.url, monkeypatch, f"auto-{uuid.uuid4().hex[:5]}")
