"""Exactly one active operator: leader election on a coordination.k8s.io Lease.

The decision (`leadership.decide`) and the leader's fence are tables, without servers. The
adapter races real candidates on the real kube-apiserver with the chart's RBAC, and two real
operator processes (`python -m specpair_operator --leader-election`, Kopf, MLflow) share one
pair while the leader is killed mid-promotion: the follower does nothing until it takes the
Lease over, then finishes the promotion, and every action is recorded once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import kopf
import pytest
from mlflow import MlflowClient

from mlflow_server import free_port
from cluster_env import CHART as CHART_DIR
from cluster_env import HERE, OPERATOR_NAMESPACE, RELEASE, REPLACE, helm, model_name, pair, serving, wait_until
from specpair_operator import leadership
from specpair_operator.__main__ import election
from specpair_operator.clients.kube import Kube
from specpair_operator.leadership import CREATE, RENEW, TAKE, WAIT, Fence, Lease, Timing, decide

LEASE = RELEASE  # the chart's fullname: its Role grants get/patch on this Lease only


def lease(holder: str, duration: float = 15.0, renewed: str = "t1", transitions: int = 0) -> Lease:
    return Lease(holder=holder, duration_s=duration, renew_time=renewed, transitions=transitions)


@pytest.mark.parametrize("current, now, seen_at, action, holder", [
    (None, 100.0, 100.0, CREATE, ""),
    (lease("me"), 100.0, 99.0, RENEW, ""),
    (lease("me"), 500.0, 100.0, RENEW, ""),             # its own lapsed Lease: still first in line
    (lease(""), 100.0, 100.0, TAKE, ""),                # released on a clean shutdown
    (lease("other"), 100.0, 90.0, WAIT, "other"),       # renewed 10 s ago (as seen here), 15 s lease
    (lease("other"), 100.0, 85.0, TAKE, ""),            # silent for exactly the lease duration
    (lease("other"), 100.0, 20.0, TAKE, ""),
    (lease("other", duration=4.0), 100.0, 96.1, WAIT, "other"),
    (lease("other", duration=4.0), 100.0, 96.0, TAKE, ""),
])
def test_decide(current, now, seen_at, action, holder):
    step = decide(current, "me", now, seen_at)
    assert (step.action, step.holder) == (action, holder), step
    assert step.reason


@pytest.mark.parametrize("renewed_at, now, open_", [
    (None, 100.0, False),   # never renewed: never acts
    (95.0, 100.0, True),
    (90.1, 100.0, True),
    (90.0, 100.0, False),   # the renew deadline (10 s) passed: it stops before a takeover (15 s)
])
def test_fence(renewed_at, now, open_):
    assert Fence(10.0, renewed_at).open(now) is open_


def test_a_process_acts_only_within_its_fence(monkeypatch):
    """What handlers.reconcile asks before every pass, Kopf's and the periodic loop's alike."""
    assert leadership.acting()  # no election in this process (Kopf run directly): it acts
    elector = leadership.Elector(None, "ns", "lease", "me", Timing())  # type: ignore[arg-type]  (no I/O here)
    monkeypatch.setattr(leadership, "_ELECTOR", elector)
    assert not leadership.acting()  # elected, never renewed
    elector.fence.renewed_at = time.monotonic()
    assert leadership.acting()
    elector.fence.renewed_at = time.monotonic() - elector.timing.renew_deadline_s
    assert not leadership.acting()


@pytest.mark.parametrize("timing", [(15, 15, 2), (15, 10, 10), (15, 10, 0), (10, 15, 2)])
def test_timing_refuses_a_leader_that_could_act_after_a_takeover(timing):
    with pytest.raises(ValueError, match="retry period .* < renew deadline .* < lease duration"):
        Timing(*timing)


def test_election_flags():
    assert election([], {"SPECPAIR_OPERATOR_NAMESPACE": "ops"}) is None
    chosen = election(["--leader-election", "--lease-duration=4", "--renew-deadline=3", "--retry-period=0.5",
                       "--leader-election-id=a", "--log-format=json"], {"SPECPAIR_OPERATOR_NAMESPACE": "ops"})
    assert (chosen.namespace, chosen.lease, chosen.identity) == ("ops", "specpair-operator", "a")
    assert chosen.timing == Timing(4, 3, 0.5)
    assert election(["--leader-election"], {"SPECPAIR_OPERATOR_NAMESPACE": "ops"}).identity  # host_random
    with pytest.raises(SystemExit, match="lease duration"):
        election(["--leader-election", "--renew-deadline=20"], {"SPECPAIR_OPERATOR_NAMESPACE": "ops"})
    with pytest.raises(SystemExit, match="namespace"):
        election(["--leader-election"], {"SPECPAIR_OPERATOR_NAMESPACE": ""})


# -- on the real control plane --------------------------------------------------------------------

@pytest.fixture
def fresh_lease(devcluster, operator_env):
    """No Lease left by an earlier test; the admin deletes it (the operator may not)."""
    def delete() -> None:
        try:
            devcluster.kube.delete("coordination.k8s.io/v1", "leases", OPERATOR_NAMESPACE, LEASE)
        except Exception:  # noqa: BLE001  (absent)
            pass
    delete()
    yield lambda: devcluster.kube.get("coordination.k8s.io/v1", "leases", OPERATOR_NAMESPACE, LEASE)
    delete()


def operator_kube() -> Kube:
    """A client with the chart's ServiceAccount token (operator_env put its kubeconfig in KUBECONFIG)."""
    return Kube.from_connection_info(kopf.login_with_kubeconfig(settings=kopf.OperatorSettings()))


