"""Prefix reuse and large batches through a real server on 127.0.0.1: the prompt tokens served
from the prefix store reported as OpenAI's `usage.prompt_tokens_details.cached_tokens` (chat and
completions, whole and streamed) and in the gRPC reply's usage, counted by the Prometheus pair,
and 64 concurrent greedy streams each equal to their solo output."""

from __future__ import annotations

import pytest

from serving_helpers import client_for, make_engine, openai_client, reference, run_threads, tiny_server

from specpair.prefix_cache import BLOCK_TOKENS
from specpair.decoding import SpeculativeEngine
from specpair.server.app import ServerOptions
from specpair.server.worker import default_max_batch_size

SYSTEM = "You are a careful assistant who answers briefly and never guesses. " * 6


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def served_from_store(engine, earlier: list[int], ids: list[int]) -> int:
    """What the store must serve `ids` after `earlier` was prefilled: the full blocks of their
    common beginning, leaving the prompt's last token to prefill."""
    common = next((i for i, (a, b) in enumerate(zip(earlier, ids)) if a != b), min(len(earlier), len(ids)))
    return BLOCK_TOKENS * min(common // BLOCK_TOKENS, (len(ids) - 1) // BLOCK_TOKENS)


def sample(server, name: str) -> float:
    labels = {"pair": server.options.pair, "version": server.options.version, "engine": "specpair"}
    return server.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def server(tiny_pair):
    with tiny_server(tiny_pair, http_port=0, max_queue=64) as server:
        yield server


def test_cached_prompt_tokens_are_reported_on_every_protocol_and_counted(tiny_pair, server):
    engine = server.engine
    client = openai_client(server)
    first, second = chat("What is two plus two?"), chat("Name a colour.")
    first_ids, second_ids = engine.encode(first), engine.encode(second)
    expected = served_from_store(engine, first_ids, second_ids)
    assert expected >= 3 * BLOCK_TOKENS         # the shared system prompt spans several blocks

    cold = client.chat.completions.create(model="tiny", messages=first, max_tokens=8, temperature=0)
    assert cold.usage.prompt_tokens == len(first_ids)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(model="tiny", messages=second, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected
    assert text == reference(tiny_pair, second, 8, chat=True).text      # served == computed cold

    # The same conversation again: every full block but the one holding its last token.
    again = client.chat.completions.create(model="tiny", messages=second, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == BLOCK_TOKENS * ((len(second_ids) - 1)
                                                                              // BLOCK_TOKENS)
    assert again.choices[0].message.content == text

    # Completions: the system text as a plain prompt (no chat template) is a prefix of its own.
    plain = SYSTEM + "Question: why is the sky blue?"
    assert client.completions.create(model="tiny", prompt=plain, max_tokens=4,
                                     temperature=0).usage.prompt_tokens_details.cached_tokens == 0
    other = SYSTEM + "Question: what is rain?"
    expected_plain = served_from_store(engine, engine.encode(plain), engine.encode(other))
    chunks = list(client.completions.create(model="tiny", prompt=other, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert expected_plain > 0 and chunks[-1].usage.prompt_tokens_details.cached_tokens == expected_plain

    with client_for(server) as grpc_client:
        reply = grpc_client.generate(chat("Say hello."), max_new_tokens=4, temperature=0.0)
    assert reply.last.usage.cached_tokens == served_from_store(engine, first_ids, engine.encode(chat("Say hello.")))
    assert reply.last.usage.prompt_tokens == len(engine.encode(chat("Say hello.")))

    stats = engine.prefix_stats
    assert stats.served > 0 and stats.looked_up > stats.served
    assert sample(server, "specpair_prefix_cache_queries_total") == stats.looked_up
    assert sample(server, "specpair_prefix_cache_hits_total") == stats.served


def test_the_default_batch_carries_more_than_eight_rows(tiny_pair):
    target, draft = tiny_pair
    # The CPU's paged cache: what its pool holds (64 rows of the tiny model, a draft model's rows
    # in the same pool); else 32.
    assert ServerOptions().max_batch_size is None
    assert default_max_batch_size(SpeculativeEngine(target, "ngram")) == 64
    assert default_max_batch_size(SpeculativeEngine(target, draft=draft)) == 64
    assert default_max_batch_size(SpeculativeEngine(target, draft=draft, kv="dynamic")) == 32


def test_64_concurrent_greedy_streams_each_equal_their_solo_output(tiny_pair, start_server):
    peaks: list[int] = []
    engine = make_engine(tiny_pair, delay=0.02, peaks=peaks)
    server = start_server(engine=engine, http_port=0, max_batch_size=64, max_queue=64)
    client = openai_client(server)
    questions = [f"Question {i}: what follows {i * 7}?" for i in range(64)]

    def stream(question):
        chunks = client.chat.completions.create(model="tiny", messages=chat(question), max_tokens=24,
                                                temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    replies = run_threads([lambda q=q: stream(q) for q in questions])
    assert max(peaks) == 64                    # all 64 decoded in one batch at some step
    for question, reply in zip(questions, replies):
        assert reply == reference(tiny_pair, chat(question), 24, chat=True).text, question
    assert engine.prefix_stats.served > 0      # rows joined with their system prompt from the store


def test_requests_arriving_together_share_one_prefill_of_their_system_prompt(tiny_pair, start_server):
    engine = make_engine(tiny_pair, delay=0.02)
    server = start_server(engine=engine, http_port=0, max_batch_size=16)
    client = openai_client(server)
    questions = [f"Question {i}: name a number." for i in range(8)]
    prompts = [engine.encode(chat(q)) for q in questions]
    common = min(served_from_store(engine, prompts[0], ids) for ids in prompts[1:])
    assert common >= 3 * BLOCK_TOKENS

    def ask(question):
        return client.chat.completions.create(model="tiny", messages=chat(question), max_tokens=6, temperature=0)

    replies = run_threads([lambda q=q: ask(q) for q in questions])
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    # One request prefills the system prompt; the others wait for its step and take its blocks.
    assert cached[0] == 0 and all(c >= common for c in cached[1:]), cached
    for question, reply in zip(questions, replies):
        assert reply.choices[0].message.content == reference(tiny_pair, chat(question), 6, chat=True).text
