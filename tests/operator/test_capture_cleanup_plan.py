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


def test_a_namespace_being_deleted_lets_the_pair_go_with_its_claim():
    step = plan.decide(pair(CAPTURING, [CAPTURE_FINALIZER], True), None, namespace_terminating=True)
    assert (step.action, step.event[1]) == (plan.REMOVE_FINALIZER, "CaptureCleanupSkipped")


def apply(step, state):
    """What the operator's write of `step` leaves in the API server (the pair and its Job)."""
    fin = state["pair"]["metadata"]["finalizers"]
    if step.action == plan.ADD_FINALIZER:
        fin.append(CAPTURE_FINALIZER)
    elif step.action == plan.REMOVE_FINALIZER:
        fin.remove(CAPTURE_FINALIZER)
    elif step.action == plan.CREATE_JOB:
        state["job"] = job()


def test_each_write_happens_once_whatever_pass_reads_what_the_last_one_left():
    """The pair is armed, deleted, its Job runs and succeeds. Every pass reads the state afresh
    (an operator killed after any write loses only that pass's Event): a write, once visible, is
    never asked for again, and the pair ends without the finalizer."""
    state = {"pair": pair(CAPTURING), "job": None}
    writes = []
    for n in range(12):
        if n == 3:
            state["pair"]["metadata"]["deletionTimestamp"] = "2026-12-07T05:00:00Z"
        if n == 6 and state["job"] is not None:
            state["job"] = job("Complete")
        step = plan.decide(state["pair"], state["job"])
        if step.action in (plan.ADD_FINALIZER, plan.REMOVE_FINALIZER, plan.CREATE_JOB):
            apply(step, state)
            writes.append(step.action)
    assert writes == [plan.ADD_FINALIZER, plan.CREATE_JOB, plan.REMOVE_FINALIZER]
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