def test_two_candidates_one_leader_takeover_after_silence_and_the_old_one_fences(fresh_lease):
    timing = Timing(lease_duration_s=2.0, renew_deadline_s=1.5, retry_period_s=0.2)

    async def race() -> None:
        a = leadership.Elector(operator_kube(), OPERATOR_NAMESPACE, LEASE, "cand-a", timing)
        b = leadership.Elector(operator_kube(), OPERATOR_NAMESPACE, LEASE, "cand-b", timing)
        try:
            # Both find no Lease and create it at once: the API server lets one through.
            steps = await asyncio.gather(a.try_once(), b.try_once())
            assert sorted(s.action for s in steps) == [CREATE, WAIT], steps
            leader, other = (a, b) if steps[0].action == CREATE else (b, a)
            assert leader.fence.open(time.monotonic()) and not other.fence.open(time.monotonic())
            # While the leader renews, the other waits, however often it looks.
            for _ in range(12):
                assert (await leader.try_once()).action == RENEW
                # t0: before the other's look that sees the leader's last renewal (its clock for
                # the silence starts inside that look), so the bound below holds however long
                # the look and the sleep take on a loaded machine (from after the sleep, a look
                # and sleep over 0.5 s would have read as a takeover before the lease ran out).
                t0 = time.monotonic()
                assert (await other.try_once()).action == WAIT
                await asyncio.sleep(0.2)
            # The leader falls silent: after the lease duration (on the other's clock) it takes over.
            while (step := await other.try_once()).action == WAIT:
                await asyncio.sleep(0.1)
            assert step.action == TAKE and time.monotonic() - t0 >= timing.lease_duration_s, (step, time.monotonic() - t0)
            held = Lease.from_object(fresh_lease())
            assert (held.holder, held.transitions) == (other.identity, 1)
            # The old leader's fence closed before the takeover; its next renewal finds the new
            # holder and it gives up at once.
            assert not leader.fence.open(time.monotonic())
            lost: list[str] = []
            await leader.keep(threading.Event(), lost.append)
            assert lost and other.identity in lost[0], lost
            # A clean shutdown hands the Lease over at once.
            await other.release()
            assert Lease.from_object(fresh_lease()).holder == ""
            assert (await leader.try_once()).action == TAKE
        finally:
            await a.kube.close()
            await b.kube.close()
    asyncio.run(race())


