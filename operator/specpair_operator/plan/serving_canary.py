"""The serving plan's canary: a candidate's pods beside the champion's, stepped up or retired; and,
when the pair names a Gateway, its routes (desired/routes.py): each step's weight written once
the step's pods serve, judged, then the next step's; champion only again on abort, and every
engine pod once the canary's pods are gone."""

from __future__ import annotations

import datetime
import json
from dataclasses import replace
from typing import Any

from specpair_operator.policy import canary as canary_mod
from specpair_operator.desired import engine_objects, learning, manifests
from specpair_operator.desired import ownership as owned
from specpair_operator.desired import routes as routes_mod
from specpair_operator.release import content as release_mod
from specpair_operator.plan.release_steps import Condition, PostEvent, Record, Report, SetStatus, TagVersion
from specpair_operator.release.registry_contract import TAG_RELEASE
from specpair_operator.release.registry_contract import TAG_HASH
from specpair_operator.observe.serving_world import EnginePod, ServingWorld
from specpair_operator.plan.serving_steps import (ANN_TEMPLATE, deployment_after, DeleteOwned, EnsureOwned, gate_tuned,
                                                  identity, kind_of, outcome, _Steps, template_fingerprint)
from specpair_operator.plan.serving_rollout import name_conflict


def canary_served(w: ServingWorld) -> dict[str, Any]:
    """The release file of the candidate a canary runs for (w.canary_run), tuned as it would serve."""
    run = w.canary_run
    tuned = gate_tuned(json.loads(run.tags[TAG_RELEASE]), run.verdict, w.rollout)
    return release_mod.with_mlflow(tuned, w.installation.tracking_uri, w.model, run.version)


def canary_deployment(w: ServingWorld, served: dict[str, Any], replicas: int, step: int) -> dict[str, Any]:
    """The candidate's engine Deployment beside the champion's (canary.canary_deployment)."""
    run, i = w.canary_run, w.installation
    dep = engine_objects.engine_deployment(w.pair, w.namespace, served, run.tags[TAG_HASH], run.version, dict(w.rollout),
                                      i.tracking_uri, i.credentials if release_mod.reads_from_mlflow(served) else None,
                                      i.pods)
    dep = learning.with_capture(dep, w.pair, w.spec, served)     # a canary's pods capture as the champion's
    dep = canary_mod.canary_deployment(dep, manifests.engine_canary_name(w.pair), replicas, step)
    dep["metadata"]["annotations"][ANN_TEMPLATE] = template_fingerprint(dep)
    return dep


def routed(w: ServingWorld) -> bool:
    """The pair names a Gateway and the API server serves its routes: the canary's share is a
    route's weight, not the replica ratio."""
    return w.gateway_api and routes_mod.gateway_parent(w.spec, w.installation.gateway) is not None


def candidate_routed(w: ServingWorld) -> bool:
    """A live route of the pair still sends requests to the candidate's Service: its pods are
    not scaled down before a pass has found the routes without it (the gateway stops sending
    first, so no request reaches a pod going away)."""
    candidate = routes_mod.candidate_service_name(w.pair)
    return any(routes_mod.weights(live).get(candidate, 0) > 0 for key, live in w.routes.items()
               if not key.startswith("Service/"))


