"""Drafting heads built from a tiny target without training, and the prompts the head tests share:
a mirror head drafts well but not perfectly (kept and rejected drafts, deterministically); Medusa
blocks at zero draft repeats."""

from __future__ import annotations

import torch

from specpair.config import GenerationParams
from specpair.heads import build_eagle_head, build_medusa_heads
from specpair.models import wrap_model

PROMPTS = ["def foo(x):\n    return", "The quick brown fox", "import os\nimport sys\n",
           "class A:\n  pass\n" * 3, "x = [1, 2, 3]\nfor i in x:\n", "Hello world, hello world"]
PARAMS = GenerationParams(max_new_tokens=32)


def eagle_head(target, vocab_every: int = 1, seed: int = 0):
    ids = torch.arange(0, target.embedding_rows, vocab_every)
    return wrap_model(build_eagle_head(target.model, ids, seed=seed), target.tokenizer, "head")


def eagle3_head(target):
    """An untrained EAGLE-3 head on half the vocabulary reading the target's layers 1, 2 and its
    last output (the eagle3_target fixture's 4 layers)."""
    from specpair.eagle3 import build_eagle3_head
    return wrap_model(build_eagle3_head(target.model, torch.arange(0, 400, 2), (1, 2, 4), seed=5),
                      None, "head")


def mirror_head(target, vocab_every: int = 1):
    """For a one-layer target, a head that nearly *is* the target: its layer is the target's
    layer and fc passes the embedding of the next token through, so it predicts the target's next
    feature from the same token (missing only the sequence's first token as context). It drafts
    well but not perfectly, without training: both kept and rejected drafts, deterministically."""
    head = eagle_head(target, vocab_every)
    with torch.no_grad():
        hidden = head.model.config.hidden_size
        head.model.fc.weight.zero_()
        head.model.fc.weight[:, :hidden] = torch.eye(hidden)
    return head


def medusa_heads(target, vocab_every: int = 1, heads: int = 3, scramble: float = 0.0):
    """Untrained Medusa heads. Blocks at zero: every head drafts what the target predicted for
    the token just committed, i.e. a repeat of it, kept where the target repeats itself. With
    `scramble`, random blocks: each head proposes its own distribution."""
    ids = torch.arange(0, target.embedding_rows, vocab_every)
    heads = build_medusa_heads(target.model, ids, heads)
    if scramble:
        torch.manual_seed(0)
        with torch.no_grad():
            for block in heads.blocks:
                block.layers[0].weight.normal_(0.0, scramble)
    return wrap_model(heads, target.tokenizer, "medusa")


def assert_rows_joining_and_leaving_match(engine, reference):
    """Rows joining a running batch (and one leaving it) draft from their own state only."""
    batch = engine.new_batch()
    first = batch.add(engine.encode(PROMPTS[0]), PARAMS)
    doomed = batch.add(engine.encode(PROMPTS[1]), PARAMS)
    batch.step(); batch.step()
    later = batch.add(engine.encode(PROMPTS[2]), PARAMS)
    batch.step()
    batch.cancel(doomed.request_id)
    while batch.active:
        batch.step()
    assert first.generated == reference[0] and later.generated == reference[2]
