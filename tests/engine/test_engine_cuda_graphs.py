"""The fixed step under the CUDA graphs the engine records itself (graphs.CapturedStep), on
a CUDA device: replaying a recorded graph gives bitwise the logits of the same compiled layers run
call by call, over a generation where rows join and leave, drafts are rejected and a row crosses
into the next capacity bucket (each new cache records its own graphs, nothing recompiles); and an
engine's greedy speculation equals its target-only decoding bitwise in bf16; a draft model's
steps replay graphs of its own, an EAGLE head's drafting step and catch-up theirs, and Medusa's
round its own. Skipped without a GPU; `bash
bench/gpu_measure.sh steps` and `heads` run it on the lent one."""

from __future__ import annotations

import random

import pytest
import torch

from specpair.kv import buckets, graphs
from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import NgramDrafter
from specpair.kv.static import StaticKVModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

W = 8


def _cuda_model(tokenizer, seed: int):
    from tiny_models import make_model
    loaded = make_model(tokenizer, seed=seed, layers=2, dtype=torch.bfloat16, init_std=0.05)
    loaded.model.to("cuda")
    loaded.device = torch.device("cuda")
    return loaded


def test_replayed_graphs_equal_the_compiled_step_over_a_generation(tiny_tokenizer, monkeypatch):
    import torch._dynamo

    model = _cuda_model(tiny_tokenizer, seed=6).model
    torch._dynamo.reset()
    captured = StaticKVModel(model, compile="on", token_bucket=W)
    monkeypatch.setenv("SPECPAIR_CUDA_GRAPHS", "off")
    called = StaticKVModel(model, compile="on", token_bucket=W)
    monkeypatch.delenv("SPECPAIR_CUDA_GRAPHS")
    assert captured.captures_graphs and not called.captures_graphs
    report = captured.warm_up(max_rows=4, max_positions=buckets.INITIAL_POSITIONS)
    # Six buckets and a prompt's step: one row in a cache of one and of two, two rows
    # (_warm_prefill).
    assert len(report["buckets"]) == 6 and report["graphs"] == 9
    assert "capture_error" not in report
    rng = random.Random(0)

    def both(op, *args, **kwargs):
        out = [getattr(kv, op)(*args, **kwargs) for kv in (captured, called)]
        if op == "extend":
            assert torch.equal(out[0], out[1]), op

    with torch._dynamo.config.patch(error_on_recompile=True):
        both("add_rows", 1)
        both("extend", [[rng.randrange(3, 300) for _ in range(30)]])
        for step in range(40):
            if step == 5:
                both("add_rows", 1)
                both("extend", [[7], [rng.randrange(3, 300) for _ in range(20)]])
            if step == 20:
                both("select", [1])
            if step == 25:
                both("add_rows", 1)
                both("extend", [[7], [rng.randrange(3, 300) for _ in range(3)]])
            k = rng.randrange(0, 5)
            feed = [[rng.randrange(3, 300) for _ in range(1 + k)] for _ in captured.lengths]
            both("extend", feed, last=1 + k)
            keep = [n - rng.randrange(0, len(f)) for n, f in zip(captured.lengths, feed)]
            for i, n in enumerate(keep):
                both("rollback", i, n)
            if step == 30:
                both("extend", [[5] * 8 for _ in captured.lengths])
                both("extend", [[5] * 200 if i == 0 else [5] for i in range(len(captured.lengths))])
    assert captured.capacity[1] == 512
    assert captured.capture_error is None
    # Rows 1 -> 2 -> 1 -> 2 and capacity 256 -> 512: each new cache recorded its own graph.
    assert captured.recorded["graphs"] >= 3


def test_greedy_speculation_equals_target_only_bitwise_under_graphs(tiny_tokenizer):
    target = _cuda_model(tiny_tokenizer, seed=1)
    config = SpeculationConfig(k=3, k_max=3, fallback_threshold=0, batch_size_threshold=4)
    engine = SpeculativeEngine(target, drafter=NgramDrafter(device="cuda"), speculation=config)
    assert engine.describe_step()["compiled"]
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "import json\n\nimport json",
               "for i in range(10):\n    print(i)\nfor i in range(10):"]
    params = GenerationParams(max_new_tokens=40)
    spec = engine.generate(prompts, params)
    plain = engine.generate(prompts, [GenerationParams(max_new_tokens=40, speculation_k=0)] * 3)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.stats.num_draft_tokens for r in spec) > 0
    sampled = engine.generate(prompts, GenerationParams(max_new_tokens=20, temperature=0.8, seed=3))
    assert all(r.finish_reason in ("length", "stop") for r in sampled)


