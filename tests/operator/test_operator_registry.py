"""The MLflow release registry against a real `mlflow server` (sqlite, loopback)."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from mlflow_server import get_trace, load_table  # tests/ is on sys.path (tests/conftest.py)

from specpair_operator.release import aliases, content as release
from specpair_operator.gate import attempts as gate_attempts
from specpair_operator.clients.registry import ReleaseRegistry
from specpair_operator.release.registry_contract import (PER_PROMPT_TABLE, TAG_GATE_RUN, TAG_GATE_STATUS,
                                                         TAG_TOKENIZER_TARGET, RegistryUnavailable, find_or_create,
                                                         gate_experiment)

SPEC = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "r1"}, "draft": {"drafter": "ngram"}}
PROMPTS = [{"prompt": "def add(a, b):", "category": "code"}]
VERDICT = {"passed": True, "reasons": [], "greedyIdentity": 1.0, "acceptanceRate": 0.62, "speedup": 1.3,
           "meanAcceptanceLength": 2.1, "categories": {"code": {"acceptanceRate": 0.7, "speedup": 1.4}},
           "acceptancePerPosition": [0.8, 0.6, 0.4], "kSweep": [{"k": 2, "speedup": 1.2}, {"k": 4, "speedup": 1.3}],
           "bestSpeculation": {"k": 4, "batchSizeThreshold": 8},
           "tokenizer": {"compatible": True, "differences": [], "targetFingerprint": "a" * 64, "draftFingerprint": None},
           "mlflowRunId": None, "device": "cpu"}


def test_same_release_same_version_new_content_new_version(reg):
    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")
    reg.ensure_model(model, "ns/p")  # idempotent
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    digest = release.content_hash(rel)
    v1 = reg.ensure_release(model, rel, digest)
    assert reg.ensure_release(model, rel, digest) == v1
    assert ReleaseRegistry(reg.tracking_uri).ensure_release(model, rel, digest) == v1  # a "restarted operator"
    rel2 = release.build_release("p", "ns", {**SPEC, "speculation": {"k": 6}}, PROMPTS)
    v2 = reg.ensure_release(model, rel2, release.content_hash(rel2))
    assert v2 != v1 and reg.count_versions(model) == 2
    mv = reg.client.get_model_version(model, v1)
    assert mv.tags["specpair.content_hash"] == digest and mv.tags["specpair.target.revision"] == "r1"
    assert "HuggingFaceTB/SmolLM2-135M" in mv.description and digest in mv.description
    # the release JSON is stored as an artifact of the release run
    path = reg.client.download_artifacts(mv.run_id, "release/release.json")
    assert json.load(open(path)) == rel


def test_aliases_follow_the_promotion_plan(reg):
    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")
    versions = []
    for k in (2, 3):
        rel = release.build_release("p", "ns", {**SPEC, "speculation": {"k": k}}, PROMPTS)
        versions.append(reg.ensure_release(model, rel, release.content_hash(rel)))
    for v in versions:
        for move in aliases.plan_promotion(reg.aliases(model), v):
            reg.set_alias(model, move.alias, move.version)
    assert reg.aliases(model) == {"champion": versions[1], "previous": versions[0]}
    for move in aliases.plan_rollback(reg.aliases(model)):
        reg.set_alias(model, move.alias, move.version)
    assert reg.aliases(model)["champion"] == versions[0]


def test_gate_runner_records_the_run_metrics_and_verdict_on_the_version(reg, tmp_path):
    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    version = reg.ensure_release(model, rel, release.content_hash(rel))
    assert reg.gate_result(model, version)[0] == "pending"
    rel_file = tmp_path / "release.json"
    rel_file.write_text(json.dumps(release.with_mlflow(rel, reg.tracking_uri, model, version)))
    # A gate command that writes a given verdict: the runner's job is recording, tested here.
    verdict_file = tmp_path / "given.json"
    verdict_file.write_text(json.dumps(VERDICT))
    gate = f"{sys.executable} -c \"import shutil,sys; shutil.copy('{verdict_file}', sys.argv[sys.argv.index('--out')+1])\""
    termination = tmp_path / "termination-log"
    termination.write_text("")        # the kubelet creates it before the container starts
    out = subprocess.run([sys.executable, "-m", "specpair_operator.gate.runner", "--release", str(rel_file),
                          "--gate-command", gate, "--termination-log", str(termination)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    status, verdict, _ = reg.gate_result(model, version)
    assert status == "passed" and verdict["acceptanceRate"] == 0.62
    tags = reg.version_tags(model, version)
    assert tags[TAG_TOKENIZER_TARGET] == "a" * 64
    run = reg.client.get_run(tags[TAG_GATE_RUN])
    assert run.data.metrics["acceptance_rate.code"] == 0.7 and run.data.metrics["speedup"] == 1.3
    history = reg.client.get_metric_history(run.info.run_id, "acceptance_per_position")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(0, 0.8), (1, 0.6), (2, 0.4)]
    assert "gate" in [a.path for a in reg.client.list_artifacts(run.info.run_id)]

    # A crashing gate is no verdict: the version keeps what it had, the cause and the gate's stderr
    # go to the termination message (the operator runs the gate again), and the exit is non-zero.
    crash = f"{sys.executable} -c \"import sys; sys.exit('model download failed: 404')\""
    out = subprocess.run([sys.executable, "-m", "specpair_operator.gate.runner", "--release", str(rel_file),
                          "--gate-command", crash, "--termination-log", str(termination)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert reg.gate_result(model, version)[0] == "passed"
    report = json.loads(termination.read_text())
    assert report["version"] == str(version) and report["cause"] == gate_attempts.GATE_CRASHED
    assert "model download failed: 404" in report["error"]
    # The gate's own progress reaches the Job's log (streamed, not swallowed).
    assert "model download failed: 404" in out.stderr


def test_unreachable_mlflow_raises_registry_unavailable_quickly():
    import time

    t0 = time.monotonic()
    with pytest.raises(RegistryUnavailable):
        ReleaseRegistry("http://127.0.0.1:9", attempts=2, backoff_s=0.05).aliases("x")
    assert time.monotonic() - t0 < 15


def test_a_lost_create_race_reads_the_winners_experiment_through_either_client(reg):
    """The operator (MlflowClient) and the gate runner (REST) each find or create a pair's
    experiment. When the other writer's create lands between a find and a create, the real
    server refuses the second create with RESOURCE_ALREADY_EXISTS on both clients, and the
    winner's experiment is found again; another refusal is raised after one find."""
    from mlflow.exceptions import RestException

    from specpair_operator.gate.record import GateRecord, MlflowRefused

    gate = GateRecord(reg.tracking_uri)
    model = f"m-{uuid.uuid4().hex[:6]}"
    name = gate_experiment(model)
    winner = reg.client.create_experiment(name)

    def lost_race(find):
        """`find`, answering nothing the first time: the winner's create came just after it."""
        calls = []

        def first_misses():
            calls.append(name)
            return None if len(calls) == 1 else find()
        return first_misses, calls

    by_client, client_finds = lost_race(lambda: reg.client.get_experiment_by_name(name).experiment_id)
    assert find_or_create(by_client, lambda: reg.client.create_experiment(name)) == winner
    by_rest, rest_finds = lost_race(lambda: gate._api("GET", "experiments/get-by-name",
                                                      params={"experiment_name": name})["experiment"]["experiment_id"])
    assert find_or_create(by_rest, lambda: gate._api("POST", "experiments/create", {"name": name})["experiment_id"]) \
        == winner
    assert len(client_finds) == len(rest_finds) == 2
    # Both adapters' own paths agree on it.
    assert reg._experiment(model) == gate._experiment(name) == winner

    # An empty name is refused as invalid, not as a race: raised, with no second find.
    finds = []
    with pytest.raises(RestException) as refused:
        find_or_create(lambda: finds.append("client"), lambda: reg.client.create_experiment(""))
    assert refused.value.error_code == "INVALID_PARAMETER_VALUE"
    with pytest.raises(MlflowRefused) as refused:
        find_or_create(lambda: finds.append("rest"),
                       lambda: gate._api("POST", "experiments/create", {"name": ""})["experiment_id"])
    assert refused.value.error_code == "INVALID_PARAMETER_VALUE" and finds == ["client", "rest"]


