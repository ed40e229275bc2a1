"""Every read a pass needs, into values: about the spec's release, one ReleaseWorld (world.py):
its aliases, tags and gate result from MLflow, its gate Jobs (one per attempt), what their pods
reported, and the gate's NetworkPolicy from the API server; about the champion's serving, one
ServingWorld (serving_world.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Mapping

from specpair_operator.release import aliases as aliases_mod
from specpair_operator.policy import canary as canary_mod
from specpair_operator.crd import conditions as c
from specpair_operator.policy import drift as drift_mod
from specpair_operator.gate import attempts as gate_attempts, verdict as gate_verdict
from specpair_operator.desired import autoscaling, engine_objects, gate_objects, manifests, model_fetch, training_job
from specpair_operator.desired import routes as routes_mod
from specpair_operator.crd import names
from specpair_operator.observe import unreadable
from specpair_operator.observe.keda import keda_installed
from specpair_operator.observe.serving_questions import ServingQuestions
from specpair_operator.policy import serving_health
from specpair_operator.desired import tls as tls_mod
from specpair_operator.clients.engine_probe import EngineUnreachable
from specpair_operator.clients.kube import Kube, KubeError
from specpair_operator.desired.ownership import owns
from specpair_operator.clients.registry import PassRegistry
from specpair_operator.release.registry_contract import TAG_ROLLED_BACK, release_of_tags
from specpair_operator.policy.shadow_run import ShadowRun
from specpair_operator.observe.serving_world import (DriftMemory, EnginePod, EngineTLS, Installation, ServingWorld,
                                                     ready_pods)
from specpair_operator.state import CA_REFRESH_S, OperatorState, read_control_ca
from specpair_operator.observe.world import GateJob, Records, ReleaseWorld
from specpair_operator.desired.pod_status import pods_waiting


def _controlled_by_job(pod: dict[str, Any], job: str) -> bool:
    return any(ref.get("kind") == "Job" and ref.get("name") == job and ref.get("controller")
               for ref in (pod.get("metadata") or {}).get("ownerReferences") or [])


def _condition(job: dict[str, Any], type_: str) -> bool:
    return any(cd.get("type") == type_ and cd.get("status") == "True"
               for cd in (job.get("status") or {}).get("conditions") or [])


def gate_job_view(job: dict[str, Any], owner_uid: str, pods: list[dict[str, Any]]) -> GateJob:
    name = job["metadata"]["name"]
    failed, message, failed_at = gate_attempts.job_failed(job)
    st = job.get("status") or {}
    reports = tuple(((cs.get("state") or {}).get("terminated") or {}).get("message") or ""
                    for pod in pods if _controlled_by_job(pod, name)
                    for cs in (pod.get("status") or {}).get("containerStatuses") or [])
    return GateJob(name, owns(owner_uid, job), failed, message, failed_at, _condition(job, "Complete"),
                   st.get("startTime") or "", st.get("completionTime") or "", reports)


def fetched_models(status: Mapping[str, Any]) -> tuple[str, ...]:
    """status.modelCache.fetched: the models digests whose fetch Job completed."""
    return tuple(str(d) for d in ((status.get("modelCache") or {}).get("fetched") or ()))


async def observe_fetch(kube: Kube, pair: str, namespace: str, release: Mapping[str, Any],
                        rollout: Mapping[str, Any], fetched: tuple[str, ...]) -> model_fetch.FetchState | None:
    """Where the release's model fetch Job stands; None when it needs none (model_fetch.needs_fetch)."""
    if not model_fetch.needs_fetch(release, rollout, fetched):
        return None
    name = model_fetch.fetch_job_name(pair, model_fetch.models_digest(release))
    job = await kube.get("batch/v1", "jobs", namespace, name)
    pods = await kube.list("v1", "pods", namespace, f"job-name={name}") if job is not None else []
    return model_fetch.fetch_state(job, pods)


def gate_jobs_needed(records: Records, version: str, aliases: Mapping[str, str]) -> bool:
    """Whether a pass must read the release's gate Jobs and their pods: not once the release is
    the champion and its gate's start and result are in the status (plan_release reads the Jobs
    for nothing else then), which is every pass of a settled pair."""
    if aliases.get(aliases_mod.CHAMPION) != version:
        return True
    return not (records.was("GateStarted", version, version)
                and any(records.was(action, version, version) for action in GATE_RESULTS))


