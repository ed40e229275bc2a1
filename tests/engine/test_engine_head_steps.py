"""An EAGLE head's drafting step on a fixed-step cache (drafters.EagleDraftStep): one step over
every cache row a token, with no host read inside, proposes bitwise what the head's vector steps
token by token propose (the rows still drafting fed through extend_vectors), for chains and trees,
one row and eight, rows joining and leaving and drafts rejected, in float32 and bfloat16; compiled
with fullgraph=True and warmed at start-up, a generation with a head compiles nothing. Medusa's
heads as one step a round (drafters.MedusaDraftStep) the same."""

from __future__ import annotations

import pytest
import torch
from head_builders import PROMPTS, medusa_heads, mirror_head

from specpair.kv import fixed_step
from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import EagleDraftStep, MedusaDrafter, RowSampling

PARAMS = GenerationParams(max_new_tokens=14)


def _engine(target, head, width: int, **kwargs):
    return SpeculativeEngine(target, draft=head, speculation=SpeculationConfig(
        k=3, k_max=3, dynamic_k=False, fallback_threshold=0, tree_width=width), **kwargs)


def _recorded_batch(engine, rows: int, in_fixed_steps: bool, params: GenerationParams):
    """A batch's run, rows joining (the last of `rows` two steps late) and the second leaving the
    step after; -> every round's proposal and every row's reply."""
    batch = engine.new_batch()
    drafter = batch.drafter
    drafter.drafts_in_fixed_steps = in_fixed_steps
    proposals = []
    propose = drafter.propose

    def recorded(*args, **kwargs):
        proposals.append(propose(*args, **kwargs))
        return proposals[-1]
    drafter.propose = recorded
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(rows)]
    seqs = [batch.add(engine.encode(p), params) for p in prompts[:max(1, rows - 1)]]
    batch.step()
    batch.step()
    if rows > 1:
        seqs.append(batch.add(engine.encode(prompts[-1]), params))
        batch.step()
        batch.cancel(seqs[1].request_id)
    while batch.active:
        batch.step()
    return proposals, [s.generated for s in seqs]


