"""A latency regression of the serving release rolled back, end to end: the operator (real Kopf) on
the real control plane, the real gate in the gate Jobs and `specpair engine serve` in the engine
pods, on the tiny models (CPU). v1 serves and traffic gives it its latency baseline
(status.servingHealth, from the real engine's GetStats histograms); v2 (another k, rolled out by
Replace) is promoted and gets its own baseline; then v2's engine gets genuinely slower and the
operator climbs the ladder on its TTFT/TPOT breaches: SpeculationOff first (the pods speculate
and TPOT breached), then, the breach persisting, Rollback to v1, which was faster on the same
traffic by its own recorded baseline. It converges on v1 serving from a fresh pod.

How v2 gets slower without a hook in the product: its engine's processes are put under a CFS
bandwidth limit, a cgroup with `cpu.cfs_quota_us` (cgroup v1) or `cpu.max` (v2) of 1 ms per
50 ms, 2% of one CPU. That is what a Kubernetes CPU limit is on a node (the container runtime
writes the same files), and what a node packed with noisy neighbours amounts to; the engine's
code and configuration are untouched and it measures its own slowness. The devcluster runs pods as local
processes and records each container's pid in its "Started" Event, which is how the test finds
the pod's process session. A quota rather than signals (SIGSTOP/SIGCONT) or pinning to a busy
core: the kernel enforces it at no CPU cost, to the microsecond, with no thread of the test
process (which also runs the operator) in the loop. Each token then waits out several 50 ms
periods, so TPOT goes from a few ms to over 100 ms whatever else the 2 shared cores run (at 5%,
1 ms per 20 ms, it was 48-100 ms: too close to a v1 baseline measured while the official CI's
other workers were busy, which made v1 "not faster" and left v2 serving target-only);
TTFT also breaches unless those cores were so busy that v2's baseline was already slow. Without
a writable cgroup cpu controller the test is skipped, saying so (under CI it fails: tests/ci_skips.py).

Traffic reaches the pods as the Service would deliver it: round robin over its EndpointSlice's
ready addresses (cluster_env.service_endpoints; the devcluster has no kube-proxy)."""

from __future__ import annotations

import itertools
import re
import time
import uuid
from pathlib import Path

import grpc
import pytest
from ci_skips import skip_unless_ci
from kopf.testing import KopfRunner
from mlflow import MlflowClient

from specpair._proto import engine_pb2, engine_pb2_grpc
from cluster_env import (CODE_PROMPTS, ONE_PROMPT_GATING, OPERATOR, cond, engine_pods, model_name, operator_metrics,
                         serving, service_endpoints, set_spec, tiny_pair)

pytestmark = pytest.mark.slow

_turn = itertools.count()


