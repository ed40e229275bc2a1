"""validate_spec keeps its verdict by the spec's content: a settled pair's pass, which checks the
same spec every drift window, does not check it again, and any change of content (an edit in
place included) is checked afresh. No server: the check is a pure function of the spec."""

from __future__ import annotations

import copy
import json

import pytest

from specpair_operator.crd import validation

VALID = {"target": {"source": "default"}, "draft": {"drafter": "ngram"}}


@pytest.fixture
def checks(monkeypatch):
    """The specs checked afresh (validation.checked_spec's calls), from an empty store."""
    monkeypatch.setattr(validation, "_verdicts", {})
    seen: list = []
    real = validation.checked_spec

    def counting(spec):
        seen.append(copy.deepcopy(spec))
        return real(spec)
    monkeypatch.setattr(validation, "checked_spec", counting)
    return seen


def test_the_same_content_is_checked_once_and_answered_alike(checks):
    invalid = {"target": {"source": "default"}, "draft": {"drafter": "ngram"}, "rollout": {"replicas": -1}}
    assert validation.validate_spec(VALID) == []
    first = validation.validate_spec(invalid)
    assert first and any("replicas" in e for e in first)
    for _ in range(3):
        # Each pass decodes its spec afresh (act/reconciler): new objects, the same content.
        assert validation.validate_spec(json.loads(json.dumps(VALID))) == []
        assert validation.validate_spec(json.loads(json.dumps(invalid))) == first
    assert len(checks) == 2


def test_changed_content_is_checked_afresh_even_in_the_same_object(checks):
    spec = json.loads(json.dumps(VALID))
    assert validation.validate_spec(spec) == []
    spec["rollout"] = {"replicas": -1}            # the same dict, edited in place
    assert validation.validate_spec(spec) != []
    spec["rollout"] = {"replicas": 1}
    assert validation.validate_spec(spec) == []
    # A type is content: 1 and 1.0 and True are different specs to the schema.
    spec["rollout"] = {"replicas": True}
    assert any("integer" in e for e in validation.validate_spec(spec))
    assert len(checks) == 4


def test_a_verdict_handed_out_is_the_callers_own(checks):
    invalid = {"target": {"source": "default"}, "draft": {"drafter": "ngram"}, "rollout": {"replicas": -1}}
    first = validation.validate_spec(invalid)
    first.append("a caller's own line")
    first.clear()
    assert validation.validate_spec(invalid) and "a caller's own line" not in validation.validate_spec(invalid)


def test_at_most_verdicts_kept_the_oldest_dropped_first(checks, monkeypatch):
    monkeypatch.setattr(validation, "VERDICTS_KEPT", 3)
    specs = [{**VALID, "rollout": {"replicas": n}} for n in range(1, 6)]
    for spec in specs:
        validation.validate_spec(spec)
    assert len(validation._verdicts) == 3
    validation.validate_spec(specs[-1])        # kept
    validation.validate_spec(specs[0])         # dropped: checked again
    assert len(checks) == 6
