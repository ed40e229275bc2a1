"""EAGLE and Medusa heads: the EAGLE head's cached step is its training forward; drafting from
the target's own features keeps greedy output identical and sampled output distributed as the
target's; a trained head is a model directory that loads like any draft."""

from __future__ import annotations

import json

import pytest
import torch
from head_builders import PARAMS, PROMPTS, assert_rows_joining_and_leaving_match, eagle_head, medusa_heads, mirror_head
from tiny_models import exact_joint, sample_and_compare

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.distill import DistillConfig, distill
from specpair.errors import SpecpairError
from specpair.heads import (build_eagle_head, build_medusa_heads, draft_vocabulary, is_head_dir,
                            save_head)
from specpair.models import load_model
from specpair.kv.static import StaticKVModel
from specpair.tokenizer_identity import fingerprint

@pytest.fixture(scope="module")
def trained_head_dir(tmp_path_factory, tiny_target):
    out = tmp_path_factory.mktemp("eagle")
    config = DistillConfig(out=str(out), method="eagle", steps=120, batch_size=4, seq_len=48,
                           lr=3e-3, seed=3, checkpoint_every=40, corpus_chars=120_000,
                           eval_prompts=4, eval_tokens=24, draft_vocab=200)
    summary = distill(config, teacher=tiny_target, progress=lambda *_: None)
    return out, summary