# The history actions of a gate's result (release_gate.gate_result).
GATE_RESULTS = ("GatePassed", "GateFailed", gate_verdict.GATE_ERROR)


async def observe_trainings(kube: Kube, pair: str, namespace: str, status: Mapping[str, Any],
                            champion: str) -> dict[str, training_job.TrainingState]:
    """The pair's training Jobs (one list), each with its pods while status does not yet record
    its end (their termination message names the version it registered): by run key
    ("version/category", "@slot" added for a scheduled one; state.run says which)."""
    selector = f"{manifests.LABEL_PAIR}={names.label_value(pair)},{manifests.LABEL_ROLE}={training_job.ROLE}"
    following = set(training_job.followed(status, champion))
    found: dict[str, training_job.TrainingState] = {}
    for job in await kube.list("batch/v1", "jobs", namespace, selector):
        run = training_job.job_run(job)
        name = job["metadata"]["name"]
        pods = await kube.list("v1", "pods", namespace, f"job-name={name}") if run in following else []
        found[training_job.run_key(*run)] = training_job.training_state(job, pods)
    return found


async def observe_release(kube: Kube, registry: PassRegistry, body: Mapping[str, Any], status: Mapping[str, Any],
                          model: str, version: str, digest: str, thresholds: Mapping[str, Any],
                          release: Mapping[str, Any] | None = None,
                          installation: Installation | None = None) -> ReleaseWorld:
    meta = body["metadata"]
    pair, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    aliases = await registry.read("aliases", model)
    tags = await registry.read("version_tags", model, version)
    gate_status, verdict, gate_message = await registry.read("gate_result", model, version)
    policy = gate_attempts.Policy.from_env()
    records = Records.from_status(status)
    jobs: list[dict[str, Any]] = []
    for attempt in range(1, policy.attempts + 1 if gate_jobs_needed(records, version, aliases) else 1):
        job = await kube.get("batch/v1", "jobs", namespace, manifests.gate_job_name(pair, digest, attempt))
        if job is None:
            break
        jobs.append(job)
    pods: list[dict[str, Any]] = []
    if jobs:
        names = ",".join(j["metadata"]["name"] for j in jobs)
        pods = await kube.list("v1", "pods", namespace, f"job-name in ({names})")
    latest = jobs[-1]["metadata"]["name"] if jobs else ""
    gating = aliases.get(aliases_mod.CHAMPION) != version
    gate_policy_owned = None
    fetched = fetched_models(status)
    fetch = None
    if gating:
        live = await kube.get("networking.k8s.io/v1", "networkpolicies", namespace,
                              gate_objects.gate_network_policy(pair, namespace)["metadata"]["name"])
        gate_policy_owned = None if live is None else owns(uid, live)
        if release is not None:
            fetch = await observe_fetch(kube, pair, namespace, release,
                                        (body.get("spec") or {}).get("rollout") or {}, fetched)
    champion = aliases.get(aliases_mod.CHAMPION)
    champion_release = None
    if gate_status == "passed" and champion and champion != version:
        # What the candidate is compared with to choose its rollout strategy (Replace, Shadow).
        champion_tags = await registry.read("version_tags", model, champion)
        champion_release = release_of_tags(champion_tags)
    return ReleaseWorld(
        rollout=dict((body.get("spec") or {}).get("rollout") or {}), champion_release=champion_release,
        pair=pair, namespace=namespace, version=version, digest=digest, thresholds=dict(thresholds),
        aliases=dict(aliases), tags=dict(tags), gate_status=gate_status, verdict=verdict, gate_message=gate_message,
        gate_jobs=tuple(gate_job_view(j, uid, pods) for j in jobs), gate_policy_owned=gate_policy_owned,
        gate_pods_waiting=pods_waiting([p for p in pods if (p["metadata"].get("labels") or {}).get("job-name") == latest]),
        verified_verdicts={str(k): str(v) for k, v in (status.get("verifiedVerdicts") or {}).items()},
        records=records, attempts=policy, now=c.now_iso(),
        models=model_fetch.models_digest(release) if release is not None else "", fetched=fetched, model_fetch=fetch,
        model=model, release=release, installation=installation)


