"""The status ledger (ledger.py): one report per pass, named helpers for it, and one write of
what changed."""

from __future__ import annotations

import logging

import pytest
from merge_patch import merge_patch

from specpair_operator.act.ledger import AlreadyReported, StatusLedger


def ledger(status: dict | None = None) -> StatusLedger:
    return StatusLedger(status or {}, 3, "ns", "chat", logging.getLogger("test"))


def conditions(patch: dict) -> dict:
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in patch["conditions"]}


def test_the_helpers_set_the_three_kstatus_conditions_and_the_phase():
    one = ledger()
    one.ready("Serving", "Serving", "v1 serving")
    patch = one.status_patch()
    assert patch["phase"] == "Serving" and patch["message"] == "v1 serving" and patch["observedGeneration"] == 3
    assert conditions(patch) == {"Ready": ("True", "Serving", "v1 serving"), "Reconciling": ("False", "Serving", ""),
                                 "Stalled": ("False", "Serving", "")}
    two = ledger()
    two.stalled("Degraded", "ReleaseNotServable", "v2 failed; v1 keeps serving", ready_reason="ChampionKeepsServing")
    assert conditions(two.status_patch())["Ready"] == ("False", "ChampionKeepsServing", "v2 failed; v1 keeps serving")
    three = ledger()
    three.reconciling("RollingOut", "RollingOut", "rolling out v1: 0/1 available", ready_message="0/1 available")
    patch = three.status_patch()
    assert patch["message"] == "rolling out v1: 0/1 available"
    assert conditions(patch)["Ready"] == ("False", "RollingOut", "0/1 available")


def test_a_second_report_is_refused_unless_it_replaces_the_first_or_the_first_was_provisional():
    one = ledger()
    one.ready("Serving", "Serving", "fine")
    with pytest.raises(AlreadyReported):
        one.stalled("Failed", "NoRelease", "nothing")
    one.stall("MLflowRejected", "MLflow refused", replacing=True)
    assert one.status_patch()["phase"] == "Failed"
    gating = ledger()
    gating.reconciling("Gating", "Gating", "gate Job running", provisional=True)
    gating.ready("Degraded", "SpeculationOff", "v1 serving target-only")  # the champion's action wins
    assert gating.status_patch()["phase"] == "Degraded"


def test_status_is_written_once_with_only_what_changed():
    status = {"phase": "Serving", "message": "v1 serving", "observedGeneration": 3, "history": [], "recorded": {}}
    same = ledger(status)
    same.ready("Serving", "Serving", "v1 serving")
    first = same.status_patch()
    again = ledger({**status, **first})
    again.ready("Serving", "Serving", "v1 serving")
    assert again.status_patch() == {}
    quiet = ledger({})  # a pass that reports nothing and records nothing writes nothing
    assert quiet.status_patch() == {}


def test_records_are_once_only_by_key_and_go_out_as_events():
    one = ledger({"recorded": {"GateStarted": ["1"]}, "history": [{"action": "GateStarted", "toVersion": "1"}]})
    assert one.was_recorded("GateStarted", "1", "1") and not one.was_recorded("GatePassed", "1", "1")
    one.record("GatePassed", "v1: passed", None, "1", key="1")
    patch = one.status_patch()
    assert [h["action"] for h in patch["history"]] == ["GateStarted", "GatePassed"]
    assert patch["recorded"] == {"GateStarted": ["1"], "GatePassed": ["1"]}
    assert one.events == [("Normal", "GatePassed", "v1: passed")]


def test_numbers_json_cannot_carry_are_written_as_null():
    one = ledger()
    one.set(speedup=float("nan"))
    assert one.status_patch()["speedup"] is None


def test_a_field_set_whole_leaves_no_key_of_its_old_maps_behind():
    # The demo's learned release (issue 58): v2's drift ladder and last live window in the status,
    # then v3's first drift check with a fresh ladder and no window closed yet.
    status = {"drift": {"version": "2", "stepsTaken": 1, "streaks": {"extraction": 38, "*": 37},
                        "breachesInRow": 38, "fineInRow": 0, "since": 5.0, "probing": True},
              "live": {"acceptance": {"extraction": 0.0906}, "draftedTokens": {"extraction": 276},
                       "trafficShift": {"creative": 308}},
              "verifiedVerdicts": {"2": "abc"}}
    one = ledger(status)
    drift = {"version": "3", "stepsTaken": 0, "streaks": {}, "breachesInRow": 0, "fineInRow": 0, "since": 0.0,
             "probing": False}
    live = {"acceptance": {}, "draftedTokens": {}, "trafficShift": {"creative": 308}}
    one.set(drift=drift, live=live, verifiedVerdicts={"2": "abc", "3": "def"})
    written = merge_patch(status, one.status_patch())
    assert written["drift"] == drift and written["live"] == live
    assert written["verifiedVerdicts"] == {"2": "abc", "3": "def"}
    # Written again unchanged, nothing goes out.
    again = ledger(written)
    again.set(drift=drift, live=live)
    assert again.status_patch() == {}