class Operators:
    """Real `python -m specpair_operator --leader-election` processes, Kopf in each, their writes
    logged by tests/operator/failpoints.py (one JSON line per write, with the writer's pid)."""

    def __init__(self, tmp: Path):
        self.log = tmp / "writes.jsonl"
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, identity: str, failpoint: str, liveness: str = "",
              timing: tuple[str, str, str] = ("15", "10", "0.5")) -> subprocess.Popen:
        """`timing`: the Lease's duration, the renew deadline and the retry period (seconds). A
        renew deadline of 10 s: a leader that cannot renew within it ends itself ("leadership
        lost", exit 1), and at 3 s a renewal (a read and a write to the API server) slowed by a
        loaded CI machine could end the leader before its failpoint kills it; the takeover after
        that kill waits out the 15 s lease instead of 4."""
        duration, deadline, retry = timing
        env = {**os.environ, "SPECPAIR_FAILPOINT": failpoint, "SPECPAIR_FAILPOINT_LOG": str(self.log),
               "SPECPAIR_RECONCILE_INTERVAL": "1", "SPECPAIR_METRICS_PORT": "0",
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen(
            [sys.executable, "-m", "specpair_operator", "--leader-election", f"--leader-election-lease={LEASE}",
             f"--leader-election-id={identity}", f"--lease-duration={duration}", f"--renew-deadline={deadline}",
             f"--retry-period={retry}",
             f"--liveness={liveness}", "--module=failpoints"],
            env=env, stdout=open(self.tmp / f"{identity}.log", "ab"), stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def output(self, identity: str) -> str:
        return (self.tmp / f"{identity}.log").read_text(errors="replace")

    def writes(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def holder(fresh_lease) -> str:
    obj = fresh_lease()
    return ((obj or {}).get("spec") or {}).get("holderIdentity") or ""


def test_two_operators_the_leader_killed_mid_promotion_one_version_one_record_each(env, mlflow_server,
                                                                                   fresh_lease, tmp_path):
    ns = env
    name = f"lead-{uuid.uuid4().hex[:5]}"
    model = model_name(ns, name)
    ops = Operators(tmp_path)
    try:
        # A leads (started first); it dies right after writing the promotion's mark, before the
        # aliases move. B runs beside it all along.
        a = ops.start("op-a", "crash-after:mlflow.set_model_version_tag specpair.promoted_at")
        wait_until("op-a to hold the Lease", lambda: holder(fresh_lease) == "op-a", timeout=60)
        health = f"http://127.0.0.1:{free_port()}/healthz"
        b = ops.start("op-b", "log", liveness=health)
        wait_until("op-b to wait for the Lease", lambda: "not leading: held by op-a" in ops.output("op-b"), timeout=60)
        # Waiting, it is alive for its liveness probe (Kopf serves the endpoint once it leads).
        with urllib.request.urlopen(health, timeout=5) as answer:
            assert answer.status == 200 and json.load(answer) == {"leading": False}
        ns.create(pair(name, "good-draft"))
        wait_until("op-a killed mid-promotion", lambda: a.poll() is not None, timeout=180,
                   show=lambda: {"pair": ns.pair(name).get("status"), "writes": ops.writes()[-5:]})
        assert a.returncode == 137, ops.output("op-a")[-3000:]
        assert b.poll() is None, ops.output("op-b")[-3000:]
        obj = ns.wait_for("v1 serving, promoted by op-b", lambda: serving(ns, name, "1"), timeout=180)
        assert holder(fresh_lease) == "op-b"
        assert int(fresh_lease()["spec"]["leaseTransitions"]) == 1
        with urllib.request.urlopen(health, timeout=5) as answer:  # Kopf's own, on the same address
            assert answer.status == 200 and json.load(answer) != {"leading": False}
    finally:
        ops.stop()

    writes = ops.writes()
    crash = next(i for i, w in enumerate(writes) if w["failed"] == "crash")
    assert writes[crash]["write"] == "mlflow.set_model_version_tag specpair.promoted_at"
    # Before op-a died every write was op-a's: op-b, running all along, made none.
    assert {w["pid"] for w in writes[:crash + 1]} == {a.pid}, writes[:crash + 1]
    assert {w["pid"] for w in writes[crash + 1:]} == {b.pid}
    assert any(w["write"] == "mlflow.set_registered_model_alias champion" for w in writes[crash + 1:])

    mlflow = MlflowClient(mlflow_server.url)
    versions = mlflow.search_model_versions(f"name='{model}'")
    assert len(versions) == 1 and versions[0].tags["specpair.content_hash"] == obj["status"]["contentHash"]
    assert mlflow.get_registered_model(model).aliases == {"candidate": "1", "champion": "1"}
    # One action each, one Event each.
    for reason in ("GateStarted", "GatePassed", "Promoted", "RolloutStarted"):
        assert len(ns.events(reason)) == 1, (reason, [e["message"] for e in ns.events(reason)])
    counts = Counter(h["action"] for h in obj["status"]["history"])
    assert counts == Counter({"GateStarted": 1, "GatePassed": 1, "Promoted": 1, "RolloutStarted": 1}), counts
    assert len(ns.list("batch/v1", "Job")) == 1
    # op-b's clean shutdown handed the Lease back.
    assert holder(fresh_lease) == ""


def test_a_leader_whose_lease_is_taken_stops_at_once(operator_env, devcluster, fresh_lease, tmp_path):
    ops = Operators(tmp_path)
    try:
        # A renew deadline far beyond its retry period: a leader that noticed only at the deadline
        # (20 s, at least 19.5 after the intruder's write) is told from one that noticed at its
        # next look (0.5 s) whatever the load (at a 3 s deadline, the bound was 3 s of wall time
        # for the look and the process's exit); 18 s leave a loaded machine that look and exit.
        proc = ops.start("op-a", "log", timing=("30", "20", "0.5"))
        wait_until("op-a to hold the Lease", lambda: holder(fresh_lease) == "op-a", timeout=60)
        devcluster.kube.patch("coordination.k8s.io/v1", "leases", OPERATOR_NAMESPACE, LEASE,
                              {"spec": {"holderIdentity": "intruder",
                                        "renewTime": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())}})
        t0 = time.monotonic()
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 18, "it acted on after its Lease was someone else's"
        assert proc.returncode == 1
        assert "leadership lost: Lease" in ops.output("op-a") and "intruder" in ops.output("op-a")
    finally:
        ops.stop()


def test_the_chart_runs_two_replicas_one_acts_and_a_deleted_leader_hands_over(env, devcluster, mlflow_server):
    """The chart's own Deployment with two replicas, its pods run by the devcluster node: both
    Ready, one holds the Lease; deleting the leader's pod hands the Lease to the other, which
    takes the pair's next release to Serving. Each action is recorded once."""
    ns = env
    release, namespace = "specpair-ha", "specpair-ha"
    values = {"replicaCount": 2, "mlflow": {"trackingUri": mlflow_server.url}, "watchNamespaces": [ns.name],
              "leaderElection": {"leaseDurationSeconds": 6, "renewDeadlineSeconds": 4, "retryPeriodSeconds": 1},
              "operator": {"metricsPort": 0, "extraEnv": [{"name": "SPECPAIR_RECONCILE_INTERVAL", "value": "1"}]}}
    kube = devcluster.kube

    def lease_holder() -> str:
        obj = kube.get("coordination.k8s.io/v1", "leases", namespace, release) or {}
        return (obj.get("spec") or {}).get("holderIdentity") or ""

    def pods() -> list[dict[str, Any]]:
        return [p for p in kube.list("v1", "Pod", namespace, labels=f"app.kubernetes.io/instance={release}")
                if not p["metadata"].get("deletionTimestamp")]
    try:
        # --wait: both pods Ready, the one waiting for the Lease included (its liveness endpoint).
        helm("upgrade", "--install", release, str(CHART_DIR), "--namespace", namespace, "--create-namespace",
             "--wait", "--timeout", "180s", "--values", "-", kubeconfig=devcluster.kubeconfig, input=json.dumps(values))
        first = wait_until("one replica to lead", lambda: lease_holder(), timeout=60)
        assert len(pods()) == 2 and first.split("_")[0] in {p["metadata"]["name"] for p in pods()}, first
        name = f"ha-{uuid.uuid4().hex[:5]}"
        # Replace: v2 changes only the draft, which the operator would otherwise score in shadow.
        ns.create(pair(name, "good-draft", rollout=REPLACE))
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=180)

        leader_pod = first.split("_")[0]
        kube.delete("v1", "Pod", namespace, leader_pod)
        second = wait_until("the other replica to lead", lambda: (h := lease_holder()) and h != first and h, timeout=60)
        assert second.split("_")[0] != leader_pod
        ns.patch("specpair.io/v1alpha1", "SpecModelPair", name, {"spec": {"draft": {"source": "faster-draft"}}})
        obj = ns.wait_for("v2 serving, by the new leader", lambda: serving(ns, name, "2"), timeout=180)
    finally:
        helm("uninstall", release, "--namespace", namespace, kubeconfig=devcluster.kubeconfig)
    counts = Counter((h["action"], str(h["toVersion"])) for h in obj["status"]["history"])
    for action in ("GateStarted", "GatePassed", "Promoted", "RolloutStarted"):
        assert counts[(action, "1")] == 1 and counts[(action, "2")] == 1, counts
    assert len(ns.events("Promoted")) == 2
