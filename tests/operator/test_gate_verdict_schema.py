"""The gate verdict's schema, as a table: what the operator refuses to judge (a GateError naming
each problem) and what it judges as before. Pure: no servers; the same refusals on the real
control plane are in test_operator_hostile_specs.py."""

from __future__ import annotations

import json

import pytest

from specpair_operator.crd import conditions
from specpair_operator.gate import verdict as gate_verdict

NAN, INF = float("nan"), float("inf")
TH = {"requireGreedyIdentity": True, "minAcceptance": 0.5, "minCategoryAcceptance": {"code": 0.6}, "minSpeedup": 1.1}
# A verdict as `specpair gate` writes it (engine/specpair/gate/verdict.py: every key of the contract).
GOOD = {"passed": True, "reasons": [], "greedyIdentity": 1.0, "greedyIdentityWithinTies": 1.0,
        "acceptanceRate": 0.7, "meanAcceptanceLength": 3.1, "speedup": 1.4,
        "categories": {"code": {"acceptanceRate": 0.8, "speedup": 1.5, "greedyIdentity": 1.0,
                                "meanAcceptanceLength": 3.4},
                       "chat": {"acceptanceRate": 0.55}},
        "tokenizer": {"compatible": True, "differences": [], "notes": ["ok"], "targetFingerprint": "ab",
                      "draftFingerprint": None},
        "acceptancePerPosition": [0.9, 0.7, 0.5, 0.3], "bestSpeculation": {"k": 4, "batchSizeThreshold": 8},
        "kSweep": [{"k": 2, "speedup": 1.2}, {"k": 4, "speedup": 1.4}], "batchSweep": [{"batchSize": 1, "speedup": 1.4}],
        "mlflowRunId": None, "device": "cpu"}


def with_(path: str, value):
    """GOOD with the value at a dotted path replaced (`...=DELETE` removes the key)."""
    verdict = json.loads(json.dumps(GOOD))
    *parents, last = path.split(".")
    node = verdict
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return verdict


DELETE = object()


@pytest.mark.parametrize("path, value, problem", [
    ("acceptanceRate", NAN, "acceptanceRate is NaN, must be a finite number in [0, 1]"),
    ("acceptanceRate", INF, "acceptanceRate is Infinity, must be a finite number in [0, 1]"),
    ("acceptanceRate", 1.5, "acceptanceRate is 1.5, must be a finite number in [0, 1]"),
    ("acceptanceRate", -0.1, "acceptanceRate is -0.1, must be a finite number in [0, 1]"),
    ("acceptanceRate", "0.7", 'acceptanceRate is "0.7", must be a finite number in [0, 1]'),
    ("acceptanceRate", True, "acceptanceRate is true, must be a finite number in [0, 1]"),
    ("speedup", INF, "speedup is Infinity, must be a finite number > 0"),
    ("speedup", -INF, "speedup is -Infinity, must be a finite number > 0"),
    ("speedup", 0, "speedup is 0, must be a finite number > 0"),
    ("speedup", 10 ** 400, "must be a finite number > 0"),
    ("speedup", [1.4], "speedup is [1.4], must be a finite number > 0"),
    ("greedyIdentity", NAN, "greedyIdentity is NaN, must be a finite number in [0, 1]"),
    ("greedyIdentityWithinTies", 2, "greedyIdentityWithinTies is 2, must be a finite number in [0, 1]"),
    ("meanAcceptanceLength", -1, "meanAcceptanceLength is -1, must be a finite number >= 0"),
    ("passed", DELETE, "passed is null, must be true or false"),
    ("passed", "yes", 'passed is "yes", must be true or false'),
    ("passed", 1, "passed is 1, must be true or false"),
    ("reasons", "too slow", 'reasons is "too slow", must be a list of strings'),
    ("categories", "code", 'categories is "code", must be a mapping of category to its numbers'),
    ("categories", ["code"], "categories is [\"code\"], must be a mapping of category to its numbers"),
    ("categories.code", 0.8, "categories.code is 0.8, must be a mapping of measure to number"),
    ("categories.code.acceptanceRate", NAN, "categories.code.acceptanceRate is NaN, must be a finite number in [0, 1]"),
    ("categories.code.speedup", "fast", 'categories.code.speedup is "fast", must be a finite number > 0'),
    ("tokenizer", "compatible", 'tokenizer is "compatible", must be a mapping (compatible, differences, fingerprints)'),
    ("tokenizer.compatible", "yes", 'tokenizer.compatible is "yes", must be true or false'),
    ("tokenizer.differences", "vocab", 'tokenizer.differences is "vocab", must be a list of strings'),
    ("tokenizer.targetFingerprint", 7, "tokenizer.targetFingerprint is 7, must be a string"),
    ("acceptancePerPosition", {"0": 0.9}, 'acceptancePerPosition is {"0": 0.9}, must be a list of numbers in [0, 1]'),
    ("acceptancePerPosition", [0.9, NAN], "acceptancePerPosition[1] is NaN, must be a finite number in [0, 1]"),
    ("bestSpeculation", "k=4", 'bestSpeculation is "k=4", must be a mapping (k, batchSizeThreshold)'),
    ("bestSpeculation.k", 0, "bestSpeculation.k is 0, must be an integer in [1, 16]"),
    ("bestSpeculation.k", 17, "bestSpeculation.k is 17, must be an integer in [1, 16]"),
    ("bestSpeculation.k", 4.0, "bestSpeculation.k is 4.0, must be an integer in [1, 16]"),
    ("bestSpeculation.batchSizeThreshold", -1, "bestSpeculation.batchSizeThreshold is -1, must be an integer >= 0"),
    ("kSweep", {"k": 2}, 'kSweep is {"k": 2}, must be a list of (k, speedup) mappings'),
    ("kSweep", [{"k": 2, "speedup": NAN}], "kSweep[0].speedup is NaN, must be a finite number >= 0"),
    ("kSweep", [{"speedup": 1.0}], "kSweep[0].k is null, must be an integer >= 1"),
    ("batchSweep", [None], "batchSweep[0] is null, must be a mapping (batchSize, speedup)"),
    ("device", 0, "device is 0, must be a string"),
    # Fields the schema does not name may be anything JSON carries, and nothing else.
    ("extra", {"deep": [1.0, -INF]}, "extra.deep[1] is -Infinity, must be a finite number"),
])
def test_an_unusable_verdict_is_a_gate_error_that_says_what_is_wrong(path, value, problem):
    verdict = with_(path, value)
    problems = gate_verdict.verdict_problems(verdict)
    assert len(problems) == 1 and problem in problems[0], problems
    out = gate_verdict.evaluate_verdict(verdict, TH)
    assert not out.passed and out.reason == gate_verdict.GATE_ERROR == "GateError"
    assert out.message == "the gate's verdict is unusable: " + problems[0] and out.failures == problems
    # Nothing of it is used as a number: no drift baseline, nothing for status.
    assert gate_verdict.usable_verdict(verdict) == {} and gate_verdict.baseline_from_verdict(verdict) == {}


