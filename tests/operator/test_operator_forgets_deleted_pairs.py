"""A deleted pair leaves nothing in the operator (issue 54, found in review): none of its
per-pair memory (state.OperatorState's fields made with per_pair_memory, canary samples
included) and none of its Prometheus series (metrics.PER_PAIR), so dashboards and alerts stop
showing it. The handler's own forgetting as a table, then the real thing: a pair served by the
operator under the chart's RBAC, deleted, and the operator's /metrics scraped.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import fields

import kopf
import pytest
from kopf.testing import KopfRunner

from cluster_env import OPERATOR, REPLACE, operator_metrics, pair, serving
from specpair_operator import handlers
from specpair_operator.act import metrics
from specpair_operator.state import STATE, OperatorState


def _series(namespace: str, name: str) -> list[tuple[str, dict[str, str]]]:
    return [(s.name, s.labels) for family in metrics.REGISTRY.collect() for s in family.samples
            if s.labels.get("namespace") == namespace and s.labels.get("pair") == name]


def _export_every_series(namespace: str, name: str) -> None:
    for metric, labels in metrics.PER_PAIR:
        values = {"namespace": namespace, "pair": name, "reason": "drift", "result": "passed",
                  "decision": "started", "version": "3", "category": "all", "step": "1"}
        child = metric.labels(*(values[label] for label in labels))
        if isinstance(metric, metrics.Counter):
            child.inc()
        elif isinstance(metric, metrics.Histogram):
            child.observe(42)
        else:
            child.set(2)


def test_every_dict_of_the_state_keyed_by_pair_is_per_pair_memory():
    """A dict field added to the state without per_pair_memory would never be forgotten: each
    dict field is per-pair memory (the state has no other dicts)."""
    dicts = [f.name for f in fields(OperatorState) if "dict[" in str(f.type)]
    assert dicts and all(f.metadata.get("per_pair") for f in fields(OperatorState) if f.name in dicts), dicts


def test_a_deleted_pairs_memory_and_series_are_gone_and_another_pairs_stay(monkeypatch):
    state = OperatorState()
    monkeypatch.setattr(handlers, "STATE", state)
    gone, kept = f"u-{uuid.uuid4().hex}", f"u-{uuid.uuid4().hex}"
    ns, name, other = "team", f"gone-{uuid.uuid4().hex[:5]}", f"kept-{uuid.uuid4().hex[:5]}"
    for memory in state.per_pair():
        memory[gone], memory[kept] = object(), object()
    state.woken.update({gone, kept})
    assert state.canary_samples[gone]   # what the review found kept for ever
    _export_every_series(ns, name)
    _export_every_series(ns, other)
    assert {s[1].get("pair") for s in _series(ns, name)} == {name}
    body = {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair",
            "metadata": {"name": name, "namespace": ns, "uid": gone}, "spec": {}}
    asyncio.run(handlers.on_event(type="DELETED", body=kopf.Body(body)))
    assert [m for m in state.per_pair() if gone in m] == [] and gone not in state.woken
    assert all(kept in m for m in state.per_pair()) and kept in state.woken
    assert _series(ns, name) == []
    for metric, _ in metrics.PER_PAIR:   # the other pair's series, one family at a time, are all there
        assert any(s.labels.get("pair") == other for family in metric.collect() for s in family.samples), metric
    metrics.forget_pair(ns, other)


@pytest.mark.slow
def test_a_deleted_serving_pair_leaves_no_series_and_no_memory(env):
    """On the real control plane: a pair gated and serving exports its release speedup and drift
    ladder step; once it is deleted the operator's /metrics has no series of it, and the
    operator's memory has nothing keyed by its uid."""
    ns = env
    name = f"bye-{uuid.uuid4().hex[:5]}"
    with KopfRunner(OPERATOR, timeout=60) as runner:
        obj = ns.create(pair(name, "good-draft", rollout=REPLACE))
        uid = obj["metadata"]["uid"]
        ns.wait_for("v1 serving", lambda: serving(ns, name, "1"), timeout=120)

        def exported() -> set[str]:
            return {metric for metric, labels in operator_metrics()
                    if ("pair", name) in labels and ("namespace", ns.name) in labels}
        ns.wait_for("its speedup and drift ladder series exported", lambda: {
            "specpair_release_speedup", "specpair_drift_ladder_step"} <= exported(), timeout=60)
        assert uid in STATE.bodies and any(uid in m for m in STATE.per_pair() if m is not STATE.bodies)

        ns.kube.delete("specpair.io/v1alpha1", "SpecModelPair", ns.name, name)
        ns.wait_for("its series gone from /metrics", lambda: not exported(), timeout=120)
        ns.wait_for("its memory forgotten", lambda: not [m for m in STATE.per_pair() if uid in m], timeout=60)
        # And it stays so: a pass that was under way when the pair went forgets what it wrote.
        time.sleep(2.5)   # two periodic passes or more (a second apart)
        assert not exported() and not [m for m in STATE.per_pair() if uid in m]
    assert runner.exception is None
