"""MedusaDrafter: Medusa heads (heads.py) drafting all k tokens at once from the last feature."""

from __future__ import annotations

import logging
import time

import torch

from specpair.drafters.base import Proposal
from specpair.drafters.head import draft_vocab_logits, HeadDrafter
from specpair.kv.buckets import bucket
from specpair.kv.compiling import compiled_function, resolve_compile
from specpair.kv.fixed_step import fixed_step_applies
from specpair.kv.graphs import StepGraphs, cuda_graphs_wanted

log = logging.getLogger(__name__)


def medusa_draft(heads, features: torch.Tensor, draft_ids: torch.Tensor, width: int):
    """Every Medusa head over features [R, D]: the draft vocabulary's logits [R, H, Vd] and their
    top `width` mapped to target ids [R, H, width]."""
    logits = draft_vocab_logits(heads, heads(features))
    return logits, draft_ids[logits.topk(width, dim=-1).indices]


class MedusaDraftStep:
    """A round of Medusa heads over rows 0..R-1 as one step of a device buffer (each row's
    `features` [R, D]): `medusa_draft`, compiled where asked (rows past one symbolic), and on CUDA
    recorded as one graph (StepGraphs), so a round's drafts are one replay. Every head runs
    whatever the round's k: one shape a rows bucket."""

    def __init__(self, heads, draft_ids: torch.Tensor, rows: int, width: int, compiled: bool):
        param = heads.lm_head.weight
        self.features = torch.zeros(rows, heads.config.hidden_size, dtype=param.dtype,
                                    device=param.device)
        draft = compiled_function(medusa_draft, param.device) if compiled else medusa_draft
        if compiled and rows > 1:
            torch._dynamo.maybe_mark_dynamic(self.features, 0)
        self.step = lambda: draft(heads, self.features, draft_ids, width)
        self.graph = None

    def __call__(self, graphs: StepGraphs):
        """-> (logits [R, H, Vd], top [R, H, width]): the graph's own buffers where recorded."""
        if self.graph is None:
            self.graph = graphs.capture(self.step)
        return self.graph.replay() if self.graph is not None else self.step()


