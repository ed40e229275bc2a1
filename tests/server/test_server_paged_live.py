"""The paged cache live behind a real server on 127.0.0.1: 64 concurrent greedy chat streams over
the OpenAI HTTP API, against a block pool too small to hold them all, each equal to its solo
output; requests waited for free blocks, rows were preempted and recomputed (the engine's
counter and its Prometheus series), the shared system prompt was served by reference (`cached_tokens`), and every block
came back."""

from __future__ import annotations

from serving_helpers import openai_client, reference, run_threads, wait_for

from specpair.config import SpeculationConfig
from specpair.decoding import SpeculativeEngine

SYSTEM = "You are a careful assistant who answers briefly and never guesses. " * 6


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_64_streams_through_a_small_pool_each_equal_their_solo_output(tiny_pair, start_server):
    target, _ = tiny_pair
    # 1,600 positions: the system prompt once, and about 30 rows' own blocks at a time.
    engine = SpeculativeEngine(target, "ngram", kv_budget="1600",
                               speculation=SpeculationConfig(k=4, batch_size_threshold=64))
    assert engine.paged_space is not None and engine.paged_space.pool.blocks == 100
    peaks: list[int] = []
    step = engine.new_batch

    def counted_batch():
        batch = step()
        original = batch.step

        def counted():
            peaks.append(batch.active)
            return original()
        batch.step = counted
        return batch
    engine.new_batch = counted_batch
    server = start_server(engine=engine, http_port=0, max_batch_size=64, max_queue=64)
    client = openai_client(server)
    questions = [f"Question {i}: what follows {i * 7}?" for i in range(64)]

    def stream(question):
        chunks = client.chat.completions.create(model="tiny", messages=chat(question), max_tokens=24,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].usage.prompt_tokens_details.cached_tokens

    replies = run_threads([lambda q=q: stream(q) for q in questions])
    for question, reply in zip(questions, replies, strict=True):
        assert not isinstance(reply, Exception), reply
        assert reply[0] == reference(tiny_pair, chat(question), 24, chat=True).text, question
    assert engine.paged_space.preemptions > 0            # the pool ran out: rows were recomputed
    labels = {"pair": server.options.pair, "version": server.options.version, "engine": "specpair"}
    assert wait_for(lambda: server.metrics.registry.get_sample_value(
        "specpair_kv_preemptions_total", labels) == engine.paged_space.preemptions)
    assert 8 < max(peaks) < 64                           # admitted by blocks, not by the 64 rows
    assert sum(cached > 0 for _, cached in replies) >= 60    # the system prompt by reference
    pool = engine.paged_space.pool
    assert not pool.tables and pool.free == pool.blocks