# -- the champion's serving -----------------------------------------------------------------------

async def observe_serving(op: OperatorState, registry: PassRegistry, body: Mapping[str, Any], spec: Mapping[str, Any],
                          status: Mapping[str, Any], model: str, aliases: Mapping[str, str], desired: str | None,
                          desired_reason: str = "", while_gating: bool = False,
                          shadow: ShadowRun | None = None, canary: Any = None, *,
                          questions: ServingQuestions) -> ServingWorld:
    """Every read the champion's serving needs, into one ServingWorld. The reads follow the
    plan's own `questions` (serving_questions.py): pods are asked who they are only once
    the rollout is available, counters only when the identity holds and a drift check is due,
    the previous release only when the ladder's next step is a rollback."""
    w = replace(_serving_world(op, body, spec, status, model, aliases, desired, desired_reason, while_gating),
                shadow=shadow, canary_run=canary, canary_memory=op.canary_samples.get(body["metadata"]["uid"]))
    champion = aliases.get(aliases_mod.CHAMPION)
    if champion is None:
        return w
    tags = await registry.read("version_tags", model, champion)
    w = replace(w, tags=dict(tags))
    if tags.get(TAG_ROLLED_BACK):
        return w
    if training_job.learning_enabled(spec):
        w = replace(w, trainings=await observe_trainings(op.kube, w.pair, w.namespace, status, champion))
    _, verdict, _ = await registry.read("gate_result", model, champion)
    # A champion's verdict edited in MLflow after its promotion serves with the spec's speculation
    # and no gated numbers, rather than with whatever the tag now says.
    w = replace(w, verdict=gate_verdict.usable_verdict(verdict))
    w = await _observe_engine(op, w, questions)
    if questions.rollout_state(w)[0] != "available":
        return w
    legacy = names.legacy_object_name(w.pair, "engine")
    if legacy != manifests.engine_name(w.pair):
        w = replace(w, legacy_deployment=await op.kube.get("apps/v1", "deployments", w.namespace, legacy))
    return await _observe_pods(op, registry, w, champion, questions)


async def observe_watch(op: OperatorState, body: Mapping[str, Any], spec: Mapping[str, Any],
                        status: Mapping[str, Any], *, questions: ServingQuestions) -> ServingWorld | None:
    """While MLflow is down: the champion as the last pass that verified it found it in MLflow,
    its pods and what they report (None when no pass has verified one)."""
    cached = op.watch_cache.get(body["metadata"]["uid"])
    if cached is None:
        return None
    model, aliases, champion, tags, verdict, served_hash = cached
    w = _serving_world(op, body, spec, status, model, aliases, champion, "", False)
    w = replace(w, registry_down=True, tags=dict(tags), verdict=dict(verdict), served_hash=served_hash,
                pods=tuple(p for p in await op.kube.list("v1", "pods", w.namespace, questions.engine_selector(w.pair))
                           if not canary_mod.is_canary_pod(p)))
    return await _observe_pods(op, op.registry.for_pass(), w, champion, questions)


def _serving_world(op: OperatorState, body: Mapping[str, Any], spec: Mapping[str, Any], status: Mapping[str, Any],
                   model: str, aliases: Mapping[str, str], desired: str | None, desired_reason: str,
                   while_gating: bool) -> ServingWorld:
    meta = body["metadata"]
    uid = meta["uid"]
    version, memory = op.samples.get(uid, ("", drift_mod.Memory()))
    return ServingWorld(
        pair=meta["name"], namespace=meta["namespace"], uid=uid, model=model, aliases=dict(aliases), desired=desired,
        desired_reason=desired_reason, while_gating=while_gating, spec=spec, status=status,
        records=Records.from_status(status),
        installation=Installation(op.gate_tracking_uri,
                                  manifests.MlflowCredentials.for_pair(spec.get("mlflow"), op.credentials), op.pods,
                                  autoscaling.default_prometheus(), routes_mod.default_gateway()),
        now=c.now_iso(), rendered=op.renders.setdefault(uid, {}),
        drift=DriftMemory(version, memory, op.serving_samples.get(uid) or serving_health.ServingMemory(),
                          op.last_drift_check.get(uid, 0.0), time.monotonic(), time.time()))


