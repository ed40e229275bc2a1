"""What a pass does about the champion's serving, decided from what it observed: pure (no I/O).

`plan_serving(world)` returns the ordered steps: the engine's objects (control-listener
certificate, NetworkPolicy, Deployment, Service, autoscaler), retiring the legacy engine, a
rollback (a rollout that failed, a tokenizer that does not match the gated one, the drift
ladder's last step), the drift ladder's speculation switches, each pod's speculation, the marks
in MLflow; and what goes into the status (history entries with their Events, conditions,
fields, the report). `plan_watch(world)` is the part that still runs while MLflow is down:
identity, drift (only SpeculationOff) and speculation.

The crash marks live here, in one place:

- a rollback tags the champion `specpair.rolled_back` before the aliases move; a champion found
  with that tag has its rollback finished (the aliases moved, RolledBack recorded once);
- SpeculationOff tags the champion `specpair.drift.speculation_off` before the pods are switched;
  a mark the status does not know of is adopted as the ladder's step taken (recorded now);
- a Deployment rolled (or created) is recorded as RolloutStarted once per template
  (`version@template`), also when the pass that rolled it died before writing its status; a new
  replica count alone is scaling: an Event, no history entry;
- a certificate the pair's Secret holds for this CA and these names (marked `issued-for`) but
  status does not know of was issued by a pass that died: kept, renewed within a day.

act (reconciler.py) runs the steps in order; status steps take effect when the pass ends.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from specpair.stats import RequestMoments

from . import aliases as aliases_mod
from . import canary as canary_mod
from . import conditions as c
from . import drift as drift_mod
from . import gate_verdict, manifests, model_fetch, names, owned, rollout_strategy, serving_health, shadow_run
from . import release as release_mod
from . import tls as tls_mod
from .plan import (TAG_RELEASE, TAG_SPECULATION_OFF, Condition, PostEvent, Record, Report, SetAlias, SetStatus,
                   StartModelFetch, TagVersion, fetch_steps, name_conflict_message, serving_versions,
                   shadow_verdict_steps)
from .registry_contract import TAG_HASH, TAG_ROLLED_BACK, TAG_TOKENIZER_DRAFT, TAG_TOKENIZER_TARGET
from .serving_world import EnginePod, ServingWorld
from .world import pods_waiting

# On the engine Deployment: a fingerprint of its spec without the replica count, to tell a
# rollout (a new pod template) from scaling.
ANN_TEMPLATE = "specpair.io/template-hash"
ANN_ISSUED_FOR = "specpair.io/issued-for"  # on the engine's TLS Secret: CA fingerprint / hash of the names


# -- writes ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EnsureOwned:
    """Create or patch one of the engine's objects (owned.ensure_owned), planned only when it is
    absent or differs from what the operator renders; a name taken since the pass looked stops
    the pass with NameConflict."""
    manifest: Mapping[str, Any]
    live: Mapping[str, Any] | None
    mutable: bool = True


@dataclass(frozen=True)
class EnsureAutoscaler:
    """The pair's autoscaler as `rollout.autoscaling` says (autoscaling.ensure_autoscaler: it
    reads what it needs, writes, and says so in the Autoscaled condition and Events)."""


@dataclass(frozen=True)
class IssueCertificate:
    """Issue the engine's control-listener certificate into its Secret (why: `reason`); its
    status.engineTLS and a CertificateIssued Event go with it."""
    reason: str
    issued_for: str


@dataclass(frozen=True)
class RetireLegacyEngine:
    """Scale the engine Deployment under the pair's old name to zero."""
    name: str


@dataclass(frozen=True)
class SwitchSpeculation:
    """The drift ladder turns speculation on or off on these pods (control addresses)."""
    addresses: tuple[str, ...]
    enabled: bool
    reason: str


@dataclass(frozen=True)
class RollSpeculation(PostEvent):
    """The drift ladder switches speculation on a vLLM pair, which cannot switch it at run time:
    the switch is the engine Deployment rendered from status.speculationEnabled (the status this
    pass sets), rolled by the next pass. This step is what the plan says of it, and act posts it
    as the Event it is (Warning when the roll leaves the pair without a ready pod)."""
    enabled: bool = True
    roll: rollout_strategy.SpeculationRoll | None = None


@dataclass(frozen=True)
class ReconcilePodSpeculation:
    """A pod reports the other speculation state than the pair wants: switch it and ask again.
    One that does not follow is named in the report (ReportSpeculation)."""
    pod: str
    address: str
    desired: bool
    champion: str


# -- the operator's memory and metrics (in process) --------------------------------------------

@dataclass(frozen=True)
class RememberChampion:
    """What MLflow said about the verified champion, to judge its drift while MLflow is down."""
    champion: str
    tags: Mapping[str, str]
    verdict: Mapping[str, Any]
    served_hash: str


@dataclass(frozen=True)
class DriftChecked:
    at: float                    # monotonic


@dataclass(frozen=True)
class RememberDrift:
    champion: str
    memory: drift_mod.Memory
    serving: serving_health.ServingMemory | None = None


@dataclass(frozen=True)
class ForgetDrift:
    """A rollback: the samples of the release rolled back from go."""


@dataclass(frozen=True)
class ExportSpeedup:
    champion: str
    verdict: Mapping[str, Any]


@dataclass(frozen=True)
class LogWarning:
    message: str


# -- the report when it depends on what the switches did ---------------------------------------

@dataclass(frozen=True)
class ReportSpeculation:
    """Pods still off the speculation state the pair wants (`stuck`, plus each
    ReconcilePodSpeculation that did not take) are what the pass reports; otherwise `otherwise`."""
    desired: bool
    champion: str
    stuck: tuple[str, ...] = ()
    otherwise: Report | None = None


WRITES = (SetAlias, TagVersion, EnsureOwned, IssueCertificate, RetireLegacyEngine, SwitchSpeculation,
          ReconcilePodSpeculation)
Step = Any


def speculation_not_reconciled(desired: bool, champion: str, stuck: list[str]) -> Report:
    return Report("reconciling", "Degraded", "SpeculationNotReconciled",
                  f"speculation should be {'on' if desired else 'off'} on every pod of v{champion}; not yet: "
                  + "; ".join(stuck), replacing=True)


