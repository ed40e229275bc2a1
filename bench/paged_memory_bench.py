#!/usr/bin/env python
"""The paged KV cache against the contiguous one on the load of issue 51, in memory: 32 rows
holding one shared 1,504-position system prompt (copied into each contiguous row, as the prefix
store serves it; taken by reference by each paged row), their own 20-token prompts, then decode
steps: KV bytes held and step times (docs/measurements/2026-12-06-paged-cpu.md).

    python bench/paged_memory_bench.py
"""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
import torch
from specpair.models import load_model
from specpair.kv.static import StaticKVModel
from specpair.paged_cache import PagedKVModel
from specpair.prefix_cache import block_keys
t = load_model("default"); m = t.model
R, P, OWN = 32, 1504, 20                      # rows, shared prefix positions, own prompt tokens
static = StaticKVModel(m); static.add_rows(R)
span = [torch.zeros(len(m.model.layers), 2, m.config.num_key_value_heads, P, m.config.hidden_size // m.config.num_attention_heads)]
for i in range(R):
    static.load_blocks(i, span)
paged = PagedKVModel(m, blocks=P // 16 + R * 8 + 8)
paged.add_rows(R)
names = block_keys("m", list(range(P + OWN)))
paged.pool.allocate(paged.keys[0], P); paged.pool.publish(paged.keys[0], names[:P // 16]); paged.lengths[0] = P
for i in range(1, R):
    paged.share_prefix(i, names, P + OWN)
own = [[5] * OWN] * R
s = time.perf_counter(); static.extend(own); print("static own-prompt step", round(time.perf_counter() - s, 2), flush=True)
s = time.perf_counter(); paged.extend(own); print("paged own-prompt step", round(time.perf_counter() - s, 2), flush=True)
best = {"static": 1e9, "paged": 1e9}
for rep in range(5):
    for name, kv in (("static", static), ("paged", paged)):
        s = time.perf_counter(); kv.extend([[7]] * R); best[name] = min(best[name], time.perf_counter() - s)
        for i in range(R): kv.rollback(i, P + OWN)
bpt = 2 * len(m.model.layers) * m.config.num_key_value_heads * (m.config.hidden_size // m.config.num_attention_heads) * 4
held = len({b for tbl in paged.pool.tables.values() for b in tbl})
print({"decode_ms": {k: round(v * 1e3) for k, v in best.items()},
       "static_cache_MB": round(static.cache_bytes / 2**20), "static_capacity": static.capacity,
       "paged_blocks_held": held, "paged_held_MB": round(held * 16 * bpt / 2**20),
       "bytes_per_token": bpt})
