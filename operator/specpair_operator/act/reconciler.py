"""One reconcile of one pair: the spec's release is observed (observe/reads.py), planned (plan/release_plan.py,
pure) and acted on here, then the champion's serving likewise (observe/reads.py, plan/serving_plan.py:
rollout, identity, drift, speculation); what the pass finds goes into a StatusLedger and the
status is written once.

Every step is idempotent, so an operator killed anywhere converges when restarted: releases are
found by content hash, Jobs and Deployments by name, aliases are moved in a crash-safe order (see
release/aliases.py and plan/release_plan.py). The operator writes status, annotations (Kopf's bookkeeping) and
Events, never spec.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from typing import Any, assert_never

import kopf
from mlflow.exceptions import MlflowException

from specpair_operator.desired import gate_objects, manifests
from specpair_operator.plan import serving_plan
from specpair_operator.crd import validation
from specpair_operator.act import metrics
from specpair_operator.plan import release_plan as plan_mod
from specpair_operator.plan import learned_release
from specpair_operator.observe.world import Records
from specpair_operator.release.registry_contract import release_of_tags
from specpair_operator.plan import release_steps
from specpair_operator.release import content as release_mod
from specpair_operator.desired import tls as tls_mod
from specpair_operator.clients.engine_probe import EngineProbe, EngineUnreachable
from specpair_operator.clients.kube import KubeError
from specpair_operator.act.carry_out import Acting, carry_out
from specpair_operator.act.ledger import StatusLedger
from specpair_operator.observe.reads import observe_release, observe_serving, observe_watch
from specpair_operator.act.owned import ensure_owned
from specpair_operator.release.registry_contract import TAG_RELEASE
from specpair_operator.release.registry_contract import TAG_HASH
from specpair_operator.clients.registry import ModelClaimed, PassRegistry
from specpair_operator.release.registry_contract import RegistryUnavailable
from specpair_operator.observe.serving_world import Installation, ServingWorld
from specpair_operator.plan.steps import Step
from specpair_operator.state import STATE, ControlTLSError

GROUP, VERSION = "specpair.io", "v1alpha1"


class PairReconciler:
    """One reconcile pass over one pair; gathers what it finds in a StatusLedger and writes the
    status once."""

    def __init__(self, body: kopf.Body, patch: kopf.Patch, logger: logging.Logger):
        self.body: Any = body         # a kopf.Body: the owner ensure_owned's objects name
        self.patch, self.logger = patch, logger
        self.name: str = body.metadata.name
        self.namespace: str = body.metadata.namespace     # the CRD is namespaced
        self.uid = body.metadata.uid
        self.spec: dict[str, Any] = json.loads(json.dumps(dict(body.spec)))
        self.status: dict[str, Any] = json.loads(json.dumps(dict(body.status)))
        self.gen = body.metadata.get("generation")
        self.ledger = StatusLedger(self.status, self.gen, self.namespace, self.name, logger)
        self.operator = STATE
        self.rollout = self.spec.get("rollout") or {}

    async def _post_events(self) -> None:
        """Events go out after the pass, like Kopf's own queue: a pass that dies posts none, and
        the status's `recorded` keys make the redone step post its Event once."""
        involved = {"apiVersion": self.body.get("apiVersion", f"{GROUP}/{VERSION}"),
                    "kind": self.body.get("kind", "SpecModelPair"), "metadata": dict(self.body.metadata)}
        for type_, reason, message in self.ledger.events:
            try:
                await self.operator.kube.event(involved, type_, reason, message)
            except (KubeError, OSError, asyncio.TimeoutError) as exc:
                self.logger.warning(f"Event {reason} not posted: {exc}")
        self.ledger.events.clear()

    def credentials(self) -> manifests.MlflowCredentials | None:
        return manifests.MlflowCredentials.for_pair(self.spec.get("mlflow"), self.operator.credentials)

    @functools.cached_property
    def reads(self) -> PassRegistry:
        """This pass's view of the registry (each alias set and version's tags read once)."""
        return self.operator.registry.for_pass()

    async def registry(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    # -- the pass --------------------------------------------------------------------------

    async def reconcile(self) -> None:
        try:
            await self._reconcile_handling_errors()
        finally:
            self.patch.status.update(self.ledger.status_patch())
            await self._post_events()

    async def _reconcile_handling_errors(self) -> None:
        try:
            await self._reconcile_release()
        except MlflowException as exc:
            # MLflow answered and refused (bad name, credentials, a value over its limits): retrying
            # the same request changes nothing, so say so where people look, and retry slowly.
            self.operator.retry_at[self.uid] = time.monotonic() + 60.0
            metrics.RECONCILE_ERRORS.labels(self.namespace, self.name, "MLflowRejected").inc()
            self.ledger.stall("MLflowRejected", f"MLflow refused a request: {str(exc)[:800]}", replacing=True)
            self.logger.error(f"MLflow refused a request: {exc}")
            return
        except (RegistryUnavailable, KubeError) as exc:
            if isinstance(exc, KubeError) and exc.permanent:
                self._refused(exc)
                return
            # Transient: back off (1 s doubling to 60 s) and let a later pass redo the steps.
            reason = "MLflowUnavailable" if isinstance(exc, RegistryUnavailable) else "KubernetesAPIError"
            delay = min(60.0, self.operator.backoff.get(self.uid, 0.5) * 2)
            self.operator.backoff[self.uid] = delay
            metrics.RECONCILE_ERRORS.labels(self.namespace, self.name, reason).inc()
            self.operator.retry_at[self.uid] = time.monotonic() + delay
            if isinstance(exc, RegistryUnavailable):
                await self._watch_while_registry_down()
            self.ledger.interrupted(reason, f"{reason}, retrying in {delay:.0f}s (nothing half-promoted: steps are redone)",
                                    f"{exc}; retrying in {delay:.0f}s")
            self.logger.warning(f"{reason}, retry in {delay:.0f}s: {exc}")
            return
        self.operator.backoff.pop(self.uid, None)
        self.operator.retry_at.pop(self.uid, None)

    def _refused(self, exc: KubeError) -> None:
        """The API server refused a request for good (400, 403, 422: an invalid quantity, a name
        it does not accept, a policy): Stalled with its words, retried slowly (a changed spec
        is reconciled at once)."""
        self.operator.retry_at[self.uid] = time.monotonic() + 60.0
        self.operator.backoff.pop(self.uid, None)
        metrics.RECONCILE_ERRORS.labels(self.namespace, self.name, "KubernetesAPIRefused").inc()
        self.ledger.stall("KubernetesAPIRefused", f"the Kubernetes API refused a request (HTTP {exc.status}): "
                          f"{exc.message[:800]}", replacing=True)
        self.logger.error(f"the Kubernetes API refused a request: {exc}")

    async def _watch_while_registry_down(self) -> None:
        """MLflow is down, serving is not: keep judging the champion's drift on what MLflow said
        last. Only the protective first step (SpeculationOff) can be taken; promotion, rollback
        and SpeculationOn wait for MLflow."""
        try:
            world = await observe_watch(self.operator, self.body, self.spec, self.status, questions=serving_plan)
            if world is not None:
                await self._act_serving(world, serving_plan.plan_watch(world))
        except (KubeError, EngineUnreachable) as exc:
            self.logger.warning(f"drift check while MLflow is down skipped: {exc}")

    async def _resolve_prompts(self) -> list[dict[str, Any]]:
        gating = self.spec.get("gating") or {}
        prompts = list(gating.get("prompts") or [])
        ref = gating.get("configMapRef")
        if ref:
            cm = await self.operator.kube.get("v1", "configmaps", self.namespace, ref["name"])
            key = ref.get("key") or "prompts.jsonl"
            if cm is None or key not in (cm.get("data") or {}):
                raise ValueError(f"ConfigMap {ref['name']} (key {key}) with golden prompts not found")
            prompts += release_mod.parse_prompt_lines(cm["data"][key])
        return prompts or release_mod.builtin_prompts()

    async def _reconcile_release(self) -> None:
        invalid = validation.validate_spec(self.spec)
        if invalid:
            # The CRD refuses these; a spec that got past it (an older CRD) must not crash-loop.
            self.ledger.stall("InvalidSpec", "the spec is invalid: " + "; ".join(invalid))
            return
        try:
            prompts = await self._resolve_prompts()
        except (ValueError, OSError) as exc:
            self.ledger.stalled("Failed", "PromptsUnavailable", str(exc))
            return
        rel = release_mod.build_release(self.name, self.namespace, self.spec, prompts)
        digest = release_mod.content_hash(rel)
        model = release_mod.effective_model_name(self.name, self.namespace, self.spec)
        reg = self.reads
        self.ledger.set(modelName=model)
        try:
            await reg.read("ensure_model", model, f"{self.namespace}/{self.name}", self.uid)
        except ModelClaimed as exc:
            self.ledger.stall("ModelOwnedByAnotherPair", f"{exc}; name another in spec.mlflow.modelName")
            return
        version = self._release_read(reg, model, digest) or await self.registry(self._ensure_release, reg, model, rel,
                                                                                  digest)
        self.ledger.set(candidateVersion=version, contentHash=digest)
        # While the spec's release serves, a draft a training Job learned for it takes the usual
        # road in its place (plan/learned_release.py); its release is its registered contract.
        drive = await reg.local_first(self._driven_release, reg, model, version)
        if drive.version != version:
            learned_rel = release_of_tags(await self.registry(reg.version_tags, model, drive.version))
            if learned_rel is not None:
                version, rel, digest = drive.version, learned_rel, release_mod.content_hash(learned_rel)
        world = await observe_release(self.operator.kube, reg, self.body, self.status, model, version, digest,
                                      rel["gating"]["thresholds"], rel,
                                      Installation(self.operator.gate_tracking_uri, self.credentials(),
                                                   self.operator.pods))
        if drive.version == version and drive.learned is not None:
            world = dataclasses.replace(world, learned=drive.learned)
        await self._act(model, rel, digest, learned_release.learned_steps(world, plan_mod.plan_release(world)))

    def _driven_release(self, reg: PassRegistry, model: str, version: str) -> learned_release.Drive:
        """Which version this pass drives: the spec's, or a draft learned for it (learned_release)."""
        def tags_of(v: str) -> dict[str, str]:
            try:
                return dict(reg.version_tags(model, str(v)))
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                return {}     # a version deleted by hand: no lineage, no try
        return learned_release.driven_release(version, reg.aliases(model), tags_of, self.status,
                                              Records.from_status(self.status).was)

    async def _act(self, model: str, rel: dict[str, Any], digest: str, steps: tuple[Step, ...]) -> None:
        """Run the planned steps in their order (act/carry_out.py): the writes, what goes into the
        status, then the champion's serving."""
        acting = Acting(model, release=rel, digest=digest)
        for step in steps:
            if not await carry_out(self, step, acting):
                return

    def _report(self, report: release_steps.Report) -> None:
        match report.how:
            case "stall":
                self.ledger.stall(report.reason, report.message, replacing=report.replacing)
            case "stalled":
                self.ledger.stalled(report.phase, report.reason, report.message, ready_reason=report.ready_reason,
                                    ready_message=report.ready_message, replacing=report.replacing)
            case "reconciling":
                self.ledger.reconciling(report.phase, report.reason, report.message,
                                        ready_message=report.ready_message, replacing=report.replacing,
                                        provisional=report.provisional)
            case "ready":
                self.ledger.ready(report.phase, report.reason, report.message, replacing=report.replacing)
            case _:
                assert_never(report.how)

    def _gate_job(self, model: str, rel: dict[str, Any], digest: str, version: str, attempt: int) -> dict[str, Any]:
        gating = self.spec.get("gating") or {}
        placement = {**self.rollout, **({"resources": gating["resources"]} if "resources" in gating else {})}
        return gate_objects.gate_job(self.name, self.namespace,
                                  release_mod.with_mlflow(rel, self.operator.gate_tracking_uri, model, version),
                                  digest, version, placement, self.operator.gate_tracking_uri,
                                  int(gating.get("activeDeadlineSeconds", 3600)), self.credentials(),
                                  self.operator.pods, attempt=attempt)

    def _ensure_release(self, reg: PassRegistry, model: str, rel: dict[str, Any], digest: str) -> str:
        version = self._recorded_version(reg, model, digest) or reg.ensure_release(model, rel, digest)
        # The full release JSON rides along as a tag so a rollback can rebuild the Deployment
        # of any version without the spec that made it.
        if TAG_RELEASE not in reg.version_tags(model, version):
            reg.set_tags(model, version, {TAG_RELEASE: json.dumps(rel, sort_keys=True, separators=(",", ":"))})
        return version

    def _release_read(self, reg: PassRegistry, model: str, digest: str) -> str | None:
        """What _ensure_release would answer, when this pass's reads hold it (a settled pass: the
        recorded version's tags, with this release's hash and its release JSON): taken on the
        event loop, without a hop to a thread. None: _ensure_release asks MLflow."""
        version = self.status.get("candidateVersion")
        if not version or self.status.get("contentHash") != digest or not reg.answered("version_tags", model, version):
            return None
        tags = reg.version_tags(model, str(version))
        return str(version) if tags.get(TAG_HASH) == digest and TAG_RELEASE in tags else None

    def _recorded_version(self, reg: PassRegistry, model: str, digest: str) -> str | None:
        """The version the status says holds this release (candidateVersion with its
        contentHash), when MLflow still has it with that hash: read with the version's tags,
        which the pass reads anyway, instead of a search by hash on every pass. None (search, or
        register again) when the status says nothing of it, or the version is gone or holds
        another release (the registered model deleted and made again)."""
        version = self.status.get("candidateVersion")
        if not version or self.status.get("contentHash") != digest:
            return None
        try:
            tags = reg.version_tags(model, str(version))
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            return None
        return str(version) if tags.get(TAG_HASH) == digest else None

    def _name_conflict(self, kind: str, name: str) -> None:
        """An object with our child's name that this pair does not own: never touch it."""
        self.ledger.stall("NameConflict", release_steps.name_conflict_message(self.namespace, self.name, kind, name))

    async def _serve_champion(self, model: str, al: dict[str, str], desired: str | None, desired_reason: str,
                              while_gating: bool = False, shadow: Any = None, canary: Any = None) -> None:
        """Roll the engine to the champion and judge it: observed (observe.observe_serving),
        planned (serving_plan.plan_serving, pure) and acted on."""
        world = await observe_serving(self.operator, self.reads, self.body, self.spec, self.status, model, al,
                                      desired, desired_reason, while_gating, shadow, canary, questions=serving_plan)
        await self._act_serving(world, serving_plan.plan_serving(world))

    async def _act_serving(self, world: ServingWorld, steps: tuple[Step, ...]) -> None:
        """Run the serving steps in their order (act/carry_out.py); a name taken since the pass
        looked ends the pass with NameConflict."""
        op = self.operator
        acting = Acting(world.model, world=world,
                        probe=op.vllm_probe if serving_plan.kind_of(world) == "vllm" else op.probe,
                        server=tls_mod.server_name(manifests.engine_name(self.name), self.namespace))
        for step in steps:
            if not await carry_out(self, step, acting):
                return

    async def _reconcile_pod_speculation(self, probe: EngineProbe, server: str,
                                         step: serving_plan.ReconcilePodSpeculation) -> str:
        """Switch one pod to the speculation state the pair wants and ask it again: '' when it
        follows (a Warning Event says so), else why not."""
        desired = step.desired
        try:
            await probe.set_speculation(step.address, desired, "operator: reconcile to the desired speculation state",
                                        server_name=server)
            after = await probe.model_info(step.address, server_name=server)
        except EngineUnreachable as exc:
            return f"pod {step.pod}: {exc}"
        if bool(after.get("speculationEnabled", True)) != desired:
            return f"pod {step.pod} still reports speculation {'off' if desired else 'on'}"
        msg = (f"pod {step.pod} of v{step.champion} had speculation {'off' if desired else 'on'}; turned it "
               f"{'on' if desired else 'off'} as the pair's drift state requires")
        self.ledger.event("Warning", "SpeculationReconciled", msg)
        self.logger.warning(msg)
        return ""

    async def _issue_certificate(self, world: ServingWorld, step: serving_plan.IssueCertificate) -> bool:
        """Issue the engine's control-listener certificate into its Secret; False when the Secret's
        name is taken by one this pair does not own (NameConflict). A patch only goes through if
        the Secret is owned by this pair (a JSON-patch test on its owner's uid); engine pods pick a
        renewed certificate up from their volume without restarting. What was issued is kept in
        status.engineTLS, written whatever else the pass says: without it the next pass would
        issue another."""
        ca = self.operator.ca     # read by this pass's observe, or made by its CreateControlCA just before
        if ca is None:
            raise ControlTLSError("no CA to issue the engine's certificate from")
        tls = world.tls
        ca_fingerprint = tls_mod.fingerprint(ca.cert_pem)
        leaf = tls_mod.issue(ca, manifests.engine_name(self.name), tls.names, server=True, days=tls_mod.SERVER_DAYS)
        secret = manifests.engine_tls_secret(self.name, self.namespace, leaf.cert_pem, leaf.key_pem, ca.cert_pem)
        secret["metadata"]["annotations"] = {serving_plan.ANN_ISSUED_FOR: serving_plan.issued_for(ca_fingerprint,
                                                                                                  tls.names)}
        if (await ensure_owned(self.operator.kube, self.body, secret, readable=False)).conflict:
            self._name_conflict("Secret", tls.secret)
            return False
        until = tls_mod.not_after(leaf.cert_pem).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.ledger.set(engineTLS={"secret": tls.secret, "caFingerprint": ca_fingerprint, "names": list(tls.names),
                                   "notAfter": until})
        self.ledger.event("Normal", "CertificateIssued", f"engine control-listener certificate in Secret {tls.secret} "
                          f"({step.reason}), valid until {until}")
        return True


    def _export_speedup(self, champion: str, verdict: dict[str, Any]) -> None:
        """specpair_release_speedup for the serving release only (the last one's series go)."""
        speedups = {"all": verdict.get("speedup")}
        speedups.update({cat: (v or {}).get("speedup") for cat, v in (verdict.get("categories") or {}).items()})
        speedups = {cat: float(v) for cat, v in speedups.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        series = (str(champion), tuple(sorted(speedups)))
        old = self.operator.speedup_series.get(self.uid)
        if old is not None and old != series:
            for cat in old[1]:
                try:
                    metrics.RELEASE_SPEEDUP.remove(self.name, old[0], cat, self.namespace)
                except KeyError:
                    pass
        for cat, value in speedups.items():
            metrics.RELEASE_SPEEDUP.labels(self.name, str(champion), cat, self.namespace).set(value)
        self.operator.speedup_series[self.uid] = series