class CountingClient:
    """The real MlflowClient, with each method's calls counted (what reaches the server)."""

    def __init__(self, client):
        self.client, self.calls = client, {}

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return method(*args, **kwargs)
        return counted


def test_a_pass_reads_aliases_and_tags_once_and_sees_its_own_writes(reg):
    model = f"m-{uuid.uuid4().hex[:6]}"
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    reg.ensure_model(model, "ns/p")
    version = reg.ensure_release(model, rel, release.content_hash(rel))
    reg.set_alias(model, "champion", version)
    reg.client = counting = CountingClient(reg.client)

    reads = reg.for_pass()
    reads.ensure_model(model, "ns/p")
    assert reads.aliases(model) == reads.aliases(model) == {"champion": version}
    assert reads.gate_result(model, version) == ("pending", None, "")
    assert reads.version_tags(model, version)["specpair.content_hash"] == release.content_hash(rel)
    assert counting.calls == {"get_registered_model": 1, "get_model_version": 1}

    # Its own writes are read back, from MLflow.
    reads.set_tags(model, version, {TAG_GATE_STATUS: "error"})
    assert reads.gate_result(model, version)[0] == "error"
    reads.set_alias(model, "candidate", version)
    assert reads.aliases(model) == {"champion": version, "candidate": version}
    assert counting.calls["get_model_version"] == 2 and counting.calls["get_registered_model"] == 2

    # Another writer (the gate) is seen by the next pass, not by this one.
    reg.set_tags(model, version, {TAG_GATE_STATUS: "passed"})
    assert reads.gate_result(model, version)[0] == "error"
    assert reg.for_pass().gate_result(model, version)[0] == "passed"


