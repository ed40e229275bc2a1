"""The pair's Gateway API routes, when it names a Gateway (`spec.rollout.gateway.parentRef`). Pure.

Why: behind one Service a canary's share is its pods over all pods (policy/canary.py), which
holds only while every request picks a pod afresh. A gRPC channel or a keep-alive HTTP client
stays on the pod it first reached, so one busy client puts 0% or 100% of its requests on the
candidate whatever the replica ratio says. A gateway splits per request by `backendRefs` weights.

What the operator owns for such a pair (all named from the engine's name, owned by the pair):
- `<engine>-champion`, a Service selecting every engine pod of the pair: the champion's side
  while no canary pod is about (a Replace rolling between versions stays served);
- `<engine>-v<version>`, a Service selecting only the champion's release version
  (`specpair.io/release-version`): the champion's side while canary pods are about, so they stay
  out of it. One Service per version rather than one whose selector changes: the operator only
  creates Services (RBAC grants no patch on them), so a Service's selector never changes;
- `<engine>-candidate`, a Service selecting the canary's pods (`specpair.io/track: canary`),
  while a candidate is in canary;
- an `HTTPRoute` (the OpenAI-compatible HTTP port, when the engine has one) and a `GRPCRoute`
  (the gRPC port; our engine only) named `<engine>`, attached to the Gateway, each with:
    1. `x-specpair-release: candidate` -> the candidate (only while there is one),
    2. `x-specpair-release: champion`  -> the champion,
    3. everything else -> champion and candidate by weight (percent), or the champion alone.
  A header match outranks a rule without one (Gateway API's precedence), so a client asking for
  a side by name gets that side at any weight: for A/B comparisons and debugging a release by hand.

Services before routes: a gateway answers 500 for a route whose Service has no endpoints yet
(Traefik: "endpointslices not found" for a second or two after the Service appears). So the Service
of a version is made before any route names it (`keep`: the champion's version while settled, the
candidate's version during its canary, ready for its promotion), and a live route is switched to a
Service only once that Service is SERVICE_SETTLE_SECONDS old (`pending`).

Which Gateway: the pair's `rollout.gateway.parentRef`, else the chart's default (values.yaml
`gateway.parentRef`, the operator's $SPECPAIR_DEFAULT_GATEWAY), else none. A pair that names no
Gateway any more (nor the chart) has its routes and route Services deleted (`unwanted`); so has a
route Service no longer wanted once no live route sends to it (an old champion's `-v<version>`
after a promotion, the candidate's after its canary), never `<engine>-champion` while a Gateway is
named (the settled routes' backend: made again at each canary's end, a new Service's endpoints
would lag the route that names it).

The route Services name their gRPC port's protocol as Gateway API asks (GEP-1911):
`kubernetes.io/h2c` for plaintext gRPC (the engine Service's own `grpc` is an IANA name that
gateways do not all read), `https` when the serving ports speak TLS.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from specpair_operator.crd import names
from specpair_operator.desired import engine_objects, manifests

GATEWAY_GROUP = "gateway.networking.k8s.io"
GATEWAY_API = f"{GATEWAY_GROUP}/v1"
RELEASE_HEADER = "x-specpair-release"
CANDIDATE, CHAMPION = "candidate", "champion"
# The gRPC service the engine serves (protos/specpair/engine/v1/engine.proto). The GRPCRoute matches
# it by name: a GRPCRoute matching everything on the listener the HTTPRoute shares would also take
# the plain HTTP requests (Traefik ranks the two catch-alls alike and sent an OpenAI request to the
# gRPC server, which answered INTERNAL_ERROR).
GRPC_SERVICE = "specpair.engine.v1.Engine"
# And the HTTPRoute matches the OpenAI-compatible API's paths only, for the same reason the other way:
# a header rule matching every path took gRPC calls carrying the header to the HTTP port.
HTTP_PATH = "/v1"
ROUTED = "Routed"        # the pair's condition: its routes as written, or why none are
H2C = "kubernetes.io/h2c"
# The canary's pods carry this label (policy/canary.canary_deployment); the candidate's Service
# selects by it. Here, below policy, so that both read one home.
TRACK_LABEL = "specpair.io/track"
CANARY_TRACK = "canary"
# How old a Service must be before a live route is switched to it: its endpoints written by the
# EndpointSlice controller and read by the gateway (module docstring).
SERVICE_SETTLE_SECONDS = 5.0


# The chart's gateway.parentRef as JSON (charts/specpair/templates/deployment.yaml): the Gateway of
# every pair that names none.
DEFAULT_GATEWAY_ENV = "SPECPAIR_DEFAULT_GATEWAY"


def default_gateway(env: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The installation's default parentRef ($SPECPAIR_DEFAULT_GATEWAY), or None when unset."""
    raw = (env.get(DEFAULT_GATEWAY_ENV) or "").strip()
    if not raw:
        return None
    try:
        ref = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{DEFAULT_GATEWAY_ENV} must be a JSON parentRef (the chart's gateway.parentRef): {exc}") from exc
    if not isinstance(ref, dict) or (ref and not isinstance(ref.get("name"), str)):
        raise ValueError(f"{DEFAULT_GATEWAY_ENV} must be a JSON object with a name (the chart's gateway.parentRef), "
                         f"not {raw[:200]}")
    return ref or None


def gateway_parent(spec: Mapping[str, Any], default: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """spec.rollout.gateway.parentRef (name, optional namespace and sectionName), else the chart's
    `default`, or None."""
    ref = ((spec.get("rollout") or {}).get("gateway") or {}).get("parentRef") or {}
    if not ref.get("name"):
        ref = default or {}
    if not ref.get("name"):
        return None
    out = {"group": GATEWAY_GROUP, "kind": "Gateway", "name": str(ref["name"])}
    for key in ("namespace", "sectionName"):
        if ref.get(key):
            out[key] = str(ref[key])
    return out


@dataclass(frozen=True)
class Traffic:
    """Where the routes send requests. `candidate_weight`: the candidate's percent of the unnamed
    requests during a canary (0-100), None when no candidate is in canary; `champion_version`:
    the release the champion's side is pinned to while canary pods are about (its own Service,
    `<engine>-v<version>`; None: `<engine>-champion`, every engine pod)."""

    candidate_weight: int | None = None
    champion_version: str | None = None

    def __post_init__(self) -> None:
        if self.candidate_weight is not None and not 0 <= self.candidate_weight <= 100:
            raise ValueError(f"a candidate weight is a percent (0-100), not {self.candidate_weight}")
        if self.candidate_weight is not None and not self.champion_version:
            raise ValueError("a canary's routes pin the champion's version (champion_version)")


SETTLED = Traffic()


def champion_service_name(pair: str) -> str:
    return names.object_name(pair, "engine-champion")


def candidate_service_name(pair: str) -> str:
    return names.object_name(pair, "engine-candidate")


def version_service_name(pair: str, version: str) -> str:
    return names.object_name(pair, f"engine-v{version}")


def champion_side(pair: str, traffic: Traffic) -> str:
    """The Service the champion's share goes to: pinned to its version, or every engine pod."""
    if traffic.champion_version:
        return version_service_name(pair, traffic.champion_version)
    return champion_service_name(pair)


def route_name(pair: str) -> str:
    return manifests.engine_name(pair)


def _ports(rollout: Mapping[str, Any], kind: str) -> tuple[int | None, int | None]:
    """(gRPC port, HTTP port) the engine serves requests on (None: not served)."""
    http_port = int(rollout.get("httpPort", manifests.HTTP_PORT))
    if kind == "vllm":
        return None, http_port or manifests.HTTP_PORT
    return int(rollout.get("port", 50051)), http_port or None


def route_service(pair: str, namespace: str, rollout: Mapping[str, Any], side: str, traffic: Traffic,
                  kind: str = "specpair") -> dict[str, Any]:
    """The Service a route sends `side`'s requests to (module docstring)."""
    selector = dict(manifests.engine_selector(pair))
    if side == CANDIDATE:
        selector[TRACK_LABEL] = CANARY_TRACK
        name = candidate_service_name(pair)
    else:
        if traffic.champion_version:
            selector[manifests.LABEL_VERSION] = str(traffic.champion_version)
        name = champion_side(pair, traffic)
    grpc_port, http_port = _ports(rollout, kind)
    tls = engine_objects.serving_tls(dict(rollout))
    ports = []
    if grpc_port:
        ports.append({"name": "grpc", "port": grpc_port, "targetPort": "grpc", "protocol": "TCP",
                      "appProtocol": "https" if tls else H2C})
    if http_port:
        ports.append({"name": "http", "port": http_port, "targetPort": "http", "protocol": "TCP",
                      "appProtocol": "https" if tls else "http"})
    labels = {**manifests.engine_selector(pair), TRACK_LABEL: side, "app.kubernetes.io/managed-by": "specpair-operator"}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"selector": selector, "ports": ports}}


