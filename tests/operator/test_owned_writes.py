"""The one writer's create-or-patch and delete (act/owned.py) on the real API server, as the
chart's ServiceAccount: a pair's object is deleted only while the pair owns it, and only the
object that was read (a uid precondition), so an object of the same name the pair does not own,
or one made again since, is left."""

from __future__ import annotations

import asyncio

from specpair_operator.desired.ownership import ABSENT, CONFLICT, CREATED, DELETED, UNCHANGED

HPA = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
       "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                "minReplicas": 1, "maxReplicas": 2}}


HPAS = "horizontalpodautoscalers"   # the test client's path names a kind it has no table entry for by its plural


def hpa(name: str, namespace: str) -> dict:
    return {**HPA, "metadata": {"name": name, "namespace": namespace}}


def test_delete_owned_deletes_only_the_pairs_own_object_it_read(operator_env, ns):
    import kopf

    from specpair_operator.act.owned import delete_owned, ensure_owned
    from specpair_operator.clients.kube import Kube

    # The owner: any object with a uid (the garbage collector keeps what it owns while it exists).
    owner = ns.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}, "data": {}})
    stranger = ns.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "stranger"}, "data": {}})

    async def scenario() -> None:
        kube = Kube.from_connection_info(kopf.login_with_kubeconfig(settings=kopf.OperatorSettings()))
        made = await ensure_owned(kube, owner, hpa("mine", ns.name))
        assert made.outcome == CREATED and ns.get("autoscaling/v2", HPAS, "mine") is not None
        gone = await delete_owned(kube, owner, hpa("mine", ns.name))
        assert (gone.outcome, gone.live["metadata"]["uid"]) == (DELETED, made.live["metadata"]["uid"])
        assert ns.get("autoscaling/v2", HPAS, "mine") is None
        assert (await delete_owned(kube, owner, hpa("mine", ns.name))).outcome == ABSENT

        # Another owner's object of the name: never touched.
        await ensure_owned(kube, stranger, hpa("theirs", ns.name))
        assert (await delete_owned(kube, owner, hpa("theirs", ns.name))).outcome == CONFLICT
        assert ns.get("autoscaling/v2", HPAS, "theirs") is not None

        # Read, then made again under the name (a new uid) before the delete: the new one stays.
        first = (await ensure_owned(kube, owner, hpa("again", ns.name))).live
        assert await kube.delete("autoscaling/v2", "horizontalpodautoscalers", ns.name, "again",
                                 first["metadata"]["uid"])
        second = (await ensure_owned(kube, owner, hpa("again", ns.name))).live
        assert second["metadata"]["uid"] != first["metadata"]["uid"]
        stale = await delete_owned(kube, owner, hpa("again", ns.name), live=first)
        assert stale.outcome == UNCHANGED
        left = ns.get("autoscaling/v2", HPAS, "again")
        assert left is not None and left["metadata"]["uid"] == second["metadata"]["uid"]

    asyncio.run(scenario())
