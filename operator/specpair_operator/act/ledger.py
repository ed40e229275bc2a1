"""What one reconcile pass reports about a pair, gathered as the pass goes and written once.

The ledger holds the pair's status as the pass read it and what the pass adds: conditions,
history entries with their Events, the keys of the actions recorded (`status.recorded`, so a
redone step records once), other status fields, and exactly one report: the phase with the
kstatus summary (Ready, Reconciling, Stalled), made by one of the named helpers `ready`,
`reconciling` and `stalled`. A second report is refused unless it says it replaces the first
(`replacing=True`: a champion's action or an error that ends the pass), so no later call
silently overwrites an earlier one. `status_patch()` is the one write: every field that differs
from what the pass read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from specpair_operator.crd import conditions as c
from specpair_operator.act import metrics

HISTORY_LIMIT = 20
RECORDED_KEYS = 10  # per action in status.recorded


# What an absent list or map in status stands for: an empty one is not written over it.
_ABSENT: dict[str, Any] = {"history": [], "conditions": []}


class AlreadyReported(RuntimeError):
    """A second report in one pass that does not say it replaces the first."""


@dataclass(frozen=True)
class Report:
    """The phase and the three kstatus conditions, each (status, reason, message)."""
    phase: str
    ready: tuple[bool, str, str]
    reconciling: tuple[bool, str, str]
    stalled: tuple[bool, str, str]

    @property
    def message(self) -> str:
        for ok, _, message in (self.stalled, self.reconciling):
            if ok:
                return message
        return self.ready[2]


class StatusLedger:
    def __init__(self, status: dict[str, Any], generation: int | None, namespace: str, name: str,
                 logger: logging.Logger | logging.LoggerAdapter):
        self.status = status
        self.generation = generation
        self.namespace, self.name, self.logger = namespace, name, logger
        self.conditions: list[dict[str, Any]] = list(status.get("conditions") or [])
        self.history: list[dict[str, Any]] = list(status.get("history") or [])
        self.recorded: dict[str, list[str]] = {k: list(v) for k, v in (status.get("recorded") or {}).items()
                                               if isinstance(v, list)}
        self.fields: dict[str, Any] = {}          # status fields the pass sets besides the report
        self.events: list[tuple[str, str, str]] = []  # (type, reason, message), posted after the pass
        self.report: Report | None = None
        self.provisional = False  # the report stands only if no other one follows
        # (reason, message, condition message) of a transient error that ended the pass
        self.interruption: tuple[str, str, str] | None = None

    # -- what the pass found ---------------------------------------------------------------

    def cond(self, type_: str, status: bool | str, reason: str, message: str) -> None:
        self.conditions = c.set_condition(self.conditions, type_, status, reason, message, self.generation)

    def set(self, **fields: Any) -> None:
        self.fields.update(fields)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def was_recorded(self, action: str, key: str, version: str) -> bool:
        """Whether the action identified by `key` is in the status already. (A status written
        before `recorded` existed counts the last such history entry for the same version.)"""
        if "recorded" in self.status:
            return key in self.recorded.get(action, [])
        last = next((h for h in reversed(self.history) if h.get("action") == action), None)
        return last is not None and str(last.get("toVersion")) == str(version)

    def record(self, action: str, reason: str, from_version: str | None, to_version: str | None,
               warning: bool = False, key: str | None = None) -> None:
        """An action in history, as an Event, in the log and in the metrics; with `key`, also
        in status.recorded, so the pass that redoes it does not record it again."""
        if key is not None:
            self.recorded[action] = (self.recorded.get(action, []) + [key])[-RECORDED_KEYS:]
        self.history.append({"time": c.now_iso(), "action": action, "fromVersion": from_version or "",
                             "toVersion": to_version or "", "reason": reason})
        self.event("Warning" if warning else "Normal", action, reason)
        self.logger.info(f"{action}: {reason}")
        metrics.count(self.namespace, self.name, action, reason)

    # -- the report: one per pass ----------------------------------------------------------

    @property
    def reported(self) -> bool:
        return self.report is not None

    def _report(self, report: Report, replacing: bool, provisional: bool = False) -> None:
        if self.report is not None and not (replacing or self.provisional):
            raise AlreadyReported(f"{report.phase}/{report.ready[1]} after {self.report.phase}/{self.report.ready[1]}")
        self.report, self.provisional = report, provisional

    def ready(self, phase: str, reason: str, message: str, *, replacing: bool = False) -> None:
        """Ready: serving as it should (`phase` Serving, or Degraded while drift keeps
        speculation off)."""
        self._report(Report(phase, (True, reason, message), (False, reason, ""), (False, reason, "")), replacing)

    def reconciling(self, phase: str, reason: str, message: str, ready_message: str | None = None, *,
                    replacing: bool = False, provisional: bool = False) -> None:
        """Not ready yet, and the operator is on it (gating, rolling out, rolling back).
        `provisional`: what the pass reports unless it reports something else later (a gate in
        progress, unless the serving champion needs an action)."""
        self._report(Report(phase, (False, reason, message if ready_message is None else ready_message),
                            (True, reason, message), (False, reason, "")), replacing, provisional)

    def stalled(self, phase: str, reason: str, message: str, ready_reason: str | None = None,
                ready_message: str | None = None, *, replacing: bool = False) -> None:
        """Not ready, and no retry changes that until someone changes something."""
        ready_reason = ready_reason or reason
        self._report(Report(phase, (False, ready_reason, message if ready_message is None else ready_message),
                            (False, ready_reason, ""), (True, reason, message)), replacing)

    def stall(self, reason: str, message: str, *, replacing: bool = False) -> None:
        """Failed and Stalled, with a Warning Event when the message is new."""
        if self.status.get("message") != message:
            self.event("Warning", reason, message[:1000])
        self.stalled("Failed", reason, message, replacing=replacing)

    def interrupted(self, reason: str, message: str, condition_message: str) -> None:
        """A transient error ended the pass: Reconciling says why, what it had reported stays."""
        self.interruption = (reason, message, condition_message)

    # -- the one write ---------------------------------------------------------------------

    def status_patch(self) -> dict[str, Any]:
        """Every status field that differs from what the pass read (NaN and Infinity as null:
        the API server refuses a whole patch over one)."""
        out = dict(self.fields)
        if self.report is not None:
            r = self.report
            self.conditions = c.summary(self.conditions, self.generation, ready=r.ready,
                                        reconciling=r.reconciling, stalled=r.stalled)
            out.update(phase=r.phase, message=r.message, observedGeneration=self.generation)
        if self.interruption is not None:
            reason, message, condition_message = self.interruption
            self.cond(c.RECONCILING, True, reason, condition_message)
            out.update(message=message, observedGeneration=self.generation)
        out.update(conditions=self.conditions, history=self.history[-HISTORY_LIMIT:], recorded=self.recorded)
        if "recorded" not in self.status and not self.recorded and self.report is None:
            out.pop("recorded")
        if isinstance(out.get("drift"), dict):
            metrics.DRIFT_STEP.labels(self.namespace, self.name).set(int(out["drift"].get("stepsTaken", 0)))
        patch = {}
        for key, value in out.items():
            had = self.status.get(key, _ABSENT.get(key))
            if had != value:
                safe = c.finite(value)
                if safe is not value:
                    self.logger.warning(f"status.{key} held a number JSON cannot carry; written as null")
                patch[key] = replacing(had, safe)
        return patch


def replacing(had: Any, value: Any) -> Any:
    """`value` as a JSON merge patch (RFC 7386, how the status is written) that leaves exactly
    `value` where `had` was: every key of a map in `had` that `value` lacks is set to null.

    A pass sets a status field whole (SetStatus), but a merge patch merges maps key by key: a
    key the new value left out kept its old value. So after a learned release was promoted,
    status.drift.streaks kept the old champion's 38 breaching windows (the new champion's
    fresh ladder wrote streaks {}), and status.live.acceptance its last window, 0.09 over 276
    drafted tokens of the n-gram lookup, read as the new release's live figure."""
    if not isinstance(had, dict) or not isinstance(value, dict):
        return value
    out = {k: None for k in had if k not in value}
    for k, v in value.items():
        out[k] = replacing(had.get(k), v)
    return out