def _backend(name: str, port: int, weight: int | None = None) -> dict[str, Any]:
    ref: dict[str, Any] = {"group": "", "kind": "Service", "name": name, "port": port}
    if weight is not None:
        ref["weight"] = weight
    return ref


def _rules(pair: str, port: int, traffic: Traffic, http: bool) -> list[dict[str, Any]]:
    champion, candidate = champion_side(pair, traffic), candidate_service_name(pair)

    def where(side: str | None) -> dict[str, Any]:
        match: dict[str, Any] = ({"path": {"type": "PathPrefix", "value": HTTP_PATH}} if http else
                                 {"method": {"type": "Exact", "service": GRPC_SERVICE}})
        if side:
            match["headers"] = [{"type": "Exact", "name": RELEASE_HEADER, "value": side}]
        return match

    def named(side: str, service: str) -> dict[str, Any]:
        return {"matches": [where(side)], "backendRefs": [_backend(service, port)]}

    rules = []
    if traffic.candidate_weight is not None:
        rules.append(named(CANDIDATE, candidate))
    rules.append(named(CHAMPION, champion))
    unnamed = {"matches": [where(None)]}
    if traffic.candidate_weight is None:
        rules.append({**unnamed, "backendRefs": [_backend(champion, port)]})
    else:
        # A side at 0% is left out rather than given weight 0: no gateway can send it a request
        # then, whatever it makes of a zero weight (or of the moment it reloads).
        split = [(champion, 100 - traffic.candidate_weight), (candidate, traffic.candidate_weight)]
        rules.append({**unnamed, "backendRefs": [_backend(name, port, w) for name, w in split if w > 0]})
    return rules


