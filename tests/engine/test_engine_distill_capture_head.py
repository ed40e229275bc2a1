"""`specpair distill --from-capture --method eagle3`: a head trained on captured traffic alone.

A capture has no corpus: the head's features come only from the captured conversations. Before
66f22ac the run first passed the (empty) corpus through the target and died reshaping 0 elements,
so every training Job naming `learning.training.method: eagle3` failed before it trained
(found measuring issue 58's targets, docs/measurements/2026-12-07c-learning-loop-smollm2-cpu.md)."""

from __future__ import annotations

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.distill import DistillConfig, distill
from specpair.models import load_model

from capture_data import extraction_prompts, write_capture   # tests/ is on sys.path


def test_an_eagle3_head_trains_from_a_capture_alone_and_drafts_with_target_only_output(tmp_path, eagle3_target):
    capture = tmp_path / "capture"
    write_capture(capture, SpeculativeEngine(eagle3_target, check_tokenizers=False),
                  {"extraction": extraction_prompts(8)})
    out = tmp_path / "head"
    summary = distill(DistillConfig(out=str(out), method="eagle3", steps=4, batch_size=2, seq_len=32, seed=3,
                                    checkpoint_every=4, eval_prompts=0, draft_vocab=200,
                                    from_capture=str(capture), category="extraction"),
                      teacher=eagle3_target, progress=lambda *_: None)
    assert summary["steps"] == 4 and summary["capture"]["requests"] == 8, summary
    assert summary["feature_seconds"] > 0
    head = load_model(str(out), device="cpu", dtype="float32")
    prompt = extraction_prompts(1)[0]
    params = GenerationParams(max_new_tokens=16)
    engine = SpeculativeEngine(eagle3_target, draft=head, kv="static",
                               speculation=SpeculationConfig(k=3, dynamic_k=False))
    reply = engine.generate([prompt], params)[0]
    plain = SpeculativeEngine(eagle3_target, speculation=SpeculationConfig(enabled=False)).generate([prompt], params)[0]
    assert reply.token_ids == plain.token_ids
    assert reply.stats.num_draft_tokens > 0


def test_the_training_jobs_default_draft_model_trains_for_a_target_narrower_than_it(tmp_path, tiny_target):
    """The training Job's default (`--method draft`, a 256-wide student with embeddings projected
    from the target's) on a 64-wide target: the projection was a QR of the tall side only, 64 x 64,
    and copying it into the student's 256-wide embedding failed (every Job of the devcluster's
    tiny pairs failed so, tests/operator/test_learning_loop_e2e.py)."""
    capture = tmp_path / "capture"
    write_capture(capture, SpeculativeEngine(tiny_target, check_tokenizers=False),
                  {"extraction": extraction_prompts(8)})
    out = tmp_path / "draft"
    summary = distill(DistillConfig(out=str(out), steps=2, batch_size=2, seq_len=32, seed=3, checkpoint_every=2,
                                    eval_prompts=0, from_capture=str(capture), category="extraction"),
                      teacher=tiny_target, progress=lambda *_: None)
    assert summary["steps"] == 2 and summary["parameters"] > 0, summary
    draft = load_model(str(out), device="cpu")
    assert draft.model.get_input_embeddings().weight.shape[1] == 256