async def _observe_engine(op: OperatorState, w: ServingWorld, questions: ServingQuestions) -> ServingWorld:
    """The engine's Deployment, Service, NetworkPolicy, certificate marks and pods."""
    kube, name = op.kube, manifests.engine_name(w.pair)
    w = replace(w, deployment=await kube.get("apps/v1", "deployments", w.namespace, name),
                service=await kube.get("v1", "services", w.namespace, name), keda=await keda_installed(op))
    if questions.name_taken(w):
        return w
    w = replace(w, tls=await _observe_tls(op, w, questions))       # vLLM pods too: their companion's control port
    served = questions.served_release(w)
    fetched = fetched_models(w.status)
    w = replace(w, models=model_fetch.models_digest(served), fetched=fetched,
                model_fetch=await observe_fetch(kube, w.pair, w.namespace, served, w.rollout, fetched))
    policy = engine_objects.engine_network_policy(w.pair, w.namespace, op.pods)["metadata"]["name"]
    pods = await kube.list("v1", "pods", w.namespace, questions.engine_selector(w.pair))
    # A canary's pods carry the Service's labels too; its Deployment is read whether or not a
    # canary runs, so one left behind is scaled down.
    w = replace(w, policy=await kube.get("networking.k8s.io/v1", "networkpolicies", w.namespace, policy),
                pods=tuple(p for p in pods if not canary_mod.is_canary_pod(p)),
                canary_pods=tuple(p for p in pods if canary_mod.is_canary_pod(p)),
                canary_deployment=await kube.get("apps/v1", "deployments", w.namespace,
                                                 manifests.engine_canary_name(w.pair)))
    return await _observe_routes(op, w)


async def _observe_routes(op: OperatorState, w: ServingWorld) -> ServingWorld:
    """The pair's routes and route Services (desired/routes.py), when it names a Gateway (or the
    chart does), or its status says it had routes (to remove them), and the API server serves
    Gateway API's routes (API discovery, open to every identity). Every route Service is listed,
    old versions' included, so those no longer wanted are found."""
    if routes_mod.gateway_parent(w.spec, w.installation.gateway) is None and not routes_mod.routed_before(w.status):
        return w
    served = await op.kube.served_resources(routes_mod.GATEWAY_API)
    if not {"httproutes", "grpcroutes"} <= served:
        return w
    found = {f"{kind}/{name}": await op.kube.get(api, plural, w.namespace, name)
             for api, plural, kind, name in routes_mod.observed_keys(w.pair, w.aliases.get(aliases_mod.CHAMPION))}
    for service in await op.kube.list("v1", "services", w.namespace, routes_mod.route_services_selector(w.pair)):
        # A list's items carry no kind: the delete (act/owned.py) and the plan's words need it.
        found.setdefault(f"Service/{service['metadata']['name']}", {"apiVersion": "v1", "kind": "Service", **service})
    return replace(w, gateway_api=True, routes=found)


async def _observe_tls(op: OperatorState, w: ServingWorld, questions: ServingQuestions) -> EngineTLS:
    """The CA of now, and what the pair's Secret holds as far as the operator may ask without
    reading it (RBAC: create and patch Secrets, no get): whether it carries the mark of a
    certificate from this CA for these names (a dry-run JSON patch of tests), or is gone. No CA
    yet: `ca_missing` (the plan has act create it; observe never writes)."""
    ca = await read_control_ca(op)
    secret = manifests.engine_tls_secret_name(w.pair)
    dns = tls_mod.engine_dns_names(manifests.engine_name(w.pair), w.namespace)
    if ca is None:
        return EngineTLS(secret, "", dns, "", ca_missing=True)
    ca_fingerprint = tls_mod.fingerprint(ca.cert_pem)
    tls = EngineTLS(secret, ca_fingerprint, dns, questions.issued_for(ca_fingerprint, dns))
    check = questions.certificate_check(replace(w, tls=tls))
    ref = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": w.namespace}}
    if check == "other":
        return replace(tls, held=await unreadable.holds(op.kube, w.uid, ref, {questions.ANN_ISSUED_FOR: tls.issued_for}))
    if check == "current":
        return replace(tls, **await _secret_missing(op, w.uid, ref))
    return tls


