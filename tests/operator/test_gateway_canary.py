"""Canaries by traffic weight through a Gateway API gateway (issue 57).

Pure tables: the routes and Services the pair owns for its Gateway (desired/routes.py), the
canary steps by weight and what status.canary says the share rests on (policy/canary.py), the
strategy chosen by what changed (policy/rollout_strategy.py).

On the devcluster, through a real Traefik (scripts/build-gateway.sh, devcluster gateway.py): an
HTTPRoute at 80/20 between two stand-in backends splits one keep-alive HTTP client's 500 requests
and one gRPC channel's 500 calls within 3 points of 20%, and the x-specpair-release header
picks a side whatever the weight.
"""

from __future__ import annotations

import http.server
import socketserver
import sys
import threading
from concurrent import futures
from pathlib import Path

import pytest

from specpair_operator.desired import engine_objects, manifests, routes
from specpair_operator.policy import canary
from specpair_operator.policy.rollout_strategy import CANARY, REPLACE, SHADOW, choose_strategy
from specpair_operator.release.content import build_release

ROLLOUT = {"port": 50051, "httpPort": 8000}
PARENT = routes.gateway_parent({"rollout": {"gateway": {"parentRef": {"name": "edge", "namespace": "gw"}}}})


# -- routes (pure) ----------------------------------------------------------------------------------

def by_kind(objs):
    return {o["kind"] + ("/" + o["metadata"]["name"] if o["kind"] == "Service" else ""): o for o in objs}


def test_no_gateway_named_no_routes():
    assert routes.gateway_parent({"rollout": {}}) is None
    assert routes.gateway_parent({"rollout": {"gateway": {"parentRef": {}}}}) is None
    assert routes.desired("p", "ns", ROLLOUT, None, routes.SETTLED) == []