def _assert_same_proposals(got, expected):
    """Equal where the verifier reads them: each row's first num[i] tokens, siblings and q."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a.num, b.num)
        for i, n in enumerate(b.num.tolist()):
            assert torch.equal(a.tokens[i, :n], b.tokens[i, :n])
            for x, y in ((a.siblings, b.siblings), (a.probs, b.probs)):
                assert (x is None) == (y is None)
                if x is not None:
                    assert torch.equal(x[i, :n], y[i, :n])


@pytest.mark.parametrize("width", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_drafting_step_proposes_what_token_by_token_steps_do(tiny_tokenizer, dtype, width,
                                                                  monkeypatch):
    """Greedy rounds at one row and at eight (one joining late, one leaving), drafts kept and
    rejected: the same proposals bitwise and the same replies. float32 takes the fixed step
    here only when made to (on the CPU it is the C layer's)."""
    from tiny_models import make_model
    if dtype == torch.float32:
        monkeypatch.setattr(fixed_step, "fixed_step_applies", lambda device, dtype: True)
        # The fixed step is the GPU's path, which never runs paged; a float32 chain on the CPU
        # would take the paged cache (ade4b31) instead of the fixed step this test is about.
        monkeypatch.setenv("SPECPAIR_PAGED", "off")
    target = make_model(tiny_tokenizer, seed=11, layers=1, dtype=dtype)
    head = mirror_head(target, vocab_every=2)
    head.model.to(dtype)
    engine = _engine(target, head, width)
    for rows in (1, 8):
        got, replies = _recorded_batch(engine, rows, True, PARAMS)
        expected, expected_replies = _recorded_batch(engine, rows, False, PARAMS)
        _assert_same_proposals(got, expected)
        assert replies == expected_replies
        drafted = sum(int(p.num.sum()) for p in got)
        assert drafted > 0
    # The drafting step ran (a batch's head cache keeps it beside its graphs).
    batch = engine.new_batch()
    batch.add(engine.encode(PROMPTS[0]), PARAMS)
    for _ in range(3):
        batch.step()
    assert any(isinstance(s, EagleDraftStep) for s in batch.drafter.kv.graphs.values())


def test_sampled_rows_draw_the_same_drafts_through_the_drafting_step(tiny_tokenizer):
    """Sampled rows beside greedy ones: the step hands back its logits, each sampled row draws
    from them with its own generator and feeds its draw; the same draws and q as token by token."""
    from tiny_models import make_model
    target = make_model(tiny_tokenizer, seed=11, layers=1, dtype=torch.bfloat16)
    head = mirror_head(target, vocab_every=2)
    head.model.to(torch.bfloat16)
    engine = _engine(target, head, 1)
    params = GenerationParams(max_new_tokens=14, temperature=0.8, seed=3)
    got, replies = _recorded_batch(engine, 4, True, params)
    expected, expected_replies = _recorded_batch(engine, 4, False, params)
    _assert_same_proposals(got, expected)
    assert replies == expected_replies
    assert any(p.probs is not None for p in got)


# Slow: dynamo traces the step's layer (13-20 s here); the fast lane keeps the
# exactness tests, the full suite this one.
@pytest.mark.slow
def test_a_compiled_head_warms_its_steps_and_then_compiles_nothing(tiny_tokenizer, monkeypatch):
    """SpeculativeEngine(compile="on") with an EAGLE head warms the head's drafting step and its
    catch-up feeds at every (rows, capacity) bucket (captures["head"]); a generation afterwards,
    rows joining and leaving and drafts rejected, compiles nothing (fullgraph=True layers, dynamo's
    error_on_recompile) and proposes and replies what the eager engine does. Three rows: past
    batch_size_threshold, so the head's rows catch up on several rounds' pairs at once."""
    import torch._dynamo

    from tiny_models import make_model

    monkeypatch.setenv("SPECPAIR_COMPILE_BACKEND", "aot_eager")
    target = make_model(tiny_tokenizer, seed=11, layers=1, dtype=torch.bfloat16)
    head = mirror_head(target, vocab_every=2)
    head.model.to(torch.bfloat16)
    config = SpeculationConfig(k=3, k_max=3, dynamic_k=False, fallback_threshold=0, tree_width=2,
                               batch_size_threshold=2)
    torch._dynamo.reset()
    compiled = SpeculativeEngine(target, draft=head, speculation=config, compile="on")
    report = compiled.captures["head"]
    assert report["buckets"] == [(r, c) for r in (1, 2) for c in (256, 512, 1024)]
    assert (report["width"], report["depth"]) == (2, 3)
    eager = SpeculativeEngine(target, draft=head, speculation=config)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, replies = _recorded_batch(compiled, 3, True, PARAMS)
    expected, expected_replies = _recorded_batch(eager, 3, True, PARAMS)
    _assert_same_proposals(got, expected)
    assert replies == expected_replies
    assert sum(int(p.num.sum()) for p in got) > 0


@pytest.mark.parametrize("width", [1, 3], ids=["chain", "tree"])
def test_medusas_step_proposes_what_its_heads_do_eagerly(tiny_tokenizer, width):
    """Medusa's heads, logits and top-k over the rows bucket as one step, every head whatever k:
    the same proposals bitwise as the first k heads run eagerly over the batch's rows (bf16; one
    row and eight, rows joining and leaving), greedy and sampled."""
    from tiny_models import make_model
    target = make_model(tiny_tokenizer, seed=11, layers=1, dtype=torch.bfloat16, init_std=0.05)
    heads = medusa_heads(target, vocab_every=2, scramble=0.05)
    heads.model.to(torch.bfloat16)
    engine = _engine(target, heads, width)
    sampled = GenerationParams(max_new_tokens=14, temperature=0.8, seed=3)
    for rows, params in ((1, PARAMS), (8, PARAMS), (4, sampled)):
        got, replies = _recorded_batch(engine, rows, True, params)
        expected, expected_replies = _recorded_batch(engine, rows, False, params)
        _assert_same_proposals(got, expected)
        assert replies == expected_replies
        assert sum(int(p.num.sum()) for p in got) > 0
    assert {1, 4, 8} <= {key[0] for key in engine.drafter.graphs.steps}     # rows buckets used


def test_medusas_compiled_step_warms_each_rows_bucket_and_then_compiles_nothing(tiny_tokenizer,
                                                                              monkeypatch):
    """Warm-up compiles the heads' step (fullgraph=True) for one row and for several (rows
    symbolic); rounds at 1, 2 and 3 rows then compile nothing and propose what the eager step
    does."""
    import torch._dynamo

    from tiny_models import make_model

    monkeypatch.setenv("SPECPAIR_COMPILE_BACKEND", "aot_eager")
    target = make_model(tiny_tokenizer, seed=11, layers=1, dtype=torch.bfloat16, init_std=0.05)
    heads = medusa_heads(target, vocab_every=2, scramble=0.05)
    heads.model.to(torch.bfloat16)
    torch._dynamo.reset()
    drafters = [MedusaDrafter(heads, target.model, len(tiny_tokenizer), compile=mode)
                for mode in ("on", "off")]
    report = drafters[0].warm_up(4, 2)
    assert report["rows"] == [1, 2, 4] and drafters[1].warm_up(4, 2)["graphs"] == 0
    dim = target.model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (1, 2, 3):
            features = torch.randn(rows, 2, dim, generator=gen).to(torch.bfloat16)
            sampling = RowSampling(*(torch.zeros(rows),) * 3, [None] * rows, greedy=True)
            out = []
            for drafter in drafters:
                batch = drafter.for_batch()
                batch.add_rows(rows)
                for i in range(rows):
                    batch.observe(i, 0, features[i])
                out.append(batch.propose([[5, 6, 7]] * rows, [3] * rows, sampling, 2))
            _assert_same_proposals([out[0]], [out[1]])
            assert int(out[0].num.sum()) == 3 * rows