def test_a_pass_answers_what_it_has_read_where_it_runs(reg):
    """A read the pass's view already holds is answered on the event loop, not on a thread (seven
    hops to a thread and back a settled pass cost more CPU than its answers); one it does not hold
    asks MLflow on a thread (MLflow's client blocks)."""
    import asyncio
    import threading

    model = f"m-{uuid.uuid4().hex[:6]}"
    rel = release.build_release("p", "ns", SPEC, PROMPTS)
    reg.ensure_model(model, "ns/p")
    version = reg.ensure_release(model, rel, release.content_hash(rel))
    reads = reg.for_pass()
    asked_on: list[str] = []
    tags_of = reads.version_tags
    reads.version_tags = lambda m, v: (asked_on.append(threading.current_thread().name), tags_of(m, v))[1]

    async def twice() -> tuple[dict, dict]:
        assert not reads.answered("version_tags", model, version)
        first = await reads.read("version_tags", model, version)
        assert reads.answered("version_tags", model, version) and reads.answered("gate_result", model, version)
        return first, await reads.read("version_tags", model, version)

    first, second = asyncio.run(twice())
    assert first == second and first["specpair.content_hash"] == release.content_hash(rel)
    here = threading.current_thread().name
    assert asked_on[0] != here and asked_on[1] == here, asked_on
    assert not reads.answered("aliases", model)

    # A function that reads through the view: here while its reads are held, on a thread from
    # the first that is not (the aliases, not read yet), and then with MLflow's answer.
    ran_on: list[str] = []

    def champion_tags(v: str) -> tuple[dict, dict]:
        ran_on.append(threading.current_thread().name)
        return reads.version_tags(model, v), reads.aliases(model)

    assert asyncio.run(reads.local_first(reads.version_tags, model, version)) == first
    tags, aliases_read = asyncio.run(reads.local_first(champion_tags, version))
    assert tags == first and aliases_read == {} and ran_on[0] == here and ran_on[1] != here, ran_on
    ran_on.clear()
    asyncio.run(reads.local_first(champion_tags, version))
    assert ran_on == [here]


