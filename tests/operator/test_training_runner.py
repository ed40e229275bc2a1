"""The training Job's runner (gate/training_runner.py) against a real MLflow server, with tiny real
models and traffic captured by the engine's real CaptureWriter: `specpair distill --from-capture`
trains a draft for one category, the runner logs it and registers a new version that changes only
the draft side, with its lineage; the version's draft loads from MLflow as the engine loads it
and drafts for the target with outputs equal to target-only. A training without data registers
nothing and says why in its report."""

from __future__ import annotations

import json
import sys

import pytest
from mlflow.tracking._tracking_service.utils import _use_tracking_uri

from specpair.config import GenerationParams, SpeculationConfig
from specpair.contract import content_hash
from specpair.decoding import SpeculativeEngine
from specpair.models import load_model

from specpair_operator.clients.registry import ReleaseRegistry
from specpair_operator.desired import training_job
from specpair_operator.gate import training_runner
from specpair_operator.release import content as release_mod
from specpair_operator.release.registry_contract import TAG_RELEASE

from capture_data import EXTRACTION, extraction_prompts, write_capture   # tests/ is on sys.path

pytestmark = pytest.mark.slow   # a real MLflow server beside the test

DISTILL = f"{sys.executable} -m specpair distill"
# A tiny target learns in seconds from its own first layer (test_engine_distill.py's settings).
TINY = "--init truncate --layers 1 --hidden 64 --heads 4 --seq-len 48 --lr 3e-3 --eval-prompts 2"
GOLDEN = [{"prompt": EXTRACTION[0].format("def fill(text, width=70):\n    return text"), "category": "extraction"},
          {"prompt": "What is a list?", "category": "qa"}]


@pytest.fixture(scope="module")
def parent(tmp_path_factory, mlflow_server, tiny_pair_dirs, tiny_target):
    """The serving release v1 in MLflow (target and draft the tiny pair), its release file as a
    training pod gets it, and its captured traffic."""
    root = tmp_path_factory.mktemp("training")
    spec = {"target": {"source": tiny_pair_dirs["target"]}, "draft": {"source": tiny_pair_dirs["draft"]}}
    rel = release_mod.build_release("chat", "learning", spec, GOLDEN, default_image="engine:test")
    registry = ReleaseRegistry(mlflow_server.url)
    model = "learning.chat"
    registry.ensure_model(model, "learning/chat", "uid-1")
    version = registry.ensure_release(model, rel, content_hash(rel))
    path = root / "release.json"
    path.write_text(json.dumps(release_mod.with_mlflow(rel, mlflow_server.url, model, version)))
    capture = root / "capture"
    write_capture(capture, SpeculativeEngine(tiny_target, check_tokenizers=False),
                  {"extraction": extraction_prompts(24)}, release=version)
    return {"release": rel, "file": str(path), "version": version, "model": model, "capture": str(capture),
            "registry": registry, "root": root}


def _run(parent, category: str, out: str) -> tuple[int, dict]:
    log = parent["root"] / f"termination-{category}"
    log.write_text("")
    rc = training_runner.main(["--release", parent["file"], "--model", parent["model"], "--version", parent["version"],
                               "--capture-dir", parent["capture"], "--category", category, "--method", "draft",
                               "--steps", "60",
                               "--max-seconds", "120", "--out", out, "--device", "cpu",
                               "--distill-command", DISTILL, "--distill-args", TINY,
                               "--termination-log", str(log)])
    return rc, json.loads(log.read_text() or "{}")


