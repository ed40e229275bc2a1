"""Shared fixtures: tiny seeded models (fast) for the engine, server and gate tests, and one real
Kubernetes control plane (devcluster) for every test that needs an API server."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Tests use the machine's 2 CPU threads (and one each under two pytest-xdist workers: see
# pytest_configure).
os.environ.setdefault("OMP_NUM_THREADS", "2")

from vllm_test_env import VLLM_TEST_ENV  # noqa: E402

for _key, _value in VLLM_TEST_ENV.items():   # the vLLM servers the tests start from this process
    os.environ.setdefault(_key, _value)


def pytest_configure(config):
    """A pytest-xdist worker beside others uses one CPU thread (and so do the servers it starts):
    more threads than cores leaves OpenMP spinning for cores another worker holds (the fast lane
    on two workers took 4.2 min at 2 threads each, 2.1 min at 1)."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)


# Rooms whose every test builds or starts something whole: wheels and checkov scans (ship), a
# control plane (devcluster, demo), Prometheus over live engines (observability).
SLOW_ROOMS = ("ship", "devcluster", "demo", "observability")


# Files that take minutes, longest first (CI's --durations): they start first. Under
# `--dist loadfile` a worker that picks one up last runs on alone after the other has finished.
# The last fresh-clone run (seconds): demo smoke 200, live Prometheus 187, canary 140, latency
# rollback 128, shadow 119, KEDA 108; the operator end to end (192 in the run before, 0.8-0.9x
# there for the files measured in both) and the MLflow outage during a gate (138 before) between
# them. The vLLM release took 217 there; its servers now start one process and one model
# inspection fewer (alone: 160 s -> 113 s), so it comes after the operator end to end. (The vLLM
# gate's own file ran two vLLM servers for ~100 s; its run through real vLLM is now checked in
# the vLLM release's gate Job, which ran them anyway.)
LONGEST_FIRST = (# Three vLLM starts at tensor parallel 2 (the gate's two, the pod's): 1,237 s alone at load
                 # 14-33 (starts 286, 283, 331 s), 211 CPU-s with its cluster; likely the longest file.
                 "operator/test_operator_vllm_mtp_tp2.py",
                 "demo/test_demo_smoke.py", "observability/test_prometheus_live.py", "operator/test_operator_e2e.py",
                 "operator/test_operator_vllm.py",
                 # The learning loop (131 s) and a scheduled training Job out of time (~130 s).
                 "operator/test_learning_loop_e2e.py", "operator/test_operator_canary_e2e.py",
                 "operator/test_gateway_canary.py",
                 # Its one vLLM at tensor parallel 2: 459 s to start at load 26-47 (TP1: ~250 s).
                 "engine/test_engine_vllm_peer.py",
                 "operator/test_operator_gate_retry.py", "operator/test_operator_latency_rollback.py",
                 "operator/test_operator_shadow_e2e.py", "observability/test_keda_scaling.py",
                 "engine/test_engine_shadow.py", "server/test_server_openai_features.py",
                 "operator/test_operator_apiserver_restart.py", "engine/test_engine_eagle3.py",
                 "operator/test_operator_convergence.py",
                 "operator/test_operator_mlflow_auth.py", "operator/test_operator_serving_auth.py",
                 "operator/test_operator_real_engine.py", "engine/test_engine_static_cache.py",
                 "operator/test_operator_leadership.py")


def pytest_collection_modifyitems(items):
    """The fast lane (`pytest -m "not slow"`, a few minutes) leaves out what starts real servers
    or tools beside the test: a Kubernetes control plane (the `devcluster` fixture, direct or
    through another fixture), a vLLM server, the slow rooms above, and tests marked slow where
    they are written (the real SmolLM2, subprocess servers, soaks).

    Then the files run longest first: LONGEST_FIRST, the other files with a slow test, and the
    fast files last, whose many short tests fill in while the other worker ends its last long
    file (scripts/test.sh keeps this order: --no-loadscope-reorder)."""
    tests = Path(__file__).resolve().parent
    for item in items:
        room = Path(str(item.fspath)).resolve().relative_to(tests).parts[0]
        if (room in SLOW_ROOMS or "devcluster" in getattr(item, "fixturenames", ())
                or item.get_closest_marker("vllm")):
            item.add_marker(pytest.mark.slow)
    files = {}
    for item in items:
        file = Path(str(item.fspath)).resolve().relative_to(tests).as_posix()
        files[file] = files.get(file, False) or item.get_closest_marker("slow") is not None
    rank = {file: (LONGEST_FIRST.index(file) if file in LONGEST_FIRST
                   else len(LONGEST_FIRST) + (0 if slow else 1)) for file, slow in files.items()}
    items.sort(key=lambda item: rank[Path(str(item.fspath)).resolve().relative_to(tests).as_posix()])