# -- pure reads of the world -------------------------------------------------------------------

def engine_selector(pair: str) -> str:
    return ",".join(f"{k}={v}" for k, v in manifests.engine_selector(pair).items())


def kind_of(w: ServingWorld) -> str:
    return release_mod.engine_kind(json.loads(w.tags.get(TAG_RELEASE) or "{}"))


def address(w: ServingWorld, pod: EnginePod) -> str:
    """The pod's control listener (mutual TLS): the operator never uses the serving port. A
    vLLM pod's is its companion's (specpair.vllm_companion), on the same port."""
    return f"{pod.ip}:{int(w.rollout.get('controlPort', manifests.CONTROL_PORT))}"


def served_release(w: ServingWorld) -> dict[str, Any]:
    """The champion's release as its engine pods get it: with the gate's tuning (k and the batch
    threshold it found on real hardware; a threshold of 0 means speculation did not pay at any
    batch size there) unless the spec says not to, and where MLflow is."""
    served = gate_tuned(json.loads(w.tags[TAG_RELEASE]), w.verdict, w.rollout)
    return release_mod.with_mlflow(served, w.installation.tracking_uri, w.model, w.aliases[aliases_mod.CHAMPION])


def gate_tuned(release: dict[str, Any], verdict: Mapping[str, Any], rollout: Mapping[str, Any]) -> dict[str, Any]:
    """The release with the k and batch threshold its gate found best, unless rollout.applyGateTuning
    is false."""
    best = verdict.get("bestSpeculation") or {}
    if rollout.get("applyGateTuning", True):
        release["speculation"].update({k: v for k, v in best.items() if k in ("k", "batchSizeThreshold")})
    return release


def shadow_release(w: ServingWorld) -> dict[str, Any]:
    """The release file of the candidate scored in shadow (w.shadow), tuned as it would serve."""
    run = w.shadow
    tuned = gate_tuned(json.loads(json.dumps(dict(run.release))), run.verdict, w.rollout)
    return release_mod.with_mlflow(tuned, w.installation.tracking_uri, w.model, run.version)


def status_speculation(w: ServingWorld, champion: str) -> bool:
    """The speculation state status wants for `champion` (a release the drift ladder has not
    acted on speculates)."""
    if str((w.status.get("drift") or {}).get("version", "")) == str(champion):
        return bool(w.status.get("speculationEnabled", True))
    return True


def engine_deployment(w: ServingWorld, served: dict[str, Any]) -> dict[str, Any]:
    champion = w.aliases[aliases_mod.CHAMPION]
    i = w.installation
    dep = manifests.engine_deployment(w.pair, w.namespace, served, w.tags[TAG_HASH], champion, dict(w.rollout),
                                      i.tracking_uri,
                                      # Engine pods need MLflow only to download a model from it.
                                      i.credentials if release_mod.reads_from_mlflow(served) else None,
                                      i.pods, speculation=status_speculation(w, champion),
                                      shadow=None if w.shadow is None else (shadow_release(w), w.shadow.settings.share))
    live_template = (((w.deployment or {}).get("spec") or {}).get("template") or {}).get("metadata") or {}
    if w.shadow is None and manifests.ANN_SHADOW_RELEASE in (live_template.get("annotations") or {}):
        # A shadow that ended: its candidate's file goes (a merge patch keeps what it does not name).
        dep["spec"]["template"]["metadata"]["annotations"][manifests.ANN_SHADOW_RELEASE] = None
    dep["metadata"].setdefault("annotations", {})[ANN_TEMPLATE] = template_fingerprint(dep)
    return dep


def template_fingerprint(dep: Mapping[str, Any]) -> str:
    return owned.manifest_fingerprint({**dep["spec"], "replicas": None})


def outcome(w: ServingWorld, desired: Mapping[str, Any], live: Mapping[str, Any] | None, mutable: bool = True) -> str:
    """What ensure_owned will do to `desired` given `live` (owned.CREATED, PATCHED, UNCHANGED,
    CONFLICT)."""
    if live is None:
        return owned.CREATED
    if not owned.owns(w.uid, dict(live)):
        return owned.CONFLICT
    stamped = json.loads(json.dumps(desired))
    fingerprint = owned.stamp(stamped)
    if not mutable or (live["metadata"].get("annotations") or {}).get(owned.ANN_MANIFEST) == fingerprint:
        return owned.UNCHANGED
    return owned.PATCHED


def deployment_after(dep: Mapping[str, Any], live: Mapping[str, Any] | None, result: str) -> dict[str, Any] | None:
    """The Deployment as the API server returns it from the write: a new spec bumps its
    generation past what the Deployment controller observed; a create has no status yet."""
    if result == owned.UNCHANGED:
        return dict(live) if live is not None else None
    if result == owned.CREATED:
        return {"metadata": {**dep["metadata"], "generation": 1}, "spec": dep["spec"], "status": {}}
    meta = live["metadata"]
    new_spec = (meta.get("annotations") or {}).get(ANN_TEMPLATE) != dep["metadata"]["annotations"][ANN_TEMPLATE] \
        or (live.get("spec") or {}).get("replicas") != dep["spec"]["replicas"]
    return {"metadata": {**meta, "annotations": {**(meta.get("annotations") or {}), **dep["metadata"]["annotations"]},
                         "generation": int(meta.get("generation", 1)) + (1 if new_spec else 0)},
            "spec": {**(live.get("spec") or {}), "replicas": dep["spec"]["replicas"]},
            "status": live.get("status") or {}}


def name_taken(w: ServingWorld) -> str:
    """'KIND NAME' of the engine Deployment or Service when an object the pair does not own has
    its name ('' when neither)."""
    for kind, obj in (("Deployment", w.deployment), ("Service", w.service)):
        if obj is not None and not owned.owns(w.uid, dict(obj)):
            return f"{kind} {obj['metadata']['name']}"
    return ""


