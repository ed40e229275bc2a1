"""Prefix reuse: the keys and values of a prompt's full blocks, kept once and copied into the next
row whose prompt begins with the same tokens.

A prompt is cut into blocks of BLOCK_TOKENS tokens. Each full block is named by a hash chained
over the model's identity, every token before it and its own tokens (`block_keys`), so one name
stands for one whole prefix: two prompts share a block's name only if they agree on everything up
to its end. The store maps names to what the cache holds for the block (opaque here: the cache
makes and reads the values, kv/static.py's StaticKVModel.read_blocks / load_blocks) and evicts the
least recently used once its bytes pass its capacity (`capacity_bytes`: a share of the KV budget,
its one home).

A lookup serves the longest run of stored blocks from the prompt's start, never the prompt's last
token (`reusable_blocks`): the prefill must still feed at least one token to get the logits of
the first new one. Blocks of a run are touched deepest first, so a prefix's first block is the
most recent of its run and eviction takes a chain from its end: a block whose predecessor is
gone can never be reached again, and is not kept at the predecessor's expense.

Nothing here imports torch: the block, hash and LRU rules are tested as plain values.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from specpair.errors import SpecpairError

BLOCK_TOKENS = 16          # tokens per block of a prompt (vLLM's default block size)
# The store's share of the KV budget, and its size where the engine has no budget (the CPU):
# 1 GiB holds ~23k SmolLM2-135M tokens in float32 (46 KB each), a dozen 1,500-token prompts
# of different system prompts.
KV_BUDGET_SHARE = 0.25
BYTES_WITHOUT_BUDGET = 1 << 30
PREFIX_CACHE_ENV = "SPECPAIR_PREFIX_CACHE"    # "on" (default) or "off"
MODES = ("on", "off")


def resolve_mode(mode: str | None = None) -> str:
    """'on' or 'off': the argument, else SPECPAIR_PREFIX_CACHE, else on."""
    mode = mode or os.environ.get(PREFIX_CACHE_ENV) or "on"
    if mode not in MODES:
        raise SpecpairError(f"prefix cache must be on or off, not {mode!r} ({PREFIX_CACHE_ENV})")
    return mode


def capacity_bytes(kv_budget: int | None) -> int:
    """The store's bytes: its share of the engine's KV budget, or a fixed size without one."""
    if kv_budget is None:
        return BYTES_WITHOUT_BUDGET
    return int(kv_budget * KV_BUDGET_SHARE)


def reusable_blocks(prompt_tokens: int, block: int = BLOCK_TOKENS) -> int:
    """How many leading full blocks of a prompt may come from the store: all full blocks that
    leave at least one token to prefill."""
    return max(0, prompt_tokens - 1) // block


def block_keys(identity: str, tokens: list[int], block: int = BLOCK_TOKENS) -> list[bytes]:
    """The chained names of the full blocks of `tokens`: block i's name hashes block i-1's name
    and its own tokens, the first block's the model's identity."""
    keys = []
    previous = hashlib.blake2b(identity.encode(), digest_size=16).digest()
    for start in range(0, len(tokens) - block + 1, block):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(array("q", tokens[start:start + block]).tobytes())
        previous = digest.digest()
        keys.append(previous)
    return keys


@dataclass
class PrefixStats:
    """A model's prompt tokens looked up in the store and served from it, since start (the
    engine's count of its target's, SpeculativeEngine.prefix_stats)."""

    looked_up: int = 0
    served: int = 0


class PrefixStore:
    """Blocks by chained name, least recently used first, within `capacity` bytes. Several models
    share one store (and one capacity) by naming their blocks under their own identity."""

    def __init__(self, capacity: int, block: int = BLOCK_TOKENS):
        if capacity < 0 or block < 1:
            raise SpecpairError(f"prefix store needs capacity >= 0 and block >= 1, not "
                                f"{capacity} and {block}")
        self.capacity, self.block = capacity, block
        self.bytes = 0
        self._blocks: OrderedDict[bytes, tuple[object, int]] = OrderedDict()   # LRU first
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def keys(self, identity: str, tokens: list[int]) -> list[bytes]:
        return block_keys(identity, tokens, self.block)

    def lookup(self, keys: list[bytes], prompt_tokens: int) -> list[object]:
        """The values of the longest stored run of `keys` from the first, at most the blocks a
        prompt of `prompt_tokens` may take (reusable_blocks); the run is touched, deepest first."""
        run = []
        for key in keys[:reusable_blocks(prompt_tokens, self.block)]:
            if key not in self._blocks:
                break
            run.append(key)
        for key in reversed(run):
            self._blocks.move_to_end(key)
        return [self._blocks[key][0] for key in run]

    def missing(self, keys: list[bytes]) -> list[int]:
        """Indices of the keys not stored (what a row's cache must be read for)."""
        return [i for i, key in enumerate(keys) if key not in self._blocks]

    def insert(self, keys: list[bytes], new: dict[int, tuple[object, int]]) -> None:
        """Store the blocks `new` (index in `keys` -> value, bytes) of the prefix named by `keys`,
        touch the prefix's stored blocks deepest first, then evict the least recently used until
        the store fits. A block larger than the whole capacity is not kept."""
        for i in reversed(range(len(keys))):     # the prefix's first block ends most recent
            key = keys[i]
            if key in self._blocks:
                self._blocks.move_to_end(key)
            elif i in new and new[i][1] <= self.capacity:
                self._blocks[key] = new[i]
                self.bytes += new[i][1]
        while self.bytes > self.capacity:
            _, (_, nbytes) = self._blocks.popitem(last=False)
            self.bytes -= nbytes
            self.evictions += 1
