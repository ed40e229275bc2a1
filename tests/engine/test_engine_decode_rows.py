"""The rows decoded together, chosen by decode step costs measured at start-up (issue 51): the pure
decision over measured seconds (tables), and the measurement on a real tiny engine and batch
feeding it (the server's start-up and its cap: tests/server/test_server_decode_rows.py)."""

from __future__ import annotations

import time

import pytest
import torch

from specpair.config import GenerationParams, SpeculationConfig
from specpair.costs import (DECODE_ROWS_CPU_MARGIN, DECODE_ROWS_MARGIN, DecodeStepCosts, decide_decode_rows,
                            decode_row_counts, decode_rows_at, decode_rows_cap, measure_decode_steps,
                            per_row_position_cost, serving_context, step_clock, tokens_per_second)
from specpair.decoding import SpeculativeEngine


def seconds_at(rates: dict[int, float]) -> dict[int, float]:
    """Step seconds of the given tokens/s per row count."""
    return {rows: rows / rate for rows, rate in rates.items()}


@pytest.mark.parametrize("rates, cap", [
    # A GPU: a row costs little, tokens/s nearly doubles with the rows up to 64.
    ({1: 700, 4: 2700, 8: 5300, 16: 10000, 32: 18000, 64: 30000}, 64),
    # 2 CPU cores, SmolLM2 after a long shared prompt: compute-bound from 8 rows, 32 rows slower
    # a token than 8 (1.23x, docs/server.md), 64 slower still.
    ({1: 14, 4: 38, 8: 48, 16: 47, 32: 40, 64: 33}, 8),
    # Still rising past 8 but by less than the margin: the fewer rows.
    ({1: 14, 4: 38, 8: 48, 16: 51, 32: 52, 64: 50}, 8),
    # Rising by more than the margin at 16, then flat: 16.
    ({1: 14, 4: 38, 8: 40, 16: 48, 32: 49, 64: 47}, 16),
    # A dip at one count (a burst elsewhere) does not stop a later count that pays from winning.
    ({1: 10, 4: 30, 8: 25, 16: 60, 32: 62}, 16),
    # Best at the fewest rows measured: those.
    ({1: 20, 4: 12}, 1),
    ({8: 40}, 8),
])
def test_the_fewest_rows_within_the_margin_of_the_best_tokens_a_second(rates, cap):
    got = decode_rows_cap(seconds_at(rates))
    assert got == cap
    measured = tokens_per_second(seconds_at(rates))
    # Never a count that measured slower per token than a smaller one by the margin: no smaller
    # count beats the chosen one, and every larger one beats it by less than the margin.
    assert all(measured[r] <= measured[got] * (1 + DECODE_ROWS_MARGIN) for r in measured)
    assert all(measured[r] * (1 + DECODE_ROWS_MARGIN) < max(measured.values()) for r in measured if r < got)


@pytest.mark.parametrize("margin, cap", [(0.0, 32), (0.05, 16), (0.5, 4)])
def test_the_margin_decides_how_much_more_a_larger_batch_must_emit(margin, cap):
    assert decode_rows_cap(seconds_at({1: 10, 4: 30, 8: 40, 16: 44, 32: 45}), margin) == cap


def test_nothing_timed_or_a_negative_margin_is_refused():
    with pytest.raises(ValueError, match="no decode step timed"):
        decode_rows_cap({})
    with pytest.raises(ValueError, match="no decode step timed"):
        decode_rows_cap({8: 0.0})
    with pytest.raises(ValueError, match="margin"):
        decode_rows_cap({8: 1.0}, margin=-0.1)


# SmolLM2 on the 2 quiet cores after a 513-token shared prompt (the lead's run, 2026-12-07).
QUIET_513 = {1: 32.1, 4: 91.3, 8: 144.5, 16: 179.0, 32: 249.0, 64: 255.1}


