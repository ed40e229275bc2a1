"""Stop-string cases at every token boundary of a reply and what a one-token-at-a-time engine
makes of them: the reference both the engine's and the server's stop-string tests compare with."""

from __future__ import annotations

import random

from specpair.config import GenerationParams

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
