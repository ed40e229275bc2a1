"""Self-distillation data: chat requests built offline from the standard library, answered by the
target itself (greedily, as it serves); a killed run keeps the replies it had; the golden prompts
never leak into training."""

from __future__ import annotations

import json
import shutil
from importlib import resources

import pytest
import torch

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


def _target_features(target, ids):
    with torch.no_grad():
        return target.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def test_replies_are_the_targets_greedy_answers_and_survive_a_kill(tmp_path, tiny_target,
                                                                    stdlib_texts, monkeypatch):
    requests = chat_requests(stdlib_texts, tiny_target.tokenizer, 5, seed=0)
    conversations = chat_replies(tiny_target, requests, tmp_path, max_new_tokens=6,
                                 progress=lambda _: None)
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    # Every request answered once, shortest prompts first (a batch pads to its longest).
    assert sorted(c["prompt"] for c in conversations) == sorted(r["prompt"] for r in requests)
    lengths = [len(engine.encode(c["prompt"], chat=True)) for c in conversations]
    assert lengths == sorted(lengths) and len(set(lengths)) > 1
    for c in conversations:
        prompt = engine.encode(c["prompt"], chat=True)
        reply = engine.generate([c["prompt"]], GenerationParams(max_new_tokens=6), chat=True)
        assert c["ids"] == prompt + reply[0].token_ids
        # The features recorded while writing are the target's over the whole conversation.
        torch.testing.assert_close(c["features"], _target_features(tiny_target, c["ids"][:-1]),
                                   atol=1e-4, rtol=1e-4)
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
    assert [c["ids"] for c in again] == [c["ids"] for c in conversations]
    assert asked == [c["prompt"] for c in conversations[2:]]
    assert torch.equal(again[0]["features"], conversations[0]["features"])   # kept on disk
    for a, c in zip(again, conversations):
        torch.testing.assert_close(a["features"], c["features"], atol=1e-4, rtol=1e-4)
    # Replies made for other requests are not mixed in.
    with pytest.raises(SpecpairError, match="other requests"):
        chat_replies(tiny_target, requests[1:], tmp_path, max_new_tokens=6, progress=lambda _: None)


def test_replies_without_saved_features_get_them_from_a_target_pass(tmp_path, tiny_target):
    """A run whose reply features are gone (made before they were kept, or deleted) trains on
    features computed by one target pass per conversation, and says how long that took."""
    config = DistillConfig(out=str(tmp_path / "head"), method="eagle", steps=1, seq_len=16,
                           corpus_chars=50_000, replies=3, reply_tokens=6, eval_prompts=0,
                           draft_vocab=0)
    distill(config, teacher=tiny_target, progress=lambda _: None)
    shutil.rmtree(tmp_path / "head" / "checkpoints")
    log = []
    summary = distill(config, teacher=tiny_target, progress=log.append)
    assert summary["steps"] == 1 and summary["feature_seconds"] > 0
    assert not any(line.startswith("replies:") for line in log)    # none generated again


@pytest.mark.slow
def test_distill_trains_a_head_on_the_targets_replies(tmp_path, tiny_target):
    summary = distill(DistillConfig(out=str(tmp_path / "head"), method="eagle", steps=2,
                                    seq_len=16, corpus_chars=50_000, replies=4, reply_tokens=8,
                                    eval_prompts=0, draft_vocab=0),
                      teacher=tiny_target, progress=lambda _: None)
    replies = (tmp_path / "head" / "replies.jsonl").read_text().splitlines()
    assert len(replies) == 4 and summary["reply_seconds"] > 0 and summary["feature_seconds"] > 0
    with pytest.raises(SpecpairError, match="replies"):
        DistillConfig(out="x", replies=-1)


def test_a_conversations_features_stop_where_its_reply_does():
    """A round may accept drafts past the end-of-turn token: the reply ends there, and its
    features keep one vector per token but the last; fewer than that is refused."""
    from specpair.self_distill import _own_features

    recorded = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
    assert torch.equal(_own_features(recorded, [1, 2, 3, 4, 5]), recorded[:4])
    with pytest.raises(SpecpairError, match="recorded 7 features for a conversation of 9"):
        _own_features(recorded, list(range(9)))


