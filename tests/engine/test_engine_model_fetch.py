"""`specpair fetch-models` against a real MLflow server (with basic auth), then an engine loading
the release from that cache with HF_HUB_OFFLINE=1 and MLflow out of reach."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from specpair import cli, model_fetch
from specpair.config import GenerationParams, Release
from specpair.errors import SpecpairError

# Nothing listens here: an engine that asked MLflow for a model would fail.
UNREACHABLE_MLFLOW = "http://127.0.0.1:9"


ADMIN = ("admin", "admin-pw-" + uuid.uuid4().hex[:12])
CREDENTIALS = {"MLFLOW_TRACKING_USERNAME": ADMIN[0], "MLFLOW_TRACKING_PASSWORD": ADMIN[1]}


@pytest.fixture(scope="module")
def registry(tmp_path_factory, tiny_pair_dirs):
    """A real `mlflow server` with basic auth (anonymous requests refused), the tiny target and
    draft registered as models (version 1 each) and a model version whose artifacts hold no
    model; MLFLOW_TRACKING_URI and the admin's credentials in the environment, as the fetch Job
    gets them."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow_server import MlflowServer, basic_auth_config

    root = tmp_path_factory.mktemp("mlflow")
    server = MlflowServer(root, args=("--app-name", "basic-auth"),
                          env=basic_auth_config(root, ADMIN, default_permission="READ"))
    server.start()
    env = {"MLFLOW_TRACKING_URI": server.url, **CREDENTIALS}
    old = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    from mlflow.tracking._tracking_service import utils as tracking_utils
    old_uri = tracking_utils._tracking_uri
    mlflow.set_tracking_uri(server.url)
    try:
        client = MlflowClient(server.url)
        experiment = client.create_experiment("fetch")
        for name, folder in (("tiny-target", tiny_pair_dirs["target"]), ("tiny-draft", tiny_pair_dirs["draft"]),
                             ("not-a-model", None)):
            run = client.create_run(experiment)
            if folder is None:
                notes = tmp_path_factory.mktemp("notes") / "README.txt"
                notes.write_text("no weights here")
                client.log_artifact(run.info.run_id, str(notes), artifact_path="model")
            else:
                client.log_artifacts(run.info.run_id, folder, artifact_path="model")
            client.set_terminated(run.info.run_id)
            client.create_registered_model(name)
            client.create_model_version(name, f"runs:/{run.info.run_id}/model", run.info.run_id)
        yield server
    finally:
        # mlflow's global URI outlives this module in the worker and the environment does not
        # override it: a later test would read this stopped server through it (as 04f9384 saw).
        mlflow.set_tracking_uri(old_uri)
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


def _release(target: str, draft: str | None) -> dict:
    return {"pair": "fetched", "namespace": "ns",
            "target": {"source": target, "revision": None},
            "draft": {"source": draft, "revision": None} if draft else {"drafter": "ngram"},
            "speculation": {"k": 3, "dynamicK": False, "fallbackThreshold": 0.5, "batchSizeThreshold": 8}}


def models_in(cache: Path) -> list[str]:
    """What the MLflow models' folder holds besides its lock files (a staging folder included)."""
    return sorted(p.name for p in (cache / "specpair-mlflow").iterdir() if not p.name.endswith(".lock"))


def _fetch_cli(release: dict, cache: Path, tmp_path: Path) -> tuple[int, dict]:
    release_file = tmp_path / "release.json"
    release_file.write_text(json.dumps(release))
    log = tmp_path / "termination-log"
    rc = cli.main(["fetch-models", "--release", str(release_file), "--cache-dir", str(cache),
                   "--termination-log", str(log)])
    return rc, json.loads(log.read_text())


