"""Passes read the operator's children from watches (clients/pod_watch.py, issue 54): the
read-your-writes rule as tables, then the operator's client on the real API server as the chart's
ServiceAccount: a pass's GETs of Deployments, Services, NetworkPolicies, HPAs and KEDA's
ScaledObjects and its LIST of engine pods are answered by watches (present and absent), a pass
reads its own write back at once, and a Service or an autoscaler deleted by hand is heard (the
callback that wakes its pair)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from specpair_operator.clients.pod_watch import (GONE, WRITTEN_MARK_S, NamespaceObjects, Written, equality_selector,
                                                 mark_cleared)
from specpair_operator.clients.read_cache import CURRENT, CachingKube, PassReads


@pytest.mark.parametrize("why, mark, event, version, age, cleared", [
    ("the watch shows the write's version", Written("12", 0.0), "MODIFIED", "12", 1.0, True),
    ("an event from before the write", Written("12", 0.0), "MODIFIED", "11", 1.0, False),
    ("a create's ADDED event", Written("7", 0.0), "ADDED", "7", 0.5, True),
    ("a delete: its DELETED event", Written(GONE, 0.0), "DELETED", "15", 1.0, True),
    ("a delete: a change before it", Written(GONE, 0.0), "MODIFIED", "14", 1.0, False),
    ("a write whose answer was lost: any event of the name", Written("", 0.0), "MODIFIED", "9", 1.0, True),
    ("never shown: dropped after WRITTEN_MARK_S", Written("12", 0.0), "MODIFIED", "11", WRITTEN_MARK_S, True),
])
def test_a_write_is_seen_on_the_watch_by_its_version(why, mark, event, version, age, cleared):
    assert mark_cleared(mark, event, version, age) is cleared, why


def _obj(name: str, version: str) -> dict:
    return {"metadata": {"name": name, "resourceVersion": version}}


def test_a_namespace_cache_answers_once_listed_and_not_for_a_write_it_has_not_seen():
    kept = NamespaceObjects()
    assert not kept.answers("svc", 0.0)                       # not listed yet: the caller GETs
    kept.listed([_obj("svc", "5")], "5", started=0.0)
    assert kept.answers("svc", 1.0) and kept.answers("absent", 1.0)

    kept.mark("svc", "8", now=2.0)                            # the operator patched it: version 8
    assert not kept.answers("svc", 2.5) and kept.answers("other", 2.5)
    kept.apply({"type": "MODIFIED", "object": _obj("svc", "7")}, now=3.0)   # someone's edit before ours
    assert not kept.answers("svc", 3.0)
    kept.apply({"type": "MODIFIED", "object": _obj("svc", "8")}, now=3.5)
    assert kept.answers("svc", 3.5) and kept.objects["svc"]["metadata"]["resourceVersion"] == "8"

    kept.mark("svc", "8", now=4.0)                            # a create answered by what is held: no mark
    assert kept.answers("svc", 4.0)
    kept.mark("gone", GONE, now=4.0)                          # a delete of what is not there: no mark
    assert kept.answers("gone", 4.0)

    kept.mark("svc", GONE, now=5.0)
    assert not kept.answers("svc", 5.0)
    kept.apply({"type": "DELETED", "object": _obj("svc", "9")}, now=5.5)
    assert kept.answers("svc", 5.5) and "svc" not in kept.objects and kept.resource_version == "9"

    kept.mark("late", "20", now=6.0)
    assert not kept.answers("late", 6.0 + WRITTEN_MARK_S - 0.1)
    assert kept.answers("late", 6.0 + WRITTEN_MARK_S)         # never seen: dropped, answered again
    kept.mark("relisted", "30", now=7.0)
    kept.listed([_obj("relisted", "30")], "30", started=7.5)  # a list begun after the write holds it
    assert kept.answers("relisted", 8.0)


def test_a_cache_holds_objects_without_their_managed_fields():
    """Who set which field (server-side apply) is most of a Deployment's bytes and the operator
    never reads it: a cache holds objects without it, listed or watched, and leaves the rest."""
    managed = [{"manager": "kube-controller-manager", "operation": "Update", "fieldsV1": {"f:status": {}}}]

    def obj(name: str, version: str) -> dict:
        return {"metadata": {"name": name, "resourceVersion": version, "labels": {"a": "b"}, "managedFields": managed},
                "spec": {"replicas": 1}}
    kept = NamespaceObjects()
    listed = obj("listed", "5")
    kept.listed([listed], "5", started=0.0)
    kept.apply({"type": "ADDED", "object": obj("watched", "6")}, now=1.0)
    for name, version in (("listed", "5"), ("watched", "6")):
        assert kept.objects[name] == {"metadata": {"name": name, "resourceVersion": version, "labels": {"a": "b"}},
                                      "spec": {"replicas": 1}}
    assert listed["metadata"]["managedFields"] == managed          # what the server sent is left as it was


@pytest.mark.parametrize("selector, labels", [
    ("specpair.io/pair=a,specpair.io/role=engine", {"specpair.io/pair": "a", "specpair.io/role": "engine"}),
    ("a==b", None), ("a!=b", None), ("a in (b)", None), ("a", None), ("=b", None),
])
def test_only_equality_selectors_are_answered(selector, labels):
    assert equality_selector(selector) == labels


@pytest.mark.parametrize("why, plural, event, owner_kind, wakes", [
    ("a Service deleted by hand", "services", "DELETED", "SpecModelPair", True),
    ("a NetworkPolicy edited by hand", "networkpolicies", "MODIFIED", "SpecModelPair", True),
    ("the operator's own creation", "services", "ADDED", "SpecModelPair", False),
    ("a Deployment: Kopf's watch wakes it (on_owned_event)", "deployments", "DELETED", "SpecModelPair", False),
    ("a Service someone else owns", "services", "DELETED", "Application", False),
    ("an HPA deleted by hand", "horizontalpodautoscalers", "DELETED", "SpecModelPair", True),
    ("a ScaledObject deleted by hand", "scaledobjects", "DELETED", "SpecModelPair", True),
    ("an HPA's status written by its controller", "horizontalpodautoscalers", "MODIFIED", "SpecModelPair", False),
    ("a ScaledObject's status written by KEDA", "scaledobjects", "MODIFIED", "SpecModelPair", False),
])
def test_a_hand_edit_of_a_pairs_service_or_policy_or_a_deleted_autoscaler_wakes_its_pass(why, plural, event, owner_kind, wakes, monkeypatch):
    from specpair_operator import handlers
    from specpair_operator.state import STATE
    monkeypatch.setattr(STATE, "bodies", {"uid-a": {}})
    monkeypatch.setattr(STATE, "woken", set())
    obj = {"metadata": {"name": "a-engine", "ownerReferences": [{"kind": owner_kind, "uid": "uid-a"}]}}
    handlers.wake_owner(plural, event, obj)
    assert (STATE.woken == {"uid-a"}) is wakes, why
    handlers.wake_owner(plural, event, {"metadata": {"ownerReferences": [{"kind": "SpecModelPair", "uid": "gone"}]}})
    assert STATE.woken <= {"uid-a"}                           # a pair the operator does not know: nothing


# -- the operator's client on the real API server ----------------------------------------------------

def _operators_kube() -> CachingKube:
    """The operator's client, logged in as handlers.login logs in: the chart's ServiceAccount."""
    import kopf
    return CachingKube.from_connection_info(kopf.login_with_kubeconfig(settings=kopf.OperatorSettings()))


def _counting_kube() -> tuple[CachingKube, list[tuple[str, str, str]], list[str]]:
    """The operator's client with what its watches hear (plural, event, name) and each request it
    makes ("METHOD path") counted; the real request is made."""
    kube = _operators_kube()
    heard: list[tuple[str, str, str]] = []
    kube.on_change = lambda plural, kind, obj: heard.append((plural, kind, obj["metadata"]["name"]))
    asked: list[str] = []
    real_request = kube._request

    async def counted(method, path, **kw):
        asked.append(f"{method} {path}")
        return await real_request(method, path, **kw)
    kube._request = counted     # type: ignore[method-assign]
    return kube, heard, asked


def _service(name: str, namespace: str, app: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"app": app}, "ports": [{"name": "grpc", "port": 50051}]}}


def _policy(name: str, namespace: str, app: str) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"], "ingress": []}}


async def _until(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_pass_reads_services_policies_and_pods_from_watches_and_its_own_writes_at_once(operator_env, ns):
    """As the chart's ServiceAccount (its list and watch of Services, NetworkPolicies, pods): once
    a namespace's watches are in, a full pass's GETs (present and absent) and its LIST of engine
    pods ask the API server nothing; a change made behind the operator is seen through the
    watch; the pass's own patch is read back at once (never the object from before it); a
    Service deleted by hand is heard, and read as absent."""
    async def scenario() -> None:
        kube, heard, asked = _counting_kube()
        try:
            name = f"w-{uuid.uuid4().hex[:5]}"
            await kube.create(_service(name, ns.name, "one"))      # outside a pass: made before any watch
            await kube.create(_policy(name, ns.name, "one"))
            full = PassReads(time.monotonic(), 1)

            async def in_pass(fn):
                token = CURRENT.set(full)
                try:
                    return await fn()
                finally:
                    CURRENT.reset(token)

            async def service():
                return await in_pass(lambda: kube.get("v1", "services", ns.name, name))

            async def policy():
                return await in_pass(lambda: kube.get("networking.k8s.io/v1", "networkpolicies", ns.name, name))

            async def canary():
                return await in_pass(lambda: kube.get("apps/v1", "deployments", ns.name, f"{name}-canary"))

            async def pods():
                return await in_pass(lambda: kube.list("v1", "pods", ns.name, f"specpair.io/pair={name},specpair.io/role=engine"))

            # The first questions start the watches and are answered by the API server meanwhile.
            assert (await service())["spec"]["selector"] == {"app": "one"}
            assert (await policy()) is not None and (await canary()) is None and await pods() == []
            await _until("the watches in", lambda: _all_synced(kube, ns.name))
            asked.clear()
            before = full.from_watch, full.pods_from_watch
            assert (await service())["spec"]["selector"] == {"app": "one"}
            assert (await policy())["spec"]["podSelector"]["matchLabels"] == {"app": "one"}
            assert (await canary()) is None and await pods() == []
            assert (full.from_watch - before[0], full.pods_from_watch - before[1]) == (3, 1)
            assert asked == [], asked

            ns.kube.patch("networking.k8s.io/v1", "networkpolicies", ns.name, name,
                          {"spec": {"podSelector": {"matchLabels": {"app": "two"}}}})
            await _until("a change behind the operator", lambda: _eq(policy(), "two"))
            await in_pass(lambda: kube.merge_patch("networking.k8s.io/v1", "networkpolicies", ns.name, name,
                                                   {"spec": {"podSelector": {"matchLabels": {"app": "three"}}}}))
            # At once: from the API server until the watch shows the write, then from the watch.
            assert (await policy())["spec"]["podSelector"]["matchLabels"] == {"app": "three"}
            await _until("the write on the watch", lambda: _watch_answers(kube, "networkpolicies", ns.name, name))
            asked.clear()
            assert (await policy())["spec"]["podSelector"]["matchLabels"] == {"app": "three"} and asked == []

            ns.kube.delete("v1", "Service", ns.name, name)
            await _until("the deletion heard", lambda: _true(("services", "DELETED", name) in heard))
            asked.clear()
            assert (await service()) is None and asked == []
        finally:
            await kube.close()

    asyncio.run(scenario())


async def _all_synced(kube: CachingKube, namespace: str) -> bool:
    watches = [kube.pod_watch] + [kube.named_watch(p) for p in ("deployments", "services", "networkpolicies")]
    return all(w is not None and namespace in w.namespaces and w.namespaces[namespace].synced for w in watches)


async def _watch_answers(kube: CachingKube, plural: str, namespace: str, name: str) -> bool:
    watch = kube.named_watch(plural)
    return watch is not None and watch.namespaces[namespace].answers(name, time.monotonic())


async def _eq(got, app: str) -> bool:
    obj = await got
    return obj is not None and obj["spec"]["podSelector"]["matchLabels"] == {"app": app}


async def _true(value: bool) -> bool:
    return value


def _autoscaler(pair: str, namespace: str, keda: bool) -> dict:
    """The autoscaler the operator would write for an autoscaled pair (plan_autoscaler)."""
    from specpair_operator.desired import autoscaling
    spec = {"rollout": {"autoscaling": {"minReplicas": 1, "maxReplicas": 3, "metric": "queueLength", "target": 4}}}
    plan = autoscaling.plan_autoscaler(spec, pair, namespace, keda=keda, default_prometheus="http://prometheus:9090")
    assert plan.desired is not None, plan
    return plan.desired


def test_a_pass_reads_autoscalers_from_watches(operator_env, ns):
    """As the chart's ServiceAccount (its list and watch of HPAs and ScaledObjects): every full
    pass asks for the pair's autoscaler of each kind, present or not (plan_autoscaler deletes a
    leftover one); once the namespace's watches are in, those GETs ask the API server nothing. A
    ScaledObject the pass creates is read back at once; an HPA deleted by hand is heard and read
    as absent. KEDA's kind is watched only while its CRD is installed: removed, the watch's list
    fails and a GET asks the API server again."""
    from autoscaler_scenario import SO, install_keda_crd, remove_keda_crd
    from specpair_operator.desired.manifests import engine_name

    async def scenario() -> None:
        kube, heard, asked = _counting_kube()
        full = PassReads(time.monotonic(), 1)

        async def in_pass(fn):
            token = CURRENT.set(full)
            try:
                return await fn()
            finally:
                CURRENT.reset(token)

        def hpa(name):
            return in_pass(lambda: kube.get("autoscaling/v2", "horizontalpodautoscalers", ns.name, name))

        def scaled_object(name):
            return in_pass(lambda: kube.get(SO[0], SO[1], ns.name, name))

        try:
            pair, bare = f"a-{uuid.uuid4().hex[:5]}", f"b-{uuid.uuid4().hex[:5]}"
            await kube.create(_autoscaler(pair, ns.name, keda=False))     # outside a pass
            assert (await hpa(engine_name(pair)))["spec"]["maxReplicas"] == 3    # starts the watch
            await _until("the HPA watch in", lambda: _synced(kube, "horizontalpodautoscalers", ns.name))
            asked.clear()
            before = full.from_watch
            assert (await hpa(engine_name(pair)))["spec"]["maxReplicas"] == 3
            assert (await hpa(engine_name(bare))) is None                   # absent: answered too
            assert full.from_watch - before == 2 and asked == [], asked

            install_keda_crd(ns.kube)
            assert (await scaled_object(engine_name(pair))) is None         # starts the watch
            await _until("the ScaledObject watch in", lambda: _synced(kube, "scaledobjects", ns.name))
            await in_pass(lambda: kube.create(_autoscaler(pair, ns.name, keda=True)))
            # At once: from the API server until the watch shows the create, then from the watch.
            assert (await scaled_object(engine_name(pair)))["spec"]["maxReplicaCount"] == 3
            await _until("the create on the watch",
                         lambda: _watch_answers(kube, "scaledobjects", ns.name, engine_name(pair)))
            asked.clear()
            assert (await scaled_object(engine_name(pair)))["spec"]["maxReplicaCount"] == 3 and asked == []

            ns.kube.delete("autoscaling/v2", "horizontalpodautoscalers", ns.name, engine_name(pair))
            await _until("the HPA's deletion heard",
                         lambda: _true(("horizontalpodautoscalers", "DELETED", engine_name(pair)) in heard))
            asked.clear()
            assert (await hpa(engine_name(pair))) is None and asked == []

            remove_keda_crd(ns.kube)
            await _until("the ScaledObject watch out of sync",
                         lambda: _true(not kube.named_watch("scaledobjects").namespaces[ns.name].synced))
            asked.clear()
            assert (await scaled_object(engine_name(pair))) is None and asked, "asked the API server"
        finally:
            await kube.close()
            remove_keda_crd(ns.kube)

    asyncio.run(scenario())


async def _synced(kube: CachingKube, plural: str, namespace: str) -> bool:
    watch = kube.named_watch(plural)
    return watch is not None and namespace in watch.namespaces and watch.namespaces[namespace].synced