class MedusaDrafter(HeadDrafter):
    """Medusa heads: from the target's feature of the token before the last committed one, head
    m drafts the token m+1 places past the last one. No cache, no recurrence: one pass over the
    heads per round, whatever k (capped at the number of heads). Each head's distribution is a
    valid proposal whatever it conditions on, so the rejection sampler stays exact.

    Where the fixed step applies (`drafts_in_fixed_steps`: kv.fixed_step.fixed_step_applies, CUDA
    or bf16) a round is a MedusaDraftStep over the rows bucket, its steps and graphs (`graphs`)
    shared by every batch; elsewhere (or switched off, as the tests compare) the first k heads
    run eagerly over the batch's rows."""

    name = "medusa"

    def __init__(self, loaded, target_model, vocab_size: int, compile: str | None = None,
                 graphs: StepGraphs | None = None):
        super().__init__(loaded, target_model, vocab_size)
        self.last: list[torch.Tensor | None] = []   # per row: feature of the newest observed token
        self.compile = compile
        device, dtype = self.draft_ids.device, self.head.lm_head.weight.dtype
        self.drafts_in_fixed_steps = fixed_step_applies(device, dtype)
        self.compiled = self.drafts_in_fixed_steps and resolve_compile(compile, device) == "on"
        self.graphs = graphs or StepGraphs(device, self.compiled and device.type == "cuda"
                                           and cuda_graphs_wanted())

    def for_batch(self) -> "MedusaDrafter":
        return MedusaDrafter(self.loaded, self.target_model, self.vocab_size, self.compile,
                             self.graphs)

    def draft_step(self, rows: int, width: int) -> MedusaDraftStep:
        """The heads' step for a rows bucket and width, made on first use."""
        step = self.graphs.steps.get((rows, width))
        if step is None:
            step = self.graphs.steps[(rows, width)] = MedusaDraftStep(
                self.head, self.draft_ids, rows, width, self.compiled)
        return step

    def step_model(self):
        return self.loaded.model

    def warm_up_steps(self, rows: int, context_length: int, tree_width: int, k_max: int) -> dict | None:
        return self.warm_up(rows, tree_width)

    @torch.no_grad()
    def warm_up(self, max_rows: int, width: int) -> dict | None:
        """The heads' step once at every rows bucket up to max_rows (compiled, on CUDA recorded:
        serving replays these graphs); -> the buckets, the graphs and the seconds, None where
        the fixed step does not apply."""
        if not self.drafts_in_fixed_steps:
            return None
        started = time.perf_counter()
        rows = [1 << i for i in range(bucket(max_rows).bit_length())]
        for r in rows:
            self.draft_step(r, width)(self.graphs)
        report = {"rows": rows, "width": width, "graphs": self.graphs.recorded["graphs"],
                  "seconds": round(time.perf_counter() - started, 3)}
        log.info("Medusa heads warmed: %d rows buckets, %d CUDA graphs recorded in %.1f s",
                 len(rows), report["graphs"], report["seconds"])
        return report

    def _add_rows(self, count: int) -> None:
        self.last += [None] * count

    def _select(self, rows: list[int]) -> None:
        self.last = [self.last[i] for i in rows]

    def _keep(self, row: int, features: torch.Tensor) -> None:
        self.last[row] = features[-1]

    @torch.no_grad()
    def _propose(self, sequences, ks, sampling, width: int = 1) -> Proposal:
        B = len(sequences)
        device = self.draft_ids.device
        # A row drafts when its newest feature is of the token before its last (always, after the
        # target's first pass over it).
        row_ks = [min(k, self.head.num_heads) if self.last[i] is not None
                  and self.known[i] == len(sequences[i]) - 1 else 0 for i, k in enumerate(ks)]
        K = max(row_ks, default=0)
        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        num = torch.tensor(row_ks, dtype=torch.long, device=device)
        if K == 0:
            return Proposal(tokens=tokens, num=num, probs=None)
        dim = self.head.config.hidden_size
        features = torch.stack([f if f is not None else torch.zeros(dim, device=device)
                                for f in self.last]).to(self.head.lm_head.weight.dtype)
        chosen, qs, sibs = [], [], []
        if self.drafts_in_fixed_steps:
            step = self.draft_step(bucket(B), width)
            step.features[:B] = features
            logits, top = step(self.graphs)               # [R, H, Vd], [R, H, width]
            if sampling.all_greedy and self._guides is None:    # a grammar row chooses in _choose
                chosen = list(top[:B, :K, 0].unbind(1))
                sibs = list(top[:B, :K, 1:].unbind(1)) if width > 1 else []
                qs = [None] * K
            else:
                for j in range(K):
                    self._choose(logits[:B, j], j, row_ks, sampling, width, chosen, qs, sibs)
            return self._proposal(chosen, qs, sibs, num, K, width)
        vectors = self.head(features, K)                                       # [B, K, D]
        for j in range(K):
            self._choose(draft_vocab_logits(self.head, vectors[:, j]), j, row_ks, sampling, width,
                         chosen, qs, sibs)
        return self._proposal(chosen, qs, sibs, num, K, width)

    def timing_step(self, context: int):
        """One round's heads (all of them; the bench times it and charges it per round): the
        one-row MedusaDraftStep where the fixed step applies."""
        if self.drafts_in_fixed_steps:
            step = self.draft_step(1, 1)
            return torch.no_grad()(lambda: step(self.graphs))
        feature = torch.zeros(1, self.head.config.hidden_size, device=self.draft_ids.device)
        return torch.no_grad()(lambda: self._logits(self.head(feature)).argmax(-1).tolist())

    def describe(self) -> dict:
        return {"kind": self.name, "heads": self.head.num_heads,
                "draft_vocab_size": int(len(self.draft_ids)), **self.loaded.identity()}