def test_gate_record_writes_through_a_server_that_does_not_proxy_artifacts(tmp_path):
    """The gate runner records over MLflow's REST API; where the server hands out artifact URIs it
    does not proxy (here a local path: `--no-serve-artifacts`), the files go through MLflow's own
    artifact repositories. A refusal is MlflowRefused with MLflow's code; no server at all is
    RegistryUnavailable (what the runner retries)."""
    from mlflow_server import MlflowServer
    from specpair_operator.gate.record import GateRecord, MlflowRefused

    server = MlflowServer(tmp_path, args=("--no-serve-artifacts", "--default-artifact-root", str(tmp_path / "store")))
    server.start()
    try:
        reg = ReleaseRegistry(server.url)
        model = f"m-{uuid.uuid4().hex[:6]}"
        reg.ensure_model(model, "ns/p")
        rel = release.build_release("p", "ns", SPEC, PROMPTS)
        version = reg.ensure_release(model, rel, release.content_hash(rel))
        extra = tmp_path / "divergence.json"
        extra.write_text("{}")
        golden = tmp_path / "golden_outputs.json"
        golden.write_text(json.dumps([{"prompt": "def add(a, b):", "category": "code", "speculative": " return a",
                                       "target_only": " return a", "seconds": {"target_only": 0.3, "speculative": 0.2}}]))
        run_id = GateRecord(server.url).record_gate(model, version, VERDICT, [str(extra), str(golden)])
        status, verdict, _ = reg.gate_result(model, version)
        assert status == "passed" and verdict["mlflowRunId"] == run_id
        run = reg.client.get_run(run_id)
        assert not run.info.artifact_uri.startswith("mlflow-artifacts:") and run.info.status == "FINISHED"
        assert sorted(a.path for a in reg.client.list_artifacts(run_id, "gate")) == \
            ["gate/divergence.json", "gate/golden_outputs.json", "gate/per_prompt.json", "gate/verdict.json"]
        # The golden prompt's trace: its spans went to the trace's own (unproxied) artifact location.
        [trace] = reg.client.search_traces(locations=[run.info.experiment_id], run_id=run_id, include_spans=False)
        assert sorted(s.name for s in get_trace(reg.client, reg.tracking_uri, trace.info.trace_id).data.spans) == \
            ["golden 1: code", "speculative", "target-only"] and trace.info.execution_duration == 500
        assert run.data.metrics["acceptance_rate.code"] == 0.7
        with pytest.raises(MlflowRefused) as refused:
            GateRecord(server.url).record_gate_error(model, "999", "no such version")
        assert refused.value.error_code == "RESOURCE_DOES_NOT_EXIST"
    finally:
        server.stop()
    with pytest.raises(RegistryUnavailable):
        GateRecord(server.url, timeout_s=2).record_gate_error(model, version, "server gone")


def test_the_runner_forks_its_own_specpair_and_runs_anything_else(monkeypatch, tmp_path):
    """`specpair gate` of this interpreter runs as a forked child (what it imported is the gate's
    start); any other command is started as it is."""
    from specpair_operator.gate.runner import own_specpair_arguments

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "specpair").write_text(f"#!{sys.executable}\nfrom specpair.cli import main\n")
    (mine / "specpair").chmod(0o755)
    monkeypatch.setenv("PATH", str(mine) + os.pathsep + os.environ["PATH"])
    assert own_specpair_arguments(["specpair", "gate", "--device", "cpu"]) == ["gate", "--device", "cpu"]
    assert own_specpair_arguments([sys.executable, "-m", "specpair", "gate"]) == ["gate"]
    # Another virtualenv's python is a link to the same base interpreter, with other packages.
    other = tmp_path / "other"
    other.mkdir()
    (other / "python").symlink_to(Path(sys.executable).resolve())
    (other / "specpair").write_text(f"#!{other / 'python'}\n")
    (other / "specpair").chmod(0o755)
    assert own_specpair_arguments([str(other / "python"), "-m", "specpair", "gate"]) is None
    assert own_specpair_arguments([sys.executable, "gate_standin.py"]) is None
    assert own_specpair_arguments([sys.executable, "-m", "specpair_operator.gate.runner"]) is None
    assert own_specpair_arguments(["no-such-program", "gate"]) is None and own_specpair_arguments([]) is None
    monkeypatch.setenv("PATH", str(other) + os.pathsep + os.environ["PATH"])
    assert own_specpair_arguments(["specpair", "gate"]) is None      # a `specpair` of another environment


