"""The API emulator's own behaviour, over HTTP, where it differs from plain kmock."""

import json

import aiohttp
import pytest

from kube_emulator import KubeEmulator, json_patch, labels_match, parse_label_selector
from standins import CRD


PAIR = {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair",
        "metadata": {"name": "p", "namespace": "ns", "labels": {"team": "a"}},
        "spec": {"target": {"source": "default"}, "draft": {"drafter": "ngram"}},
        "status": {"phase": "Hacked"}}
BASE = "/apis/specpair.io/v1alpha1/namespaces/ns/specmodelpairs"


@pytest.fixture
async def api():
    emu = KubeEmulator()
    emu.load_crd(str(CRD))
    url = await emu.start()
    async with aiohttp.ClientSession(url) as session:
        yield emu, session
    await emu.stop()


async def test_discovery_reports_core_v1_namespaces_and_status_subresources(api):
    _, s = api
    assert (await (await s.get("/api")).json())["versions"] == ["v1"]
    core = await (await s.get("/api/v1")).json()
    assert {"namespaces", "pods", "pods/status"} <= {r["name"] for r in core["resources"]}
    r = await s.get("/api/v1/namespaces")
    assert r.status == 200 and (await r.json())["items"] == []
    groups = {g["name"] for g in (await (await s.get("/apis")).json())["groups"]}
    assert {"specpair.io", "apps", "batch"} <= groups
    res = await (await s.get("/apis/specpair.io/v1alpha1")).json()
    smp = next(r for r in res["resources"] if r["name"] == "specmodelpairs")
    assert smp["shortNames"] == ["smp"] and smp["namespaced"]
    assert "specmodelpairs/status" in {r["name"] for r in res["resources"]}


async def test_create_assigns_identity_defaults_and_drops_status(api):
    _, s = api
    r = await s.post(BASE, json=PAIR)
    assert r.status == 201
    obj = await r.json()
    meta = obj["metadata"]
    assert meta["uid"] and meta["generation"] == 1 and meta["creationTimestamp"] and int(meta["resourceVersion"]) > 0
    assert "status" not in obj
    assert obj["spec"]["speculation"] == {"k": 4, "dynamicK": True, "fallbackThreshold": 0.5, "batchSizeThreshold": 8}
    assert obj["spec"]["drift"]["ladder"] == ["SpeculationOff", "Rollback"]
    r = await s.post(BASE, json=PAIR)
    assert r.status == 409 and (await r.json())["reason"] == "AlreadyExists"
    assert (await s.get(BASE + "/nope")).status == 404


async def test_status_is_a_separate_subresource_and_generation_tracks_spec(api):
    _, s = api
    created = await (await s.post(BASE, json=PAIR)).json()
    merge = {"Content-Type": "application/merge-patch+json"}
    r = await s.patch(BASE + "/p", data=json.dumps({"status": {"phase": "X"}, "metadata": {"annotations": {"a": "b"}}}),
                      headers=merge)
    obj = await r.json()
    assert "status" not in obj and obj["metadata"]["annotations"] == {"a": "b"} and obj["metadata"]["generation"] == 1
    obj = await (await s.patch(BASE + "/p/status", data=json.dumps({"status": {"phase": "Serving"}, "spec": {"x": 1}}),
                               headers=merge)).json()
    assert obj["status"] == {"phase": "Serving"} and "x" not in obj["spec"] and obj["metadata"]["generation"] == 1
    obj = await (await s.patch(BASE + "/p", data=json.dumps({"spec": {"speculation": {"k": 6}}}), headers=merge)).json()
    assert obj["metadata"]["generation"] == 2 and obj["status"] == {"phase": "Serving"}
    assert int(obj["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    # JSON patch with a stale resourceVersion test is refused (Kopf relies on this).
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": created["metadata"]["resourceVersion"]},
             {"op": "add", "path": "/metadata/labels/x", "value": "y"}]
    r = await s.patch(BASE + "/p", data=json.dumps(stale), headers={"Content-Type": "application/json-patch+json"})
    assert r.status == 422
    # PUT with a stale resourceVersion conflicts.
    body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": created["metadata"]["resourceVersion"]}}
    assert (await s.put(BASE + "/p", json=body)).status == 409


async def test_watch_from_list_version_loses_nothing_and_filters_labels(api):
    emu, s = api
    listing = await (await s.get(BASE)).json()
    rv = listing["metadata"]["resourceVersion"]
    await s.post(BASE, json=PAIR)  # happens between the list and the watch
    other = {**PAIR, "metadata": {"name": "q", "namespace": "ns", "labels": {"team": "b"}}}
    await s.post(BASE, json=other)
    seen = []
    async with s.get(BASE, params={"watch": "true", "resourceVersion": rv, "labelSelector": "team in (a)",
                                   "timeoutSeconds": "1"}) as r:
        async for line in r.content:
            seen.append(json.loads(line))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in seen] == [("ADDED", "p")]
    items = (await (await s.get(BASE, params={"labelSelector": "team!=a"})).json())["items"]
    assert [i["metadata"]["name"] for i in items] == ["q"]


async def test_delete_honours_finalizers_and_cascades_to_owned_objects(api):
    _, s = api
    pair = await (await s.post(BASE, json={**PAIR, "metadata": {**PAIR["metadata"], "finalizers": ["f"]}})).json()
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {
        "name": "d", "namespace": "ns", "ownerReferences": [{"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair",
                                                             "name": "p", "uid": pair["metadata"]["uid"]}]}, "spec": {}}
    assert (await s.post("/apis/apps/v1/namespaces/ns/deployments", json=dep)).status == 201
    obj = await (await s.delete(BASE + "/p")).json()
    assert obj["metadata"]["deletionTimestamp"]
    assert (await s.get("/apis/apps/v1/namespaces/ns/deployments/d")).status == 200
    r = await s.patch(BASE + "/p", data=json.dumps({"metadata": {"finalizers": None}}),
                      headers={"Content-Type": "application/merge-patch+json"})
    assert r.status == 200
    assert (await s.get(BASE + "/p")).status == 404
    assert (await s.get("/apis/apps/v1/namespaces/ns/deployments/d")).status == 404


def test_selector_and_json_patch_units():
    sel = parse_label_selector("a=1,b!=2,c in (x, y),!d,e")
    assert labels_match({"a": "1", "c": "y", "e": ""}, sel)
    assert not labels_match({"a": "1", "c": "z", "e": ""}, sel)
    assert not labels_match({"a": "1", "c": "x", "d": "", "e": ""}, sel)
    doc = json_patch({"a": {"b": [1, 2]}}, [{"op": "add", "path": "/a/b/-", "value": 3},
                                            {"op": "replace", "path": "/a/b/0", "value": 0},
                                            {"op": "remove", "path": "/a/b/1"}])
    assert doc == {"a": {"b": [0, 3]}}