def test_a_draft_models_steps_replay_its_own_graphs_and_speculation_equals_target_only(
        tiny_tokenizer, monkeypatch):
    """A draft model on CUDA (compiled, bf16): warm-up records its fixed step (token bucket 1) at
    every bucket (captures["draft"]) beside the target's; a generation replays graphs of both
    models, with drafts partly rejected (the draft is the target's weights plus noise, one layer
    fewer), and greedy speculation equals target-only decoding bitwise."""
    from collections import Counter

    from tiny_models import make_model, perturbed_copy

    target = make_model(tiny_tokenizer, seed=21, layers=2, dtype=torch.bfloat16, init_std=0.05)
    draft = perturbed_copy(target, seed=22, noise=0.3, layers=1)
    for loaded in (target, draft):
        loaded.model.to("cuda")
        loaded.device = torch.device("cuda")
    replays = Counter()
    made, call = graphs.CapturedStep.__init__, graphs.CapturedStep.__call__

    def counting_init(self, runner, *args, **kwargs):
        made(self, runner, *args, **kwargs)
        self.model_id = id(runner.model)

    def counting_call(self, host):
        replays[self.model_id] += 1
        return call(self, host)

    monkeypatch.setattr(graphs.CapturedStep, "__init__", counting_init)
    monkeypatch.setattr(graphs.CapturedStep, "__call__", counting_call)
    config = SpeculationConfig(k=3, k_max=3, dynamic_k=False, fallback_threshold=0,
                               batch_size_threshold=4)
    engine = SpeculativeEngine(target, draft=draft, speculation=config)
    report = engine.captures["draft"]
    assert report["token_bucket"] == 1 and report["graphs"] >= len(report["buckets"]) > 0
    assert "capture_error" not in report and "capture_error" not in engine.captures["target"]
    replays.clear()
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "import json\n\nimport json",
               "for i in range(10):\n    print(i)\nfor i in range(10):"]
    spec = engine.generate(prompts, GenerationParams(max_new_tokens=32))
    assert replays[id(draft.model)] > 0 and replays[id(target.model)] > 0
    drafted = sum(r.stats.num_draft_tokens for r in spec)
    accepted = sum(r.stats.num_accepted_tokens for r in spec)
    assert 0 < accepted < drafted
    plain = engine.generate(prompts, [GenerationParams(max_new_tokens=32, speculation_k=0)] * 3)
    assert [r.token_ids for r in plain] == [r.token_ids for r in spec]


def _cuda_head_engine(tokenizer, build_head) -> SpeculativeEngine:
    """A compiled engine on CUDA in bf16 with the head `build_head(target)` makes, k 3, trees
    two wide, speculation up to 4 rows (warmed at start-up: captures["head"])."""
    target = _cuda_model(tokenizer, seed=11)
    head = build_head(target)
    head.model.to(device="cuda", dtype=torch.bfloat16)
    head.device = torch.device("cuda")
    config = SpeculationConfig(k=3, k_max=3, dynamic_k=False, fallback_threshold=0,
                               batch_size_threshold=4, tree_width=2)
    return SpeculativeEngine(target, draft=head, speculation=config)


