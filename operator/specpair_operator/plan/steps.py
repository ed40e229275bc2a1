"""Every step a plan can emit, as one closed union: what act carries out (act/reconciler.py
matches a step once, with a case for each of these and no fallback; the type checker, run on the
operator by tests/operator/test_operator_types.py, fails when a step here has no case there).

A new step: its frozen dataclass beside the plan that emits it, its name in `Step` below, and
its case in `PairReconciler.carry_out`."""

from __future__ import annotations

from typing import Union

from specpair_operator.plan.release_steps import (Condition, EnsureGatePolicy, ObserveGateDuration, PostEvent,
                                                  Record, RecordGateError, Report, ServeChampion, SetAlias,
                                                  SetStatus, StartGateJob, TagVersion)
from specpair_operator.plan.serving_steps import (CreateControlCA, DeleteOwned, DriftChecked, EnsureAutoscaler,
                                                  EnsureOwned, ExportSpeedup, ForgetDrift, IssueCertificate, LogWarning,
                                                  ReconcilePodSpeculation, RememberChampion, RememberDrift,
                                                  ReportSpeculation, RetireLegacyEngine, RollSpeculation,
                                                  SwitchSpeculation, TLSSecretSeen)
from specpair_operator.plan.serving_draft_swap import PromoteInPlace, ResumeEngine, SwapDraft
from specpair_operator.policy.canary import RememberCanary, ScaleDown

# The release's steps (plan/release_plan.py) ...
ReleaseStep = Union[SetAlias, TagVersion, EnsureGatePolicy, StartGateJob, RecordGateError,
                    ObserveGateDuration, ServeChampion]
# ... the champion's serving (plan/serving_*.py, the canary's from policy/canary.py) ...
ServingStep = Union[EnsureOwned, DeleteOwned, EnsureAutoscaler, CreateControlCA, IssueCertificate, TLSSecretSeen,
                    RetireLegacyEngine, SwitchSpeculation, ReconcilePodSpeculation, ReportSpeculation,
                    RememberChampion, DriftChecked, RememberDrift, ForgetDrift, ExportSpeedup, LogWarning, ScaleDown,
                    RememberCanary, SwapDraft, PromoteInPlace, ResumeEngine]
# ... and what goes into the status, from either (RollSpeculation is a PostEvent with its numbers).
StatusStep = Union[Record, Condition, SetStatus, PostEvent, RollSpeculation, Report]

Step = Union[ReleaseStep, ServingStep, StatusStep]