def test_the_parent_ref_is_the_gateways():
    assert PARENT == {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge", "namespace": "gw"}
    assert routes.gateway_parent({"rollout": {"gateway": {"parentRef": {"name": "edge", "sectionName": "web"}}}}) == \
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge", "sectionName": "web"}


def test_settled_the_routes_send_everything_to_the_champion():
    objs = by_kind(routes.desired("p", "ns", ROLLOUT, PARENT, routes.SETTLED))
    assert set(objs) == {"Service/p-engine-champion", "HTTPRoute", "GRPCRoute"}
    champion = objs["Service/p-engine-champion"]
    # Settled: every engine pod of the pair (a Replace rolling between versions stays served).
    assert champion["spec"]["selector"] == manifests.engine_selector("p")
    assert {p["name"]: p["appProtocol"] for p in champion["spec"]["ports"]} == {"grpc": routes.H2C, "http": "http"}
    for kind, port in (("HTTPRoute", 8000), ("GRPCRoute", 50051)):
        route = objs[kind]
        assert route["metadata"]["name"] == manifests.engine_name("p")
        assert route["spec"]["parentRefs"] == [PARENT]
        assert routes.weights(route) == {"p-engine-champion": 1}
        named = [r for r in route["spec"]["rules"] if any(m.get("headers") for m in r.get("matches", []))]
        assert [m["matches"][0]["headers"][0]["value"] for m in named] == [routes.CHAMPION]
        assert all(ref["port"] == port for r in route["spec"]["rules"] for ref in r["backendRefs"])


@pytest.mark.parametrize("weight", [0, 5, 20, 100])
def test_during_a_canary_the_routes_weigh_champion_and_candidate(weight):
    objs = by_kind(routes.desired("p", "ns", ROLLOUT, PARENT, routes.Traffic(weight, "3")))
    assert set(objs) == {"Service/p-engine-v3", "Service/p-engine-candidate", "HTTPRoute", "GRPCRoute"}
    champion, candidate = objs["Service/p-engine-v3"], objs["Service/p-engine-candidate"]
    # The champion's side is its version's own Service, so the canary's pods (another version) stay
    # out; a Service of its own, as the operator never changes a Service's selector (create only).
    assert champion["spec"]["selector"] == {**manifests.engine_selector("p"), manifests.LABEL_VERSION: "3"}
    assert candidate["spec"]["selector"] == {**manifests.engine_selector("p"), canary.TRACK_LABEL: canary.CANARY_TRACK}
    for kind in ("HTTPRoute", "GRPCRoute"):
        route = objs[kind]
        # A side at 0% is left out of the split (no gateway sends it anything then).
        assert routes.weights(route) == {k: v for k, v in {"p-engine-v3": 100 - weight,
                                                           "p-engine-candidate": weight}.items() if v}
        sides = {r["matches"][0]["headers"][0]["value"]: r["backendRefs"][0]["name"]
                 for r in route["spec"]["rules"] if any(m.get("headers") for m in r.get("matches", []))}
        assert sides == {routes.CANDIDATE: "p-engine-candidate", routes.CHAMPION: "p-engine-v3"}
        for rule in route["spec"]["rules"]:
            for match in rule.get("matches", []):
                if "headers" in match:
                    assert match["headers"][0] == {"type": "Exact", "name": "x-specpair-release",
                                                    "value": match["headers"][0]["value"]}
                assert match.get("path") == ({"type": "PathPrefix", "value": "/v1"} if kind == "HTTPRoute" else None)
                # gRPC: the engine's service by name, so the two routes never take each other's requests.
                assert ("method" in match) == (kind == "GRPCRoute")


def test_the_canary_pods_carry_what_the_candidate_service_selects():
    release = {"target": {"source": "default"}, "draft": {"drafter": "ngram"}, "speculation": {"k": 3},
               "gating": {}, "pair": "p", "version": "4"}
    champion = engine_objects.engine_deployment("p", "ns", {**release, "version": "3"}, "d" * 64, "3", {"replicas": 2},
                                           "http://mlflow")
    candidate = canary.canary_deployment(engine_objects.engine_deployment("p", "ns", release, "e" * 64, "4",
                                                                     {"replicas": 2}, "http://mlflow"),
                                         manifests.engine_canary_name("p"), 1, 0)
    objs = by_kind(routes.desired("p", "ns", ROLLOUT, PARENT, routes.Traffic(20, "3")))

    def selects(service, dep):
        return service["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert selects(objs["Service/p-engine-v3"], champion)
    assert not selects(objs["Service/p-engine-v3"], candidate)
    assert selects(objs["Service/p-engine-candidate"], candidate)
    assert not selects(objs["Service/p-engine-candidate"], champion)
    # Settled again: the champion's Service takes every engine pod.
    settled = by_kind(routes.desired("p", "ns", ROLLOUT, PARENT, routes.SETTLED))["Service/p-engine-champion"]
    assert selects(settled, champion) and selects(settled, candidate)


def test_tls_and_vllm_and_no_http_port():
    objs = by_kind(routes.desired("p", "ns", {**ROLLOUT, "tls": {"enabled": True}}, PARENT, routes.SETTLED))
    assert {p["appProtocol"] for p in objs["Service/p-engine-champion"]["spec"]["ports"]} == {"https"}
    vllm = by_kind(routes.desired("p", "ns", {}, PARENT, routes.SETTLED, kind="vllm"))
    assert set(vllm) == {"Service/p-engine-champion", "HTTPRoute"}       # vLLM serves no gRPC port
    grpc_only = by_kind(routes.desired("p", "ns", {"httpPort": 0}, PARENT, routes.SETTLED))
    assert set(grpc_only) == {"Service/p-engine-champion", "GRPCRoute"}


@pytest.mark.parametrize("traffic", [dict(candidate_weight=101, champion_version="1"),
                                     dict(candidate_weight=-1, champion_version="1"),
                                     dict(candidate_weight=20)])
def test_a_weight_is_a_percent_and_a_canary_pins_the_champion(traffic):
    with pytest.raises(ValueError):
        routes.Traffic(**traffic)


# -- the operator's plan writes the routes (pure) ---------------------------------------------------

ROUTED_STEPS = [{"weight": 20, "pauseSeconds": 20}, {"weight": 100, "pauseSeconds": 20}]
ROUTED_ROLLOUT = {"replicas": 2, "gateway": {"parentRef": {"name": "edge"}},
                  "strategy": {"type": "Canary", "steps": ROUTED_STEPS}}


def routed_cluster(candidate: str, gateway_api: bool = True):
    """test_canary_plan's model of MLflow, the two Deployments and their pods, for a pair that
    names a Gateway: the route objects the plan writes are kept as the API server would, and each
    pass's requests (60) reach the pods as the live HTTPRoute's weights say (the gateway)."""
    import functools

    import plan_tables
    import test_canary_plan as tcp
    from specpair_operator.plan import serving_plan as sp
    from specpair_operator.plan.serving_steps import DeleteOwned

    spec = {**tcp.SPEC, "rollout": ROUTED_ROLLOUT}

    class Routed(tcp.Cluster):
        candidate_world = staticmethod(functools.partial(plan_tables.candidate_world, tags=tcp.NEW_TARGET,
                                                         champion_tags=tcp.CHAMPION_TAGS, verdict=tcp.GOOD,
                                                         rollout=ROUTED_ROLLOUT))

        def __init__(self):
            self.routes, self.splits, self.removed = {}, [], []
            super().__init__(candidate, per_pod=0)

        def serving_world(self, step):
            import dataclasses
            w = super().serving_world(step)
            return dataclasses.replace(w, spec=spec, gateway_api=gateway_api, routes=dict(self.routes))

        def write_object(self, step):
            if isinstance(step, DeleteOwned):
                # Only what no live route sends to (the gateway could still be reading it).
                assert step.live["metadata"]["name"] not in routes.sent_to(self.routes), step.live
                self.removed.append(routes.key(step.live))
                self.routes.pop(routes.key(step.live))
                return
            if isinstance(step, sp.EnsureOwned) and routes.key(step.manifest) in {
                    f"{kind}/{name}" for _, _, kind, name in routes.observed_keys(plan_tables.PAIR, "1")} | {
                    f"{kind}/{name}" for _, _, kind, name in routes.observed_keys(plan_tables.PAIR, "2")}:
                written = plan_tables.mine(dict(step.manifest), step.mutable)
                if written["kind"] == "Service":
                    # Old enough for a route at the next pass (routes.pending; the wait is tested below).
                    written["metadata"]["creationTimestamp"] = "2000-01-01T00:00:00Z"
                self.routes[routes.key(step.manifest)] = written
                if step.manifest["kind"] == "HTTPRoute":
                    self.splits.append(routes.describe(routes.weights(step.manifest)))
                return
            super().write_object(step)

        def one_pass(self, crash_at):
            # The gateway: 60 requests a pass, split by the live route's weights over each side's pods.
            split = routes.weights(self.routes.get(f"HTTPRoute/{routes.route_name(plan_tables.PAIR)}"))
            total = sum(split.values()) or 1
            candidate_share = split.get(routes.candidate_service_name(plan_tables.PAIR), 0) / total
            for side, share in (("main", 1 - candidate_share), ("canary", candidate_share)):
                for pod in self.pods[side]:
                    pod.serve(round(60 * share / len(self.pods[side])), **self.speed[pod.served["mlflow"]["version"]])
            return super().one_pass(crash_at)

    return Routed()


def run_routed(cluster, passes: int = 40):
    for _ in range(passes):
        if not cluster.one_pass(None):
            return cluster
    raise AssertionError(f"no convergence: {cluster.history}; {cluster.status.get('canary')}")


def test_the_operator_writes_each_steps_weight_then_judges_then_the_next_and_ends_on_the_champion():
    cl = run_routed(routed_cluster("fast"))
    assert [a for a, _ in cl.history] == ["CanaryStarted", "CanaryAdvanced", "CanaryPassed", "Promoted",
                                          "RolloutStarted", "CanaryScaledDown"]
    # The canary's first step at 0% until its pods serve, then 20%, then 100%; promoted: v2's
    # pods only (the canary's beside the new engine pods), then every engine pod.
    assert cl.splits == ["chat-engine-v1 100%", "chat-engine-v1 80%, chat-engine-candidate 20%",
                         "chat-engine-candidate 100%", "chat-engine-v2 100%",
                         "chat-engine-champion 100%"], cl.splits
    assert cl.events.count("TrafficRouted") == 2 * len(cl.splits)      # HTTPRoute and GRPCRoute, each write
    # A weight step sizes the candidate for its share of the champion's load: 1 pod at 20% of 2, 2 at 100%.
    assert cl.objects["canary"]["spec"]["replicas"] == 0
    entry = cl.status["canary"]
    assert entry["phase"] == "Promoted" and (entry["weight"], entry["trafficShare"]) == (100, 1.0)
    assert entry["shareBasis"] == canary.SHARE_BY_WEIGHT and entry["observedShare"] == 1.0
    # The champion's baseline at 100% is its stretch of the step before.
    assert entry["judged"]["ttft:*"]["verdict"] == "fine"
    assert cl.routes["HTTPRoute/chat-engine"]["spec"] == cl.routes["HTTPRoute/chat-engine"]["spec"] | {
        "rules": routes._rules("chat", 8000, routes.SETTLED, True)}
    # The old champion's and the candidate's route Services are gone, each once no route sent to
    # it; the settled routes' one stays, and the new champion's version one, made at its canary's
    # start (routes.desired's keep), ready for the next canary's champion side.
    assert sorted(cl.removed) == ["Service/chat-engine-candidate", "Service/chat-engine-v1"]
    assert sorted(k for k in cl.routes if k.startswith("Service/")) == ["Service/chat-engine-champion",
                                                                        "Service/chat-engine-v2"]


def test_a_routed_canary_worse_than_the_champion_goes_back_to_the_champion_before_its_pods_go():
    cl = routed_cluster("slow")
    observed = []
    while "CanaryAborted" not in [a for a, _ in cl.history]:
        cl.one_pass(None)
        observed.append((cl.status.get("canary") or {}).get("observedShare"))
    scale_down = f"ScaleDown {routes.names.object_name('chat', 'engine-canary')}"
    # The abort's pass takes the candidate out of the routes; its pods go only in the next pass,
    # which finds the live routes without it (the gateway stopped sending to them first).
    assert "EnsureOwned HTTPRoute" in kinds_of(cl.last_serving) and scale_down not in kinds_of(cl.last_serving)
    assert cl.splits[-1] == "chat-engine-v1 100%" and cl.pods["canary"]
    cl.one_pass(None)
    assert scale_down in kinds_of(cl.last_serving)
    # The share the pods counted is the route's weight (20% of every pass's 60 requests).
    assert any(o is not None and abs(o - 0.2) < 0.02 for o in observed), observed
    run_routed(cl)
    assert cl.splits[-1] == "chat-engine-champion 100%" and cl.aliases["champion"] == "1"


def test_the_charts_default_gateway_serves_a_pair_that_names_none():
    env = {routes.DEFAULT_GATEWAY_ENV: '{"name": "edge", "namespace": "gw"}'}
    default = routes.default_gateway(env)
    assert routes.gateway_parent({"rollout": {}}, default) == PARENT
    assert routes.gateway_parent({"rollout": {"gateway": {"parentRef": {"name": "own"}}}}, default)["name"] == "own"
    assert routes.default_gateway({}) is None and routes.default_gateway({routes.DEFAULT_GATEWAY_ENV: " "}) is None
    for bad in ("edge", '["edge"]', '{"namespace": "gw"}'):
        with pytest.raises(ValueError, match=routes.DEFAULT_GATEWAY_ENV):
            routes.default_gateway({routes.DEFAULT_GATEWAY_ENV: bad})


def plan_routes(spec: dict, live: dict, conditions: list, default: dict | None = None) -> list:
    """One pass's route steps for a settled pair (serving_canary._routes), the live objects as observe read them."""
    import plan_tables

    from specpair_operator.observe.serving_world import Installation, ServingWorld
    from specpair_operator.plan import serving_canary
    from specpair_operator.plan.serving_steps import _Steps
    w = ServingWorld(pair="p", namespace="ns", uid=plan_tables.UID, model="m", spec=spec,
                     status={"conditions": conditions}, gateway_api=True, routes=live,
                     installation=Installation(gateway=default))
    out = _Steps(w)
    serving_canary._routes(out, routes.SETTLED, "v1 serving")
    return out.steps


def test_a_pair_that_stops_naming_a_gateway_has_its_routes_removed():
    import plan_tables

    written = {routes.key(o): plan_tables.mine(o, o["kind"] != "Service")
               for o in routes.desired("p", "ns", ROLLOUT, PARENT, routes.SETTLED)}
    routed = [{"type": routes.ROUTED, "status": "True", "reason": "Routed"}]
    spec = {"rollout": dict(ROLLOUT)}
    steps = plan_routes(spec, written, routed)
    assert sorted(routes.key(s.live) for s in steps if type(s).__name__ == "DeleteOwned") == sorted(written)
    cond = next(s for s in steps if kinds_of([s])[0].startswith("Condition Routed"))
    assert (cond.status, cond.reason) == (False, "NoGateway") and "removed HTTPRoute/p-engine" in cond.message
    # One not the pair's (no owner reference of its uid) is never touched.
    foreign = {**written, "Service/p-engine-champion": {**written["Service/p-engine-champion"],
                                                        "metadata": {"name": "p-engine-champion"}}}
    assert "Service/p-engine-champion" not in {routes.key(s.live) for s in plan_routes(spec, foreign, routed)
                                               if type(s).__name__ == "DeleteOwned"}
    # Once gone (the condition says NoGateway), a pass plans nothing.
    assert plan_routes(spec, {}, [{"type": routes.ROUTED, "status": "False", "reason": "NoGateway"}]) == []
    # The chart's default Gateway keeps them: nothing to write, nothing to delete.
    kept = plan_routes(spec, written, routed, default={"name": "edge", "namespace": "gw"})
    assert kinds_of(kept) == [k for k in kinds_of(kept) if k.startswith("Condition Routed")], kinds_of(kept)


def test_a_live_route_is_switched_only_to_a_service_old_enough_to_have_endpoints():
    """Traefik answered 500 ("endpointslices not found") for a second or two after a route named a
    Service made in the same pass: the Service comes first, the route once it is 5 s old."""
    import plan_tables

    from specpair_operator.observe.serving_world import ServingWorld
    from specpair_operator.plan import serving_canary
    from specpair_operator.plan.serving_steps import _Steps

    spec = {"rollout": {**ROLLOUT, "gateway": {"parentRef": {"name": "edge", "namespace": "gw"}}}}
    settled = {routes.key(o): plan_tables.mine(o, o["kind"] != "Service")
               for o in routes.desired("p", "ns", ROLLOUT, PARENT, routes.SETTLED)}

    def canary_start(now: str, v1_created: str | None) -> list:
        live = dict(settled)
        if v1_created:     # the champion's version Service and the candidate's (its header rule)
            for side in (routes.CHAMPION, routes.CANDIDATE):
                made = routes.route_service("p", "ns", ROLLOUT, side, routes.Traffic(0, "1"))
                live[routes.key(made)] = plan_tables.mine({**made, "metadata": {**made["metadata"],
                                                                                "creationTimestamp": v1_created}}, False)
        w = ServingWorld(pair="p", namespace="ns", uid=plan_tables.UID, model="m", spec=spec, gateway_api=True,
                         routes=live, now=now)
        out = _Steps(w)
        serving_canary._routes(out, routes.Traffic(0, "1"), "v2 canary step 1 of 4 starting", keep=("1", "2"))
        return kinds_of(out.steps)
    absent = canary_start("2026-01-01T00:00:10Z", None)
    assert "EnsureOwned Service" in absent and "EnsureOwned HTTPRoute" not in absent, absent
    assert "Condition Routed=True ServicePending" in absent
    assert "EnsureOwned HTTPRoute" not in canary_start("2026-01-01T00:00:10Z", "2026-01-01T00:00:07Z")
    assert "EnsureOwned HTTPRoute" in canary_start("2026-01-01T00:00:10Z", "2026-01-01T00:00:05Z")
    # The first routes of a pair are written at once (nothing was routed before them).
    w = ServingWorld(pair="p", namespace="ns", uid=plan_tables.UID, model="m", spec=spec, gateway_api=True,
                     routes={}, now="2026-01-01T00:00:10Z")
    out = _Steps(w)
    serving_canary._routes(out, routes.SETTLED, "v1 serving", keep=("1",))
    assert {"EnsureOwned HTTPRoute", "EnsureOwned GRPCRoute"} <= set(kinds_of(out.steps))


def test_without_gateway_api_on_the_cluster_the_condition_says_so_and_the_ratio_stays():
    cl = routed_cluster("fast", gateway_api=False)
    cl.one_pass(None)
    cl.one_pass(None)
    conds = [s for s in cl.last_serving if kinds_of([s])[0].startswith("Condition Routed")]
    assert conds and conds[0].status is False and conds[0].reason == "GatewayAPINotServed"
    assert not cl.routes and cl.status["canary"]["shareBasis"].startswith("approximate")


def test_the_dashboards_weight_and_observed_share_follow_status_canary():
    from specpair_operator.act import metrics

    def value(name: str) -> dict:
        return {s.labels["step"]: s.value for s in metrics.REGISTRY.collect() for s in s.samples
                if s.name == name and s.labels.get("pair") == "share-p"}
    entry = canary.status_entry("2", "1", "Progressing", 0, canary.steps_of({}), 1, 4, "m", weight=20, observed=0.198)
    metrics.canary_share("ns", "share-p", entry)
    metrics.canary_share("ns", "share-p", {**entry, "step": 2, "trafficShare": 0.25, "observedShare": None})
    assert value("specpair_canary_weight_percent") == {"1": 20.0, "2": 25.0}
    assert value("specpair_canary_observed_share") == {"1": 0.198}
    metrics.canary_share("ns", "share-p", None)          # a status write without a canary: nothing
    assert metrics.forget_pair("ns", "share-p") == 3 and value("specpair_canary_weight_percent") == {}


def kinds_of(steps):
    from plan_tables import kinds
    return kinds(steps)


# -- steps by weight, and what the share rests on (pure) --------------------------------------------

@pytest.mark.parametrize("step, champion_replicas, routed, replicas, weight", [
    (canary.Step(weight=20), 5, True, 1, 20),       # 20% of 5 pods' load: one pod
    (canary.Step(weight=50), 4, True, 2, 50),
    (canary.Step(weight=100), 3, True, 3, 100),
    (canary.Step(weight=5), 1, True, 1, 5),         # at least one pod
    (canary.Step(weight=20), 4, False, 1, 20),      # replica ratio 1 / (1 + 4)
    (canary.Step(weight=25), 1, False, 1, 25),      # ratio 50%: approximate
    (canary.Step(weight=100), 3, False, 3, 100),    # the ratio cannot pass 50% beside the champion
    (canary.Step(share=0.5), 2, False, 1, 33),      # the route's weight for a share step: its ratio
    (canary.Step(replicas=2), 2, True, 2, 50),
])
def test_a_weight_step_sizes_the_candidate_for_its_weight(step, champion_replicas, routed, replicas, weight):
    assert step.candidate_replicas(champion_replicas, routed=routed) == replicas
    assert step.candidate_weight(champion_replicas) == weight


def test_the_default_steps_are_the_crds():
    steps = canary.steps_of({"rollout": {}})
    assert [(s.weight, s.pause_seconds) for s in steps] == [(5, 60), (25, 60), (50, 60), (100, 60)]
    assert canary.steps_of({"rollout": {"strategy": {"steps": [{"replicas": 1}]}}}) == (canary.Step(1, None, 60.0),)


def test_the_status_says_what_the_share_rests_on():
    memory = canary.Memory()
    assert canary.observed_share(memory) is None
    routed = canary.status_entry("2", "1", "Progressing", 0, canary.steps_of({}), 1, 4, "m", weight=20, observed=0.198)
    assert (routed["trafficShare"], routed["weight"], routed["observedShare"]) == (0.2, 20, 0.198)
    assert routed["shareBasis"] == canary.SHARE_BY_WEIGHT
    ratio = canary.status_entry("2", "1", "Progressing", 0, canary.steps_of({}), 1, 4, "m", previous=routed)
    assert ratio["trafficShare"] == 0.2 and ratio["weight"] is None and ratio["observedShare"] is None
    assert ratio["shareBasis"].startswith("approximate: replica ratio")


# -- the strategy chosen by what changed (pure) -----------------------------------------------------

BASE = {"target": {"source": "default"}, "draft": {"drafter": "ngram"}, "speculation": {"k": 4}}


def release(image: str = "img:1", **blocks) -> dict:
    spec = {**{k: dict(v) for k, v in BASE.items()}, **blocks}
    return build_release("p", "ns", spec, [{"prompt": "hi"}], default_image=image)


@pytest.mark.parametrize("asked, candidate, expected", [
    (None, release(target={"source": "default", "revision": "r2"}), CANARY),
    (None, release(target={"source": "other"}), CANARY),
    # ... also with the draft side changed (the riskier change decides); the tokenizer comes with the target.
    (None, release(target={"source": "default", "revision": "r2"}, speculation={"k": 6}), CANARY),
    (None, release(image="img:2"), CANARY),                                   # the engine's image
    (None, release(engine="vllm", draft={"source": "tiny-draft"}), CANARY),    # the engine itself
    (None, release(speculation={"k": 6}), SHADOW),                            # draft side only
    (None, release(speculation={"k": 4, "fallbackThreshold": 0.2}), REPLACE),  # a serving setting
    # The user's explicit strategy wins.
    (REPLACE, release(target={"source": "other"}), REPLACE),
    (SHADOW, release(speculation={"k": 6}), SHADOW),
    (CANARY, release(speculation={"k": 6}), CANARY),
])
def test_the_strategy_follows_what_changed(asked, candidate, expected):
    spec = {"rollout": {"strategy": {"type": asked}}} if asked else {"rollout": {}}
    chosen = choose_strategy(spec, release(), candidate)
    assert chosen.type == expected, chosen
    assert chosen.refused is None
    if asked is None and expected == CANARY:
        assert chosen.reason.startswith("chosen automatically: the candidate changes")



def test_the_endpoint_stand_in_lists_the_ready_pods_of_a_selector_service():
    """devcluster gateway.endpoint_slice: what the EndpointSlice controller would write for pods
    with loopback IPs, as an FQDN slice (module docstring there)."""
    from specpair_devcluster.gateway import endpoint_slice

    service = routes.route_service("p", "ns", ROLLOUT, routes.CHAMPION, routes.SETTLED)
    service["metadata"]["uid"] = "u-1"

    def pod(name, ip, ready, labels=None):
        return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": labels or manifests.engine_selector("p")},
                "spec": {"containers": [{"name": "engine", "ports": [{"name": "grpc", "containerPort": 50051},
                                                                     {"name": "http", "containerPort": 8000}]}]},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
    got = endpoint_slice(service, [pod("a", "127.20.0.5", True), pod("b", "127.20.0.6", False),
                                   pod("c", "127.20.0.7", True, {"app": "other"})])
    assert got["addressType"] == "FQDN" and got["metadata"]["labels"]["kubernetes.io/service-name"] == "p-engine-champion"
    assert [e["addresses"] for e in got["endpoints"]] == [["127.20.0.5"]]
    assert {p["name"]: (p["port"], p["appProtocol"]) for p in got["ports"]} == {"grpc": (50051, routes.H2C),
                                                                                "http": (8000, "http")}
    assert endpoint_slice({**service, "spec": {**service["spec"], "selector": {}}}, []) is None


# -- through a real gateway on the devcluster -------------------------------------------------------

REQUESTS = 500
CANDIDATE_WEIGHT = 20
TOLERANCE = 0.03         # the issue's 3 points


class _Who(http.server.BaseHTTPRequestHandler):
    """A stand-in backend: answers every GET with its side's name, on one keep-alive connection."""
    protocol_version = "HTTP/1.1"
    side = ""

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = self.side.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class StandIn:
    """One side: an HTTP/1.1 server and a plaintext gRPC (h2c) server, each answering its name."""

    def __init__(self, side: str):
        import grpc

        handler = type(f"Who{side}", (_Who,), {"side": side})
        self.http = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            routes.GRPC_SERVICE, {"Who": grpc.unary_unary_rpc_method_handler(lambda req, ctx: side.encode())}),))
        self.grpc_port = self.grpc.add_insecure_port("127.0.0.1:0")
        self.grpc.start()
        self.http_port = self.http.server_address[1]

    def stop(self):
        self.http.shutdown()
        self.http.server_close()
        self.grpc.stop(0)