def test_an_eagle_heads_drafting_step_replays_one_graph_a_token(tiny_tokenizer):
    """An EAGLE head on CUDA (compiled, bf16): warm-up records its drafting step at every bucket
    (captures["head"]); a batch's rounds replay it (drafters.EagleDraftStep: one graph a greedy
    draft token), proposing bitwise what the same head's vector steps propose token by token,
    and catch up through a recorded step too (drafters.EagleCatchUp); greedy speculation equals
    target-only decoding."""
    from head_builders import mirror_head

    from specpair.drafters import EagleDraftStep

    engine = _cuda_head_engine(tiny_tokenizer, lambda target: mirror_head(target, vocab_every=2))
    report = engine.captures["head"]
    # Each (rows, capacity) bucket: its drafting step, and its catch-up at each width warm-up
    # feeds (1, 2, 4 and 8 pairs a row; wider ones run as vector steps, unrecorded).
    assert report["graphs"] == 5 * len(report["buckets"]) > 0 and "capture_error" not in report
    prompts = ["def add(a, b):\n    return a + b\n", "import json\n\nimport json", "for i in x:"]
    params = GenerationParams(max_new_tokens=24)
    runs = []
    for in_fixed_steps in (True, False):
        batch = engine.new_batch()
        batch.drafter.drafts_in_fixed_steps = in_fixed_steps
        proposals, propose = [], batch.drafter.propose
        batch.drafter.propose = lambda *a, **kw: proposals.append(propose(*a, **kw)) or proposals[-1]
        # The drafting steps as made: a finished batch's cache goes back to the shelf with its
        # graphs, so they are gone from the drafter's cache by the end.
        made, draft_step = [], batch.drafter.draft_step
        batch.drafter.draft_step = lambda *a, **kw: made.append(draft_step(*a, **kw)) or made[-1]
        caught, catch_up_step = [], batch.drafter.catch_up_step
        batch.drafter.catch_up_step = lambda *a: caught.append(catch_up_step(*a)) or caught[-1]
        rows = [batch.add(engine.encode(p), params) for p in prompts]
        while batch.active:
            batch.step()
        runs.append((proposals, [r.generated for r in rows], batch.drafter.kv, made, caught))
    (got, replies, kv, steps, catch_ups), (expected, expected_replies, _, _, _) = runs
    assert replies == expected_replies and len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a.num, b.num)
        for i, n in enumerate(b.num.tolist()):
            assert torch.equal(a.tokens[i, :n], b.tokens[i, :n])
            assert torch.equal(a.siblings[i, :n], b.siblings[i, :n])
    assert steps and all(isinstance(s, EagleDraftStep) and s.graph is not None for s in steps)
    assert kv.capture_error is None
    # The rounds' catch-ups replayed their own graphs, bitwise what the step computes called
    # directly (its cache writes are the same writes again), called as the engine calls it:
    # without autograd (with it, the compiled layer compiles a training graph of its own).
    assert catch_ups and all(s.graph is not None for s in catch_ups)
    with torch.no_grad():
        for step in {id(s): s for s in catch_ups}.values():
            replayed, called = step.graph.replay().clone(), step.step()
            rows = (replayed != called).any(-1).nonzero().flatten().tolist()
            assert not rows, (step.width, rows, (replayed.float() - called.float()).abs().max())
    plain = engine.generate(prompts, [GenerationParams(max_new_tokens=24, speculation_k=0)] * 3)
    assert [r.token_ids for r in plain] == replies


def test_medusa_heads_round_replays_one_graph_bitwise(tiny_tokenizer):
    """Medusa's heads on CUDA (compiled, bf16): warm-up records their step at every rows bucket up
    to the speculation threshold (captures["head"]); each recorded round replays bitwise what the
    same compiled step computes called directly, and greedy speculation with the heads equals
    target-only decoding."""
    from head_builders import medusa_heads

    engine = _cuda_head_engine(tiny_tokenizer,
                               lambda target: medusa_heads(target, vocab_every=2, scramble=0.05))
    report = engine.captures["head"]
    assert report["rows"] == [1, 2, 4] and report["graphs"] == 3
    graphs = engine.drafter.graphs
    assert graphs.capture_error is None
    gen = torch.Generator(device="cuda").manual_seed(0)
    for (rows, width), step in graphs.steps.items():
        assert step.graph is not None
        step.features.copy_(torch.randn(step.features.shape, generator=gen, device="cuda"))
        replayed = [t.clone() for t in step(graphs)]
        called = step.step()
        assert all(torch.equal(a, b) for a, b in zip(replayed, called)), (rows, width)
    prompts = ["def add(a, b):\n    return a + b\n", "import json\n\nimport json", "for i in x:"]
    spec = engine.generate(prompts, GenerationParams(max_new_tokens=24))
    plain = engine.generate(prompts, [GenerationParams(max_new_tokens=24, speculation_k=0)] * 3)
    assert [r.token_ids for r in plain] == [r.token_ids for r in spec]
    assert sum(r.stats.num_draft_tokens for r in spec) > 0
