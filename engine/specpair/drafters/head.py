"""HeadDrafter: what the head drafters (EAGLE, Medusa, EAGLE-3) share: the target's features handed
over after each verification, and logits over the draft vocabulary mapped to the target's."""

from __future__ import annotations

import gc
import weakref

import torch

from specpair import cpu_kernels
from specpair.drafters.base import Drafter, Proposal
from specpair.drafters.draft_tokens import choose_draft_tokens, choose_siblings, stack_draft_probs
from specpair.errors import SpecpairError


def draft_vocab_logits(head, vectors: torch.Tensor) -> torch.Tensor:
    """Logits over the head's draft vocabulary [..., Vd] of its vectors [..., D]."""
    return cpu_kernels.linear(vectors.reshape(-1, 1, vectors.shape[-1]),
                              head.lm_head.weight).reshape(*vectors.shape[:-1], -1)


def head_logits(head, vectors: torch.Tensor, vocab_size: int, draft_ids: torch.Tensor) -> torch.Tensor:
    """Target-vocabulary logits [..., V] of a head's vectors [..., D] (`target_vocab_logits`)."""
    return target_vocab_logits(draft_vocab_logits(head, vectors), vocab_size, draft_ids)


def target_vocab_logits(small: torch.Tensor, vocab_size: int, draft_ids: torch.Tensor
                        ) -> torch.Tensor:
    """Draft-vocabulary logits [..., Vd] spread over the target's vocabulary [..., V]: the draft
    vocabulary's rows, -inf elsewhere (q is zero off the draft vocabulary)."""
    full = torch.full((*small.shape[:-1], vocab_size), float("-inf"), dtype=small.dtype,
                      device=small.device)
    full[..., draft_ids] = small
    return full


# Per target (its kv.runner.StaticLlama), the live head drafters reading its features and what
# each reads: an EAGLE-3 head's layers, or None for the last normed state (EAGLE, Medusa).
_READERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def read_features(drafter, target_model, layers: tuple[int, ...] | None) -> None:
    """Declare that `drafter` drafts from the target's features: the inputs of `layers` (an
    EAGLE-3 head's) or, None, the last normed state. What a target step hands over
    (StaticLlama.feature_layers) is the union of the layers its live drafters read, and goes
    back to the normed state once none is left (no drafter changes what a later one on the same
    target receives). One step hands one kind: a head of the other kind beside a live one is
    refused by name (a serving EAGLE head and an EAGLE-3 candidate in shadow, say)."""
    from specpair.kv.families import supports
    from specpair.kv.runner import StaticLlama

    if supports(target_model):
        return                      # the general path: the normed state, no layers
    runner = StaticLlama.of(target_model)
    readers = _READERS.setdefault(runner, weakref.WeakKeyDictionary())

    def others() -> set:
        return {str(v) for v in readers.values() if (v is None) != (layers is None)}
    if others():
        gc.collect()                # drafters of batches gone but not yet collected
    if others():
        theirs = sorted(others())[0]
        raise SpecpairError(
            "one target step hands a head one kind of features: "
            + ("the last normed state (an EAGLE or Medusa head drafts on this target)"
               if theirs == "None" else f"the inputs of layers {theirs} (an EAGLE-3 head drafts "
                                        "on this target)")
            + "; a head reading "
            + ("the normed state" if layers is None else f"layers {list(layers)}")
            + " cannot draft beside it (in shadow, score a head beside a champion of its kind)")
    readers[drafter] = None if layers is None else tuple(layers)
    weakref.finalize(drafter, _hand_over, weakref.ref(runner))
    _hand_over(weakref.ref(runner))


def _hand_over(runner_ref) -> None:
    """Set the target's feature_layers from its live readers (read_features)."""
    runner = runner_ref()
    if runner is None:
        return
    layers = set()
    for read in (_READERS.get(runner) or {}).values():
        layers |= set(read or ())
    runner.feature_layers = tuple(sorted(layers)) or None


