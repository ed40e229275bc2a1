"""Speculation by batch size from costs measured at start-up: the pure decision (tables), and the
measurement on a real tiny engine feeding it (`engine serve`'s start-up: test_server_cli.py)."""

from __future__ import annotations

import pytest

from specpair.config import SpeculationConfig
from specpair.costs import (RowsCosts, RowsDecision, decide_speculation_by_rows, expected_tokens,
                            speculation_by_rows, threshold_of)
from specpair.decoding import SpeculativeEngine
from specpair.server.cli import decide_speculation_at_startup


def costs(rows: int, verify: dict[int, float], draft_per_token: float = 0.0, step: float = 1.0) -> RowsCosts:
    return RowsCosts(rows, step, verify, {k: k * draft_per_token * rows for k in verify})


@pytest.mark.parametrize("acceptance, k, tokens", [
    (0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 1, 1.5), (0.5, 3, 1.875),
])
def test_expected_tokens_a_round(acceptance, k, tokens):
    assert expected_tokens(acceptance, k) == pytest.approx(tokens)


@pytest.mark.parametrize("row_costs, acceptance, want", [
    # A GPU-like device: verification nearly free at every size, free lookups: pays, deep k.
    ([costs(r, {1: 1.02, 2: 1.04, 4: 1.08}) for r in (1, 2, 4)], 0.5,
     [(1, 4, True), (2, 4, True), (4, 4, True)]),
    # A CPU-like one: verification grows with the tokens; at 4 rows it is compute the CPU lacks.
    ([costs(1, {1: 1.1, 2: 1.2, 4: 1.5}), costs(2, {1: 1.4, 2: 1.8, 4: 2.6}),
      costs(4, {1: 1.9, 2: 2.8, 4: 4.6})], 0.5,
     [(1, 2, True), (2, 1, True), (4, 1, False)]),
    # A draft model costing half a target step a token: never pays at this acceptance.
    ([costs(1, {1: 1.05, 2: 1.1}, draft_per_token=0.5)], 0.5, [(1, 1, False)]),
    # ... but does where nearly everything is accepted.
    ([costs(1, {1: 1.05, 2: 1.1}, draft_per_token=0.5)], 0.95, [(1, 2, True)]),
    # No acceptance: drafting never pays, whatever it costs.
    ([costs(1, {1: 1.0, 2: 1.0})], 0.0, [(1, 1, False)]),
])
def test_per_batch_size_the_k_with_most_tokens_a_second_and_whether_it_pays(row_costs, acceptance, want):
    got = speculation_by_rows(row_costs, acceptance)
    assert [(d.rows, d.k, d.pays) for d in got] == want
    for d, c in zip(got, sorted(row_costs, key=lambda c: c.rows)):
        round_seconds = max(c.verify[d.k], c.target_step) + c.draft[d.k]
        assert d.speedup == pytest.approx(expected_tokens(acceptance, d.k) * c.target_step / round_seconds, abs=1e-4)


def test_a_verification_timed_faster_than_a_one_token_step_is_priced_as_one():
    """A burst elsewhere can slow the timed one-token step below a verification's time; the
    speedup then rests on the one-token step, never above the tokens a round emits."""
    (d,) = speculation_by_rows([RowsCosts(2, 3.0, {1: 1.5, 3: 2.0}, {1: 0.0, 3: 0.0})], 0.5)
    assert (d.k, d.speedup) == (3, expected_tokens(0.5, 3))


def test_a_tie_with_target_only_does_not_pay():
    (d,) = speculation_by_rows([RowsCosts(1, 1.0, {1: 1.5}, {1: 0.0})], 0.5)
    assert d.speedup == 1.0 and not d.pays


@pytest.mark.parametrize("pays, threshold", [
    ([], 0),
    ([(1, False)], 0),
    ([(1, True)], 1),
    ([(1, True), (2, True), (4, False), (8, True)], 2),    # the unbroken run from the smallest
    ([(4, True), (1, True), (2, True)], 4),                # in any order
    ([(1, False), (2, True)], 0),
])
def test_the_threshold_is_the_unbroken_run_of_paying_sizes(pays, threshold):
    assert threshold_of([RowsDecision(r, 1, 1.0, p) for r, p in pays]) == threshold


def test_start_up_measures_the_row_buckets_and_sets_the_threshold(tiny_target, tiny_draft):
    """On the tiny pair (real steps, timed here): each measured size is one bucket larger than
    the last, measuring stops at the first that does not pay, and the server keeps speculating
    at batch 1 whatever the costs say (each request's back-off judges it there)."""
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=SpeculationConfig(k=3, k_max=4))
    decided = decide_speculation_by_rows(engine, max_rows=8)
    rows = [d.rows for d in decided["decisions"]]
    assert rows == [1, 2, 4, 8][:len(rows)] and rows
    assert all(d.pays for d in decided["decisions"][:-1])
    assert not decided["decisions"][-1].pays or rows[-1] == 8
    assert decided["threshold"] == threshold_of(decided["decisions"])
    assert all(1 <= d.k <= 4 and d.speedup > 0 for d in decided["decisions"])

    said = []
    again = decide_speculation_at_startup(engine, 8, said.append)
    assert engine.config.batch_size_threshold == max(1, again["threshold"])
    first = again["decisions"][0]
    assert engine.config.k == (first.k if first.pays else 3)
    assert said and said[0].startswith("speculation by batch size, measured in ")
    assert said[0].endswith(f"threshold {engine.config.batch_size_threshold}")
    assert engine.speculation_by_rows == again["decisions"]


def test_no_measurement_where_nothing_drafts(tiny_target):
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    said = []
    assert decide_speculation_at_startup(engine, None, said.append) is None and not said
    assert engine.config.batch_size_threshold == SpeculationConfig().batch_size_threshold



def test_start_up_reads_the_steps_on_the_step_clock(tiny_target, tiny_draft, monkeypatch):
    """The threshold's steps are read on costs.step_clock's clock, as the decode rows' are (on a
    CPU: CPU seconds of the timing thread at one torch thread, which other jobs do not enter:
    test_engine_decode_rows.py). Here a clock on which every timed call lasts one second: a
    verification then costs exactly a target step and a draft step as much, so batch 1's best is
    k 1 at 1.5 / 2 tokens a step and nothing past it is measured. On the wall clock the
    decision would be whatever the machine's load made of the tiny model's steps."""
    import contextlib

    from specpair import costs

    entered = []

    @contextlib.contextmanager
    def one_second_a_call(device):
        entered.append(device.type)
        ticks = iter(range(10**6))
        yield lambda: float(next(ticks))

    monkeypatch.setattr(costs, "step_clock", one_second_a_call)
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=SpeculationConfig(k=3, k_max=4))
    decided = decide_speculation_by_rows(engine, max_rows=8)
    assert entered == ["cpu"]
    assert decided["decisions"] == [RowsDecision(1, 1, 0.75, False)] and decided["threshold"] == 0
