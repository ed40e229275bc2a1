"""Deleting a pair deletes the traffic it captured unless told to keep it (issue 58,
docs/learning.md): the decision (plan/capture_cleanup.py) as a table, the clean-up Job it runs
(desired/learning.py), and that Job's command on a real folder of captured shards."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specpair import capture
from specpair.capture import CaptureSettings, CaptureWriter
from specpair_operator.desired import learning
from specpair_operator.desired.learning import CAPTURE_FINALIZER, capture_cleanup_job, cleanup_job_name
from specpair_operator.desired.pod_shutdown import shutdown_of
from specpair_operator.plan import capture_cleanup as plan

UID = "0b9f6c1e-7d2a-4c55-9a57-2f1f1d9b2a10"
CAPTURING = {"enabled": True, "persistentVolumeClaim": "traffic"}


def pair(learning_spec=None, finalizers=(), deleting=False):
    meta = {"name": "chat", "namespace": "team", "uid": UID, "resourceVersion": "7", "finalizers": list(finalizers)}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T05:00:00Z"
    return {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": meta,
            "spec": {"target": {"source": "default"}, "draft": {"drafter": "ngram"},
                     **({"learning": learning_spec} if learning_spec is not None else {})}}


def job(*conditions, uid=UID):
    return {"metadata": {"name": cleanup_job_name("chat", uid), "uid": "job-1",
                         "annotations": {learning.ANN_PAIR_UID: uid}},
            "status": {"conditions": [{"type": t, "status": "True"} for t in conditions]}}


@pytest.mark.parametrize("what, body, live_job, action, reason", [
    ("no learning: nothing", pair(), None, plan.NONE, None),
    ("learning off: nothing", pair({"enabled": False, "persistentVolumeClaim": "traffic"}), None, plan.NONE, None),
    ("capturing: the finalizer", pair(CAPTURING), None, plan.ADD_FINALIZER, "CaptureCleanupArmed"),
    ("capturing, armed: nothing", pair(CAPTURING, [CAPTURE_FINALIZER]), None, plan.NONE, None),
    ("kept on delete: no finalizer", pair({**CAPTURING, "keepOnDelete": True}), None, plan.NONE, None),
    ("kept on delete once armed: the finalizer goes", pair({**CAPTURING, "keepOnDelete": True}, [CAPTURE_FINALIZER]),
     None, plan.REMOVE_FINALIZER, "CaptureKeptOnDelete"),
    ("turned off after capturing: still deleted with the pair",
     pair({"enabled": False, "persistentVolumeClaim": "traffic"}, [CAPTURE_FINALIZER]), None, plan.NONE, None),
    ("another's finalizer is not ours", pair(CAPTURING, ["example.com/x", CAPTURE_FINALIZER]), None, plan.NONE, None),
    ("deleting without the finalizer: nothing", pair(CAPTURING, deleting=True), None, plan.NONE, None),
    ("deleting: the clean-up Job", pair(CAPTURING, [CAPTURE_FINALIZER], True), None, plan.CREATE_JOB,
     "CaptureCleanupStarted"),
    ("deleting, the Job running: wait", pair(CAPTURING, [CAPTURE_FINALIZER], True), job(), plan.WAIT, None),
    ("deleting, the Job done: the finalizer goes", pair(CAPTURING, [CAPTURE_FINALIZER], True), job("Complete"),
     plan.REMOVE_FINALIZER, "CaptureDeleted"),
    ("deleting, the Job failed: stays, said", pair(CAPTURING, [CAPTURE_FINALIZER], True), job("Failed"), plan.WAIT,
     "CaptureCleanupFailed"),
    ("deleting, keepOnDelete set meanwhile: the pair goes", pair({**CAPTURING, "keepOnDelete": True},
                                                                 [CAPTURE_FINALIZER], True), job("Failed"),
     plan.REMOVE_FINALIZER, "CaptureKept"),
    ("deleting, a Job of the name that is not this pair's", pair(CAPTURING, [CAPTURE_FINALIZER], True),
     job("Complete", uid="another"), plan.WAIT, "CaptureCleanupBlocked"),
])
def test_the_decision(what, body, live_job, action, reason):
    step = plan.decide(body, live_job)
    assert (step.action, step.event and step.event[1]) == (action, reason), what


DELETING = pair(CAPTURING, [CAPTURE_FINALIZER], True)
ENGINE, CANARY = "chat-engine", "chat-engine-canary"


def pods(n: int) -> list[str]:
    """Names of n engine pods still there."""
    return [f"{ENGINE}-5d8f7-{i}" for i in range(n)]


@pytest.mark.parametrize("what, live_job, engines, pods, action, reason, scaled", [
    # Each row fails on the old order (the Job at once, the finalizer off when it succeeded):
    # an engine pod still serving writes the pair's folder again after the Job deleted it.
    ("engines serving: scaled to 0 first, no clean-up yet", None, {ENGINE: 2}, pods(2), plan.STOP_ENGINES,
     "CaptureEnginesStopping", (ENGINE,)),
    ("a canary beside the champion: both", None, {ENGINE: 1, CANARY: 1}, pods(2), plan.STOP_ENGINES,
     "CaptureEnginesStopping", (ENGINE, CANARY)),
    ("only the ones not yet at 0", None, {ENGINE: 0, CANARY: 1}, pods(3), plan.STOP_ENGINES, "CaptureEnginesStopping",
     (CANARY,)),
    ("scaled to 0, pods still stopping: no clean-up yet", None, {ENGINE: 0}, pods(1), plan.WAIT, None, ()),
    ("no pod left: the clean-up Job", None, {ENGINE: 0}, pods(0), plan.CREATE_JOB, "CaptureCleanupStarted", ()),
    ("Deployments gone, no pod: the clean-up Job", None, {}, pods(0), plan.CREATE_JOB, "CaptureCleanupStarted", ()),
    ("clean-up done, no pod: the finalizer goes", job("Complete"), {ENGINE: 0}, pods(0), plan.REMOVE_FINALIZER,
     "CaptureDeleted", ()),
    # Scaled back up meanwhile (by hand): stopped again before the finalizer goes.
    ("clean-up done, an engine back: stopped again", job("Complete"), {ENGINE: 1}, pods(1), plan.STOP_ENGINES,
     "CaptureEnginesStopping", (ENGINE,)),
    ("clean-up done, a pod still stopping: the finalizer stays", job("Complete"), {ENGINE: 0}, pods(1), plan.WAIT,
     None, ()),
])
def test_the_clean_up_waits_for_the_engines_to_stop(what, live_job, engines, pods, action, reason, scaled):
    step = plan.decide(DELETING, live_job, engines=engines, engine_pods=pods)
    assert (step.action, step.event and step.event[1], step.scale_down) == (action, reason, scaled), what


def test_engines_are_left_serving_until_the_pair_is_deleted_and_when_its_capture_is_kept():
    assert plan.decide(pair(CAPTURING, [CAPTURE_FINALIZER]), None, engines={ENGINE: 2},
                       engine_pods=pods(2)).action == plan.NONE
    kept = pair({**CAPTURING, "keepOnDelete": True}, [CAPTURE_FINALIZER], True)
    assert plan.decide(kept, None, engines={ENGINE: 2}, engine_pods=pods(2)).action == plan.REMOVE_FINALIZER


# The pair's deletion at 05:00:00; the default grace period (rollout.shutdown) plus the margin.
GRACE = shutdown_of({}).grace_period
WARN_AFTER = GRACE + plan.ENGINES_STOP_MARGIN_SECONDS


def after(seconds: int) -> str:
    """The time `seconds` after the pair's deletion (under an hour)."""
    return f"2026-12-07T05:{seconds // 60:02d}:{seconds % 60:02d}Z"


