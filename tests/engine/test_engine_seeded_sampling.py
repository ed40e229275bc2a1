"""Seeded sampling draws each token by (seed, position) (rejection_sampler.keyed_sample): a seeded
reply is the target-only reply for its seed, token for token, alone or beside other requests,
whatever drafts it (n-gram lookup, a draft model, an EAGLE tree) and wherever a draft is rejected;
over seeds it follows the target's distribution. Unseeded rows keep the rejection sampler."""

from __future__ import annotations

import numpy as np
import pytest
from head_builders import mirror_head
from scipy.stats import chisquare
from tiny_models import exact_joint, sample_and_compare

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import NgramDrafter
from specpair.errors import SpecpairError

PROMPT = "x = [1, 2, 3]; y = [1, 2, 3]; z = [1, 2,"
SEEDS = (1, 2, 3)
# Rows beside the seeded one: another seed, an unseeded sampled row, a greedy row, a row with
# speculation off; they join before and after it, and one is cancelled while it runs.
NEIGHBOURS = [("import os\nimport sys\n", GenerationParams(max_new_tokens=30, temperature=1.0)),
              ("def foo(x):", GenerationParams(max_new_tokens=12)),
              ("class Path:", GenerationParams(max_new_tokens=40, temperature=1.2, top_p=0.9, seed=9)),
              ("hello world", GenerationParams(max_new_tokens=25, temperature=0.8, seed=1,
                                               speculation_k=0))]

# name: (target fixture, drafter, speculation, the seeded request's settings)
CASES = {
    # The server's defaults: dynamic k, the acceptance fallback, speculation off past 8 rows.
    "ngram": ("smooth_target", "ngram", SpeculationConfig(), dict(temperature=0.7, top_k=2)),
    # Past 3 rows nobody drafts: under load the row's rounds switch between drafting and not.
    "ngram, off past 3 rows": ("smooth_target", "ngram", SpeculationConfig(batch_size_threshold=3),
                               dict(temperature=1.0, top_k=3)),
    "draft model": ("tiny_target", "tiny_draft", SpeculationConfig(), dict(temperature=0.9, top_p=0.95)),
    "draft model, k=4": ("tiny_target", "tiny_draft",
                         SpeculationConfig(k=4, dynamic_k=False, fallback_threshold=0),
                         dict(temperature=0.8)),
    "eagle tree": ("one_layer_target", "mirror_head",
                   SpeculationConfig(k=3, dynamic_k=False, fallback_threshold=0, tree_width=2),
                   dict(temperature=0.8, top_k=20)),
}


def _engine(request, case: str) -> tuple[SpeculativeEngine, SpeculativeEngine]:
    """(the speculative engine of a case, the target-only engine of its target)."""
    target_name, drafter, speculation, _ = CASES[case]
    target = request.getfixturevalue(target_name)
    if drafter == "ngram":
        engine = SpeculativeEngine(target, drafter=NgramDrafter(), speculation=speculation)
    elif drafter == "mirror_head":
        engine = SpeculativeEngine(target, draft=mirror_head(target, vocab_every=2), speculation=speculation)
    else:
        engine = SpeculativeEngine(target, draft=request.getfixturevalue(drafter), speculation=speculation)
    return engine, SpeculativeEngine(target, speculation=SpeculationConfig(enabled=False))


def _run(engine: SpeculativeEngine, params: GenerationParams, load: bool):
    """The seeded request's tokens and each of its rounds' (drafted, accepted), alone or under
    load (NEIGHBOURS)."""
    batch = engine.new_batch()
    neighbours = [batch.add(engine.encode(p), q) for p, q in NEIGHBOURS[:2]] if load else []
    for _ in range(2 if load else 0):
        batch.step()
    seq = batch.add(engine.encode(PROMPT), params)
    if load:
        neighbours += [batch.add(engine.encode(p), q) for p, q in NEIGHBOURS[2:]]
    rounds, steps = [], 0
    while batch.active:
        before = (seq.stats.num_draft_tokens, seq.stats.num_accepted_tokens)
        batch.step()
        steps += 1
        if load and steps == 3:
            batch.cancel(neighbours[0].request_id)
        drafted = seq.stats.num_draft_tokens - before[0]
        if drafted:
            rounds.append((drafted, seq.stats.num_accepted_tokens - before[1]))
    assert seq.finish_reason in ("length", "stop")
    return seq.generated, rounds


@pytest.mark.parametrize("case", list(CASES))
def test_a_seeded_reply_is_the_target_only_reply_alone_and_under_load(request, case):
    engine, target_only = _engine(request, case)
    settings = CASES[case][3]
    all_rounds, references = {"alone": [], "load": []}, set()
    for seed in SEEDS:
        params = GenerationParams(max_new_tokens=40, seed=seed, **settings)
        reference, no_rounds = _run(target_only, params, load=False)
        assert no_rounds == []
        references.add(tuple(reference))
        for how in ("alone", "load"):
            tokens, rounds = _run(engine, params, load=how == "load")
            assert tokens == reference, (case, seed, how)
            all_rounds[how] += rounds
    # The identity is not target-only decoding passing for speculation: drafts were kept and
    # drafts were rejected, alone and under load.
    for how, rounds in all_rounds.items():
        assert sum(a for _, a in rounds) > 0, (how, rounds)
        assert any(a < d for d, a in rounds), (how, rounds)
    assert len(references) == len(SEEDS)         # the seed decides the reply: not one fixed answer


