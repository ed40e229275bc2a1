"""Distillation on tiny models: loss falls, acceptance rises, runs are reproducible and resumable."""

from __future__ import annotations

import json

import pytest

from specpair.distill import DistillConfig, corpus_texts, distill
from specpair.errors import SpecpairError
from specpair.models import load_model


def _config(out, **kw):
    # The tiny random teacher is chaotic, so a student from scratch learns it slowly; starting
    # from its first layer (the "truncate" init) shows the effect in a few seconds.
    base = dict(out=str(out), steps=300, batch_size=4, seq_len=48, layers=1, hidden=64, heads=4,
                lr=3e-3, seed=3, checkpoint_every=10, corpus_chars=120_000, eval_prompts=4,
                eval_tokens=24, init="truncate")
    base.update(kw)
    return DistillConfig(**base)


def test_distill_improves_draft_and_output_loads(tmp_path, tiny_target):
    summary = distill(_config(tmp_path / "draft"), teacher=tiny_target, progress=lambda *_: None)
    assert summary["loss_last10"] < 0.7 * summary["loss_first10"], summary
    assert summary["acceptance_after"] > summary["acceptance_before"], summary
    # The output is a model directory the engine loads as a draft for the same tokenizer.
    draft = load_model(str(tmp_path / "draft"), device="cpu")
    assert draft.num_parameters == summary["parameters"]
    saved = json.loads((tmp_path / "draft" / "distill_summary.json").read_text())
    assert saved["acceptance_after"] == summary["acceptance_after"]


def test_distill_is_reproducible_and_resumes_exactly(tmp_path, tiny_target):
    quiet = lambda *_: None  # noqa: E731
    full = distill(_config(tmp_path / "a", steps=20, eval_prompts=0), teacher=tiny_target, progress=quiet)
    partial = distill(_config(tmp_path / "b", steps=20, eval_prompts=0), teacher=tiny_target,
                      progress=quiet, stop_after=13)
    assert partial == {"stopped_at": 13}
    resumed = distill(_config(tmp_path / "b", steps=20, eval_prompts=0), teacher=tiny_target, progress=quiet)
    history_a = json.loads((tmp_path / "a" / "distill_summary.json").read_text())
    assert resumed["loss_last10"] == full["loss_last10"]
    assert resumed["loss_first10"] == full["loss_first10"]
    assert history_a["steps"] == 20


def test_distill_rejects_bad_settings(tmp_path):
    with pytest.raises(SpecpairError, match="divisible"):
        _config(tmp_path, hidden=30, heads=4)
    with pytest.raises(SpecpairError, match="corpus not found"):
        corpus_texts(str(tmp_path / "missing"), 1000, 0)
    with pytest.raises(SpecpairError, match="init must be"):
        _config(tmp_path, init="magic")
