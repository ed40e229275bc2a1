"""Generate over real gRPC on 127.0.0.1: streaming, batching, greedy identity, sampling."""

import pytest

from specpair._proto import engine_pb2 as pb
from specpair.config import SpeculationConfig
from specpair.server.client import collect, request

from drafting_checks import assert_drafted_and_accepted
from serving_helpers import client_for, make_engine, reference, run_threads

PROMPTS = ["def foo(x):", "import os", "class Path:", "The quick brown fox", "return self",
           "for i in range(10):", "x = [1, 2, 3]", "hello world"]


def test_stream_sends_text_as_it_is_made_and_stats_at_the_end(tiny_pair, client):
    messages = list(client.stream(request("def foo(x):", max_new_tokens=24, request_id="abc")))
    assert len(messages) > 1, "a reply of 24 tokens should arrive in several messages"
    assert all(m.request_id == "abc" for m in messages)
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    last = messages[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    token_ids = [t for m in messages for t in m.token_ids]
    assert last.usage.completion_tokens == len(token_ids) == 24
    ref = reference(tiny_pair, "def foo(x):", 24)
    assert last.usage.prompt_tokens == ref.prompt_tokens
    assert token_ids == ref.token_ids
    assert "".join(m.text for m in messages) == ref.text
    stats = last.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    assert stats.num_draft_tokens == sum(stats.num_draft_tokens_per_pos)
    assert stats.acceptance_rate == pytest.approx(stats.num_accepted_tokens / stats.num_draft_tokens)
    assert stats.mean_acceptance_length == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)
    assert 0 < last.timings.time_to_first_token_seconds <= last.timings.total_seconds
    assert 0 <= last.timings.queue_seconds <= last.timings.time_to_first_token_seconds


def test_unary_style_use_reads_only_the_final_message(client):
    reply = client.generate("import os", max_new_tokens=5)
    assert reply.finish_reason == "FINISH_REASON_LENGTH"
    assert reply.last.usage.completion_tokens == 5 == len(reply.token_ids)
    assert reply.last.request_id, "the server names requests sent without an id"


def test_chat_prompt_goes_through_the_chat_template(tiny_pair, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f():"}]
    reply = client.generate(messages, max_new_tokens=8)
    ref = reference(tiny_pair, messages, 8, chat=True)
    assert reply.token_ids == ref.token_ids
    assert reply.last.usage.prompt_tokens == ref.prompt_tokens


def test_stop_string_ends_the_reply_before_it(tiny_pair, client):
    full = reference(tiny_pair, "class Path:", 40).text
    # A printable two-character stop string first seen some way into the reply.
    stop = next(full[i:i + 2] for i in range(5, len(full) - 2)
                if full[i:i + 2].isascii() and full[i:i + 2].isprintable() and full.find(full[i:i + 2]) == i)
    reply = client.generate("class Path:", max_new_tokens=40, stop=[stop])
    assert reply.finish_reason == "FINISH_REASON_STOP"
    assert reply.text == full[:full.find(stop)]


def test_sixteen_concurrent_streams_each_get_their_own_reply(tiny_pair, shared_server):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]
    with client_for(shared_server) as c:
        replies = run_threads([lambda p=p: collect(c.stream(request(p, max_new_tokens=12))) for p in prompts])
    for prompt, reply in zip(prompts, replies, strict=True):
        assert not isinstance(reply, Exception), reply
        assert reply.token_ids == reference(tiny_pair, prompt, 12).token_ids, prompt


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_greedy_output_equals_single_request_target_only_at_every_batch_size(tiny_pair, start_server, batch):
    peaks = []
    # A short pause per step lets all `batch` requests join before the first finishes.
    server = start_server(engine=make_engine(tiny_pair, delay=0.01, peaks=peaks), max_batch_size=8)
    n = 28
    with client_for(server) as c:
        replies = run_threads([lambda p=p: c.generate(p, max_new_tokens=n) for p in PROMPTS[:batch]])
    drafted = accepted = 0
    for prompt, reply in zip(PROMPTS[:batch], replies, strict=True):
        assert not isinstance(reply, Exception), reply
        ref = reference(tiny_pair, prompt, n)
        assert reply.token_ids == ref.token_ids, f"{prompt!r} differs at batch {batch}"
        drafted += reply.last.stats.num_draft_tokens
        accepted += reply.last.stats.num_accepted_tokens
    assert max(peaks) == batch, f"requests ran {max(peaks)} at a time, wanted {batch}"
    # Some drafts accepted, some rejected: the KV caches were cut back along the way.
    assert 0 < accepted < drafted, "speculation should be on at batch <= batch_size_threshold (8)"


def test_ngram_drafter_serves_target_identical_output(tiny_pair, start_server):
    from specpair.decoding import SpeculativeEngine
    from specpair.drafters import NgramDrafter
    target, _ = tiny_pair
    server = start_server(engine=SpeculativeEngine(target, drafter=NgramDrafter()))
    prompt = "x = [1, 2, 3]; y = [1, 2, 3]; z = [1, 2,"
    with client_for(server) as c:
        replies = run_threads([lambda: c.generate(prompt, max_new_tokens=20),
                               lambda: c.generate("hello world", max_new_tokens=20)])
        info = c.model_info()
    assert replies[0].token_ids == reference(tiny_pair, prompt, 20).token_ids
    assert replies[1].token_ids == reference(tiny_pair, "hello world", 20).token_ids
    # This random target never continues the prompt's patterns: every draft is proposed, verified
    # and rejected (measured: 9 and 7 drafted, none accepted).
    assert_drafted_and_accepted([r.last.stats for r in replies], "n-gram through the server", accepted=False)
    assert info.draft.kind == "ngram" and info.tokenizer.compatible


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_pair, start_server):
    # No engine-wide fallback: this test is about what the batch does, not the acceptance window.
    server = start_server(engine=make_engine(tiny_pair, delay=0.005,
                                             speculation=SpeculationConfig(fallback_threshold=0.0)))
    options = dict(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    with client_for(server) as c:
        alone = c.generate("def foo(x):", **options)
        # Neighbours with other lengths, seeds and k: rows draft different numbers of tokens.
        together = run_threads([lambda: c.generate("def foo(x):", **options),
                                lambda: c.generate("import os", max_new_tokens=24, temperature=1.0, seed=9),
                                lambda: c.generate("class Path:", max_new_tokens=24, temperature=0.7, seed=3,
                                                   speculation_k=8),
                                lambda: c.generate("hello world", max_new_tokens=20)])
        other_seed = c.generate("def foo(x):", **{**options, "seed": 4321})
    assert not any(isinstance(r, Exception) for r in together), together
    assert together[0].token_ids == alone.token_ids
    assert together[0].last.stats.num_draft_tokens > 0
    assert other_seed.token_ids != alone.token_ids


def test_per_request_speculation_override(client):
    off = client.generate("def foo(x):", max_new_tokens=12, speculation_k=0)
    assert off.last.stats.num_draft_tokens == 0 and off.last.stats.num_target_steps == 12
    fixed = client.generate("def foo(x):", max_new_tokens=12, speculation_k=2)
    assert fixed.last.stats.num_draft_tokens > 0
    assert len(fixed.last.stats.num_draft_tokens_per_pos) <= 2
    assert off.token_ids == fixed.token_ids
