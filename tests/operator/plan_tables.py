"""What the operator's plan tables build their worlds from (test_operator_plan,
test_operator_serving_plan, test_operator_shadow_plan, test_canary_plan): the pair's names, a
release's tags, a passed candidate's world, objects as the API server holds them after the
operator wrote them, what a pod reports of itself, each planned step by a short name, and the
passes of the operator over a candidate beside its champion, killed at any write.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Callable, Iterable, Mapping

from specpair_operator.policy import canary
from specpair_operator.gate import verdict as gate_verdict
from specpair_operator.desired import manifests
from specpair_operator.act import owned
from specpair_operator.release import content as release
from specpair_operator.plan import release_steps as rs
from specpair_operator.plan import release_plan as p
from specpair_operator.plan import serving_plan as sp
from specpair_operator.release.registry_contract import TAG_HASH, TAG_RELEASE, TAG_TOKENIZER_DRAFT, TAG_TOKENIZER_TARGET
from specpair_operator.observe.serving_world import EngineTLS, ServingWorld
from specpair_operator.observe.world import GateJob, Records, ReleaseWorld

PAIR, NS, UID, MODEL = "chat", "team", "uid-chat", "team-chat"
NOW = "2026-11-25T12:00:00Z"
# Thresholds every gate verdict of these tables passes.
TH = {"requireGreedyIdentity": True, "minAcceptance": 0.0, "minCategoryAcceptance": {}, "minSpeedup": 0.0}
TLS = EngineTLS("chat-engine-tls", "ca1", ("chat-engine.team.svc",), "ca1/names")
CURRENT_TLS = {"secret": TLS.secret, "caFingerprint": "ca1", "names": list(TLS.names), "notAfter": "2027-11-25T12:00:00Z"}


def release_tags(spec: Mapping[str, Any],
                 golden: Iterable[Mapping[str, Any]] = ({"prompt": "x", "category": "code"},)) -> dict[str, str]:
    """The tags a version of the pair's `spec` carries in MLflow once registered."""
    rel = release.build_release(PAIR, NS, dict(spec), [dict(g) for g in golden])
    return {TAG_RELEASE: json.dumps(rel, sort_keys=True), TAG_HASH: release.content_hash(rel),
            TAG_TOKENIZER_TARGET: "t", TAG_TOKENIZER_DRAFT: "d"}


def reported(verdict: Mapping[str, Any], version: str) -> str:
    """What a gate Job of `version` reports when it wrote `verdict`."""
    return json.dumps({"version": version, "verdictSha256": gate_verdict.verdict_digest(dict(verdict))})


def candidate_world(*, tags: Mapping[str, str], champion_tags: Mapping[str, str], verdict: Mapping[str, Any],
                    rollout: Mapping[str, Any], **changes: Any) -> ReleaseWorld:
    """v2 (`tags`) passed its gate (its Job reported `verdict`); v1 (`champion_tags`) is champion."""
    w = ReleaseWorld(pair=PAIR, namespace=NS, version="2", digest=tags[TAG_HASH], thresholds=TH,
                     aliases={"champion": "1"}, tags=dict(tags), gate_status="passed", verdict=verdict,
                     gate_jobs=(GateJob(manifests.gate_job_name(PAIR, tags[TAG_HASH]), complete=True,
                                        reports=(reported(verdict, "2"),)),),
                     records=Records({"GateStarted": ("2",), "GatePassed": ("2",)}), now=NOW, rollout=rollout,
                     champion_release=json.loads(champion_tags[TAG_RELEASE]))
    return dataclasses.replace(w, **changes)


def mine(obj: Mapping[str, Any], mutable: bool = True) -> dict[str, Any]:
    """`obj` as the API server holds it after ensure_owned wrote it for this pair."""
    obj = copy.deepcopy(dict(obj))
    if mutable:
        owned.stamp(obj)
    obj["metadata"]["ownerReferences"] = [{"uid": UID, "controller": True, "kind": "SpecModelPair", "name": PAIR}]
    return obj


