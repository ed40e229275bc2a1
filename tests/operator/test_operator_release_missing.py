"""The registered model behind a serving pair deleted in MLflow (issue 54): the status said
`Gating`, "gate Job ... running", for ever, though that Job had completed long before. Now the
plan sees that the registry lost the release's verdict (plan.release_lost), says so
(ReleaseMissing: a history entry, an Event, the Reconciling reason), and gates the release,
registered again by the pass, in a new attempt, the engine serving meanwhile; with no attempt
left it stalls with the reason. The plan as tables, then the real thing against real MLflow and
the real control plane.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid

import pytest

from plan_tables import MODEL, NOW, NS, PAIR, TH, release_tags, reported
from specpair_operator.gate import attempts as gate_attempts
from specpair_operator.desired import manifests
from specpair_operator.plan import release_steps as rs
from specpair_operator.plan import release_gate as rg
from specpair_operator.plan import release_plan as p
from specpair_operator.release.registry_contract import TAG_HASH
from specpair_operator.observe.world import GateJob, Records, ReleaseWorld

TAGS = release_tags({"target": {"source": "default"}, "draft": {"drafter": "ngram"}})
DIGEST = TAGS[TAG_HASH]
VERDICT = {"passed": True, "reasons": [], "greedyIdentity": 1.0, "acceptanceRate": 0.7, "speedup": 1.6,
           "categories": {"code": {"acceptanceRate": 0.8}}, "tokenizer": {"compatible": True, "differences": []}}


def ago(seconds: float) -> str:
    at = dt.datetime.fromisoformat(NOW.replace("Z", "+00:00")) - dt.timedelta(seconds=seconds)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def job(attempt: int, **state) -> GateJob:
    return GateJob(manifests.gate_job_name(PAIR, DIGEST, attempt), started_at=ago(600), **state)


OLD_GATE = job(1, complete=True, completed_at=ago(120), reports=(reported({**VERDICT, "speedup": 1.5}, "1"),))


def lost_world(**changes) -> ReleaseWorld:
    """The pass after the registered model was deleted: it made the model again and registered the
    spec's release as v1 with none of its tags; aliases gone (no champion), no verdict, and the
    gate Job of the release (the same digest) complete since long ago; the status as it was."""
    w = ReleaseWorld(pair=PAIR, namespace=NS, version="1", digest=DIGEST, thresholds=TH, aliases={},
                     tags=dict(TAGS), gate_status="pending", gate_jobs=(OLD_GATE,), gate_policy_owned=True,
                     verified_verdicts={"1": "old-digest"},
                     records=Records({"GateStarted": ("1",), "GatePassed": ("1",), "Promoted": ("1@x",)}), now=NOW)
    return dataclasses.replace(w, **changes)


def of(steps, kind):
    return [s for s in steps if isinstance(s, kind)]


def report(steps) -> rs.Report:
    (r,) = of(steps, rs.Report)
    return r


def test_a_lost_release_is_said_and_gated_again_in_a_new_attempt_while_the_engine_serves():
    steps = p.plan_release(lost_world())
    assert of(steps, rs.StartGateJob) == [rs.StartGateJob("1", 2)]
    (rec,) = [r for r in of(steps, rs.Record) if r.action == rg.RELEASE_MISSING]
    assert rec.warning and rec.key == "1#2" and "MLflow has no gate verdict for v1" in rec.reason
    assert "registered again as v1 and gated again; the engine keeps serving" in rec.reason
    r = report(steps)
    assert (r.how, r.reason) == ("reconciling", rg.RELEASE_MISSING)
    assert "MLflow lost v1's gate verdict" in r.message and manifests.gate_job_name(PAIR, DIGEST, 2) in r.message
    # The old verdict's digest goes (a merge patch's null), so the new gate's own is verified.
    assert rs.SetStatus({"verifiedVerdicts": {"1": None}}) in steps
    (serve,) = of(steps, rs.ServeChampion)
    assert serve.desired is None and serve.while_gating   # the engine's Deployment is left as it is
    assert not [r for r in of(steps, rs.Record) if r.action == "GateRetrying"]


def test_a_gate_job_that_just_completed_is_not_taken_for_a_lost_verdict():
    """Its verdict may have landed after this pass read the tags: VERDICT_GRACE_S."""
    fresh = dataclasses.replace(OLD_GATE, completed_at=ago(rg.VERDICT_GRACE_S - 5))
    steps = p.plan_release(lost_world(gate_jobs=(fresh,), verified_verdicts={}))
    assert not of(steps, rs.StartGateJob) and report(steps).reason == "Gating"
    assert not [r for r in of(steps, rs.Record) if r.action == rg.RELEASE_MISSING]
    later = p.plan_release(lost_world(gate_jobs=(dataclasses.replace(OLD_GATE, completed_at=ago(rg.VERDICT_GRACE_S)),),
                                      verified_verdicts={}))
    assert of(later, rs.StartGateJob) == [rs.StartGateJob("1", 2)]


def test_while_the_new_attempt_runs_the_status_still_says_why():
    running = lost_world(gate_jobs=(OLD_GATE, job(2)), verified_verdicts={},
                         records=Records({"GateStarted": ("1",), rg.RELEASE_MISSING: ("1#2",)}))
    steps = p.plan_release(running)
    assert not of(steps, rs.StartGateJob) and not [r for r in of(steps, rs.Record) if r.action == "GateRetrying"]
    r = report(steps)
    assert r.reason == rg.RELEASE_MISSING and "gate Job " + manifests.gate_job_name(PAIR, DIGEST, 2) + " running" \
        in r.message


def test_the_new_attempts_verdict_is_verified_and_promoted():
    new = {**VERDICT, "speedup": 1.7}
    done = lost_world(gate_status="passed", verdict=new, verified_verdicts={},
                      gate_jobs=(OLD_GATE, job(2, complete=True, completed_at=ago(1), reports=(reported(new, "1"),))),
                      records=Records({"GateStarted": ("1",), rg.RELEASE_MISSING: ("1#2",)}))
    steps = p.plan_release(done)
    assert rs.SetAlias("champion", "1") in steps
    assert [r.action for r in of(steps, rs.Record) if r.warning] == []      # no VerdictMismatch, no retry
    (serve,) = of(steps, rs.ServeChampion)
    assert serve.desired == "1" and serve.aliases["champion"] == "1"


def test_with_no_attempt_left_it_stalls_with_the_reason():
    policy = gate_attempts.Policy(attempts=2)
    spent = lost_world(attempts=policy, verified_verdicts={},
                       gate_jobs=(OLD_GATE, job(2, complete=True, completed_at=ago(60))))
    steps = p.plan_release(spent)
    assert not of(steps, rs.StartGateJob)
    r = report(steps)
    assert (r.how, r.reason) == ("stalled", rg.RELEASE_MISSING) and "delete the pair's gate Jobs" in r.message


@pytest.mark.parametrize("changes", [
    {"gate_status": "passed", "verdict": VERDICT},                 # the verdict is there
    {"gate_jobs": (job(1),), "verified_verdicts": {}},            # the gate still runs
    {"gate_jobs": (), "verified_verdicts": {}},                   # no gate yet
    {"gate_jobs": (job(1, failed=True, failed_at=ago(60)),), "verified_verdicts": {}},   # failed: a retry's business
])
def test_nothing_is_lost_otherwise(changes):
    assert rg.release_lost(lost_world(**changes)) == ""


# -- against real MLflow, on the real control plane -------------------------------------------------

@pytest.mark.slow
def test_deleting_the_registered_model_behind_a_serving_pair_regates_it_while_the_engine_serves(env, mlflow_server):
    from kopf.testing import KopfRunner
    from mlflow import MlflowClient

    from cluster_env import OPERATOR, REPLACE, cond, engine_pods, model_name, pair, serving

    ns = env
    name = f"lost-{uuid.uuid4().hex[:5]}"
    model = model_name(ns, name)
    mlflow = MlflowClient(mlflow_server.url)
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(pair(name, "good-draft", rollout=REPLACE))
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)
        serving_pods = {pod["metadata"]["uid"] for pod in engine_pods(ns)}
        ns.wait_for("the gate Job complete", lambda: all(
            any(c["type"] == "Complete" and c["status"] == "True" for c in (j.get("status") or {}).get("conditions") or [])
            for j in ns.list("batch/v1", "Job")), timeout=60)

        mlflow.delete_registered_model(model)
        obj = ns.wait_for("the lost release said", lambda: (o := ns.pair(name)) and any(
            h["action"] == rg.RELEASE_MISSING for h in o["status"].get("history") or []) and o, timeout=90)
        (entry,) = [h for h in obj["status"]["history"] if h["action"] == rg.RELEASE_MISSING]
        assert "MLflow has no gate verdict for v1" in entry["reason"] and "gated again" in entry["reason"]
        ns.wait_for_event(rg.RELEASE_MISSING, "the engine keeps serving its release meanwhile")

        obj = ns.wait_for("v1 serving again from the model made anew", lambda: serving(ns, name, "1")
                          and mlflow.get_registered_model(model).aliases.get("champion") == "1"
                          and ns.pair(name), timeout=120)
        assert cond(obj, "Gated")["status"] == "True" and cond(obj, "Stalled")["status"] == "False"
        assert mlflow.get_model_version(model, "1").tags["specpair.gate.status"] == "passed"
        assert sorted(j["metadata"]["name"] for j in ns.list("batch/v1", "Job")) == [
            manifests.gate_job_name(name, obj["status"]["contentHash"], 1),
            manifests.gate_job_name(name, obj["status"]["contentHash"], 2)]
        # The engine served throughout: the same pods, never rolled.
        assert {pod["metadata"]["uid"] for pod in engine_pods(ns)} == serving_pods
        assert not ns.events("VerdictMismatch")
    assert runner.exception is None