def test_a_verdict_nested_past_the_recursion_limit_is_a_gate_error_not_an_exception():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    for verdict in ({**GOOD, "extra": deep}, {**GOOD, "categories": deep}):
        out = gate_verdict.evaluate_verdict(verdict, TH)
        assert out.reason == "GateError" and "nested" in out.message, out.message
        assert gate_verdict.baseline_from_verdict(verdict) == {}


@pytest.mark.parametrize("verdict", [None, "passed", [GOOD], 1.0])
def test_a_verdict_that_is_no_object_is_a_gate_error(verdict):
    out = gate_verdict.evaluate_verdict(verdict, TH)
    assert out.reason == "GateError" and "the verdict is" in out.message and "must be a JSON object" in out.message


def test_every_problem_is_named_once():
    """The issue's forged verdict: NaN passes every threshold (`NaN < min` is false), so each
    problem must be caught, and each said once (a NaN fails its range and finiteness alike)."""
    forged = {**GOOD, "acceptanceRate": NAN, "speedup": INF, "categories": "code", "tokenizer": "yes"}
    assert gate_verdict.verdict_problems(forged) == [
        "acceptanceRate is NaN, must be a finite number in [0, 1]",
        "speedup is Infinity, must be a finite number > 0",
        'categories is "code", must be a mapping of category to its numbers',
        'tokenizer is "yes", must be a mapping (compatible, differences, fingerprints)']


@pytest.mark.parametrize("verdict", [
    GOOD,
    # What the gate writes when it stops at the tokenizer check: nothing measured.
    {"passed": False, "reasons": ["tokenizer mismatch: vocab"], "tokenizer": {"compatible": False,
     "differences": ["vocab"]}, "greedyIdentity": None, "acceptanceRate": None, "meanAcceptanceLength": None,
     "speedup": None, "categories": {}, "acceptancePerPosition": [], "bestSpeculation": None, "kSweep": [],
     "batchSweep": [], "mlflowRunId": None, "device": None},
    {"passed": True},
    {**GOOD, "engine": "vllm", "mlflowRunId": "abc", "unknownField": {"nested": [1, "x", None]}},
    {**GOOD, "acceptanceRate": 0, "greedyIdentity": 1, "kSweep": [{"k": 2, "speedup": 0.0}]},
])
def test_a_usable_verdict_is_judged_as_before(verdict):
    assert gate_verdict.verdict_problems(verdict) == []
    assert gate_verdict.usable_verdict(verdict) is verdict
    assert gate_verdict.evaluate_verdict(verdict, TH).reason != "GateError"


def test_the_largest_k_is_the_crds():
    from specpair_operator.crd.validation import spec_schema
    assert gate_verdict.max_k() == spec_schema()["properties"]["speculation"]["properties"]["k"]["maximum"] == 16


@pytest.mark.parametrize("value, safe", [
    (NAN, None), (INF, None), (-INF, None), (1.5, 1.5), ("NaN", "NaN"), (None, None),
    ({"a": 1.0, "b": {"c": [0.5, NAN]}}, {"a": 1.0, "b": {"c": [0.5, None]}}),
    ([INF, {"x": -INF}], [None, {"x": None}]),
])
def test_a_status_value_carries_no_nan_or_infinity(value, safe):
    out = conditions.finite(value)
    assert out == safe
    json.dumps(out, allow_nan=False)  # what the API server accepts


def test_a_finite_status_value_is_left_as_the_very_object():
    """The pass rewrites (and logs) only a value that held a NaN or Infinity."""
    value = {"lastGate": {"acceptanceRate": 0.7, "categories": {"code": 0.8}}, "history": [{"a": 1}]}
    assert conditions.finite(value) is value
    assert conditions.finite(value["history"]) is value["history"]