def available(dep: Mapping[str, Any], generation: int = 1) -> dict[str, Any]:
    """An engine Deployment this pair wrote, rolled out by the Deployment controller: all replicas available."""
    dep = mine(dep)
    n = dep["spec"]["replicas"]
    dep["metadata"]["generation"] = generation
    dep["status"] = {"observedGeneration": generation, "replicas": n, "updatedReplicas": n, "availableReplicas": n}
    return dep


def pod_info(served: Mapping[str, Any], speculating: bool = True, **changes: Any) -> dict[str, Any]:
    """What an engine pod serving release `served` says of itself (GetInfo as the probe reads it)."""
    return {"pair": PAIR, "releaseVersion": served["mlflow"]["version"], "contentHash": release.content_hash(served),
            "tokenizer": {"target": "t", "draft": "d"}, "speculationEnabled": speculating, **changes}


def step_name(s: Any) -> str:
    """A planned step by its class and what tells it apart: a Record by its action, a Report by
    its reason, a write by what it touches."""
    if isinstance(s, rs.Record):
        return f"Record {s.action}"
    if isinstance(s, rs.Report):
        return f"Report {s.how} {s.phase}/{s.reason}"
    if isinstance(s, sp.RollSpeculation):
        return f"RollSpeculation {'on' if s.enabled else 'off'}"
    if isinstance(s, rs.PostEvent):
        return f"Event {s.reason}"
    if isinstance(s, rs.SetAlias):
        return f"SetAlias {s.alias}={s.version}"
    if isinstance(s, rs.TagVersion):
        return f"TagVersion v{s.version} " + ",".join(k if v else f"{k}=cleared" for k, v in sorted(s.tags.items()))
    if isinstance(s, rs.Condition):
        return f"Condition {s.type}={s.status} {s.reason}"
    if isinstance(s, rs.StartGateJob):
        return f"StartGateJob {s.attempt}"
    if isinstance(s, rs.ServeChampion):
        return (f"ServeChampion {s.desired or '-'}" + (" while gating" if s.while_gating else "")
                + (f" shadow v{s.shadow.version}" if s.shadow else "")
                + (f" canary v{s.canary.version}" if s.canary else ""))
    if isinstance(s, sp.EnsureOwned):
        return f"EnsureOwned {s.manifest['kind']}"
    if isinstance(s, canary.ScaleDown):
        return f"ScaleDown {s.name}"
    if isinstance(s, sp.SwitchSpeculation):
        return f"SwitchSpeculation {'on' if s.enabled else 'off'}"
    if isinstance(s, sp.ReportSpeculation):
        return "ReportSpeculation " + (f"stuck {len(s.stuck)}" if s.stuck else
                                       (s.otherwise.reason if s.otherwise else "-"))
    if isinstance(s, rs.SetStatus):
        return "SetStatus " + ",".join(sorted(s.fields))
    return type(s).__name__


def kinds(steps: Iterable[Any]) -> list[str]:
    return [step_name(s) for s in steps]


