"""The prefill token budget (decoding.Batch._prefill_caps) where a head drafts (EAGLE, EAGLE-3,
Medusa), where token trees are verified, and beside a shadow observer: a long prompt joining rows
that decode is fed in chunks, each chunk's target features handed to the head (and the
observer) as the chunk is computed, so after the last chunk the head holds what one whole
prefill hands it. Every row's tokens equal its solo output, and each row's drafts, round for
round (position, chain, a tree's siblings), equal the ones it drafts with the prompts fed whole,
a second long prompt joining while the first is mid-prompt. A control shows that comparison sees
a chunk's features dropped or shifted by one position (greedy tokens alone would not: a greedy
reply is the target's whatever the head drafts)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from head_builders import eagle3_head, eagle_head, medusa_heads

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import Batch, SpeculativeEngine
from specpair.drafters import NgramDrafter

SPEC = dict(k=3, k_max=3, dynamic_k=False, fallback_threshold=0, batch_size_threshold=64)
SHORT = ["def foo(x):\n    return", "The quick brown fox"]
LONG = ["class A:\n  pass\n" * 6 + "import os\nimport sys\n" * 3,            # 111 tokens
        "x = [1, 2, 3]\nfor i in x:\n" * 5 + "Hello world, hello world"]    # 125
BUDGET = 24       # a long prompt takes five or more steps beside the decoding rows
GREEDY = GenerationParams(max_new_tokens=14)
SAMPLED = GenerationParams(max_new_tokens=14, temperature=0.8, seed=7)   # keyed: batch-free draws
# (A category a request: a shadow's sums are then per request.)
PLAN = [(name, prompt, replace(params, category=name)) for name, prompt, params in
        [("s0", SHORT[0], GREEDY), ("s1", SHORT[1], SAMPLED), ("l0", LONG[0], GREEDY),
         ("l1", LONG[1], GREEDY)]]


def head_engine(kind: str, request) -> SpeculativeEngine:
    if kind == "eagle3":
        target = request.getfixturevalue("eagle3_target")
        head = eagle3_head(target)
    elif kind == "medusa":
        target = request.getfixturevalue("smooth_target")
        head = medusa_heads(target, scramble=0.3)
    else:       # eagle, eagle-tree: a random head (head_builders' mirror head reads no feature)
        target = request.getfixturevalue("one_layer_target")
        head = eagle_head(target, vocab_every=2, seed=3)
    width = 3 if kind == "eagle-tree" else 1
    engine = SpeculativeEngine(target, draft=head,
                               speculation=SpeculationConfig(**SPEC, tree_width=width))
    assert engine.paged_space is not None          # the C layer's paged cache: the budget applies
    return engine


def spy_drafts(batch: Batch, drafts: dict) -> None:
    """Record each row's drafts a round: (its length, chain, a tree's siblings), by request id.
    The batch's own drafter object runs them; this only reads what it returns."""
    inner = batch.drafter.propose

    def propose(sequences, ks, sampling, width=1, **extra):
        proposal = inner(sequences, ks, sampling, width, **extra)
        tokens, num = proposal.tokens.tolist(), proposal.num.tolist()
        siblings = proposal.siblings.tolist() if proposal.siblings is not None else None
        for i, seq in enumerate(batch.rows):
            if num[i]:
                drafts.setdefault(seq.request_id, []).append(
                    (len(seq.tokens), tokens[i][:num[i]],
                     siblings[i][:num[i]] if siblings is not None else None))
        return proposal
    batch.drafter.propose = propose


def run(engine, budget: int | None, spy: bool = True, plan=PLAN):
    """The short rows decode two steps, the first long prompt joins, and the second joins one
    step later (the first still mid-prompt under the budget). -> ({request: tokens},
    {request: drafts}, steps that fed some prompt in part, {request: (drafted, accepted)})."""
    engine.prefill_budget = budget
    batch = engine.new_batch()
    drafts: dict = {}
    if spy:
        spy_drafts(batch, drafts)
    seqs = {}
    for name, prompt, params in plan[:2]:
        seqs[name] = batch.add(engine.encode(prompt), params, request_id=name)
    batch.step()
    batch.step()
    partial = 0
    for name, prompt, params in plan[2:]:
        seqs[name] = batch.add(engine.encode(prompt), params, request_id=name)
        batch.step()
        partial += bool(batch._prefill_cap)
    while batch.active:
        batch.step()
        partial += bool(batch._prefill_cap)
    results = {name: batch.result(seq) for name, seq in seqs.items()}
    return ({n: r.token_ids for n, r in results.items()}, drafts, partial,
            {n: (r.stats.num_draft_tokens, r.stats.num_accepted_tokens) for n, r in results.items()})


