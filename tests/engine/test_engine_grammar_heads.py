"""Head drafters (EAGLE, Medusa) under a row's grammar (issue 56): a head proposes within the
grammar (its logits masked by what the grammar allows after the committed tokens and its drafts
so far, HeadDrafter.propose), a tree's siblings too, and grammar rows draft token trees: the
target's mask applies at every chain position and at every sibling's node
(RowGrammar.sibling_masks), so output equals target-only constrained decoding, greedy and seeded.
A grammar whose tokens the head cannot draft costs no wrong token, and its refused drafts are
counted as drafted and not accepted."""

from __future__ import annotations

import json

import pytest
import torch
from head_builders import medusa_heads, mirror_head

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.grammar import GrammarCompiler, reply_valid

SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age"],
     "properties": {"name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 99}}},
    {"type": "array", "maxItems": 4, "items": {"type": "integer", "minimum": 0, "maximum": 99}},
    {"type": "object", "additionalProperties": False, "required": ["note"],
     "properties": {"note": {"type": "string", "maxLength": 24}}},
]
PROMPTS = ['Reply as JSON: {"name":"Ann","age":31}. Now Bob:', "def parse(x):\n    return x",
           "The quick brown fox"]


def _engine(target, method: str, width: int, k: int = 3, vocab_every: int = 2):
    draft = (mirror_head(target, vocab_every=vocab_every) if method == "eagle"
             else medusa_heads(target, vocab_every=vocab_every, scramble=0.3))
    return SpeculativeEngine(target, draft=draft, speculation=SpeculationConfig(
        k=k, dynamic_k=False, fallback_threshold=0, tree_width=width))


@pytest.fixture(scope="module")
def targets(one_layer_target, smooth_target):
    return {"eagle": one_layer_target, "medusa": smooth_target}


def _complete_after(grammar, tokens: list[int]) -> bool:
    """Whether the grammar is complete (only EOS may follow, no draft allowed) after the row's
    committed tokens and `tokens` (which it allows); its state left as it was."""
    matcher = grammar.matcher
    for token in tokens:
        matcher.consume_token(token)
    complete = matcher.is_stopped()
    if tokens:
        matcher.rollback(len(tokens))
    return complete


def _record_proposals(batch, guided: bool, seen: list):
    """Wrap the batch's drafter: each grammar row's proposal as (drafted, allowed, refused while
    the grammar still allowed a token), read before the Batch cuts or advances anything.
    `guided` False: the drafter is not told the grammars (the drafts a head makes without
    them)."""
    propose = batch.drafter.propose

    def recorded(sequences, ks, sampling, width=1, **kwargs):
        if not guided:
            batch.drafter.grammars = None
        proposal = propose(sequences, ks, sampling, width, **kwargs)
        for i, n in enumerate(proposal.num.tolist()):
            grammar = batch.rows[i].grammar
            if grammar is not None and n:
                chain = proposal.tokens[i, :n].tolist()
                allowed = grammar.allowed(chain)
                seen.append((n, allowed, allowed < n and not _complete_after(grammar, chain[:allowed])))
        return proposal
    batch.drafter.propose = recorded


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_a_head_drafts_within_the_grammar(targets, method):
    """Guided, every draft a head proposes for a grammar row is one its grammar allows, up to
    where the grammar is complete (past it, EOS is the target's to emit: no draft is allowed); the
    same head told nothing of the grammar proposes tokens it refuses (the check can fail). The
    head's draft vocabulary is the whole vocabulary here: where it holds no allowed token a row
    drafts unguided (the next test)."""
    target = targets[method]
    engine = _engine(target, method, width=1, vocab_every=1)
    counts = {}
    for guided in (True, False):
        seen = []
        batch = engine.new_batch()
        _record_proposals(batch, guided, seen)
        for prompt, schema in zip(PROMPTS, SCHEMAS):
            batch.add(engine.encode(prompt), GenerationParams(
                max_new_tokens=24, structure=("json_schema", json.dumps(schema))))
        while batch.active:
            batch.step()
        counts[guided] = (sum(n for n, _, _ in seen), sum(a for _, a, _ in seen),
                          sum(r for _, _, r in seen))
    (drafted, allowed, refused), (free_drafted, free_allowed, free_refused) = counts[True], counts[False]
    assert drafted > 0 and allowed > 0 and refused == 0, counts
    assert free_drafted > free_allowed and free_refused > 0, counts


