"""Act: each planned step carried out, in one match over the closed union of steps
(plan/steps.py), with no fallback: a step without its case here fails the type checker
(tests/operator/test_operator_types.py runs it) before it can fail a pass.

The pass's reads are done (observe/) and its decisions made (plan/); what is left is writing:
MLflow aliases and tags, the objects the pair owns, the engine pods' speculation switch, the
operator's own memory between passes, and the status ledger (written once, when the pass ends)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, assert_never

from specpair_operator.act import metrics
from specpair_operator.act.autoscaler import apply_autoscaler_plan
from specpair_operator.act.control_ca import create_control_ca
from specpair_operator.act import draft_swap
from specpair_operator.act.owned import delete_owned, ensure_owned
from specpair_operator.clients.engine_probe import EngineProbe
from specpair_operator.desired import gate_objects
from specpair_operator.observe.serving_world import ServingWorld
from specpair_operator.plan.release_steps import (Condition, EnsureGatePolicy, ObserveGateDuration, PostEvent,
                                                  Record, RecordGateError, Report, ServeChampion, SetAlias,
                                                  SetStatus, StartGateJob, TagVersion)
from specpair_operator.plan.serving_steps import (CreateControlCA, DeleteOwned, DriftChecked, EnsureAutoscaler,
                                                  EnsureOwned, ExportSpeedup, ForgetDrift, IssueCertificate, LogWarning,
                                                  ReconcilePodSpeculation, RememberChampion, RememberDrift,
                                                  ReportSpeculation, RetireLegacyEngine, SwitchSpeculation,
                                                  TLSSecretSeen, speculation_not_reconciled)
from specpair_operator.plan.serving_draft_swap import PromoteInPlace, ResumeEngine, SwapDraft
from specpair_operator.plan.steps import Step
from specpair_operator.policy import canary as canary_mod
from specpair_operator.release import aliases as aliases_mod

if TYPE_CHECKING:
    from specpair_operator.act.reconciler import PairReconciler


@dataclass
class Acting:
    """What one plan's steps are carried out with: the release's (model, its release file and
    digest) or the champion's serving (the world it was planned from, the pods' probe)."""
    model: str
    release: dict[str, Any] | None = None
    digest: str = ""
    world: ServingWorld | None = None
    probe: EngineProbe | None = None
    server: str = ""                                      # the engine's TLS server name
    stuck: list[str] = field(default_factory=list)        # pods that did not follow a ReconcilePodSpeculation

    def serving(self) -> ServingWorld:
        if self.world is None:
            raise TypeError("a serving step outside the serving plan")
        return self.world

    def spec_release(self) -> dict[str, Any]:
        if self.release is None:
            raise TypeError("a release step outside the release plan")
        return self.release

    def engine_probe(self) -> EngineProbe:
        if self.probe is None:
            raise TypeError("a speculation step without the engine pods' probe")
        return self.probe


async def carry_out(r: PairReconciler, step: Step, acting: Acting) -> bool:
    """Carry one step out; False ends the pass here (a name taken since the pass looked)."""
    op, ledger = r.operator, r.ledger
    kube = op.kube
    if kube is None:
        raise RuntimeError("a step carried out before the operator started (no Kubernetes client)")
    match step:
        # -- MLflow ---------------------------------------------------------------------------
        case SetAlias():
            await r.registry(r.reads.set_alias, acting.model, step.alias, step.version)
        case TagVersion():
            await r.registry(r.reads.set_tags, acting.model, step.version, dict(step.tags))
        case RecordGateError():
            await r.registry(r.reads.record_gate_error, acting.model, step.version, step.reason)
        # -- the release's objects ------------------------------------------------------------
        case EnsureGatePolicy():
            policy = await ensure_owned(kube, r.body, gate_objects.gate_network_policy(r.name, r.namespace))
            if policy.conflict:
                r._name_conflict(policy.kind, policy.name)
                return False
        case StartGateJob():
            await ensure_owned(kube, r.body, r._gate_job(acting.model, acting.spec_release(), acting.digest,
                                                        step.version, step.attempt), mutable=False, live=None)
        case ObserveGateDuration():
            metrics.GATE_DURATION.labels(r.namespace, r.name, step.result).observe(step.seconds)
        case ServeChampion():
            await r._serve_champion(acting.model, dict(step.aliases), desired=step.desired, desired_reason=step.reason,
                                   while_gating=step.while_gating, shadow=step.shadow, canary=step.canary)
        # -- the champion's serving -----------------------------------------------------------
        case EnsureOwned():
            done = await ensure_owned(kube, r.body, copy.deepcopy(dict(step.manifest)), mutable=step.mutable,
                                      live=copy.deepcopy(step.live))
            if done.conflict:
                r._name_conflict(done.kind, done.name)
                return False
        case DeleteOwned():
            await delete_owned(kube, r.body, copy.deepcopy(dict(step.live)), live=copy.deepcopy(dict(step.live)))
        case EnsureAutoscaler():
            await apply_autoscaler_plan(kube, r.body, ledger, step.plan)  # outside the release
        case CreateControlCA():
            await create_control_ca(op)
        case IssueCertificate():
            if not await r._issue_certificate(acting.serving(), step):
                return False
        case canary_mod.ScaleDown():
            await kube.merge_patch("apps/v1", "deployments", r.namespace, step.name, canary_mod.scale_down_patch())
        case canary_mod.RememberCanary():
            op.canary_samples[r.uid] = step.memory
        case RetireLegacyEngine():
            await kube.merge_patch("apps/v1", "deployments", r.namespace, step.name, {"spec": {"replicas": 0}})
        case SwitchSpeculation():
            for address in step.addresses:
                await acting.engine_probe().set_speculation(address, step.enabled, step.reason,
                                                            server_name=acting.server)
            if step.reason.startswith("drift probe"):
                r.logger.info(f"{step.reason} {'started' if step.enabled else 'over'} for "
                              f"v{acting.serving().aliases.get(aliases_mod.CHAMPION)}")
        case SwapDraft():
            refused = await draft_swap.swap_draft(r, acting.engine_probe(), acting.server, step)
            if refused is not None:
                ledger.record(refused.action, refused.reason, refused.from_version, refused.to_version,
                              warning=refused.warning, key=refused.key)
        case PromoteInPlace():
            if not await draft_swap.promote_in_place(r, step):
                return False
        case ResumeEngine():
            await draft_swap.resume_engine(r, step)
        case ReconcilePodSpeculation():
            why = await r._reconcile_pod_speculation(acting.engine_probe(), acting.server, step)
            if why:
                acting.stuck.append(why)
        case ReportSpeculation():
            stuck = list(step.stuck) + acting.stuck
            if stuck:
                r._report(speculation_not_reconciled(step.desired, step.champion, stuck))
            elif step.otherwise is not None:
                r._report(step.otherwise)
        # -- the operator's memory between passes ---------------------------------------------
        case RememberChampion():
            world = acting.serving()
            op.watch_cache[r.uid] = (world.model, dict(world.aliases), step.champion, dict(step.tags),
                                     dict(step.verdict), step.served_hash)
        case DriftChecked():
            op.last_drift_check[r.uid] = step.at
        case TLSSecretSeen():
            op.tls_checked_at[r.uid] = step.at
        case RememberDrift():
            op.samples[r.uid] = (step.champion, step.memory)
            if step.serving is not None:
                op.serving_samples[r.uid] = step.serving
        case ForgetDrift():
            op.samples.pop(r.uid, None)
            op.serving_samples.pop(r.uid, None)
        case ExportSpeedup():
            r._export_speedup(step.champion, dict(step.verdict))
        case LogWarning():
            r.logger.warning(step.message)
        # -- the status (written once, when the pass ends) ------------------------------------
        case Record():
            ledger.record(step.action, step.reason, step.from_version, step.to_version, warning=step.warning,
                          key=step.key)
        case Condition():
            ledger.cond(step.type, step.status, step.reason, step.message)
        case SetStatus():
            ledger.set(**step.fields)
            metrics.canary_share(r.namespace, r.name, step.fields.get("canary"))
        case PostEvent():   # RollSpeculation too: an Event with the roll's numbers
            ledger.event(step.type, step.reason, step.message)
        case Report():
            r._report(step)
        case _:
            assert_never(step)
    return True