@pytest.mark.slow   # starts an MLflow server (about 20 s on 2 cores; the other tests on it are slow too)
def test_fetch_then_serve_offline_from_the_cache(registry, tiny_pair_dirs, tmp_path, monkeypatch, capsys):
    from specpair.pair import load_pair

    cache = tmp_path / "hub"
    # What a fetch killed mid-download leaves: a staging folder, never taken for the model.
    stale = cache / "specpair-mlflow" / ".staging-models_tiny-target_1-0dead0"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{")
    release = _release("models:/tiny-target/1", "models:/tiny-draft/1")
    rc, report = _fetch_cli(release, cache, tmp_path)
    assert rc == 0 and report["fetched"] == 2 and report["present"] == 0
    assert models_in(cache) == ["models_tiny-draft_1", "models_tiny-target_1"]
    assert report["digest"] == Release.from_dict(release).content_hash
    marker = json.loads((cache / ".specpair" / "releases" / f"{report['digest']}.json").read_text())
    assert [m["role"] for m in marker["models"]] == ["target", "draft"]
    assert all(m["outcome"] == "fetched" and (cache / m["path"] / "config.json").is_file() for m in marker["models"])
    assert model_fetch.is_complete(release, cache)

    # Again, with MLflow out of reach: both are present, nothing is downloaded.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", UNREACHABLE_MLFLOW)
    rc, again = _fetch_cli(release, cache, tmp_path)
    assert rc == 0 and again == {"digest": report["digest"], "fetched": 0, "present": 2}

    # An engine pod's view: the cache as HF_HUB_CACHE, offline, MLflow unreachable, an empty own cache.
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPECPAIR_CACHE", str(tmp_path / "pod-cache"))
    engine = load_pair(replace(Release.from_dict(release).pair, device="cpu"), progress=lambda m: None)
    assert engine.target.resolved_path.startswith(str(cache / "specpair-mlflow"))
    assert not (tmp_path / "pod-cache" / "mlflow").exists()
    params = GenerationParams(max_new_tokens=12)
    served = engine.generate(["def foo(x):"], params)[0]
    local = Release.from_dict(_release(tiny_pair_dirs["target"], tiny_pair_dirs["draft"])).pair
    direct = load_pair(replace(local, device="cpu"), progress=lambda m: None)
    assert served.token_ids == direct.generate(["def foo(x):"], params, speculate=False)[0].token_ids
    assert served.stats.num_drafts > 0


@pytest.mark.slow
def test_a_missing_model_names_itself_and_marks_nothing(registry, tmp_path, capsys):
    cache = tmp_path / "hub"
    release = _release("models:/tiny-target/1", "models:/no-such-draft/4")
    rc, report = _fetch_cli(release, cache, tmp_path)
    assert rc == 2
    err = capsys.readouterr().err
    assert "draft models:/no-such-draft/4 from MLflow" in err and registry.url in err
    assert "draft models:/no-such-draft/4 from MLflow" in report["error"]
    assert report["digest"] == Release.from_dict(release).content_hash
    assert not (cache / ".specpair" / "releases").exists()
    assert not model_fetch.is_complete(release, cache)
    # The target that did arrive is kept (and skipped next time); no staging folder is left behind.
    assert models_in(cache) == ["models_tiny-target_1"]


@pytest.mark.slow
def test_artifacts_without_a_model_never_look_complete(registry, tmp_path):
    cache = tmp_path / "hub"
    with pytest.raises(SpecpairError, match=r"target models:/not-a-model/1 from MLflow: its artifacts hold no "
                                            r"config\.json"):
        model_fetch.fetch_models(_release("models:/not-a-model/1", None), cache, progress=lambda m: None)
    assert models_in(cache) == []
    assert not (cache / ".specpair").exists()


def test_hub_model_unreachable_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    # HF_HUB_OFFLINE=1 as huggingface_hub read it at import (this process imported it already).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    release = _release("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    release["target"]["revision"] = "12fd25f77366fa6b3b4b768ec3050bf629380bac"
    with pytest.raises(SpecpairError, match=r"cannot fetch target HuggingFaceTB/SmolLM2-135M-Instruct at revision "
                                            r"12fd25f7\w+ from the Hugging Face hub: "):
        model_fetch.fetch_models(release, tmp_path / "hub", progress=lambda m: None)
    assert not (tmp_path / "hub" / ".specpair").exists()


def test_sources_that_need_no_fetch(tmp_path, tiny_pair_dirs):
    """The embedded default, a model-free drafter and a path in the image are left where they are;
    a path the image lacks is refused as the engine would refuse it."""
    report = model_fetch.fetch_models(_release("default", tiny_pair_dirs["draft"]), tmp_path / "hub",
                                      progress=lambda m: None)
    assert [(m["role"], m["outcome"], m["kind"]) for m in report["models"]] == [
        ("target", "image", "default"), ("draft", "image", "local")]
    with pytest.raises(SpecpairError, match="draft /nowhere/model: model path not found"):
        model_fetch.release_models(_release("default", "/nowhere/model"))
    fetch, _ = model_fetch.release_models({"target": {"source": "org/model", "revision": "v1"},
                                           "draft": {"source": "models:/d/2"}})
    assert [(m.role, m.kind, m.revision) for m in fetch] == [("target", "hub", "v1"), ("draft", "mlflow", None)]


def test_flags_instead_of_a_release_file(tmp_path):
    with pytest.raises(SpecpairError, match="not both"):
        model_fetch.release_of(release_file="r.json", target="x")
    assert model_fetch.release_of(target="org/m", target_revision="abc") == {
        "target": {"source": "org/m", "revision": "abc"}, "draft": {}}


@pytest.mark.slow
def test_mlflow_credentials_come_from_the_environment(registry, tmp_path, monkeypatch):
    """As the fetch Job gets them (MLFLOW_TRACKING_USERNAME/PASSWORD from the pair's Secret):
    without them MLflow refuses and the error says so; with them the model arrives."""
    release = _release("models:/tiny-target/1", None)
    for name in CREDENTIALS:
        monkeypatch.delenv(name)
    with pytest.raises(SpecpairError, match=r"cannot fetch target models:/tiny-target/1 from MLflow "
                                            r"\(http://127\.0\.0\.1:\d+\): .*(401|[Uu]nauthori[sz]ed|credentials)"):
        model_fetch.fetch_models(release, tmp_path / "hub", progress=lambda m: None)
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    report = model_fetch.fetch_models(release, tmp_path / "hub", progress=lambda m: None)
    assert [m["outcome"] for m in report["models"]] == ["fetched"]
