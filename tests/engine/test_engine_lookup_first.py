"""Lookup first, then the head (drafters.LookupFirstDrafter): a row whose recent tokens occurred
before copies what followed them, the others ask the head; either way the head's state follows
every committed token. Greedy output stays identical to target-only, chains and trees, rows
joining and leaving; sampled output keeps the target's exact distribution with copied rows and
head rows side by side in one batch."""

from __future__ import annotations

import pytest
import torch
from head_builders import PARAMS, PROMPTS, assert_rows_joining_and_leaving_match, mirror_head
from tiny_models import exact_joint, sample_and_compare

from specpair.config import SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import LookupFirstDrafter, NgramDrafter
from specpair.errors import SpecpairError
from specpair.rejection_sampler import verify_tree


def test_the_lookup_tells_how_long_a_match_it_found():
    ngram = NgramDrafter()
    assert ngram.match([1, 2, 3, 9, 4, 1, 2, 3], 2) == (3, [9, 4])
    assert ngram.match([7, 5, 8, 6, 5], 3) == (1, [8, 6, 5])
    assert ngram.match([1, 2, 3], 2) == (0, [])
    assert ngram.lookup([1, 2, 3, 9, 4, 1, 2, 3], 2) == [9, 4]


def _engine(target, min_match, width=1, **spec):
    settings = dict(k=3, dynamic_k=False, fallback_threshold=0, tree_width=width,
                    lookup_min_match=min_match) | spec
    return SpeculativeEngine(target, draft=mirror_head(target, vocab_every=2),
                             speculation=SpeculationConfig(**settings))


@pytest.mark.parametrize("min_match,width", [(1, 1), (2, 2), (1, 3)])
def test_greedy_output_is_the_targets_with_both_drafters_at_work(one_layer_target, reference,
                                                                  min_match, width):
    engine = _engine(one_layer_target, min_match, width)
    assert isinstance(engine.drafter, LookupFirstDrafter)
    results = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == reference
    rounds = engine.drafter.describe()["rounds"]
    assert rounds["copied"] > 0 and rounds["head"] > 0, rounds
    # Each request's stats say which of its rounds copied (what the bench's bound prices apart).
    assert sum((r.stats.num_copied_draft_tokens_per_pos or [0])[0] for r in results) == rounds["copied"]
    assert_rows_joining_and_leaving_match(engine, reference)


def test_a_copied_row_in_a_tree_batch_feeds_its_chain_alone(one_layer_target, reference, monkeypatch):
    """In a round where some rows copy and others ask the head for a tree, the copied rows'
    repeated siblings are never kept, so they are not fed: a copied row's tokens form a plain
    chain (no token has a parent) while a head row's depths each carry their siblings."""
    from specpair.kv.static import StaticKVModel
    from specpair.paged_cache import PagedKVModel

    rounds, trees = [], []
    propose = LookupFirstDrafter.propose

    def recording_propose(self, *args, **kwargs):
        out = propose(self, *args, **kwargs)
        if out.siblings is not None:
            rounds.append((out.copied, out.num.tolist(), out.siblings.shape[2]))
        return out

    def recording(extend):      # the target's cache, contiguous or paged (trees run on both)
        def recording_extend(self, rows, *args, parents=None, **kwargs):
            if parents is not None:
                trees.append(parents)
            return extend(self, rows, *args, parents=parents, **kwargs)
        return recording_extend

    monkeypatch.setattr(LookupFirstDrafter, "propose", recording_propose)
    for cache in (StaticKVModel, PagedKVModel):
        monkeypatch.setattr(cache, "extend", recording(cache.extend))
    engine = _engine(one_layer_target, 1, 2)
    assert [r.token_ids for r in engine.generate(PROMPTS, PARAMS)] == reference
    assert len(rounds) == len(trees)
    mixed = 0
    for (copied, nums, S), parents in zip(rounds, trees):
        for i, row in enumerate(parents):
            branches = sum(1 for p in row if p >= 0)
            assert branches == (0 if copied and copied[i] else nums[i] * S), (copied, nums, parents)
        mixed += bool(copied and any(copied) and not all(copied))
    assert mixed > 0, "no round had copied rows beside head rows"


def test_copy_rounds_leave_the_head_where_drafting_every_round_would(one_layer_target):
    """Two heads on one script of rounds: one drafts every round, the other sits behind the
    lookup. Rounds play out as the lookup-first drafter's proposals are accepted by a scripted
    target (the longest prefix it continues with), both drafters are told the same outcome and
    handed the same features. Whenever the lookup-first drafter asks its head, both heads must
    propose the same tokens: copy rounds, a token or several at once, lost nothing."""
    from specpair.drafters import EagleDrafter, RowSampling

    target = one_layer_target
    vocab = len(target.tokenizer)
    head = mirror_head(target, vocab_every=2)
    plain = EagleDrafter(head, target.model, vocab_size=vocab)
    mixed = LookupFirstDrafter(NgramDrafter(), EagleDrafter(head, target.model, vocab_size=vocab), 1)
    torch.manual_seed(0)
    features = torch.randn(64, head.model.config.hidden_size)      # the target's, per position
    script = [5, 6, 7, 8, 5, 6, 7, 9, 10, 40, 41, 5, 6, 11, 12, 13, 14, 5, 6, 7, 8, 15, 16, 17,
              18, 19, 20, 21, 22, 23]
    greedy = RowSampling(temperature=torch.zeros(1), top_k=torch.zeros(1, dtype=torch.long),
                         top_p=torch.ones(1), generators=[None])
    for drafter in (plain, mixed):
        drafter.add_rows(1)
    seq, known, rounds = script[:4], 0, []
    while len(seq) < len(script) - 4:
        copied_before = mixed.rounds["copied"]
        ours, theirs = mixed.propose([seq], [3], greedy), plain.propose([seq], [3], greedy)
        n = int(ours.num[0])
        drafts = ours.tokens[0, :n].tolist()
        copied = mixed.rounds["copied"] > copied_before
        if n and not copied:
            assert drafts == theirs.tokens[0, :int(theirs.num[0])].tolist(), (seq, drafts)
        rest, a = script[len(seq):], 0
        while a < n and drafts[a] == rest[a]:
            a += 1
        rounds.append(("copy" if copied else "head" if n else "none", a))
        committed = len(seq)
        for drafter in (plain, mixed):
            drafter.accepted(0, committed, a)
            drafter.observe(0, known, features[known:committed + a])
        known, seq = committed + a, script[:committed + a + 1]
    assert any(kind == "copy" and a >= 2 for kind, a in rounds), rounds
    assert sum(kind == "head" for kind, _ in rounds) >= 3, rounds


