"""One reconcile of one pair: the spec's release is observed (observe.py), planned (plan.py,
pure) and acted on here, then the champion is served and watched (rollout, identity, drift,
speculation); what the pass finds goes into a StatusLedger and the status is written once.

Every step is idempotent, so an operator killed anywhere converges when restarted: releases are
found by content hash, Jobs and Deployments by name, aliases are moved in a crash-safe order (see
aliases.py and plan.py). The operator writes status, annotations (Kopf's bookkeeping) and
Events, never spec.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import logging
import time
from dataclasses import replace
from typing import Any

import kopf
from mlflow.exceptions import MlflowException

from specpair.stats import RequestMoments

from . import aliases as aliases_mod
from . import autoscaling
from . import conditions as c
from . import drift as drift_mod
from . import gate_verdict, manifests, names, owned, validation
from . import metrics
from . import plan as plan_mod
from . import release as release_mod
from . import tls as tls_mod
from .engine_probe import EngineProbe, EngineUnreachable
from .kube import KubeError
from .ledger import StatusLedger
from .observe import observe_release
from .owned import ensure_owned
from .plan import TAG_RELEASE, TAG_SPECULATION_OFF
from .registry import (ModelClaimed, TAG_HASH, TAG_ROLLED_BACK, TAG_TOKENIZER_DRAFT, TAG_TOKENIZER_TARGET,
                       RegistryUnavailable, ReleaseRegistry)

from .state import CA_REFRESH_S, STATE, control_ca
from .world import pods_waiting

GROUP, VERSION = "specpair.io", "v1alpha1"
# On the engine Deployment: a fingerprint of its spec without the replica count, to tell a
# rollout (a new pod template) from scaling.
ANN_TEMPLATE = "specpair.io/template-hash"
ANN_ISSUED_FOR = "specpair.io/issued-for"  # on the engine's TLS Secret: CA fingerprint / hash of the names


class PairReconciler:
    """One reconcile pass over one pair; gathers what it finds in a StatusLedger and writes the
    status once."""

    def __init__(self, body: kopf.Body, patch: kopf.Patch, logger: logging.Logger):
        self.body, self.patch, self.logger = body, patch, logger
        self.name, self.namespace = body.metadata.name, body.metadata.namespace
        self.uid = body.metadata.uid
        self.spec: dict[str, Any] = json.loads(json.dumps(dict(body.spec)))
        self.status: dict[str, Any] = json.loads(json.dumps(dict(body.status)))
        self.gen = body.metadata.get("generation")
        self.ledger = StatusLedger(self.status, self.gen, self.namespace, self.name, logger)
        self.operator = STATE
        self.rollout = self.spec.get("rollout") or {}
        self.watching = False  # the champion is watched while the spec's release is elsewhere
        self.registry_down = False  # judging drift from the last MLflow facts while MLflow is down
        self.kind = "specpair"  # the serving release's engine (set by _serve_champion from the champion's release)

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
        cached = self.operator.watch_cache.get(self.uid)
        if cached is None:
            return
        model, al, champion, tags, verdict, served_hash = cached
        self.registry_down = True
        self.kind = release_mod.engine_kind(json.loads(tags.get(TAG_RELEASE) or "{}"))
        try:
            pods = await self._engine_pods()
            ok, _, infos = await self._verify_identity(pods, champion, served_hash, tags)
            if ok:
                await self._drift(model, al, champion, verdict, tags, pods, infos)
                await self._reconcile_speculation(champion, pods, infos)
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
        reg = self.operator.registry
        self.ledger.set(modelName=model)
        try:
            await self.registry(reg.ensure_model, model, f"{self.namespace}/{self.name}", self.uid)
        except ModelClaimed as exc:
            self.ledger.stall("ModelOwnedByAnotherPair", f"{exc}; name another in spec.mlflow.modelName")
            return
        version = await self.registry(self._ensure_release, reg, model, rel, digest)
        self.ledger.set(candidateVersion=version, contentHash=digest)
        world = await observe_release(self.operator.kube, reg, self.body, self.status, model, version, digest,
                                      rel["gating"]["thresholds"])
        await self._act(model, rel, digest, plan_mod.plan_release(world))

    async def _act(self, model: str, rel: dict[str, Any], digest: str, steps: tuple[plan_mod.Step, ...]) -> None:
        """Run the planned steps in their order: the writes, what goes into the status, then the
        champion's serving."""
        reg, kube, ledger = self.operator.registry, self.operator.kube, self.ledger
        for step in steps:
            if isinstance(step, plan_mod.SetAlias):
                await self.registry(reg.set_alias, model, step.alias, step.version)
            elif isinstance(step, plan_mod.TagVersion):
                await self.registry(reg.set_tags, model, step.version, dict(step.tags))
            elif isinstance(step, plan_mod.EnsureGatePolicy):
                policy = await ensure_owned(kube, self.body, manifests.gate_network_policy(self.name, self.namespace))
                if policy.conflict:  # taken since the pass looked
                    self._name_conflict(policy.kind, policy.name)
                    return
            elif isinstance(step, plan_mod.StartGateJob):
                await ensure_owned(kube, self.body, self._gate_job(model, rel, digest, step.version, step.attempt), mutable=False,
                                   live=None)
            elif isinstance(step, plan_mod.RecordGateError):
                await self.registry(reg.record_gate_error, model, step.version, step.reason)
            elif isinstance(step, plan_mod.Record):
                ledger.record(step.action, step.reason, step.from_version, step.to_version, warning=step.warning,
                              key=step.key)
            elif isinstance(step, plan_mod.Condition):
                ledger.cond(step.type, step.status, step.reason, step.message)
            elif isinstance(step, plan_mod.SetStatus):
                ledger.set(**step.fields)
            elif isinstance(step, plan_mod.PostEvent):
                ledger.event(step.type, step.reason, step.message)
            elif isinstance(step, plan_mod.Report):
                self._report(step)
            elif isinstance(step, plan_mod.ObserveGateDuration):
                metrics.GATE_DURATION.labels(self.namespace, self.name, step.result).observe(step.seconds)
            elif isinstance(step, plan_mod.ServeChampion):
                await self._serve_champion(model, dict(step.aliases), desired=step.desired,
                                           desired_reason=step.reason, while_gating=step.while_gating)
            else:
                raise TypeError(f"no act for {step!r}")

    def _report(self, report: plan_mod.Report) -> None:
        if report.how == "stall":
            self.ledger.stall(report.reason, report.message)
        elif report.how == "stalled":
            self.ledger.stalled(report.phase, report.reason, report.message, ready_message=report.ready_message)
        elif report.how == "reconciling":
            self.ledger.reconciling(report.phase, report.reason, report.message, ready_message=report.ready_message,
                                    provisional=report.provisional)
        else:
            self.ledger.ready(report.phase, report.reason, report.message)

    def _gate_job(self, model: str, rel: dict[str, Any], digest: str, version: str, attempt: int) -> dict[str, Any]:
        gating = self.spec.get("gating") or {}
        placement = {**self.rollout, **({"resources": gating["resources"]} if "resources" in gating else {})}
        return manifests.gate_job(self.name, self.namespace,
                                  release_mod.with_mlflow(rel, self.operator.gate_tracking_uri, model, version),
                                  digest, version, placement, self.operator.gate_tracking_uri,
                                  int(gating.get("activeDeadlineSeconds", 3600)), self.credentials(),
                                  self.operator.pods, attempt=attempt)

    def _ensure_release(self, reg: ReleaseRegistry, model: str, rel: dict[str, Any], digest: str) -> str:
        version = reg.ensure_release(model, rel, digest)
        # The full release JSON rides along as a tag so a rollback can rebuild the Deployment
        # of any version without the spec that made it.
        if TAG_RELEASE not in reg.version_tags(model, version):
            reg.set_tags(model, version, {TAG_RELEASE: json.dumps(rel, sort_keys=True, separators=(",", ":"))})
        return version

    def _name_conflict(self, kind: str, name: str) -> None:
        """An object with our child's name that this pair does not own: never touch it."""
        self.ledger.stall("NameConflict", plan_mod.name_conflict_message(self.namespace, self.name, kind, name))

    async def _unschedulable(self, selector: str) -> str:
        return pods_waiting(await self.operator.kube.list("v1", "pods", self.namespace, selector))

    def _versions(self, al: dict[str, str]) -> None:
        self.ledger.set(**plan_mod.serving_versions(al))

    async def _serve_champion(self, model: str, al: dict[str, str], desired: str | None, desired_reason: str,
                     while_gating: bool = False) -> None:
        """Roll the engine to the champion and judge its health; `desired` None means the
        spec's release is not servable (failed gate, rolled back) and the champion carries on.
        The champion's drift is watched either way. `while_gating` (while a new release is being
        gated) leaves the pass's status alone unless the champion needs an action."""
        reg = self.operator.registry
        champion = al.get(aliases_mod.CHAMPION)
        self._versions(al)
        if champion is None:
            if while_gating:
                return
            self.ledger.stalled("Failed", "NoRelease", desired_reason or "no release has passed the gate")
            return
        tags = await self.registry(reg.version_tags, model, champion)
        if tags.get(TAG_ROLLED_BACK):
            # Rolled back, but the pass that tagged it died before moving the alias: finish it.
            await self._rollback(model, al, champion, tags[TAG_ROLLED_BACK], marked=True)
            return
        rel = json.loads(tags[TAG_RELEASE])
        digest = tags[TAG_HASH]
        self.kind = release_mod.engine_kind(rel)
        _, verdict, _ = await self.registry(reg.gate_result, model, champion)
        # A champion's verdict edited in MLflow after its promotion serves with the spec's
        # speculation and no gated numbers, rather than with whatever the tag now says.
        verdict = gate_verdict.usable_verdict(verdict)
        served = json.loads(json.dumps(rel))
        best = verdict.get("bestSpeculation") or {}
        # The gate tuned k and the batch threshold on real hardware: serve with what it found
        # (a threshold of 0 means speculation did not pay at any batch size there).
        if self.rollout.get("applyGateTuning", True):
            served["speculation"].update({k: v for k, v in best.items() if k in ("k", "batchSizeThreshold")})
        served = release_mod.with_mlflow(served, self.operator.gate_tracking_uri, model, champion)
        if isinstance(verdict.get("speedup"), (int, float)):
            self.ledger.set(speedup=float(verdict["speedup"]))
        self._export_speedup(champion, verdict)
        # Until live traffic has been measured, the printer column shows the gated acceptance.
        if isinstance(verdict.get("acceptanceRate"), (int, float)) and \
                (self.status.get("servingVersion") != champion or "acceptance" not in self.status):
            self.ledger.set(acceptance=float(verdict["acceptanceRate"]))
        state, msg = await self._ensure_engine(served, digest, champion)
        if state == "conflict":
            kind, name = msg.split(" ", 1)
            self._name_conflict(kind, name)
            return
        if state == "failed":
            await self._rollback(model, al, champion, f"rollout of v{champion} failed: {msg}")
            return
        if state != "available":
            if while_gating:
                return
            self.ledger.reconciling("RollingOut", "RollingOut", f"rolling out v{champion}: {msg}", ready_message=msg)
            return
        pods = await self._engine_pods()
        served_hash = release_mod.content_hash(served)
        ok, why, infos = await self._verify_identity(pods, champion, served_hash, tags)
        if ok:
            self.operator.watch_cache[self.uid] = (model, dict(al), champion, dict(tags), verdict, served_hash)
        if why.startswith("tokenizer"):
            await self._rollback(model, al, champion, why)
            return
        if not ok:
            if while_gating:
                return
            self.ledger.reconciling("RollingOut", "IdentityUnverified", why)
            return
        # The champion is watched whatever the spec's release is doing (gated, failed, rolled back).
        self.watching = while_gating or desired is None
        drifted = await self._drift(model, al, champion, verdict, tags, pods, infos)
        unreconciled = await self._reconcile_speculation(champion, pods, infos)
        if while_gating or (desired is None and drifted and self.ledger.reported):
            return  # nothing to say beyond what a drift action this pass already said
        if desired is None:
            self.ledger.stalled("Degraded", "ReleaseNotServable", f"{desired_reason}; v{champion} keeps serving",
                                ready_reason="ChampionKeepsServing")
            return
        if unreconciled:
            # A pod not yet at the speculation state drift wants is what this pass reports, over
            # the drift step it took.
            self.ledger.reconciling("Degraded", "SpeculationNotReconciled", unreconciled, replacing=True)
            return
        if drifted:
            return
        self.ledger.ready("Serving", "Serving", f"v{champion} serving on {len(pods)} pod(s), identity verified")

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

    async def _ensure_engine(self, served: dict[str, Any], digest: str, version: str) -> tuple[str, str]:
        """The champion's engine: its Deployment, Service, control-listener certificate and
        NetworkPolicy. Returns the rollout's state and what it says (("conflict", "KIND NAME")
        for a child's name taken by an object the pair does not own: nothing is written then)."""
        kube = self.operator.kube
        dep = manifests.engine_deployment(self.name, self.namespace, served, digest, version, self.rollout,
                                          self.operator.gate_tracking_uri,
                                          # Engine pods need MLflow only to download a model from it.
                                          self.credentials() if release_mod.reads_from_mlflow(served) else None,
                                          self.operator.pods, speculation=self._desired_speculation(version))
        svc = manifests.engine_service(self.name, self.namespace, self.rollout, self.kind)
        live = await kube.get("apps/v1", "deployments", self.namespace, dep["metadata"]["name"])
        live_svc = await kube.get("v1", "services", self.namespace, svc["metadata"]["name"])
        for kind, obj in (("Deployment", live), ("Service", live_svc)):
            if obj is not None and not owned.owns(self.uid, obj):
                return "conflict", f"{kind} {obj['metadata']['name']}"
        # The control listener's certificate, before the first engine pod needs it (vLLM pods
        # have no control listener).
        conflict = await self._ensure_engine_tls() if self.kind != "vllm" else ""
        if conflict:
            return "conflict", f"Secret {conflict}"
        # Ingress to engine pods on their ports only; in place before the first engine pod is.
        policy = await ensure_owned(kube, self.body, manifests.engine_network_policy(self.name, self.namespace, self.operator.pods))
        if policy.conflict:
            return "conflict", f"{policy.kind} {policy.name}"
        # A rollout is a new pod template. A new replica count alone (kubectl scale, an
        # autoscaler: spec.rollout.replicas) is scaling: an Event, no history entry, no rollout.
        template = owned.manifest_fingerprint({**dep["spec"], "replicas": None})
        live_template = ((live or {}).get("metadata", {}).get("annotations") or {}).get(ANN_TEMPLATE)
        dep["metadata"].setdefault("annotations", {})[ANN_TEMPLATE] = template
        engine = await ensure_owned(kube, self.body, dep, live=live)
        key = f"{version}@{template}"
        if engine.outcome == owned.CREATED:
            self.ledger.record("RolloutStarted", f"engine Deployment created for v{version}", None, version, key=key)
        elif (engine.changed and live_template != template) or not self.ledger.was_recorded("RolloutStarted", key, version):
            # Rolled now, or by a pass that died before writing its status.
            self.ledger.record("RolloutStarted", f"engine Deployment rolled to v{version}", None, version, key=key)
        elif engine.changed and (live or {}).get("spec", {}).get("replicas") != dep["spec"]["replicas"]:
            self.ledger.event("Normal", "Scaled", f"engine Deployment of v{version} scaled from "
                              f"{live['spec'].get('replicas')} to {dep['spec']['replicas']} replicas")
        # The scale subresource's status: what autoscalers and `kubectl get --subresource=scale` read.
        self.ledger.set(replicas=int(((engine.live or {}).get("status") or {}).get("replicas") or 0),
                        selector=",".join(f"{k}={v}" for k, v in manifests.engine_selector(self.name).items()))
        await ensure_owned(kube, self.body, svc, mutable=False, live=live_svc)
        await autoscaling.ensure_autoscaler(self.operator, self.body, self.ledger)  # outside the release
        state, msg = manifests.deployment_rollout_state(engine.live, digest)
        if state == "progressing":
            waiting = await self._unschedulable(",".join(f"{k}={v}" for k, v in manifests.engine_selector(self.name).items()))
            if waiting:
                msg = f"{msg}; {waiting}"
        if state == "available":
            await self._retire_legacy_engine(dep["metadata"]["name"])
        return state, msg

    async def _retire_legacy_engine(self, current: str) -> None:
        """A pair whose name is not a DNS label had its engine Deployment under another name
        (names.legacy_object_name). Once the one under `current` is available, that one is
        scaled to zero (the operator may patch Deployments, not delete them): its pods carry the
        pair's labels and would serve, and be verified, beside the current ones."""
        legacy = names.legacy_object_name(self.name, "engine")
        if legacy == current:
            return
        old = await self.operator.kube.get("apps/v1", "deployments", self.namespace, legacy)
        if old is None or not owned.owns(self.uid, old) or not (old.get("spec") or {}).get("replicas"):
            return
        await self.operator.kube.merge_patch("apps/v1", "deployments", self.namespace, legacy, {"spec": {"replicas": 0}})
        self.ledger.event("Normal", "LegacyEngineRetired", f"Deployment {legacy} scaled to 0: the engine is Deployment "
                   f"{current} now (a pair name that is not a DNS label gets a hash in its objects' names); the "
                   f"objects named {names.legacy_object_name(self.name)}-* this pair owns are unused and may be deleted")

    async def _ensure_engine_tls(self) -> str:
        """Issue the engine's control-listener certificate when it has none, was issued by another
        CA or for other names, or nears its end; '' or the name of a Secret this pair does not own.

        What was issued is kept in status.engineTLS, so the operator never reads a Secret in the
        pair's namespace (RBAC: create and patch, no get); a patch only goes through if the Secret
        is owned by this pair (a JSON-patch test on its owner's uid). Engine pods pick a renewed
        certificate up from their volume without restarting."""
        ca = await control_ca(self.operator)
        secret_name = manifests.engine_tls_secret_name(self.name)
        dns = tls_mod.engine_dns_names(manifests.engine_name(self.name), self.namespace)
        ca_fingerprint = tls_mod.fingerprint(ca.cert_pem)
        # What the Secret says it holds, so a pass can ask whether it holds that without reading it.
        issued_for = {ANN_ISSUED_FOR: f"{ca_fingerprint}/{hashlib.sha256(','.join(dns).encode()).hexdigest()[:16]}"}
        have = self.status.get("engineTLS") or {}
        reason = ""
        if have.get("secret") != secret_name or have.get("caFingerprint") != ca_fingerprint \
                or list(have.get("names") or []) != list(dns):
            reason = "no certificate from this CA yet" if have.get("caFingerprint") != ca_fingerprint \
                else "the Service's names changed"
            secret_ref = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret_name, "namespace": self.namespace}}
            if await owned.holds(self.operator.kube, self.uid, secret_ref, issued_for):
                # This pair's Secret holds a certificate from this CA for these names: a pass issued it
                # and died before its status said so. Its end cannot be read here, so it is renewed
                # within a day, by a pass that records what it issues.
                until = c.parse_iso(c.now_iso()) + datetime.timedelta(days=tls_mod.RENEW_DAYS + 1)
                self.ledger.set(engineTLS={"secret": secret_name, "caFingerprint": ca_fingerprint, "names": list(dns),
                                           "notAfter": until.strftime("%Y-%m-%dT%H:%M:%SZ")})
                return ""
        elif c.parse_iso(have.get("notAfter") or "1970-01-01T00:00:00Z") - c.parse_iso(c.now_iso()) \
                < datetime.timedelta(days=tls_mod.RENEW_DAYS):
            reason = f"it expires {have.get('notAfter')}"
        elif await self._tls_secret_missing(secret_name):
            reason = f"engine pods cannot find Secret {secret_name}"
        if not reason:
            self.ledger.set(engineTLS=have)
            return ""
        leaf = tls_mod.issue(ca, manifests.engine_name(self.name), dns, server=True, days=tls_mod.SERVER_DAYS)
        secret = manifests.engine_tls_secret(self.name, self.namespace, leaf.cert_pem, leaf.key_pem, ca.cert_pem)
        secret["metadata"]["annotations"] = issued_for
        if (await ensure_owned(self.operator.kube, self.body, secret, readable=False)).conflict:
            return secret_name
        until = tls_mod.not_after(leaf.cert_pem).strftime("%Y-%m-%dT%H:%M:%SZ")
        # Written whatever else the pass says: without it the next pass would issue another.
        self.ledger.set(engineTLS={"secret": secret_name, "caFingerprint": ca_fingerprint, "names": list(dns),
                                   "notAfter": until})
        self.ledger.event("Normal", "CertificateIssued",
                   f"engine control-listener certificate in Secret {secret_name} ({reason}), valid until {until}")
        return ""

    async def _tls_secret_missing(self, secret_name: str) -> bool:
        """Whether the Secret is gone (deleted by hand), asked every CA_REFRESH_S by trying to
        create it: the operator may not read Secrets, and engine pods cannot start without it."""
        if time.monotonic() - self.operator.tls_checked_at.get(self.uid, 0.0) < CA_REFRESH_S:
            return False
        probe = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret_name, "namespace": self.namespace}}
        try:
            # dryRun: nothing is written; 409 means it is there.
            await self.operator.kube.create(probe, read_existing=False, dry_run=True)
        except KubeError as exc:
            if exc.status != 409:
                raise
            self.operator.tls_checked_at[self.uid] = time.monotonic()
            return False
        return True

    async def _engine_pods(self) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in manifests.engine_selector(self.name).items())
        pods = await self.operator.kube.list("v1", "pods", self.namespace, selector)

        def ready(p: dict[str, Any]) -> bool:
            st = p.get("status") or {}
            return st.get("phase") == "Running" and bool(st.get("podIP")) and not p["metadata"].get("deletionTimestamp") \
                and any(cd.get("type") == "Ready" and cd.get("status") == "True" for cd in st.get("conditions") or [])
        return [p for p in pods if ready(p)]

    def _address(self, pod: dict[str, Any]) -> str:
        """The pod's control listener (mutual TLS): the operator never uses the serving port. A
        vLLM pod has none: its HTTP port, read only (/v1/models, /metrics)."""
        if self.kind == "vllm":
            return f"{pod['status']['podIP']}:{int(self.rollout.get('httpPort') or manifests.HTTP_PORT)}"
        return f"{pod['status']['podIP']}:{int(self.rollout.get('controlPort', manifests.CONTROL_PORT))}"

    def _server_name(self) -> str:
        return tls_mod.server_name(manifests.engine_name(self.name), self.namespace)

    async def _verify_identity(self, pods: list[dict[str, Any]], version: str, digest: str, tags: dict[str, str]
                               ) -> tuple[bool, str, list[dict[str, Any]]]:
        if not pods:
            return False, "no ready engine pods", []
        infos = []
        expected = {"target": tags.get(TAG_TOKENIZER_TARGET), "draft": tags.get(TAG_TOKENIZER_DRAFT)}
        for pod in pods:
            try:
                info = await self._probe().model_info(self._address(pod), server_name=self._server_name())
            except EngineUnreachable as exc:
                return False, f"pod {pod['metadata']['name']}: model identity not verified: {exc}", infos
            # `digest` is the hash of the release document this pod was given; the engine hashes
            # the file it loaded, so a pod serving anything else is caught here.
            served = (info.get("pair"), str(info.get("releaseVersion")), info.get("contentHash") or "")
            if served != (self.name, version, digest):
                return False, (f"pod {pod['metadata']['name']} serves {served[0]} v{served[1]} with content hash "
                               f"{served[2][:12] or '(none)'}; release is {self.name} v{version} "
                               f"({digest[:12]})"), infos
            mismatch = drift_mod.fingerprint_mismatch(expected, info.get("tokenizer") or {})
            if mismatch:
                return False, f"tokenizer mismatch on pod {pod['metadata']['name']}: " + "; ".join(mismatch), infos
            infos.append(info)
        return True, "", infos

    async def _rollback(self, model: str, al: dict[str, str], champion: str, reason: str,
                        marked: bool = False) -> None:
        reg = self.operator.registry
        target = aliases_mod.rollback_target(al)
        self.ledger.cond(c.DRIFTED, True, "RolledBack" if target else "NoPreviousRelease", reason)
        if target is None:
            self.ledger.stalled("Failed", "NoPreviousRelease", f"{reason}; no previous release",
                                ready_message=f"{reason}; no previous release to roll back to")
            return
        # The tag first: it is what keeps a restarted operator from re-promoting this version,
        # and what makes the next pass finish the alias move if this one dies before it.
        if not marked:
            await self.registry(reg.set_tags, model, champion, {TAG_ROLLED_BACK: reason[:4000]})
        for move in aliases_mod.plan_rollback(al):
            await self.registry(reg.set_alias, model, move.alias, move.version)
        self.ledger.record("RolledBack", reason, champion, target, warning=True, key=champion)
        self.operator.samples.pop(self.uid, None)
        self.ledger.set(drift=drift_mod.DriftState().as_dict())
        self.ledger.set(speculationEnabled=True)
        self._versions({**al, aliases_mod.CHAMPION: target})
        self.ledger.reconciling("RollingOut", "RolledBack", f"rolling back to v{target}", ready_message=reason)

    def _desired_speculation(self, champion: str) -> bool:
        if "speculationEnabled" in self.ledger.fields:
            return bool(self.ledger.fields["speculationEnabled"])
        if str((self.status.get("drift") or {}).get("version", "")) == str(champion):
            return bool(self.status.get("speculationEnabled", True))
        return True  # a release the drift ladder has not acted on speculates

    def _probe(self) -> EngineProbe:
        return self.operator.vllm_probe if self.kind == "vllm" else self.operator.probe

    async def _reconcile_speculation(self, champion: str, pods: list[dict[str, Any]],
                                     infos: list[dict[str, Any]]) -> str:
        """Every pod speculates exactly when the operator wants it to (level-triggered: a pod that
        restarted after SpeculationOff speculates again until told otherwise). Returns what is
        still off-target ('' when every pod matches)."""
        desired = self._desired_speculation(champion)
        stuck = []
        for pod, info in zip(pods, infos):
            if bool(info.get("speculationEnabled", True)) == desired:
                continue
            name = pod["metadata"]["name"]
            if self.kind == "vllm":
                # No runtime switch: the Deployment is rendered with the desired state and rolls.
                stuck.append(f"pod {name} is replaced by one {'with' if desired else 'without'} speculation "
                             "(vLLM cannot switch it at run time)")
                continue
            try:
                await self._probe().set_speculation(self._address(pod), desired,
                                                    "operator: reconcile to the desired speculation state",
                                                    server_name=self._server_name())
                after = await self._probe().model_info(self._address(pod), server_name=self._server_name())
            except EngineUnreachable as exc:
                stuck.append(f"pod {name}: {exc}")
                continue
            if bool(after.get("speculationEnabled", True)) != desired:
                stuck.append(f"pod {name} still reports speculation {'off' if desired else 'on'}")
                continue
            msg = (f"pod {name} of v{champion} had speculation {'off' if desired else 'on'}; turned it "
                   f"{'on' if desired else 'off'} as the pair's drift state requires")
            self.ledger.event("Warning", "SpeculationReconciled", msg)
            self.logger.warning(msg)
        if not stuck:
            return ""
        return (f"speculation should be {'on' if desired else 'off'} on every pod of v{champion}; not yet: "
                + "; ".join(stuck))

    async def _drift(self, model: str, al: dict[str, str], champion: str, verdict: dict[str, Any],
                     tags: dict[str, str], pods: list[dict[str, Any]], infos: list[dict[str, Any]]) -> bool:
        """Observe each pod's counters, let drift.decide pick the ladder's step, apply it.
        True when this pass took a drift action or the champion serves target-only after one."""
        policy_spec = self.spec.get("drift") or {}
        if not policy_spec.get("enabled", True):
            return False
        policy = drift_mod.DriftPolicy.from_spec(policy_spec)
        now = time.monotonic()
        previous = drift_mod.state_for_release(self.status.get("drift"), champion)
        off = drift_mod.SPECULATION_OFF in policy.ladder[:previous.steps_taken]
        if tags.get(TAG_SPECULATION_OFF) and not off and drift_mod.SPECULATION_OFF in policy.ladder:
            # The pass that turned speculation off died before writing its status: adopt its step.
            previous = replace(previous, steps_taken=policy.ladder.index(drift_mod.SPECULATION_OFF) + 1,
                               since=time.time())
            off = True
            self.ledger.set(speculationEnabled=False)
            self.ledger.set(drift={**previous.as_dict(), "version": str(champion), "probing": False})
            self.ledger.record("SpeculationOff", tags[TAG_SPECULATION_OFF], champion, champion, warning=True)

        def degraded(extra: str = "") -> bool:
            if self.watching:  # the pass reports the spec's release; the Drifted condition says the rest
                return True
            self.ledger.ready("Degraded", "SpeculationOff", f"v{champion} serving target-only after drift{extra}")
            return True
        if now - self.operator.last_drift_check.get(self.uid, 0.0) < float(policy_spec.get("intervalSeconds", 30)):
            return degraded() if off else False
        self.operator.last_drift_check[self.uid] = now
        observed = []
        try:
            for pod in pods:
                stats = await self._probe().stats(self._address(pod), server_name=self._server_name())
                uptime = stats.get("uptimeSeconds")
                meta = pod["metadata"]
                observed.append(drift_mod.PodStats(
                    f"{meta['name']}/{meta.get('uid', '')}",
                    {cat: RequestMoments.from_stats(v) for cat, v in (stats.get("categories") or {}).items()},
                    time.time() - float(uptime) if uptime else None))
        except EngineUnreachable as exc:
            self.logger.warning(f"drift check skipped: {exc}")
            return degraded() if off else False
        version, memory = self.operator.samples.get(self.uid, ("", drift_mod.Memory()))
        if version != champion:
            memory = drift_mod.Memory()
        previous_baseline, same_models = None, False
        next_step = policy.ladder[previous.steps_taken] if previous.steps_taken < len(policy.ladder) else None
        if self.registry_down and next_step != drift_mod.SPECULATION_OFF:
            return off  # without MLflow only the protective first step is taken
        target = al.get(aliases_mod.PREVIOUS)
        if next_step == drift_mod.ROLLBACK and target and target != champion:
            # Rolling back only helps if the previous release does better on this traffic: its
            # gated baseline per category, and whether it serves the very same models.
            reg = self.operator.registry
            _, prev_verdict, _ = await self.registry(reg.gate_result, model, target)
            previous_baseline = gate_verdict.baseline_from_verdict(prev_verdict) if prev_verdict else None
            tags_prev = await self.registry(reg.version_tags, model, target)
            tags_cur = await self.registry(reg.version_tags, model, champion)

            def models(tags: dict[str, str]) -> Any:
                rel = json.loads(tags.get(TAG_RELEASE) or "{}")
                return rel.get("target"), rel.get("draft"), tags.get(TAG_TOKENIZER_DRAFT)
            same_models = TAG_RELEASE in tags_prev and models(tags_prev) == models(tags_cur)
        baseline = gate_verdict.baseline_from_verdict(verdict)
        if self.kind == "vllm":
            # vLLM counts drafts for the whole server, not per category: judge them against the
            # gated overall acceptance (and the previous release's, likewise).
            baseline = {k: v for k, v in baseline.items() if k == "*"}
            previous_baseline = {k: v for k, v in (previous_baseline or {}).items() if k == "*"} or None
        decision = drift_mod.decide(policy, previous, memory, time.time(), observed, baseline,
                                    previous_baseline, same_models)
        if self.registry_down and decision.action and decision.action != drift_mod.SPECULATION_OFF:
            return off
        self.operator.samples[self.uid] = (champion, decision.memory)
        state = decision.state
        probing = decision.memory.probe_started is not None
        self.ledger.set(drift={**state.as_dict(), "version": str(champion), "probing": probing})
        last = decision.memory.last
        live = {cat: round(j.live, 4) for cat, j in last.items() if cat != drift_mod.OVERALL}
        if drift_mod.OVERALL in last:
            self.ledger.set(acceptance=round(last[drift_mod.OVERALL].live, 4))
        shift = dict((self.status.get("live") or {}).get("trafficShift") or {})
        for cat, n in decision.shift.items():
            shift[cat] = int(shift.get(cat, 0)) + n
        self.ledger.set(live={"acceptance": live, "draftedTokens": {cat: j.drafted for cat, j in last.items()
                                                                  if cat != drift_mod.OVERALL},
                            "trafficShift": shift})
        messages = [j.message() for j in decision.breaches]
        if messages:
            self.ledger.cond(c.DRIFTED, True, "AcceptanceBelowBaseline", "; ".join(messages))
        elif any(j.verdict == drift_mod.FINE for j in decision.judged) and not off:
            self.ledger.cond(c.DRIFTED, False, "WithinBaseline", "live acceptance within the gated baseline"
                      + (f"; traffic shift, not judged: {', '.join(sorted(shift))}" if shift else ""))
        addresses = [self._address(pod) for pod in pods]
        if decision.action == drift_mod.SPECULATION_OFF:
            reason = "sustained drift: " + decision.reason
            # The mark first (see TAG_SPECULATION_OFF), then the pods. With MLflow down the status
            # alone carries the step (a crash before it is written loses it; the pods turn back on).
            if not self.registry_down:
                await self.registry(self.operator.registry.set_tags, model, champion, {TAG_SPECULATION_OFF: reason[:4000]})
            for address in addresses:
                await self._probe().set_speculation(address, False, reason[:500], server_name=self._server_name())
            self.ledger.set(speculationEnabled=False)
            self.ledger.cond(c.DRIFTED, True, "SpeculationOff", reason)
            self.ledger.record("SpeculationOff", reason, champion, champion, warning=True)
            self.ledger.ready("Degraded", "SpeculationOff", f"v{champion} serving target-only: {reason}")
            return True
        if decision.action == drift_mod.ROLLBACK:
            await self._rollback(model, al, champion, "drift persisted after speculation off: " + decision.reason)
            return True
        if decision.action == drift_mod.SPECULATION_ON:
            await self.registry(self.operator.registry.set_tags, model, champion, {TAG_SPECULATION_OFF: ""})
            for address in addresses:
                await self._probe().set_speculation(address, True, decision.reason[:500], server_name=self._server_name())
            self.ledger.set(speculationEnabled=True)
            self.ledger.cond(c.DRIFTED, False, "Recovered", decision.reason)
            self.ledger.record("SpeculationOn", decision.reason, champion, champion)
            return False
        if decision.reason:
            self.ledger.cond(c.DRIFTED, True, "RollbackWouldNotHelp", decision.reason)
        if off:
            # Speculation stays off but keeps being measured: probes turn it on for a while
            # when the engine drafted nothing since.
            if self.status.get("speculationEnabled", True) != decision.speculation:
                for address in addresses:
                    await self._probe().set_speculation(address, decision.speculation,
                                                        "drift probe" if decision.speculation else "drift probe over",
                                                        server_name=self._server_name())
                self.logger.info(f"drift probe {'started' if decision.speculation else 'over'} for v{champion}")
            self.ledger.set(speculationEnabled=decision.speculation)
            return degraded(" (probing with the draft)" if probing else "")
        return False