def routes(pair: str, namespace: str, rollout: Mapping[str, Any], parent: Mapping[str, Any], traffic: Traffic,
           kind: str = "specpair") -> list[dict[str, Any]]:
    """The HTTPRoute and GRPCRoute (each when the engine serves that port) for `traffic`."""
    grpc_port, http_port = _ports(rollout, kind)
    meta = {"name": route_name(pair), "namespace": namespace,
            "labels": {**manifests.engine_selector(pair), "app.kubernetes.io/managed-by": "specpair-operator"}}
    out = []
    if http_port:
        out.append({"apiVersion": GATEWAY_API, "kind": "HTTPRoute", "metadata": dict(meta),
                    "spec": {"parentRefs": [dict(parent)], "rules": _rules(pair, http_port, traffic, True)}})
    if grpc_port:
        out.append({"apiVersion": GATEWAY_API, "kind": "GRPCRoute", "metadata": dict(meta),
                    "spec": {"parentRefs": [dict(parent)], "rules": _rules(pair, grpc_port, traffic, False)}})
    return out


def desired(pair: str, namespace: str, rollout: Mapping[str, Any], parent: Mapping[str, Any] | None,
            traffic: Traffic, kind: str = "specpair", keep: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Everything the pair owns for its Gateway: the route Services (the candidate's only during a
    canary; and the version Services of `keep`, made before a route names them) and the routes;
    nothing when it names no Gateway."""
    if parent is None:
        return []
    services = [route_service(pair, namespace, rollout, CHAMPION, traffic, kind)]
    if traffic.candidate_weight is not None:
        services.append(route_service(pair, namespace, rollout, CANDIDATE, traffic, kind))
    named = {s["metadata"]["name"] for s in services}
    for version in keep:
        pinned = Traffic(0, str(version))
        if version_service_name(pair, str(version)) not in named:
            services.append(route_service(pair, namespace, rollout, CHAMPION, pinned, kind))
            named.add(version_service_name(pair, str(version)))
    return [*services, *routes(pair, namespace, rollout, parent, traffic, kind)]


def _created(obj: Mapping[str, Any]) -> datetime.datetime | None:
    stamp = (obj.get("metadata") or {}).get("creationTimestamp")
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None


def pending(wanted: Iterable[Mapping[str, Any]], live: Mapping[str, Mapping[str, Any] | None], now: str) -> list[str]:
    """The Services the `wanted` routes send to that are absent or younger than
    SERVICE_SETTLE_SECONDS at `now` (ISO time): a live route is not switched to them yet."""
    at = datetime.datetime.fromisoformat(now.replace("Z", "+00:00"))
    out = []
    for name in sorted(sent_to({key(o): o for o in wanted if o["kind"] != "Service"})):
        service = live.get(f"Service/{name}")
        created = _created(service) if service else None
        if created is None or (at - created).total_seconds() < SERVICE_SETTLE_SECONDS:
            out.append(name)
    return out


def weights(route: Mapping[str, Any] | None) -> dict[str, int]:
    """The unnamed requests' split a live route says: {service: weight} of its rule matching no header."""
    for rule in ((route or {}).get("spec") or {}).get("rules") or []:
        if not any(m.get("headers") for m in rule.get("matches") or []):
            refs = rule.get("backendRefs") or []
            return {r["name"]: int(r.get("weight", 1)) for r in refs}
    return {}


def describe(split: Mapping[str, int]) -> str:
    """A route's split in words: 'p-engine-v1 95%, p-engine-candidate 5%' (none: 'none')."""
    total = sum(split.values())
    if not total:
        return "none"
    return ", ".join(f"{name} {round(100 * w / total)}%" for name, w in split.items())


def observed_keys(pair: str, champion: str | None) -> list[tuple[str, str, str, str]]:
    """(apiVersion, plural, kind, name) of every object `desired` may write for the pair while
    `champion` is the champion: what a pass reads before it plans them (observe/reads.py)."""
    out = [(GATEWAY_API, "httproutes", "HTTPRoute", route_name(pair)),
           (GATEWAY_API, "grpcroutes", "GRPCRoute", route_name(pair)),
           ("v1", "services", "Service", champion_service_name(pair)),
           ("v1", "services", "Service", candidate_service_name(pair))]
    if champion:
        out.append(("v1", "services", "Service", version_service_name(pair, champion)))
    return out


def key(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def route_services_selector(pair: str) -> str:
    """The label selector of every route Service of the pair, whatever its version (`route_service`)."""
    engine = ",".join(f"{k}={v}" for k, v in manifests.engine_selector(pair).items())
    return f"{engine},{TRACK_LABEL} in ({CHAMPION},{CANDIDATE})"


def sent_to(live: Mapping[str, Mapping[str, Any] | None]) -> set[str]:
    """The Services the live routes (among `live`, keyed by `key`) send any request to."""
    return {ref["name"] for k, obj in live.items() if obj and not k.startswith("Service/")
            for rule in (obj.get("spec") or {}).get("rules") or [] for ref in rule.get("backendRefs") or []}


def unwanted(pair: str, wanted: Iterable[Mapping[str, Any]], live: Mapping[str, Mapping[str, Any] | None],
             gateway_named: bool) -> list[Mapping[str, Any]]:
    """The live objects (keyed by `key`) of the pair's routes to delete (module docstring): all of
    them when no Gateway is named; else route Services `wanted` leaves out that no live route
    sends to, `<engine>-champion` kept."""
    if not gateway_named:
        # The routes first: a gateway never reads a route naming a Service already gone.
        return sorted((obj for obj in live.values() if obj), key=lambda obj: obj["kind"] == "Service")
    keep = {key(o) for o in wanted} | {f"Service/{champion_service_name(pair)}"}
    used = sent_to(live)
    return [obj for k, obj in live.items() if obj and k.startswith("Service/") and k not in keep
            and obj["metadata"]["name"] not in used]


def routed_before(status: Mapping[str, Any]) -> bool:
    """The pair's status says routes were written (its Routed condition True): a pass reads them
    even when no Gateway is named any more, to remove them."""
    return any(c.get("type") == ROUTED and c.get("status") == "True" for c in status.get("conditions") or [])
