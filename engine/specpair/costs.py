"""What speculation costs on this hardware: the step costs dynamic k chooses by, and step timing.

`measure_step_costs` times the kernels a round is made of (a target step, a verification of k+1
tokens, a draft step); `CostModel` turns those seconds into costs relative to one target step, and
`DynamicK` picks each round's k by them. The engine calibrates with them at serving time
(`SpeculativeEngine.calibrate`), the bench prices its bound with them; `StepTiming` is where a
batch's steps spent their time.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from specpair.config import GenerationParams, SpeculationConfig
from specpair.prefix_cache import BLOCK_TOKENS


@dataclass
class CostModel:
    """Costs of one round relative to one target decode step, measured on this hardware.

    draft: one draft step; verify[k]: one target pass over k+1 tokens. On a GPU verify[k] is close
    to 1 for small k; on a CPU it grows with k (the issue measured 1.64 for k=4), which is why a
    fixed k that pays on a GPU can lose on a CPU.
    """

    draft: float
    verify: dict[int, float]
    draft_per_token: bool = True      # False: one draft pass per round whatever k (Medusa, n-gram)
    # What a drafting round costs beyond its draft steps, whatever k: an EAGLE head's catch-up
    # on the pairs observed since its last round and its first draft (measured on an H100:
    # about 2 ms a round outside the recorded drafting steps, more than a SmolLM2 step).
    draft_round: float = 0.0

    @classmethod
    def from_seconds(cls, costs: dict) -> "CostModel":
        t1 = costs["target_step"]
        return cls(draft=costs["draft_step"] / t1, verify={k: v / t1 for k, v in costs["verify"].items()},
                   draft_per_token=costs.get("draft_per_token", True),
                   draft_round=costs.get("draft_round", 0.0) / t1)

    def round_cost(self, k: int) -> float:
        if k in self.verify:
            v = self.verify[k]
        else:
            near = min(self.verify, key=lambda x: abs(x - k))
            v = self.verify[near] * (k + 1) / (near + 1) if k > near else self.verify[near]
        drafting = (k * self.draft if self.draft_per_token else self.draft) + self.draft_round
        return (drafting if k > 0 else 0.0) + v


def row_back_off_enabled() -> bool:
    """The per-row back-off (DynamicK) is on unless SPECPAIR_ROW_BACK_OFF=off. What live
    acceptance reads under it is the audited requests' (RequestAudit)."""
    return os.environ.get("SPECPAIR_ROW_BACK_OFF", "on").strip().lower() not in ("0", "off", "false", "no")


# The share of requests that draft every round, whatever their acceptance (no per-row back-off):
# the sample live acceptance is read from (drift's per-request sums, the engine-wide fallback,
# shadow scoring). A backed-off row drafts only at its request's start and in probes, so its
# rounds say how a request begins, not how the drafter does: on test_prometheus_live's tiny pair
# (4 code prompts x 12 tokens, k 3) a mediocre draft was accepted 12/42 drafting every round and
# 0/16 backed off, 0/12 of them in full rounds, against 0.3 gated. A share drawn at random, before
# a request's first round, is a sample its acceptance cannot bias. Its price: an audited request
# whose drafts fail pays for them (on the CPU some 8% of its time, so half the requests cost some
# 4% overall, where no back-off costs 8%), and drift's evidence comes from half the traffic
# (its windows need `minRequests` audited requests). SPECPAIR_AUDIT_SHARE sets another.
AUDIT_SHARE = 0.5


class RequestAudit:
    """Draws which requests are audited (AUDIT_SHARE): drafted every round, counted live."""

    def __init__(self, share: float | None = None, seed: int | None = None):
        if share is None:
            share = float(os.environ.get("SPECPAIR_AUDIT_SHARE", AUDIT_SHARE))
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"audit share must be in [0, 1], got {share}")
        self.share = share
        self._rng = random.Random(seed)

    def draw(self, config: SpeculationConfig) -> bool:
        """Whether the next request is audited. Where rows do not back off at all (the pair sets
        fallback_threshold 0, or SPECPAIR_ROW_BACK_OFF=off) every request drafts every round and
        is counted."""
        if not (config.fallback_threshold > 0 and row_back_off_enabled()):
            return True
        return self.share >= 1.0 or (self.share > 0.0 and self._rng.random() < self.share)


