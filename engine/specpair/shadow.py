"""Shadow drafting: score a candidate drafter on live traffic without serving one token from it.

The serving engine (the champion) can carry a second drafter, the candidate release's (same
target, another draft side). On a share of requests, after each step the candidate is asked what
it would have drafted at prefixes whose continuation the target has already decided; it only
reads. Nothing it does reaches a row's tokens, caches, random streams or k: the champion's output
is the same with or without it (tests/engine/test_engine_shadow.py).

The math
    Speculative sampling accepts draft token x ~ q with probability min(1, p(x)/q(x)), so the
    first draft position is accepted with probability
        alpha = sum_x q(x) min(1, p(x)/q(x)) = sum_x min(p(x), q(x)),
    p the target's distribution at that position after the request's sampling transform
    (temperature, top-k, top-p), q the drafter's under the same transform.
    - Sampled requests, a point-mass drafter (n-gram lookup): its rounds are replayed as for
      greedy requests below. Serving, it keeps a draft token exactly when the sampled token is
      that token (a rejection samples the residual, which excludes it), so the committed tokens,
      which the champion samples from the same distribution, decide its rounds as serving would
      (in distribution), and its first positions are counted where its own rounds start.
    - Sampled requests, a draft model: p comes from the verification logits the step already computed for the
      first position of the champion's round (the target's distribution of the next token after
      everything committed before the step: no extra target pass); q is the candidate's
      distribution at the same prefix (a point mass on its token for n-gram lookup, so alpha =
      p(token)). The expectation is exact per position, so the shadow's mean alpha differs from
      what the candidate would measure serving only by which positions are sampled.
    - Greedy requests: p is the one-hot of the target's argmax, which is the token the champion
      committed there (greedy output does not depend on the drafter), so alpha is the indicator
      [candidate's first token == committed token]. More: the candidate's whole chain can be
      replayed. Serving, it would draft a chain of k at prefix v, keep the a leading tokens that
      equal the target's argmax (the committed tokens v, v+1, ...), and start its next round at
      v + a + 1. The shadow runs exactly these rounds, each chain judged once the committed
      tokens reach its first mismatch or its end, with the candidate's own dynamic k, capped as
      serving caps it (the request's k, the tokens left). Its drafted / accepted sums are then
      those the candidate counts when it serves the same requests (bitwise-equal verification
      logits, kv/static.py). Not replayed: the engine-wide fallback to target-only and a
      cost-calibrated k (the shadow's k follows the heuristic); and a chain that drafts past the
      end-of-sequence token is judged against the tokens that exist (a lower bound there).
    The champion is scored on the same requests and positions' rounds: its first-position alpha
    (sum min(p, q) of its own q for sampled rows, [a >= 1] for greedy ones) and, for greedy
    requests, its drafted / accepted tokens, so the two are compared on the same traffic.

The unit is the request (stats.RequestMoments, as drift uses): per finished shadowed request
(d_i, a_i) = (first positions scored, sum of alpha) and, greedy, (chain tokens drafted, accepted),
summed per category with their squares and cross products for the ratio estimator's variance,
and the cross sums of candidate and champion over the same requests (stats.PairedSums) for the
variance of their difference.

Cost and bounds: the candidate's draft seconds per committed token of shadowed requests are
reported. A request is shadowed with probability `share` when it joins; the candidate's replay
backs off per row where the champion's row may (an unaudited request, costs.RequestAudit), and
drafts every round where the champion's does; no step is scored while
the batch is larger than the serving release's batch threshold or a row runs target-only for
want of KV memory (a skipped step only delays a greedy replay; sampled positions are skipped).
The candidate's own cache (a draft model's) is not counted in the KV budget.

Drafters: n-gram lookup, draft models and heads (EAGLE, EAGLE-3, Medusa). A head drafts from the
target's features of the committed tokens: the scorer is an observer the engine declares
(batch_observer.BatchObserver, SpeculativeEngine.add_observer) that wants them, so the Batch asks
the target for them whatever the champion drafts with and hands them over as it hands a serving
head its own; each row keeps them until a round is due, and a round at prefix v hands the
candidate those of positions before v - 1, what a serving head knows there (the bonus token's
not computed yet). One target step hands one kind of features (drafters.head.read_features):
an EAGLE-3 candidate beside an EAGLE or Medusa champion, or the reverse, is refused by name.
A feature-reading candidate takes the paged cache off (it hands no features) and the prefix
store's reuse (a prompt served from it computes none).
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specpair.batch_observer import BatchObserver, VerifiedRound
from specpair.config import PairSpec, Release, SpeculationConfig
from specpair.contract import DEFAULT_CATEGORY
from specpair.costs import DynamicK, sync
from specpair.drafters import Drafter, ModelDrafter, NgramDrafter, RowSampling
from specpair.errors import SpecpairError
from specpair.rejection_sampler import process_logits
from specpair.stats import PairedSums, RequestMoments

log = logging.getLogger("specpair.shadow")

DEFAULT_SHARE = 0.1


@dataclass(frozen=True)
class Candidate:
    """The candidate release as the shadow needs it: who it is and the pair it drafts with
    (target, draft model or drafter, speculation: Release.from_dict's reading)."""
    version: str
    content_hash: str
    pair: PairSpec

    @property
    def speculation(self) -> SpeculationConfig:
        return self.pair.speculation


def read_candidate(path: str | Path) -> Candidate:
    """A candidate release file, refused with the reason when it cannot be shadowed."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SpecpairError(f"--shadow-release {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise SpecpairError(f"--shadow-release {path}: not a release (a JSON object)")
    try:
        release = Release.from_dict(raw)
    except SpecpairError as exc:
        raise SpecpairError(f"--shadow-release {path}: {exc}") from exc
    if not release.pair.speculates:
        raise SpecpairError(f"--shadow-release {path}: no draft (a drafter or a draft source): "
                            f"nothing to score")
    return Candidate(version=release.version or "0", content_hash=release.content_hash, pair=release.pair)


def check_same_target(candidate: Candidate, source: str, revision: str | None) -> None:
    """Shadow scoring reads the serving target's logits: the candidate must be gated on that target."""
    mine = (candidate.pair.target.source, candidate.pair.target.revision)
    if mine != (source, revision):
        raise SpecpairError(
            f"shadow candidate v{candidate.version} targets {mine[0]}"
            f"{'@' + str(mine[1]) if mine[1] else ''}, the engine serves {source}"
            f"{'@' + str(revision) if revision else ''}: a shadow drafter must share the serving "
            f"target (another target needs a canary)")


def build_shadow_drafter(candidate: Candidate, engine, load_model=None) -> Drafter:
    """The candidate's drafter beside the engine's target (same tokenizer required)."""
    pair = candidate.pair
    if pair.drafter is not None:      # a known model-free drafter (PairSpec refuses others)
        return NgramDrafter(device=engine.target.device)
    if load_model is None:
        from specpair.models import load_model
    from specpair.tokenizer_identity import compare, fingerprint
    loaded = load_model(pair.draft.source, device=str(engine.target.device), revision=pair.draft.revision)
    if getattr(loaded.model, "is_drafting_head", False):
        # As the engine builds a head (drafter_choice): the tokenizer check knows a head carries
        # the target's; lookup in front of it is the serving engine's choice, not scored here.
        from specpair.drafter_choice import build_drafter

        try:
            return build_drafter(
                engine.target, loaded, speculation=replace(pair.speculation, lookup_min_match=0),
                kv=engine.kv_kind, compile=engine.compile_mode,
                target_fingerprint=engine.target_fingerprint).drafter
        except SpecpairError as exc:
            raise SpecpairError(f"shadow candidate v{candidate.version}: {exc}") from exc
    check = compare(fingerprint(loaded.tokenizer, embedding_rows=loaded.embedding_rows),
                    engine.target_fingerprint)
    if not check.compatible:
        raise SpecpairError(f"shadow candidate v{candidate.version}: draft tokenizer differs from the "
                            f"target's: " + "; ".join(check.differences))
    return ModelDrafter(loaded, vocab_size=engine.vocab_size, kv=engine.kv_kind, compile=engine.compile_mode)


# -- what is counted -----------------------------------------------------------------------------

@dataclass
class RequestScore:
    """One shadowed request's sums, added to its category when it finishes."""
    positions: int = 0              # candidate: first positions scored
    alpha: float = 0.0              # candidate: Σ alpha over them
    champion_positions: int = 0
    champion_alpha: float = 0.0
    drafted: int = 0                # candidate, greedy replay: chain tokens drafted
    accepted: int = 0               # ... and accepted
    draft_seconds: float = 0.0      # the candidate's share of the shadow's draft time
    committed: int = 0              # tokens the champion committed while shadowed


@dataclass
class CategoryShadow:
    """Cumulative since start, over finished shadowed requests of one category."""
    requests: int = 0
    candidate_alpha: RequestMoments = field(default_factory=RequestMoments.zero)
    champion_alpha: RequestMoments = field(default_factory=RequestMoments.zero)
    candidate_chain: RequestMoments = field(default_factory=RequestMoments.zero)   # greedy requests
    champion_chain: RequestMoments = field(default_factory=RequestMoments.zero)    # the same requests
    alpha_paired: PairedSums = field(default_factory=PairedSums)   # candidate x champion, per request
    chain_paired: PairedSums = field(default_factory=PairedSums)
    draft_seconds: float = 0.0
    committed_tokens: int = 0

    def add(self, score: RequestScore, greedy: bool, champion_drafted: int, champion_accepted: int) -> None:
        self.requests += 1
        mine, theirs = (score.positions, score.alpha), (score.champion_positions, score.champion_alpha)
        self.candidate_alpha += RequestMoments.of_request(*mine)
        self.champion_alpha += RequestMoments.of_request(*theirs)
        self.alpha_paired += PairedSums.of_request(mine, theirs)
        if greedy:
            mine, theirs = (score.drafted, score.accepted), (champion_drafted, champion_accepted)
            self.candidate_chain += RequestMoments.of_request(*mine)
            self.champion_chain += RequestMoments.of_request(*theirs)
            self.chain_paired += PairedSums.of_request(mine, theirs)
        self.draft_seconds += score.draft_seconds
        self.committed_tokens += score.committed


@dataclass
class _Row:
    seq: object                     # decoding.Sequence
    greedy: bool
    generator: torch.Generator | None
    replayed: bool                  # the candidate's rounds replayed on the committed tokens
    k: DynamicK
    v: int                          # replayed: where the candidate's next round starts (else its first)
    chain: list[int] | None = None  # greedy replay: the chain drafted at v, not yet judged
    asked: int = 0                  # the longest prefix the drafter was handed (it only grows)
    score: RequestScore = field(default_factory=RequestScore)
    # A head candidate: the target's features of positions fed.. not yet handed to it (fed: what
    # it knows, its `known`), in position order.
    fed: int = 0
    features: list = field(default_factory=list)

    @property
    def featured(self) -> int:
        """Positions with a feature: handed or kept."""
        return self.fed + sum(int(f.shape[0]) for f in self.features)

    def keep_features(self, start: int, features: torch.Tensor) -> None:
        """The target's features from position `start` (a preempted row's recomputed ones
        overlap what is kept: only the new part is taken)."""
        have = self.featured
        if start > have:
            raise SpecpairError(f"shadow: features from position {start}, {have} expected")
        if start + features.shape[0] > have:
            self.features.append(features[have - start:])


class _BatchShadow:
    """The shadow's rows of one Batch and the candidate drafter's per-row state for them."""

    def __init__(self, scorer: "ShadowScorer", device):
        self.scorer, self.device = scorer, device
        self.drafter = scorer.drafter.for_batch()
        self.rows: list[_Row] = []
        # The sequences already offered the share, by id. The objects are held, not just their
        # ids: a finished sequence freed between two steps let the next request's sequence take
        # its address, and that request was then never offered the share (1 of 12 sequential
        # requests went unscored on the tiny pair).
        self.seen: dict[int, object] = {}
        # A head candidate: the features handed this step for rows not (yet) shadowed, by the
        # sequence's id: a newcomer takes its own when the share is drawn (align).
        self.incoming: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def take_features(self, seq, start: int, features: torch.Tensor) -> None:
        for r in self.rows:
            if r.seq is seq:
                r.keep_features(start, features)
                return
        self.incoming.setdefault(id(seq), []).append((start, features))

    def align(self, batch, committed: list[int]) -> None:
        """Follow the batch's rows: drop those gone (cancelled), take newcomers by the share
        (their replay starts where this step's round did)."""
        present = {id(s) for s in batch.rows}
        keep = [i for i, r in enumerate(self.rows) if id(r.seq) in present]
        if len(keep) != len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            self.drafter.select(keep)
        self.seen = {key: seq for key, seq in self.seen.items() if key in present}
        for i, seq in enumerate(batch.rows):
            if id(seq) in self.seen:
                continue
            self.seen[id(seq)] = seq
            if not self.scorer.draw():
                continue
            greedy = seq.params.greedy
            gen = None
            if not greedy:   # the candidate's own random stream: the row's is the champion's alone
                gen = torch.Generator(device=batch.device)
                gen.manual_seed(self.scorer.rng.randrange(2 ** 62))
            # A point-mass drafter's rounds are replayed on sampled rows too: serving, it keeps
            # a draft token exactly when the sampled token is that token (a rejection samples
            # the residual, which excludes it), with the target's probability either way, so
            # the committed tokens decide its rounds as serving would, in distribution. Scoring
            # only the champion's round starts instead counted it where it never starts a round
            # (inside the spans it copies): 0.64 against 0.39 served on SmolLM2 (docs/shadow.md).
            replayed = greedy or self.scorer.drafter.deterministic
            # A head drafts nothing in a row's first round (no features of its prompt yet):
            # serving, that round is the target's alone, one token; its rounds start after.
            first = committed[i] + (1 if self.scorer.wants_features else 0)
            row = _Row(seq=seq, greedy=greedy, generator=gen, replayed=replayed,
                       k=replay_k(self.scorer.candidate.speculation, seq.stats.audited), v=first)
            for start, features in self.incoming.get(id(seq), []):
                row.keep_features(start, features)
            self.rows.append(row)
            self.drafter.add_rows(1)
        self.incoming = {}

    def hand_features(self, n: int, upto: int) -> None:
        """Row n's candidate head told the features of positions before `upto` (what a serving
        head knows at prefix upto + 1)."""
        r = self.rows[n]
        if upto <= r.fed or not r.features:
            return
        kept = torch.cat(r.features) if len(r.features) > 1 else r.features[0]
        count = min(upto - r.fed, int(kept.shape[0]))
        self.drafter.observe(n, r.fed, kept[:count])
        r.fed += count
        r.features = [kept[count:]] if count < kept.shape[0] else []


class ShadowScorer(BatchObserver):
    """Scores a candidate drafter beside the serving one; see the module docstring.

    An observer of the engine's batches (SpeculativeEngine.add_observer, which attach_shadow
    calls; `engine.shadow` finds it): Batch.step calls `after_round` after each verification,
    and hands it the target's features (`take_features`) where the candidate drafts from them.
    `snapshot()` is safe from other threads (GetStats, metrics)."""

    def __init__(self, drafter: Drafter, candidate: Candidate, *, share: float = DEFAULT_SHARE,
                 batch_size_threshold: int | None = None, seed: int | None = None):
        if not 0.0 <= share <= 1.0:
            raise SpecpairError(f"shadow share must be in [0, 1], got {share}")
        self.drafter, self.candidate, self.share = drafter, candidate, share
        self.wants_features = drafter.wants_features
        self.batch_size_threshold = batch_size_threshold
        self.rng = random.Random(seed)
        self.categories: dict[str, CategoryShadow] = {}
        self.skipped_steps = 0       # steps not scored: batch too large or KV memory short
        self._batches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def draw(self) -> bool:
        return self.share > 0 and self.rng.random() < self.share

    def snapshot(self) -> dict[str, CategoryShadow]:
        with self._lock:
            return {name: replace(c) for name, c in self.categories.items()}

    # -- the batch's hooks (batch_observer.BatchObserver) ----------------------------------------

    def _state(self, batch) -> "_BatchShadow":
        state = self._batches.get(batch)
        if state is None:
            state = self._batches[batch] = _BatchShadow(self, batch.device)
        return state

    def take_features(self, batch, row: int, start: int, features: torch.Tensor) -> None:
        self._state(batch).take_features(batch.rows[row], start, features)

    def after_round(self, batch, verified: VerifiedRound) -> None:
        self.observe(batch, verified.committed, verified.first_logits, verified.sampling,
                     verified.drafts, verified.num, verified.q, verified.accepted,
                     prefilling=verified.prefilling)

    def cache_bytes(self, batch) -> int:
        """A draft model's cache for the batch's shadowed rows (kept apart from the paged pool)."""
        state = self._batches.get(batch)
        return getattr(getattr(getattr(state, "drafter", None), "kv", None), "cache_bytes", 0)

    @torch.no_grad()
    def observe(self, batch, committed: list[int], first_logits: torch.Tensor, sampling: RowSampling,
                drafts: torch.Tensor, num: torch.Tensor, q: torch.Tensor | None,
                accepted: list[int], prefilling: frozenset = frozenset()) -> None:
        """After a verification: rows' lengths before it (`committed`), the target's logits
        [B, V] for each row's first position, the rows' sampling, the champion's drafts [B, K],
        their count [B], its q [B, K, V] (None: point masses) and what it accepted per row.
        Rows have their new tokens; finished ones are still in the batch. A row whose prompt
        the step fed only in part (`prefilling`: the prefill budget's chunks) is drawn for the
        share as it joins, but nothing is asked of it until its prompt is whole: its logits are
        a chunk's, and a head candidate knows only the chunks' features so far."""
        state = self._state(batch)
        state.align(batch, committed)
        if not state.rows:
            return
        threshold = self.batch_size_threshold
        if threshold is None:
            threshold = batch.engine.config.batch_size_threshold
        if batch.active > threshold or any(s.memory_target_only for s in batch.rows):
            self.skipped_steps += 1
            self._finish(state)
            return
        where = {id(s): i for i, s in enumerate(batch.rows)}
        index = [where[id(r.seq)] for r in state.rows]
        nums = num.tolist()
        for r, i in zip(state.rows, index):
            r.score.committed += len(r.seq.tokens) - committed[i]
            if nums[i]:
                r.score.champion_positions += 1
                if r.greedy:
                    r.score.champion_alpha += 1.0 if accepted[i] >= 1 else 0.0
        sampled = [(r, i) for r, i in zip(state.rows, index) if not r.greedy]
        p = None
        if sampled:
            rows = torch.tensor([i for _, i in sampled], device=first_logits.device)
            p = process_logits(first_logits[rows].unsqueeze(1), sampling.temperature[rows],
                               sampling.top_k[rows], sampling.top_p[rows]).squeeze(1)     # [S, V]
            for n, (r, i) in enumerate(sampled):
                if nums[i]:
                    champ = q[i, 0].float() if q is not None else one_hot(drafts[i, 0], p.shape[-1])
                    r.score.champion_alpha += float(torch.minimum(p[n], champ.to(p.device)).sum())
        waiting = {n for n, i in enumerate(index) if i in prefilling}
        self._draft_rounds(state, committed, index, p, sampled, waiting)
        state.drafter.trim()      # a draft model's cache gives back what no row needs
        self._finish(state)

    def _draft_rounds(self, state: _BatchShadow, committed, index, p, sampled,
                      waiting: set[int] = frozenset()) -> None:
        """Ask the candidate at every prefix due: once per sampled row (the step's round start),
        and each greedy row's replayed rounds until they wait on tokens not yet committed. The
        rows `waiting` (their prompt fed in part) are asked nothing yet."""
        p_row = {id(r): n for n, (r, _) in enumerate(sampled)}
        due: dict[int, tuple[int, int]] = {}          # shadow row -> (prefix length, k)
        for n, r in enumerate(state.rows):
            if n in waiting:
                continue
            if (not r.replayed and committed[index[n]] >= r.v
                    and committed[index[n]] - len(r.seq.prompt_ids) < r.seq.params.max_new_tokens):
                due[n] = (committed[index[n]], 1)
        while True:
            for n, r in enumerate(state.rows):
                if r.replayed and n not in waiting:
                    self._judge(r)
                    if r.chain is None and n not in due and self._ready(r):
                        due[n] = (r.v, self._replay_k(r))
            if not due:
                return
            self._propose(state, due, p, p_row)
            due = {}

    @staticmethod
    def _ready(r: _Row) -> bool:
        seq = r.seq
        return r.v - len(seq.prompt_ids) < seq.params.max_new_tokens and (
            r.v < len(seq.tokens) or (r.v == len(seq.tokens) and not seq.finished))

    @staticmethod
    def _replay_k(r: _Row) -> int:
        """The k serving would use at the replayed round (Batch._ks, without fallback)."""
        params = r.seq.params
        k = r.k.k if params.speculation_k is None else params.speculation_k
        remaining = params.max_new_tokens - (r.v - len(r.seq.prompt_ids)) - 1
        return max(0, min(k, remaining))

    def _propose(self, state: _BatchShadow, due, p, p_row) -> None:
        rows = state.rows
        ks = [due[n][1] if n in due else 0 for n in range(len(rows))]
        for n in due:
            rows[n].asked = due[n][0]
            if self.wants_features:   # what a serving head knows at that prefix
                state.hand_features(n, due[n][0] - 1)
        # A row not asked this round is handed the prefix it had: a drafter that indexes each
        # row's sequence as it grows (a batch's NgramDrafter) starts its index again whenever a
        # row's sequence gets shorter, and the replay's prefixes trail the committed tokens.
        sequences = [r.seq.tokens[:r.asked] for r in rows]
        sampling = shadow_sampling(rows, state.device)
        start = time.perf_counter()
        proposal = state.drafter.propose(sequences, ks, sampling)
        tokens = proposal.tokens.tolist()
        counts = proposal.num.tolist()
        sync(proposal.tokens.device)
        seconds = time.perf_counter() - start
        busy = [n for n in due if ks[n]] or list(due)
        for n in due:
            r, prefix = rows[n], due[n][0]
            r.score.draft_seconds += seconds / len(busy) if n in busy else 0.0
            # Back to the prefix: the next round feeds what is committed by then.
            state.drafter.accepted(n, prefix, 0)
            chain = tokens[n][:counts[n]]
            if not r.replayed:
                if chain:
                    probs = proposal.probs
                    cand = probs[n, 0].float() if probs is not None else one_hot(chain[0], p.shape[-1])
                    target = p[p_row[id(r)]]
                    r.score.positions += 1
                    r.score.alpha += float(torch.minimum(target, cand.to(target.device)).sum())
            elif chain:
                r.chain = chain
            else:            # nothing drafted: serving takes a target-only round here
                r.v += 1

    @staticmethod
    def _judge(r: _Row) -> None:
        """A replayed chain once the committed tokens decide it: up to its first mismatch, or all."""
        if r.chain is None:
            return
        seen = r.seq.tokens[r.v:r.v + len(r.chain)]
        a = 0
        while a < len(seen) and seen[a] == r.chain[a]:
            a += 1
        if a == len(r.chain) or a < len(seen) or r.seq.finished:
            r.score.drafted += len(r.chain)
            r.score.accepted += a
            r.score.positions += 1
            r.score.alpha += 1.0 if a >= 1 else 0.0
            r.k.update(len(r.chain), a)
            r.v += a + 1
            r.chain = None

    def _finish(self, state: _BatchShadow) -> None:
        done = [n for n, r in enumerate(state.rows) if r.seq.finished]
        if not done:
            return
        with self._lock:
            for n in done:
                r = state.rows[n]
                if r.seq.finish_reason == "cancelled":
                    continue
                name = r.seq.params.category or DEFAULT_CATEGORY
                stats = r.seq.stats
                self.categories.setdefault(name, CategoryShadow()).add(
                    r.score, r.greedy, stats.num_draft_tokens, stats.num_accepted_tokens)
        keep = [n for n in range(len(state.rows)) if n not in done]
        state.rows = [state.rows[n] for n in keep]
        state.drafter.select(keep)


def replay_k(speculation: SpeculationConfig, audited: bool) -> DynamicK:
    """The candidate's k in a replay, as it would serve the same request: an audited request
    (costs.RequestAudit) drafts every round, another backs off by the candidate's settings, as
    the champion's row does, so both sides of a request are counted under the same rule."""
    return DynamicK(speculation, back_off=False if audited else None)


def one_hot(token, size: int) -> torch.Tensor:
    out = torch.zeros(size)
    out[int(token)] = 1.0
    return out


def shadow_sampling(rows: list[_Row], device) -> RowSampling:
    """The shadowed rows' sampling settings with the candidate's own generators."""
    params = [r.seq.params for r in rows]
    return RowSampling(temperature=torch.tensor([p.temperature for p in params], device=device),
                       top_k=torch.tensor([p.top_k for p in params], device=device),
                       top_p=torch.tensor([p.top_p for p in params], device=device),
                       generators=[r.generator for r in rows])


def attach_shadow(engine, release_path: str | Path, *, share: float = DEFAULT_SHARE,
                  serving_target: tuple[str, str | None], load_model=None,
                  seed: int | None = None) -> ShadowScorer:
    """Read a candidate release, check it drafts for the serving target, build its drafter and
    declare it an observer of the engine's batches (`engine.shadow` finds it): Batch.step
    scores it from then on."""
    candidate = read_candidate(release_path)
    check_same_target(candidate, *serving_target)
    drafter = build_shadow_drafter(candidate, engine, load_model)
    scorer = ShadowScorer(drafter, candidate, share=share, seed=seed)
    engine.add_observer(scorer)
    return scorer
