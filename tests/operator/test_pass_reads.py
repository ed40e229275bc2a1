"""What a settled pair's pass takes from its last full pass (clients/read_cache.py): the rule as a
table, then the clients on the real API server and real MLflow, then the real operator: a settled
pair's passes between full ones ask the API server for its pods only and MLflow for nothing,
and a Service deleted by hand is put back (its watch wakes the pair's pass: clients/pod_watch.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from specpair_operator.clients.read_cache import (CURRENT, CachingKube, PassReads, RememberingRegistry,
                                                  replays)


def reads(fetched_at: float = 100.0, generation: int = 3) -> PassReads:
    return PassReads(fetched_at=fetched_at, generation=generation)


@pytest.mark.parametrize("why, settled, woken, recorded, generation, now, expected", [
    ("settled, woken by nothing, read 5 s ago", True, False, reads(), 3, 105.0, True),
    ("in motion: every step reads what it acts on", False, False, reads(), 3, 105.0, False),
    ("a watch woke it (its Deployment or a Job changed)", True, True, reads(), 3, 105.0, False),
    ("no full pass yet (an operator just started)", True, False, None, 3, 105.0, False),
    ("another generation than the one read for", True, False, reads(), 4, 105.0, False),
    ("read a resync ago: the backstop", True, False, reads(), 3, 160.0, False),
    ("just inside the backstop", True, False, reads(), 3, 159.9, True),
])
def test_a_pass_replays_only_when_settled_unwoken_and_within_the_backstop(why, settled, woken, recorded,
                                                                            generation, now, expected):
    assert replays(settled, woken, recorded, generation, now, 60.0) is expected, why


# -- the clients on real servers ---------------------------------------------------------------------

def _operators_kube() -> CachingKube:
    """The operator's client, logged in as handlers.login logs in: the chart's ServiceAccount."""
    import kopf
    return CachingKube.from_connection_info(kopf.login_with_kubeconfig(settings=kopf.OperatorSettings()))


async def _in_pass(recorded: PassReads, fn):
    token = CURRENT.set(recorded)
    try:
        return await fn()
    finally:
        CURRENT.reset(token)


def _policy(name: str, namespace: str, app: str) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name, "namespace": namespace},
            "spec": {"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"], "ingress": []}}


def test_the_kube_client_replays_what_stands_still_and_drops_what_it_writes(operator_env, ns):
    """On the real API server, as the chart's ServiceAccount: a full pass records a
    NetworkPolicy it reads; a settled pass answers from the record (a change made behind it is
    not seen until the next full pass); the pass's own write drops the record, so it reads its
    write back; pods are listed every time; outside a pass nothing is recorded."""
    async def scenario() -> None:
        kube = _operators_kube()
        try:
            name = f"np-{uuid.uuid4().hex[:5]}"
            await kube.create(_policy(name, ns.name, "one"))
            full = PassReads(time.monotonic(), 1)
            first = await _in_pass(full, lambda: kube.get("networking.k8s.io/v1", "networkpolicies", ns.name, name))
            assert first["spec"]["podSelector"]["matchLabels"] == {"app": "one"}
            ns.kube.patch("networking.k8s.io/v1", "networkpolicies", ns.name, name,
                          {"spec": {"podSelector": {"matchLabels": {"app": "two"}}}})

            full.replaying = True
            again = await _in_pass(full, lambda: kube.get("networking.k8s.io/v1", "networkpolicies", ns.name, name))
            assert again["spec"]["podSelector"]["matchLabels"] == {"app": "one"} and full.asked_replaying == {}
            await _in_pass(full, lambda: kube.list("v1", "pods", ns.name))
            assert full.asked_replaying == {"list pods": 1}

            await _in_pass(full, lambda: kube.merge_patch("networking.k8s.io/v1", "networkpolicies", ns.name, name,
                                                          {"spec": {"podSelector": {"matchLabels": {"app": "three"}}}}))
            written = await _in_pass(full, lambda: kube.get("networking.k8s.io/v1", "networkpolicies", ns.name, name))
            assert written["spec"]["podSelector"]["matchLabels"] == {"app": "three"}
            # Read back from the server, or from the namespace's watch once it shows the write
            # (clients/pod_watch.py; tests/operator/test_watch_reads.py): never the record.
            assert full.asked_replaying.get("networkpolicies", 0) + full.from_watch >= 1
            assert set(full.asked_replaying) <= {"list pods", "networkpolicies"}

            ns.kube.patch("networking.k8s.io/v1", "networkpolicies", ns.name, name,
                          {"spec": {"podSelector": {"matchLabels": {"app": "four"}}}})
            fresh = PassReads(time.monotonic(), 1)

            async def seen_by_a_full_pass() -> bool:
                got = await _in_pass(fresh, lambda: kube.get("networking.k8s.io/v1", "networkpolicies", ns.name, name))
                return got["spec"]["podSelector"]["matchLabels"] == {"app": "four"}
            # A full pass reads it from the namespace's watch: as soon as the watch delivers the edit.
            deadline = time.monotonic() + 30
            while not await seen_by_a_full_pass():
                assert time.monotonic() < deadline, "a full pass never saw the edit"
                await asyncio.sleep(0.1)
            assert (await kube.get("networking.k8s.io/v1", "networkpolicies", ns.name, name)) is not None
        finally:
            await kube.close()

    asyncio.run(scenario())


def _engine_pod(name: str, pair: str, role: str = "engine") -> dict:
    # Never scheduled (no scheduler has that name): the API object is all the watch sees.
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {
        "specpair.io/pair": pair, "specpair.io/role": role}},
            "spec": {"schedulerName": "no-such-scheduler",
                     "containers": [{"name": "engine", "image": "specpair/engine:none"}]}}


def test_the_pod_watch_answers_a_settled_pass_once_synced_and_follows_changes(operator_env, ns):
    """On the real API server, as the chart's ServiceAccount (its list and watch of pods): the
    pod watch answers nothing until its first list is in (the caller lists), then the engine pods
    of the pair asked about, following creations, label changes and deletions without a request
    per question; other selectors and other pods it leaves to a LIST."""
    from specpair_operator.clients.pod_watch import PodWatch

    async def scenario() -> None:
        kube = _operators_kube()
        watch = PodWatch(kube, watch_timeout_s=5)   # the API server ends each watch after 5 s: resumed
        selector = "specpair.io/pair=a,specpair.io/role=engine"

        async def names(sel: str = selector) -> set[str] | None:
            got = watch.pods(ns.name, sel)
            return None if got is None else {p["metadata"]["name"] for p in got}

        async def until(what: str, check, timeout: float = 30.0):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if await check():
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(f"timed out waiting for {what}")

        try:
            ns.create(_engine_pod("a-1", "a"))
            ns.create(_engine_pod("gate-a", "a", role="gate"))
            assert await names() is None                      # the first question starts the watch
            await until("the first list in", lambda: names())
            assert await names() == {"a-1"}
            ns.create(_engine_pod("a-2", "a"))
            ns.create(_engine_pod("b-1", "b"))
            await until("a-2 seen", lambda: _eq(names(), {"a-1", "a-2"}))
            await asyncio.sleep(6)                            # past one watch's end: resumed, not listed again
            ns.kube.delete("v1", "Pod", ns.name, "a-1")
            await until("a-1 gone", lambda: _eq(names(), {"a-2"}))
            ns.kube.patch("v1", "pods", ns.name, "a-2", {"metadata": {"labels": {"specpair.io/pair": "b"}}})
            await until("a-2 moved to pair b", lambda: _eq(names(), set()))
            assert await names("specpair.io/pair=b,specpair.io/role=engine") == {"a-2", "b-1"}
            assert watch.pods(ns.name, "specpair.io/pair in (a,b),specpair.io/role=engine") is None
            assert watch.pods(ns.name, "specpair.io/pair=a,specpair.io/role=gate") is None
        finally:
            await watch.close()
            await kube.close()

    asyncio.run(scenario())


async def _eq(got, expected) -> bool:
    return (await got) == expected


def test_the_registry_view_replays_tags_and_aliases_and_reads_its_writes(mlflow_server):
    """On a real MLflow server: a settled pass's view answers the aliases and tags the full
    pass read, without a request; a tag it writes is read back from MLflow; the ownership check
    is not asked again."""
    from specpair_operator.clients.registry import ReleaseRegistry

    registry = ReleaseRegistry(mlflow_server.url)
    model = f"replay-{uuid.uuid4().hex[:6]}"
    registry.ensure_model(model, "ns/pair", "uid-1")
    version = registry.client.create_model_version(model, "s3://specpair-test/none", tags={"a": "1"}).version
    registry.set_alias(model, "champion", version)

    recorded = PassReads(time.monotonic(), 1)
    full = RememberingRegistry(registry, recorded)
    full.ensure_model(model, "ns/pair", "uid-1")
    assert full.aliases(model) == {"champion": str(version)} and full.version_tags(model, version)["a"] == "1"
    full.keep()

    registry.client.set_model_version_tag(model, str(version), "a", "edited by hand")
    recorded.replaying = True
    settled = RememberingRegistry(registry, recorded)
    settled.ensure_model(model, "ns/pair", "uid-1")
    assert settled.aliases(model) == {"champion": str(version)}
    assert settled.version_tags(model, version)["a"] == "1" and recorded.asked_replaying == {}
    settled.set_tags(model, version, {"b": "2"})
    tags = settled.version_tags(model, version)
    assert tags["a"] == "edited by hand" and tags["b"] == "2" and recorded.asked_replaying == {"mlflow": 1}
    settled.keep()
    assert recorded.tags[(model, str(version))]["b"] == "2"


# -- the operator ---------------------------------------------------------------------------------

def test_a_settled_pairs_passes_ask_for_counters_only_judge_drift_and_the_backstop_restores_a_service(env, monkeypatch):
    """The real operator under the chart's RBAC, real MLflow: once a pair serves, its passes at
    the drift interval (1 s here) between full ones (the resync backstop, 6 s here) ask the API
    server for nothing (its pods come from the pod watch), MLflow for nothing and its engine pod
    for its counters only, at most once a pass, and still judge drift every window; a Service
    deleted by hand is made again (its watch wakes a full pass; the backstop would too)."""
    from kopf.testing import KopfRunner

    from cluster_env import OPERATOR, REPLACE, pair, serving
    from specpair_operator.desired import manifests
    from specpair_operator.state import STATE

    monkeypatch.setenv("SPECPAIR_RESYNC_INTERVAL", "6")
    ns = env
    name = f"calm-{uuid.uuid4().hex[:5]}"
    with KopfRunner(OPERATOR, timeout=60) as runner:
        obj = ns.create(pair(name, "good-draft", rollout=REPLACE, drift={"intervalSeconds": 1}))
        uid = obj["metadata"]["uid"]
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)
        checked = ns.wait_for("a drift check", lambda: STATE.last_drift_check.get(uid), timeout=30)
        # The first settled pass starts the namespace's pod watch, and lists while it syncs.
        reads = ns.wait_for("three settled passes on one full pass's reads, the pods from the watch", lambda: (
            r := STATE.pass_reads.get(uid)) and r.replayed >= 3 and r.pods_from_watch >= 3 and r, timeout=60)
        asked = dict(reads.asked_replaying)
        assert set(asked) <= {"GetStats", "list pods"} and asked.get("list pods", 0) <= 1, asked
        assert 1 <= asked.get("GetStats", 0) <= reads.replayed, (asked, reads.replayed)
        ns.wait_for("drift judged again on settled passes", lambda: STATE.last_drift_check.get(uid, 0) > checked,
                    timeout=30)

        service = manifests.engine_name(name)
        ns.kube.delete("v1", "Service", ns.name, service)
        assert ns.get("v1", "Service", service) is None
        ns.wait_for("the Service made again", lambda: ns.get("v1", "Service", service), timeout=30)
    assert runner.exception is None