def rollout_state(w: ServingWorld) -> tuple[str, str]:
    """The engine rollout's state after this pass's writes: ('conflict', 'KIND NAME'), or
    manifests.deployment_rollout_state's ('absent'|'progressing'|'available'|'failed', message)."""
    out = _Steps(w)
    return _engine(out, w, served_release(w))


def identity(w: ServingWorld, champion: str, digest: str) -> tuple[bool, str, list[EnginePod]]:
    """Whether every ready pod serves this pair's `champion` with content hash `digest` and the
    gated tokenizers; else what is wrong on the first pod that is not."""
    if not w.ready:
        return False, "no ready engine pods", []
    expected = {"target": w.tags.get(TAG_TOKENIZER_TARGET), "draft": w.tags.get(TAG_TOKENIZER_DRAFT)}
    verified: list[EnginePod] = []
    for pod in w.ready:
        if pod.info is None:
            return False, f"pod {pod.name}: model identity not verified: {pod.unreachable or 'not asked'}", verified
        info = pod.info
        # `digest` is the hash of the release document this pod was given; the engine hashes
        # the file it loaded, so a pod serving anything else is caught here.
        served = (info.get("pair"), str(info.get("releaseVersion")), info.get("contentHash") or "")
        if served != (w.pair, champion, digest):
            return False, (f"pod {pod.name} serves {served[0]} v{served[1]} with content hash "
                           f"{served[2][:12] or '(none)'}; release is {w.pair} v{champion} "
                           f"({digest[:12]})"), verified
        mismatch = drift_mod.fingerprint_mismatch(expected, dict(info.get("tokenizer") or {}))
        if mismatch:
            return False, f"tokenizer mismatch on pod {pod.name}: " + "; ".join(mismatch), verified
        verified.append(pod)
    return True, "", verified


def champion_digest(w: ServingWorld) -> str:
    """The hash of the release document the champion's pods were given."""
    return w.served_hash or release_mod.content_hash(served_release(w))


@dataclass(frozen=True)
class DriftPosition:
    """Where the champion is on the drift ladder as this pass starts."""
    policy: drift_mod.DriftPolicy
    previous: drift_mod.DriftState
    off: bool                      # SpeculationOff is among the steps taken
    adopted: bool                  # taken from the champion's mark: the pass that took it died first
    due: bool                      # an interval has passed since the last check
    next_step: str | None


def serving_breach_reason(judged: serving_health.Judgement) -> str:
    return "ErrorRateAboveLimit" if judged.metric == serving_health.ERRORS else "LatencyAboveBaseline"


def drift_position(w: ServingWorld, champion: str) -> DriftPosition | None:
    """None when drift is not watched (spec.drift.enabled false)."""
    spec = w.spec.get("drift") or {}
    if not spec.get("enabled", True):
        return None
    policy = drift_mod.DriftPolicy.from_spec(dict(spec))
    previous = drift_mod.state_for_release(dict(w.status.get("drift") or {}), champion)
    off = drift_mod.SPECULATION_OFF in policy.ladder[:previous.steps_taken]
    adopted = bool(w.tags.get(TAG_SPECULATION_OFF)) and not off and drift_mod.SPECULATION_OFF in policy.ladder
    if adopted:
        previous = replace(previous, steps_taken=policy.ladder.index(drift_mod.SPECULATION_OFF) + 1,
                           since=w.drift.wall)
        off = True
    due = w.drift.monotonic - w.drift.checked_at >= float(spec.get("intervalSeconds", 30))
    next_step = policy.ladder[previous.steps_taken] if previous.steps_taken < len(policy.ladder) else None
    return DriftPosition(policy, previous, off, adopted, due, next_step)


def rollback_needs_previous(w: ServingWorld, champion: str) -> bool:
    """Whether the drift check needs the facts of the release a rollback would go to."""
    pos = drift_position(w, champion)
    target = w.aliases.get(aliases_mod.PREVIOUS)
    return pos is not None and pos.due and not w.registry_down and pos.next_step == drift_mod.ROLLBACK \
        and bool(target) and target != champion


# -- the plan ----------------------------------------------------------------------------------

@dataclass
class _Steps:
    world: ServingWorld
    steps: list[Step] = field(default_factory=list)
    reported: bool = False
    fields: dict[str, Any] = field(default_factory=dict)   # status fields set by this plan

    def add(self, *steps: Step) -> None:
        for step in steps:
            if isinstance(step, Report):
                self.reported = True
            elif isinstance(step, SetStatus):
                self.fields.update(step.fields)
        self.steps.extend(steps)

    def was(self, action: str, key: str, version: str) -> bool:
        return self.world.records.was(action, key, version) or any(
            isinstance(s, Record) and s.action == action and s.key == key for s in self.steps)

    def speculation(self, champion: str) -> bool:
        if "speculationEnabled" in self.fields:
            return bool(self.fields["speculationEnabled"])
        return status_speculation(self.world, champion)