def _routes(out: _Steps, traffic: routes_mod.Traffic, why: str, keep: tuple[str, ...] = ()) -> None:
    """The pair's routes and route Services for `traffic` (desired/routes.py), each written only
    when absent or different; an Event for each route whose split changes; the Routed condition.
    A False condition when the API server serves no Gateway API routes or a name is taken by an
    object the pair does not own (never touched). Route Services no longer wanted are deleted
    once no live route sends to them; when the pair names no Gateway (nor the chart), every
    route object it owns is (routes.unwanted)."""
    w = out.world
    parent = routes_mod.gateway_parent(w.spec, w.installation.gateway)
    if parent is None:
        _unroute(out)
        return
    gateway = f"Gateway {parent.get('namespace', w.namespace)}/{parent['name']}"
    if not w.gateway_api:
        out.add(Condition(routes_mod.ROUTED, False, "GatewayAPINotServed",
                          f"rollout.gateway names {gateway}, but the API server serves no HTTPRoute and GRPCRoute "
                          f"({routes_mod.GATEWAY_API}): no routes written; a canary's share is the replica ratio"))
        return
    wanted = routes_mod.desired(w.pair, w.namespace, w.rollout, parent, traffic, kind_of(w), keep)
    # A live route switched only to Services old enough to have endpoints (routes.pending); a
    # route made for the first time at once (nothing was routed before it).
    waiting = routes_mod.pending(wanted, w.routes, w.now) if any(
        w.routes.get(routes_mod.key(o)) for o in wanted if o["kind"] != "Service") else []
    for obj in wanted:
        live = w.routes.get(routes_mod.key(obj))
        if waiting and obj["kind"] != "Service":
            continue
        mutable = obj["kind"] != "Service"     # Services are created only (routes.py: one per version)
        result = outcome(w, obj, live, mutable)
        if result == owned.CONFLICT:
            out.add(Condition(routes_mod.ROUTED, False, "NameConflict",
                              f"{obj['kind']} {obj['metadata']['name']} exists and is not the pair's: left untouched, "
                              "no routes written"))
            return
        if result != owned.UNCHANGED:
            out.add(EnsureOwned(obj, live, mutable))
        if obj["kind"] != "Service" and routes_mod.weights(live) != routes_mod.weights(obj):
            out.add(PostEvent("Normal", "TrafficRouted",
                              f"{obj['kind']} {obj['metadata']['name']}: {routes_mod.describe(routes_mod.weights(live))}"
                              f" -> {routes_mod.describe(routes_mod.weights(obj))} ({why})"))
    for live in routes_mod.unwanted(w.pair, wanted, w.routes, gateway_named=True):
        if owned.owns(w.uid, dict(live)):
            out.add(DeleteOwned(live), PostEvent("Normal", "RouteRemoved",
                                                 f"{live['kind']} {live['metadata']['name']}: no route sends to it "
                                                 f"any more ({why})"))
    split = next((routes_mod.weights(o) for o in wanted if o["kind"] != "Service"), {})
    kinds = " and ".join(o["kind"] for o in wanted if o["kind"] != "Service")
    if waiting:
        out.add(Condition(routes_mod.ROUTED, True, "ServicePending",
                          f"{kinds} {routes_mod.route_name(w.pair)} on {gateway} unchanged until Service(s) "
                          f"{', '.join(waiting)} are {routes_mod.SERVICE_SETTLE_SECONDS:g} s old (their endpoints); "
                          f"then {routes_mod.describe(split)} ({why})"))
        return
    out.add(Condition(routes_mod.ROUTED, True, "Routed",
                      f"{kinds} {routes_mod.route_name(w.pair)} on {gateway}: {routes_mod.describe(split)} ({why})"))