def test_a_copy_takes_its_own_k_and_the_head_keeps_its_own(one_layer_target):
    """The engine grows a copy's k on runs (as for lookup alone) apart from the head's k, which
    its cost model keeps small: a copying row copies up to copy_ks, a head row drafts ks."""
    from specpair.drafters import EagleDrafter, RowSampling

    vocab = len(one_layer_target.tokenizer)
    head = EagleDrafter(mirror_head(one_layer_target, vocab_every=2), one_layer_target.model, vocab)
    drafter = LookupFirstDrafter(NgramDrafter(), head, 2)
    drafter.add_rows(2)
    features = torch.randn(9, head.head.config.hidden_size)
    repeating, fresh = [5, 6, 7, 8, 9, 10, 11, 5, 6], [20, 21, 22, 23, 24, 25, 26, 27, 28]
    for row in (0, 1):
        drafter.observe(row, 0, features[:8])
    greedy = RowSampling(temperature=torch.zeros(2), top_k=torch.zeros(2, dtype=torch.long),
                         top_p=torch.ones(2), generators=[None, None])
    out = drafter.propose([repeating, fresh], [1, 1], greedy, copy_ks=[5, 5])
    assert out.copied == [True, False]
    assert out.num.tolist() == [5, 1] and out.tokens[0].tolist() == [7, 8, 9, 10, 11]


@pytest.mark.slow
def test_sampled_output_keeps_the_targets_distribution(one_layer_target):
    """Tokens 1-3 of 4,000 sampled replies against the target's exact joint distribution. After
    the first token, rows whose last token occurs in the prompt copy (a point-mass q), the others
    draft from the head (q on half the vocabulary); at width 3 copied rows carry repeated
    siblings beside head rows with drawn ones."""
    for width in (1, 3):
        engine = _engine(one_layer_target, 1, width, k=2, batch_size_threshold=100_000)
        prompt = engine.encode("def foo(x): return foo(x) + x")
        joint = exact_joint(one_layer_target.model, prompt, temperature=1.5, top_k=3)
        seqs = sample_and_compare(engine, prompt, joint, temperature=1.5, top_k=3,
                                  max_new_tokens=4, n=4000)
        rounds = engine.drafter.rounds
        assert rounds["copied"] > 0 and rounds["head"] > 0, (width, rounds)
        assert sum(s.stats.num_accepted_tokens for s in seqs) > 0


def test_repeated_siblings_of_a_point_mass_keep_the_tree_sampler_exact():
    """A copied row in a tree: q is a point mass on its token x and its siblings repeat x. The
    first emitted token must follow p (chi-square), x accepted with probability p(x)."""
    import numpy as np
    from scipy.stats import chisquare

    V, rows, x = 5, 6000, 2
    p = torch.tensor([0.1, 0.2, 0.4, 0.3, 0.0])
    q = torch.zeros(V)
    q[x] = 1.0
    logits = torch.log(p.clamp_min(1e-30)).expand(rows, 2, V).clone()
    drafts = torch.full((rows, 1), x)
    accepted, branch, nxt = verify_tree(
        logits, logits[:, :1].unsqueeze(2).expand(rows, 1, 2, V), drafts,
        torch.full((rows, 1, 2), x), torch.ones(rows, dtype=torch.long), torch.ones(rows),
        torch.zeros(rows, dtype=torch.long), torch.ones(rows), q.expand(rows, 1, V),
        [torch.Generator().manual_seed(i) for i in range(rows)])
    assert all(b == -1 for b in branch)               # a repeat of a rejected token is never kept
    first = [x if a else n for a, n in zip(accepted, nxt)]
    counts = np.bincount(first, minlength=V)
    assert counts[4] == 0
    expected = p[:4].double().numpy()
    assert chisquare(counts[:4], f_exp=expected / expected.sum() * counts.sum()).pvalue > 1e-3


def test_bad_settings_are_refused_or_said(one_layer_target, tiny_target, tiny_draft):
    for bad in (-1, 4):
        with pytest.raises(SpecpairError, match="lookup_min_match"):
            SpeculationConfig(lookup_min_match=bad)
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft,
                               speculation=SpeculationConfig(lookup_min_match=2))
    assert any("lookup_min_match applies to drafting heads" in w for w in engine.warnings)
    engine = SpeculativeEngine(tiny_target, drafter=NgramDrafter(),
                               speculation=SpeculationConfig(lookup_min_match=2))
    assert any("lookup_min_match applies to drafting heads" in w for w in engine.warnings)

