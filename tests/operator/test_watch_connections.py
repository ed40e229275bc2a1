"""The operator keeps a watch per namespace and kind (clients/pod_watch.py: 6 kinds), each holding
its connection for minutes. On the requests' own aiohttp session (at most 100 connections) 17
namespaces of pairs left no connection for a request: every GET, PATCH and LIST waited for one
until its timeout, and bench/operator_scale.py's operator stopped bringing pairs up at ~860 of
1,000 (20 namespaces; 2026-12-07f). Watches now stream on a session of their own. On the real
API server, as the chart's ServiceAccount: with 110 watches open, a request is still answered."""

from __future__ import annotations

import asyncio

import aiohttp

WATCHES = 110       # past aiohttp's default cap of 100 connections a session


def test_requests_are_answered_while_more_watches_are_open_than_a_sessions_connection_cap(operator_env, ns):
    import kopf

    from specpair_operator.clients.kube import Kube

    async def scenario() -> None:
        kube = Kube.from_connection_info(kopf.login_with_kubeconfig(settings=kopf.OperatorSettings()))
        # A request that finds no connection fails after this long (not the default 30 s).
        kube.timeout = aiohttp.ClientTimeout(total=20)
        _, version = await kube.list_versioned("v1", "pods", ns.name)
        seen: set[int] = set()

        async def hold(i: int) -> None:
            async for event in kube.watch("v1", "pods", ns.name, version, timeout_s=300):
                if event.get("type") == "ADDED":
                    seen.add(i)

        watches = [asyncio.create_task(hold(i)) for i in range(WATCHES)]
        try:
            # A pod that never runs (held by a scheduling gate): every open watch reports it.
            await asyncio.to_thread(ns.create, {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "held"},
                "spec": {"schedulingGates": [{"name": "specpair.io/test-held"}],
                         "containers": [{"name": "main", "image": "never-pulled"}]}})
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 120
            while len(seen) < 100 and loop.time() < deadline:
                await asyncio.sleep(0.2)
            assert len(seen) >= 100, f"only {len(seen)} watches saw the pod"
            # More than 100 streams are open (or waiting for a connection): a request is answered.
            # (The chart grants the operator list and watch on pods, not get.)
            got = await kube.list("v1", "pods", ns.name)
            assert [p["metadata"]["name"] for p in got] == ["held"]
            while len(seen) < WATCHES and loop.time() < deadline:
                await asyncio.sleep(0.2)
            assert len(seen) == WATCHES, f"{WATCHES - len(seen)} watches never connected"
            assert not any(w.done() for w in watches), [w.exception() for w in watches if w.done()]
        finally:
            for w in watches:
                w.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
            await kube.close()

    asyncio.run(scenario())