@pytest.fixture(scope="module")
def gateway(devcluster, tmp_path_factory):
    """Traefik on the session's devcluster (started once for this file)."""
    from specpair_devcluster.gateway import DevGateway

    gw = DevGateway(devcluster, tmp_path_factory.mktemp("gateway")).start()
    yield gw
    gw.stop()


def _stand_in_service(ns, name: str, side: StandIn) -> None:
    """A Service without a selector and the EndpointSlice its owner writes (as for any backend
    outside the cluster's pods), with the ports of the route Services the operator renders."""
    ports = {p["name"]: p for p in routes.route_service("p", ns.name, ROLLOUT, routes.CHAMPION, routes.SETTLED)
             ["spec"]["ports"]}
    ns.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
               "spec": {"ports": [{k: v for k, v in p.items() if k != "targetPort"} for p in ports.values()]}})
    ns.kube.request("POST", f"/apis/discovery.k8s.io/v1/namespaces/{ns.name}/endpointslices", body={
               "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": f"{name}-1", "labels": {"kubernetes.io/service-name": name}},
               # FQDN: the API server refuses a loopback address in an IPv4 slice (gateway.py).
               "addressType": "FQDN",
               "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
               "ports": [{"name": "http", "port": side.http_port, "protocol": "TCP", "appProtocol": "http"},
                         {"name": "grpc", "port": side.grpc_port, "protocol": "TCP", "appProtocol": routes.H2C}]})


