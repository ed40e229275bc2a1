"""The vLLM gate's tokenizer check for an EAGLE-3 head (specpair.vllm_head_check): a head has no
tokenizer of its own, so its vocabulary mapping is held to the target's instead, from the files
our writer (eagle3.save_eagle3_head, what `specpair distill --method eagle3` writes) leaves."""

from __future__ import annotations

import pytest
import torch

from specpair.eagle3 import build_eagle3_head, save_eagle3_head
from specpair.gate.verdict import tokenizer_check
from specpair.vllm_head_check import head_config, head_tokenizer_check, vocabulary_differences
from tiny_models import make_model, make_tokenizer, save_tiny

HEAD = {"speculators_model_type": "eagle3", "draft_vocab_size": 3, "target_hidden_size": None,
        "transformer_layer_config": {"vocab_size": 10, "hidden_size": 8}}
TARGET = {"vocab_size": 10, "hidden_size": 8}


@pytest.mark.parametrize("head, target, ids, said", [
    (HEAD, TARGET, [0, 4, 9], []),
    (HEAD, {**TARGET, "vocab_size": 12}, [0, 4, 9], ["the head embeds a vocabulary of 10 ids, the target's has 12"]),
    (HEAD, TARGET, [0, 4, 10], ["the head's draft vocabulary maps to target ids 0..10, outside the target's 0..9"]),
    (HEAD, TARGET, [0, 4, 4], ["the head's draft vocabulary maps two draft ids to one target id"]),
    (HEAD, {**TARGET, "hidden_size": 16}, [0, 1, 2], ["the head reads hidden states 8 wide, the target's are 16"]),
    ({**HEAD, "target_hidden_size": 16}, {**TARGET, "hidden_size": 16}, [0, 1, 2], []),
], ids=["agrees", "another vocabulary", "an id past the target's", "two ids on one", "another width",
        "a head over a wider target"])
def test_what_keeps_a_head_from_drafting_the_targets_tokens(head, target, ids, said):
    assert vocabulary_differences(head, target, ids) == said


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    target = make_model(make_tokenizer(), seed=1, layers=4, hidden=64, heads=2)
    wider = make_model(make_tokenizer(), seed=2, layers=4, hidden=128, heads=2)
    vocab = target.model.config.vocab_size
    # A draft vocabulary of every other id: a d2t map the check reads back from the weights.
    head = build_eagle3_head(target.model, torch.arange(0, vocab, 2), aux_layers=(1, 2, 3))
    save_eagle3_head(head, root / "head")
    return {"target": save_tiny(target, root / "target"), "wider": save_tiny(wider, root / "wider"),
            "head": str(root / "head"), "vocab": vocab}


def release(target: str, draft: dict) -> dict:
    return {"target": {"source": target}, "draft": draft}


def test_a_head_without_tokenizer_files_is_checked_by_its_vocabulary_map(written):
    assert head_config(written["head"]) is not None and head_config(written["target"]) is None
    tok = head_tokenizer_check(release(written["target"], {"source": written["head"], "method": "eagle3"}),
                               progress=lambda *_: None)
    assert tok["compatible"] is True and tok["differences"] == []
    assert f"draft vocabulary of {(written['vocab'] + 1) // 2} ids maps into the target's {written['vocab']}" \
        in tok["notes"][0]
    assert tok["targetFingerprint"] and tok["draftFingerprint"] is None


def test_both_gates_tokenizer_check_takes_a_head_without_tokenizer_files(written):
    """gate.verdict.tokenizer_check, which our engine's gate calls: it loaded the head's folder as
    a tokenizer and failed on every head distill wrote (the demo's learned release, GateError)."""
    tok = tokenizer_check(release(written["target"], {"source": written["head"], "method": "eagle3"}),
                          progress=lambda *_: None)
    assert tok["compatible"] is True and tok["draftFingerprint"] is None
    assert "EAGLE-3 head: no tokenizer of its own" in tok["notes"][0]


def test_a_head_made_for_another_target_is_refused_with_the_reason(written):
    tok = head_tokenizer_check(release(written["wider"], {"source": written["head"], "method": "eagle3"}),
                               progress=lambda *_: None)
    assert tok["compatible"] is False
    assert tok["differences"] == ["the head reads hidden states 64 wide, the target's are 128"]


def test_other_drafts_are_left_to_the_tokenizer_comparison(written):
    assert head_tokenizer_check(release(written["target"], {"drafter": "ngram"})) is None
    assert head_tokenizer_check(release(written["target"], {"source": written["wider"]})) is None
