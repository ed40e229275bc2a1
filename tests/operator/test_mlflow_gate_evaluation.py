"""The release as a reviewer reads it in MLflow (docs/mlflow.md), read back with MlflowClient from
a real `mlflow server`: the gate run as an evaluation (dataset input, parameters, per-prompt
table, real duration, a description with every floor) and the model version carrying its figures."""

import json
import subprocess
import sys
import time
import uuid

import pytest
from mlflow_server import get_trace, load_table  # tests/ is on sys.path (tests/conftest.py)

from specpair_operator.release import content as release
from specpair_operator.release.registry_contract import (EXPERIMENT_KIND, GOLDEN_DATASET, PER_PROMPT_COLUMNS,
                                                 PER_PROMPT_TABLE, RUNS_VIEW,
                                                 TAG_EXPERIMENT_KIND, TAG_GATE_RUN, TAG_GATE_SUMMARY,
                                                 TAG_LOGGED_MODEL, TAG_RUN_DESCRIPTION, RegistryUnavailable,
                                                 gate_experiment,
                                                 gate_description, logged_model_id, prompts_digest)
from specpair_operator.release.registry_traces import golden_trace

SPEC = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "r1"}, "draft": {"drafter": "ngram"},
        "gating": {"thresholds": {"minSpeedup": 1.0, "minCategoryAcceptance": {"code": 0.5}}}}
PROMPTS = [{"prompt": "def add(a, b):", "category": "code"}, {"prompt": "A poem about rain", "category": "creative"}]
# A release that passes while speculation slows one category down: the page must say so.
VERDICT = {"passed": True, "reasons": [], "greedyIdentity": 1.0, "acceptanceRate": 0.41, "speedup": 1.08,
           "meanAcceptanceLength": 1.9, "device": "cpu",
           "categories": {"code": {"acceptanceRate": 0.7, "speedup": 1.31, "meanAcceptanceLength": 2.6},
                          "creative": {"acceptanceRate": 0.12, "speedup": 0.92, "meanAcceptanceLength": 1.2}},
           "acceptancePerPosition": [0.8, 0.6], "kSweep": [{"k": 2, "speedup": 1.05}, {"k": 4, "speedup": 1.08}],
           "bestSpeculation": {"k": 4, "batchSizeThreshold": 8},
           "tokenizer": {"compatible": True, "differences": [], "targetFingerprint": "a" * 64, "draftFingerprint": None},
           "mlflowRunId": None}
# (`seconds`: the medians of each prompt's target-only and speculative timings; `started_at`: when
# its timings began, epoch seconds: the traces' timings.)
GOLDEN = [{"prompt": "def add(a, b):", "category": "code", "token_ids": [1, 2, 3, 4], "output_tokens": 4,
           "acceptance_rate": 0.7, "mean_acceptance_length": 2.6, "speedup": 1.31, "identical": True,
           "target_only": " return a + b", "speculative": " return a + b",
           "seconds": {"target_only": 0.262, "speculative": 0.2}, "started_at": 1765000000.25},
          {"prompt": "A poem about rain", "category": "creative", "token_ids": [5, 6], "output_tokens": 2,
           "acceptance_rate": 0.12, "mean_acceptance_length": 1.2, "speedup": 0.92, "identical": True,
           "target_only": " Drops", "speculative": " Drops",
           "seconds": {"target_only": 0.092, "speculative": 0.1}, "started_at": 1765000001.5}]
GATE_SECONDS = 1.5