def plan_serving(w: ServingWorld) -> tuple[Step, ...]:
    """Roll the engine to the champion and judge it; `w.desired` None means the spec's release is
    not servable (failed gate, rolled back) and the champion carries on. The champion's drift is
    watched either way. While a gate runs (`w.while_gating`) the pass's report stays the gate's
    unless the champion needs an action."""
    out = _Steps(w)
    aliases = w.aliases
    champion = aliases.get(aliases_mod.CHAMPION)
    out.add(SetStatus(serving_versions(aliases)))
    if champion is None:
        if not w.while_gating:
            out.add(Report("stalled", "Failed", "NoRelease", w.desired_reason or "no release has passed the gate"))
        return tuple(out.steps)
    if w.tags.get(TAG_ROLLED_BACK):
        # Rolled back, but the pass that tagged it died before moving the alias: finish it.
        _rollback(out, champion, w.tags[TAG_ROLLED_BACK], marked=True)
        return tuple(out.steps)
    served = served_release(w)
    verdict = w.verdict
    if isinstance(verdict.get("speedup"), (int, float)):
        out.add(SetStatus({"speedup": float(verdict["speedup"])}))
    out.add(ExportSpeedup(champion, verdict))
    # Until live traffic has been measured, the printer column shows the gated acceptance.
    if isinstance(verdict.get("acceptanceRate"), (int, float)) and \
            (w.status.get("servingVersion") != champion or "acceptance" not in w.status):
        out.add(SetStatus({"acceptance": float(verdict["acceptanceRate"])}))
    state, msg = _engine(out, w, served)
    if state == "conflict":
        kind, name = msg.split(" ", 1)
        out.add(name_conflict(w, kind, name))
        return tuple(out.steps)
    if state == "fetching":
        return tuple(out.steps)   # the fetch's steps said so
    if state == "failed" and w.shadow is not None:
        # The pods that carry the candidate's drafter do not come up: the candidate is rejected
        # and the champion is rendered without it, not rolled back.
        out.add(_shadow_verdict(out, champion, shadow_run.REJECTED, f"the pods of v{champion} scoring it did not "
                                f"become available: {msg}", {}))
        return tuple(out.steps)
    if state == "failed":
        _rollback(out, champion, f"rollout of v{champion} failed: {msg}")
        return tuple(out.steps)
    if state != "available":
        if not w.while_gating:
            out.add(Report("reconciling", "RollingOut", "RollingOut", f"rolling out v{champion}: {msg}", ready_message=msg))
        return tuple(out.steps)
    digest = release_mod.content_hash(served)
    ok, why, verified = identity(w, champion, digest)
    if ok:
        out.add(RememberChampion(champion, dict(w.tags), dict(verdict), digest))
    if why.startswith("tokenizer"):
        _rollback(out, champion, why)
        return tuple(out.steps)
    if not ok:
        if not w.while_gating:
            out.add(Report("reconciling", "RollingOut", "IdentityUnverified", why))
        return tuple(out.steps)
    # The champion is watched whatever the spec's release is doing (gated, failed, rolled back).
    watching = w.while_gating or w.desired is None
    drifted = _drift(out, champion, verified, watching)
    stuck = _speculation(out, champion, verified)
    if w.canary_run is None:
        _retire_canary(out, champion)
    if w.while_gating or (w.desired is None and drifted and out.reported):
        return tuple(out.steps)  # nothing to say beyond what a drift action this pass already said
    if w.desired is None:
        out.add(Report("stalled", "Degraded", "ReleaseNotServable", f"{w.desired_reason}; v{champion} keeps serving",
                       ready_reason="ChampionKeepsServing"))
        return tuple(out.steps)
    shadowing = _shadow(out, champion, verified) if w.shadow is not None else None
    canarying = _canary(out, champion, verified) if w.canary_run is not None else None
    # A pod not yet at the speculation state drift wants is what this pass reports, over the
    # drift step it took.
    serving = None if drifted else shadowing or canarying or Report("ready", "Serving", "Serving",
                                                       f"v{champion} serving on {len(w.ready)} pod(s), identity verified")
    out.add(ReportSpeculation(out.speculation(champion), champion, tuple(stuck), serving))
    return tuple(out.steps)


def plan_watch(w: ServingWorld) -> tuple[Step, ...]:
    """MLflow is down, serving is not: keep judging the champion's drift on what MLflow said
    last (`w.registry_down`). Only the protective first step (SpeculationOff) can be taken;
    promotion, rollback and SpeculationOn wait for MLflow."""
    out = _Steps(w)
    champion = w.aliases[aliases_mod.CHAMPION]
    ok, _, verified = identity(w, champion, w.served_hash)
    if ok:
        _drift(out, champion, verified, watching=False)
        _speculation(out, champion, verified)
    return tuple(out.steps)


def name_conflict(w: ServingWorld, kind: str, name: str) -> Report:
    """An object with our child's name that this pair does not own: never touched."""
    return Report("stall", "Failed", "NameConflict", name_conflict_message(w.namespace, w.pair, kind, name))


def _engine(out: _Steps, w: ServingWorld, served: dict[str, Any]) -> tuple[str, str]:
    """The champion's engine: its control-listener certificate, NetworkPolicy, Deployment and
    Service, then its autoscaler. Returns the rollout's state and what it says (("conflict", "KIND NAME") for a
    child's name taken by an object the pair does not own: nothing more is written then)."""
    version = w.aliases[aliases_mod.CHAMPION]
    digest = w.tags[TAG_HASH]
    kind = release_mod.engine_kind(served)
    taken = name_taken(w)
    if taken:
        return "conflict", taken
    # The control listener's certificate (vLLM pods': their companion's), before the first engine
    # pod needs it.
    if w.tls is not None:
        _certificate(out, w)
    # Ingress to engine pods on their ports only; in place before the first engine pod is.
    policy = manifests.engine_network_policy(w.pair, w.namespace, w.installation.pods)
    policy_outcome = outcome(w, policy, w.policy)
    if policy_outcome == owned.CONFLICT:
        return "conflict", f"NetworkPolicy {policy['metadata']['name']}"
    if policy_outcome != owned.UNCHANGED:
        out.add(EnsureOwned(policy, w.policy))
    # A rollout is a new pod template. A new replica count alone (kubectl scale, an autoscaler:
    # spec.rollout.replicas) is scaling: an Event, no history entry, no rollout.
    dep = engine_deployment(w, served)
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
    result = outcome(w, dep, live)
    changed = result in (owned.CREATED, owned.PATCHED)
    if changed:
        out.add(EnsureOwned(dep, live))
    key = f"{version}@{template}"
    if result == owned.CREATED:
        out.add(Record("RolloutStarted", f"engine Deployment created for v{version}", None, version, key=key))
    elif (changed and live_template != template) or not out.was("RolloutStarted", key, version):
        # Rolled now, or by a pass that died before writing its status.
        out.add(Record("RolloutStarted", f"engine Deployment rolled to v{version}", None, version, key=key))
    elif changed and (live or {}).get("spec", {}).get("replicas") != dep["spec"]["replicas"]:
        out.add(PostEvent("Normal", "Scaled", f"engine Deployment of v{version} scaled from "
                          f"{live['spec'].get('replicas')} to {dep['spec']['replicas']} replicas"))
    after = deployment_after(dep, live, result)
    # The scale subresource's status: what autoscalers and `kubectl get --subresource=scale` read.
    out.add(SetStatus({"replicas": int(((after or {}).get("status") or {}).get("replicas") or 0),
                       "selector": engine_selector(w.pair)}))
    if w.service is None:
        out.add(EnsureOwned(manifests.engine_service(w.pair, w.namespace, dict(w.rollout), kind), None, mutable=False))
    out.add(EnsureAutoscaler())
    state, msg = manifests.deployment_rollout_state(after, digest)
    if state == "progressing":
        waiting = pods_waiting([dict(p) for p in w.pods])
        if waiting:
            msg = f"{msg}; {waiting}"
    if state == "available":
        _retire_legacy(out, w, dep["metadata"]["name"])
    return state, msg


