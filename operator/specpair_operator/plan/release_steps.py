"""The release plan's steps and the list a pass's release plan fills (plan/release_plan.py).

The writes to MLflow and the API server, what goes into the status (written once, when the pass
ends: history entries with their Events, conditions, fields, the one report), and last the
champion's serving. The serving plans emit the status steps too; plan/steps.py is the union act
matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping

from specpair_operator.observe.world import ReleaseWorld
from specpair_operator.release import aliases as aliases_mod

if TYPE_CHECKING:
    from specpair_operator.plan.steps import Step   # the union of every plan's steps


# -- writes ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SetAlias:
    """Point an MLflow alias of the pair's registered model (candidate, champion, previous) at a
    version: how a release is gated, promoted and rolled back."""
    alias: str
    version: str


@dataclass(frozen=True)
class TagVersion:
    """Tags on a model version: the crash marks written before the move they stand for (promoted
    at, speculation off), a shadow's or canary's verdict; an empty value clears a tag."""
    version: str
    tags: Mapping[str, str]


@dataclass(frozen=True)
class EnsureGatePolicy:
    """The gate pods' NetworkPolicy (no ingress), before the first gate pod exists."""


@dataclass(frozen=True)
class StartGateJob:
    """Create the gate Job of the spec's release, attempt `attempt` (each attempt a Job of its own,
    gate_objects.gate_job)."""
    version: str
    attempt: int


@dataclass(frozen=True)
class RecordGateError:
    """The gate is broken for good: GateError in the version's tags."""
    version: str
    reason: str


# -- status (written once, when the pass ends) -------------------------------------------------

@dataclass(frozen=True)
class Record:
    """A history entry with its Event; `key` makes it once-only (status.recorded)."""
    action: str
    reason: str
    from_version: str | None
    to_version: str | None
    warning: bool = False
    key: str | None = None


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool | str
    reason: str
    message: str


@dataclass(frozen=True)
class SetStatus:
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class PostEvent:
    type: str
    reason: str
    message: str


ReportHow = Literal["ready", "reconciling", "stalled", "stall"]


@dataclass(frozen=True)
class Report:
    """The pass's report through the ledger's named helper `how` (ready, reconciling, stalled or
    stall) with these arguments."""
    how: ReportHow
    phase: str
    reason: str
    message: str
    ready_message: str | None = None
    provisional: bool = False
    ready_reason: str | None = None     # stalled: Ready's reason when it is not `reason`
    replacing: bool = False             # stands over a report made earlier in the pass


@dataclass(frozen=True)
class ObserveGateDuration:
    result: str          # passed or failed
    seconds: float


# -- then --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServeChampion:
    """Roll the engine to the champion and judge it. `desired` None: the spec's release is not
    (yet) servable and the champion carries on; `while_gating`: a gate runs meanwhile, and the
    champion reports only an action of its own; `shadow`: the champion's pods also score this
    candidate (shadow_run.ShadowRun)."""
    aliases: Mapping[str, str]
    desired: str | None
    reason: str = ""
    while_gating: bool = False
    shadow: Any = None
    canary: Any = None      # canary.CanaryRun: the candidate's pods serve beside the champion's


WRITES = (SetAlias, TagVersion, EnsureGatePolicy, StartGateJob, RecordGateError)


@dataclass
class ReleaseSteps:
    world: ReleaseWorld
    steps: list[Step] = field(default_factory=list)

    def add(self, *steps: Step) -> None:
        self.steps.extend(steps)

    def was(self, action: str, key: str, version: str) -> bool:
        """Recorded already: in the status, or by a step planned earlier in this pass."""
        return self.world.records.was(action, key, version) or any(
            isinstance(s, Record) and s.action == action and s.key == key for s in self.steps)


def name_conflict_message(namespace: str, pair: str, kind: str, name: str) -> str:
    return (f"{kind} {namespace}/{name} exists and is not owned by SpecModelPair {pair}; "
            f"rename or delete it (the operator never changes objects it does not own)")


def name_conflict(out: ReleaseSteps, kind: str, name: str) -> None:
    """An object with our child's name that this pair does not own: never touched."""
    out.add(Report("stall", "Failed", "NameConflict", name_conflict_message(out.world.namespace, out.world.pair,
                                                                            kind, name)))


def serving_versions(aliases: Mapping[str, str]) -> dict[str, str]:
    """status.servingVersion and previousVersion as the aliases say."""
    return {"servingVersion": aliases.get(aliases_mod.CHAMPION, ""), "previousVersion": aliases.get(aliases_mod.PREVIOUS, "")}


def versions_status(aliases: Mapping[str, str]) -> SetStatus:
    return SetStatus(serving_versions(aliases))