async def _secret_missing(op: OperatorState, uid: str, ref: dict[str, Any]) -> dict[str, Any]:
    """Whether the Secret is gone (deleted by hand), asked every CA_REFRESH_S by trying to
    create it: the operator may not read Secrets, and engine pods cannot start without it. Found
    there: when (`seen_at`), which the plan has act remember (TLSSecretSeen)."""
    if time.monotonic() - op.tls_checked_at.get(uid, 0.0) < CA_REFRESH_S:
        return {"missing": False}
    try:
        # dryRun: nothing is written; 409 means it is there.
        await op.kube.create(ref, read_existing=False, dry_run=True)
    except KubeError as exc:
        if exc.status != 409:
            raise
        return {"missing": False, "seen_at": time.monotonic()}
    return {"missing": True}


async def _observe_pods(op: OperatorState, registry: PassRegistry, w: ServingWorld, champion: str,
                        questions: ServingQuestions) -> ServingWorld:
    """Who each ready pod says it is (up to the first that does not answer); then, when they
    are the champion's and a drift check is due, their counters (likewise), and the release a
    rollback would go to when the ladder's next step is one."""
    probe = op.vllm_probe if questions.kind_of(w) == "vllm" else op.probe
    server = tls_mod.server_name(manifests.engine_name(w.pair), w.namespace)
    ready = []
    for pod in ready_pods(list(w.pods)):
        meta = pod["metadata"]
        view = EnginePod(meta["name"], meta.get("uid", ""), pod["status"]["podIP"])
        try:
            view = replace(view, info=await probe.model_info(questions.address(w, view), server_name=server))
        except EngineUnreachable as exc:
            ready.append(replace(view, unreachable=str(exc)))
            break
        ready.append(view)
    w = replace(w, ready=tuple(ready))
    ok, _, verified = questions.identity(w, champion, questions.champion_digest(w))
    position = questions.drift_position(w, champion)
    # A candidate scored in shadow is judged every pass on the pods' counters; a training waiting
    # for captured requests reads them every pass too (their counts of closed capture shards).
    if not ok or ((position is None or not position.due) and w.shadow is None and w.canary_run is None
                  and not training_job.waits_for_capture(w.status, champion)):
        return w
    counted = []
    for view in verified:
        try:
            counted.append(replace(view, stats=await probe.stats(questions.address(w, view), server_name=server)))
        except EngineUnreachable as exc:
            counted.append(replace(view, stats_unreachable=str(exc)))
            break
    w = replace(w, ready=tuple(counted) + w.ready[len(counted):])
    if questions.rollback_needs_previous(w, champion):
        target = w.aliases[aliases_mod.PREVIOUS]
        _, previous_verdict, _ = await registry.read("gate_result", w.model, target)
        previous_tags = await registry.read("version_tags", w.model, target)
        w = replace(w, drift=replace(w.drift, previous_verdict=previous_verdict, previous_tags=dict(previous_tags)))
    if w.canary_run is not None:
        w = await _observe_canary(w, probe, server, questions)
    return w


async def _observe_canary(w: ServingWorld, probe: Any, server: str, questions: ServingQuestions) -> ServingWorld:
    """Who each ready canary pod says it is and its counters (up to the first that does not
    answer): the candidate's side of the canary's judgement."""
    ready = []
    for pod in ready_pods(list(w.canary_pods)):
        meta = pod["metadata"]
        view = EnginePod(meta["name"], meta.get("uid", ""), pod["status"]["podIP"])
        address = questions.address(w, view)
        try:
            view = replace(view, info=await probe.model_info(address, server_name=server))
            view = replace(view, stats=await probe.stats(address, server_name=server))
        except EngineUnreachable as exc:
            ready.append(replace(view, unreachable=str(exc)) if view.info is None
                         else replace(view, stats_unreachable=str(exc)))
            break
        ready.append(view)
    return replace(w, canary_ready=tuple(ready))