# Seconds a file's tests took (setup, call and teardown), and a worker's: the summary at the end
# says which files LONGEST_FIRST should name and how evenly the workers were loaded.
FILE_SECONDS: dict[str, float] = {}
WORKER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    file = report.nodeid.split("::", 1)[0]
    FILE_SECONDS[file] = FILE_SECONDS.get(file, 0.0) + report.duration
    node = getattr(report, "node", None)   # set where xdist's controller receives the report
    if node is not None:
        worker = node.gateway.id
        WORKER_SECONDS[worker] = WORKER_SECONDS.get(worker, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not FILE_SECONDS:
        return
    terminalreporter.write_sep("=", "longest files (LONGEST_FIRST in tests/conftest.py)")
    for file, seconds in sorted(FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {file}")
    if WORKER_SECONDS:
        terminalreporter.write_line("workers: " + ", ".join(
            f"{worker} {seconds:.0f}s" for worker, seconds in sorted(WORKER_SECONDS.items())))


def pytest_runtest_setup(item):
    """Tests marked `vllm` need the vLLM virtualenv (bash scripts/setup-vllm.sh): skipped where it
    is absent, unless SPECPAIR_REQUIRE_VLLM is set (CI), where they fail instead. Skip them on
    purpose with `-m "not vllm"`."""
    if item.get_closest_marker("vllm") is None:
        return
    from specpair.vllm_peer import default_python
    if not default_python().exists():
        why = f"no vLLM virtualenv at {default_python()} (bash scripts/setup-vllm.sh)"
        if os.environ.get("SPECPAIR_REQUIRE_VLLM"):
            pytest.fail(why + "; SPECPAIR_REQUIRE_VLLM is set, so this is a failure, not a skip",
                        pytrace=False)
        pytest.skip(why)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tiny_models import make_tokenizer
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_target(tiny_tokenizer):
    from tiny_models import make_model
    return make_model(tiny_tokenizer, seed=1)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    """Partially accepting draft: the target plus noise, one layer fewer."""
    from tiny_models import perturbed_copy
    return perturbed_copy(tiny_target, seed=5, noise=0.03)


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory, tiny_target, tiny_draft):
    """The tiny pair saved as model directories, for CLI / gate / server subprocess tests."""
    from tiny_models import save_tiny
    root = tmp_path_factory.mktemp("tiny-pair")
    return {"target": save_tiny(tiny_target, root / "target"),
            "draft": save_tiny(tiny_draft, root / "draft")}


from devcluster_images import TEST_PYTHON_IMAGE  # noqa: E402


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` (tests/mlflow_server.py), one per session: a start is ~7 CPU-s (5-6 s
    on a quiet machine, 15-20 s on a busy one), so every file that needs one shares it (the operator's, the observability scenarios', the model
    fetch's) and keeps to models of its own (names from its namespace) instead of a clean
    registry. Tests that take it down for an outage start it again on the same port and data."""
    from mlflow_server import MlflowServer
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def devcluster(tmp_path_factory):
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler, built from the pinned Go
    modules (scripts/build-control-plane.sh), with two nodes that run pods as local processes:
    `devcluster-node-1` (cpu only) and `devcluster-gpu-1` (one nvidia.com/gpu). One per session;
    tests isolate themselves by namespace."""
    from specpair_devcluster import DevCluster, NodeSpec
    from specpair_devcluster.node_agent import LocalImage, LocalImages
    from specpair_operator.desired.manifests import CACHE_DIR

    cache = os.environ.get("SPECPAIR_CACHE", str(Path.home() / ".cache" / "specpair"))
    env = {"OMP_NUM_THREADS": "1"}
    images = LocalImages({TEST_PYTHON_IMAGE: LocalImage(["python"], programs={"python": [sys.executable]})})
    nodes = [NodeSpec(name="devcluster-node-1", cpu="4", env=env, preseeded={CACHE_DIR: cache}),
             NodeSpec(name="devcluster-gpu-1", cpu="4", gpus=1, env=env, preseeded={CACHE_DIR: cache},
                      labels={"node.specpair.io/pool": "gpu"})]
    cluster = DevCluster(tmp_path_factory.mktemp("devcluster"), nodes=nodes, images=images)
    cluster.start()
    yield cluster
    cluster.stop()
    errors = cluster.node_errors()
    assert not errors, f"the node agents reported errors: {errors[-5:]}"
