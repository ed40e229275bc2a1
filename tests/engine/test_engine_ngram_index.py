"""The n-gram drafter's per-row index: it proposes exactly what a scan of the whole sequence
proposes, as rows grow, join and leave, and a batch's rounds never scan the sequence."""

from __future__ import annotations

import random

import pytest

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import LookupFirstDrafter, NgramDrafter, NgramIndex


@pytest.mark.parametrize("seed", range(40))
def test_the_index_matches_what_a_scan_finds_at_every_length(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])
    low = rng.randint(1, 3)
    high = rng.randint(low, 4)
    scan, index = NgramDrafter(high, low), NgramIndex(low, high)
    seq = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
    for _ in range(40):
        seq += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        index.sync(seq)
        for k in (1, 3, 6):
            assert index.match(k) == scan.match(seq, k), (seq, k)
    # A sequence that is not the indexed one continued (here: shorter) is indexed again.
    shorter = seq[:len(seq) // 2]
    index.sync(shorter)
    assert index.match(4) == scan.match(shorter, 4)


def _no_scans(monkeypatch):
    def scan(self, sequence):
        raise AssertionError("a batch's round scanned the whole sequence")
    monkeypatch.setattr(NgramDrafter, "_continuations", scan)


def test_a_batch_keeps_one_index_per_row_through_joins_and_leaves(tiny_target, monkeypatch):
    """Greedy output with rows joining and leaving equals target-only's; no round scans."""
    prompts = ["the cat sat on the mat and the cat sat on", "a b c a b c a b", "one two one two one",
               "x y z x y z x y z"]
    params = GenerationParams(max_new_tokens=24)
    reference = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    expected = [reference.generate([p], params)[0].token_ids for p in prompts]
    engine = SpeculativeEngine(tiny_target, drafter=NgramDrafter(),
                               speculation=SpeculationConfig(k=4, dynamic_k=False, fallback_threshold=0,
                                                             batch_size_threshold=100))
    _no_scans(monkeypatch)
    batch = engine.new_batch()
    first = batch.add(engine.encode(prompts[0]), params)
    doomed = batch.add(engine.encode(prompts[1]), params)
    batch.step()
    later = batch.add(engine.encode(prompts[2]), params)
    batch.step()
    batch.cancel(doomed.request_id)
    last = batch.add(engine.encode(prompts[3]), params)
    while batch.active:
        batch.step()
    assert [first.generated, later.generated, last.generated] == [expected[0], expected[2], expected[3]]
    assert len(batch.drafter.rows) == len(batch.rows)


def test_lookup_first_copies_from_its_rows_indexes(monkeypatch):
    """Lookup first keeps the same per-row indexes for its copies (its head is left alone here)."""
    class Head:
        tree_capable = False
        name = "head"

        def for_batch(self):
            return self

        def add_rows(self, count):
            pass

        def select(self, rows):
            pass

    drafter = LookupFirstDrafter(NgramDrafter(), Head(), min_match=2).for_batch()
    drafter.add_rows(2)
    _no_scans(monkeypatch)
    sequences = [[1, 2, 3, 1, 2], [7, 8, 9]]
    found = drafter.ngram.match_rows(sequences, [3, 3])
    assert found == [(2, [3, 1, 2]), (0, [])]
    drafter.select([1])
    sequences[1] += [7, 8]
    assert drafter.ngram.match_rows([sequences[1]], [2]) == [(2, [9, 7])]
