"""Drafting with a published EAGLE-3 head (specpair/eagle3.py) in our engine: the drafter, apart from
the head's format so the format (read by heads.py and models.py) imports no engine step."""

from __future__ import annotations

import torch

from specpair.drafters.base import Proposal
from specpair.drafters.head import HeadDrafter, draft_vocab_logits
from specpair.eagle3 import METHOD, default_aux_layers
from specpair.kv.buckets import bucket
from specpair.errors import SpecpairError


class Eagle3Drafter(HeadDrafter):
    """Drafts with an EAGLE-3 head (module docstring) from the target's auxiliary hidden states.

    Per row the head's cache holds the keys and values of the pairs built on the target's own
    features (x[j+1], aux[j]); a round first feeds the pairs observed since the last round, then
    drafts by feeding the head its own outputs. Drafted pairs live only in the round: the cache
    keeps the real pairs, so a rejection costs nothing. Chains and trees (a tree's alternatives
    are the head's next candidates at each position, as for our EAGLE heads); q lives on the
    draft vocabulary, so sampled output stays the target's distribution."""

    name = METHOD

    def __init__(self, loaded, target_model, vocab_size: int, compile: str | None = None,
                 fixed: bool | None = None, kernel: bool | None = None):
        from specpair.kv.families import supports
        from specpair.kv.fixed_step import fixed_step_applies
        from specpair.kv.runner import StaticLlama

        why = supports(target_model)
        if why:
            raise SpecpairError(f"an EAGLE-3 head drafts from the static cache's features: {why}")
        head = loaded.model
        layers = len(target_model.model.layers)
        # vLLM's default layers as vLLM takes them: distinct, in order (a target of under 6
        # layers has fewer than 3, which a head's fc of 3 states cannot read).
        aux = head.aux_layers or tuple(sorted(set(default_aux_layers(layers))))
        if min(aux) < 0 or max(aux) > layers:
            raise SpecpairError(f"the EAGLE-3 head reads layers {list(aux)}; the target has "
                                f"{layers}")
        if len(aux) != head.aux_count:
            raise SpecpairError(f"the EAGLE-3 head's fc reads {head.aux_count} hidden states; "
                                f"it names no layers and vLLM's default for a {layers}-layer "
                                f"target is {len(aux)}: {list(aux)}")
        if head.target_hidden_size != target_model.config.hidden_size:
            raise SpecpairError(f"the EAGLE-3 head was trained for hidden size "
                                f"{head.target_hidden_size}; the target's is "
                                f"{target_model.config.hidden_size}")
        # The target hands over the layers every live EAGLE-3 head on it reads (heads of other
        # layers may share one target; head.read_features); each takes its own from them.
        self.runner = StaticLlama.of(target_model)
        super().__init__(loaded, target_model, vocab_size, layers=tuple(aux))
        self.aux_layers, self.compile = tuple(aux), compile
        self.embed = head.embed_tokens or target_model.get_input_embeddings()
        self.caches: list[tuple | None] = []      # per row: (keys, values) [1, KV, n, hd]
        self.fed: list[int] = []                  # per row: real pairs in its cache
        self.pending: list[list[torch.Tensor]] = []
        # Where the head's round runs as fixed-shape steps over one cache of every row
        # (eagle3_steps: what CUDA graphs record) instead of row by row: where the fixed step
        # applies to the head (CUDA, bf16; the target's fixed step hands the layers over as its
        # general step does), or asked (`fixed`: the tests, on the CPU).
        head_param = next(head.parameters())
        self.fixed = (fixed_step_applies(head_param.device, head_param.dtype) if fixed is None
                      else fixed)
        # Elsewhere, on the CPU in float32, the round runs every drafting row's step as one C
        # call (head_kernels: the head's layer, its norm riding along) over that same cache of
        # every row; without the kernel (or `kernel` False: the tests' reference) row by row in
        # PyTorch over a cache of its own per row.
        from specpair import head_kernels

        self.kernel = not self.fixed and (head_kernels.applies(head) if kernel is None
                                          else kernel)
        self.cache = None
        self.layer_kernel = head_kernels.Eagle3Kernel(head) if self.kernel else None
        self.fused_top1_rounds = 0      # rounds whose drafts came from the C call's top-1
        if self.fixed or self.kernel:
            from specpair.eagle3_steps import Eagle3Cache
            self.cache = Eagle3Cache(head, head_param.device, head.lm_head.weight.dtype)

    def for_batch(self) -> "Eagle3Drafter":
        return Eagle3Drafter(self.loaded, self.target_model, self.vocab_size, self.compile,
                             self.fixed, self.kernel)

    def cache_bytes(self) -> int:
        """The head's keys and values: one cache of every row (kernel, fixed steps), else each
        row's own."""
        if self.cache is not None:
            return 0 if self.cache.kc is None else self.cache.kc.nbytes + self.cache.vc.nbytes
        return sum(kv[0].nbytes + kv[1].nbytes for kv in self.caches if kv is not None)

    shares_prefix = True

    def prefix_positions(self, row: int) -> int:
        return self.cache.lengths[row] if self.cache is not None else self.fed[row]

    def _prefix_cache(self, row: int, start: int, width: int) -> torch.Tensor:
        """[2, 1 layer, KV, width, hd] of row's pairs from `start`."""
        if self.cache is not None:
            k, v = self.cache.kc[row], self.cache.vc[row]        # [KV, C, hd]
        else:
            k, v = (t[0] for t in self.caches[row])              # [1, KV, n, hd] each
        return torch.stack((k[:, start:start + width], v[:, start:start + width])).unsqueeze(1)

    def _load_prefix_cache(self, row: int, span: torch.Tensor) -> int:
        n = int(span.shape[3])
        span = span.to(device=self.draft_ids.device)
        if self.cache is not None:
            self.cache.reserve(n)
            self.cache.kc[row, :, :n] = span[0, 0]
            self.cache.vc[row, :, :n] = span[1, 0]
            self.cache.lengths[row] = n
        else:
            self.caches[row] = (span[0].clone(), span[1].clone())   # [1, KV, n, hd]
            self.fed[row] = n
        return n

    def _add_rows(self, count: int) -> None:
        self.caches += [None] * count
        self.fed += [0] * count
        self.pending += [[] for _ in range(count)]
        if self.cache is not None:
            self.cache.add_rows(count)

    def _select(self, rows: list[int]) -> None:
        self.caches = [self.caches[i] for i in rows]
        self.fed = [self.fed[i] for i in rows]
        self.pending = [self.pending[i] for i in rows]
        if self.cache is not None:
            self.cache.select(rows)

    def _keep(self, row: int, features: torch.Tensor) -> None:
        handed = self.runner.feature_layers
        if handed != self.aux_layers:
            D = self.target_model.config.hidden_size
            features = torch.cat([features[:, handed.index(L) * D:(handed.index(L) + 1) * D]
                                  for L in self.aux_layers], dim=-1)
        self.pending[row].append(features)

    def _step(self, row: int, tokens: list[int] | torch.Tensor, hidden: torch.Tensor,
              start: int, keep: bool, past=None):
        """Feed row its pairs (tokens [n], hidden [n, D]) from position `start`; keep: into
        its cache. -> (pre-norm outputs [n, D], the keys/values with these appended)."""
        head = self.head
        device = hidden.device
        ids = torch.as_tensor(tokens, dtype=torch.long, device=device).view(1, -1)
        n = ids.shape[1]
        embeds = self.embed(ids).to(hidden.dtype)
        positions = torch.arange(start, start + n, device=device).view(1, n)
        cos, sin = head.rotary(embeds, positions)
        past = self.caches[row] if past is None else past
        out, kv = head.layer(embeds, hidden.view(1, n, -1), cos, sin, past, None)
        if keep:
            self.caches[row] = kv
        return out[0], kv

    @torch.no_grad()
    def _propose(self, sequences, ks, sampling, width: int = 1):
        if self.fixed:
            return self._propose_in_fixed_steps(sequences, ks, sampling, width)
        if self.kernel:
            return self._propose_in_kernel(sequences, ks, sampling, width)
        head = self.head
        B = len(sequences)
        K = max(ks, default=0)
        device = self.draft_ids.device
        dtype = head.lm_head.weight.dtype
        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        g = torch.zeros(B, head.config.hidden_size, dtype=dtype, device=device)   # pre-norm
        drafting = [False] * B
        for i, seq in enumerate(sequences):
            start, known = self.fed[i], self.known[i]
            if self.pending[i]:
                # The token after each observed position and the target's aux states there.
                aux = torch.cat(self.pending[i]).to(device=device, dtype=dtype)
                self.pending[i] = []
                out, _ = self._step(i, seq[start + 1:known + 1], head.fc(aux), start, keep=True)
                self.fed[i] = known
                g[i] = out[-1]
                drafting[i] = ks[i] > 0 and known > 0
        num = torch.tensor([ks[i] if drafting[i] else 0 for i in range(B)], dtype=torch.long,
                           device=device)
        if K == 0 or not any(drafting):
            return self._no_drafts(tokens, num)
        row_ks = [ks[i] if drafting[i] else 0 for i in range(B)]
        chosen_steps, qs, sibs = [], [], []
        past = list(self.caches)
        for j in range(K):
            chosen = self._choose(draft_vocab_logits(head, head.norm(g)), j, row_ks, sampling,
                                  width, chosen_steps, qs, sibs)
            if j + 1 == K:
                break       # the last draft token is never fed: verifying it is the target's job
            going = [i for i in range(B) if j + 1 < row_ks[i]]
            if not going:
                break
            for i in going:   # (drafted token, the head's own output) at the next position
                out, past[i] = self._step(i, chosen[i:i + 1], g[i:i + 1], self.fed[i] + j,
                                          keep=False, past=past[i])
                g[i] = out[0]
        return self._proposal(chosen_steps, qs, sibs, num, K, width)

    def _kernel_steps(self, rows: list[int], ids: torch.Tensor, hidden: torch.Tensor,
                      positions: list[int], pick: list[int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The head's layer for pairs (ids [T], hidden [T, D]) of cache rows `rows` at
        `positions` (a row's pairs consecutive), in C calls of up to the kernel's width:
        -> (pre-norm outputs, normed) [T, D], and where `pick` (indices into the T pairs) is
        given, the greedy draft of each picked pair (target ids [P]: the argmax of its logits
        over the draft vocabulary, in the layer's call where it all fits one, no logits row
        written; head_kernels.with_top1 / top1), else None."""
        from specpair import cpu_kernels, head_kernels

        cache, device, run = self.cache, hidden.device, self.layer_kernel
        embeds = self.embed(ids).to(hidden.dtype)
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        positions_t = torch.tensor(positions, dtype=torch.long, device=device)
        width = cpu_kernels.MAX_TOKENS
        if len(rows) <= width and (pick is None or len(pick) <= width):
            if pick is None:
                return (*run(embeds, hidden, rows_t, positions_t, max(positions) + 1, cache.kc,
                             cache.vc), None)
            out, normed, top = run.with_top1(embeds, hidden, rows_t, positions_t,
                                             max(positions) + 1, cache.kc, cache.vc,
                                             torch.tensor(pick, dtype=torch.long))
            return out, normed, self.draft_ids[top]
        outs = [run(embeds[a:a + width], hidden[a:a + width], rows_t[a:a + width],
                    positions_t[a:a + width], max(positions[a:a + width]) + 1, cache.kc, cache.vc)
                for a in range(0, len(rows), width)]
        out, normed = torch.cat([o for o, _ in outs]), torch.cat([n for _, n in outs])
        if pick is None:
            return out, normed, None
        return out, normed, self.draft_ids[head_kernels.top1(normed[pick],
                                                             self.head.lm_head.weight)]

    def _top1_fused(self, sampling, width: int) -> bool:
        """Whether this round's drafts are each row's argmax, read from the layer's C call (no
        logits row): every row greedy, a chain (a tree's siblings need the row's top few) and
        no grammar (a guided row masks the whole row first)."""
        return (sampling.all_greedy and width == 1 and self._guides is None
                and self.layer_kernel.top1_applies())

    def _propose_in_kernel(self, sequences, ks, sampling, width: int):
        """propose() with each step of every row as one C call (head_kernels) over one cache of
        every row (eagle3_steps.Eagle3Cache): the catch-up of the rows' pending pairs (its fc
        in the small-batch kernel), the first draft from its outputs, then one call a further
        draft for the rows still drafting. Drafted pairs are written past the rows' lengths,
        where the next catch-up writes the real ones. A row's arithmetic is the same whatever
        the other rows (cpu_kernels.c): its drafts are bitwise the same alone and in a batch."""
        from specpair import cpu_kernels

        head, cache = self.head, self.cache
        B = len(sequences)
        K = max(ks, default=0)
        device, dtype = self.draft_ids.device, cache.dtype
        tokens, pairs, aux, drafting, num = self._open_round(sequences, ks, self.cache.lengths, device, dtype)
        if not any(pairs):
            return self._no_drafts(tokens, num)
        rows, positions, last = [], [], []
        for i, toks in enumerate(pairs):
            rows += [i] * len(toks)
            positions += range(cache.lengths[i], cache.lengths[i] + len(toks))
            last.append(len(rows) - 1)
        cache.reserve(max(cache.lengths[i] + len(toks) for i, toks in enumerate(pairs)) + K)
        states = torch.cat([a for a in aux if a is not None])
        step = cpu_kernels.MAX_TOKENS
        hidden = torch.cat([cpu_kernels.linear(states[a:a + step], head.fc.weight)
                            for a in range(0, len(states), step)])
        ids = torch.tensor([t for toks in pairs for t in toks], dtype=torch.long, device=device)
        # Greedy chains take each drafting row's first draft from the catch-up's own call (its
        # last pair's argmax): only those rows are scored against the draft vocabulary (a row
        # not drafting this round proposes nothing; its token stays 0, past its num).
        fused = K > 0 and any(drafting) and self._top1_fused(sampling, width)
        scored = [i for i in range(B) if drafting[i]] if fused else []
        pick = [last[i] for i in scored] if fused else None
        self.fused_top1_rounds += fused
        out, normed, top = self._kernel_steps(rows, ids, hidden, positions, pick)
        for i, toks in enumerate(pairs):
            cache.lengths[i] += len(toks)
        if K == 0 or not any(drafting):
            return self._no_drafts(tokens, num)
        index = torch.tensor(last, dtype=torch.long, device=device)
        g, gn = out[index], normed[index]                                   # [B, D]
        row_ks = [ks[i] if drafting[i] else 0 for i in range(B)]
        chosen_steps, qs, sibs = [], [], []
        if fused:
            chosen = torch.zeros(B, dtype=torch.long, device=device)
            chosen[scored] = top
            chosen_steps.append(chosen)
            qs.append(None)
        else:
            chosen = self._choose(draft_vocab_logits(head, gn), 0, row_ks, sampling, width,
                                  chosen_steps, qs, sibs)
        for j in range(1, K):       # the last draft token is never fed
            going = [i for i in range(B) if j < row_ks[i]]
            if not going:
                break
            at = torch.tensor(going, dtype=torch.long, device=device)
            out, normed, top = self._kernel_steps(going, chosen[at], g[at],
                                                  [cache.lengths[i] + j - 1 for i in going],
                                                  list(range(len(going))) if fused else None)
            g[at], gn[at] = out, normed
            if fused:        # a row past its k keeps its last draft (its normed output stays)
                chosen = chosen.clone()
                chosen[at] = top
                chosen_steps.append(chosen)
                qs.append(None)
            else:
                chosen = self._choose(draft_vocab_logits(head, gn), j, row_ks, sampling, width,
                                      chosen_steps, qs, sibs)
        return self._proposal(chosen_steps, qs, sibs, num, K, width)

    def _propose_in_fixed_steps(self, sequences, ks, sampling, width: int):
        """propose() as fixed-shape steps over every row (eagle3_steps): one catch-up step of
        the rows' pending pairs (a prompt's first, wider than CATCH_UP_WIDTH, at its own
        bucket), the first draft from its outputs, then one drafting step a further draft.
        Greedy: the steps read and write only the device, and the tokens come back in one
        gather at the end; a sampled row chooses from each step's logits and feeds its draw."""
        from specpair.eagle3_steps import Eagle3CatchUp, Eagle3DraftStep

        head, cache = self.head, self.cache
        B = len(sequences)
        K = max(ks, default=0)
        device, dtype = self.draft_ids.device, cache.dtype
        tokens, pairs, aux, drafting, num = self._open_round(sequences, ks, self.cache.lengths, device, dtype)
        if not any(pairs):
            return self._no_drafts(tokens, num)
        widest = bucket(max(map(len, pairs)))
        cache.reserve(max(cache.lengths) + max(widest, K))
        key = ("catch-up", widest)
        if key not in cache.steps:
            cache.steps[key] = Eagle3CatchUp(head, self.embed, cache, widest)
        g = cache.steps[key](cache, pairs, aux)[:B].clone()                      # [B, D]
        if K == 0 or not any(drafting):
            return self._no_drafts(tokens, num)
        row_ks = [ks[i] if drafting[i] else 0 for i in range(B)]
        chosen_steps, qs, sibs = [], [], []
        chosen = self._choose(draft_vocab_logits(head, head.norm(g)), 0, row_ks, sampling,
                              width, chosen_steps, qs, sibs)
        steps = max(row_ks) - 1          # the last draft token is never fed
        if steps > 0:
            cache.reserve(max(cache.lengths) + steps + 1)     # a grown cache: new steps
            key = ("draft", width)
            if key not in cache.steps:
                cache.steps[key] = Eagle3DraftStep(head, self.embed, self.draft_ids, cache, width)
            step = cache.steps[key]
            start = step.start(chosen, g, cache.lengths)
            # A row with a grammar chooses each draft on the host within it (_choose).
            greedy = sampling.all_greedy and self._guides is None
            for j in range(1, steps + 1):
                logits = step(cache)
                if not greedy:
                    chosen = self._choose(logits[:B], j, row_ks, sampling, width, chosen_steps,
                                          qs, sibs)
                    step.ids[:B, 0] = chosen
            if greedy:
                self._gather_greedy(step, start, steps, width, chosen_steps, qs, sibs)
        return self._proposal(chosen_steps, qs, sibs, num, K, width)

    def describe(self) -> dict:
        return {**super().describe(), "aux_layers": list(self.aux_layers),
                "fixed_steps": bool(self.fixed), "c_kernel": bool(self.kernel)}
