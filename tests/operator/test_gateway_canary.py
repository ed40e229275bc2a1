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
        named = [r for r in route["spec"]["rules"] if r.get("matches")]
        assert [m["matches"][0]["headers"][0]["value"] for m in named] == [routes.CHAMPION]
        assert all(ref["port"] == port for r in route["spec"]["rules"] for ref in r["backendRefs"])


@pytest.mark.parametrize("weight", [0, 5, 20, 100])
def test_during_a_canary_the_routes_weigh_champion_and_candidate(weight):
    objs = by_kind(routes.desired("p", "ns", ROLLOUT, PARENT, routes.Traffic(weight, "3")))
    champion, candidate = objs["Service/p-engine-champion"], objs["Service/p-engine-candidate"]
    # The champion's Service is pinned to its version, so the canary's pods (another version) stay out.
    assert champion["spec"]["selector"] == {**manifests.engine_selector("p"), manifests.LABEL_VERSION: "3"}
    assert candidate["spec"]["selector"] == {**manifests.engine_selector("p"), canary.TRACK_LABEL: canary.CANARY_TRACK}
    for kind in ("HTTPRoute", "GRPCRoute"):
        route = objs[kind]
        assert routes.weights(route) == {"p-engine-champion": 100 - weight, "p-engine-candidate": weight}
        sides = {r["matches"][0]["headers"][0]["value"]: r["backendRefs"][0]["name"]
                 for r in route["spec"]["rules"] if r.get("matches")}
        assert sides == {routes.CANDIDATE: "p-engine-candidate", routes.CHAMPION: "p-engine-champion"}
        for rule in route["spec"]["rules"]:
            for match in rule.get("matches", []):
                assert match["headers"][0] == {"type": "Exact", "name": "x-specpair-release",
                                                "value": match["headers"][0]["value"]}
                assert ("path" in match) == (kind == "HTTPRoute")


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
    assert selects(objs["Service/p-engine-champion"], champion)
    assert not selects(objs["Service/p-engine-champion"], candidate)
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
