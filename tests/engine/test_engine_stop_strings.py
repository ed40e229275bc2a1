"""Stop strings at every token boundary: nothing of a stop string ever reaches the client.

The reference is what a one-token-at-a-time engine does: after each token, look for the stop
strings in the text so far; the first prefix of the reply that contains one ends it, the text is
cut where the stop string starts, and the token ids end with the token that completed it. The
speculative engine must give exactly that, whatever its step boundaries, and the pieces it streams
must concatenate to the final text (so a piece that later turns out to begin a stop string may
never be sent).
"""

from __future__ import annotations

import pytest
from stop_string_cases import MAX_NEW, PROMPT, SAMPLED, decode, expected_stop, run_rows, stop_cases

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    return SpeculativeEngine(tiny_target, draft=tiny_draft,
                             speculation=SpeculationConfig(k=4, fallback_threshold=0,
                                                           batch_size_threshold=100_000))


@pytest.mark.parametrize("speculate", [False, True], ids=["one-token-steps", "speculative-steps"])
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_stop_strings_at_every_boundary(engine, sampling, speculate):
    ids = engine.encode(PROMPT)
    base = GenerationParams(max_new_tokens=MAX_NEW, **sampling)
    # The reply without stop strings, decoded in the same batch as the stopped ones below.
    [(_, _, full)], _ = run_rows(engine, ids, [base], speculate)
    assert len(full.token_ids) == MAX_NEW and full.finish_reason == "length"
    cases = stop_cases(engine, full.token_ids)
    assert len(cases) > 100
    params = [base] + [GenerationParams(max_new_tokens=MAX_NEW, stop=stops, **sampling) for stops in cases]
    rows, several = run_rows(engine, ids, params, speculate)
    assert rows[0][2].token_ids == full.token_ids, "the reply changed with its batch"
    if speculate:
        assert several > 0, "no step emitted several tokens: step boundaries were not exercised"
    wrong = []
    for stops, (pieces, streamed_ids, result) in zip(cases, rows[1:]):
        text, token_ids = expected_stop(engine, full.token_ids, stops)
        stopped = token_ids != full.token_ids or text != decode(engine, full.token_ids)
        got = ("".join(pieces), result.text, streamed_ids, result.token_ids, result.finish_reason)
        want = (text, text, token_ids, token_ids, "stop" if stopped else "length")
        if got != want:
            wrong.append((stops, got, want))
    assert not wrong, f"{len(wrong)} of {len(cases)} stop cases wrong, e.g. {wrong[:3]}"


def test_generate_returns_the_stopped_reply(engine):
    """The unary path (CLI, gate, bench): engine.generate with stop strings."""
    ids = engine.encode(PROMPT)
    for sampling in ({}, SAMPLED):
        full = engine.generate([PROMPT], GenerationParams(max_new_tokens=MAX_NEW, **sampling))[0]
        cases = stop_cases(engine, full.token_ids)[::10]
        results = engine.generate([PROMPT] * len(cases),
                                  [GenerationParams(max_new_tokens=MAX_NEW, stop=s, **sampling) for s in cases])
        for stops, result in zip(cases, results):
            text, token_ids = expected_stop(engine, full.token_ids, stops)
            assert (result.text, result.token_ids) == (text, token_ids), stops
        assert len(ids) == results[0].prompt_tokens