class DynamicK:
    """Chooses k for a sequence's next round.

    Without a cost model: transformers' heuristic (grow by 2 after a fully accepted round, shrink by
    1 after a rejection). With one: keep a moving estimate of the acceptance at each draft position
    (given the previous ones were accepted) and pick the k that maximises expected tokens per unit
    of time, (1 + sum_j prod_{i<=j} a_i) / (k * c + verify(k)), Leviathan's objective with the
    measured costs instead of the assumption that verification costs one step.
    """

    EMA = 0.3
    # The per-row back-off: after BACKOFF_AFTER rounds in a row whose drafts were all rejected
    # (or, with a cost model, once no k is expected to beat a target-only step), the row drafts
    # nothing for a rest of BACKOFF_FIRST rounds, then probes with k_min; a probe rejected again
    # doubles the rest (up to BACKOFF_MAX), an accepted draft ends the back-off. A row's own
    # failures decide, whatever the other rows or the machine do: a request whose drafts keep
    # failing stops paying their verification (on a CPU, verifying k+1 tokens costs more than one).
    BACKOFF_AFTER = 3
    BACKOFF_FIRST = 8
    BACKOFF_MAX = 256

    def __init__(self, config: SpeculationConfig, cost_model: CostModel | None = None, *,
                 back_off: bool | None = None):
        """back_off: the per-row back-off; default on where the engine falls back at all
        (fallback_threshold > 0: a pair that sets 0 asks to keep drafting whatever it costs)."""
        self.config = config
        self.k = config.k
        self.cost_model = cost_model
        # Prior: the acceptance a fresh pair is assumed to have until it shows otherwise.
        self.position_acceptance = [0.7] * config.k_max
        self.back_off = (config.fallback_threshold > 0 and row_back_off_enabled()) if back_off is None \
            else back_off
        self.rejected_rounds = 0          # rounds in a row whose drafts were all rejected
        self.rest = 0                     # rounds left without drafting (backed off while > 0)
        self.next_rest = self.BACKOFF_FIRST
        self.probing = False              # the last round drafted as a probe after a rest
        self.backoffs = 0                 # times this row backed off

    @property
    def backed_off(self) -> bool:
        return self.rest > 0

    def update(self, drafted: int, accepted: int) -> None:
        if self.back_off and self._back_off(drafted, accepted):
            return
        if not self.config.dynamic_k or drafted == 0:
            return
        if self.cost_model is None:
            if accepted == drafted:
                self.k = min(self.config.k_max, self.k + 2)
            else:
                self.k = max(self.config.k_min, self.k - 1)
            return
        # Positions before the first rejection were accepted; the first rejected one was not;
        # later positions were never judged.
        for j in range(min(drafted, accepted + 1)):
            hit = 1.0 if j < accepted else 0.0
            self.position_acceptance[j] += self.EMA * (hit - self.position_acceptance[j])
        self.k = self.best_k()

    def _back_off(self, drafted: int, accepted: int) -> bool:
        """Feed the back-off one round; True when it set k (resting or probing), so the dynamic
        rule leaves k alone this round."""
        if self.rest > 0:
            if drafted == 0:
                self.rest -= 1
                if self.rest == 0:       # probe: the smallest k, one round
                    self.k, self.probing = self.config.k_min, True
            return True
        if drafted == 0:
            return False                 # nothing judged (nothing to look up, batch too large, ...)
        if accepted > 0:
            self.rejected_rounds, self.next_rest = 0, self.BACKOFF_FIRST
            self.probing = False         # (after a probe: drafts pay again, from k_min on)
            return False
        self.rejected_rounds += 1
        if self.probing or self.rejected_rounds >= self.BACKOFF_AFTER or self._never_pays():
            if self.probing:
                self.next_rest = min(self.BACKOFF_MAX, 2 * self.next_rest)
            self.rest, self.k, self.probing = self.next_rest, 0, False
            self.rejected_rounds = 0
            self.backoffs += 1
            return True
        return False

    def _never_pays(self) -> bool:
        """With a cost model: whether, after this rejection, no k is expected to emit more tokens
        per unit of time than a target-only step (1 token for 1)."""
        if self.cost_model is None or not self.config.dynamic_k:
            return False
        first = self.position_acceptance[0] + self.EMA * (0.0 - self.position_acceptance[0])
        acceptance = [first, *self.position_acceptance[1:]]
        expected, survive = 1.0, 1.0
        for k in range(1, self.config.k_max + 1):
            survive *= acceptance[k - 1]
            expected += survive
            if expected / self.cost_model.round_cost(k) >= 1.0:
                return False
        return True

    def best_k(self) -> int:
        best, best_rate, expected, survive = self.config.k_min, -1.0, 1.0, 1.0
        for k in range(1, self.config.k_max + 1):
            survive *= self.position_acceptance[k - 1]
            expected += survive
            rate = expected / self.cost_model.round_cost(k)
            if k >= self.config.k_min and rate > best_rate:
                best, best_rate = k, rate
        return best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepTiming:
    """Where a batch's steps spent their time (the bench's host time per step).

    model_seconds: inside the model calls (draft proposals, target forwards), each waited for;
    wait_seconds: of that, blocked on the device after the call returned. On an asynchronous
    device the host's time is the steps' time less the waiting; on a CPU the model calls run on
    the host and nothing is waited for, so the host's own share is the time outside the calls.
    """

    steps: int = 0
    seconds: float = 0.0
    model_seconds: float = 0.0
    wait_seconds: float = 0.0

    def merge(self, other: "StepTiming") -> None:
        for name in ("steps", "seconds", "model_seconds", "wait_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class CostTiming:
    """How a drafter times its own steps for the cost model (Drafter.cost_probe): `extends(model,
    sizes)` the fastest extend of each size, `after_one(fn)` the fastest call after a warm-up,
    `lookup(drafter)` the fastest lookup, on a prompt of `prompt_length` tokens."""
    prompt_length: int
    extends: Callable[[Any, list[int]], dict[int, float]]
    after_one: Callable[[Callable[[], object]], float]
    lookup: Callable[[Any], float]


def timed(fn, device, clock: Callable[[], float] = time.perf_counter) -> tuple[float, object]:
    sync(device)
    start = clock()
    out = fn()
    sync(device)
    return clock() - start, out


@torch.no_grad()
def measure_step_costs(engine, prompt_ids: list[int], ks: list[int],
                       repeats: int = 5, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Seconds a SpeculativeEngine's kernels take, the fastest of `repeats` after a warm-up: T1 (target, 1 token), Tv[k] (target,
    k+1 tokens; 1 + k*width when a head drafts a tree of `width` candidates per position), Td
    (one draft step). The target's passes are timed in turns (T1, Tv[1], ..., T1, ...), not one
    size after another: a burst of other work on a shared machine then slows one turn of every
    size rather than all the timings of one size, which priced a single k at twice its cost.
    `clock`: what the seconds are read on (step_clock's, at start-up)."""
    device = engine.target.device

    def fastest_extends(model, token_counts: list[int]) -> dict[int, float]:
        kv = engine.serving_cache(model)
        kv.add_rows(1)
        kv.extend([prompt_ids])
        base = kv.lengths[0]
        best = {n: float("inf") for n in token_counts}
        for turn in range(repeats + 1):
            for n in token_counts:
                seconds, _ = timed(lambda: kv.extend([prompt_ids[:n] or [0]], last=n), device, clock)
                kv.rollback(0, base)
                kv.trim()
                if turn:          # the first turn warms up
                    best[n] = min(best[n], seconds)
        return best

    def fastest_lookup(drafter) -> float:
        seq = list(prompt_ids) * 2
        return min(timed(lambda: drafter.lookup(seq, max(ks)) if hasattr(drafter, "lookup") else None,
                          device, clock)[0] for _ in range(repeats))

    lookup_first = engine.drafter is not None and engine.drafter.copies
    # Lookup first, then a head: priced as its head (what k is chosen by, dynamic_k's cost model)
    drafter = engine.drafter.priced_as() if engine.drafter is not None else None
    width = engine.config.tree_width if drafter is not None and drafter.tree_capable else 1
    sizes = {1, *(1 + k * width for k in ks)}
    if lookup_first:      # ... which verifies a chain in the rounds that copy
        sizes |= {1 + k for k in ks}
    passes = fastest_extends(engine.target.model, sorted(sizes))
    costs = {"target_step": passes[1], "tree_width": width,
             "verify": {k: passes[1 + k * width] for k in ks}}
    # n-gram: one lookup per round; models and heads: one step per draft token
    costs["draft_per_token"] = drafter is not None and drafter.draft_per_token

    def fastest_after_one(fn) -> float:
        return min([timed(fn, device, clock)[0] for _ in range(repeats + 1)][1:])

    if drafter is not None:      # each drafter times its own step (Drafter.cost_probe)
        costs.update(drafter.cost_probe(CostTiming(len(prompt_ids), fastest_extends, fastest_after_one,
                                                   fastest_lookup)))
    else:
        costs["draft_step"] = 0.0
    if lookup_first:
        # ... but its rounds that copy cost a lookup and a chain's verification: the bound prices
        # those rounds (recorded apart, AcceptanceStats) at these.
        costs["copy"] = {"verify": {k: passes[1 + k] for k in ks},
                         "draft_step": fastest_lookup(engine.drafter), "draft_per_token": False}
    return costs


# -- speculation by batch size, from costs measured at start-up ------------------------------------

# The acceptance the start-up decision assumes before any request has been seen: the share of
# draft tokens below which the engine stops speculating anyway (SpeculationConfig's default
# fallback_threshold). A pair that drafts better gains from speculation at more sizes than this
# decides; one that drafts worse is caught per row (DynamicK's back-off) and by the fallback.
STARTUP_ACCEPTANCE = 0.5
# Row buckets measured at start-up, up to this (the paged pool's default batch cap).
STARTUP_MAX_ROWS = 64


@dataclass(frozen=True)
class RowsCosts:
    """Seconds one step of `rows` rows takes: target_step with one token a row, verify[k] with
    each row's k drafts and bonus token, draft[k] drafting k tokens for every row."""
    rows: int
    target_step: float
    verify: dict[int, float]
    draft: dict[int, float]


@dataclass(frozen=True)
class RowsDecision:
    rows: int
    k: int               # the k with most tokens a second at this batch size
    speedup: float       # expected, over target-only, at that k
    pays: bool


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round emits with k drafts, each accepted with `acceptance` given the ones before
    it were: the bonus token plus acceptance + acceptance^2 + ... + acceptance^k."""
    return sum(acceptance ** j for j in range(k + 1))


def speculation_by_rows(costs: list[RowsCosts], acceptance: float) -> list[RowsDecision]:
    """Per batch size: the k that emits most tokens per second at this acceptance, and whether
    that beats target-only's one token a step (strictly: a tie is no reason to pay for drafts)."""
    decisions = []
    for c in sorted(costs, key=lambda c: c.rows):
        best_k, best = 0, 0.0
        for k in sorted(c.verify):
            # Verifying k+1 tokens costs at least a step of one: a faster timing is noise (a burst
            # elsewhere slowed the one-token step) and would price drafts above their worth.
            round_seconds = max(c.verify[k], c.target_step) + c.draft.get(k, 0.0)
            speedup = expected_tokens(acceptance, k) * c.target_step / round_seconds if round_seconds > 0 else 0.0
            if speedup > best:
                best_k, best = k, speedup
        decisions.append(RowsDecision(c.rows, best_k, round(best, 4), best > 1.0))
    return decisions


def threshold_of(decisions: list[RowsDecision]) -> int:
    """The largest batch size of the unbroken run of paying sizes from the smallest (0: none
    pays). Between two measured sizes the smaller's verdict holds (a bucket's rows share its step)."""
    threshold = 0
    for d in sorted(decisions, key=lambda d: d.rows):
        if not d.pays:
            break
        threshold = d.rows
    return threshold


def k_for_rows(decisions: list[RowsDecision] | None, rows: int) -> int | None:
    """The largest k a round of a batch of `rows` rows may draft, from the start-up decisions:
    the k of the largest measured size up to `rows` (between two measured sizes the smaller's
    verdict holds, as threshold_of reads them), 0 where drafting did not pay there. None, no
    limit: nothing was measured, or batch 1, where each row's own k and back-off judge its real
    acceptance (the decision there assumed STARTUP_ACCEPTANCE)."""
    if not decisions or rows <= 1:
        return None
    measured = [d for d in sorted(decisions, key=lambda d: d.rows) if d.rows <= rows]
    if not measured:
        return None
    last = measured[-1]
    return last.k if last.pays else 0


@torch.no_grad()
def measure_rows_costs(engine, prompt_ids: list[int], rows: int, ks: list[int], drafting: dict,
                       repeats: int = 2, clock: Callable[[], float] = time.perf_counter) -> RowsCosts:
    """Times one target step of `rows` rows at one token a row and at each k's verification
    width, the fastest of `repeats` after a warm-up, in turns (as measure_step_costs). Drafting
    comes from the one-row probe (`drafting`: measure_step_costs' draft_step, draft_per_token,
    draft_round), times the rows: n-gram lookups and the CPU's heads run row by row, and a draft
    model's batched step costs no more than that, so the decision errs towards target-only."""
    device = engine.target.device
    width = engine.config.tree_width if engine.drafter is not None and engine.drafter.tree_capable else 1
    kv = engine.serving_cache(engine.target.model)
    kv.add_rows(rows)
    kv.extend([prompt_ids] * rows)
    base = kv.lengths[0]
    sizes = sorted({1, *(1 + k * width for k in ks)})
    best = {n: float("inf") for n in sizes}
    for turn in range(repeats + 1):
        for n in sizes:
            seconds, _ = timed(lambda: kv.extend([(prompt_ids * n)[:n]] * rows, last=n), device, clock)
            for row in range(rows):
                kv.rollback(row, base)
            kv.trim()
            if turn:
                best[n] = min(best[n], seconds)
    step = drafting.get("draft_step", 0.0)
    per_token = drafting.get("draft_per_token", True)
    draft = {k: rows * ((k * step if per_token else step) + drafting.get("draft_round", 0.0)) for k in ks}
    return RowsCosts(rows, best[1], {k: best[1 + k * width] for k in ks}, draft)


def decide_speculation_by_rows(engine, max_rows: int = STARTUP_MAX_ROWS,
                               acceptance: float = STARTUP_ACCEPTANCE,
                               prompt: str = "The quick brown fox jumps over the lazy dog. ") -> dict:
    """Measure at the engine's row buckets (1, 2, 4, ... max_rows) and decide per batch size
    whether drafting pays and with which k. Stops measuring at the first size that does not pay:
    the threshold is the unbroken run from 1, so larger sizes could not change it. The steps are
    read on step_clock's clock, as the decode rows' (on a CPU: CPU seconds at one thread, which
    other jobs on the machine do not enter; the decision is by ratios of the steps' seconds).
    Returns {"decisions": [RowsDecision...], "threshold": int, "seconds": float}."""
    started = time.perf_counter()
    ids = engine.encode(prompt)
    # Two verification widths a size: the pair's k and 1 (the k chosen is one of them). Each
    # width is a timed target step a row bucket; on a busy 2-core machine a SmolLM2 step took
    # 1.5 s, and six widths to 8 rows took 405 s to measure.
    ks = sorted({1, min(engine.config.k, engine.config.k_max)})
    costs, decisions, rows = [], [], 1
    with step_clock(engine.target.device) as clock:
        drafting = measure_step_costs(engine, ids, ks[:1], repeats=2, clock=clock)
        while rows <= max(1, max_rows):
            costs.append(measure_rows_costs(engine, ids, rows, ks, drafting, clock=clock))
            decisions = speculation_by_rows(costs, acceptance)
            if not decisions[-1].pays:
                break
            rows *= 2
    return {"decisions": decisions, "threshold": threshold_of(decisions),
            "seconds": time.perf_counter() - started}


# -- rows decoded together, from step costs measured at start-up -----------------------------------

# Row counts timed at start-up (those up to the rows admission holds, and that number itself).
DECODE_ROWS_MEASURED = (1, 4, 8, 16, 32, 64)
# A larger batch is worth its rows only where it emits more than this share more tokens a second
# than a smaller one: between two counts within it the fewer rows decode (the rows past them wait,
# and a batch of fewer rows ends its requests sooner), and a start-up timing on a shared machine
# is not finer than this. On 2 CPU cores SmolLM2's 8-row step is compute-bound already, and 32
# rows cost 1.23x a token (docs/server.md); on a GPU a row costs little until 64.
DECODE_ROWS_MARGIN = 0.10
# The margin where the steps are timed in CPU seconds at one thread (a CPU: step_clock). Those do
# not move with other jobs (two timings of SmolLM2 at load 25-30 agreed within 3% at every
# count), so a finer margin; and they leave out what a two-thread step pays in wall time each
# step whatever its rows (its Python, its fork-joins), which favours more rows. With 10% the CPU
# figures chose 16 rows once and 32 once (16: 199 and 194, 32: 210 and 209, 64: 214 and 215
# tokens a CPU second); with 5% both choose 32, as the quiet wall-clock figures did.
DECODE_ROWS_CPU_MARGIN = 0.05
# The shared prompt the start-up measurement decodes after, in tokens: the positions the paged
# pool plans a row at (block_pool.PLANNED_ROW_POSITIONS) where a prefix store shares them among
# the rows; without one each row would prefill its own, so a short prompt.
DECODE_ROWS_UNSHARED_CONTEXT = 32
# Turns of the measurement (each times every row count, in alternating order) and timed steps a
# count in each turn: the median of turns x steps is each count's figure.
DECODE_ROWS_TURNS = 3
DECODE_ROWS_STEPS = 2


def tokens_per_second(step_seconds: dict[int, float]) -> dict[int, float]:
    """Tokens a second of a target-only decode step at each measured row count (one a row)."""
    return {rows: rows / seconds for rows, seconds in sorted(step_seconds.items()) if seconds > 0}


def decode_rows_cap(step_seconds: dict[int, float], margin: float = DECODE_ROWS_MARGIN) -> int:
    """The rows to decode together: the fewest measured whose tokens a second come within
    `margin` of the best measured count's, so no row count that measured slower per token than a
    smaller one is chosen, nor one that measured barely faster. step_seconds: the median seconds
    of one target-only decode step at each row count."""
    rates = tokens_per_second(step_seconds)
    if not rates:
        raise ValueError("no decode step timed: nothing to choose the rows by")
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    best = max(rates.values())
    return min(rows for rows, rate in rates.items() if rate * (1.0 + margin) >= best)


# The longer context the start-up measurement times a decode step at besides the planned one,
# as a multiple of it: what one more position of context costs a row, so that the rows are priced
# at the context being served (DecodeStepCosts.at). On 2 CPU cores the quiet shared-prefix chat
# load served rows at 1,696 positions where start-up measured at 513 (2026-12-07).
DECODE_ROWS_LONG_CONTEXT = 4


@dataclass(frozen=True)
class DecodeStepCosts:
    """Median seconds of a target-only decode step at each row count after `context` positions,
    and what one more position costs a row of a step (`per_row_position`, seconds): attention
    reads each row's own positions, so a step of r rows at context c costs about
    seconds[r] + r * (c - context) * per_row_position. Where attention dominates (long chats on
    a CPU), more rows share less of a step, and fewer rows decode as fast a token."""
    seconds: dict[int, float]
    context: int
    per_row_position: float = 0.0
    margin: float = DECODE_ROWS_MARGIN      # the rule's, for these seconds' clock (step_margin)

    def at(self, context: int) -> dict[int, float]:
        """The step seconds of each row count priced at `context` positions (no cheaper than a
        tenth of the measured step: a context shorter than the measured one saves at most its
        attention, not the weights' reads)."""
        if context < 0:
            raise ValueError(f"context must be >= 0, got {context}")
        return {rows: max(0.1 * seconds, seconds + rows * (context - self.context) * self.per_row_position)
                for rows, seconds in sorted(self.seconds.items())}


def per_row_position_cost(short_seconds: float, long_seconds: float, rows: int, short_context: int,
                          long_context: int) -> float:
    """Seconds one more position of context costs a row of a decode step, from one row count
    timed at two contexts (0 where the longer measured no slower: the noise of a shared machine
    is no evidence that context is free, but no evidence of a cost either)."""
    if rows < 1 or long_context <= short_context:
        raise ValueError(f"need rows >= 1 and a longer second context, got {rows} rows at "
                         f"{short_context} and {long_context}")
    return max(0.0, (long_seconds - short_seconds) / (rows * (long_context - short_context)))


def decode_rows_at(costs: DecodeStepCosts, context: int, margin: float | None = None) -> int:
    """The rows to decode together where the rows being served hold about `context` positions:
    decode_rows_cap over the step costs priced there (by the costs' own margin unless given)."""
    return decode_rows_cap(costs.at(context), costs.margin if margin is None else margin)


def serving_context(lengths: list[int], default: int) -> int:
    """The context a step of these rows is priced at: their mean length in positions (prompt and
    what they may still emit); `default` where there are none yet."""
    return round(sum(lengths) / len(lengths)) if lengths else default


def decode_row_counts(max_rows: int, measured: tuple[int, ...] = DECODE_ROWS_MEASURED) -> list[int]:
    """The row counts to time where admission holds `max_rows`: the standard ones below it and it."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return sorted({r for r in measured if r < max_rows} | {max_rows})


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


@contextlib.contextmanager
def step_clock(device: torch.device):
    """The clock a start-up timing of decode steps reads (yields a callable giving seconds).

    On a GPU the wall clock: the device does the work. On a CPU, the calling thread's CPU
    seconds with torch (and the C layer, which runs torch's thread count) at one thread for the
    while: the step's whole work then runs in this thread, so its CPU seconds are what the step
    costs, whatever else the machine runs. Wall seconds at two threads read other jobs instead:
    at load 23-28 on 2 cores the wall-clock timing of SmolLM2 took 342 s and read 0.4 tok/s at
    1 row and 14.4 at 64 (each of a step's ~150 parallel regions waits for its partner thread
    to be scheduled again, a wait that does not grow with the rows), so it chose 64 rows where
    the quiet machine's figures choose 32
    (docs/measurements/2026-12-07c-startup-rows-and-openmp-wait-cpu.md).
    Rows share a step's weights alike at one thread or two, so their ratio is what the rows are
    chosen by; the seconds are CPU seconds, not a two-thread step's wall time."""
    if device.type != "cpu":
        yield time.perf_counter
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield time.thread_time
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def measure_decode_steps(engine, row_counts: list[int], context_tokens: int,
                         turns: int = DECODE_ROWS_TURNS, steps: int = DECODE_ROWS_STEPS
                         ) -> tuple[dict[int, float], int]:
    """Median seconds of one target-only decode step of a real Batch at each row count, every row
    after the same `context_tokens`-token prompt (served to all but the first row by the prefix
    store, as a shared system prompt is). The counts are timed in turns, in ascending then
    descending order, one batch grown and shrunk between them (rows cancelled, or added and their
    prompt's last token fed in a step not timed): a burst of other work on a shared machine slows
    one turn of every count, not every timing of one (the start-up threshold's noise, 2026-12-06).
    The engine's observers, speculation controller, request audit and prefix counters are as
    they were afterwards. A step's seconds are read on step_clock's clock: on a CPU, CPU seconds of
    the step's work at one thread, so what other jobs on the machine do does not enter them.
    Returns (the medians by row count, the prompt's tokens: fewer than `context_tokens` where the
    model's context leaves no room for the steps)."""
    if not row_counts:
        raise ValueError("no row counts to time")
    # Every row steps in at most every turn's every count: room for that many tokens.
    budget = turns * len(row_counts) * (steps + 1) + 2
    # Whole prefix-store blocks and one token: a row joining is served every block but the one
    # holding its prompt's last token, so it prefills that token alone (a joining row whose
    # prompt tail took a block's worth of positions made each turn's first step a prefill of
    # 63 x 16 positions: seconds of SmolLM2 on 2 cores).
    length = min(context_tokens, engine.target.context_length - budget - 2)
    length = max(1, length - length % BLOCK_TOKENS + 1) if length > BLOCK_TOKENS else max(1, length)
    seed_text = engine.encode("The quick brown fox jumps over the lazy dog. ")
    prompt = (seed_text * (length // max(1, len(seed_text)) + 1))[:length]
    params = GenerationParams(max_new_tokens=budget, speculation_k=0)
    controller = engine.controller
    saved = {name: copy.deepcopy(value) for name, value in vars(controller).items() if name != "config"}
    audit, prefix, eos = copy.deepcopy(engine.audit), copy.deepcopy(engine.prefix_stats), engine.eos_ids
    # A timing row steps whatever it emits: a greedy reply that reached its end of sequence
    # would end every row of the same prompt at once, and no count would be timed.
    engine.eos_ids = frozenset()
    timings: dict[int, list[float]] = {rows: [] for rows in row_counts}
    ids, device = itertools.count(), engine.target.device
    with engine.observers_paused():
        batch = engine.new_batch()
        batch.speculate = False
        # Whole prompts: the untimed steps below feed a row's prompt in one step. Under a prefill
        # budget the first prompt's step stored only its first chunk, so every joining row
        # prefilled thousands of uncached positions, ran the pool dry and was preempted: no count
        # was ever timed and SmolLM2's server failed to start (2026-12-07, 82b625d).
        batch.prefill_budget = None
        try:
            batch.add(prompt, params, request_id=f"decode-rows-{next(ids)}")
            batch.step()             # the prompt once: the other rows are served its blocks
            for turn in range(turns):
                order = sorted(row_counts, reverse=bool(turn % 2))
                for rows in order:
                    while batch.active > rows:
                        batch.cancel(batch.rows[-1].request_id)
                    if batch.active < rows:
                        while batch.active < rows:
                            batch.add(prompt, params, request_id=f"decode-rows-{next(ids)}")
                        batch.step()     # the new rows' last prompt token (not timed)
                    with step_clock(device) as clock:
                        for _ in range(steps):
                            if batch.active != rows:    # (a row cannot end before its budget)
                                break
                            sync(device)
                            start = clock()
                            batch.step()
                            sync(device)
                            timings[rows].append(clock() - start)
                    batch.done.clear()
        finally:
            for seq in list(batch.rows):
                batch.cancel(seq.request_id)
            batch.release()
            vars(controller).update(saved)
            engine.audit, engine.prefix_stats, engine.eos_ids = audit, prefix, eos
    missing = [rows for rows, seconds in timings.items() if not seconds]
    if missing:
        raise RuntimeError(f"no decode step timed at {missing} rows (rows kept ending)")
    return {rows: _median(seconds) for rows, seconds in timings.items()}, len(prompt)


def step_margin(device: torch.device) -> float:
    """The rows rule's margin for steps timed on this device's clock (step_clock)."""
    return DECODE_ROWS_CPU_MARGIN if device.type == "cpu" else DECODE_ROWS_MARGIN


def decide_decode_rows(engine, max_rows: int, margin: float | None = None,
                       turns: int = DECODE_ROWS_TURNS, steps: int = DECODE_ROWS_STEPS,
                       long_context: int = DECODE_ROWS_LONG_CONTEXT) -> dict:
    """Time target-only decode steps at the row counts up to `max_rows` (the rows admission
    holds) and choose the rows decoded together (decode_rows_cap); then those rows again
    after `long_context` times the context, which prices a position of context a row
    (DecodeStepCosts: the worker decides the rows at the context it serves). Returns {"rows":
    int, "step_seconds": {rows: s}, "tokens_per_second": {rows: tok/s}, "context": tokens,
    "costs": DecodeStepCosts, "seconds": measuring time}."""
    from specpair.block_pool import PLANNED_ROW_POSITIONS

    started = time.perf_counter()
    context = PLANNED_ROW_POSITIONS if engine.prefix_store is not None else DECODE_ROWS_UNSHARED_CONTEXT
    counts = decode_row_counts(max_rows)
    seconds, context = measure_decode_steps(engine, counts, context, turns=turns, steps=steps)
    margin = step_margin(engine.target.device) if margin is None else margin
    rows, per_position = decode_rows_cap(seconds, margin), 0.0
    if long_context > 1:
        # At the rows chosen (those served), two turns: each server start without a setting pays
        # for this, a tiny model's in CI as SmolLM2's in a pod.
        longer, measured = measure_decode_steps(engine, [rows], context * long_context, turns=2,
                                                steps=steps)
        # At least twice as long, or no price: a model whose context leaves no room for a longer
        # prompt would price a position by the noise between two timings a few positions apart.
        if measured >= 2 * context:
            per_position = per_row_position_cost(seconds[rows], longer[rows], rows, context, measured)
    return {"rows": rows, "step_seconds": seconds,
            "tokens_per_second": tokens_per_second(seconds), "context": context,
            "costs": DecodeStepCosts(seconds, context, per_position, margin),
            "seconds": time.perf_counter() - started}