def test_a_draft_rejected_at_any_position_leaves_the_reply_unchanged(request):
    """Fixed k = 4: over a few seeds the rounds reject at every draft position 0..3 (and keep
    all four), and every reply still equals target-only."""
    engine, target_only = _engine(request, "draft model, k=4")
    rejected_at, whole = set(), 0
    for seed in range(4, 10):
        params = GenerationParams(max_new_tokens=40, seed=seed, temperature=0.8)
        tokens, rounds = _run(engine, params, load=seed % 2 == 0)
        assert tokens == _run(target_only, params, load=False)[0], seed
        rejected_at |= {a for d, a in rounds if a < d}
        whole += sum(1 for d, a in rounds if a == d == 4)
    assert rejected_at == {0, 1, 2, 3}
    assert whole > 0


def test_seeded_ngram_speculation_follows_the_target_distribution(smooth_target):
    """Sequences of 3 tokens from seeded rows (seeds 0..n-1) against the target's exact joint
    distribution, with n-gram drafts (point masses) kept by the keyed rule. The prompt ends in
    13 tokens of the target's own greedy reply, which loops: lookup then drafts what the target
    is likely to sample, and a third of the drafts are kept."""
    engine = SpeculativeEngine(smooth_target, drafter=NgramDrafter(),
                               speculation=SpeculationConfig(k=3, dynamic_k=False, fallback_threshold=0,
                                                             batch_size_threshold=100_000))
    text = "Hello world, hello world, hello world, hello"
    greedy = engine.generate([text], GenerationParams(max_new_tokens=13), speculate=False)[0]
    prompt = engine.encode(text) + greedy.token_ids
    temperature, top_k = 1.0, 2
    joint = exact_joint(smooth_target.model, prompt, temperature=temperature, top_k=top_k, depth=3)
    seqs = sample_and_compare(engine, prompt, joint, temperature=temperature, top_k=top_k,
                              max_new_tokens=4, n=2000)
    assert sum(s.stats.num_accepted_tokens for s in seqs) > 0
    assert sum(s.stats.num_draft_tokens - s.stats.num_accepted_tokens for s in seqs) > 0


def test_unseeded_speculation_still_follows_the_target_distribution(tiny_target, tiny_draft):
    """Unseeded rows keep the rejection sampler (their own generators): two-token sequences
    against the target's exact joint distribution, and two runs that differ."""
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft,
                               speculation=SpeculationConfig(k=2, dynamic_k=False, fallback_threshold=0,
                                                             batch_size_threshold=100_000))
    prompt = engine.encode("def foo(x):")
    temperature, top_k, n = 1.5, 3, 3000
    joint = exact_joint(tiny_target.model, prompt, temperature=temperature, top_k=top_k, depth=2)
    params = GenerationParams(max_new_tokens=3, temperature=temperature, top_k=top_k)
    batch = engine.new_batch()
    seqs = [batch.add(prompt, params) for _ in range(n)]
    assert all(s.generator is not None for s in seqs)
    while batch.active:
        batch.step()
    keys = sorted(joint)
    counts = dict.fromkeys(keys, 0)
    for seq in seqs:
        counts[tuple(seq.generated[:2])] += 1       # outside the support: KeyError, a failure
    observed = np.array([counts[k] for k in keys])
    expected = np.array([joint[k] for k in keys]) * n
    assert chisquare(observed, f_exp=expected * observed.sum() / expected.sum()).pvalue > 1e-3
    assert sum(s.stats.num_accepted_tokens for s in seqs) > 0
    again = engine.generate(["def foo(x):"] * 8, GenerationParams(max_new_tokens=12, temperature=1.0))
    assert len({tuple(r.token_ids) for r in again}) > 1


def test_a_seed_outside_64_bits_is_refused():
    for seed in (-1, 2 ** 64):
        with pytest.raises(SpecpairError, match=r"seed must be in \[0, 2\*\*64\)"):
            GenerationParams(temperature=1.0, seed=seed)
    assert GenerationParams(temperature=1.0, seed=2 ** 64 - 1).seed == 2 ** 64 - 1


def test_the_largest_seed_draws_like_any_other(tiny_target):
    """Seeds past 2**63 (negative as int64 keys) reproduce too, and differ from their low bits."""
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    high = GenerationParams(max_new_tokens=16, temperature=1.0, seed=2 ** 64 - 1)
    low = GenerationParams(max_new_tokens=16, temperature=1.0, seed=2 ** 63 - 1)
    first, second, other = (engine.generate([PROMPT], p)[0].token_ids for p in (high, high, low))
    assert first == second and first != other