def solo(engine) -> dict[str, list[int]]:
    engine.prefill_budget = None
    return {name: engine.generate([prompt], params)[0].token_ids for name, prompt, params in PLAN}


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "eagle-tree"])
def test_a_head_fed_a_prompt_in_chunks_drafts_what_it_drafts_after_a_whole_prefill(kind, request):
    # (An engine a run: the pool's prefix store would serve the next run's prompts cached.)
    alone = solo(head_engine(kind, request))
    whole, whole_drafts, whole_partial, whole_counts = run(head_engine(kind, request), None)
    tokens, drafts, partial, counts = run(head_engine(kind, request), BUDGET)
    assert whole_partial == 0 and partial >= 8, partial     # both long prompts chunked
    assert tokens == whole == alone
    assert drafts == whole_drafts            # round for round, the long rows' first ones included
    assert counts == whole_counts
    assert drafts["l0"] and drafts["l1"]      # the long rows drafted after their chunks
    if kind == "eagle3":                      # (it partly predicts this target: checked too)
        assert sum(a for _, a in counts.values()) > 0, counts
    if kind == "eagle-tree":
        assert any(s for _, _, s in drafts["l0"])


@pytest.mark.parametrize("kind,fault", [("eagle", "dropped"), ("eagle", "shifted")])
def test_the_comparison_sees_a_chunks_features_dropped_or_misaligned(kind, fault, request,
                                                                     monkeypatch):
    """The control for the test above: a chunk's features handed as zeros (dropped) or one
    position late (shifted) leave the tokens greedy rows emit alone, and change the drafts."""
    whole, whole_drafts, _, _ = run(head_engine(kind, request), None)
    handed = Batch._hand_features

    def faulty(self, row, start, features, drafter):
        if row in self._prefill_cap and features.shape[0] > 1:
            features = (torch.zeros_like(features) if fault == "dropped"
                        else torch.cat([features[:1], features[:-1]]))
        handed(self, row, start, features, drafter)
    monkeypatch.setattr(Batch, "_hand_features", faulty)
    tokens, drafts, partial, _ = run(head_engine(kind, request), BUDGET)
    assert partial > 0
    assert {n: tokens[n] for n in ("s0", "l0", "l1")} == {n: whole[n] for n in ("s0", "l0", "l1")}
    assert drafts["l0"] != whole_drafts["l0"] and drafts["l1"] != whole_drafts["l1"]


@pytest.mark.parametrize("champion,candidate", [("ngram", "eagle3"), ("eagle3", "ngram"),
                                                ("ngram", "model")])
def test_a_shadow_observer_scores_chunked_prompts_as_whole_ones(champion, candidate, request):
    """A shadow scorer (share 1) beside chunked prompts, the second long one sampled: it is
    asked nothing of a row until its prompt is whole (VerifiedRound.prefilling: its logits are
    a chunk's end's, not a next token's: a draft model candidate scored a sampled row's alpha
    against them mid-prompt), then scores every request as it does with the prompts fed whole;
    the champion's tokens and counts unchanged."""
    from specpair.drafters.eagle3 import Eagle3Drafter
    from specpair.config import ModelRef, PairSpec
    from specpair.drafters import ModelDrafter
    from specpair.shadow import Candidate, ShadowScorer
    from tiny_models import perturbed_copy

    target = request.getfixturevalue("eagle3_target")
    sampled_plan = PLAN[:3] + [("l1", LONG[1], replace(SAMPLED, category="l1"))]

    def eagle3(engine):
        return Eagle3Drafter(eagle3_head(target), target.model, engine.vocab_size)

    def scored(budget):
        base = SpeculativeEngine(target, drafter=NgramDrafter(), speculation=SpeculationConfig(**SPEC))
        engine = base if champion == "ngram" else SpeculativeEngine(
            target, drafter=eagle3(base), speculation=SpeculationConfig(**SPEC))
        drafter = {"eagle3": lambda: eagle3(engine), "ngram": NgramDrafter,
                   "model": lambda: ModelDrafter(perturbed_copy(target, seed=12, noise=0.03),
                                                 vocab_size=engine.vocab_size)}[candidate]()
        scorer = ShadowScorer(drafter, Candidate(version="7", content_hash="c" * 64, pair=PairSpec(
            target=ModelRef("tiny"), drafter="ngram", speculation=SpeculationConfig(**SPEC))),
            share=1.0, seed=0)
        engine.add_observer(scorer)
        assert engine.paged_space is not None
        tokens, _, partial, counts = run(engine, budget, spy=False, plan=sampled_plan)
        # (its draft seconds are a clock's: the rest are counts and sums of alpha)
        return tokens, partial, counts, {c: replace(score, draft_seconds=0.0)
                                         for c, score in scorer.snapshot().items()}

    whole, _, whole_counts, whole_scores = scored(None)
    tokens, partial, counts, scores = scored(BUDGET)
    assert partial > 0
    assert tokens == whole and counts == whole_counts
    assert scores == whole_scores
    assert set(scores) == {name for name, _, _ in PLAN}      # every request scored
    assert sum(c.candidate_alpha.drafted for c in scores.values()) > 0