def test_a_keep_alive_client_and_a_grpc_channel_split_by_the_routes_weight(gateway, ns):
    import grpc
    import requests as http_client

    from specpair_devcluster.processes import wait_until

    sides = {routes.CHAMPION: StandIn(routes.CHAMPION), routes.CANDIDATE: StandIn(routes.CANDIDATE)}
    try:
        gateway.gateway(ns.name)
        _stand_in_service(ns, routes.champion_side("p", routes.Traffic(CANDIDATE_WEIGHT, "1")), sides[routes.CHAMPION])
        _stand_in_service(ns, routes.candidate_service_name("p"), sides[routes.CANDIDATE])
        parent = routes.gateway_parent({"rollout": {"gateway": {"parentRef": {"name": "specpair"}}}})
        for route in routes.routes("p", ns.name, ROLLOUT, parent, routes.Traffic(CANDIDATE_WEIGHT, "1")):
            kind = {"HTTPRoute": "httproutes", "GRPCRoute": "grpcroutes"}[route["kind"]]
            route["metadata"]["namespace"] = ns.name
            ns.kube.request("POST", f"/apis/{routes.GATEWAY_API}/namespaces/{ns.name}/{kind}", body=route)

        session = http_client.Session()
        session.trust_env = False
        channel = grpc.insecure_channel(gateway.address)
        who = channel.unary_unary(f"/{routes.GRPC_SERVICE}/Who")

        def http_answers() -> bool:
            try:
                return session.get(gateway.url + "/v1/models", timeout=5).status_code == 200
            except http_client.RequestException:
                return False

        def grpc_answers() -> bool:
            try:
                return who(b"", timeout=5) in (b"champion", b"candidate")
            except grpc.RpcError:
                return False
        wait_until(http_answers, 60, interval=0.5, what="the HTTPRoute served through Traefik")
        wait_until(grpc_answers, 60, interval=0.5, what="the GRPCRoute served through Traefik")

        # One keep-alive connection, one gRPC channel (one HTTP/2 connection): the gateway splits
        # per request, so the connection's first backend does not decide.
        http_sides = [session.get(gateway.url + "/v1/models", timeout=10).text for _ in range(REQUESTS)]
        grpc_sides = [who(b"", timeout=10).decode() for _ in range(REQUESTS)]
        for client, got in (("keep-alive HTTP", http_sides), ("gRPC", grpc_sides)):
            share = got.count(routes.CANDIDATE) / len(got)
            print(f"{client}: candidate share {share:.3f} of {len(got)} requests at weight {CANDIDATE_WEIGHT}%; "
                  f"by replica ratio (1 candidate pod beside 4) the same client's one connection would put "
                  f"0% or 100% on the candidate")
            assert set(got) <= {routes.CHAMPION, routes.CANDIDATE}
            assert abs(share - CANDIDATE_WEIGHT / 100) <= TOLERANCE, (client, share)

        # The header picks a side by name, whatever the weight.
        for side in (routes.CANDIDATE, routes.CHAMPION):
            assert {session.get(gateway.url + "/v1/models", headers={routes.RELEASE_HEADER: side}, timeout=10).text
                    for _ in range(20)} == {side}
            assert {who(b"", metadata=((routes.RELEASE_HEADER, side),), timeout=10).decode()
                    for _ in range(20)} == {side}
        channel.close()
        session.close()
    finally:
        for side in sides.values():
            side.stop()


