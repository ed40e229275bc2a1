"""What the operator's plan tables build their worlds from (test_operator_plan,
test_operator_serving_plan, test_operator_shadow_plan, test_canary_plan): the pair's names, a
release's tags, a passed candidate's world, objects as the API server holds them after the
operator wrote them, what a pod reports of itself, and each planned step by a short name.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Iterable, Mapping

from specpair_operator import canary, gate_verdict, manifests, owned, release
from specpair_operator import plan as p
from specpair_operator import serving_plan as sp
from specpair_operator.registry import TAG_HASH, TAG_TOKENIZER_DRAFT, TAG_TOKENIZER_TARGET
from specpair_operator.serving_world import EngineTLS
from specpair_operator.world import GateJob, Records, ReleaseWorld

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
    return {p.TAG_RELEASE: json.dumps(rel, sort_keys=True), TAG_HASH: release.content_hash(rel),
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
                     champion_release=json.loads(champion_tags[p.TAG_RELEASE]))
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
    if isinstance(s, p.Record):
        return f"Record {s.action}"
    if isinstance(s, p.Report):
        return f"Report {s.how} {s.phase}/{s.reason}"
    if isinstance(s, p.PostEvent):
        return f"Event {s.reason}"
    if isinstance(s, p.SetAlias):
        return f"SetAlias {s.alias}={s.version}"
    if isinstance(s, p.TagVersion):
        return f"TagVersion v{s.version} " + ",".join(k if v else f"{k}=cleared" for k, v in sorted(s.tags.items()))
    if isinstance(s, p.Condition):
        return f"Condition {s.type}={s.status} {s.reason}"
    if isinstance(s, p.StartGateJob):
        return f"StartGateJob {s.attempt}"
    if isinstance(s, p.ServeChampion):
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
    if isinstance(s, p.SetStatus):
        return "SetStatus " + ",".join(sorted(s.fields))
    return type(s).__name__


def kinds(steps: Iterable[Any]) -> list[str]:
    return [step_name(s) for s in steps]
