"""The rows a real server decodes together (issue 51): measured at start-up where --max-batch-size
is not set (cli.decide_decode_rows_at_startup, costs.decide_decode_rows), held by the worker while
admission holds more requests queued, reported in `specpair_decode_rows`; concurrent greedy
streams through a capped batch each equal their solo output (the uncapped 64-stream identity test
is test_server_prefix_reuse.py's)."""

from __future__ import annotations

import pytest

from serving_helpers import make_engine, openai_client, reference, run_threads

from specpair.costs import DecodeStepCosts, decode_rows_cap
from specpair.server.cli import decide_decode_rows_at_startup
from specpair.server.worker import EngineWorker, decode_rows, default_max_batch_size

SYSTEM = "You answer in one short sentence, politely, and you never make anything up. " * 5


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def gauge(server, name: str) -> float | None:
    labels = {"pair": server.options.pair, "version": server.options.version, "engine": "specpair"}
    return server.metrics.registry.get_sample_value(name, labels)


@pytest.mark.parametrize("measured, setting, rows", [
    (None, None, 64),     # not measured: every row admission holds (the tiny pool's 64)
    (8, None, 8),         # measured: those
    (128, None, 64),      # never past what admission holds
    (8, 16, 16),          # --max-batch-size overrides the measurement
    (None, 3, 3),
])
def test_the_rows_decoded_together(tiny_pair, measured, setting, rows):
    engine = make_engine(tiny_pair)
    engine.decode_rows = measured
    assert default_max_batch_size(engine) == 64
    assert decode_rows(engine, setting) == rows
    worker = EngineWorker(engine, max_batch_size=setting, max_queue=4)
    assert (worker.decode_rows, worker.max_batch_size) == (rows, setting or 64)


def test_start_up_measures_the_rows_and_the_server_decodes_no_more(tiny_pair, start_server):
    """The real start-up measurement on the tiny pair sets the cap; the server reports it and
    never steps more rows than it while 24 requests arrive together, all of them admitted (none
    refused: admission holds 64 beside a queue of 4) and each equal to its solo reply."""
    peaks: list[int] = []
    engine = make_engine(tiny_pair, peaks=peaks)
    said = []
    decided = decide_decode_rows_at_startup(engine, said.append)
    assert engine.decode_rows == decided["rows"] == decode_rows_cap(decided["step_seconds"],
                                                                    decided["costs"].margin)
    assert sorted(decided["step_seconds"]) == [1, 4, 8, 16, 32, 64]
    assert said and said[0].startswith("decode rows by measured step cost") \
        and f"decoding up to {engine.decode_rows} rows a step" in said[0]
    peaks.clear()        # the measurement's own batch stepped through the same engine
    engine.step_delay = 0.02     # each step paced, so the 24 are in flight together
    server = start_server(engine=engine, http_port=0, max_queue=4)
    assert server.worker.decode_rows == engine.decode_rows and server.worker.max_batch_size == 64
    assert gauge(server, "specpair_decode_rows") == engine.decode_rows
    replies = ask_together(server, 24)
    assert max(peaks) <= engine.decode_rows
    assert_solo(tiny_pair, replies)


def test_a_cap_below_the_load_queues_the_rest_and_their_replies_do_not_change(tiny_pair, start_server):
    """A cap of 4 (as a CPU whose 4-row step measured best would choose) under 20 concurrent
    requests: the batch steps exactly 4 rows at its fullest, the other requests wait queued
    (admitted, not refused), take their system prompt's blocks from the prefix store when they
    join, and reply as they would alone."""
    peaks: list[int] = []
    engine = make_engine(tiny_pair, delay=0.02, peaks=peaks)
    engine.decode_rows = decode_rows_cap({1: 1.0, 4: 1.0, 8: 3.0, 16: 6.0})    # 4 rows for the time of 1
    assert engine.decode_rows == 4
    server = start_server(engine=engine, http_port=0, max_queue=4)
    assert gauge(server, "specpair_decode_rows") == 4
    replies = ask_together(server, 20)
    assert max(peaks) == 4
    assert_solo(tiny_pair, replies)
    assert engine.prefix_stats.served > 0


def test_the_worker_prices_the_rows_at_the_context_it_serves(tiny_pair, start_server):
    """Start-up measured rows as free (16 rows a step for the time of 1) after no context, and a
    position of context as costing each row: at the context of the chats that come (their
    prompt and half their reply each), a step of r rows costs 1 + 3r, so 4 rows decode within
    10% of 16's tokens a second, and the worker steps no more than 4 where the unpriced
    measurement said 16; the gauge says 4, and the replies are their solo ones."""
    peaks: list[int] = []
    engine = make_engine(tiny_pair, delay=0.02, peaks=peaks)
    questions = [f"Question {i}: what comes after {i * 3}?" for i in range(20)]
    lengths = [len(engine.encode(chat(q), chat=True)) + 16 // 2 for q in questions]
    context = sum(lengths) / len(lengths)
    engine.decode_rows = 16
    engine.decode_costs = DecodeStepCosts({1: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}, 0, 3.0 / context)
    assert decode_rows_cap(engine.decode_costs.seconds) == 16
    assert decode_rows_cap(engine.decode_costs.at(round(context))) == 4
    server = start_server(engine=engine, http_port=0, max_queue=4)
    assert server.worker.decode_rows == 16
    replies = ask_together(server, 20, questions)
    assert max(peaks) == 4
    assert server.worker.decode_rows == 4 and gauge(server, "specpair_decode_rows") == 4
    assert_solo(tiny_pair, replies)


def ask_together(server, count: int, questions: list[str] | None = None) -> list:
    client = openai_client(server)
    questions = questions or [f"Question {i}: what comes after {i * 3}?" for i in range(count)]

    def stream(question):
        chunks = client.chat.completions.create(model="tiny", messages=chat(question), max_tokens=16,
                                                temperature=0, stream=True)
        return question, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return run_threads([lambda q=q: stream(q) for q in questions])


def assert_solo(tiny_pair, replies) -> None:
    for reply in replies:
        assert not isinstance(reply, Exception), reply
        question, text = reply
        assert text == reference(tiny_pair, chat(question), 16, chat=True).text, question