# -- the operator drives a canary through the real gateway ------------------------------------------

ROUTED_TOLERANCE = 0.03    # the issue's 3 points, over the requests sent while a weight held
SETTLE_S = 3.0             # a weight counts once the route held it this long (Traefik reloads on a watch)
SERVED_BY = "x-specpair-version"   # engine_standin.SERVED_BY: the version that answered


class RoutedClient:
    """One client through the gateway sending requests in a loop (a thread), no header: a gRPC
    channel calling Generate, or a keep-alive HTTP session posting /v1/completions (one
    connection, as an OpenAI client keeps it). Each answer's `x-specpair-version` (gRPC initial
    metadata, HTTP header) says which side served it, beside the candidate weight the live route
    of its kind held from SETTLE_S before the request until after it (None across a change).
    Every failure after the first answer is kept, whatever the weight."""

    def __init__(self, gateway, ns, pair: str, protocol: str):
        self.ns, self.pair, self.protocol = ns, pair, protocol
        self.plural = {"grpc": "grpcroutes", "http": "httproutes"}[protocol]
        self.url = gateway.url + "/v1/completions"
        if protocol == "grpc":
            import grpc

            from specpair._proto import engine_pb2_grpc
            self.channel = grpc.insecure_channel(gateway.address)
            self.stub = engine_pb2_grpc.EngineStub(self.channel)
        else:
            import requests as http_client
            self.session = http_client.Session()
            self.session.trust_env = False
        self.answers: list[tuple[int | None, str]] = []     # (weight held, version that served)
        self.failed: list[tuple[int | None, str]] = []     # (weight held, what failed)
        self.weight: int | None = None
        self.since = 0.0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._watch, daemon=True),
                        threading.Thread(target=self._send, daemon=True)]
        for t in self.threads:
            t.start()

    def _watch(self) -> None:
        import time
        while not self.stop.is_set():
            route = self.ns.get(routes.GATEWAY_API, self.plural, routes.route_name(self.pair))
            split = routes.weights(route)
            weight = split.get(routes.candidate_service_name(self.pair), 0) if route else None
            if weight != self.weight:
                self.weight, self.since = weight, time.monotonic()
            self.stop.wait(0.2)

    def held(self) -> int | None:
        import time
        return self.weight if time.monotonic() - self.since >= SETTLE_S else None

    def _call(self) -> str:
        """One request through the gateway: the version that served it (raises on a failure)."""
        if self.protocol == "grpc":
            from specpair._proto import engine_pb2
            call = self.stub.Generate(engine_pb2.GenerateRequest(prompt="def f():", max_new_tokens=8,
                                                                 category="code"), timeout=30)
            served = dict(call.initial_metadata()).get(SERVED_BY, "?")
            for _ in call:
                pass
            return served
        reply = self.session.post(self.url, json={"model": self.pair, "prompt": "def f():", "max_tokens": 8,
                                                  "metadata": {"category": "code"}}, timeout=30)
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
        return reply.headers.get(SERVED_BY, "?")

    def _send(self) -> None:
        while not self.stop.is_set():
            before = self.held()
            try:
                served = self._call()
            except Exception as exc:   # noqa: BLE001 - every failure is the test's finding
                if self.answers:       # the route served once: from then on a failure counts
                    self.failed.append((before, f"{type(exc).__name__}: {str(exc)[:300]}"))
                self.stop.wait(0.2)
                continue
            after = self.held()
            self.answers.append((before if before == after else None, served))
            self.stop.wait(0.01)

    def share(self, weight: int, candidate: str) -> tuple[float, int]:
        got = [served for held, served in self.answers if held == weight]
        return (got.count(candidate) / len(got) if got else float("nan")), len(got)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(35)
        if self.protocol == "grpc":
            self.channel.close()
        else:
            self.session.close()


