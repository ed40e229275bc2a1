"""Self-distillation data: chat requests built offline from the standard library, answered by the
target itself (greedily, as it serves); a killed run keeps the replies it had; the golden prompts
never leak into training."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.distill import DistillConfig, corpus_texts, distill
from specpair.errors import SpecpairError
from specpair.self_distill import KIND_SHARES, chat_replies, chat_requests


@pytest.fixture(scope="module")
def stdlib_texts():
    return corpus_texts("stdlib", 400_000, seed=0)


def test_requests_are_seeded_varied_and_not_the_golden_prompts(stdlib_texts, tiny_tokenizer):
    requests = chat_requests(stdlib_texts, tiny_tokenizer, 200, seed=3)
    assert requests == chat_requests(stdlib_texts, tiny_tokenizer, 200, seed=3)
    assert requests != chat_requests(stdlib_texts, tiny_tokenizer, 200, seed=4)
    assert len(requests) == 200
    kinds = {kind: sum(r["kind"] == kind for r in requests) for kind in KIND_SHARES}
    assert all(abs(kinds[k] - 200 * share) <= 1 for k, share in KIND_SHARES.items()), kinds
    assert not any("{" + field + "}" in r["prompt"] for r in requests
                   for field in ("name", "args", "summary", "src", "text", "w"))
    golden = resources.files("specpair").joinpath("prompts/default.jsonl").read_text()
    golden = {json.loads(line)["prompt"] for line in golden.splitlines() if line.strip()}
    assert not golden & {r["prompt"] for r in requests}


def test_a_corpus_without_python_is_refused(tmp_path, tiny_tokenizer):
    (tmp_path / "notes.txt").write_text("plain words, no functions here. " * 50)
    with pytest.raises(SpecpairError, match="too little Python"):
        chat_requests(corpus_texts(str(tmp_path), 10_000, 0), tiny_tokenizer, 10, seed=0)


def test_replies_are_the_targets_greedy_answers_and_survive_a_kill(tmp_path, tiny_target,
                                                                    stdlib_texts, monkeypatch):
    requests = chat_requests(stdlib_texts, tiny_target.tokenizer, 5, seed=0)
    conversations = chat_replies(tiny_target, requests, tmp_path, max_new_tokens=6,
                                 progress=lambda _: None)
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    for request, ids in zip(requests, conversations):
        prompt = engine.encode(request["prompt"], chat=True)
        reply = engine.generate([request["prompt"]], GenerationParams(max_new_tokens=6), chat=True)
        assert ids == prompt + reply[0].token_ids
    # A run killed while writing its third reply: the rerun keeps two and generates three.
    lines = (tmp_path / "replies.jsonl").read_text().splitlines()
    (tmp_path / "replies.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:17])
    asked = []
    original = SpeculativeEngine.generate

    def generate(self, prompts, *args, **kwargs):
        asked.extend(prompts)
        return original(self, prompts, *args, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "generate", generate)
    again = chat_replies(tiny_target, requests, tmp_path, max_new_tokens=6, progress=lambda _: None)
    assert again == conversations
    assert asked == [r["prompt"] for r in requests[2:]]
    # Replies made for other requests are not mixed in.
    with pytest.raises(SpecpairError, match="other requests"):
        chat_replies(tiny_target, requests[1:], tmp_path, max_new_tokens=6, progress=lambda _: None)


def test_distill_trains_a_head_on_the_targets_replies(tmp_path, tiny_target):
    summary = distill(DistillConfig(out=str(tmp_path / "head"), method="eagle", steps=2,
                                    seq_len=16, corpus_chars=50_000, replies=4, reply_tokens=8,
                                    eval_prompts=0, draft_vocab=0),
                      teacher=tiny_target, progress=lambda _: None)
    replies = (tmp_path / "head" / "replies.jsonl").read_text().splitlines()
    assert len(replies) == 4 and summary["reply_seconds"] > 0
    with pytest.raises(SpecpairError, match="replies"):
        DistillConfig(out="x", replies=-1)
