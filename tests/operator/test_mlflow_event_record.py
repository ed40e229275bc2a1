"""Live events on the record a reviewer reads in MLflow (docs/mlflow.md): each mark the operator
writes on a version (promotion, shadow verdict, SpeculationOff, rollback) leaves a short tag in
words, a line in the version's history and a run with the evidence as metrics. Pure parts first,
then through the operator's registry adapter against a real `mlflow server`."""

import json
import uuid

import pytest

from specpair_operator.release import aliases, content as release
from specpair_operator.policy import drift
from specpair_operator.release.registry_contract import (HISTORY_SECTION, TAG_EVENT, TAG_PROMOTED_AT, TAG_ROLLED_BACK,
                                                 TAG_RUN_DESCRIPTION, TAG_SHADOW_VERDICT, TAG_SPECULATION_OFF,
                                                 drift_figures, event_record, gate_experiment, with_gate_section,
                                                 with_history_line)

SPEC = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "r1"}, "draft": {"drafter": "ngram"}}
PROMPTS = [{"prompt": "def add(a, b):", "category": "code"}]


def drift_reason() -> str:
    """A rollback reason as the drift policy words it (drift.Judgement.message)."""
    judged = drift.Judgement(category="code", verdict=drift.BREACH, live=0.05, upper=0.11, baseline=0.8,
                             floor=0.6, drafted=320, requests=12)
    return "sustained drift: " + judged.message()


def test_a_drift_reason_gives_its_figures_by_category():
    assert drift_figures(drift_reason()) == {"live_acceptance.code": 0.05, "upper_acceptance.code": 0.11,
                                             "floor.code": 0.6, "gated_acceptance.code": 0.8,
                                             "requests.code": 12.0, "drafted.code": 320.0}
    assert drift_figures("p99 latency 2.1 s over 1.2 s") == {}


def test_each_mark_reads_as_words_and_only_marks_are_events():
    rollback = event_record(TAG_ROLLED_BACK, drift_reason(), "2", {})
    assert rollback.name == "rollback" and rollback.summary.startswith("v2 rolled back (lost the champion alias): ")
    assert rollback.metrics["live_acceptance.code"] == 0.05
    off = event_record(TAG_SPECULATION_OFF, drift_reason(), "2", {})
    on = event_record(TAG_SPECULATION_OFF, "", "2", {})
    assert (off.name, on.name) == ("speculation-off", "speculation-on") and off.key != on.key
    shadow = event_record(TAG_SHADOW_VERDICT, json.dumps({"result": "Rejected", "reason": "candidate worse", "categories": {
        "*": {"candidateAlpha": 0.31, "championAlpha": 0.52, "requests": 40, "status": "worse"}}}), "3", {})
    assert shadow.metrics == {"candidateAlpha.pooled": 0.31, "championAlpha.pooled": 0.52, "requests.pooled": 40.0}
    assert "Rejected: candidate worse" in shadow.summary
    assert event_record("specpair.gate.status", "passed", "2", {}) is None


def test_the_history_survives_a_new_gate_section_and_keeps_to_mlflows_length():
    text = with_history_line("release v2", "first")
    text = with_gate_section(text, {"passed": True, "acceptanceRate": 0.5, "speedup": 1.2}, "1", "r")
    assert text.startswith("release v2") and text.endswith("- first") and "[gate run]" in text
    for i in range(100):
        text = with_history_line(text, f"event {i} " + "x" * 80)
    assert len(text) <= 5000 and text.endswith("x" * 80) and "- first" not in text and "[gate run]" in text


def test_a_drift_driven_rollback_is_explained_in_the_version_history(reg):
    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")
    versions = []
    for k in (2, 3):
        rel = release.build_release("p", "ns", {**SPEC, "speculation": {"k": k}}, PROMPTS)
        version = reg.ensure_release(model, rel, release.content_hash(rel))
        reg.set_tags(model, version, {TAG_PROMOTED_AT: f"2026-12-06T12:0{k}:00Z"})
        for move in aliases.plan_promotion(reg.aliases(model), version):
            reg.set_alias(model, move.alias, move.version)
        versions.append(version)
    v1, v2 = versions
    # As serving_plan._rollback does it: the mark first, then the alias.
    reg.for_pass().set_tags(model, v2, {TAG_ROLLED_BACK: drift_reason()})
    reg.set_tags(model, v2, {TAG_ROLLED_BACK: drift_reason()})   # a pass that planned it again
    for move in aliases.plan_rollback(reg.aliases(model)):
        reg.set_alias(model, move.alias, move.version)
    assert reg.aliases(model)["champion"] == v1

    mv = reg.client.get_model_version(model, v2)
    history = mv.description.split(HISTORY_SECTION)[1].splitlines()
    assert [line.split("**")[1] for line in history] == ["promotion", "rollback"]
    assert "rolled back (lost the champion alias): sustained drift: category 'code' acceptance 0.050" in history[1]
    assert mv.tags["specpair.event.rollback"].startswith("v2 rolled back")
    assert mv.tags[TAG_ROLLED_BACK] == drift_reason()      # the operator's own mark, as it was
    exp_id = reg.client.get_experiment_by_name(gate_experiment(model)).experiment_id
    [run] = reg.client.search_runs([exp_id], filter_string=f"tags.`{TAG_EVENT}` = 'rollback'")   # one, not two
    assert f"runs/{run.info.run_id})" in history[1]
    assert run.data.metrics["live_acceptance.code"] == 0.05 and run.data.metrics["gated_acceptance.code"] == 0.8
    assert "sustained drift" in run.data.tags[TAG_RUN_DESCRIPTION] and run.info.status == "FINISHED"
    assert reg.client.get_model_version(model, v1).tags["specpair.event.promotion"].startswith("v1 promoted to champion")


def lose_first_reply(monkeypatch, client, method: str) -> None:
    """MLflow commits `method`'s first call and its reply is lost (as failpoints.py does for the
    operator's other writes): the adapter's retry must find what was done."""
    original, lost = getattr(client, method), []

    def committed_then_lost(*args, **kwargs):
        result = original(*args, **kwargs)
        if not lost:
            lost.append(method)
            raise ConnectionError(f"the reply to {method} was lost")
        return result
    monkeypatch.setattr(client, method, committed_then_lost)


@pytest.mark.parametrize("method", ["create_logged_model", "finalize_logged_model", "update_model_version",
                                    "set_model_version_tag"])
def test_a_lost_reply_makes_no_second_logged_model_run_or_history_line(reg, monkeypatch, method):
    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")
    lose_first_reply(monkeypatch, reg.client, method)
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    version = reg.ensure_release(model, rel, release.content_hash(rel))
    reg.set_tags(model, version, {TAG_ROLLED_BACK: drift_reason()})
    mv = reg.client.get_model_version(model, version)
    exp_id = reg.client.get_experiment_by_name(gate_experiment(model)).experiment_id
    assert len(reg.client.search_logged_models(experiment_ids=[exp_id])) == 1
    assert len(reg.client.search_runs([exp_id], filter_string=f"tags.`{TAG_EVENT}` = 'rollback'")) == 1
    assert mv.description.split(HISTORY_SECTION)[1].count("**rollback**") == 1
    assert mv.tags[TAG_ROLLED_BACK] == drift_reason() and mv.tags["specpair.event.rollback"].startswith("v1 rolled back")