@pytest.mark.parametrize("what, live_job, engines, left, now, reason", [
    ("a pod stopping within its grace period: quiet", None, {ENGINE: 0}, 1, after(20), None),
    ("at the wait's end: quiet still", None, {ENGINE: 0}, 1, after(WARN_AFTER), None),
    ("a second past it: said, with the pod's name", None, {ENGINE: 0}, 1, after(WARN_AFTER + 1),
     "CaptureEnginesNotStopping"),
    ("past it, the Job done meanwhile: said, the finalizer stays", job("Complete"), {ENGINE: 0}, 2,
     "2026-12-07T06:00:00Z", "CaptureEnginesNotStopping"),
    ("no time given (as before): quiet", None, {ENGINE: 0}, 1, None, None),
])
def test_an_engine_pod_that_never_goes_is_said_in_a_warning(what, live_job, engines, left, now, reason):
    """A pod held past its grace period (another's finalizer, a node gone) keeps the pair
    Terminating: the clean-up still waits (no Job beside it), and says which pod after a
    generous wait."""
    step = plan.decide(DELETING, live_job, engines=engines, engine_pods=pods(left), now=now)
    assert (step.action, step.event and step.event[0], step.event and step.event[1]) == (
        plan.WAIT, reason and "Warning", reason), what
    if reason:
        assert all(name in step.event[2] for name in pods(left)), step.event


