"""The serving plan's rollout: the engine's objects (Deployment, Service, NetworkPolicy, autoscaler),
the models it waits for, the legacy engine retired, and the control listener's certificate."""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

from specpair_operator.release import aliases as aliases_mod
from specpair_operator.crd import conditions as c
from specpair_operator.desired import autoscaling, engine_objects, model_fetch
from specpair_operator.crd import names
from specpair_operator.desired import ownership as owned
from specpair_operator.policy import shadow_run
from specpair_operator.release import content as release_mod
from specpair_operator.desired import tls as tls_mod
from specpair_operator.plan.model_cache import fetch_job, fetch_steps
from specpair_operator.plan.release_steps import (PostEvent, Record, Report, SetStatus, TagVersion,
                                                  name_conflict_message)
from specpair_operator.release.registry_contract import TAG_HASH
from specpair_operator.observe.serving_world import ServingWorld
from specpair_operator.desired.pod_status import pods_waiting
from specpair_operator.plan.serving_draft_swap import (InPlace, resume_if_paused, swap_in_place, swapped_in_place,
                                                       SWAPPING)
from specpair_operator.plan.serving_steps import (ANN_TEMPLATE, CreateControlCA, deployment_after,
                                                  engine_selector, EnsureAutoscaler, EnsureOwned, IssueCertificate,
                                                  outcome, rendered_engine, taken_child, RetireLegacyEngine,
                                                  served_release,
                                                  TLSSecretSeen, _Steps)


def rollout_state(w: ServingWorld) -> tuple[str, str]:
    """The engine rollout's state after this pass's writes: ('conflict', 'KIND NAME'), or
    engine_objects.deployment_rollout_state's ('absent'|'progressing'|'available'|'failed', message)."""
    out = _Steps(w)
    state, msg = _engine(out, w, served_release(w))
    # While a draft is swapped into the running pods, the plan needs what they say they serve.
    return ("available", msg) if state == SWAPPING else (state, msg)


def name_conflict(w: ServingWorld, kind: str, name: str) -> Report:
    """An object with our child's name that this pair does not own: never touched."""
    return Report("stall", "Failed", "NameConflict", name_conflict_message(w.namespace, w.pair, kind, name))


def _engine(out: _Steps, w: ServingWorld, served: dict[str, Any]) -> tuple[str, str]:
    """The champion's engine: its control-listener certificate, NetworkPolicy, Deployment and
    Service, then its autoscaler. Returns the rollout's state and what it says (("conflict", "KIND NAME") for a
    child's name taken by an object the pair does not own: the NameConflict report is planned and
    nothing more is written then)."""
    version = w.aliases[aliases_mod.CHAMPION]
    digest = w.tags[TAG_HASH]
    kind = release_mod.engine_kind(served)
    taken = taken_child(w)
    if taken:
        out.add(name_conflict(w, *taken))
        return "conflict", " ".join(taken)
    # The control listener's certificate (vLLM pods': their companion's), before the first engine
    # pod needs it.
    if w.tls is not None:
        _certificate(out, w)
    # Ingress to engine pods on their ports only; in place before the first engine pod is.
    policy = engine_objects.engine_network_policy(w.pair, w.namespace, w.installation.pods)
    policy_outcome = outcome(w, policy, w.policy)
    if policy_outcome == owned.CONFLICT:
        out.add(name_conflict(w, "NetworkPolicy", policy["metadata"]["name"]))
        return "conflict", f"NetworkPolicy {policy['metadata']['name']}"
    if policy_outcome != owned.UNCHANGED:
        out.add(EnsureOwned(policy, w.policy))
    # A rollout is a new pod template. A new replica count alone (kubectl scale, an autoscaler:
    # spec.rollout.replicas) is scaling: an Event, no history entry, no rollout.
    rendered = rendered_engine(w, served)
    dep = rendered.deployment
    template = dep["metadata"]["annotations"][ANN_TEMPLATE]
    live = w.deployment
    live_template = ((live or {}).get("metadata", {}).get("annotations") or {}).get(ANN_TEMPLATE)
    if live_template != template and not _models_ready(out, w, version, served):
        return "fetching", ""
    roll = shadow_run.rolled_to(template, live)
    if w.shadow is not None and (not w.shadow.started_at or (live_template != template
                                                              and w.shadow.started_for != roll)):
        # The pods roll to score the candidate afresh: its evidence, and the clock of
        # rollout.shadow.maxSeconds, start over (the mark before the pods move, once per roll).
        out.add(TagVersion(w.shadow.version, {shadow_run.TAG_SHADOW_STARTED: shadow_run.started_mark(w.now, roll)}))
    key = f"{version}@{template}"
    # A release that changes only the draft: swapped into the running pods, no roll.
    in_place = swap_in_place(out, w, served, dep, live, version, key) if live_template != template else InPlace()
    if in_place.state is not None:
        return in_place.state
    result = outcome(w, dep, live, manifest=rendered.manifest)
    changed = result in (owned.CREATED, owned.PATCHED)
    if changed:
        out.add(EnsureOwned(dep, live))
    resume_if_paused(out, w, live)
    if result == owned.CREATED:
        out.add(Record("RolloutStarted", f"engine Deployment created for v{version}", None, version, key=key))
    elif (changed and live_template != template) or not (
            out.was("RolloutStarted", key, version) or swapped_in_place(out, w, key, version,
                                                                       release_mod.content_hash(served))):
        # Rolled now, or by a pass that died before writing its status.
        note = f" (not swapped in place: {in_place.why})" if in_place.draft_only else ""
        out.add(Record("RolloutStarted", f"engine Deployment rolled to v{version}{note}", None, version, key=key))
    elif changed and (live or {}).get("spec", {}).get("replicas") != dep["spec"]["replicas"]:
        out.add(PostEvent("Normal", "Scaled", f"engine Deployment of v{version} scaled from "
                          f"{live['spec'].get('replicas')} to {dep['spec']['replicas']} replicas"))
    after = deployment_after(dep, live, result)
    # The scale subresource's status: what autoscalers and `kubectl get --subresource=scale` read.
    out.add(SetStatus({"replicas": int(((after or {}).get("status") or {}).get("replicas") or 0),
                       "selector": engine_selector(w.pair)}))
    if w.service is None:
        out.add(EnsureOwned(engine_objects.engine_service(w.pair, w.namespace, dict(w.rollout), kind), None, mutable=False))
    out.add(EnsureAutoscaler(autoscaling.plan_autoscaler(dict(w.spec), w.pair, w.namespace, keda=w.keda,
                                                         default_prometheus=w.installation.prometheus)))
    state, msg = engine_objects.deployment_rollout_state(after, digest)
    if state == "progressing":
        waiting = pods_waiting([dict(p) for p in w.pods])
        if waiting:
            msg = f"{msg}; {waiting}"
    if state == "available":
        _retire_legacy(out, w, dep["metadata"]["name"])
    return state, msg


