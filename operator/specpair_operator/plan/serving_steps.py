"""The serving plan's steps (what act writes or records) and the pure reads of a ServingWorld that
every concern of the plan shares. The plan itself is serving_plan.py."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from specpair_operator.release import aliases as aliases_mod
from specpair_operator.policy import drift as drift_mod
from specpair_operator.desired import engine_objects, learning, manifests
from specpair_operator.desired.autoscaling import AutoscalerPlan
from specpair_operator.desired import ownership as owned
from specpair_operator.policy import draft_swap, rollout_strategy, serving_health
from specpair_operator.release import content as release_mod
from specpair_operator.plan.release_steps import PostEvent, Record, Report, SetAlias, SetStatus, TagVersion
from specpair_operator.release.registry_contract import TAG_RELEASE
from specpair_operator.release.registry_contract import TAG_HASH, TAG_TOKENIZER_DRAFT, TAG_TOKENIZER_TARGET
from specpair_operator.observe.serving_world import EnginePod, ServingWorld

if TYPE_CHECKING:
    from specpair_operator.plan.steps import Step   # the union of every plan's steps


# On the engine Deployment: a fingerprint of its spec without the replica count, to tell a
# rollout (a new pod template) from scaling.
ANN_TEMPLATE = "specpair.io/template-hash"
ANN_ISSUED_FOR = "specpair.io/issued-for"  # on the engine's TLS Secret: CA fingerprint / hash of the names


@dataclass(frozen=True)
class EnsureOwned:
    """Create or patch one of the engine's objects (owned.ensure_owned), planned only when it is
    absent or differs from what the operator renders; a name taken since the pass looked stops
    the pass with NameConflict."""
    manifest: Mapping[str, Any]
    live: Mapping[str, Any] | None
    mutable: bool = True


@dataclass(frozen=True)
class DeleteOwned:
    """Delete one of the pair's objects no longer wanted (owned.delete_owned: only while the pair
    owns it, and only the object read), planned only for one the pass found and the pair owns."""
    live: Mapping[str, Any]


@dataclass(frozen=True)
class EnsureAutoscaler:
    """The pair's autoscaler as `rollout.autoscaling` says, planned (autoscaling.plan_autoscaler:
    the object to write, the other kind to delete, or why none can be); act/autoscaler.py writes
    it and says so in the Autoscaled condition and Events."""
    plan: AutoscalerPlan


@dataclass(frozen=True)
class IssueCertificate:
    """Issue the engine's control-listener certificate into its Secret (why: `reason`); its
    status.engineTLS and a CertificateIssued Event go with it."""
    reason: str
    issued_for: str


@dataclass(frozen=True)
class CreateControlCA:
    """Create the operator's CA Secret, which observe found absent (a new installation, or the
    Secret deleted): engine certificates are issued from it (act/control_ca.py)."""


@dataclass(frozen=True)
class TLSSecretSeen:
    """The pair's engine TLS Secret was there at `at` (monotonic; a dry-run create answered 409):
    observe asks again CA_REFRESH_S later."""
    at: float


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


@dataclass(frozen=True)
class ReportSpeculation:
    """Pods still off the speculation state the pair wants (`stuck`, plus each
    ReconcilePodSpeculation that did not take) are what the pass reports; otherwise `otherwise`."""
    desired: bool
    champion: str
    stuck: tuple[str, ...] = ()
    otherwise: Report | None = None


WRITES = (SetAlias, TagVersion, EnsureOwned, DeleteOwned, CreateControlCA, IssueCertificate, RetireLegacyEngine, SwitchSpeculation,
          ReconcilePodSpeculation)




def speculation_not_reconciled(desired: bool, champion: str, stuck: list[str]) -> Report:
    return Report("reconciling", "Degraded", "SpeculationNotReconciled",
                  f"speculation should be {'on' if desired else 'off'} on every pod of v{champion}; not yet: "
                  + "; ".join(stuck), replacing=True)


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
    """The release with the k and batch threshold its gate found best, and a vLLM gate's k by load
    (kByBatchSize: vLLM's batch-size schedule for k, docs/vllm.md; only that gate writes it),
    unless rollout.applyGateTuning is false."""
    best = verdict.get("bestSpeculation") or {}
    if rollout.get("applyGateTuning", True):
        release["speculation"].update({k: v for k, v in best.items() if k in ("k", "batchSizeThreshold",
                                                                                "kByBatchSize")})
    return release


def shadow_release(w: ServingWorld) -> dict[str, Any]:
    """The release file of the candidate scored in shadow (w.shadow), tuned as it would serve."""
    run = w.shadow
    tuned = gate_tuned(json.loads(json.dumps(dict(run.release))), run.verdict, w.rollout)
    return release_mod.with_mlflow(tuned, w.installation.tracking_uri, w.model, run.version)


def status_speculation(w: ServingWorld, champion: str) -> bool:
    """The speculation state status wants for `champion` (a release the drift ladder has not
    turned off speculates: status.speculationEnabled left false by the previous champion's
    ladder, whose drift state the new champion's first check replaces, is not this release's)."""
    stored = w.status.get("drift") or {}
    if str(stored.get("version", "")) != str(champion):
        return True
    if not speculation_turned_off(w, drift_mod.state_for_release(dict(stored), champion)):
        return True
    return bool(w.status.get("speculationEnabled", True))


def speculation_turned_off(w: ServingWorld, state: drift_mod.DriftState) -> bool:
    """Whether SpeculationOff is among the ladder steps `state` (the champion's) has taken."""
    ladder = drift_mod.DriftPolicy.from_spec(dict(w.spec.get("drift") or {})).ladder
    return drift_mod.SPECULATION_OFF in ladder[:state.steps_taken]


@dataclass(frozen=True)
class RenderedEngine:
    """The engine Deployment rendered for a world and release, with the fingerprint ensure_owned
    stamps on it (owned.stamp: what `outcome` compares with the live object's)."""
    deployment: dict[str, Any]
    manifest: str


def rendered_engine(w: ServingWorld, served: dict[str, Any]) -> RenderedEngine:
    """The engine Deployment for `served`, rendered only when what it is rendered from changed:
    observe's rollout question (serving_rollout.rollout_state) and the plan both ask for it, and
    a settled pair's passes ask for the same one pass after pass; its rendering and two
    fingerprints were ~40% of a settled pass's event loop at 335 pairs. The render is kept in
    w.rendered (the operator keeps it per pair: OperatorState.renders) with copies of the values
    it was made from, and is used only while the world's values are equal to those; each
    caller gets a copy of its own (ensure_owned stamps and adopts the manifest it writes)."""
    champion = w.aliases[aliases_mod.CHAMPION]
    live_template = (((w.deployment or {}).get("spec") or {}).get("template") or {}).get("metadata") or {}
    # Everything _engine_deployment reads from the world, and the release.
    inputs = (w.pair, w.namespace, w.model, champion, w.tags[TAG_HASH], w.spec, status_speculation(w, champion),
              w.installation, w.shadow, manifests.ANN_SHADOW_RELEASE in (live_template.get("annotations") or {}),
              served)
    kept = w.rendered.get("engine")
    if kept is None or kept[0] != inputs:
        dep = _engine_deployment(w, served)
        # Copies: the pass's spec and release may be edited after the pass, the next compares with these.
        kept = (pickle.loads(pickle.dumps(inputs, pickle.HIGHEST_PROTOCOL)), pickle.dumps(dep, pickle.HIGHEST_PROTOCOL),
                owned.manifest_fingerprint(json.loads(json.dumps(dep))))
        w.rendered["engine"] = kept
    return RenderedEngine(pickle.loads(kept[1]), kept[2])


def engine_deployment(w: ServingWorld, served: dict[str, Any]) -> dict[str, Any]:
    return rendered_engine(w, served).deployment


def _engine_deployment(w: ServingWorld, served: dict[str, Any]) -> dict[str, Any]:
    champion = w.aliases[aliases_mod.CHAMPION]
    i = w.installation
    dep = engine_objects.engine_deployment(w.pair, w.namespace, served, w.tags[TAG_HASH], champion, dict(w.rollout),
                                      i.tracking_uri,
                                      # Engine pods need MLflow only to download a model from it.
                                      i.credentials if release_mod.reads_from_mlflow(served) else None,
                                      i.pods, speculation=status_speculation(w, champion),
                                      shadow=None if w.shadow is None else (shadow_release(w), w.shadow.settings.share))
    dep = learning.with_capture(dep, w.pair, w.spec, served)     # spec.learning: the capture volume and flags
    live_template = (((w.deployment or {}).get("spec") or {}).get("template") or {}).get("metadata") or {}
    if w.shadow is None and manifests.ANN_SHADOW_RELEASE in (live_template.get("annotations") or {}):
        # A shadow that ended: its candidate's file goes (a merge patch keeps what it does not name).
        dep["spec"]["template"]["metadata"]["annotations"][manifests.ANN_SHADOW_RELEASE] = None
    dep["metadata"].setdefault("annotations", {})[ANN_TEMPLATE] = template_fingerprint(dep)
    return dep


def template_fingerprint(dep: Mapping[str, Any]) -> str:
    return owned.manifest_fingerprint({**dep["spec"], "replicas": None})


def outcome(w: ServingWorld, desired: Mapping[str, Any], live: Mapping[str, Any] | None, mutable: bool = True,
            manifest: str | None = None) -> str:
    """What ensure_owned will do to `desired` given `live` (owned.CREATED, PATCHED, UNCHANGED,
    CONFLICT). `manifest`: the fingerprint ensure_owned will stamp on `desired`, where the caller
    holds it already (RenderedEngine.manifest)."""
    if live is None:
        return owned.CREATED
    if not owned.owns(w.uid, dict(live)):
        return owned.CONFLICT
    fingerprint = manifest if manifest is not None else owned.stamp(json.loads(json.dumps(desired)))
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


def taken_child(w: ServingWorld) -> tuple[str, str] | None:
    """(kind, name) of the engine Deployment or Service when an object the pair does not own has
    its name (None when neither)."""
    for kind, obj in (("Deployment", w.deployment), ("Service", w.service)):
        if obj is not None and not owned.owns(w.uid, dict(obj)):
            return kind, obj["metadata"]["name"]
    return None


def name_taken(w: ServingWorld) -> str:
    """'KIND NAME' of taken_child ('' when none)."""
    taken = taken_child(w)
    return f"{taken[0]} {taken[1]}" if taken else ""


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
        # A pod started with another release serves this one once its draft was swapped to it
        # (plan/serving_draft_swap.py: only a release that changes nothing but the draft); one
        # started with this release serves another once its draft was swapped away.
        if not draft_swap.serves(info, w.pair, champion, digest):
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