def test_a_namespace_being_deleted_lets_the_pair_go_with_its_claim():
    step = plan.decide(pair(CAPTURING, [CAPTURE_FINALIZER], True), None, namespace_terminating=True)
    assert (step.action, step.event[1]) == (plan.REMOVE_FINALIZER, "CaptureCleanupSkipped")


def apply(step, state):
    """What the operator's write of `step` leaves in the API server (the pair, its Job, its
    engines' replicas)."""
    fin = state["pair"]["metadata"]["finalizers"]
    if step.action == plan.STOP_ENGINES:
        state["engines"].update({name: 0 for name in step.scale_down})
    elif step.action == plan.ADD_FINALIZER:
        fin.append(CAPTURE_FINALIZER)
    elif step.action == plan.REMOVE_FINALIZER:
        fin.remove(CAPTURE_FINALIZER)
    elif step.action == plan.CREATE_JOB:
        state["job"] = job()


def test_each_write_happens_once_whatever_pass_reads_what_the_last_one_left():
    """The pair is armed, deleted, its engines scaled down, their pods stop, its Job runs and
    succeeds. Every pass reads the state afresh (an operator killed after any write loses only
    that pass's Event): a write, once visible, is never asked for again, no Job exists while an
    engine pod does, and the pair ends without the finalizer."""
    state = {"pair": pair(CAPTURING), "job": None, "engines": {"chat-engine": 2}}
    writes, left = [], 2
    for n in range(16):
        if n == 3:
            state["pair"]["metadata"]["deletionTimestamp"] = "2026-12-07T05:00:00Z"
        if 6 <= n and state["engines"]["chat-engine"] == 0:
            left = max(0, left - 1)    # the Deployment's pods stop, one a pass
        if n == 11 and state["job"] is not None:
            state["job"] = job("Complete")
        step = plan.decide(state["pair"], state["job"], engines=state["engines"], engine_pods=pods(left))
        if step.action in (plan.ADD_FINALIZER, plan.REMOVE_FINALIZER, plan.CREATE_JOB, plan.STOP_ENGINES):
            apply(step, state)
            writes.append(step.action)
        assert not (state["job"] and left), f"pass {n}: the clean-up Job beside a running engine pod"
    assert writes == [plan.ADD_FINALIZER, plan.STOP_ENGINES, plan.CREATE_JOB, plan.REMOVE_FINALIZER]
    assert state["pair"]["metadata"]["finalizers"] == []


def test_the_clean_up_job_removes_the_pairs_folder_as_the_engines_user():
    j = capture_cleanup_job("chat", "team", UID, "traffic", {"image": "registry/engine:1"})
    assert j["metadata"]["name"] == cleanup_job_name("chat", UID) and "ownerReferences" not in j["metadata"]
    assert j["metadata"]["annotations"][learning.ANN_PAIR_UID] == UID
    spec = j["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["image"] == "registry/engine:1"
    assert container["command"] == ["python", "-m", "specpair.capture", "remove", learning.capture_dir("chat")]
    assert spec["volumes"] == [{"name": "capture", "persistentVolumeClaim": {"claimName": "traffic"}}]
    assert container["volumeMounts"] == [{"name": "capture", "mountPath": learning.CAPTURE_MOUNT_PATH}]
    assert spec["securityContext"]["runAsNonRoot"] and spec["automountServiceAccountToken"] is False
    assert j["spec"]["activeDeadlineSeconds"] and j["spec"]["ttlSecondsAfterFinished"]
    # Another pair made under the same name later has its own Job.
    assert cleanup_job_name("chat", "ffffffff-0000") != cleanup_job_name("chat", UID)


def test_the_jobs_command_deletes_a_pairs_folder_and_nothing_beside_it(tmp_path):
    pair_dir, other = tmp_path / "chat", tmp_path / "other-pair"
    for folder in (pair_dir, other):
        writer = CaptureWriter(CaptureSettings(directory=str(folder), sample_rate=1.0), release="1", pod="p")
        writer.start()
        for i in range(3):
            writer.offer("code", [i], [i])
        writer.flush()
        writer.stop()
    done = subprocess.run([sys.executable, "-m", "specpair.capture", "remove", str(pair_dir)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "3 records" in done.stdout, done
    assert not pair_dir.exists() and len(list(capture.read_records(other, "code"))) == 3
    again = subprocess.run([sys.executable, "-m", "specpair.capture", "remove", str(pair_dir)],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "0 records" in again.stdout     # a rerun after a crash: done already
