"""The sizes a cache's shapes come in: rows, tokens per row and capacity are each a power of two
(`bucket`), so a step's shape is one of a few, each compiled (and on CUDA recorded) once; and the
rows of one step grouped by width (`width_groups`) so a joining prompt does not pad every row.
No torch: pure decisions."""

from __future__ import annotations


INITIAL_POSITIONS = 256      # the smallest capacity bucket, in positions per row
# A capacity (rows or positions) shrinks once what live rows need falls to this fraction of it,
# to twice the bucket they need: far enough from the growth point that a row joining and
# leaving at a bucket's edge does not reallocate the cache every step.
SHRINK_BELOW = 4
# Prompts run as one fixed step of their own rows (`StaticKVModel._prefill_step`, recorded as a
# CUDA graph) while their rows times their bucket stays within this many tokens; longer ones are
# compute-bound and run eagerly, attending only the slots they reach.
PREFILL_STEP_TOKENS = 1024


def bucket(n: int, floor: int = 1) -> int:
    """The bucket holding n: the smallest power of two >= n and >= floor. Rows, tokens per row
    and capacity are all bucketed so (one home for the bucket sizes); a step's shape is then
    one of a few, each compiled (and on CUDA captured) once."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


GROUP_CALL_TOKENS = 16   # what one more forward costs, in padded tokens: layer calls, launches


def width_groups(counts: list[int]) -> list[list[int]]:
    """Rows of a step grouped so that each group is padded only to its own widest row: a
    request that joins a running batch feeds its whole prompt while the others feed one token
    and their drafts, and one padded forward would run every row at the prompt's width (16 rows
    joined by a 300-token prompt: 4,800 tokens of work for 315). Rows sorted by width are cut
    where the padding saved pays for the extra forward (GROUP_CALL_TOKENS); -> row indices per
    group, widest first (one group: no cut pays)."""
    order = sorted(range(len(counts)), key=lambda i: -counts[i])
    widths = [max(1, counts[i]) for i in order]     # a row feeding nothing still takes a slot
    n = len(widths)
    if n * (widths[0] if n else 0) - sum(widths) <= GROUP_CALL_TOKENS:
        return [list(range(n))] if n else []     # all the padding would not pay for one cut
    # best[j]: least cost of the first j rows (sorted); a group order[i:j] costs (j-i)*widths[i].
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * widths[i] + (GROUP_CALL_TOKENS if i else 0)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], n
    while j:
        bounds.append((cut[j], j))
        j = cut[j]
    return [sorted(order[i:j]) for i, j in reversed(bounds)]