def _models_ready(out: _Steps, w: ServingWorld, version: str, served: dict[str, Any]) -> bool:
    """Before new engine pods read the model cache (a rollout, a rollback's included), the
    served release's models are in it: else its fetch Job's steps (plan.fetch_steps) and no
    rollout; the pods running keep serving."""
    ready, steps = fetch_steps(w.model_fetch, version, w.models, w.fetched,
                               out.was(model_fetch.MODEL_FETCH_FAILED, w.models, version), None, "RollingOut")
    inst = w.installation
    for step in steps:
        if isinstance(step, StartModelFetch):
            step = EnsureOwned(model_fetch.desired_fetch_job(w.pair, w.namespace, served, dict(w.rollout),
                                                             inst.tracking_uri, inst.credentials, inst.pods),
                               None, mutable=False)
        out.add(step)
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


def _rollback(out: _Steps, champion: str, reason: str, marked: bool = False) -> None:
    w = out.world
    al = dict(w.aliases)
    target = aliases_mod.rollback_target(al)
    out.add(Condition(c.DRIFTED, True, "RolledBack" if target else "NoPreviousRelease", reason))
    if target is None:
        out.add(Report("stalled", "Failed", "NoPreviousRelease", f"{reason}; no previous release",
                       ready_message=f"{reason}; no previous release to roll back to"))
        return
    # The tag first: it is what keeps a restarted operator from re-promoting this version, and
    # what makes the next pass finish the alias move if this one dies before it.
    if not marked:
        out.add(TagVersion(champion, {TAG_ROLLED_BACK: reason[:4000]}))
    for move in aliases_mod.plan_rollback(al):
        out.add(SetAlias(move.alias, move.version))
    out.add(Record("RolledBack", reason, champion, target, warning=True, key=champion),
            ForgetDrift(),
            SetStatus({"drift": drift_mod.DriftState().as_dict()}),
            SetStatus({"speculationEnabled": True}),
            SetStatus(serving_versions({**al, aliases_mod.CHAMPION: target})),
            Report("reconciling", "RollingOut", "RolledBack", f"rolling back to v{target}", ready_message=reason))


def _speculation(out: _Steps, champion: str, pods: list[EnginePod]) -> list[str]:
    """Every pod speculates exactly when the operator wants it to (level-triggered: a pod that
    restarted after SpeculationOff speculates again until told otherwise). Returns the pods known
    now to stay off-target (vLLM cannot switch at run time); act adds those that do not follow."""
    w = out.world
    desired = out.speculation(champion)
    stuck = []
    for pod in pods:
        if bool((pod.info or {}).get("speculationEnabled", True)) == desired:
            continue
        if kind_of(w) == "vllm":
            # No runtime switch: the Deployment is rendered with the desired state and rolls.
            stuck.append(f"pod {pod.name} is replaced by one {'with' if desired else 'without'} speculation "
                         "(vLLM cannot switch it at run time)")
            continue
        out.add(ReconcilePodSpeculation(pod.name, address(w, pod), desired, champion))
    return stuck


def _switch(out: _Steps, champion: str, addresses: tuple[str, ...], enabled: bool, reason: str) -> None:
    """The drift ladder's switch: on the specpair engine each pod's SetSpeculation. vLLM has no
    runtime switch (its probe's set_speculation refuses), so no such step is planned for its
    pods: the Deployment, rendered from the speculationEnabled this pass sets, rolls, and the
    plan says how (RollSpeculation)."""
    w = out.world
    if kind_of(w) != "vllm":
        out.add(SwitchSpeculation(addresses, enabled, reason[:500]))
        return
    roll = rollout_strategy.speculation_roll(manifests.rollout_strategy(dict(w.rollout)),
                                             int(w.rollout.get("replicas", 1)))
    out.add(RollSpeculation("Warning" if roll.unserved else "Normal", "SpeculationRollout",
                            f"{roll.describe(champion, enabled)}; because: {reason}"[:1000], enabled, roll))