def test_a_training_registers_a_draft_only_release_with_its_lineage(parent, mlflow_server, tiny_target, monkeypatch):
    rc, report = _run(parent, "extraction", str(parent["root"] / "out"))
    assert rc == 0, report
    # What the operator reads back from the Job (training_job.training_state).
    version = report[training_job.REPORT_VERSION]
    assert version != parent["version"] and "24 captured requests of 'extraction'" in report["summary"]
    tags = parent["registry"].version_tags(parent["model"], version)
    assert tags[training_runner.TAG_LINEAGE_RELEASE] == parent["version"]
    assert tags[training_runner.TAG_LINEAGE_RELEASE_HASH] == content_hash(parent["release"])
    assert tags[training_runner.TAG_LINEAGE_CATEGORY] == "extraction"
    captured = json.loads(tags[training_runner.TAG_LINEAGE_CAPTURE])
    assert captured["requests"] == 24 and captured["releases"] == [parent["version"]], captured
    assert tags["specpair.gate.status"] == "pending"      # the usual road starts at the gate
    # Only the draft side changed.
    learned = json.loads(tags[TAG_RELEASE])
    run = tags[training_runner.TAG_LINEAGE_RUN]
    assert learned["draft"] == {"source": f"runs:/{run}/draft", "revision": None}
    assert {k: v for k, v in learned.items() if k != "draft"} == \
        {k: v for k, v in parent["release"].items() if k != "draft"}
    # The draft loads from MLflow as an engine pod loads it, and drafts for the target. A pod has
    # only MLFLOW_TRACKING_URI; in this worker an earlier test may have set mlflow's global
    # tracking URI to a server of its own since stopped, which the variable does not override
    # (CI at 33e8b32: "connection refused" on another test's port), so the URI is set for the load.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.setenv("SPECPAIR_CACHE", str(parent["root"] / "cache"))
    with _use_tracking_uri(mlflow_server.url):
        draft = load_model(learned["draft"]["source"], device="cpu", progress=lambda *_: None)
    engine = SpeculativeEngine(tiny_target, draft=draft, speculation=SpeculationConfig(k=4, fallback_threshold=0.0))
    prompts = extraction_prompts(26)[24:]     # not trained on
    params = GenerationParams(max_new_tokens=24)
    spec = engine.generate(prompts, params, chat=True)
    assert [r.token_ids for r in spec] == [r.token_ids for r in engine.generate(prompts, params, chat=True,
                                                                                 speculate=False)]
    assert sum(r.stats.num_draft_tokens for r in spec) > 0


def test_a_training_without_data_registers_nothing_and_says_why(parent):
    before = parent["registry"].count_versions(parent["model"])
    rc, report = _run(parent, "code", str(parent["root"] / "out-code"))
    assert rc == 1
    assert "no captured requests of category 'code'" in report["error"], report
    assert parent["registry"].count_versions(parent["model"]) == before


def test_the_learned_release_scores_its_category_in_the_format_it_was_served_in():
    """A category served as plain completions (chat share 0) gets golden prompts that say so;
    the other categories, prompts with tools (the template renders them) and a category served
    as the release's gating.chat says keep their prompts (and so the release's hash)."""
    release = {"target": {"source": "t"}, "draft": {"drafter": "ngram"}, "mlflow": {"trackingUri": "x"},
               "gating": {"prompts": [{"prompt": "a", "category": "code"}, {"prompt": "b", "category": "qa"},
                                      {"prompt": "c", "category": "code", "tools": [{"type": "function"}]}]}}
    plain = training_runner.learned_release(release, "r1", "draft", "code", 0.1)
    assert [p.get("chat") for p in plain["gating"]["prompts"]] == [False, None, None]
    assert plain["draft"] == {"source": "runs:/r1/draft", "revision": None} and "mlflow" not in plain
    assert release["gating"]["prompts"][0] == {"prompt": "a", "category": "code"}    # not changed in place
    chat = training_runner.learned_release(release, "r1", "draft", "code", 0.9)
    unknown = training_runner.learned_release(release, "r1", "draft", "code", None)
    assert chat == unknown and all("chat" not in p for p in chat["gating"]["prompts"])
    # A release gated as plain completions, its category served chat-formatted: that prompt says chat.
    as_plain = {**release, "gating": {**release["gating"], "chat": False}}
    served_chat = training_runner.learned_release(as_plain, "r1", "draft", "code", 1.0)
    assert [p.get("chat") for p in served_chat["gating"]["prompts"]] == [True, None, None]