class CpuQuota:
    """A cgroup with a CFS bandwidth limit of `share` of one CPU, for the processes moved into it;
    removed (its processes moved back) on exit."""

    PERIOD_US = 50_000

    def __init__(self, share: float):
        self.quota_us = max(1000, int(share * self.PERIOD_US))   # the kernel's minimum quota: 1 ms
        self.root: Path | None = None
        self.group: Path | None = None

    def __enter__(self) -> "CpuQuota":
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fstype, options, *_ = line.split()
            controllers = Path(mount, "cgroup.subtree_control")
            if fstype == "cgroup" and "cpu" in options.split(",") or \
                    fstype == "cgroup2" and controllers.exists() and "cpu" in controllers.read_text().split():
                try:
                    self.root, self.group = Path(mount), Path(mount, f"specpair-test-{uuid.uuid4().hex[:8]}")
                    self.group.mkdir()
                    if fstype == "cgroup":
                        (self.group / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                        (self.group / "cpu.cfs_quota_us").write_text(str(self.quota_us))
                    else:
                        (self.group / "cpu.max").write_text(f"{self.quota_us} {self.PERIOD_US}")
                    return self
                except OSError as err:
                    self.__exit__()
                    skip_unless_ci(f"no writable cgroup cpu controller at {mount}: {err}")
        skip_unless_ci("no cgroup cpu controller mounted")

    def add_session(self, leader: int) -> list[int]:
        """Moves every process of the session `leader` leads (with all their threads) in."""
        moved = []
        for pid in session_processes(leader):
            try:
                (self.group / "cgroup.procs").write_text(str(pid))
                moved.append(pid)
            except OSError:
                pass   # exited meanwhile
        return moved

    def __exit__(self, *exc: object) -> None:
        if self.group is None or not self.group.exists():
            return
        for pid in (self.group / "cgroup.procs").read_text().split():
            try:
                (self.root / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        self.group.rmdir()


def session_processes(leader: int) -> list[int]:
    """The processes of the session `leader` leads (the devcluster starts each container in a
    session of its own)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[3]) == leader:   # state, ppid, pgrp, session
                out.append(int(entry.name))
    return out


def engine_session(ns, pod: dict) -> int:
    """The pid of the running engine container of `pod`, from the node's "Started" Event."""
    pids = [int(m.group(1)) for e in ns.events("Started")
            if e["involvedObject"]["name"] == pod["metadata"]["name"]
            and (m := re.search(r"Started container engine \(pid (\d+)\)", e.get("message", "")))]
    alive = [pid for pid in pids if pid in session_processes(pid)]
    assert len(alive) == 1, f"the engine of {pod['metadata']['name']} should run as one process session: {pids}"
    return alive[0]


def traffic(ns, name: str, n: int) -> None:
    """`n` code requests, one at a time, round robin over the Service's ready endpoints."""
    addresses = service_endpoints(ns, name)
    for _ in range(n if addresses else 0):
        turn = next(_turn)
        req = engine_pb2.GenerateRequest(prompt=CODE_PROMPTS[turn % len(CODE_PROMPTS)], max_new_tokens=8,
                                         category="code")
        try:
            with grpc.insecure_channel(addresses[turn % len(addresses)]) as channel:
                for _ in engine_pb2_grpc.EngineStub(channel).Generate(req, timeout=30):
                    pass
        except grpc.RpcError:
            return  # a pod going away; the next round reads the endpoints again


def baseline(ns, name: str, version: str) -> dict | None:
    return ((ns.pair(name).get("status") or {}).get("servingHealth") or {}).get("baselines", {}).get(version)


def history(obj: dict) -> list[dict]:
    return obj["status"].get("history") or []


def test_a_slower_serving_release_is_rolled_back_to_the_previous_one_that_was_faster(
        operator_env, ns, mlflow_server, model_dirs, devcluster):
    target, draft = model_dirs["target"], model_dirs["draft"]
    name = f"slow-{uuid.uuid4().hex[:5]}"
    # 10 s windows of at least 10 requests, one breaching window per step; acceptance is left out
    # of the judgement (minDraftedTokens above what the test drafts): every step is latency's.
    drift = {"intervalSeconds": 1, "windowSeconds": 10, "minDraftedTokens": 10**9, "consecutiveBreaches": 1,
             "probeAfterWindows": 1000,
             "latency": {"minRequests": 10, "ttftP95Ratio": 2.0, "tpotP95Ratio": 2.0}}
    replace = {"applyGateTuning": False, "strategy": {"type": "Replace"}}
    # Baselines from two requests a look (6.5 a second measured, not the 11 of four a look; a
    # window needs 10): enough for the 20 requests a baseline is asserted to hold, and well above
    # the load of the slowed release's windows (serial requests of most of a second each under
    # the quota: 2.4 a second at most, measured), so no breach is excused as a load shift
    # (serving_health.LOAD_SHIFT: above 1.5x the baseline's load).
    baseline_traffic, slowed_traffic = (lambda: traffic(ns, name, 2)), (lambda: traffic(ns, name, 4))
    took: dict[str, float] = {}
    start = time.monotonic()

    def mark(what: str) -> None:
        took[what] = round(time.monotonic() - start, 1)

    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(tiny_pair(name, target, draft, drift=drift, rollout=replace, gating=ONE_PROMPT_GATING))
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=300)
        mark("v1 serving")
        v1 = ns.wait_for_during("v1's latency baseline", lambda: baseline(ns, name, "1"),
                                during=baseline_traffic, timeout=120)
        mark("v1 baseline")

        # v2: another k, the same models; Replace, so it is promoted on its gate.
        set_spec(ns, name, {"speculation": {"k": 2, "fallbackThreshold": 0}})
        ns.wait_for("v2 serving", lambda: serving(ns, name, "2") and len(service_endpoints(ns, name)) == 1,
                    timeout=300)
        mark("v2 serving")
        v2 = ns.wait_for_during("v2's latency baseline", lambda: baseline(ns, name, "2"),
                                during=baseline_traffic, timeout=120)
        mark("v2 baseline")
        (v2_pod,) = engine_pods(ns, "2")

        # v2's engine gets slower: 2% of one CPU.
        with CpuQuota(0.02) as quota:
            assert quota.add_session(engine_session(ns, v2_pod))
            obj = ns.wait_for_during(
                "v2 rolled back to v1", lambda: (o := ns.pair(name)) and o["status"].get("servingVersion") == "1"
                and o, during=slowed_traffic, timeout=180)
            mark("rolled back")
        # Converged: v1 serves from a fresh pod, v2's is gone, and the pair is Stalled on its spec's
        # release (v2 stays out of service until the spec changes; kstatus: not Ready).
        obj = ns.wait_for("v1 serving from a fresh pod, v2's gone",
                          lambda: (o := ns.pair(name)) and cond(o, "Stalled").get("reason") == "ReleaseNotServable"
                          and cond(o, "Stalled").get("observedGeneration") == o["metadata"]["generation"]
                          and not engine_pods(ns, "2") and len(engine_pods(ns, "1")) == 1
                          and len(service_endpoints(ns, name)) == 1 and o, timeout=120)
        mark("converged")
        who = {("namespace", ns.name), ("pair", name)}
        rollbacks = operator_metrics().get(("specpair_rollbacks_total", frozenset(who | {("reason", "latency")})))

    assert runner.exception is None
    status = obj["status"]
    print("seconds since the pair was created", took)
    print("v1 baseline", v1, "\nv2 baseline", v2, "\nrolled back:", history(obj)[-2:])
    steps = [(h["action"], h["fromVersion"], h["toVersion"]) for h in history(obj)
             if h["action"] in ("SpeculationOff", "RolledBack")]
    assert steps == [("SpeculationOff", "2", "2"), ("RolledBack", "2", "1")], history(obj)
    off, rolled = (next(h for h in history(obj) if h["action"] == a) for a in ("SpeculationOff", "RolledBack"))
    assert "TPOT" in off["reason"] and "baseline p95" in off["reason"], off
    assert "v1 was faster" in rolled["reason"], rolled
    # The numbers: v2 judged against its own baseline, and slower than twice v1's too. TPOT breaches
    # in every run (the quota spreads each token over several periods); TTFT too unless the shared
    # cores are so busy that v2's baseline was already slow (then its numbers are checked the same).
    assert "TPOT p95" in rolled["reason"], rolled
    for what, key in (("TTFT", "ttftP95"), ("TPOT", "tpotP95")):
        found = re.search(rf"{what} p95 ([0-9.]+) ms \(baseline p95", rolled["reason"])
        if found is None:
            continue
        live_ms = float(found[1])
        assert f"{what} p95 {live_ms:.1f} ms (baseline p95 {v2[key]['code'] * 1000:.1f} ms" in rolled["reason"]
        assert live_ms > 2 * 1000 * max(v1[key]["code"], v2[key]["code"]), (what, live_ms, v1, v2)
    assert rollbacks == 1
    assert status["phase"] == "Degraded" and status["servingVersion"] == "1" and status["speculationEnabled"]
    ready = cond(obj, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ChampionKeepsServing", ready
    stalled = cond(obj, "Stalled")
    assert stalled["status"] == "True" and stalled["reason"] == "ReleaseNotServable", stalled
    assert "v2 was rolled back" in stalled["message"] and "v1 keeps serving" in stalled["message"], stalled
    drifted = cond(obj, "Drifted")
    assert drifted["status"] == "True" and drifted["reason"] == "RolledBack", drifted
    assert drifted["observedGeneration"] == obj["metadata"]["generation"]
    slow = ns.events("LatencyAboveBaseline")
    assert all(e["type"] == "Warning" for e in slow), slow
    assert any("category 'code' TPOT p95" in e["message"] for e in slow), slow
    assert ns.events("SpeculationOff") and ns.events("RolledBack")
    # Both baselines recorded from the real histograms, and kept across the rollback.
    kept = status["servingHealth"]["baselines"]
    assert kept["1"] == v1 and kept["2"] == v2
    for b in (v1, v2):
        assert b["requests"] >= 20 and b["errorRate"] == 0 and b["ttftP95"]["code"] > 0 and b["tpotP95"]["code"] > 0
    mlflow = MlflowClient(mlflow_server.url)
    assert mlflow.get_model_version_by_alias(model_name(ns, name), "champion").version == "1"
    assert "specpair.rolled_back" in mlflow.get_model_version(model_name(ns, name), "2").tags
