"""The engine Deployment is rendered once a pass (serving_steps.rendered_engine): observe's
rollout question (rollout_state) and the plan (plan_serving) ask for the same Deployment from the
same values, and its rendering and fingerprints were the largest part of a settled pass at 335
pairs. These tables check that the second ask reuses the first's render, that a world whose
values changed in between is rendered afresh, and that a caller's edits to its Deployment (as
ensure_owned stamps and adopts it) never reach another caller."""

from __future__ import annotations

import dataclasses

import pytest

import test_operator_serving_plan as tables
from specpair_operator.desired import ownership as owned
from specpair_operator.plan import serving_plan as sp
from specpair_operator.plan import serving_steps


@pytest.fixture
def renders(monkeypatch):
    """How many times the pass really rendered the engine Deployment (the real renderer, counted)."""
    calls = []
    real = serving_steps._engine_deployment

    def counted(w, served):
        calls.append(w.pair)
        return real(w, served)

    monkeypatch.setattr(serving_steps, "_engine_deployment", counted)
    return calls


def a_pass(w):
    """As a pass runs: observe asks the rollout question, reads the pods (a new world made by
    replace), and the plan plans from that world."""
    state = sp.rollout_state(w)
    return state, sp.plan_serving(dataclasses.replace(w, now="2026-11-25T12:00:05Z"))


def test_a_settled_pass_renders_the_engine_once_and_plans_as_two_renders_did(renders):
    settled = tables.serving(pods=2)
    renders.clear()     # building the table's world rendered it too
    state, steps = a_pass(dataclasses.replace(settled, rendered={}))
    assert renders == [tables.PAIR]
    assert state[0] == "available"
    # The same plan as from worlds that share no render (each ask rendered afresh).
    unshared = sp.plan_serving(dataclasses.replace(settled, now="2026-11-25T12:00:05Z", rendered={}))
    assert len(renders) == 2
    assert steps == unshared
    assert tables.writes(steps) == []


@pytest.mark.parametrize("what, change, written", [
    ("a new replica count", {"spec": {**tables.SPEC, "rollout": {"replicas": 3}}}, ["EnsureOwned Deployment"]),
    ("a new pod template", {"spec": {**tables.SPEC, "rollout": {"replicas": 1, "nodeSelector": {"gpu": "a100"}}}},
     ["EnsureOwned Deployment"]),
    ("another champion's tags", {"tags": tables.release_tags("2")}, ["EnsureOwned Deployment"]),
])
def test_a_world_changed_after_the_rollout_question_is_rendered_afresh(renders, what, change, written):
    w = dataclasses.replace(tables.serving(pods=1), rendered={})
    renders.clear()
    sp.rollout_state(w)
    steps = sp.plan_serving(dataclasses.replace(w, **change))
    assert len(renders) == 2, what
    assert [k for k in tables.writes(steps) if k.startswith("EnsureOwned")] == written, what
    ensured = next(s for s in steps if isinstance(s, serving_steps.EnsureOwned) and s.manifest["kind"] == "Deployment")
    if "spec" in change:
        assert ensured.manifest["spec"]["replicas"] == change["spec"]["rollout"]["replicas"]
    # What the plan wants written is what a world without the first render plans.
    assert steps == sp.plan_serving(dataclasses.replace(w, rendered={}, **change))


def test_each_caller_gets_a_deployment_of_its_own(renders):
    w = dataclasses.replace(tables.serving(pods=1), rendered={})
    renders.clear()
    served = sp.served_release(w)
    first = serving_steps.rendered_engine(w, served)
    pristine = owned.manifest_fingerprint(first.deployment)
    # ensure_owned stamps the manifest it writes and adds its owner reference.
    owned.stamp(first.deployment)
    first.deployment["metadata"]["ownerReferences"] = [{"uid": tables.UID, "controller": True}]
    first.deployment["spec"]["template"]["spec"]["containers"][0]["image"] = "edited"
    second = serving_steps.rendered_engine(w, served)
    assert len(renders) == 1
    assert owned.manifest_fingerprint(second.deployment) == pristine
    assert second.manifest == first.manifest
    assert "ownerReferences" not in second.deployment["metadata"]