class CandidateCluster:
    """What the operator's passes read and write for a pair whose v2 passed its gate beside
    champion v1: MLflow (aliases, tags), the status, the owned objects. `one_pass` plans the
    release, then the serving its ServeChampion asks for, and applies each step; a subclass
    models the engine (`write`, `serving_world`). A pass killed at a write keeps its writes and
    loses its status, and `forget` drops what the operator kept in memory."""

    WRITES = (*rs.WRITES, *sp.WRITES, canary.ScaleDown)
    candidate_world: Callable[..., ReleaseWorld]    # the table's, with its defaults

    def __init__(self, champion_tags: Mapping[str, str], candidate_tags: Mapping[str, str]):
        self.aliases = {"champion": "1", "candidate": "2"}
        self.tags = {"1": dict(champion_tags), "2": dict(candidate_tags)}
        self.status: dict[str, Any] = {"engineTLS": CURRENT_TLS, "recorded": {"GateStarted": ["2"], "GatePassed": ["2"]}}
        self.objects: dict[str, Any] = {}
        self.generation = 0
        self.history: list[tuple[str, str | None]] = []
        self.events: list[str] = []
        self.writes = 0
        self.last_serving: tuple[Any, ...] = ()

    def records(self) -> Records:
        return Records({k: tuple(v) for k, v in self.status["recorded"].items()})

    def release_world(self) -> ReleaseWorld:
        champion = self.aliases["champion"]
        return self.candidate_world(tags=self.tags["2"], aliases=dict(self.aliases), records=self.records(),
                                    champion_release=None if champion == "2" else json.loads(
                                        self.tags[champion][TAG_RELEASE]))

    def serving_world(self, step: rs.ServeChampion) -> ServingWorld:
        raise NotImplementedError

    def champion_world(self, step: rs.ServeChampion, spec: Mapping[str, Any], verdict: Mapping[str, Any],
                       **engine: Any) -> ServingWorld:
        """The serving world `step` asks for, as this cluster holds it; `engine`: the table's own
        fields (its Deployments, pods, shadow or canary)."""
        return ServingWorld(pair=PAIR, namespace=NS, uid=UID, model=MODEL, aliases=dict(step.aliases),
                            desired=step.desired, desired_reason=step.reason, spec=spec,
                            status=copy.deepcopy(self.status), records=self.records(), now=NOW,
                            tags=self.tags[step.aliases["champion"]], verdict=verdict, tls=TLS,
                            service=self.objects.get("Service"), policy=self.objects.get("NetworkPolicy"), **engine)

    def plan_release(self, world: ReleaseWorld) -> tuple[Any, ...]:
        """The release plan a pass runs (a subclass adds what its reconciler adds)."""
        return p.plan_release(world)

    def write(self, step: Any) -> None:
        """MLflow's writes here; the engine's objects in `write_object`."""
        if isinstance(step, rs.SetAlias):
            self.aliases[step.alias] = step.version
        elif isinstance(step, rs.TagVersion):
            self.tags[step.version].update(step.tags)
        else:
            self.write_object(step)

    def write_object(self, step: Any) -> None:
        raise NotImplementedError

    def remember(self, step: Any) -> None:
        """A step that is neither a write nor the status (what the operator keeps in memory)."""

    def forget(self) -> None:
        """The operator died: what it kept in memory is gone."""

    def one_pass(self, crash_at: int | None) -> bool:
        """One pass; False when it planned nothing to write or record. Killed at write
        `crash_at` (counted over the whole run)."""
        status = copy.deepcopy(self.status)
        said: list[tuple[str, str | None]] = []
        events: list[str] = []
        busy = False

        def run_steps(steps: tuple[Any, ...]) -> bool:
            nonlocal busy
            for step in steps:
                if isinstance(step, self.WRITES):
                    self.write(step)
                    busy = True
                    self.writes += 1
                    if crash_at is not None and self.writes == crash_at + 1:
                        return False
                elif isinstance(step, rs.Record):
                    busy = True
                    said.append((step.action, step.key))
                    if step.key is not None:
                        status["recorded"][step.action] = status["recorded"].get(step.action, []) + [step.key]
                elif isinstance(step, rs.PostEvent):
                    events.append(step.reason)
                elif isinstance(step, rs.SetStatus):
                    status.update(copy.deepcopy(dict(step.fields)))
                elif isinstance(step, rs.ServeChampion):
                    self.last_serving = sp.plan_serving(self.serving_world(step))
                    if not run_steps(self.last_serving):
                        return False
                else:
                    self.remember(step)
            return True
        if not run_steps(self.plan_release(self.release_world())):
            self.forget()
            return True
        self.status = status
        self.history += said
        self.events += events
        return busy
