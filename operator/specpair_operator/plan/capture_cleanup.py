"""What a pair's captured traffic needs next (issue 58, docs/learning.md): a pure decision from
the pair as the API server holds it and its clean-up Job as read.

A pair that captures (spec.learning.enabled, a claim named) and does not keep its capture
(keepOnDelete) carries the finalizer CAPTURE_FINALIZER; once it is being deleted, a Job deletes
its folder on the claim, and the finalizer goes when that Job succeeded. The Job runs only once
the pair's engine pods are gone: they capture what they serve until they stop, and they go by
garbage collection only after the finalizer, so a pod opening its next shard (every 60 s or 256
records) after the Job would create the folder again. Each
answer holds from any state the last pass left (the engines scaled down or not, their pods gone
or not, the finalizer added or not, the Job created or not, finished or not), so an operator
killed anywhere on the way converges on its next pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from specpair_operator.crd.conditions import parse_iso
from specpair_operator.desired.learning import ANN_PAIR_UID, CAPTURE_FINALIZER, Learning, capture_dir
from specpair_operator.desired.pod_shutdown import shutdown_of

NONE, ADD_FINALIZER, REMOVE_FINALIZER, CREATE_JOB, WAIT = "none", "add-finalizer", "remove-finalizer", "create-job", "wait"
# Scale the pair's engine Deployments (CleanupStep.scale_down) to 0 replicas.
STOP_ENGINES = "stop-engines"
# An engine pod still there this long past its grace period (rollout.shutdown), counted from the
# pair's deletion, is said in a Warning: the scale-down comes at the first pass after it, so a pod
# that should have stopped by then is held (another's finalizer, a node gone unreachable) and the
# pair stays Terminating until it goes.
ENGINES_STOP_MARGIN_SECONDS = 300


@dataclass(frozen=True)
class CleanupStep:
    action: str
    # The Event that says so: (type, reason, message); None: nothing to say (waiting, nothing to do).
    event: tuple[str, str, str] | None = None
    # STOP_ENGINES: the engine Deployments to scale to 0 replicas, by name.
    scale_down: tuple[str, ...] = ()


def _job_state(job: Mapping[str, Any] | None) -> str:
    """'absent', 'running', 'succeeded' or 'failed' (Kubernetes gave up: backoffLimit or deadline)."""
    if job is None:
        return "absent"
    status = job.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "SuccessCriteriaMet"):
            return "succeeded"
        if cond.get("status") == "True" and cond.get("type") in ("Failed", "FailureTarget"):
            return "failed"
    return "running"


def decide(pair: Mapping[str, Any], job: Mapping[str, Any] | None = None,
           namespace_terminating: bool = False, *, engines: Mapping[str, int] | None = None,
           engine_pods: Sequence[str] = (), now: str | None = None) -> CleanupStep:
    """The next step for `pair` (its body); `job`: its clean-up Job as read (None: absent);
    `namespace_terminating`: the API server refused to create the Job because the namespace is
    being deleted (its claim goes with it); `engines`: the pair's engine Deployments (champion
    and canary) as read, name -> spec.replicas; `engine_pods`: the names of its engine pods that
    still exist, running or terminating (a stopping pod still finishes, and captures, the
    requests it drains); `now`: the time of the pass (RFC 3339), against the pair's deletion."""
    meta = pair.get("metadata") or {}
    name = meta.get("name", "")
    has = CAPTURE_FINALIZER in (meta.get("finalizers") or [])
    learning = Learning.from_spec(pair.get("spec") or {})
    # Once it captured, the finalizer stays while the claim is named and the capture not kept:
    # traffic captured before learning was turned off is on the claim still.
    wanted = bool(learning.claim) and not learning.keep_on_delete and (learning.enabled or has)
    where = f"{capture_dir(name)} on PersistentVolumeClaim {learning.claim}"
    if not meta.get("deletionTimestamp"):
        if wanted and not has:
            return CleanupStep(ADD_FINALIZER, ("Normal", "CaptureCleanupArmed",
                                               f"captured traffic ({where}) is deleted with the pair; "
                                               f"learning.keepOnDelete keeps it"))
        if has and not wanted:
            return CleanupStep(REMOVE_FINALIZER, ("Normal", "CaptureKeptOnDelete",
                                                  "captured traffic is kept when the pair is deleted "
                                                  "(learning.keepOnDelete, or no claim named)"))
        return CleanupStep(NONE)
    if not has:
        return CleanupStep(NONE)
    if not wanted:
        return CleanupStep(REMOVE_FINALIZER, ("Normal", "CaptureKept",
                                              f"the pair goes; its captured traffic ({where}) is kept"))
    if namespace_terminating:
        return CleanupStep(REMOVE_FINALIZER, ("Normal", "CaptureCleanupSkipped",
                                              "the namespace is being deleted, with the claim the captured "
                                              "traffic is on: no clean-up Job can run in it"))
    # No pod may capture once the Job has deleted the folder: the engines first, scaled to 0
    # (the pair's own pass, which would scale them back, no longer runs for a pair being
    # deleted; its autoscaler scales the pair, not the Deployments), then the Job once their
    # last pod is gone.
    running = tuple(sorted(name for name, replicas in (engines or {}).items() if replicas > 0))
    if running:
        return CleanupStep(STOP_ENGINES, ("Normal", "CaptureEnginesStopping",
                                          f"scaling {', '.join(running)} to 0 replicas: their pods capture until "
                                          f"they stop, so {where} is deleted once none is left"), running)
    if engine_pods:
        grace = shutdown_of((pair.get("spec") or {}).get("rollout") or {}).grace_period
        deleting = (parse_iso(now) - parse_iso(meta["deletionTimestamp"])).total_seconds() if now else 0.0
        if deleting > grace + ENGINES_STOP_MARGIN_SECONDS:
            return CleanupStep(WAIT, ("Warning", "CaptureEnginesNotStopping",
                                      f"engine pod {', '.join(sorted(engine_pods))} still there {deleting:.0f} s "
                                      f"after the pair's deletion (grace period {grace} s): {where} is deleted, "
                                      f"and the pair goes, only once no engine pod is left; see why it stays "
                                      f"(its finalizers, its node), or set learning.keepOnDelete"))
        return CleanupStep(WAIT)
    if job is not None and (job.get("metadata") or {}).get("annotations", {}).get(ANN_PAIR_UID) != meta.get("uid"):
        return CleanupStep(WAIT, ("Warning", "CaptureCleanupBlocked",
                                  f"Job {job['metadata'].get('name')} is not this pair's clean-up; "
                                  f"delete it, or set learning.keepOnDelete to keep the traffic"))
    state = _job_state(job)
    if state == "absent":
        return CleanupStep(CREATE_JOB, ("Normal", "CaptureCleanupStarted", f"deleting captured traffic ({where})"))
    if state == "succeeded":
        return CleanupStep(REMOVE_FINALIZER, ("Normal", "CaptureDeleted",
                                              f"captured traffic deleted ({where}); the pair goes"))
    if state == "failed":
        return CleanupStep(WAIT, ("Warning", "CaptureCleanupFailed",
                                  f"Job {job['metadata'].get('name')} could not delete {where}; the pair "
                                  f"stays until it can (the Job is retried once it is deleted, or after its "
                                  f"TTL) or until learning.keepOnDelete is set"))
    return CleanupStep(WAIT)