def _requests_file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_requests_from_a_file_are_read_once_each_in_order(tmp_path):
    """--requests: a platform's own traffic, in the bench's prompt format. Kinds are the
    categories; a repeated prompt is answered once; --replies N takes the first N."""
    from specpair.self_distill import file_requests

    path = _requests_file(tmp_path / "traffic.jsonl", [
        {"prompt": "How do I reverse a list in Python?", "category": "code"},
        {"prompt": "What does HTTP 404 mean?"},
        {"prompt": "How do I reverse a list in Python?", "category": "code"},
        {"prompt": "Summarise: the build broke twice.", "category": "summarisation"}])
    rows = file_requests(path)
    assert [r["prompt"][:8] for r in rows] == ["How do I", "What doe", "Summaris"]
    assert [r["kind"] for r in rows] == ["code", "general", "summarisation"]
    assert file_requests(path, 2) == rows[:2]
    with pytest.raises(SpecpairError, match="holds 3 distinct requests"):
        file_requests(path, 4)


def test_a_requests_file_with_golden_prompts_or_bad_lines_is_refused_before_loading(tmp_path):
    golden = resources.files("specpair").joinpath("prompts/default.jsonl").read_text().splitlines()[3]
    leaky = _requests_file(tmp_path / "leaky.jsonl", [{"prompt": "Hello there"}, json.loads(golden)])
    with pytest.raises(SpecpairError, match="1 of the shipped golden prompts"):
        DistillConfig(out=str(tmp_path / "x"), method="eagle", requests=leaky)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{"prompt": ""}\n')
    with pytest.raises(SpecpairError, match="line 2"):
        DistillConfig(out=str(tmp_path / "x"), method="eagle", requests=str(tmp_path / "bad.jsonl"))
    with pytest.raises(SpecpairError, match="not found"):
        DistillConfig(out=str(tmp_path / "x"), method="eagle", requests=str(tmp_path / "none.jsonl"))
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_distill_answers_the_requests_file_and_resumes_a_checkpoint_from_before_it(tmp_path, tiny_target):
    prompts = ["Explain what a mutex is.", "Write a haiku about rain.", "List three prime numbers."]
    path = _requests_file(tmp_path / "traffic.jsonl",
                          [{"prompt": p, "category": c} for p, c in zip(prompts, ("qa", "creative", "qa"))])
    config = DistillConfig(out=str(tmp_path / "head"), method="eagle", steps=1, seq_len=16,
                           corpus_chars=50_000, requests=path, reply_tokens=6, eval_prompts=0,
                           draft_vocab=0, checkpoint_every=1)
    summary = distill(config, teacher=tiny_target, progress=lambda _: None)
    replies = [json.loads(line) for line in (tmp_path / "head" / "replies.jsonl").read_text().splitlines()]
    assert sorted(r["prompt"] for r in replies) == sorted(prompts)
    assert {r["prompt"]: r["kind"] for r in replies}["Write a haiku about rain."] == "creative"
    assert summary["reply_seconds"] > 0
    # A checkpoint saved before a setting existed resumes: the setting counts as its default.
    from specpair.distill import _checkpoints

    plain = DistillConfig(out=str(tmp_path / "plain"), method="eagle", steps=1, seq_len=16,
                          corpus_chars=50_000, eval_prompts=0, draft_vocab=0, checkpoint_every=1)
    distill(plain, teacher=tiny_target, progress=lambda _: None)
    last = _checkpoints(tmp_path / "plain")[-1]
    state = torch.load(last, weights_only=False)
    del state["config"]["requests"]
    torch.save(state, last)
    longer = DistillConfig(**{**plain.__dict__, "steps": 2})
    assert distill(longer, teacher=tiny_target, progress=lambda _: None)["steps"] == 2
    with pytest.raises(SpecpairError, match="other settings"):
        distill(DistillConfig(**{**plain.__dict__, "steps": 3, "seed": 1}), teacher=tiny_target,
                progress=lambda _: None)
