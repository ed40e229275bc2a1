"""Pairs too large for the annotations that carry them (issue 54): 10,000 golden prompts, or one
of 1 MiB, made Kopf's last-handled-configuration annotation exceed the 256 KiB an object's
annotations may hold, and the API server answered 422 in a loop. The CRD bounds the prompts, the
operator bounds the whole spec (validation.MAX_SPEC_BYTES) with the reason, and Kopf's copy of a
large spec is kept as a digest (handlers.BoundedDiffBaseStorage), so the refusal is written.
Decisions as tables, then the real API server with the chart's RBAC and real Kopf.
"""

from __future__ import annotations

import time
import uuid

import kopf
import pytest
from kopf.testing import KopfRunner

from cluster_env import OPERATOR, cond, crd_yaml, pair
from specpair_operator import handlers
from specpair_operator.crd.validation import MAX_SPEC_BYTES, validate_spec

BASE = {"target": {"source": "default"}, "draft": {"drafter": "ngram"}}
TEN_THOUSAND = [{"prompt": f"def f{i}(x):", "category": "code"} for i in range(10_000)]
ONE_MIB = [{"prompt": "x" * (1 << 20), "category": "code"}]
# Each prompt and their number within the CRD's bounds, the whole well above MAX_SPEC_BYTES (and
# above the 256 KiB of annotations an object may hold).
MANY_LONG = [{"prompt": f"{i:04d} " + "y" * 295, "category": "code"} for i in range(1000)]


def gating(prompts: list[dict]) -> dict:
    return {**BASE, "gating": {"prompts": prompts}}


@pytest.mark.parametrize("prompts, says", [
    (TEN_THOUSAND, "spec.gating.prompts: Too many: 10000: must have at most 1000 items"),
    (ONE_MIB, "spec.gating.prompts[0].prompt: Too long: may not be more than 32768 bytes"),
    (MANY_LONG, "spec: Too long: the spec is 332082 bytes serialized (332001 of them inline golden prompts)"),
])
def test_prompts_too_large_for_the_annotations_are_refused_with_the_reason(prompts, says):
    errors = validate_spec(gating(prompts))
    assert any(e.startswith(says) for e in errors), [e[:200] for e in errors]
    if prompts is MANY_LONG:
        assert f"at most {MAX_SPEC_BYTES}" in errors[0] and "256 KiB" in errors[0]


def test_a_spec_of_many_short_prompts_fits():
    assert validate_spec(gating([{"prompt": f"def f{i}(x):", "category": "code"} for i in range(1000)])) == []


def test_the_crd_states_the_operators_bound():
    prompts = crd_yaml()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["gating"]["properties"]["prompts"]
    assert f"{MAX_SPEC_BYTES // 1024} KiB" in " ".join(prompts["description"].split())


def _body(spec: dict, annotations: dict | None = None) -> kopf.Body:
    return kopf.Body({"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair",
                      "metadata": {"name": "p", "namespace": "ns", "annotations": dict(annotations or {})},
                      "spec": spec})


def test_kopfs_copy_of_a_large_spec_is_a_digest_that_still_tells_a_change():
    storage = handlers.BoundedDiffBaseStorage(prefix="specpair.io", key="last-handled-configuration")
    large, small = gating(MANY_LONG), BASE
    patch = kopf.Patch()
    storage.store(body=_body(large), patch=patch, essence=storage.build(body=_body(large)))
    written = dict(patch["metadata"]["annotations"])
    assert sum(len(v) for v in written.values()) < 200
    assert storage.fetch(body=_body(large, written)) == storage.build(body=_body(large, written))  # no change
    changed = {**large, "speculation": {"k": 3}}
    assert storage.fetch(body=_body(changed, written)) == {}                                       # a change
    patch = kopf.Patch()
    storage.store(body=_body(small), patch=patch, essence=storage.build(body=_body(small)))
    assert storage.fetch(body=_body(small, dict(patch["metadata"]["annotations"]))) == {"spec": small}


@pytest.mark.parametrize("prompts", [TEN_THOUSAND, ONE_MIB], ids=["10000-prompts", "1MiB-prompt"])
def test_the_api_server_refuses_the_issues_pairs_in_the_operators_words(env, prompts):
    ns = env
    bad = pair("huge", "good-draft")
    bad["spec"]["gating"]["prompts"] = prompts
    ns.assert_refused_in_the_operators_words(bad)
    assert ns.pair("huge") == {}


@pytest.mark.slow
def test_a_spec_too_large_for_annotations_is_stalled_with_the_reason_and_no_422_loop(env):
    """Past the CRD's per-prompt bounds: 1,000 prompts of 300 characters (330 kB of spec). The
    status says why (InvalidSpec, the size and the limit), nothing is created, and Kopf's writes
    are not refused: no 422 in its log across several passes."""
    ns = env
    name = f"large-{uuid.uuid4().hex[:5]}"
    big = pair(name, "good-draft")
    big["spec"]["gating"]["prompts"] = MANY_LONG
    with KopfRunner(OPERATOR, timeout=60) as runner:
        ns.create(big)
        obj = ns.wait_for("the size refusal in the status", lambda: (o := ns.pair(name))
                          and cond(o, "Stalled").get("reason") == "InvalidSpec" and o, timeout=60)
        message = cond(obj, "Stalled")["message"]
        assert "spec: Too long: the spec is" in message and f"at most {MAX_SPEC_BYTES}" in message, message
        assert cond(obj, "Ready")["status"] == "False" and cond(obj, "Reconciling")["status"] == "False"
        time.sleep(3)   # several passes, and Kopf's own handling of the change
        annotations = ns.pair(name)["metadata"].get("annotations") or {}
        assert handlers.DIFFBASE_DIGEST in annotations.get("specpair.io/last-handled-configuration", "")
        assert not ns.list("batch/v1", "Job") and not ns.list("apps/v1", "Deployment")
    assert runner.exception is None
    assert "422" not in runner.stdout and "Unprocessable" not in runner.stdout, runner.stdout[-3000:]