def _drift(out: _Steps, champion: str, pods: list[EnginePod], watching: bool) -> bool:
    """Let drift.decide pick the ladder's step from each pod's counters, and take it. True when
    this pass took a drift action or the champion serves target-only after one."""
    w = out.world
    pos = drift_position(w, champion)
    if pos is None:
        return False
    policy, previous, off = pos.policy, pos.previous, pos.off
    if pos.adopted:
        # The pass that turned speculation off died before writing its status: adopt its step.
        out.add(SetStatus({"speculationEnabled": False}),
                SetStatus({"drift": {**previous.as_dict(), "version": str(champion), "probing": False}}),
                Record("SpeculationOff", w.tags[TAG_SPECULATION_OFF], champion, champion, warning=True))

    def degraded(extra: str = "") -> bool:
        if not watching:  # watched, the pass reports the spec's release; the Drifted condition says the rest
            out.add(Report("ready", "Degraded", "SpeculationOff", f"v{champion} serving target-only after drift{extra}"))
        return True
    if not pos.due:
        return degraded() if off else False
    out.add(DriftChecked(w.drift.monotonic))
    unreachable = next((p for p in pods if p.stats is None), None)
    if unreachable is not None:
        out.add(LogWarning(f"drift check skipped: {unreachable.stats_unreachable or 'no counters'}"))
        return degraded() if off else False
    observed = []
    for pod in pods:
        stats = pod.stats or {}
        uptime = stats.get("uptimeSeconds")
        observed.append(drift_mod.PodStats(
            f"{pod.name}/{pod.uid}",
            {cat: RequestMoments.from_stats(v) for cat, v in (stats.get("categories") or {}).items()},
            w.drift.wall - float(uptime) if uptime else None))
    memory = w.drift.memory if w.drift.version == champion else drift_mod.Memory()
    if w.registry_down and pos.next_step != drift_mod.SPECULATION_OFF:
        return off  # without MLflow only the protective first step is taken
    previous_baseline, same_models = None, False
    if rollback_needs_previous(w, champion):
        # Rolling back only helps if the previous release does better on this traffic: its gated
        # baseline per category, and whether it serves the very same models.
        prev_verdict = w.drift.previous_verdict
        previous_baseline = gate_verdict.baseline_from_verdict(dict(prev_verdict)) if prev_verdict else None
        tags_prev = w.drift.previous_tags or {}

        def models(tags: Mapping[str, str]) -> Any:
            rel = json.loads(tags.get(TAG_RELEASE) or "{}")
            return rel.get("target"), rel.get("draft"), tags.get(TAG_TOKENIZER_DRAFT)
        same_models = TAG_RELEASE in tags_prev and models(tags_prev) == models(w.tags)
    # vLLM pods count per category too (their companion, from vLLM's per-request acceptance):
    # both engines are judged against the gated baseline per category, by the same rules.
    baseline = gate_verdict.baseline_from_verdict(dict(w.verdict))
    # Acceptance and serving health (latency, errors) climb the same ladder.
    serving_pods = [serving_health.serving_pod(p.pod, pod.stats or {}, p.started) for p, pod in zip(observed, pods)]
    outcome = serving_health.decide(
        policy, serving_health.LatencyPolicy.from_spec(dict(w.spec.get("drift") or {})), previous, memory,
        serving_health.ServingState.for_release(dict(w.status.get("servingHealth") or {}), champion),
        w.drift.serving, w.drift.wall, observed, serving_pods, baseline, previous_baseline, same_models,
        champion=champion, previous_version=w.aliases.get(aliases_mod.PREVIOUS),
        speculating=any(bool((pod.stats or {}).get("speculating")) for pod in pods))
    decision = outcome.drift
    if w.registry_down and decision.action and decision.action != drift_mod.SPECULATION_OFF:
        return off
    out.add(RememberDrift(champion, decision.memory, outcome.serving.memory),
            SetStatus({"servingHealth": outcome.serving.status()}))
    state = decision.state
    probing = decision.memory.probe_started is not None
    out.add(SetStatus({"drift": {**state.as_dict(), "version": str(champion), "probing": probing}}))
    last = decision.memory.last
    live = {cat: round(j.live, 4) for cat, j in last.items() if cat != drift_mod.OVERALL}
    if drift_mod.OVERALL in last:
        out.add(SetStatus({"acceptance": round(last[drift_mod.OVERALL].live, 4)}))
    shift = dict((w.status.get("live") or {}).get("trafficShift") or {})
    for cat, n in decision.shift.items():
        shift[cat] = int(shift.get(cat, 0)) + n
    out.add(SetStatus({"live": {"acceptance": live,
                                "draftedTokens": {cat: j.drafted for cat, j in last.items() if cat != drift_mod.OVERALL},
                                "trafficShift": shift}}))
    messages = [j.message() for j in decision.breaches]
    slow = outcome.serving.breaches
    for judged in slow:
        out.add(PostEvent("Warning", serving_breach_reason(judged), judged.message()))
    if messages:
        out.add(Condition(c.DRIFTED, True, "AcceptanceBelowBaseline", "; ".join(messages)))
    elif slow:
        out.add(Condition(c.DRIFTED, True, serving_breach_reason(slow[0]), "; ".join(j.message() for j in slow)))
    elif any(j.verdict == drift_mod.FINE for j in decision.judged) and not off:
        out.add(Condition(c.DRIFTED, False, "WithinBaseline", "live acceptance within the gated baseline"
                          + (f"; traffic shift, not judged: {', '.join(sorted(shift))}" if shift else "")))
    addresses = tuple(address(w, pod) for pod in pods)
    if decision.action == drift_mod.SPECULATION_OFF:
        reason = "sustained drift: " + decision.reason
        # The mark first (see TAG_SPECULATION_OFF), then the pods. With MLflow down the status
        # alone carries the step (a crash before it is written loses it; the pods turn back on).
        if not w.registry_down:
            out.add(TagVersion(champion, {TAG_SPECULATION_OFF: reason[:4000]}))
        _switch(out, champion, addresses, False, reason)
        out.add(SetStatus({"speculationEnabled": False}),
                Condition(c.DRIFTED, True, "SpeculationOff", reason),
                Record("SpeculationOff", reason, champion, champion, warning=True),
                Report("ready", "Degraded", "SpeculationOff", f"v{champion} serving target-only: {reason}"))
        return True
    if decision.action == drift_mod.ROLLBACK:
        # Acceptance rolls back after SpeculationOff; serving health (errors) may go there directly.
        _rollback(out, champion, ("drift persisted after speculation off: " if off else "sustained drift: ")
                  + decision.reason)
        return True
    if decision.action == drift_mod.SPECULATION_ON:
        out.add(TagVersion(champion, {TAG_SPECULATION_OFF: ""}))
        _switch(out, champion, addresses, True, decision.reason)
        out.add(SetStatus({"speculationEnabled": True}),
                Condition(c.DRIFTED, False, "Recovered", decision.reason),
                Record("SpeculationOn", decision.reason, champion, champion))
        return False
    if decision.reason:
        out.add(Condition(c.DRIFTED, True, "RollbackWouldNotHelp", decision.reason))
    if off:
        # Speculation stays off but keeps being measured: probes turn it on for a while when the
        # engine drafted nothing since.
        if w.status.get("speculationEnabled", True) != decision.speculation:
            _switch(out, champion, addresses, decision.speculation,
                    "drift probe" if decision.speculation else "drift probe over")
        out.add(SetStatus({"speculationEnabled": decision.speculation}))
        return degraded(" (probing with the draft)" if probing else "")
    return False