def _unroute(out: _Steps) -> None:
    """The pair names no Gateway (nor the chart): the routes and route Services it owns, found
    because its status said it was routed, are deleted, and the Routed condition says so (its
    False reason NoGateway: later passes read nothing of Gateway API)."""
    w = out.world
    gone = [live for live in routes_mod.unwanted(w.pair, (), w.routes, gateway_named=False)
            if owned.owns(w.uid, dict(live))]
    for live in gone:
        out.add(DeleteOwned(live), PostEvent("Normal", "RouteRemoved",
                                             f"{live['kind']} {live['metadata']['name']}: the pair names no Gateway"))
    had = next((c for c in w.status.get("conditions") or [] if c.get("type") == routes_mod.ROUTED), None)
    if gone or (had is not None and had.get("reason") != "NoGateway"):
        out.add(Condition(routes_mod.ROUTED, False, "NoGateway",
                          "no Gateway named (rollout.gateway.parentRef, nor the chart's gateway.parentRef): "
                          + (f"removed {', '.join(routes_mod.key(o) for o in gone)}" if gone else "no routes")
                          + "; a canary's share is the replica ratio"))


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
    by_weight = routed(w)
    replicas = steps[step].candidate_replicas(champion_replicas, by_weight)
    weight = steps[step].candidate_weight(champion_replicas) if by_weight else None
    # Until this step's pods serve, the route keeps the previous step's weight (none at the first).
    before = steps[step - 1].candidate_weight(champion_replicas) if step > 0 else 0
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
    prior = w.canary_memory if isinstance(w.canary_memory, canary_mod.Memory) else canary_mod.Memory()
    memory = prior.for_step(version, step)
    if weight == 100 and memory is not prior and (prior.version, prior.step) == (str(version), step - 1):
        # At 100% the champion serves nothing through the routes: its stretch of the step before
        # is the baseline the candidate is judged against (lost with the operator's memory).
        memory = replace(memory, champion=prior.champion, carried=prior.champion.finished)
    routing = {"weight": before}     # the candidate weight this pass's routes carry

    def entry(phase: str, message: str, judged: tuple = ()) -> SetStatus:
        started = datetime.datetime.fromtimestamp(memory.since, datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ") if memory.since is not None else ""
        return SetStatus({"canary": canary_mod.status_entry(version, champion, phase, step, steps, replicas,
                                                            champion_replicas, message, judged, started, had,
                                                            weight=routing["weight"] if by_weight else None,
                                                            observed=canary_mod.observed_share(memory))})

    def progressing(message: str, judged: tuple = (), judging: bool = False) -> Report:
        if not judging:     # this step's pods do not serve yet: the previous step's weight
            _routes(out, routes_mod.Traffic(before, champion), f"v{version} canary step {step + 1} of {len(steps)} "
                    "starting", keep=(champion, version))
        out.add(Condition(canary_mod.CONDITION, "Unknown", "Progressing", message), entry("Progressing", message, judged))
        return Report("reconciling", "Canary", "CanaryProgressing", message,
                      ready_message=f"v{champion} serving; v{version} in canary beside it")

    def abort(reason: str, judged: tuple = ()) -> Report:
        msg = f"canary of v{version} aborted: {reason}"
        # The champion's alone again first: no request reaches a canary pod being scaled down.
        _routes(out, routes_mod.Traffic(None, champion), f"canary of v{version} aborted", keep=(champion,))
        aborted = entry("Aborted", msg, judged)
        out.add(TagVersion(version, canary_mod.mark_tag(canary_mod.ABORTED, reason, aborted.fields["canary"])))
        if not candidate_routed(w):     # else the next pass scales it down (_retire_canary)
            out.add(canary_mod.ScaleDown(dep["metadata"]["name"]))
        out.add(canary_mod.RememberCanary(canary_mod.Memory()), Condition(canary_mod.CONDITION, False, "Aborted", msg),
                aborted)
        if not out.was("CanaryAborted", version, version):
            out.add(Record("CanaryAborted", msg, champion, version, warning=True, key=version))
        return Report("stalled", "Degraded", "CanaryAborted", f"{msg}; v{champion} keeps serving",
                      ready_reason="ChampionKeepsServing")

    where = f"v{version} canary step {step + 1} of {len(steps)} ({replicas} pod(s) beside {champion_replicas}" + \
        (f", weight {weight}%)" if weight is not None else ")")
    state, msg = engine_objects.deployment_rollout_state(deployment_after(dep, w.canary_deployment, result), run.tags[TAG_HASH])
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
    # Judging this step: its weight (written, then judged, then the next step's).
    routing["weight"] = weight if weight is not None else before
    _routes(out, routes_mod.Traffic(routing["weight"], champion), f"v{version} canary step {step + 1} of {len(steps)}",
            keep=(champion, version))
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
        replicas = steps[step].candidate_replicas(champion_replicas, by_weight)
        nxt = canary_deployment(w, served, replicas, step)
        out.add(EnsureOwned(nxt, w.canary_deployment))
        memory = canary_mod.Memory()
        share = (f"weight {steps[step].candidate_weight(champion_replicas)}% once they serve" if by_weight else
                 f"{canary_mod.traffic_share(replicas, champion_replicas):.0%} of the traffic")
        text = (f"v{version}: {decision.reason}; step {step + 1} of {len(steps)}: {replicas} pod(s) beside "
                f"{champion_replicas} ({share})")
        if not out.was("CanaryAdvanced", f"{version}#{step + 1}", version):
            out.add(Record("CanaryAdvanced", text, champion, version, key=f"{version}#{step + 1}"))
        return progressing(text, judged, judging=True)
    return progressing(f"{where}: {decision.reason}", judged, judging=True)


def _retire_canary(out: _Steps, champion: str) -> None:
    """No canary runs: a canary Deployment with pods is scaled down, once the champion's own
    Deployment serves (the candidate promoted: its canary pods served until then), or at once
    (a candidate aborted, or no longer the spec's). The routes send everything to the champion:
    pinned to its version while canary pods are about (first, before they are scaled down), to
    every engine pod once they are gone."""
    w = out.world
    live = w.canary_deployment
    about = bool(w.canary_pods) or bool(((live or {}).get("spec") or {}).get("replicas"))
    _routes(out, routes_mod.Traffic(None, champion) if about else routes_mod.SETTLED,
            f"v{champion} serving" + (", canary pods going" if about else ""), keep=(champion,) if champion else ())
    if live is None or not owned.owns(w.uid, dict(live)):
        return
    version = str(((live.get("metadata") or {}).get("labels") or {}).get(manifests.LABEL_VERSION, ""))
    name = live["metadata"]["name"]
    why = (f"v{champion} serves from its engine Deployment now" if version == str(champion)
           else f"v{version} is no longer a candidate")
    had = w.status.get("canary") or {}
    promoted = str(had.get("version")) == version == str(champion) and had.get("phase") == "Passed"
    scaled = bool((live.get("spec") or {}).get("replicas"))
    if scaled and candidate_routed(w):
        return      # the routes written above take the candidate out first; scaled down next pass
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