class HeadDrafter(Drafter):
    """What heads share: they draft from the target's features of committed tokens (`observe`),
    through a draft vocabulary. Subclasses keep what they need of the features (`_keep`) and
    their per-row state (`_add_rows`, `_select`)."""

    deterministic = False
    wants_features = True
    tree_capable = True

    def __init__(self, loaded, target_model, vocab_size: int,
                 layers: tuple[int, ...] | None = None):
        """layers: the target's layers whose inputs the head reads (an EAGLE-3 head's; None:
        the last normed state), declared to the target (read_features)."""
        self.loaded, self.head = loaded, loaded.model
        if self.head.config.hidden_size != target_model.config.hidden_size:
            raise SpecpairError(f"head hidden size {self.head.config.hidden_size} does not match "
                                f"the target's {target_model.config.hidden_size}")
        self.target_model, self.vocab_size = target_model, vocab_size
        self.draft_ids = self.head.draft_token_ids.to(next(self.head.parameters()).device)
        if int(self.draft_ids.max()) >= vocab_size:
            raise SpecpairError(f"head drafts token {int(self.draft_ids.max())}; the target has {vocab_size}")
        self.known: list[int] = []          # per row: positions with an observed feature
        read_features(self, target_model, layers)

    def cost_probe(self, timing) -> dict[str, float]:
        """A head's own step (per token or per round), and what a round costs beyond its steps,
        where it can time them (timing_step, timing_round); else as the base prices it."""
        if not hasattr(self, "timing_step"):
            return super().cost_probe(timing)
        costs = {"draft_step": timing.after_one(self.timing_step(timing.prompt_length))}
        if hasattr(self, "timing_round"):
            seconds = timing.after_one(self.timing_round(timing.prompt_length))
            costs["draft_round"] = max(0.0, seconds - costs["draft_step"])
        return costs

    def add_rows(self, count: int) -> None:
        self.known += [0] * count
        self._add_rows(count)

    def select(self, rows: list[int]) -> None:
        self.known = [self.known[i] for i in rows]
        self._select(rows)

    # A head keeping its own keys and values over its rows' pairs (EAGLE, EAGLE-3) shares them
    # over a prompt prefix (Drafter.prefix_identity): it sets this and writes _prefix_cache,
    # _load_prefix_cache and prefix_positions.
    shares_prefix = False

    def prefix_identity(self) -> str | None:
        if not self.shares_prefix:
            return None
        return f"head {self.name} {sorted(self.loaded.identity().items())}"

    def prefix_position_bytes(self) -> int:
        """A position of the head's keys and values: every layer's, per key-value head."""
        if not self.shares_prefix:
            return 0
        config = self.head.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = int(getattr(config, "num_hidden_layers", 1))
        return 2 * layers * kv_heads * head_dim * self.head.lm_head.weight.element_size()

    def read_prefix(self, row: int, starts: list[int], width: int) -> list[tuple[torch.Tensor, int]]:
        """Each block as one tensor [2 (keys, values), layers, kv heads, width, head dim]."""
        if starts and max(starts) + width > self.prefix_positions(row):
            raise SpecpairError(f"row {row}: its head holds {self.prefix_positions(row)} "
                                f"positions, not {max(starts) + width}")
        blocks = [self._prefix_cache(row, start, width).clone() for start in starts]
        return [(block, block.nbytes) for block in blocks]

    def load_prefix(self, row: int, blocks: list) -> int:
        if self.known[row] or self.prefix_positions(row):
            raise SpecpairError(f"row {row}: its head already holds positions")
        if not blocks:
            return 0
        n = self._load_prefix_cache(row, torch.cat(blocks, dim=3))
        self.known[row] = n
        return n

    def _prefix_cache(self, row: int, start: int, width: int) -> torch.Tensor:
        raise NotImplementedError

    def _load_prefix_cache(self, row: int, span: torch.Tensor) -> int:
        raise NotImplementedError

    def observe(self, row: int, start: int, features: torch.Tensor) -> None:
        if start != self.known[row]:
            raise SpecpairError(f"row {row}: features from position {start}, expected {self.known[row]}")
        if features.shape[0]:
            self._keep(row, features)
            self.known[row] += int(features.shape[0])

    def _take_pending(self, sequences, ks, lengths: list[int], device, dtype=None):
        """A round's catch-up for heads that keep their rows' observed features in
        `self.pending` (EAGLE, EAGLE-3): each row's pairs observed since its last round (the
        token after each observed position, from the head cache's `lengths[i]`) with the
        target's features there [n, F] (None: none), and whether the row drafts this round (its
        last pair is fed now: known == its cache length after); the pending features taken."""
        pairs, features, drafting = [], [], []
        for i, seq in enumerate(sequences):
            start, known, pending = lengths[i], self.known[i], self.pending[i]
            pairs.append(seq[start + 1:known + 1] if pending else [])
            features.append(torch.cat(pending).to(device=device, dtype=dtype) if pending else None)
            self.pending[i] = []
            drafting.append(ks[i] > 0 and known > 0 and len(pairs[-1]) > 0)
        return pairs, features, drafting

    def _open_round(self, sequences, ks, lengths: list[int], device, dtype=None):
        """A round's start for every head that catches up from `pending`: the drafts [B, K]
        (zeros), then _take_pending's pairs, features and drafting, and how many tokens each row
        may draft (`num`: its k where it drafts)."""
        B, K = len(sequences), max(ks, default=0)
        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        pairs, features, drafting = self._take_pending(sequences, ks, lengths, device, dtype)
        num = torch.tensor([ks[i] if drafting[i] else 0 for i in range(B)], dtype=torch.long, device=device)
        return tokens, pairs, features, drafting, num

    @staticmethod
    def _no_drafts(tokens: torch.Tensor, num: torch.Tensor) -> Proposal:
        return Proposal(tokens=tokens, num=torch.zeros_like(num), probs=None)

    @staticmethod
    def _gather_greedy(step, start, steps: int, width: int, chosen_steps, q_steps, sibling_steps) -> None:
        """A greedy fixed-step round's drafts, read back from the device in one gather at its
        end (step.tokens: [B, steps, width]): the chosen token a position, its alternatives."""
        drafted = step.tokens(start, steps)
        chosen_steps += list(drafted[..., 0].unbind(1))
        if width > 1:
            sibling_steps += list(drafted[..., 1:].unbind(1))
        q_steps += [None] * steps

    # This round's grammar guides (grammar.DraftGrammar per row, None for a free row), open while
    # `propose` runs: None when no row drafting this round has a grammar.
    _guides: list | None = None

    def propose(self, sequences, ks, sampling, width: int = 1) -> Proposal:
        """A round's drafts (the subclass's `_propose`). Rows with a grammar (`grammars`, set by
        the Batch) propose within it: each position's head logits are masked by what the grammar
        allows after the committed tokens and the row's drafts so far (`_choose`), a tree's
        siblings included, so no draft is spent on a token the grammar refuses and a sampled
        row's q is the masked distribution it drew from (sampling stays exact). The committed
        state is restored when the round ends."""
        grammars = self.grammars or [None] * len(sequences)
        guides = [g.drafting() if g is not None and k else None for g, k in zip(grammars, ks)]
        self._guides = guides if any(g is not None for g in guides) else None
        try:
            return self._propose(sequences, ks, sampling, width)
        finally:
            for guide in guides:
                if guide is not None:
                    guide.close()
            self._guides = None

    def _propose(self, sequences, ks, sampling, width: int = 1) -> Proposal:
        raise NotImplementedError

    def _within_grammars(self, small: torch.Tensor, j: int, row_ks: list[int]) -> torch.Tensor:
        """The head's draft-vocabulary logits [B, Vd] with -inf where a guided row's grammar
        refuses the token (a new tensor; `small` itself when no row is masked). A row whose
        grammar allows nothing in the draft vocabulary drafts unguided: the Batch cuts its drafts
        where the grammar refuses them (a q with no mass would sample nothing)."""
        out = None
        for i, guide in enumerate(self._guides):
            if guide is None or j >= row_ks[i]:
                continue
            allowed = guide.mask(self.vocab_size)
            if allowed is None:
                continue
            on_draft = allowed.to(small.device)[self.draft_ids]
            if not bool(on_draft.any()):
                continue
            if out is None:
                out = small.clone()
            out[i] = out[i].masked_fill(~on_draft, float("-inf"))
        return small if out is None else out

    def _add_rows(self, count: int) -> None:
        raise NotImplementedError

    def _select(self, rows: list[int]) -> None:
        raise NotImplementedError

    def _keep(self, row: int, features: torch.Tensor) -> None:
        raise NotImplementedError

    def _logits(self, vectors: torch.Tensor) -> torch.Tensor:
        return head_logits(self.head, vectors, self.vocab_size, self.draft_ids)

    def _choose(self, small, j, row_ks, sampling, width, chosen_steps, q_steps, sibling_steps):
        """Position j's tokens (and, for a tree, their alternatives) from the head's logits over
        its draft vocabulary [B, Vd]. All rows greedy: their top, mapped to the target's ids (no
        distribution over the whole vocabulary is needed: greedy verification reads no q).
        A row with a grammar chooses within it (`propose`), its choice then taken by its guide."""
        if self._guides is not None:
            small = self._within_grammars(small, j, row_ks)
        if sampling.all_greedy:
            # A chain's draft is the argmax (ties: the lowest index, as the target's greedy
            # verification and the head's fused C top-1 take them; topk's order is unspecified).
            top = self.draft_ids[small.argmax(-1, keepdim=True) if width == 1
                                 else small.topk(width, dim=-1).indices]       # [B, C]
            chosen, q = top[:, 0], None
            if width > 1:
                sibling_steps.append(top[:, 1:])
        else:
            logits = target_vocab_logits(small, self.vocab_size, self.draft_ids)
            chosen, q = choose_draft_tokens(logits, j, row_ks, sampling)
            if width > 1:
                sibling_steps.append(choose_siblings(logits, chosen, q, j, row_ks, sampling, width - 1))
        chosen_steps.append(chosen)
        q_steps.append(q)
        if self._guides is not None:
            taken = chosen.tolist()
            for i, guide in enumerate(self._guides):
                if guide is not None and j < row_ks[i]:
                    guide.take(taken[i])
        return chosen

    def _proposal(self, chosen_steps, q_steps, sibling_steps, num, K, width) -> Proposal:
        B = num.shape[0]
        tokens = torch.zeros(B, K, dtype=torch.long, device=num.device)
        if chosen_steps:
            tokens[:, :len(chosen_steps)] = torch.stack(chosen_steps, dim=1)
        siblings = None
        if sibling_steps:
            siblings = torch.zeros(B, K, width - 1, dtype=torch.long, device=num.device)
            siblings[:, :len(sibling_steps)] = torch.stack(sibling_steps, dim=1)
        return Proposal(tokens=tokens, num=num, probs=stack_draft_probs(q_steps, K),
                        siblings=siblings)

    def describe(self) -> dict:
        return {"kind": self.name, "draft_vocab_size": int(len(self.draft_ids)),
                **self.loaded.identity()}
