"""k by load for vLLM releases (specpair.vllm_k_schedule): the gate's speedups at each concurrency
become vLLM's num_speculative_tokens_per_batch_size, the release carries it as
speculation.kByBatchSize, and vllm_peer.speculative_config ships it after vLLM's own rules. Pure
functions, no server: the schedule's reading by vLLM's own dense lookup is in
test_engine_vllm_serve.py (the vLLM parser test), and the gate measuring it through real vLLM
servers in tests/operator/test_operator_vllm.py."""

from __future__ import annotations

import pytest

from specpair.errors import SpecpairError
from specpair.gate.vllm import k_by_load
from specpair.vllm_k_schedule import LoadPoint, k_at, k_by_batch_size
from specpair.vllm_peer import speculative_config

P = LoadPoint

# (measured points, release k, the schedule shipped)
TABLE = [
    # Pays everywhere: no schedule (k throughout, vLLM keeps its uniform-k scheduling).
    ([P(1, 1.8), P(4, 1.4), P(16, 1.1)], 3, None),
    # Stops paying at 16: k up to 15, 0 from 16 on (vLLM carries the last range past 64).
    ([P(1, 1.5), P(4, 1.2), P(16, 0.9), P(64, 0.7)], 3, [[1, 15, 3], [16, 64, 0]]),
    # A later point that pays again does not turn drafting back on: an unbroken run, as our
    # engine's batch threshold (noise at one point must not flap k).
    ([P(1, 1.5), P(4, 0.95), P(16, 1.3)], 4, [[1, 3, 4], [4, 16, 0]]),
    # Batch 1 drafts even where it does not pay: that is the gate's minSpeedup call.
    ([P(1, 0.8), P(2, 0.7)], 2, [[1, 1, 2], [2, 2, 0]]),
    ([P(1, 0.8)], 2, None),
    # Exactly 1.0 does not pay.
    ([P(1, 1.2), P(8, 1.0)], 5, [[1, 7, 5], [8, 8, 0]]),
    # Not measured at 1: the batch sizes below the first point draft.
    ([P(4, 0.9), P(16, 0.8)], 3, [[1, 3, 3], [4, 16, 0]]),
    ([P(4, 1.1), P(16, 0.8)], 3, [[1, 15, 3], [16, 16, 0]]),
    # Order of measurement does not matter.
    ([P(16, 0.9), P(1, 1.5), P(4, 1.2)], 3, [[1, 15, 3], [16, 16, 0]]),
    ([], 3, None),
]


@pytest.mark.parametrize("points,k,expected", TABLE)
def test_the_schedule_drafts_k_through_the_unbroken_run_that_pays(points, k, expected):
    schedule = k_by_batch_size(points, k)
    assert schedule == expected
    for point in points:
        # Every measured concurrency drafts k where it (and every one below it) paid, else 0.
        pays_up_to_here = all(p.speedup > 1.0 or p.concurrency == 1 for p in points if p.concurrency <= point.concurrency)
        assert k_at(schedule, point.concurrency, k) == (k if pays_up_to_here else 0)
    assert k_at(schedule, 1, k) == k


def test_bad_points_are_refused():
    with pytest.raises(ValueError, match="measured twice"):
        k_by_batch_size([P(4, 1.2), P(4, 0.9)], 3)
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        k_by_batch_size([P(0, 1.2)], 3)
    with pytest.raises(ValueError, match="k must be >= 1"):
        k_by_batch_size([P(1, 1.2)], 0)


def test_the_gate_records_the_speedups_the_schedule_rests_on():
    """gate.vllm.k_by_load: the verdict's batchSweep (as our engine's gate writes it) and the
    schedule from exactly those rounded figures."""
    got = k_by_load([1, 4, 16], [1.0, 4.0, 16.0], [0.5, 3.2, 16.4], 3)
    assert got["batchSweep"] == [{"batchSize": 1, "speedup": 2.0}, {"batchSize": 4, "speedup": 1.25},
                                 {"batchSize": 16, "speedup": 0.9756}]
    assert got["bestSpeculation"] == {"kByBatchSize": [[1, 15, 3], [16, 16, 0]]}
    # A ratio that rounds to 1.0 is recorded as 1.0 and does not pay.
    got = k_by_load([1, 2], [1.0, 2.00001], [1.0, 2.0], 3)
    assert got["batchSweep"][1]["speedup"] == 1.0 and got["bestSpeculation"] == {"kByBatchSize": [[1, 1, 3], [2, 2, 0]]}
    assert k_by_load([1, 2], [1.0, 2.0], [0.5, 1.0], 3) == {
        "batchSweep": [{"batchSize": 1, "speedup": 2.0}, {"batchSize": 2, "speedup": 2.0}], "bestSpeculation": None}
    assert k_by_load([], [], [], 3) == {"batchSweep": [], "bestSpeculation": None}


def release(speculation: dict) -> dict:
    return {"target": {"source": "/m"}, "draft": {"drafter": "ngram"}, "speculation": speculation,
            "engine": {"kind": "vllm"}}


def test_a_release_ships_its_schedule_in_vllms_speculative_config():
    spec = speculative_config(release({"k": 3, "kByBatchSize": [[1, 15, 3], [16, 64, 0]]}))
    assert spec["num_speculative_tokens"] == 3
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 15, 3], [16, 64, 0]]
    # Without one, none is shipped (and the engine's own reading never sees the key).
    assert "num_speculative_tokens_per_batch_size" not in speculative_config(release({"k": 3}))
    assert speculative_config(release({"k": 3, "enabled": False, "kByBatchSize": [[1, 1, 3]]})) is None


@pytest.mark.parametrize("schedule,why", [
    ([], "non-empty list"),
    ("1-15:3", "non-empty list"),
    ([[1, 15]], r"\[start, end, k\]"),
    ([[1, 15, 3.0]], r"\[start, end, k\]"),
    ([[1, 15, True]], r"\[start, end, k\]"),
    ([[2, 15, 3]], "first start at 1"),
    ([[1, 15, 3], [10, 20, 0]], "not overlap"),
    ([[1, 15, 3], [16, 8, 0]], "start <= end"),
    ([[1, 15, 4]], "0 <= k <= 3"),     # vLLM would cap it silently
    ([[1, 15, -1]], "0 <= k <= 3"),
])
def test_a_schedule_vllm_would_refuse_or_change_is_refused_by_name(schedule, why):
    with pytest.raises(SpecpairError, match=why) as caught:
        speculative_config(release({"k": 3, "kByBatchSize": schedule}))
    assert "speculation.kByBatchSize" in str(caught.value)