@pytest.mark.parametrize("method, width", [("eagle", 1), ("eagle", 2), ("medusa", 3)])
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 7)])
def test_grammar_rows_draft_chains_and_trees_with_target_only_output(targets, method, width,
                                                                    temperature, seed):
    """Grammar rows draft (trees included: they drafted nothing in tree rounds before) and every
    reply is target-only constrained decoding's, token for token; complete replies validate."""
    target = targets[method]
    engine = _engine(target, method, width)
    drafted = accepted = 0
    for schema in SCHEMAS:
        structure = ("json_schema", json.dumps(schema))
        params = GenerationParams(max_new_tokens=40, temperature=temperature, seed=seed,
                                  structure=structure)
        spec = engine.generate(PROMPTS, params)
        alone = engine.generate(PROMPTS, params, speculate=False)
        for a, b in zip(spec, alone):
            assert a.token_ids == b.token_ids, (method, width, schema)
            if a.finish_reason == "stop":
                assert reply_valid(structure, a.text), a.text
            assert a.stats.num_accepted_tokens <= a.stats.num_draft_tokens
            drafted += a.stats.num_draft_tokens
            accepted += a.stats.num_accepted_tokens
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_sibling_masks_are_the_masks_after_each_sibling(tiny_tokenizer):
    """RowGrammar.sibling_masks: sibling s at depth j's node is the grammar's mask after
    chain[:j] + [s] (as masks() computes it for that path); a refused sibling's is empty; the
    committed state is left as it was."""
    tok = tiny_tokenizer
    V = len(tok)
    compiler = GrammarCompiler(tok, V, [tok.eos_token_id])
    grammar = compiler.row(("json_schema", json.dumps(SCHEMAS[0])))
    chain = tok('{"name":"Bo', add_special_tokens=False)["input_ids"]
    assert grammar.allowed(chain) == len(chain)
    digit = tok("7", add_special_tokens=False)["input_ids"][0]
    siblings = [[t, digit] for t in chain]      # each depth: its own chain token, and a digit
    masks = grammar.sibling_masks(chain, siblings, V)
    assert masks.shape == (len(chain), 2, V)
    for j in range(len(chain)):
        for s, token in enumerate(siblings[j]):
            path = chain[:j] + [token]
            if grammar.allowed(path) == len(path):
                assert torch.equal(masks[j, s], grammar.masks(path, V)[-1]), (j, s)
            else:
                assert not masks[j, s].any(), (j, s)
    assert not masks[0, 1].any()          # a digit cannot open the object
    assert masks[len(chain) - 1, 0].any()
    assert grammar.allowed(chain) == len(chain) and not grammar.matcher.is_error()


def test_a_grammar_the_head_cannot_draft_costs_no_wrong_token(one_layer_target):
    """A regex whose every token lies outside the head's draft vocabulary (even ids only): the
    head's drafts are all refused, cut before verification, counted as drafted and not accepted;
    the reply is target-only's."""
    tok = one_layer_target.tokenizer
    V = len(tok)
    compiler = GrammarCompiler(tok, V, [tok.eos_token_id])
    # Single characters whose whole-grammar tokens are all odd ids (off a vocab_every=2 head).
    chars = [c for c in "abcdefghijklmnopqrstuvwxyz"
             if all(t % 2 for t in tok(c, add_special_tokens=False)["input_ids"])]
    regex = None
    for size in range(len(chars), 0, -1):
        candidate = f"[{''.join(chars[:size])}]{{200}}"
        first = compiler.row(("regex", candidate)).masks([], V)[0]
        allowed = first.nonzero().flatten().tolist()
        if allowed and all(t % 2 or t == tok.eos_token_id for t in allowed):
            regex = candidate
            break
    assert regex is not None, chars
    engine = _engine(one_layer_target, "eagle", width=1, k=3)
    params = GenerationParams(max_new_tokens=12, structure=("regex", regex))
    spec = engine.generate(PROMPTS, params)
    alone = engine.generate(PROMPTS, params, speculate=False)
    assert [r.token_ids for r in spec] == [r.token_ids for r in alone]
    assert sum(r.stats.num_draft_tokens for r in spec) > 0
    assert sum(r.stats.num_accepted_tokens for r in spec) == 0
