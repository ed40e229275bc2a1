"""Golden prompts that ask for structure, on the operator's side (pure): the CRD takes them, the
release carries them (a plain prompt's release is unchanged), the operator re-judges the floors,
and the gate's record shows the rates (metrics, headline, per-prompt table, description,
parameters). And the drift probe's mark reads as words like the other events. The real gate
judging them: tests/engine/test_engine_gate.py; through a live operator and real MLflow:
tests/operator/test_operator_real_engine.py."""

from specpair.contract import content_hash
from specpair_operator.crd.validation import validate_spec
from specpair_operator.gate.verdict import evaluate_verdict
from specpair_operator.release import content as release
from specpair_operator.release.registry_contract import (PER_PROMPT_COLUMNS, TAG_DRIFT_PROBE, event_record,
                                                         gate_description, gate_metrics, headline_metrics,
                                                         per_prompt_table, probe_mark, release_params)

SPEC = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "r1"}, "draft": {"drafter": "ngram"}}
SCHEMA = {"type": "object", "required": ["a"], "properties": {"a": {"enum": [1, 2]}}}
JSON_PROMPT = {"prompt": "Pick one as JSON", "category": "json",
               "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}}
TOOL_PROMPT = {"prompt": "Weather?", "category": "tools", "tool_choice": "required", "tools": [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}
PLAIN = {"prompt": "def add(a, b):", "category": "code"}
VERDICT = {"passed": True, "reasons": [], "tokenizer": {"compatible": True, "differences": []},
           "greedyIdentity": 1.0, "acceptanceRate": 0.6, "speedup": 1.2, "schemaValidity": 0.5, "toolCallParse": 1.0,
           "categories": {"json": {"acceptanceRate": 0.7, "speedup": 1.3, "schemaValidity": 0.5},
                          "tools": {"acceptanceRate": 0.5, "speedup": 1.1, "toolCallParse": 1.0},
                          "code": {"acceptanceRate": 0.6, "speedup": 1.2}}}


def test_the_crd_takes_structured_prompts_and_floors_and_the_release_carries_them():
    spec = {**SPEC, "gating": {"prompts": [PLAIN, JSON_PROMPT, TOOL_PROMPT],
                               "thresholds": {"minSchemaValidity": 0.9, "minToolCallParse": 1}}}
    assert validate_spec(spec) == []
    bad = {**SPEC, "gating": {"thresholds": {"minSchemaValidity": 1.5}}}
    assert validate_spec(bad) == ["spec.gating.thresholds.minSchemaValidity: Invalid value: 1.5: "
                                  "spec.gating.thresholds.minSchemaValidity in body should be less than or equal to 1"]
    rel = release.build_release("p", "ns", spec, [PLAIN, JSON_PROMPT, TOOL_PROMPT])
    assert rel["gating"]["prompts"] == [PLAIN, JSON_PROMPT, TOOL_PROMPT]
    # A plain prompt carries no new key: releases made before keep their hashes.
    plain = release.build_release("p", "ns", SPEC, [PLAIN])
    assert plain["gating"]["prompts"] == [PLAIN] and set(plain["gating"]["thresholds"]) >= {"minAcceptance"}
    assert "minSchemaValidity" not in plain["gating"]["thresholds"]
    assert content_hash(plain) != content_hash(release.build_release("p", "ns", SPEC, [PLAIN, JSON_PROMPT]))
    # ConfigMap lines take the same keys.
    line = '{"prompt": "x", "response_format": {"type": "json_object"}}'
    assert release.parse_prompt_lines(line) == [{"prompt": "x", "category": "general",
                                                 "response_format": {"type": "json_object"}}]


def test_the_operator_refuses_a_release_whose_json_stops_validating_even_if_the_gate_said_pass():
    outcome = evaluate_verdict(VERDICT, {"requireGreedyIdentity": True})
    assert not outcome.passed
    assert outcome.failures == ["category 'json' schema validity 0.500 < minSchemaValidity 1.000 (short by 0.500)"]
    assert evaluate_verdict(VERDICT, {"minSchemaValidity": 0.5}).passed
    # A verdict of plain prompts has no such rate, and meets the floors.
    plain = {k: v for k, v in VERDICT.items() if k not in ("schemaValidity", "toolCallParse")}
    plain["categories"] = {"code": VERDICT["categories"]["code"]}
    assert evaluate_verdict(plain, {}).passed


def test_the_gate_record_shows_the_rates():
    metrics = gate_metrics(VERDICT)
    assert metrics[("schema_validity", 0)] == 0.5 and metrics[("schema_validity.json", 0)] == 0.5
    assert metrics[("tool_call_parse.tools", 0)] == 1.0
    assert ("schema_validity.code", 0) not in metrics and ("tool_call_parse.json", 0) not in metrics
    assert headline_metrics(VERDICT)["schema_validity.json"] == 0.5
    table = per_prompt_table([{"category": "json", "prompt": "p", "output_tokens": 5, "schema_valid": False},
                              {"category": "code", "prompt": "q", "output_tokens": 7}])
    assert table["columns"] == list(PER_PROMPT_COLUMNS) and PER_PROMPT_COLUMNS[-2:] == ("schema_valid", "tool_call_parsed")
    assert [row[-2:] for row in table["data"]] == [[False, None], [None, None]]
    rel = release.build_release("p", "ns", {**SPEC, "gating": {"thresholds": {"minSchemaValidity": 0.9}}},
                                [PLAIN, JSON_PROMPT])
    text = gate_description(VERDICT, rel)
    assert "| schema validity of json | >= 0.900 | 50.0% |" in text
    assert "| tool-call parse rate of tools | >= 1.000 | 100.0% |" in text
    params = release_params(rel)
    assert params["threshold.minSchemaValidity"] == "0.9" and params["threshold.minToolCallParse"] == "1.0"
    assert "threshold.minSchemaValidity" not in release_params(release.build_release("p", "ns", SPEC, [PLAIN]))


def test_a_drift_probe_reads_as_words_once_per_probe():
    on = event_record(TAG_DRIFT_PROBE, probe_mark(True, 1_765_000_000), "2", {})
    over = event_record(TAG_DRIFT_PROBE, probe_mark(False, 1_765_000_090), "2", {})
    assert on.name == over.name == "probe" and on.version_tag == "specpair.event.probe"
    assert on.summary.startswith("v2 drift probe on at 2025-12-06T05:46:40Z: speculation on with the draft")
    assert over.summary.startswith("v2 drift probe over at 2025-12-06T05:48:10Z: speculation off again")
    assert (on.metrics, over.metrics) == ({"probing": 1.0}, {"probing": 0.0})
    # The same probe's mark written again is the same record; the next probe's is another.
    assert event_record(TAG_DRIFT_PROBE, probe_mark(True, 1_765_000_000), "2", {}).key == on.key
    assert event_record(TAG_DRIFT_PROBE, probe_mark(True, 1_765_000_500), "2", {}).key != on.key


def test_the_charts_crd_is_the_crd():
    """The e2e clusters install the chart's copy: a field added to crds/ alone is pruned there
    (the structured golden prompts were, until the copy took them)."""
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    assert (repo / "charts/specpair/crds/specmodelpair.yaml").read_text() == (repo / "crds/specmodelpair.yaml").read_text()
