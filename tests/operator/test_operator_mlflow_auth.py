"""A pair in its own namespace gates against an MLflow that requires credentials (issue: MLflow
credentials), on the real control plane with a real `mlflow server --app-name basic-auth`.

The operator logs in as MLflow's admin (its own environment, as the chart hands it the
installation's Secret). The pair names a Secret in its namespace (spec.mlflow.credentialsSecretRef)
holding another user's credentials: the gate Job writes its verdict with those, or not at all.
Until the Secret exists the gate pod cannot start, and the pair says why instead of gating
unauthenticated.
"""

from __future__ import annotations

import base64
import urllib.error
import urllib.request
import uuid

import pytest
from kopf.testing import KopfRunner
from mlflow import MlflowClient

from cluster_env import OPERATOR, cond, engine_pods, model_name, pair, serving
from mlflow_server import MlflowServer, basic_auth_config  # tests/ is on sys.path (tests/conftest.py)

ADMIN = ("admin", "admin-pw-" + uuid.uuid4().hex[:8])
TEAM = ("team", "team-pw-" + uuid.uuid4().hex[:8])


@pytest.fixture(scope="module")
def auth_mlflow(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-auth")
    # Authenticated users may edit (the gate writes tags on the pair's model); anonymous: nothing.
    server = MlflowServer(root, args=("--app-name", "basic-auth"),
                          env=basic_auth_config(root, ADMIN, default_permission="EDIT"))
    server.start()
    import os

    from mlflow.server.auth.client import AuthServiceClient

    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = ADMIN
    try:
        AuthServiceClient(server.url).create_user(*TEAM)
    finally:
        del os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]
    yield server
    server.stop()


def test_a_pair_gates_with_its_own_credentials_secret_against_an_authenticated_mlflow(env, auth_mlflow, monkeypatch):
    ns = env
    with pytest.raises(Exception, match="401|Unauthorized|credentials"):
        MlflowClient(auth_mlflow.url).search_registered_models()  # noqa: B017 - the anonymous refusal
    monkeypatch.setenv("SPECPAIR_MLFLOW_TRACKING_URI", auth_mlflow.url)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
    name = f"auth-{uuid.uuid4().hex[:5]}"
    spec = pair(name, "good-draft")
    spec["spec"]["mlflow"] = {"credentialsSecretRef": {"name": "team-mlflow"}}
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(spec)
        obj = ns.wait_for("the gate waiting for its Secret", lambda: (o := ns.pair(name)) and
                          cond(o, "Gated").get("reason") == "GatePending" and
                          "team-mlflow" in cond(o, "Gated").get("message", "") and o, timeout=90)
        assert "CreateContainerConfigError" in cond(obj, "Gated")["message"]
        ns.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "team-mlflow"}, "type": "Opaque",
                   "data": {"username": base64.b64encode(TEAM[0].encode()).decode(),
                            "password": base64.b64encode(TEAM[1].encode()).decode()}})
        ns.wait_for("v1 serving, gated with the team's credentials", lambda: serving(ns, name, "1"), timeout=180)
        client = MlflowClient(auth_mlflow.url)
        assert client.get_model_version(model_name(ns, name), "1").tags["specpair.gate.status"] == "passed"
        # The server remembers checked credentials (basic_auth_config): the team's name, checked
        # by the gate, with another password is still refused.
        wrong = base64.b64encode(f"{TEAM[0]}:{TEAM[1]}-not".encode()).decode()
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(urllib.request.Request(
                auth_mlflow.url + "/api/2.0/mlflow/registered-models/search",
                headers={"Authorization": f"Basic {wrong}"}), timeout=30)
        # The engine serves a release with no MLflow model source: it gets no MLflow credentials.
        (pod,) = engine_pods(ns)
        assert not [e for e in pod["spec"]["containers"][0].get("env", []) if e["name"].startswith("MLFLOW_TRACKING_")
                    and e["name"] != "MLFLOW_TRACKING_URI"]
    assert runner.exception is None