# -- shadow scoring (shadow_run.py) -------------------------------------------------------------

def _shadow(out: _Steps, champion: str, pods: list[EnginePod]) -> Report:
    """Judge the candidate scored in shadow on the champion's verified pods (their GetStats) in
    the champion's gated categories; a verdict is tagged on the candidate (the mark: the next
    pass promotes it, or renders the champion without it) and recorded. Returns the report."""
    w = out.world
    run = w.shadow
    gated = gate_verdict.baseline_from_verdict(dict(w.verdict))
    judged = shadow_run.judge(run, release_mod.content_hash(shadow_release(w)), [p.stats for p in pods], gated, w.now)
    # A verdict's mark goes in a pass that records nothing else: killed right after the mark, a
    # pass loses what it recorded, and the passes after act on the mark (the rollout that carried
    # the shadow would never be recorded).
    if judged.result == shadow_run.UNDECIDED or any(isinstance(s, Record) for s in out.steps):
        msg = (f"v{run.version} scored in shadow on {judged.pods} pod(s) of v{champion} for {judged.elapsed:.0f} s: "
               f"{judged.reason}")
        out.add(Condition(shadow_run.SHADOW_SCORED, "Unknown", "Scoring", msg),
                SetStatus({"shadow": {"version": run.version, "champion": champion, "result": judged.result,
                                      "reason": judged.reason, "startedAt": run.started_at,
                                      "share": run.settings.share, **shadow_run.numbers(judged)}}))
        return Report("reconciling", "Shadowing", "ShadowScoring", msg,
                      ready_message=f"v{champion} serving; v{run.version} scored in shadow")
    return _shadow_verdict(out, champion, judged.result, judged.reason, shadow_run.numbers(judged))


def _shadow_verdict(out: _Steps, champion: str, result: str, reason: str, numbers: Mapping[str, Any]) -> Report:
    """Tag the verdict on the candidate (first: what the next pass acts on), then say so."""
    w = out.world
    run = w.shadow
    verdict = {"result": result, "reason": reason, "at": w.now, "startedAt": run.started_at,
               "share": run.settings.share, **numbers}
    out.add(TagVersion(run.version, {shadow_run.TAG_SHADOW_VERDICT: shadow_run.verdict_tag(verdict)}),
            *shadow_verdict_steps(out.was, verdict, champion, run.version))
    message = shadow_run.describe(run.version, verdict)
    if result == shadow_run.PROMOTE:
        return Report("reconciling", "Promoting", "ShadowPromoted", message,
                      ready_message=f"v{run.version} promoted by shadow scoring; rolling out")
    return Report("stalled", "Degraded", "ShadowRejected", f"{message}; v{champion} keeps serving",
                  ready_reason="ChampionKeepsServing")


# -- canary (canary.py) -------------------------------------------------------------------------

def canary_served(w: ServingWorld) -> dict[str, Any]:
    """The release file of the candidate a canary runs for (w.canary_run), tuned as it would serve."""
    run = w.canary_run
    tuned = gate_tuned(json.loads(run.tags[TAG_RELEASE]), run.verdict, w.rollout)
    return release_mod.with_mlflow(tuned, w.installation.tracking_uri, w.model, run.version)


def canary_deployment(w: ServingWorld, served: dict[str, Any], replicas: int, step: int) -> dict[str, Any]:
    """The candidate's engine Deployment beside the champion's (canary.canary_deployment)."""
    run, i = w.canary_run, w.installation
    dep = manifests.engine_deployment(w.pair, w.namespace, served, run.tags[TAG_HASH], run.version, dict(w.rollout),
                                      i.tracking_uri, i.credentials if release_mod.reads_from_mlflow(served) else None,
                                      i.pods)
    dep = canary_mod.canary_deployment(dep, manifests.engine_canary_name(w.pair), replicas, step)
    dep["metadata"]["annotations"][ANN_TEMPLATE] = template_fingerprint(dep)
    return dep


