"""Stop strings at every token boundary: nothing of a stop string ever reaches the client.

The reference is what a one-token-at-a-time engine does: after each token, look for the stop
strings in the text so far; the first prefix of the reply that contains one ends it, the text is
cut where the stop string starts, and the token ids end with the token that completed it. The
speculative engine must give exactly that, whatever its step boundaries, and the pieces it streams
must concatenate to the final text (so a piece that later turns out to begin a stop string may
never be sent).
"""

from __future__ import annotations

import random

import pytest

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine

PROMPT = "The quick brown fox"
MAX_NEW = 32
SAMPLED = dict(temperature=0.8, top_k=40, seed=1234)


def decode(engine, ids: list[int]) -> str:
    if ids and ids[-1] in engine.eos_ids:
        ids = ids[:-1]
    return engine.target.tokenizer.decode(ids, skip_special_tokens=True)


def expected_stop(engine, ids: list[int], stops) -> tuple[str, list[int]]:
    """One token at a time: (text, token ids) of a reply `ids` ended by the first stop string."""
    for n in range(1, len(ids) + 1):
        text = decode(engine, ids[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], ids[:n]
    return decode(engine, ids), ids


def boundaries(engine, ids: list[int]) -> list[int]:
    """Character offsets in the reply's text where one token ends and the next begins."""
    full = decode(engine, ids)
    offsets = {0}
    for n in range(1, len(ids)):
        text = decode(engine, ids[:n])
        if full.startswith(text):
            offsets.add(len(text))
    return sorted(offsets)


def stop_cases(engine, ids: list[int]) -> list[tuple[str, ...]]:
    """Stop strings of 1-8 characters ending at, straddling and starting at every boundary."""
    full = decode(engine, ids)
    singles = set()
    for b in boundaries(engine, ids):
        for length in range(1, 9):
            for start in range(b - length, b + 1):
                if start >= 0 and start + length <= len(full):
                    singles.add(full[start:start + length])
    # A tail that begins a stop string which never completes: held back, then flushed at the end.
    for length in range(1, 8):
        singles.add(full[-length:] + "\x07")
    singles = sorted(s for s in singles if "\ufffd" not in s)
    cases = [(s,) for s in singles]
    # Several stop strings at once: the first to complete wins, even if another starts earlier.
    rng = random.Random(0)
    cases += [tuple(rng.sample(singles, 3)) for _ in range(60)]
    return cases


def run_rows(engine, ids: list[int], params: list[GenerationParams], speculate: bool):
    """All rows in one batch; per row (streamed pieces, streamed token ids, final result)."""
    batch = engine.new_batch()
    batch.speculate = speculate
    seqs = [batch.add(ids, p) for p in params]
    pieces = {s.request_id: [] for s in seqs}
    tokens = {s.request_id: [] for s in seqs}
    steps_with_several_tokens = 0
    while batch.active:
        for out in batch.step():
            pieces[out.request_id].append(out.text)
            tokens[out.request_id].extend(out.token_ids)
            steps_with_several_tokens += len(out.token_ids) > 1
    return [(pieces[s.request_id], tokens[s.request_id], batch.result(s)) for s in seqs], \
        steps_with_several_tokens


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