def test_the_operator_runs_a_canary_by_the_routes_weight_through_the_gateway(gateway, env, world):
    """The operator (real Kopf, the chart's RBAC) on the devcluster with Traefik in front: v1
    serves through the routes it owns; v2 (a new target revision) runs its canary at 20% and then
    100% by the routes' weight, judged on the counters of the requests one gRPC channel and one
    keep-alive HTTP connection sent through the gateway, and is promoted, the routes ending on
    every engine pod again; v3 (slow to its first token) is aborted at 20% and the routes go back
    to v2 alone. At 20% the candidate's share of each client's requests is within 3 points (a
    replica ratio would give it 0% or 100%: one connection stays on one pod). No request through
    the gateway fails at all, across both promotions' and the abort's pods going away: each
    stopping pod still serves, unready, for its stop delay while the endpoints and Traefik drop it
    (rollout.shutdown, desired/pod_shutdown.py)."""
    import time

    from kopf.testing import KopfRunner

    from cluster_env import OPERATOR, pair, serving, set_spec

    ns = env
    world.data.update({"_serving_counters": True, "_first_token_seconds": {"3": 1.0}})
    world.save()
    gateway.mirror.namespaces.append(ns.name)
    gateway.gateway(ns.name)
    name = "routed"
    # Latency judged from 10 requests a side; the stand-in answers in well under a millisecond, so
    # a scheduling hiccup on this shared machine must not read as a breach: 20x the champion's p95.
    # Acceptance is left out (drift.minDraftedTokens above what the test drafts): the stand-in's
    # sums carry no per-request spread, and at 100% the champion's sample is the step before's.
    drift = {"enabled": False, "minDraftedTokens": 10**9,
             "latency": {"minRequests": 10, "ttftP95Ratio": 20.0, "tpotP95Ratio": 20.0}}
    gw = {"parentRef": {"name": "specpair"}}
    # 20% held long enough for each client's 30 requests at load ~40 (4 s gave the gRPC one 28).
    steps = [{"weight": 20, "pauseSeconds": 10}, {"weight": 100, "pauseSeconds": 2}]
    clients: list[RoutedClient] = []
    began = time.monotonic()
    try:
        with KopfRunner(OPERATOR, timeout=60) as runner:
            ns.create(pair(name, "good-draft", drift=drift, rollout={"gateway": gw}))
            ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)
            print(f"v1 serving in {time.monotonic() - began:.0f} s")
            began = time.monotonic()
            clients = [RoutedClient(gateway, ns, name, "grpc"), RoutedClient(gateway, ns, name, "http")]
            ns.wait_for("v1 answering through the gateway (gRPC and HTTP)",
                        lambda: all(any(s == "1" for _, s in c.answers) for c in clients), timeout=60)

            set_spec(ns, name, {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "r2"},
                                "rollout": {"gateway": gw, "strategy": {"type": "Canary", "steps": steps}}})
            ns.wait_for("v2 promoted and the routes on every engine pod", lambda: serving(ns, name, "2") and
                        routes.weights(ns.get(routes.GATEWAY_API, "grpcroutes", routes.route_name(name))) ==
                        {routes.champion_service_name(name): 1}, timeout=240)
            for client in clients:
                share, n = client.share(20, "2")
                print(f"v2 at weight 20%: candidate share {share:.3f} of {n} requests on one {client.protocol} "
                      f"connection; at 100%: {client.share(100, '2')}", flush=True)
                assert n >= 30 and abs(share - 0.20) <= ROUTED_TOLERANCE, (client.protocol, share, n)
                # At 100% the champion is out of the split; a gateway slower than SETTLE_S to reload
                # (load ~36 here) answered 1 of 622 from the champion once: within the same bound.
                assert client.share(100, "2")[0] >= 1 - ROUTED_TOLERANCE, (client.protocol, client.share(100, "2"))
            print(f"v1 to v2 promoted in {time.monotonic() - began:.0f} s")
            began = time.monotonic()
            entry = ns.pair(name)["status"]["canary"]
            assert entry["phase"] == "Promoted" and entry["shareBasis"] == canary.SHARE_BY_WEIGHT, entry
            routed_events = [e["message"] for e in ns.events("TrafficRouted")]
            assert any("-engine-candidate 20%" in m for m in routed_events), routed_events
            assert any("-engine-candidate 100%" in m for m in routed_events), routed_events

            set_spec(ns, name, {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "r3"},
                                "rollout": {"gateway": gw, "strategy": {"type": "Canary", "steps": [steps[0]]}}})
            ns.wait_for("v3 aborted and the routes on v2 alone", lambda: (
                ((ns.pair(name).get("status") or {}).get("canary") or {}).get("phase") == "Aborted" and
                routes.weights(ns.get(routes.GATEWAY_API, "grpcroutes", routes.route_name(name))) in (
                    {routes.version_service_name(name, "2"): 1}, {routes.champion_service_name(name): 1})),
                timeout=240)
            status = ns.pair(name)["status"]
            entry = status["canary"]
            assert entry["version"] == "3" and entry["judged"]["ttft:*"]["verdict"] == "breach", entry
            assert status["servingVersion"] == "2", status
            print(f"v3 aborted in {time.monotonic() - began:.0f} s")
            for client in clients:
                assert client.share(20, "3")[1] >= 1, f"v3's pods never served {client.protocol} through the route"
        assert runner.exception is None
        # No request failed at all: pods went away (v1's after the promotion, the canaries' after
        # the promotion and the abort) while requests kept coming, each serving through its stop
        # delay (before rollout.shutdown, 2 and 14 gRPC requests failed in two runs).
        for client in clients:
            print(f"{client.protocol}: {len(client.answers)} answered, failed through the gateway: {client.failed}")
        assert not [(c.protocol, c.failed) for c in clients if c.failed]
    finally:
        for client in clients:
            client.close()
        gateway.mirror.namespaces.remove(ns.name)
