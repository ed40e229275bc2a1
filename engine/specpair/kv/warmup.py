"""Warming a fixed-step cache ahead of the first request: every (rows, capacity) bucket the batch
can run at (`buckets`), its layer compiled and on CUDA its step recorded once per bucket on
scratch caches (`warm_up`), and the prompt's step (`_warm_prefill`)."""

from __future__ import annotations

import logging
import time

import torch

from specpair.kv import buckets as sizes
from specpair.kv.graphs import CapturedStep


log = logging.getLogger(__name__)


def buckets(kv: "StaticKVModel", max_rows: int, max_positions: int, rows_from: int = 1
            ) -> list[tuple[int, int]]:
    """Every (rows, capacity) bucket a batch of rows_from to max_rows rows of up to
    max_positions positions can run the fixed step at."""
    rows = [sizes.bucket(1 << i) for i in range(sizes.bucket(max_rows).bit_length())
            if 1 << i >= rows_from]
    top = sizes.bucket(max_positions + kv.token_bucket, kv._position_floor)
    floor = kv._position_floor
    positions = [floor << i for i in range((top // floor).bit_length())]
    return [(r, c) for r in rows for c in positions]


def warm_up(kv: "StaticKVModel", max_rows: int, max_positions: int, rows_from: int = 1) -> dict:
    """Compile the fixed step's layer and, on CUDA, record the step's graph at every bucket
    (`buckets`) on scratch caches of those shapes, so no request pays a compile and every
    shape is proven to record; -> the buckets, the seconds, the graphs recorded and on CUDA
    the most memory one bucket's graph reserved (only the graph of the cache in use is held
    while serving: a real cache records its own in a few replays' time, `_replay`)."""
    r = kv.runner
    cuda = kv.device.type == "cuda"
    started = time.perf_counter()
    shapes = buckets(kv, max_rows, max_positions, rows_from)
    W = kv.token_bucket
    graph_bytes, recorded, seconds = 0, 0, []
    for rows, positions in shapes:
        bucket_started = time.perf_counter()
        shape = (rows, r.kv_heads, positions, r.head_dim)
        caches, table = kv._scratch(shape)
        slots = torch.arange(W).view(1, W).expand(rows, W)
        host = torch.stack((torch.zeros(rows, W, dtype=torch.long), slots, slots))
        capturing = kv.captures_graphs and kv.capture_error is None
        before = torch.cuda.memory_reserved(kv.device) if capturing else 0
        recorded += _warm_shape(kv, host, caches, table=table)
        if capturing:
            torch.cuda.synchronize(kv.device)
            graph_bytes = max(graph_bytes, torch.cuda.memory_reserved(kv.device) - before)
        del caches
        seconds.append(round(time.perf_counter() - bucket_started, 3))
    prefill_started = time.perf_counter()
    recorded += _warm_prefill(kv, max_rows, rows_from)
    if cuda:
        torch.cuda.synchronize(kv.device)
    # Where a cold start goes: a bucket that compiles a new graph class stands out from the
    # ones that only record (the start-up target is a figure of these).
    report = {"token_bucket": W, "buckets": shapes, "graphs": recorded,
              "seconds": round(time.perf_counter() - started, 3), "bucket_seconds": seconds,
              "prefill_seconds": round(time.perf_counter() - prefill_started, 3)}
    if cuda:
        report["graph_memory_bytes"] = graph_bytes
    if kv.capture_error:
        report["capture_error"] = kv.capture_error
    slowest_seconds, slowest = max(zip(seconds, shapes), default=(0.0, "-"))
    log.info("fixed step warmed: %d buckets (rows, capacity) at %d tokens a row in %.1f s "
             "(the slowest %s in %.1f s, the prompt's step %.1f s), %d CUDA graphs recorded%s",
             len(shapes), W, report["seconds"], slowest, slowest_seconds,
             report["prefill_seconds"], recorded,
             f", at most {graph_bytes / 2**20:.0f} MiB each" if cuda else "")
    return report


def _warm_prefill(kv: "StaticKVModel", max_rows: int, rows_from: int = 1) -> int:
    """Compile the prompt's step (`_prefill_step`) ahead of the first request: it reads its
    rows through an index (another graph than the bucket's step) at a token count that
    differs from the bucket's, and the second count seen makes dynamo compile the layer with
    the count symbolic, which then serves every prompt bucket. One row and several, in a cache
    of one row and of several, compile apart (`mark_sizes`): the three that occur. On CUDA
    each recorded once, to prove it records (a real cache records its own graphs in a few
    replays' time). -> graphs recorded."""
    if not kv.compiled or rows_from > 1:   # (past speculation: the same graphs)
        return 0
    r, width, recorded = kv.runner, sizes.bucket(kv.token_bucket + 1), 0
    # (prompt rows, cache rows): a prompt beside none, beside others, several together.
    for rows, cache_rows in ((1, 1), (1, 2), (2, 2)):
        if rows * width > kv.prefill_step_tokens or cache_rows > sizes.bucket(max_rows):
            continue
        shape = (cache_rows, r.kv_heads, sizes.bucket(width, kv._position_floor), r.head_dim)
        caches, table = kv._scratch(shape)
        slots = torch.arange(width).view(1, width).expand(rows, width)
        kv_rows = torch.arange(rows).view(rows, 1).expand(rows, width)
        host = torch.stack((torch.zeros(rows, width, dtype=torch.long), slots, slots, kv_rows))
        recorded += _warm_shape(kv, host, caches, head=False, table=table)
    return recorded


def _warm_shape(kv: "StaticKVModel", host: torch.Tensor, caches, head: bool = True,
                table=None) -> bool:
    """The fixed step once at this input shape on scratch `caches`: compiled (when it is), and
    on CUDA recorded as a graph and replayed, to prove it records. A recording that fails is
    reported once and serving runs uncaptured. -> whether a graph was recorded."""
    if not (kv.captures_graphs and kv.capture_error is None):
        kv._step_uncaptured(host, caches, head, table=table)
        return False
    try:
        CapturedStep(kv.runner, host.to(kv.device), caches, kv.compiled, head=head,
                     table=table)(host)
        return True
    except Exception as exc:     # noqa: BLE001 - reported; serving runs uncaptured
        kv.capture_error = f"{type(exc).__name__}: {exc}"
        log.warning("CUDA graph capture failed at inputs %s: %s", tuple(host.shape),
                    kv.capture_error)
        return False
