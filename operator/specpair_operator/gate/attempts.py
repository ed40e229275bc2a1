"""A gate Job that ends without a verdict is no verdict: the release is gated again.

The gate runner (gate/runner.py) writes why it failed into its termination message, which the
kubelet copies into the pod's status; the operator reads it from there (`failure_of`), and
`next_step` decides, from how many attempts failed and how long ago the last one did, whether to
start the next attempt now, wait, or give up and report GateError. Each attempt is a Job of its
own (manifests.gate_job_name(pair, digest, attempt)), so nothing is deleted and every attempt's
pod and log stay there to be read. Only a verdict (passed or failed) ends the gating otherwise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

GATE_CRASHED = "GateCrashed"            # the gate command ended without writing a verdict
MLFLOW_UNREACHABLE = "MLflowUnreachable"  # a verdict, but MLflow could not take it before the deadline
JOB_FAILED = "JobFailed"                # no word from the runner (killed at the deadline, evicted, ...)
RETRY, WAIT, GIVE_UP = "retry", "wait", "give-up"
MESSAGE_LIMIT = 1500  # a termination message holds 4096 bytes at most


def failure_report(version: str, cause: str, message: str) -> dict[str, str]:
    """What the runner writes into its termination message when it has no verdict to report."""
    return {"version": str(version), "cause": cause, "error": message[-MESSAGE_LIMIT:]}


@dataclass(frozen=True)
class Failure:
    cause: str
    message: str

    def describe(self) -> str:
        if self.cause == MLFLOW_UNREACHABLE:
            return f"MLflow unreachable: {self.message}"
        return self.message


def failure_of(termination_messages: list[str], version: str, job_message: str) -> Failure:
    """Why an attempt failed: the runner's report for this version, else the Job's own words."""
    for text in termination_messages:
        try:
            report = json.loads(text)
        except ValueError:
            continue
        if isinstance(report, dict) and str(report.get("version")) == str(version) \
                and isinstance(report.get("cause"), str) and isinstance(report.get("error"), str):
            return Failure(report["cause"], report["error"])
    return Failure(JOB_FAILED, f"gate Job failed: {job_message or 'no reason given'}")


@dataclass(frozen=True)
class Policy:
    """How often a release is gated before its gate counts as broken, and the wait before the
    second attempt (doubling after each further failure)."""
    attempts: int = 3
    delay_s: float = 30.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Policy":
        env = os.environ if env is None else env
        raw_attempts = env.get("SPECPAIR_GATE_ATTEMPTS", "") or str(cls.attempts)
        raw_delay = env.get("SPECPAIR_GATE_RETRY_DELAY_SECONDS", "") or str(cls.delay_s)
        try:
            attempts, delay = int(raw_attempts), float(raw_delay)
        except ValueError:
            attempts, delay = 0, -1.0
        if attempts < 1 or not delay >= 0:
            raise ValueError(f"SPECPAIR_GATE_ATTEMPTS={raw_attempts!r} must be an integer >= 1 and "
                             f"SPECPAIR_GATE_RETRY_DELAY_SECONDS={raw_delay!r} a number >= 0")
        return cls(attempts, delay)


def next_step(policy: Policy, failed: int, since_last_failure_s: float) -> tuple[str, float]:
    """(RETRY, 0), (WAIT, seconds left) or (GIVE_UP, 0), after `failed` attempts without a
    verdict, the last one `since_last_failure_s` ago."""
    if failed >= policy.attempts:
        return GIVE_UP, 0.0
    left = policy.delay_s * 2 ** (failed - 1) - since_last_failure_s
    return (WAIT, left) if left > 0 else (RETRY, 0.0)


def job_failed(job: dict[str, Any] | None) -> tuple[bool, str, str]:
    """(failed, the Job's message, when it failed) from a Job's Failed condition."""
    for cd in ((job or {}).get("status") or {}).get("conditions") or []:
        if cd.get("type") == "Failed" and cd.get("status") == "True":
            return True, cd.get("message") or cd.get("reason") or "", cd.get("lastTransitionTime") or ""
    return False, "", ""