def test_a_forked_real_gate_is_recorded_and_its_crash_reported(reg, tmp_path, tiny_pair_dirs, monkeypatch):
    """The real `specpair gate` on tiny models, forked by the runner: its verdict lands on the
    version in MLflow; a release the gate refuses is a crash with the gate's own message."""
    model = f"m-{uuid.uuid4().hex[:6]}"
    reg.ensure_model(model, "ns/p")
    spec = {"target": {"source": tiny_pair_dirs["target"]}, "draft": {"source": tiny_pair_dirs["draft"]},
            "speculation": {"k": 3, "dynamicK": False},
            "gating": {"maxNewTokens": 8, "chat": False, "tuning": {"kValues": [], "batchSizes": []},
                       "thresholds": {"requireGreedyIdentity": True, "minAcceptance": 0.0, "minSpeedup": 0.0}}}
    rel = release.build_release("p", "ns", spec, PROMPTS)
    version = reg.ensure_release(model, rel, release.content_hash(rel))
    rel_file = tmp_path / "release.json"
    rel_file.write_text(json.dumps(release.with_mlflow(rel, reg.tracking_uri, model, version)))
    termination = tmp_path / "termination-log"
    termination.write_text("")
    runner = [sys.executable, "-m", "specpair_operator.gate.runner", "--release", str(rel_file),
              "--gate-command", f"{sys.executable} -m specpair gate --device cpu", "--termination-log", str(termination)]
    out = subprocess.run(runner, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "forked" in out.stderr
    status, verdict, _ = reg.gate_result(model, version)
    assert status == "passed" and verdict["greedyIdentity"] == 1.0
    assert json.loads(termination.read_text())["passed"] is True
    # The real gate's per-prompt results reach the run's table (docs/mlflow.md), measured.
    run = reg.client.get_run(reg.version_tags(model, version)[TAG_GATE_RUN])
    table = load_table(reg.client, reg.tracking_uri, run.info.experiment_id, PER_PROMPT_TABLE, run.info.run_id)
    assert table["category"].tolist() == ["code"] and table["identical"].tolist() == [True]
    assert 0 < table["output_tokens"][0] <= 8 and table["speedup"][0] > 0 and 0 <= table["acceptance"][0] <= 1
    # Its generation as a trace of the run, timed as the gate timed it (inside the gate's run).
    [trace] = reg.client.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id, include_spans=False)
    spans = {s.name: s for s in get_trace(reg.client, reg.tracking_uri, trace.info.trace_id).data.spans}
    assert sorted(spans) == ["golden 1: code", "speculative", "target-only"]
    assert all(s.end_time_ns > s.start_time_ns for s in spans.values())
    assert run.info.start_time <= trace.info.request_time and \
        trace.info.request_time + trace.info.execution_duration <= run.info.end_time
    # Greedy identity 1.0: the reply served is target-only's.
    assert spans["target-only"].outputs["reply"] == spans["speculative"].outputs["reply"] == trace.info.response_preview

    broken = release.with_mlflow({**rel, "draft": {}}, reg.tracking_uri, model, version)
    rel_file.write_text(json.dumps(broken))
    out = subprocess.run(runner, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    report = json.loads(termination.read_text())
    assert report["cause"] == gate_attempts.GATE_CRASHED and "release.draft needs 'source'" in report["error"]
    assert reg.gate_result(model, version)[0] == "passed"          # the version keeps its verdict