def test_cached_head_step_equals_its_training_forward(tiny_target):
    head = eagle_head(tiny_target).model
    torch.manual_seed(0)
    L, D = 11, head.config.hidden_size
    embeds, features = torch.randn(2, L, D), torch.randn(2, L, D)
    with torch.no_grad():
        whole = head(embeds, features)
    kv = StaticKVModel(head)
    kv.add_rows(2)
    # Row 0 in pieces of 4, 1 and 6 pairs; row 1 joins late and catches up in one piece.
    out0 = kv.extend_vectors([head.inputs(embeds[0, :4], features[0, :4]), features.new_zeros(0, D)])
    out1 = kv.extend_vectors([head.inputs(embeds[0, 4:5], features[0, 4:5]),
                              head.inputs(embeds[1], features[1])])
    out2 = kv.extend_vectors([head.inputs(embeds[0, 5:], features[0, 5:]), features.new_zeros(0, D)])
    norm = head.model.norm
    row0 = norm(torch.cat([out0[0, :4], out1[0, :1], out2[0, :6]]))
    torch.testing.assert_close(row0, whole[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(norm(out1[1, :L]), whole[1], rtol=1e-4, atol=1e-4)


def test_unrolled_training_steps_are_the_heads_own_drafting_steps(tiny_target):
    """EAGLE-3's training-time test: step d of `unroll` at index j is what the head computes
    while drafting the d-th token of a round after pair j, through the same cached step the
    drafter runs (pairs 0..j on real features, then its own predicted features)."""
    head = eagle_head(tiny_target, seed=2).model
    torch.manual_seed(1)
    L, D, depth = 12, head.config.hidden_size, 3
    embeds, features = torch.randn(1, L, D), torch.randn(1, L, D)
    with torch.no_grad():
        steps = head.unroll(embeds, features, depth)
        torch.testing.assert_close(steps[0], head(embeds[:, 1:], features[:, :-1]),
                                   rtol=1e-4, atol=1e-4)
        assert [s.shape[1] for s in steps] == [L - 1, L - 2, L - 3]
        for j in (0, 4, L - 1 - depth):
            kv = StaticKVModel(head)
            kv.add_rows(1)
            out = kv.extend_vectors([head.inputs(embeds[0, 1:j + 2], features[0, :j + 1])])
            g = head.model.norm(out[0, j])
            torch.testing.assert_close(g, steps[0][0, j], rtol=1e-4, atol=1e-4)
            for d in range(2, depth + 1):
                pair = head.inputs(embeds[0, j + d:j + d + 1], g[None])
                g = head.model.norm(kv.extend_vectors([pair])[0, 0])
                torch.testing.assert_close(g, steps[d - 1][0, j], rtol=1e-4, atol=1e-4)
    with pytest.raises(SpecpairError, match="cannot be unrolled"):
        head.unroll(embeds[:, :3], features[:, :3], 3)


def test_training_time_test_adds_the_later_steps_loss(tiny_target):
    from specpair.distill import eagle_loss

    head = eagle_head(tiny_target, seed=2).model
    torch.manual_seed(1)
    embeds, features = torch.randn(2, 10, head.config.hidden_size), torch.randn(2, 10, head.config.hidden_size)
    losses = []
    for depth in (1, 2):
        torch.manual_seed(5)                       # the same feature noise for both
        losses.append(eagle_loss(head, embeds, features, depth))
    assert losses[1] > losses[0] + 1e-3
    head.zero_grad()
    losses[1].backward()
    assert head.fc.weight.grad is not None and bool(head.fc.weight.grad.abs().sum() > 0)


def test_an_unrolled_eagle_run_trains_and_resumes_exactly(tmp_path, tiny_target):
    quiet = lambda *_: None  # noqa: E731

    def config(out):
        return DistillConfig(out=str(out), method="eagle", steps=30, batch_size=2, seq_len=24,
                             lr=3e-3, seed=7, checkpoint_every=8, corpus_chars=40_000,
                             eval_prompts=0, draft_vocab=150, ttt_depth=3)

    full = distill(config(tmp_path / "a"), teacher=tiny_target, progress=quiet)
    assert full["config"]["ttt_depth"] == 3 and full["loss_first10"] > full["loss_last10"]
    distill(config(tmp_path / "b"), teacher=tiny_target, progress=quiet, stop_after=17)
    assert distill(config(tmp_path / "b"), teacher=tiny_target, progress=quiet)["loss_last10"] \
        == full["loss_last10"]
    with pytest.raises(SpecpairError, match="ttt_depth"):
        DistillConfig(out=str(tmp_path), method="medusa", ttt_depth=2)
    with pytest.raises(SpecpairError, match="ttt_depth"):
        DistillConfig(out=str(tmp_path), method="eagle", ttt_depth=0)


def test_verification_hands_over_the_targets_own_features(tiny_target):
    ids = tiny_target.tokenizer("def foo(x):\n    return x + 1", add_special_tokens=False)["input_ids"]
    kv = StaticKVModel(tiny_target.model)
    kv.add_rows(1)
    _, first = kv.extend([ids[:5]], hidden=True)
    _, rest = kv.extend([ids[5:]], hidden=True)
    with torch.no_grad():
        expected = tiny_target.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    torch.testing.assert_close(torch.cat([first[0], rest[0]]), expected, rtol=1e-4, atol=1e-4)


def test_trained_medusa_heads_are_a_draft_directory(tmp_path, tiny_target):
    config = DistillConfig(out=str(tmp_path / "m"), method="medusa", medusa_heads=3, steps=100,
                           batch_size=4, seq_len=48, lr=3e-3, seed=3, checkpoint_every=20,
                           corpus_chars=120_000, eval_prompts=2, eval_tokens=16, draft_vocab=0)
    summary = distill(config, teacher=tiny_target, progress=lambda *_: None)
    assert summary["method"] == "medusa"
    assert summary["loss_last10"] < 0.9 * summary["loss_first10"], summary
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["medusa_num_heads"] == 3
    from safetensors.torch import load_file
    names = set(load_file(str(tmp_path / "m" / "model.safetensors")))
    assert {f"blocks.{m}.layers.0.weight" for m in range(3)} | {"lm_head.weight", "d2t"} == names
    heads = load_model(str(tmp_path / "m"), device="cpu")
    assert heads.model.num_heads == 3 and len(heads.model.draft_token_ids) == tiny_target.embedding_rows


@pytest.mark.parametrize("k", [1, 3, 5])
def test_eagle_greedy_identity_batched_and_joining(one_layer_target, reference, k):
    engine = SpeculativeEngine(one_layer_target, draft=mirror_head(one_layer_target, vocab_every=2),
                               speculation=SpeculationConfig(k=k, dynamic_k=False, fallback_threshold=0))
    results = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == reference
    drafted = sum(r.stats.num_draft_tokens for r in results)
    accepted = sum(r.stats.num_accepted_tokens for r in results)
    assert 0 < accepted < drafted          # both paths: kept drafts and rejected ones
    assert_rows_joining_and_leaving_match(engine, reference)


@pytest.mark.parametrize("method,width", [("eagle", 1), ("medusa", 1), ("eagle", 3)])
def test_head_sampling_follows_the_target_distribution(one_layer_target, smooth_target, method, width):
    """Tokens 1-3 of sampled replies against the target's exact joint distribution. Token 1 comes
    from the target alone (no features yet); tokens 2-3 from one round of two head drafts whose q
    lives on half the vocabulary (zero elsewhere): the sampler must still be exact. (Medusa runs
    on the smoother target with random heads: on the chaotic one its top-3 never meets the
    target's, and nothing would be accepted.) Width 3: a token tree, two more candidates per
    position drawn from q, verified by the multi-candidate rule (test_engine_tree.py)."""
    if method == "eagle":
        tiny_target, head = one_layer_target, mirror_head(one_layer_target, vocab_every=2)
    else:
        tiny_target, head = smooth_target, medusa_heads(smooth_target, vocab_every=2, scramble=0.3)
    engine = SpeculativeEngine(tiny_target, draft=head,
                               speculation=SpeculationConfig(k=2, dynamic_k=False, fallback_threshold=0,
                                                             batch_size_threshold=100_000,
                                                             tree_width=width))
    prompt = engine.encode("def foo(x):")
    top_k, temperature, n = 3, 1.5, 4000
    joint = exact_joint(tiny_target.model, prompt, temperature=temperature, top_k=top_k)
    seqs = sample_and_compare(engine, prompt, joint, temperature=temperature, top_k=top_k,
                              max_new_tokens=4, n=n)
    assert sum(s.stats.num_accepted_tokens for s in seqs) > 0
    assert sum(s.stats.num_draft_tokens - s.stats.num_accepted_tokens for s in seqs) > 0


@pytest.mark.parametrize("k", [2, 5])
def test_medusa_greedy_identity_and_partial_acceptance(smooth_target, k):
    reference = SpeculativeEngine(smooth_target, speculation=SpeculationConfig(enabled=False))
    expected = [reference.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    engine = SpeculativeEngine(smooth_target, draft=medusa_heads(smooth_target), speculation=SpeculationConfig(
        k=k, dynamic_k=False, fallback_threshold=0))
    results = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == expected
    accepted = sum(r.stats.num_accepted_tokens for r in results)
    assert 0 < accepted < sum(r.stats.num_draft_tokens for r in results)
    # Never more drafts a round than heads (k=5 asks for more than the 3 heads have).
    assert all(len(r.stats.num_draft_tokens_per_pos) <= 3 for r in results)


def test_medusa_drafts_from_the_feature_before_the_last_token(tiny_target):
    heads = medusa_heads(tiny_target, heads=2, scramble=0.2)   # not the identity: no position confusion
    engine = SpeculativeEngine(tiny_target, draft=heads, speculation=SpeculationConfig(
        k=2, dynamic_k=False, fallback_threshold=0))
    batch = engine.new_batch()
    seq = batch.add(engine.encode(PROMPTS[0]), GenerationParams(max_new_tokens=8))
    batch.step()            # the target's first pass: features observed, one token committed
    from specpair.drafters import RowSampling
    greedy = RowSampling(temperature=torch.zeros(1), top_k=torch.zeros(1, dtype=torch.long),
                         top_p=torch.ones(1), generators=[None])
    proposal = batch.drafter.propose([seq.tokens], [2], greedy)
    with torch.no_grad():
        feature = tiny_target.model.model(input_ids=torch.tensor([seq.tokens])).last_hidden_state[0, -2]
        expected = heads.model.lm_head(heads.model(feature)).argmax(-1)
    assert proposal.num.tolist() == [2]
    assert proposal.tokens[0].tolist() == expected.tolist()


def test_trained_eagle_head_is_a_draft_directory(tiny_target, trained_head_dir):
    out, summary = trained_head_dir
    assert summary["method"] == "eagle"
    assert summary["loss_last10"] < 0.7 * summary["loss_first10"], summary
    # Acceptance is measured and reported (the tiny random target is too chaotic for a head to
    # learn in seconds; SmolLM2's figures are in docs/measurements/).
    assert summary["acceptance_after"] is not None
    assert is_head_dir(out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 200
    head = load_model(str(out), device="cpu")
    # The release fingerprints it like any draft: the target's tokenizer, the target's rows.
    assert fingerprint(head.tokenizer, embedding_rows=head.embedding_rows) == \
        fingerprint(tiny_target.tokenizer, embedding_rows=tiny_target.embedding_rows)
    ids = head.model.draft_token_ids
    assert len(ids) == 200 and bool((ids[1:] > ids[:-1]).all())
    torch.testing.assert_close(head.model.lm_head.weight, tiny_target.model.lm_head.weight[ids])


def test_eagle_run_is_reproducible_and_resumes_exactly(tmp_path, tiny_target):
    quiet = lambda *_: None  # noqa: E731

    def config(out):
        return DistillConfig(out=str(out), method="eagle", steps=12, batch_size=2, seq_len=32,
                             lr=3e-3, seed=7, checkpoint_every=4, corpus_chars=60_000,
                             eval_prompts=0, draft_vocab=150)

    full = distill(config(tmp_path / "a"), teacher=tiny_target, progress=quiet)
    assert distill(config(tmp_path / "b"), teacher=tiny_target, progress=quiet,
                   stop_after=9) == {"stopped_at": 9}
    resumed = distill(config(tmp_path / "b"), teacher=tiny_target, progress=quiet)
    assert resumed["loss_last10"] == full["loss_last10"]
    a = load_model(str(tmp_path / "a"), device="cpu").model.state_dict()
    b = load_model(str(tmp_path / "b"), device="cpu").model.state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_bad_heads_and_settings_are_refused(tmp_path, tiny_target):
    with pytest.raises(SpecpairError, match="method"):
        DistillConfig(out=str(tmp_path), method="medusa-ish")
    with pytest.raises(SpecpairError, match="at least one head"):
        build_medusa_heads(tiny_target.model, torch.arange(10), 0)
    with pytest.raises(SpecpairError, match="increasing"):
        build_eagle_head(tiny_target.model, torch.tensor([5, 3, 9]))
    head = eagle_head(tiny_target)
    with pytest.raises(SpecpairError, match="static"):
        SpeculativeEngine(tiny_target, draft=head, kv="dynamic")
    save_head(head.model, tmp_path / "h", tiny_target.tokenizer, {"target": "tiny"})
    (tmp_path / "h" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SpecpairError, match="weights"):
        load_model(str(tmp_path / "h"), device="cpu")


def test_draft_vocabulary_takes_the_most_frequent_tokens():
    ids = torch.tensor([5, 5, 5, 2, 2, 9, 7, 7, 7, 7])
    assert draft_vocabulary([ids], 2, always=[]).tolist() == [5, 7]
    assert draft_vocabulary([ids], 3, always=[0]).tolist() == [0, 5, 7]
    assert draft_vocabulary([ids], 99, always=[]).tolist() == [2, 5, 7, 9]
    # A short sample (the target's predictions) weighs as much as the whole corpus.
    assert draft_vocabulary([ids, torch.tensor([3, 3])], 2, always=[]).tolist() == [3, 7]


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_the_gate_measures_a_head_like_any_draft(tmp_path, tiny_target, tiny_pair_dirs, method):
    from specpair.gate import run_gate

    head = eagle_head(tiny_target) if method == "eagle" else medusa_heads(tiny_target)
    save_head(head.model, tmp_path / "head", tiny_target.tokenizer, {"target": "tiny"})
    release = {"pair": "tiny-head", "target": {"source": tiny_pair_dirs["target"]},
               "draft": {"source": str(tmp_path / "head")},
               "speculation": {"k": 3, "dynamicK": False},
               "gating": {"prompts": [{"prompt": p, "category": "code"} for p in PROMPTS[:3]],
                          "maxNewTokens": 12, "chat": False,
                          "thresholds": {"requireGreedyIdentity": True}}}
    verdict, golden = run_gate(release, device="cpu", progress=lambda *_: None, k_sweep=[1],
                               batch_sizes=[1])
    assert verdict["tokenizer"]["compatible"], verdict["tokenizer"]
    assert verdict["greedyIdentity"] == 1.0 and verdict["passed"], verdict["reasons"]
    assert len(golden) == 3 and all(g["identical"] for g in golden)


def test_a_once_per_round_draft_is_charged_once_per_round():
    """Medusa drafts a whole round in one pass: the cost model must not charge it k times."""
    from specpair.costs import CostModel

    costs = {"target_step": 1.0, "draft_step": 0.2, "verify": {1: 1.1, 3: 1.2}}
    per_token = CostModel.from_seconds({**costs, "draft_per_token": True})
    per_round = CostModel.from_seconds({**costs, "draft_per_token": False})
    assert per_token.round_cost(3) == pytest.approx(3 * 0.2 + 1.2)
    assert per_round.round_cost(3) == pytest.approx(0.2 + 1.2)
    assert per_round.round_cost(0) == pytest.approx(1.1)    # no drafts, no draft pass


def test_a_heads_round_cost_is_charged_once_a_round_beside_its_draft_steps():
    """An EAGLE round costs its catch-up and first draft beyond its draft steps (about 2 ms on an
    H100, docs/gpu.md): charged once a drafting round, never when nothing is drafted."""
    from specpair.costs import CostModel

    costs = {"target_step": 1.0, "draft_step": 0.2, "verify": {1: 1.1, 3: 1.2},
             "draft_round": 0.5}
    model = CostModel.from_seconds(costs)
    assert model.round_cost(3) == pytest.approx(3 * 0.2 + 0.5 + 1.2)
    assert model.round_cost(1) == pytest.approx(0.2 + 0.5 + 1.1)
    assert model.round_cost(0) == pytest.approx(1.1)
    assert CostModel.from_seconds({**costs, "draft_round": 0.0}).round_cost(3) == pytest.approx(1.8)


def test_calibrating_an_eagle_engine_measures_its_round_beside_its_step(tiny_target):
    """The cost model's figures for a head come from running it: its drafting step and a whole
    round of one draft (catch-up, first logits, choice), whose excess over the step is charged a
    round; generation afterwards is unchanged (the timing rows are the drafter's own batch)."""
    engine = SpeculativeEngine(tiny_target, draft=eagle_head(tiny_target),
                               speculation=SpeculationConfig(k=3, k_max=3, dynamic_k=True))
    before = engine.generate(PROMPTS[:2], PARAMS)
    costs = engine.apply_k_policy("cost")
    assert costs["draft_step"] > 0 and costs["draft_round"] >= 0
    assert engine.cost_model.draft_round == pytest.approx(costs["draft_round"] / costs["target_step"])
    round_of_one = engine.drafter.timing_round(12)
    for _ in range(3):
        round_of_one()
    engine.cost_model = None
    assert [r.token_ids for r in engine.generate(PROMPTS[:2], PARAMS)] == [r.token_ids for r in before]
