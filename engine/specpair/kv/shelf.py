"""A model's most recently released small cache kept, with its CUDA graphs, for the next batch of
that shape (`CacheShelf`), and the lease a cache holds on it (`CacheLease`)."""

from __future__ import annotations

import threading

from specpair.kv.buckets import INITIAL_POSITIONS


class CacheShelf:
    """One model's most recently released small cache, kept with the CUDA graphs recorded over it,
    for the next batch that needs that shape. Every `generate()` is a batch of its own (the bench,
    the gate, the CLI), and a fresh cache records fresh graphs: measured on an H100, recording at
    every request was most of the loop's host time for SmolLM2 (docs/gpu.md). Only small caches
    are kept (KEEP_ROWS rows, KEEP_POSITIONS positions: one-request batches) and only one, so
    memory still follows live rows; a kept cache holds stale keys, which no row ever attends (a
    row attends only the slots before its positions, all written by itself)."""

    KEEP_ROWS = 2
    KEEP_POSITIONS = 2 * INITIAL_POSITIONS

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: tuple | None = None        # (shape, caches, graphs)

    def take(self, shape: tuple) -> tuple | None:
        with self._lock:
            if self._kept is not None and self._kept[0] == shape:
                kept, self._kept = self._kept, None
                return kept[1], kept[2]
        return None

    def give(self, shape: tuple, caches, graphs) -> None:
        if caches and shape[0] <= self.KEEP_ROWS and shape[2] <= self.KEEP_POSITIONS:
            with self._lock:
                self._kept = (shape, caches, graphs)


class CacheLease:
    """The cache a StaticKVModel holds, handed back to its model's shelf when the cache is
    replaced (grown or shrunk) or its batch is gone (weakref.finalize)."""

    def __init__(self, shelf: CacheShelf):
        self.shelf = shelf
        self.shape: tuple | None = None
        self.caches: list = []
        self.graphs: dict = {}

    def release(self) -> None:
        if self.shape is not None:
            self.shelf.give(self.shape, self.caches, self.graphs)
        self.shape, self.caches, self.graphs = None, [], {}
