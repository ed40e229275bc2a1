"""The drafter interface the engine speaks (Drafter) and what crosses it: a round's Proposal and
the rows' sampling settings (RowSampling)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specpair.rejection_sampler import DrawKeys


@dataclass
class Proposal:
    tokens: torch.Tensor            # [B, K] long, row i valid up to num[i]
    num: torch.Tensor               # [B] long
    probs: torch.Tensor | None      # [B, K, V] draft distributions q, None when deterministic
    siblings: torch.Tensor | None = None   # [B, K, S] alternatives to tokens[:, j] (a token tree,
                                           # rejection_sampler.verify_tree); None: a chain
    copied: list[bool] | None = None       # per row: drafted by copying (LookupFirstDrafter)
    host: list[list[int]] | None = None    # per row its drafted tokens, where the drafter made


@dataclass
class RowSampling:
    """Per-row sampling settings as tensors, shared by draft and target so p and q match."""

    temperature: torch.Tensor       # [B]
    top_k: torch.Tensor             # [B]
    top_p: torch.Tensor             # [B]
    generators: list                # [B] torch.Generator or None
    greedy: bool | None = None      # every row greedy, when the caller knows it without the device
    keys: DrawKeys | None = None    # seeded rows: they draw by (seed, position) instead, the
                                    # draft as the target does (rejection_sampler.keyed_sample)

    @property
    def all_greedy(self) -> bool:
        if self.greedy is not None:
            return self.greedy
        return bool((self.temperature <= 0).all())


class Drafter:
    """Interface. `deterministic` drafters propose point masses (q = one-hot). Drafters that
    `wants_features` are handed the target's features of every committed token (`observe`)."""

    name = "drafter"
    deterministic = True
    wants_features = False
    tree_capable = False     # proposes alternatives per position (siblings) when width > 1
    copies = False           # drafts some rows' rounds by copying, each round saying which
                             # (Proposal.copied): those rounds keep a k of their own (copy_ks)
    # This round's rows' grammars (grammar.RowGrammar, None for a free row), set by the Batch
    # before propose: a drafter that can propose within them does (a draft model, a head, a
    # lookup); whatever a grammar still refuses is cut before verification (Batch.step).
    grammars: list | None = None
    # The cost model's price of a round (costs.measure_costs): one draft step per draft token (a
    # draft model, an EAGLE head) rather than one per round (lookup, Medusa's heads at once).
    draft_per_token = False

    # -- what the engine needs of a drafter, asked here rather than of its class ---------------

    def draft_model(self) -> Any:
        """The separate causal LM this drafter runs, whose cache the engine warms up like the
        target's (and bench's assisted baseline hands to transformers); None: none."""
        return None

    def step_model(self) -> Any:
        """The model one draft step reads (a draft model, a head): its bytes priced in bench's
        bandwidth figures; None: no model step."""
        return None

    def cached_model(self) -> Any:
        """The model whose cache this drafter keeps per row (a draft model's, an EAGLE head's):
        what its rows need in the cache; None (n-gram lookup, Medusa): nothing cached."""
        return getattr(getattr(self, "kv", None), "model", None)

    def cache_bytes(self) -> int:
        """Memory this drafter keeps for its rows beside the engine's paged pool (a head's own
        keys and values), which the KV budget must hold too (decoding.Batch counts it before
        admitting rows). A draft model's rows live in the pool: 0, as for a drafter that keeps
        nothing."""
        return 0

    def reusable_prefix_cache(self) -> tuple[str, Any] | None:
        """(identity, cache) of a cache of this drafter's whose prompt prefixes the engine's
        prefix store may keep and reuse (a draft model's); None: none."""
        return None

    # -- a head's own cache over a shared prompt prefix (decoding.Batch, the paged cache) ------

    def prefix_identity(self) -> str | None:
        """What names this drafter's own per-position cache where the paged pool keeps it (its
        model's identity): a head's keys and values over a prompt's pairs, which every row
        sharing the prompt's prefix would otherwise compute again. None: it keeps nothing a
        prefix could share (n-gram lookup, Medusa; a draft model's rows share the pool's
        blocks)."""
        return None

    def prefix_positions(self, row: int) -> int:
        """Positions of its own cache `row` holds computed from committed tokens only (what
        may be stored for later rows)."""
        return 0

    def prefix_position_bytes(self) -> int:
        """Bytes one position of that cache takes where a prefix keeps it (the paged pool
        prices its blocks with them: paged_cache.PagedSpace.for_budget); 0 where it keeps none."""
        return 0

    def read_prefix(self, row: int, starts: list[int], width: int) -> list[tuple[Any, int]]:
        """Copies of row's own cache at positions start..start+width-1 for each start, each
        with its bytes (what the paged pool keeps beside the target's blocks)."""
        raise NotImplementedError

    def load_prefix(self, row: int, blocks: list) -> int:
        """An empty row takes consecutive blocks (read_prefix's) as its first positions, as if
        it had computed them from its first features; -> positions it now holds (its features
        are then expected from there on: observe)."""
        raise NotImplementedError

    def priced_as(self) -> "Drafter":
        """The drafter whose steps price this one's rounds in the cost model: itself (lookup
        first: its head, the copying rounds priced apart)."""
        return self

    def warm_up_steps(self, rows: int, context_length: int, tree_width: int, k_max: int) -> dict | None:
        """Run this drafter's own steps at every shape serving uses, so no request compiles (a
        drafting head's); -> what was captured, None: nothing to warm."""
        return None

    def cost_probe(self, timing: Any) -> dict[str, float]:
        """This drafter's draft step (and round) in seconds for the cost model, timed with
        `timing` (costs.CostTiming): by default a lookup per round."""
        return {"draft_step": timing.lookup(self)}

    def for_batch(self) -> "Drafter":
        """The drafter a new batch uses: itself when it keeps no per-row state."""
        return self

    def trim(self) -> None:
        """End of a round: release what rejected drafts left behind."""

    def observe(self, row: int, start: int, features: torch.Tensor) -> None:
        """The target's features [n, D] of row's committed tokens at positions start..start+n-1."""

    def add_rows(self, count: int) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        pass

    def propose(self, sequences: list[list[int]], ks: list[int], sampling: RowSampling,
                width: int = 1) -> Proposal:
        """Up to ks[i] draft tokens for each row. `width`: candidates per position for a
        `tree_capable` drafter (the release's tree width; 1 is a chain); others draft chains."""
        raise NotImplementedError

    def accepted(self, row: int, committed_before: int, num_accepted: int) -> None:
        """Row's sequence was `committed_before` tokens long; `num_accepted` drafts were kept."""

    def describe(self) -> dict:
        return {"kind": self.name}
