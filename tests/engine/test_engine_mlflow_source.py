"""A release can point at models that live in MLflow: `models:/NAME/VERSION` loads as a directory."""

from __future__ import annotations

import os

import pytest


def test_models_uri_downloads_and_loads(tmp_path, tiny_pair_dirs, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from specpair.config import GenerationParams
    from specpair.decoding import SpeculativeEngine
    from specpair.models import load_model

    monkeypatch.setenv("SPECPAIR_CACHE", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # mlflow's global URI outlives the test in this worker, and the environment does not override
    # it: put back after the test (a later test once read a stopped server's through it, 04f9384).
    from mlflow.tracking._tracking_service import utils as tracking_utils
    monkeypatch.setattr(tracking_utils, "_tracking_uri", tracking_utils._tracking_uri)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.create_experiment("drafts", artifact_location=(tmp_path / "artifacts").as_uri())
    with mlflow.start_run(experiment_id=experiment) as run:
        mlflow.log_artifacts(tiny_pair_dirs["draft"], artifact_path="model")
    client = MlflowClient()
    client.create_registered_model("tiny-draft")
    client.create_model_version("tiny-draft", f"runs:/{run.info.run_id}/model", run.info.run_id)

    draft = load_model("models:/tiny-draft/1", device="cpu")
    target = load_model(tiny_pair_dirs["target"], device="cpu")
    assert os.path.isfile(os.path.join(draft.resolved_path, "config.json"))
    engine = SpeculativeEngine(target, draft=draft)
    base = SpeculativeEngine(target).generate(["def foo(x):"], GenerationParams(max_new_tokens=8),
                                              speculate=False)[0]
    spec = engine.generate(["def foo(x):"], GenerationParams(max_new_tokens=8))[0]
    assert spec.token_ids == base.token_ids and spec.stats.num_drafts > 0
    # Second load comes from the cache, not MLflow.
    again = load_model("models:/tiny-draft/1", device="cpu")
    assert again.resolved_path == draft.resolved_path
