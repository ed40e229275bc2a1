"""Fixtures for the operator tests: the real control plane (the session's devcluster,
tests/conftest.py) with the chart installed by helm against the session's real MLflow server
(`mlflow_server`, tests/conftest.py), and a namespace per test.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

# A periodic pass a second over every pair (the operator reads it at start-up): what the tests
# wait on most (a gate Job finished, an engine Deployment ready) wakes a pass at once
# (handlers.on_owned_event), so the periodic pass is left what only polling sees (MLflow, the
# engines' counters) and a pass every 0.4 s only kept MLflow and the API server busier.
os.environ.setdefault("SPECPAIR_RECONCILE_INTERVAL", "1")
os.environ.setdefault("SPECPAIR_WATCH_TIMEOUT", "30")
# A full pass over a settled pair at least every 6 s (six intervals; the default is thirty): what
# only a full pass sees (MLflow edited by hand, a Service deleted by hand, a pod that changed what
# it reports) is seen well inside the tests' waits.
os.environ.setdefault("SPECPAIR_RESYNC_INTERVAL", "6")

from cluster_env import MODELS, Namespace, World, apply_env, install_chart  # noqa: E402  (tests/operator is on sys.path)
from cluster_env import register_standin_image  # noqa: E402
from cluster_env import operator_env as operator_env_for  # noqa: E402


from mlflow_server import free_port  # noqa: E402  (tests/ is on sys.path)


@pytest.fixture(scope="session")
def operator_kubeconfig(devcluster, mlflow_server, tmp_path_factory) -> Path:
    """The chart installed by helm on the real control plane; a kubeconfig with the token of the
    chart's ServiceAccount: the in-test operator has exactly the chart's RBAC."""
    return install_chart(devcluster, mlflow_server.url, tmp_path_factory.mktemp("operator"))


# The in-test operator serves its Prometheus metrics here (once per test process).
OPERATOR_METRICS_PORT = free_port()


@pytest.fixture
def operator_env(operator_kubeconfig, mlflow_server, monkeypatch) -> dict[str, str]:
    env = operator_env_for(operator_kubeconfig, mlflow_server.url,
                           {"SPECPAIR_METRICS_PORT": str(OPERATOR_METRICS_PORT), "SPECPAIR_METRICS_ADDRESS": "127.0.0.1"})
    apply_env(env, monkeypatch)
    return env


@pytest.fixture
def ns(devcluster) -> Namespace:
    space = Namespace(devcluster)
    yield space
    space.delete()


@pytest.fixture(scope="session")
def world(devcluster, tmp_path_factory) -> World:
    """The stand-in gate's and engine's model world, one file per session (cluster_env.World)."""
    w = World(tmp_path_factory.mktemp("world") / "world.json", MODELS)
    register_standin_image(devcluster, w.path)
    return w


@pytest.fixture
def env(world, operator_env, ns) -> Namespace:
    """A namespace of its own with the operator's environment and the model world as MODELS says."""
    world.data = json.loads(json.dumps(MODELS))
    world.save()
    return ns


@pytest.fixture
def reg(mlflow_server):
    """The operator's MLflow adapter (clients/registry.py) on the session's real MLflow server."""
    from specpair_operator.clients.registry import ReleaseRegistry
    return ReleaseRegistry(mlflow_server.url)


@pytest.fixture
def model_dirs(tiny_pair_dirs):
    """The tiny models where pods can read them: a host folder no pod mount covers (pytest's
    folders are under /tmp, which each pod has as its own emptyDir)."""
    root = Path.home() / ".cache" / "specpair-test-models" / uuid.uuid4().hex[:8]
    out = {k: str(shutil.copytree(v, root / k)) for k, v in tiny_pair_dirs.items()}
    yield out
    shutil.rmtree(root, ignore_errors=True)