def _canary(out: _Steps, champion: str, verified: list[EnginePod]) -> Report:
    """Run the canary's step: its Deployment at the step's replicas, its pods' identity, then the
    candidate judged against the champion's verified pods (canary.judge, canary.decide). Abort
    tags the candidate first (the mark: the release pass never promotes it, and scales nothing
    up again), then scales the canary down; Promote tags it (the next release pass promotes);
    Advance scales the canary for the next step (the step is its annotation). Returns the report."""
    w = out.world
    run = w.canary_run
    version, steps = run.version, run.steps
    had = w.status.get("canary") or {}
    step = canary_mod.live_step(w.canary_deployment, version)
    if str(had.get("version")) == str(version) and had.get("phase") == "Progressing":
        step = max(step, int(had.get("step", 1)) - 1)
    step = min(max(step, 0), len(steps) - 1)
    champion_replicas = int(w.rollout.get("replicas", 1))
    replicas = steps[step].candidate_replicas(champion_replicas)
    served = canary_served(w)
    dep = canary_deployment(w, served, replicas, step)
    result = outcome(w, dep, w.canary_deployment)
    if result == owned.CONFLICT:
        return name_conflict(w, "Deployment", dep["metadata"]["name"])
    if result != owned.UNCHANGED:
        # A canary scaled down (ScaleDown) carries a fingerprint no render has: patched again.
        out.add(EnsureOwned(dep, w.canary_deployment))
    if step > 0 and not out.was("CanaryAdvanced", f"{version}#{step + 1}", version):
        # The pass that scaled the canary for this step died before its status said so.
        out.add(Record("CanaryAdvanced", f"v{version}: step {step + 1} of {len(steps)}: {replicas} pod(s) beside "
                       f"{champion_replicas}", champion, version, key=f"{version}#{step + 1}"))
    memory = w.canary_memory if isinstance(w.canary_memory, canary_mod.Memory) else canary_mod.Memory()
    memory = memory.for_step(version, step)

    def entry(phase: str, message: str, judged: tuple = ()) -> SetStatus:
        started = datetime.datetime.fromtimestamp(memory.since, datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ") if memory.since is not None else ""
        return SetStatus({"canary": canary_mod.status_entry(version, champion, phase, step, steps, replicas,
                                                            champion_replicas, message, judged, started, had)})

    def progressing(message: str, judged: tuple = ()) -> Report:
        out.add(Condition(canary_mod.CONDITION, "Unknown", "Progressing", message), entry("Progressing", message, judged))
        return Report("reconciling", "Canary", "CanaryProgressing", message,
                      ready_message=f"v{champion} serving; v{version} in canary beside it")

    def abort(reason: str, judged: tuple = ()) -> Report:
        msg = f"canary of v{version} aborted: {reason}"
        aborted = entry("Aborted", msg, judged)
        out.add(TagVersion(version, canary_mod.mark_tag(canary_mod.ABORTED, reason, aborted.fields["canary"])),
                canary_mod.ScaleDown(dep["metadata"]["name"]), canary_mod.RememberCanary(canary_mod.Memory()),
                Condition(canary_mod.CONDITION, False, "Aborted", msg), aborted)
        if not out.was("CanaryAborted", version, version):
            out.add(Record("CanaryAborted", msg, champion, version, warning=True, key=version))
        return Report("stalled", "Degraded", "CanaryAborted", f"{msg}; v{champion} keeps serving",
                      ready_reason="ChampionKeepsServing")

    where = f"v{version} canary step {step + 1} of {len(steps)} ({replicas} pod(s) beside {champion_replicas})"
    state, msg = manifests.deployment_rollout_state(deployment_after(dep, w.canary_deployment, result), run.tags[TAG_HASH])
    if state == "failed":
        return abort(f"its pods did not become available: {msg}")
    if state != "available":
        return progressing(f"{where}: {msg}")
    ok, why, pods = identity(replace(w, ready=w.canary_ready, tags=run.tags), version, release_mod.content_hash(served))
    if why.startswith("tokenizer"):
        return abort(why)
    if not ok:
        return progressing(f"{where}: {why}")
    unread = next((p for p in [*verified, *pods] if p.stats is None), None)
    if unread is not None:
        return progressing(f"{where}: counters of pod {unread.name} not read: {unread.stats_unreachable or 'not asked'}")
    wall = w.drift.wall

    def reports(side: list[EnginePod]) -> list[canary_mod.PodReport]:
        return [canary_mod.PodReport.from_stats(f"{p.name}/{p.uid}", p.stats or {}, wall) for p in side]
    memory = canary_mod.observe(memory, wall, reports(verified), reports(pods))
    out.add(canary_mod.RememberCanary(memory))
    policy = canary_mod.Policy.from_spec(w.spec)
    judged = canary_mod.judge(policy, memory)
    decision = canary_mod.decide(policy, steps, step, judged, wall - (memory.since or wall),
                                 float(w.rollout.get("progressDeadlineSeconds", 600)))
    if decision.action == canary_mod.ABORT:
        return abort(decision.reason, judged)
    if decision.action == canary_mod.PROMOTE:
        msg = f"canary of v{version} passed: {decision.reason}"
        passed = entry("Passed", msg, judged)
        out.add(TagVersion(version, canary_mod.mark_tag(canary_mod.PASSED, decision.reason, passed.fields["canary"])),
                Condition(canary_mod.CONDITION, True, "Passed", msg), passed)
        if not out.was("CanaryPassed", version, version):
            out.add(Record("CanaryPassed", msg, champion, version, key=version))
        return Report("reconciling", "Promoting", "CanaryPassed", msg,
                      ready_message=f"v{version} passed its canary; promoting")
    if decision.action == canary_mod.ADVANCE:
        step += 1
        replicas = steps[step].candidate_replicas(champion_replicas)
        nxt = canary_deployment(w, served, replicas, step)
        out.add(EnsureOwned(nxt, w.canary_deployment))
        memory = canary_mod.Memory()
        text = (f"v{version}: {decision.reason}; step {step + 1} of {len(steps)}: {replicas} pod(s) beside "
                f"{champion_replicas} ({canary_mod.traffic_share(replicas, champion_replicas):.0%} of the traffic)")
        if not out.was("CanaryAdvanced", f"{version}#{step + 1}", version):
            out.add(Record("CanaryAdvanced", text, champion, version, key=f"{version}#{step + 1}"))
        return progressing(text, judged)
    return progressing(f"{where}: {decision.reason}", judged)


def _retire_canary(out: _Steps, champion: str) -> None:
    """No canary runs: a canary Deployment with pods is scaled down, once the champion's own
    Deployment serves (the candidate promoted: its canary pods served until then), or at once
    (a candidate aborted, or no longer the spec's)."""
    w = out.world
    live = w.canary_deployment
    if live is None or not owned.owns(w.uid, dict(live)):
        return
    version = str(((live.get("metadata") or {}).get("labels") or {}).get(manifests.LABEL_VERSION, ""))
    name = live["metadata"]["name"]
    why = (f"v{champion} serves from its engine Deployment now" if version == str(champion)
           else f"v{version} is no longer a candidate")
    had = w.status.get("canary") or {}
    promoted = str(had.get("version")) == version == str(champion) and had.get("phase") == "Passed"
    scaled = bool((live.get("spec") or {}).get("replicas"))
    if scaled:
        out.add(canary_mod.ScaleDown(name))
    said = f"Deployment {name} scaled to 0: {why}"
    if promoted:
        # Scaled down now, or by a pass that died before its status said the promoted canary is over.
        # Read from the status, so recorded: a pass on a body that does not show this status yet is
        # held back (handlers.reconcile compares the records) and does not say it again.
        if not out.was("CanaryScaledDown", version, version):
            out.add(Record("CanaryScaledDown", said, champion, version, key=version))
    elif scaled:
        out.add(PostEvent("Normal", "CanaryScaledDown", said))
    if promoted:
        out.add(SetStatus({"canary": {**had, "phase": "Promoted", "message": f"v{version} promoted; {why}"}}))
