"""When a pair's next periodic pass is due (handlers.pass_delay, pure): every interval while it
is in motion; once settled, at its drift interval (drift is still judged every window) or the
resync backstop, whichever comes first; never more often than the interval."""

from __future__ import annotations

import pytest

from specpair_operator.handlers import pass_delay, resync_interval


def body(generation: int = 3, drift: dict | None = None) -> dict:
    return {"metadata": {"generation": generation}, "spec": {"drift": drift} if drift is not None else {}}


def status(phase: str = "Serving", ready: str = "True", observed: int = 3, serving: str = "2",
           candidate: str = "2") -> dict:
    return {"phase": phase, "servingVersion": serving, "candidateVersion": candidate,
            "conditions": [{"type": "Ready", "status": ready, "observedGeneration": observed}]}


@pytest.mark.parametrize("why, st", [
    ("gating a candidate", status(phase="Gating", ready="False")),
    ("a candidate scored beside the champion", status(candidate="3")),
    ("a spec not yet observed", status(observed=2)),
    ("not ready", status(ready="False")),
    ("nothing served yet", status(serving="", candidate="")),
    ("no status yet", {}),
])
def test_a_pair_in_motion_is_passed_over_every_interval(why, st):
    assert pass_delay(body(), st, 10.0, 60.0) == 10.0, why


def test_a_settled_pair_waits_for_its_drift_window():
    assert pass_delay(body(), status(), 10.0, 60.0) == 30.0          # the CRD's default drift interval
    assert pass_delay(body(drift={"intervalSeconds": 45}), status(), 10.0, 60.0) == 45.0


def test_the_resync_backstop_bounds_a_settled_pairs_wait():
    assert pass_delay(body(drift={"intervalSeconds": 600}), status(), 10.0, 60.0) == 60.0
    assert pass_delay(body(drift={"enabled": False}), status(), 10.0, 60.0) == 60.0


def test_never_more_often_than_the_interval():
    assert pass_delay(body(drift={"intervalSeconds": 2}), status(), 10.0, 60.0) == 10.0


def test_resync_defaults_to_thirty_intervals(monkeypatch):
    monkeypatch.delenv("SPECPAIR_RESYNC_INTERVAL", raising=False)
    assert resync_interval(10.0) == 300.0 and resync_interval(1.0) == 30.0
    monkeypatch.setenv("SPECPAIR_RESYNC_INTERVAL", "120")
    assert resync_interval(10.0) == 120.0


# -- what a settled pair's pass reads ------------------------------------------------------------

def records(*actions: str) -> "Records":
    from specpair_operator.observe.world import Records
    return Records.from_status({"recorded": {a: ["2"] for a in actions}})


@pytest.mark.parametrize("recorded, aliases, needed", [
    (("GateStarted", "GatePassed"), {"champion": "2"}, False),      # settled: nothing to learn from the Jobs
    (("GateStarted", "GateError"), {"champion": "2"}, False),
    (("GateStarted",), {"champion": "2"}, True),                    # the result is not in the status yet
    (("GatePassed",), {"champion": "2"}, True),                     # nor its start (a gate finished while down)
    (("GateStarted", "GatePassed"), {"champion": "1"}, True),       # not the champion: being gated or promoted
    ((), {}, True),
])
def test_gate_jobs_are_read_until_the_champions_gate_is_recorded(recorded, aliases, needed):
    from specpair_operator.observe.reads import gate_jobs_needed
    assert gate_jobs_needed(records(*recorded), "2", aliases) is needed
