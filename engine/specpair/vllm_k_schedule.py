"""k by load for a vLLM release: where drafting pays, from what the gate measured.

Speculation that wins at one request can lose at thirty-two while acceptance stays flat: a batch
step is bound by compute sooner, and every drafted token is verified work. vLLM cannot switch
speculation at run time, but it reads a batch-size schedule for k
(`num_speculative_tokens_per_batch_size` in `--speculative-config`: inclusive ranges
`[start, end, k]`, the first starting at 1, k 0 drafting nothing, the last range's k carried past
its end, every k capped at `num_speculative_tokens`). The vLLM gate (gate/vllm.py) measures the
release at the concurrencies it will serve (the pair's `gating.tuning.batchSizes`), target-only
and speculative, and this module turns those speedups into the schedule the pods get.

The rule is the specpair engine's batch threshold (gate/engine.py), per range: the release's k
from batch 1 through the unbroken run of measured concurrencies that pay, 0 from the first that
does not. Batch 1 always drafts: whether speculation pays there is the gate's minSpeedup call,
so tuning never turns speculation off for good. Each measured concurrency's choice holds from it
up to the next measured one (between two points nothing was measured; the lower one's answer
stands). A pure function: the gate and the tests call it alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

# Drafting pays at a concurrency when the speculative server finishes the same requests faster.
PAYING_SPEEDUP = 1.0


@dataclass(frozen=True)
class LoadPoint:
    """What the gate measured at one concurrency: requests in flight at once, and the target-only
    wall time over the speculative one for the same requests (median of the gate's runs)."""
    concurrency: int
    speedup: float


def k_by_batch_size(points: Iterable[LoadPoint], k: int) -> list[list[int]] | None:
    """vLLM's num_speculative_tokens_per_batch_size for a release drafting `k` tokens, from the
    gate's load points: adjacent ranges of equal k merged, the last ending at the largest
    concurrency measured. None: drafting pays at every concurrency measured (or none was), so k
    serves throughout and no schedule is shipped (vLLM keeps its uniform-k scheduling)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    by_concurrency: dict[int, float] = {}
    for point in points:
        if point.concurrency < 1:
            raise ValueError(f"a concurrency must be >= 1, got {point.concurrency}")
        if point.concurrency in by_concurrency:
            raise ValueError(f"concurrency {point.concurrency} measured twice")
        by_concurrency[point.concurrency] = float(point.speedup)
    if not by_concurrency:
        return None
    # (start, k) per measured concurrency: k through the unbroken run that pays, 0 after.
    starts, paying = [], True
    for concurrency in sorted(by_concurrency):
        paying = paying and (concurrency == 1 or by_concurrency[concurrency] > PAYING_SPEEDUP)
        starts.append((concurrency, k if paying else 0))
    if all(chosen == k for _, chosen in starts):
        return None
    # Batch sizes below the first concurrency measured draft (batch 1 always does).
    if starts[0][0] != 1:
        starts.insert(0, (1, k))
    schedule: list[list[int]] = []
    for i, (start, chosen) in enumerate(starts):
        end = starts[i + 1][0] - 1 if i + 1 < len(starts) else start
        if schedule and schedule[-1][2] == chosen:
            schedule[-1][1] = end
        else:
            schedule.append([start, end, chosen])
    return schedule


def k_at(schedule: list[list[int]] | None, batch_size: int, k: int) -> int:
    """The k a schedule drafts at `batch_size`, as vLLM's dense lookup reads it (the last range's
    k past its end; no schedule: k)."""
    if not schedule:
        return k
    chosen = schedule[0][2]
    for start, _end, value in schedule:
        if start > batch_size:
            break
        chosen = value
    return min(chosen, k)