@pytest.mark.parametrize("per_row_position, context, cap", [
    (0.0, 513, 32),         # as measured: 32 rows within 10% of 64's tokens a second
    (0.0, 8000, 32),        # a context that costs nothing more changes nothing
    (3e-6, 513, 32),        # priced where it was measured: the measurement's own choice
    (3e-6, 1700, 32),       # the chat load's 1,696 positions: attention grows, 32 still pays
    (3e-6, 8000, 16),       # an 8k chat: attention a row is most of a step, 16 rows do as well
    (3e-5, 8000, 4),        # attention ten times dearer: 4 rows
    (3e-6, 100, 32),        # shorter than measured: cheaper, no fewer rows
])
def test_the_rows_are_priced_at_the_context_being_served(per_row_position, context, cap):
    costs = DecodeStepCosts(seconds_at(QUIET_513), 513, per_row_position)
    assert decode_rows_at(costs, context) == cap
    priced = costs.at(context)
    assert sorted(priced) == sorted(QUIET_513)
    for rows, seconds in priced.items():      # each count's step: its own rows' extra positions
        measured = rows / QUIET_513[rows]
        assert seconds == pytest.approx(max(0.1 * measured, measured + rows * (context - 513) * per_row_position))


def test_a_context_shorter_than_measured_saves_at_most_the_attention():
    costs = DecodeStepCosts({8: 0.1, 32: 0.2}, 2000, 1e-3)
    assert costs.at(0) == {8: pytest.approx(0.01), 32: pytest.approx(0.02)}     # a tenth, not < 0
    with pytest.raises(ValueError, match="context"):
        costs.at(-1)


@pytest.mark.parametrize("short, long, rows, short_context, long_context, cost", [
    (0.128, 0.242, 32, 513, 2052, (0.242 - 0.128) / (32 * (2052 - 513))),
    (0.128, 0.120, 32, 513, 2052, 0.0),      # the longer measured faster: noise, no cost
    (0.050, 0.050, 1, 10, 20, 0.0),
])
def test_a_position_of_context_costs_a_row_what_two_contexts_measured(short, long, rows, short_context,
                                                                     long_context, cost):
    assert per_row_position_cost(short, long, rows, short_context, long_context) == pytest.approx(cost)


def test_a_second_context_must_be_longer():
    with pytest.raises(ValueError, match="longer"):
        per_row_position_cost(0.1, 0.2, 8, 513, 513)
    with pytest.raises(ValueError, match="rows"):
        per_row_position_cost(0.1, 0.2, 0, 513, 1000)


def test_the_context_served_is_the_rows_mean_length():
    assert serving_context([1700, 1700, 1732], 513) == 1711
    assert serving_context([], 513) == 513


@pytest.mark.parametrize("max_rows, counts", [
    (64, [1, 4, 8, 16, 32, 64]), (48, [1, 4, 8, 16, 32, 48]), (8, [1, 4, 8]), (6, [1, 4, 6]), (1, [1]),
])
def test_the_counts_timed_reach_what_admission_holds(max_rows, counts):
    assert decode_row_counts(max_rows) == counts


