"""Stop strings over real gRPC: streamed pieces never hold a stop string's first characters.

Cases and reference come from tests/engine/test_engine_stop_strings.py (stop strings of 1-8 characters
ending at, straddling and starting at the reply's token boundaries); here they go through the
server, several at once, greedy and sampled, and every message of each stream is checked.
"""

import pytest

from specpair._proto import engine_pb2 as pb
from specpair.config import SpeculationConfig
from specpair.server.app import EngineServer, ServerOptions
from specpair.server.client import request

from serving_helpers import client_for, make_engine, run_threads
from stop_string_cases import MAX_NEW, PROMPT, SAMPLED, expected_stop, stop_cases


@pytest.fixture(scope="module")
def server(tiny_pair):
    # No engine-wide fallback: a sampled reply then depends only on its own seed, so the reply
    # without stop strings is the reference for every stopped one.
    engine = make_engine(tiny_pair, speculation=SpeculationConfig(k=4, fallback_threshold=0))
    server = EngineServer(lambda: engine, ServerOptions(port=0, pair="tiny", version="1", max_batch_size=8),
                          progress=lambda _m: None)
    server.start(wait_ready=True, timeout=60)
    yield server
    server.stop(drain_timeout=1.0)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_streamed_and_whole_replies_end_before_the_stop_string(server, sampling):
    engine = server.engine
    with client_for(server) as c:
        full = c.generate(PROMPT, max_new_tokens=MAX_NEW, **sampling)
        assert len(full.token_ids) == MAX_NEW
        cases = stop_cases(engine, list(full.token_ids))[::5]
        assert len(cases) > 30

        def run(stops):
            return list(c.stream(request(PROMPT, max_new_tokens=MAX_NEW, stop=list(stops), **sampling),
                                 timeout=60))
        for start in range(0, len(cases), 8):
            chunk = cases[start:start + 8]
            for stops, messages in zip(chunk, run_threads([lambda s=s: run(s) for s in chunk])):
                assert not isinstance(messages, Exception), messages
                text, token_ids = expected_stop(engine, list(full.token_ids), stops)
                streamed = "".join(m.text for m in messages)
                assert streamed == text, (stops, [m.text for m in messages], text)
                assert [t for m in messages for t in m.token_ids] == token_ids, stops
                last = messages[-1]
                assert last.usage.completion_tokens == len(token_ids)
                stopped = token_ids != list(full.token_ids) or text != full.text
                assert last.finish_reason == (pb.FINISH_REASON_STOP if stopped else pb.FINISH_REASON_LENGTH)
