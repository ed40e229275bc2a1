"""An infrastructure failure during a gate is not a verdict.

The decisions are tables (gate_attempts: retry, wait or give up; what an attempt died of). The
gate runner is run as the Job runs it against a real MLflow server that is down, and one that
comes back before the runner's deadline. On the real control plane a pair's gate meets a real
MLflow outage (the server process stopped, then started again on the same data): the first
attempt gives up at its deadline, the operator says why (GateRetrying, naming MLflow) and gates
again, and the release is promoted once.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections import Counter

import pytest
from kopf.testing import KopfRunner
from mlflow import MlflowClient

from cluster_env import HERE, MODELS, OPERATOR, cond, model_name, pair, serving
from mlflow_server import free_port
from waiting import wait_until
from specpair_operator.gate import attempts as gate_attempts
from specpair_operator.release import content as release
from specpair_operator.gate.attempts import GIVE_UP, RETRY, WAIT, Failure, Policy, failure_of, next_step
from specpair_operator.gate.runner import DEADLINE_MARGIN_S, until_deadline
from specpair_operator.clients.registry import ReleaseRegistry
from specpair_operator.release.registry_contract import RegistryUnavailable


@pytest.mark.parametrize("failed, since, expected", [
    (1, 0.0, (WAIT, 30.0)),
    (1, 29.0, (WAIT, 1.0)),
    (1, 30.0, (RETRY, 0.0)),
    (2, 30.0, (WAIT, 30.0)),      # the delay doubles after each failure
    (2, 60.0, (RETRY, 0.0)),
    (3, 1e9, (GIVE_UP, 0.0)),     # three attempts without a verdict: the gate itself is broken
])
def test_next_step(failed, since, expected):
    assert next_step(Policy(attempts=3, delay_s=30.0), failed, since) == expected


def test_no_delay_retries_at_once_and_one_attempt_never_retries():
    assert next_step(Policy(3, 0.0), 1, 0.0) == (RETRY, 0.0)
    assert next_step(Policy(1, 0.0), 1, 0.0) == (GIVE_UP, 0.0)


@pytest.mark.parametrize("messages, expected", [
    ([json.dumps(gate_attempts.failure_report("2", "MLflowUnreachable", "MLflow at http://m unreachable"))],
     Failure("MLflowUnreachable", "MLflow at http://m unreachable")),
    (["", "not json", json.dumps(gate_attempts.failure_report("2", "GateCrashed", "gate exited 1"))],
     Failure("GateCrashed", "gate exited 1")),
    # Another version's report, or a verdict digest (no cause): the Job's words instead.
    ([json.dumps(gate_attempts.failure_report("1", "GateCrashed", "old"))],
     Failure("JobFailed", "gate Job failed: Job has reached the specified backoff limit")),
    ([json.dumps({"version": "2", "passed": True, "verdictSha256": "ab"})],
     Failure("JobFailed", "gate Job failed: Job has reached the specified backoff limit")),
])
def test_failure_of(messages, expected):
    assert failure_of(messages, "2", "Job has reached the specified backoff limit") == expected


def test_mlflow_is_named_as_the_cause():
    assert Failure("MLflowUnreachable", "verdict not recorded").describe().startswith("MLflow unreachable: ")


@pytest.mark.parametrize("env", [{"SPECPAIR_GATE_ATTEMPTS": "0"}, {"SPECPAIR_GATE_ATTEMPTS": "two"},
                                 {"SPECPAIR_GATE_RETRY_DELAY_SECONDS": "-1"}, {"SPECPAIR_GATE_RETRY_DELAY_SECONDS": "nan"}])
def test_policy_refuses_bad_settings_by_name(env):
    with pytest.raises(ValueError, match="SPECPAIR_GATE_ATTEMPTS=.* SPECPAIR_GATE_RETRY_DELAY_SECONDS="):
        Policy.from_env(env)
    assert Policy.from_env({}) == Policy(3, 30.0)


def test_until_deadline_backs_off_then_gives_up_naming_how_long():
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    def down() -> None:
        raise RegistryUnavailable("MLflow at http://m unreachable")
    with pytest.raises(RegistryUnavailable, match=r"tried for 40s to record"):
        until_deadline(down, 40.0, "record", sleep=sleep, clock=lambda: now[0])
    assert slept == [1, 2, 4, 8, 15, 10]  # doubling, capped at 15 s, the last cut to the deadline
    calls = iter([RegistryUnavailable("down"), RegistryUnavailable("down"), "run-1"])

    def flaky() -> str:
        got = next(calls)
        if isinstance(got, Exception):
            raise got
        return got
    assert until_deadline(flaky, 40.0, "record", sleep=lambda s: None, clock=lambda: 0.0) == "run-1"


# -- the gate runner as the Job runs it, against a real MLflow server -----------------------------

def _runner(rel_path, term, deadline: float, stderr=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specpair_operator.gate.runner", "--release", str(rel_path),
                             "--gate-command", f"{sys.executable} {HERE / 'gate_standin.py'}",
                             "--termination-log", str(term), "--deadline-seconds", str(deadline)],
                            stdout=subprocess.PIPE, stderr=stderr, text=True)


@pytest.fixture
def gated_release(mlflow_server, tmp_path, monkeypatch):
    """A registered release for the runner to gate: its release file and the stand-in world."""
    world = tmp_path / "world.json"
    world.write_text(json.dumps({k: v for k, v in MODELS.items()}))
    monkeypatch.setenv("SPECPAIR_STANDIN_WORLD", str(world))
    spec = pair("runner", "good-draft")["spec"]
    rel = release.build_release("runner", f"r-{uuid.uuid4().hex[:6]}", spec, spec["gating"]["prompts"])
    digest = release.content_hash(rel)
    model = f"runner-{uuid.uuid4().hex[:8]}"
    reg = ReleaseRegistry(mlflow_server.url)
    reg.ensure_model(model, "test/runner")
    version = reg.ensure_release(model, rel, digest)
    path = tmp_path / "release.json"
    path.write_text(json.dumps(release.with_mlflow(rel, mlflow_server.url, model, version)))
    term = tmp_path / "termination-log"
    term.write_text("")
    return path, term, reg, model, version


@pytest.mark.slow
def test_runner_reports_mlflow_unreachable_at_its_deadline_and_writes_no_verdict(gated_release):
    path, term, reg, model, version = gated_release
    # The release's MLflow address is one nothing listens on, for the runner's whole life: what a
    # stopped server is to its client (connection refused), without stopping the session's (a
    # restart is 5-20 s of MLflow's start), which then says no verdict was written.
    rel = json.loads(path.read_text())
    path.write_text(json.dumps(release.with_mlflow(rel, f"http://127.0.0.1:{free_port()}", model, version)))
    t0 = time.monotonic()
    proc = _runner(path, term, deadline=24)
    # The runner gives up DEADLINE_MARGIN_S before the Job's deadline, or at half of it: at 12 s.
    budget = max(24 - DEADLINE_MARGIN_S, 24 / 2)
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 1, err[-2000:]
    # It tried until its deadline and no longer: by the runner's own clock, MLflow was tried for
    # at most `budget` s (one more once rounded, with the last refused call). The wall time also
    # holds the runner's start and the gate's run, a few times longer at CI's load than quiet,
    # so no upper bound on it but communicate()'s 120 s (was: 9 <= took < 40).
    assert took >= budget, took
    report = json.loads(term.read_text())
    assert report["version"] == str(version) and report["cause"] == "MLflowUnreachable", report
    assert "verdict not recorded" in report["error"], report
    tried = re.search(r"tried for (\d+)s", report["error"])
    assert tried and int(tried.group(1)) <= budget + 1, report
    assert reg.gate_result(model, version)[0] == "pending"  # no verdict, no error: not a result


@pytest.mark.slow
def test_runner_outlasts_an_mlflow_outage_shorter_than_its_deadline(mlflow_server, gated_release, tmp_path):
    path, term, reg, model, version = gated_release
    log = tmp_path / "runner.err"
    mlflow_server.stop()
    with open(log, "w") as stderr:
        try:
            proc = _runner(path, term, deadline=120, stderr=stderr)
            # MLflow comes back once the gate is done and the runner is retrying it.
            wait_until("the runner to retry MLflow", lambda: "MLflow unreachable" in log.read_text(), timeout=60)
            assert proc.poll() is None
        finally:
            mlflow_server.start()
        proc.communicate(timeout=120)
    err = log.read_text()
    assert proc.returncode == 0, err[-2000:]
    assert "MLflow unreachable" in err
    status, verdict, _ = reg.gate_result(model, version)
    assert status == "passed" and verdict["acceptanceRate"] == 0.7
    assert json.loads(term.read_text())["verdictSha256"]


# -- on the real control plane --------------------------------------------------------------------

def test_an_mlflow_outage_during_a_gate_ends_in_a_promotion(env, world, mlflow_server, monkeypatch):
    ns = env
    name = f"outage-{uuid.uuid4().hex[:5]}"
    model = model_name(ns, name)
    monkeypatch.setenv("SPECPAIR_GATE_RETRY_DELAY_SECONDS", "1")
    world.update(_gateSeconds=5)  # MLflow goes down while the gate runs
    spec = pair(name, "good-draft")
    # The runner retries MLflow until 15 s before this deadline (the CRD's least): ~45 s.
    spec["spec"]["gating"]["activeDeadlineSeconds"] = 60
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(spec)
        first = ns.wait_for("the gate Job", lambda: ns.list("batch/v1", "Job"), timeout=120)[0]
        mlflow_server.stop()
        try:
            ns.wait_for("the first attempt to end without a verdict", lambda: any(
                c["type"] == "Failed" and c["status"] == "True"
                for c in (ns.get("batch/v1", "Job", first["metadata"]["name"]).get("status") or {}).get("conditions") or []),
                timeout=150)
        finally:
            # The outage ends with the first attempt (about 50 s): the second gates at once.
            world.update(_gateSeconds=0)
            mlflow_server.start()
        obj = ns.wait_for("v1 serving after the outage", lambda: serving(ns, name, "1"), timeout=300)
    assert runner.exception is None

    retries = [h for h in obj["status"]["history"] if h["action"] == "GateRetrying"]
    assert len(retries) == 1 and "MLflow unreachable" in retries[0]["reason"], retries
    assert "attempt 2" in retries[0]["reason"]
    (event,) = ns.events("GateRetrying")
    assert event["type"] == "Warning" and "MLflow unreachable" in event["message"]
    counts = Counter(h["action"] for h in obj["status"]["history"])
    assert counts == Counter({"GateStarted": 1, "GateRetrying": 1, "GatePassed": 1, "Promoted": 1,
                              "RolloutStarted": 1}), counts
    assert not ns.events("GateError")
    assert cond(obj, "Gated")["status"] == "True"
    jobs = sorted(j["metadata"]["name"] for j in ns.list("batch/v1", "Job"))
    assert jobs == sorted([first["metadata"]["name"], first["metadata"]["name"] + "-a2"]), jobs
    mlflow = MlflowClient(mlflow_server.url)
    assert len(mlflow.search_model_versions(f"name='{model}'")) == 1
    assert mlflow.get_registered_model(model).aliases == {"candidate": "1", "champion": "1"}
