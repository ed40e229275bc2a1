"""What one pass observed about the champion's serving, as values: the input of plan/serving_plan.py
(nothing changes them; serving_plan.py reads, the table tests build new ones).

reads.observe_serving reads it all before anything is decided: the champion's tags and
verdict from MLflow; the engine's Deployment, Service, NetworkPolicy, TLS Secret mark and pods
from the API server; what each ready pod reports (identity, tokenizer, speculation, counters);
and the operator's memory of the pair (drift samples, when drift was last checked). So every
serving decision (roll out, scale, retire the legacy engine, reissue the certificate, roll back
on a tokenizer mismatch, the drift ladder, set speculation per pod) is a function of these
values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from specpair_operator.policy import drift as drift_mod
from specpair_operator.desired import manifests
from specpair_operator.policy import serving_health
from specpair_operator.policy.shadow_run import ShadowRun
from specpair_operator.observe.world import Records


@dataclass(frozen=True)
class EnginePod:
    """A ready engine pod and what it reported over its control listener."""
    name: str
    uid: str
    ip: str
    info: Mapping[str, Any] | None = None     # ModelInfo (identity, tokenizer, speculationEnabled); None: not asked
    unreachable: str = ""                      # why ModelInfo failed
    stats: Mapping[str, Any] | None = None    # GetStats (counters per category, uptime); None: not asked
    stats_unreachable: str = ""                # why GetStats failed


@dataclass(frozen=True)
class EngineTLS:
    """The engine's control-listener certificate as status.engineTLS and the Secret's marks say."""
    secret: str                    # the Secret's name
    ca_fingerprint: str            # of the CA certificates are issued from now
    names: tuple[str, ...]         # the DNS names the certificate must carry
    issued_for: str                # the Secret's specpair.io/issued-for mark for this CA and these names
    held: bool | None = None       # the pair's Secret carries that mark (asked when status.engineTLS disagrees)
    missing: bool = False          # the Secret is gone (asked every CA_REFRESH_S)
    seen_at: float | None = None   # when (monotonic) this pass found the Secret there, if it asked
    ca_missing: bool = False       # the operator's CA Secret is absent: none to issue from yet


@dataclass(frozen=True)
class Installation:
    """The installation's settings the engine's objects are rendered with."""
    tracking_uri: str = "http://mlflow:5000"
    credentials: manifests.MlflowCredentials | None = None   # the pair's, else the installation's
    pods: manifests.PodDefaults = field(default_factory=manifests.PodDefaults)
    prometheus: str | None = None     # where KEDA asks for a signal (the chart's autoscaling.prometheusAddress)
    # The Gateway of pairs that name none (the chart's gateway.parentRef; desired/routes.py).
    gateway: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class DriftMemory:
    """The operator's in-process memory of the pair's drift (lost on restart, which costs only the
    evidence gathered so far), and the clocks of this pass."""
    version: str = ""                        # the champion the samples belong to
    memory: drift_mod.Memory = field(default_factory=drift_mod.Memory)
    serving: serving_health.ServingMemory = field(default_factory=serving_health.ServingMemory)
    checked_at: float = 0.0                  # monotonic time of the last check
    monotonic: float = 1e9                   # now, monotonic
    wall: float = 0.0                        # now, time.time()
    # The release a rollback would go to, read only when the ladder's next step is a rollback:
    previous_verdict: Mapping[str, Any] | None = None
    previous_tags: Mapping[str, str] | None = None


@dataclass(frozen=True)
class ServingWorld:
    """The champion and its engine as one pass found them."""
    pair: str
    namespace: str
    uid: str
    model: str
    aliases: Mapping[str, str] = field(default_factory=dict)
    desired: str | None = None       # the spec's release when it is servable; None: the champion carries on
    desired_reason: str = ""         # why the spec's release is not servable
    while_gating: bool = False       # a gate runs meanwhile: the champion reports only an action of its own
    registry_down: bool = False      # MLflow is down: the champion's facts are the last ones MLflow gave
    spec: Mapping[str, Any] = field(default_factory=dict)
    status: Mapping[str, Any] = field(default_factory=dict)   # the pair's status as the pass read it
    records: Records = field(default_factory=Records)
    installation: Installation = field(default_factory=Installation)
    now: str = "1970-01-01T00:00:00Z"
    # From MLflow: the champion's tags and its gate's verdict (usable_verdict: {} when unusable).
    tags: Mapping[str, str] = field(default_factory=dict)
    verdict: Mapping[str, Any] = field(default_factory=dict)
    served_hash: str = ""            # watch-only mode: the hash of what the champion's pods were given
    # From the API server (None: absent).
    deployment: Mapping[str, Any] | None = None
    service: Mapping[str, Any] | None = None
    policy: Mapping[str, Any] | None = None
    legacy_deployment: Mapping[str, Any] | None = None
    autoscaler: Mapping[str, Any] | None = None
    keda: bool = False                # the API server serves KEDA's ScaledObject (autoscaling.keda_installed)
    tls: EngineTLS | None = None
    pods: tuple[Mapping[str, Any], ...] = ()   # every engine pod of the pair
    ready: tuple[EnginePod, ...] = ()           # the ready ones, in order, with what they reported
    drift: DriftMemory = field(default_factory=DriftMemory)
    # The model cache (model_fetch.py), for the champion's served release: its models digest, the
    # digests status.modelCache records as fetched, and where its fetch Job stands (a
    # model_fetch.FetchState; None when it needs no fetch).
    models: str = ""
    fetched: tuple[str, ...] = ()
    model_fetch: Any = None
    # A gated candidate scored in shadow on the champion's pods (shadow_run.py); None: none.
    shadow: ShadowRun | None = None
    # A canary (canary.py): the candidate it runs for (a canary.CanaryRun; None: none), its
    # Deployment, its pods (apart from `pods`: they carry the track label), the ready ones with
    # what they reported (asked only while a canary runs), and the operator's evidence of the step.
    canary_run: Any = None
    canary_deployment: Mapping[str, Any] | None = None
    canary_pods: tuple[Mapping[str, Any], ...] = ()
    canary_ready: tuple[EnginePod, ...] = ()
    canary_memory: Any = None
    # The pair's Gateway API objects (desired/routes.py), read only when it names a Gateway:
    # whether the API server serves HTTPRoute and GRPCRoute, and each object routes.observed_keys
    # names ("Kind/name" -> the object as read, None: absent).
    gateway_api: bool = False
    routes: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    # The pair's training Jobs (desired/training_job.py; spec.learning), read only when learning
    # is enabled: "version/category" -> a training_job.TrainingState. None: not read this pass
    # (then the plan starts none, so a Job that exists is never created twice).
    trainings: Mapping[str, Any] | None = None
    # What was rendered for the pair (plan/serving_steps.rendered_engine: the engine Deployment,
    # asked for by observe's rollout question and by the plan, pass after pass). Each entry keeps
    # copies of the values it was rendered from and is used only while the world holds equal
    # ones. The worlds `replace` makes from this one share it; the operator keeps it per pair
    # across passes (OperatorState.renders).
    rendered: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rollout(self) -> Mapping[str, Any]:
        return self.spec.get("rollout") or {}


def ready_pods(pods: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Running, with an IP, not terminating, and Ready."""
    def ready(p: Mapping[str, Any]) -> bool:
        st = p.get("status") or {}
        return st.get("phase") == "Running" and bool(st.get("podIP")) and not p["metadata"].get("deletionTimestamp") \
            and any(cd.get("type") == "Ready" and cd.get("status") == "True" for cd in st.get("conditions") or [])
    return [p for p in pods if ready(p)]