def gate_with(reg, tmp_path, model: str, spec: dict, verdict: dict) -> str:
    """A release's version, gated by the real gate runner forking a command that takes
    GATE_SECONDS and writes `verdict` and GOLDEN (the runner's recording is under test here)."""
    rel = release.build_release("p", "ns", spec, PROMPTS)
    version = reg.ensure_release(model, rel, release.content_hash(rel))
    rel_file = tmp_path / f"release-{version}.json"
    rel_file.write_text(json.dumps(release.with_mlflow(rel, reg.tracking_uri, model, version)))
    given = tmp_path / f"given-{version}.json"
    given.write_text(json.dumps(verdict))
    golden = tmp_path / "golden.json"
    golden.write_text(json.dumps(GOLDEN))
    gate = (f"{sys.executable} -c \"import os,shutil,sys,time; time.sleep({GATE_SECONDS}); "
            f"out=sys.argv[sys.argv.index('--out')+1]; shutil.copy('{given}', out); "
            f"shutil.copy('{golden}', os.path.join(os.path.dirname(out), 'golden_outputs.json'))\"")
    out = subprocess.run([sys.executable, "-m", "specpair_operator.gate.runner", "--release", str(rel_file),
                          "--gate-command", gate, "--termination-log", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return version


def test_the_gate_run_is_an_evaluation_and_the_version_carries_its_figures(reg, tmp_path):
    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")
    version = gate_with(reg, tmp_path, model, SPEC, VERDICT)
    client = reg.client
    tags = reg.version_tags(model, version)
    run = client.get_run(tags[TAG_GATE_RUN])

    # The golden prompts are the run's evaluation dataset, with the digest of their content.
    [inp] = run.inputs.dataset_inputs
    assert inp.dataset.name == GOLDEN_DATASET and inp.dataset.digest == prompts_digest(PROMPTS)
    assert {t.key: t.value for t in inp.tags}["mlflow.data.context"] == "eval"
    assert json.loads(inp.dataset.profile)["num_rows"] == 2
    # The release's settings and what the gate tuned, as parameters.
    params = run.data.params
    assert params["target"] == "HuggingFaceTB/SmolLM2-135M@r1" and params["draft"] == "drafter:ngram"
    assert params["tuned.k"] == "4" and params["tuned.batchSizeThreshold"] == "8"
    assert params["threshold.minSpeedup"] == "1.0" and params["threshold.minCategoryAcceptance.code"] == "0.5"
    assert params["speculation.k"] == str(release.SPECULATION_DEFAULTS["k"])
    # The run lasted as long as the gate did (it was written after the gate ended: 50 ms).
    assert (run.info.end_time - run.info.start_time) / 1000 >= GATE_SECONDS
    # The description states the verdict, the floors and the slowed category.
    description = run.data.tags[TAG_RUN_DESCRIPTION]
    assert "Gate passed" in description and "speedup.creative 0.92" in description
    assert "| speedup | >= 1.00x | 1.08x |" in description
    assert "| acceptance of code | >= 0.500 | 70.0% |" in description
    # The per-prompt results as a table MLflow's evaluation view reads.
    table = load_table(client, reg.tracking_uri, run.info.experiment_id, PER_PROMPT_TABLE, run.info.run_id)
    assert list(table.columns[:len(PER_PROMPT_COLUMNS)]) == list(PER_PROMPT_COLUMNS)
    assert table["speedup"].tolist() == [1.31, 0.92] and table["output_tokens"].tolist() == [4, 2]
    # The experiment opens on runs, not on MLflow 3's GenAI overview.
    assert client.get_experiment(run.info.experiment_id).tags[TAG_EXPERIMENT_KIND] == EXPERIMENT_KIND

    # The version: its logged model holds the headline figures, its description links the gate run.
    mv = client.get_model_version(model, version)
    model_id = logged_model_id(mv.source)
    assert model_id and client.get_run(mv.run_id).data.tags[TAG_LOGGED_MODEL] == model_id
    figures = {m.key: m.value for m in client.get_logged_model(model_id).metrics}
    assert figures["acceptance_rate.code"] == 0.7 and figures["speedup.creative"] == 0.92 and figures["passed"] == 1.0
    assert f"runs/{run.info.run_id})" in mv.description and "creative 12.0% / 0.92x" in mv.description
    assert f"(#/experiments/{run.info.experiment_id}?{RUNS_VIEW})" in mv.description   # opens on the runs
    assert tags[TAG_GATE_SUMMARY].startswith("passed: acceptance 41.0%, speedup 1.08x")
    # The release run holds the same settings, so MLflow's comparison of two versions lines them up.
    assert client.get_run(mv.run_id).data.params["target"] == params["target"]
    assert json.load(open(client.download_artifacts(mv.run_id, "release/release.json")))["pair"] == "p"


def test_the_golden_generations_are_traces_of_the_gate_run_with_their_timings(reg, tmp_path):
    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")
    version = gate_with(reg, tmp_path, model, SPEC, VERDICT)
    run = reg.client.get_run(reg.version_tags(model, version)[TAG_GATE_RUN])
    traces = reg.client.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id, include_spans=False)
    by_name = {t.info.tags["mlflow.traceName"]: t for t in traces}
    assert sorted(by_name) == ["golden 1: code", "golden 2: creative"]
    code = get_trace(reg.client, reg.tracking_uri, by_name["golden 1: code"].info.trace_id)
    assert (code.info.request_preview, code.info.response_preview) == ("def add(a, b):", " return a + b")
    assert code.info.tags["specpair.model_version"] == version and code.info.state.value == "OK"
    # The prompt's timings: target-only then speculative, each the median the gate measured.
    assert code.info.request_time == 1765000000250 and code.info.execution_duration == 462
    spans = {s.name: s for s in code.data.spans}
    assert sorted(spans) == ["golden 1: code", "speculative", "target-only"]
    assert (spans["target-only"].end_time_ns - spans["target-only"].start_time_ns) == 262_000_000
    assert spans["speculative"].start_time_ns == spans["target-only"].end_time_ns
    assert (spans["speculative"].end_time_ns - spans["speculative"].start_time_ns) == 200_000_000
    root = spans["golden 1: code"]
    assert root.parent_id is None and spans["speculative"].parent_id == root.span_id
    assert root.inputs == {"prompt": "def add(a, b):", "category": "code"}
    assert root.outputs["speedup"] == 1.31 and root.outputs["reply"] == " return a + b"
    assert spans["speculative"].attributes["specpair.acceptance_rate"] == 0.7


def test_a_golden_row_without_timings_is_a_trace_without_length_and_the_same_trace_twice():
    row = {k: v for k, v in GOLDEN[1].items() if k not in ("seconds", "started_at")}
    body, spans = golden_trace(row, 1, "7", "run1", "3", start_ms=1765000000000)
    info = body["trace"]["trace_info"]
    assert info["execution_duration"] == "0.000s" and info["request_time"] == "2025-12-06T05:46:40.000Z"
    assert info["trace_metadata"]["mlflow.sourceRun"] == "run1"
    assert {s["start_time_unix_nano"] for s in spans["spans"]} == {1765000000000 * 1_000_000}
    assert golden_trace(row, 1, "7", "run1", "3", 1765000000000) == (body, spans)
    assert golden_trace(row, 0, "7", "run1", "3", 1765000000000)[0] != body


def test_a_retried_record_finishes_the_gate_run_its_failed_try_made(reg, tmp_path, monkeypatch):
    """The runner tries a record again until its deadline. A try that failed halfway (MLflow did
    the write, its reply was lost) made the gate run: the retry finishes that run instead of
    making a second gate-vN beside it, with one dataset input and one trace per prompt."""
    from specpair_operator.gate.record import GateRecord

    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    version = reg.ensure_release(model, rel, release.content_hash(rel))
    golden = tmp_path / "golden_outputs.json"
    golden.write_text(json.dumps(GOLDEN))
    record = GateRecord(reg.tracking_uri)
    send, lost = record._send, []

    def reply_lost_once(method, url, **kwargs):
        out = send(method, url, **kwargs)
        if url.endswith("/api/3.0/mlflow/traces") and not lost:
            lost.append(url)
            raise RegistryUnavailable("the reply to the first trace was lost")
        return out
    monkeypatch.setattr(record, "_send", reply_lost_once)
    started_ms = int(time.time() * 1000) - 2000          # the runner's, the same for all its tries
    with pytest.raises(RegistryUnavailable):
        record.record_gate(model, version, VERDICT, [str(golden)], rel, started_ms)
    run_id = record.record_gate(model, version, VERDICT, [str(golden)], rel, started_ms)
    exp_id = reg.client.get_experiment_by_name(gate_experiment(model)).experiment_id
    [run] = reg.client.search_runs([exp_id], filter_string=f"tags.`mlflow.runName` = 'gate-v{version}'")
    assert run.info.run_id == run_id == reg.version_tags(model, version)[TAG_GATE_RUN]
    assert run.info.status == "FINISHED" and run.info.start_time == started_ms
    assert len(run.inputs.dataset_inputs) == 1
    assert len(reg.client.search_traces(locations=[exp_id], run_id=run_id, include_spans=False)) == len(GOLDEN)


def test_two_versions_compare_setting_by_setting_and_figure_by_figure(reg, tmp_path):
    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")
    v1 = gate_with(reg, tmp_path, model, SPEC, VERDICT)
    slower = {**VERDICT, "passed": False, "speedup": 0.8, "reasons": ["speedup 0.800x < minSpeedup 1.000x"]}
    v2 = gate_with(reg, tmp_path, model, {**SPEC, "speculation": {"k": 6}}, slower)
    runs = [reg.client.get_run(reg.client.get_model_version(model, v).run_id) for v in (v1, v2)]
    assert [r.data.params["speculation.k"] for r in runs] == [str(release.SPECULATION_DEFAULTS["k"]), "6"]
    assert [r.data.metrics["speedup"] for r in runs] == [1.08, 0.8]
    experiment = reg.client.get_experiment_by_name(gate_experiment(model))
    assert [r.info.experiment_id for r in runs] == [experiment.experiment_id] * 2
    assert reg.version_tags(model, v2)[TAG_GATE_SUMMARY].startswith("failed: ")
    gate_run = reg.client.get_run(reg.version_tags(model, v2)[TAG_GATE_RUN])
    description = gate_run.data.tags[TAG_RUN_DESCRIPTION]
    assert "Gate failed" in description and "- speedup 0.800x < minSpeedup 1.000x" in description


def test_the_description_names_every_floor_and_says_where_none_was_set():
    rel = release.build_release("p", "ns", {**SPEC, "gating": {"thresholds": {"minCategoryAcceptance": {"qa": 0.4}}}},
                                PROMPTS)
    low = {**VERDICT, "acceptanceRate": 0.036}
    text = gate_description(low, rel)
    assert "| acceptance | >= 0.000 | 3.6% |" in text and "| acceptance of qa | >= 0.400 | n/a |" in text
    assert "No floor set for minAcceptance: any figure passes it." in text
    # No minSpeedup: the default floor, target-only less the noise the gate measured.
    assert "| speedup | >= 1.00x (default: target-only less the 0.000 noise measured) | 1.08x |" in text
    noisy_off = {**low, "speedup": 0.9, "speedupNoise": 0.04, "bestSpeculation": {"batchSizeThreshold": 0}}
    assert ("| speedup | >= 0.96x (default: target-only less the 0.040 noise measured; slower: speculation "
            "shipped off) | 0.90x |") in gate_description(noisy_off, rel)
    named = release.build_release("p", "ns", {**SPEC, "gating": {"thresholds": {"minSpeedup": 0}}}, PROMPTS)
    assert "No floor set for minAcceptance and minSpeedup: any figure passes it." in gate_description(low, named)
    assert "speedup.creative 0.92" in text and "Tuned on this hardware: batchSizeThreshold = 8, k = 4." in text
    # A recorder not handed the release claims no floors it does not know.
    assert "| floor |" not in gate_description(low, None) and "not handed" in gate_description(low, None)


def test_a_release_with_more_settings_than_one_batch_takes_is_recorded_whole(reg, tmp_path):
    """The CRD bounds no spec's categories: 150 category floors are 150 parameters, more than one
    MLflow log-batch takes (100)."""
    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")
    floors = {f"cat{i:03d}": 0.0 for i in range(150)}
    version = gate_with(reg, tmp_path, model, {**SPEC, "gating": {"thresholds": {"minCategoryAcceptance": floors}}},
                        VERDICT)
    mv = reg.client.get_model_version(model, version)
    for run_id in (mv.run_id, reg.version_tags(model, version)[TAG_GATE_RUN]):
        params = reg.client.get_run(run_id).data.params
        assert params["threshold.minCategoryAcceptance.cat149"] == "0.0" and len(params) > 150
    assert len(reg.client.get_logged_model(logged_model_id(mv.source)).params) > 150