def _models_ready(out: _Steps, w: ServingWorld, version: str, served: dict[str, Any]) -> bool:
    """Before new engine pods read the model cache (a rollout, a rollback's included), the
    served release's models are in it: else its fetch Job's steps (model_cache.fetch_steps) and no
    rollout; the pods running keep serving."""
    ready, steps = fetch_steps(w.model_fetch, version, w.models, w.fetched,
                               out.was(model_fetch.MODEL_FETCH_FAILED, w.models, version), None, "RollingOut",
                               lambda: fetch_job(w.pair, w.namespace, served, w.rollout, w.installation))
    out.add(*steps)
    return ready


def _retire_legacy(out: _Steps, w: ServingWorld, current: str) -> None:
    """A pair whose name is not a DNS label had its engine Deployment under another name
    (names.legacy_object_name). Once the one under `current` is available, that one is scaled to
    zero (the operator may patch Deployments, not delete them): its pods carry the pair's labels
    and would serve, and be verified, beside the current ones."""
    legacy = names.legacy_object_name(w.pair, "engine")
    old = w.legacy_deployment
    if legacy == current or old is None or not owned.owns(w.uid, dict(old)) or not (old.get("spec") or {}).get("replicas"):
        return
    out.add(RetireLegacyEngine(legacy),
            PostEvent("Normal", "LegacyEngineRetired", f"Deployment {legacy} scaled to 0: the engine is Deployment "
                      f"{current} now (a pair name that is not a DNS label gets a hash in its objects' names); the "
                      f"objects named {names.legacy_object_name(w.pair)}-* this pair owns are unused and may be deleted"))


def certificate_check(w: ServingWorld) -> str:
    """How status.engineTLS stands against the CA and names of now: 'other' (another Secret, CA
    or names: ask whether the Secret holds one anyway), 'expiring', or 'current' (ask now and
    then whether the Secret is still there)."""
    tls, have = w.tls, w.status.get("engineTLS") or {}
    if have.get("secret") != tls.secret or have.get("caFingerprint") != tls.ca_fingerprint \
            or list(have.get("names") or []) != list(tls.names):
        return "other"
    if c.parse_iso(have.get("notAfter") or "1970-01-01T00:00:00Z") - c.parse_iso(w.now) \
            < datetime.timedelta(days=tls_mod.RENEW_DAYS):
        return "expiring"
    return "current"


def issued_for(ca_fingerprint: str, dns: tuple[str, ...]) -> str:
    return f"{ca_fingerprint}/{hashlib.sha256(','.join(dns).encode()).hexdigest()[:16]}"


def _certificate(out: _Steps, w: ServingWorld) -> None:
    """Issue the engine's control-listener certificate when it has none, was issued by another CA
    or for other names, nears its end, or its Secret is gone. What was issued is kept in
    status.engineTLS, so the operator never reads a Secret in the pair's namespace (RBAC: create
    and patch, no get)."""
    tls, have = w.tls, w.status.get("engineTLS") or {}
    if tls.ca_missing:
        # No CA (a new installation, or its Secret deleted): act makes one, then issues from it.
        out.add(CreateControlCA())
    if tls.seen_at is not None:
        out.add(TLSSecretSeen(tls.seen_at))
    check = certificate_check(w)
    reason = ""
    if check == "other":
        reason = "no certificate from this CA yet" if have.get("caFingerprint") != tls.ca_fingerprint \
            else "the Service's names changed"
        if tls.held:
            # This pair's Secret holds a certificate from this CA for these names: a pass issued it
            # and died before its status said so. Its end cannot be read here, so it is renewed
            # within a day, by a pass that records what it issues.
            until = c.parse_iso(w.now) + datetime.timedelta(days=tls_mod.RENEW_DAYS + 1)
            out.add(SetStatus({"engineTLS": {"secret": tls.secret, "caFingerprint": tls.ca_fingerprint,
                                             "names": list(tls.names), "notAfter": until.strftime("%Y-%m-%dT%H:%M:%SZ")}}))
            return
    elif check == "expiring":
        reason = f"it expires {have.get('notAfter')}"
    elif tls.missing:
        reason = f"engine pods cannot find Secret {tls.secret}"
    if not reason:
        out.add(SetStatus({"engineTLS": dict(have)}))
        return
    out.add(IssueCertificate(reason, tls.issued_for))
