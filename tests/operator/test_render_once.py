"""The engine Deployment is rendered only when what it is rendered from changed
(serving_steps.rendered_engine): observe's rollout question (rollout_state) and the plan
(plan_serving) ask for the same Deployment from the same values, a settled pair's passes ask for
it pass after pass, and its rendering and fingerprints were the largest part of a settled pass
at 335 pairs. These tables check that a second ask reuses the first's render, in one pass and
in the next (the operator keeps it per pair: OperatorState.renders), that a world whose values
changed is rendered afresh, and that a caller's edits to its Deployment (as ensure_owned stamps
and adopts it), or a pass's edits to its spec, never reach another caller."""

from __future__ import annotations

import copy
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


def a_pass(w, kept=None):
    """As a pass runs: observe builds a world of fresh values (a pass reads its spec and status
    anew; `kept`: the pair's renders the operator keeps), asks the rollout question, reads the
    pods (a new world made by replace), and the plan plans from that world."""
    w = dataclasses.replace(w, spec=copy.deepcopy(w.spec), status=copy.deepcopy(w.status), tags=dict(w.tags),
                            rendered={} if kept is None else kept)
    state = sp.rollout_state(w)
    return state, sp.plan_serving(dataclasses.replace(w, now="2026-11-25T12:00:05Z"))


def test_a_settled_pass_renders_the_engine_once_and_plans_as_two_renders_did(renders):
    settled = tables.serving(pods=2)
    renders.clear()     # building the table's world rendered it too
    state, steps = a_pass(settled)
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


def test_the_next_pass_of_a_settled_pair_renders_nothing_and_a_change_renders_once(renders):
    settled = tables.serving(pods=1)
    kept: dict = {}
    renders.clear()
    first = a_pass(settled, kept)
    assert a_pass(settled, kept) == first and a_pass(settled, kept) == first
    assert len(renders) == 1
    # A new pod template in the spec: the next pass renders it, once.
    moved = dataclasses.replace(settled, spec={**settled.spec, "rollout": {"replicas": 1, "nodeSelector": {"gpu": "a100"}}})
    state, steps = a_pass(moved, kept)
    a_pass(moved, kept)
    assert len(renders) == 2
    assert steps == sp.plan_serving(dataclasses.replace(moved, rendered={}))
    ensured = next(s for s in steps if isinstance(s, serving_steps.EnsureOwned) and s.manifest["kind"] == "Deployment")
    assert ensured.manifest["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "a100"}


def test_a_spec_edited_after_its_pass_does_not_pass_for_the_next_one(renders):
    w = dataclasses.replace(tables.serving(pods=1), spec=copy.deepcopy(tables.SPEC), rendered={})
    renders.clear()
    sp.rollout_state(w)
    # The pass is over; its spec dict is edited in place (a later pass's spec equals the edit).
    w.spec["rollout"]["replicas"] = 3
    nxt = dataclasses.replace(w, spec=copy.deepcopy(w.spec))
    steps = sp.plan_serving(nxt)
    assert len(renders) == 2
    ensured = next(s for s in steps if isinstance(s, serving_steps.EnsureOwned) and s.manifest["kind"] == "Deployment")
    assert ensured.manifest["spec"]["replicas"] == 3