def test_start_up_times_every_count_on_a_real_batch_and_leaves_the_engine_as_it_was(tiny_target):
    """On the tiny model (real steps, timed here): a median for every count, the cap one of them
    and the rule's over them; afterwards no row holds a block, the prefix counters and the
    controller are untouched, and a request decodes as before."""
    engine = SpeculativeEngine(tiny_target, "ngram", speculation=SpeculationConfig(k=3))
    before = engine.generate(["Once upon a time"], GenerationParams(max_new_tokens=12))[0].token_ids
    looked_up, served = engine.prefix_stats.looked_up, engine.prefix_stats.served
    window = engine.controller.window.drafted
    decided = decide_decode_rows(engine, 16, turns=3, steps=2)
    assert sorted(decided["step_seconds"]) == [1, 4, 8, 16]
    assert all(s > 0 for s in decided["step_seconds"].values())
    # (on the CPU's clock, CPU seconds at one thread, by its margin)
    assert decided["costs"].margin == DECODE_ROWS_CPU_MARGIN
    assert decided["rows"] == decode_rows_cap(decided["step_seconds"], DECODE_ROWS_CPU_MARGIN)
    assert decided["tokens_per_second"] == tokens_per_second(decided["step_seconds"])
    assert 0 < decided["context"] <= 512 and decided["seconds"] > 0
    # ... and the rows chosen after a longer prompt: what a position of context costs a row
    costs = decided["costs"]
    assert (costs.seconds, costs.context) == (decided["step_seconds"], decided["context"])
    assert costs.per_row_position >= 0 and decode_rows_at(costs, costs.context) == decided["rows"]
    assert (engine.prefix_stats.looked_up, engine.prefix_stats.served) == (looked_up, served)
    assert engine.controller.window.drafted == window and engine.eos_ids
    pool = engine.paged_space.pool
    assert pool.idle and pool.free == pool.blocks
    again = engine.generate(["Once upon a time"], GenerationParams(max_new_tokens=12))[0].token_ids
    assert again == before


def test_the_prompt_is_cut_to_leave_the_steps_room_in_the_models_context(tiny_target):
    """A target-only engine, a context longer than the model's: the prompt is cut so that every
    row's steps fit (a timing row steps on whatever it emits, its end of sequence included), and
    every count is timed."""
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    medians, context = measure_decode_steps(engine, [1, 2, 3], 10_000, turns=2, steps=1)
    assert sorted(medians) == [1, 2, 3] and all(s > 0 for s in medians.values())
    assert context + 2 * 3 * 2 < engine.target.context_length


def test_a_cpu_step_is_timed_in_the_threads_cpu_seconds_at_one_thread():
    """What other jobs do does not enter a CPU's step timing: inside step_clock torch (and the C
    layer, which asks it) runs one thread, and time this thread does not run (here a sleep, on a
    busy machine its waits for a core) is not counted; torch's threads are as they were after."""
    threads = torch.get_num_threads()
    with step_clock(torch.device("cpu")) as clock:
        assert torch.get_num_threads() == 1
        start = clock()
        time.sleep(0.3)
        slept = clock() - start
    assert slept < 0.1
    assert torch.get_num_threads() == threads


def test_the_margin_goes_with_the_clock_the_costs_were_timed_on():
    costs = DecodeStepCosts(seconds_at({8: 40, 16: 43, 32: 46}), 513, 0.0, DECODE_ROWS_CPU_MARGIN)
    assert decode_rows_at(costs, 513) == 32            # 43 is more than 5% short of 46
    assert decode_rows_at(costs, 513, margin=DECODE_ROWS_MARGIN) == 16
    assert DecodeStepCosts(costs.seconds, 513).margin == DECODE_ROWS_MARGIN


def test_the_timing_feeds_each_prompt_whole_under_a_prefill_budget(tiny_target, monkeypatch):
    """The untimed steps feed a row's prompt in one step whatever the engine's prefill budget:
    under a budget the first prompt's step stored only a chunk, every joining row prefilled the
    rest itself, and on SmolLM2 (a 2,049-token prompt, 32 rows) the pool ran dry, the rows were
    preempted and the server failed to start ('no decode step timed at [32] rows'). Here the
    budget is 16 positions and no step the timing takes feeds a prompt in part."""
    from specpair import decoding

    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    engine.prefill_budget = 16
    partial, step = [], decoding.Batch.step

    def recorded(batch):
        out = step(batch)
        partial.append(bool(batch._prefill_cap))
        return out
    monkeypatch.setattr(decoding.Batch, "step", recorded)
    medians, context = measure_decode_steps(engine, [1, 4, 8], 200, turns=2, steps=2)
    assert sorted(medians) == [1, 4, 8] and context > 16
    assert partial and not any(partial), partial
    # (the engine's own budget is as it was: requests are still fed in chunks)
    assert engine.prefill_budget == 16
