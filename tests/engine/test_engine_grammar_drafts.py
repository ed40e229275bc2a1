"""Grammar-aware drafts (grammar.RowGrammar.guided_drafts, NgramDrafter and LookupFirstDrafter
under a row's grammar): a lookup's proposals are cut at the first token the grammar refuses, the
tokens the grammar forces (key names, separators, closing braces, EOS once complete) are drafted
in their place (jump-forward drafting), and the target still verifies every one under its mask,
so output equals target-only constrained decoding on every schema, greedy and seeded."""

from __future__ import annotations

import json

import pytest
import torch
from head_builders import mirror_head

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import LookupFirstDrafter
from specpair.drafters.base import RowSampling
from specpair.grammar import GrammarCompiler, reply_valid

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
SCHEMAS = [
    PERSON,
    {"type": "object", "additionalProperties": False, "required": ["ok", "level"],
     "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}}},
    {"type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}},
    {"type": "object", "additionalProperties": False, "required": ["point"],
     "properties": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                              "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                             "y": {"type": "integer", "minimum": -9, "maximum": 9}}}}},
    {"type": "object", "additionalProperties": False, "required": ["tags"],
     "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 2,
                             "items": {"enum": ["alpha", "beta", "gamma"]}}}},
    {"enum": ["yes", "no", "maybe"]},
]
# Prompts that quote the keys, as extraction prompts do: the lookup has something to copy.
PROMPTS = ['Reply as JSON with "name" and "age": {"name":"Ann","age":31}. Now Bob:',
           "def parse(x):\n    return x",
           '{"ok":true,"level":"low"} {"point":{"x":1,"y":2}} {"tags":["beta"]} again:']
GREEDY = RowSampling(temperature=torch.zeros(1), top_k=torch.zeros(1, dtype=torch.long),
                     top_p=torch.ones(1), generators=[None], greedy=True)


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    return GrammarCompiler(tiny_tokenizer, len(tiny_tokenizer), [tiny_tokenizer.eos_token_id])


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_forced_tokens_are_drafted_and_refused_proposals_cut(tiny_tokenizer, compiler):
    tok = tiny_tokenizer
    grammar = compiler.row(("json_schema", json.dumps(PERSON)))
    # Nothing proposed (or only what the grammar refuses): what it forces, the opening up to the
    # name's value, and nothing past where the value is free.
    forced = grammar.guided_drafts([], 20)
    assert tok.decode(forced) == '{"name":"'
    assert grammar.guided_drafts(_ids(tok, "hello"), 20) == forced
    assert grammar.guided_drafts([], 3) == forced[:3]             # never more than k
    assert grammar.allowed([]) == 0 and not grammar.matcher.is_error()    # state left as committed
    grammar.advance(forced)
    # A proposal the grammar allows is kept up to the first refused token (a second quote
    # closes the string; the key after it must be "age", not a digit).
    kept = grammar.guided_drafts(_ids(tok, 'Bo"7'), 20)
    assert tok.decode(kept).startswith('Bo"') and "7" not in tok.decode(kept)
    assert tok.decode(kept) == 'Bo","age":'                        # ... then the forced key
    # The lookup is asked again after forced tokens, with the drafts so far.
    asked = []
    more = grammar.guided_drafts(_ids(tok, 'Bo"'), 20, lambda drafts: asked.append(list(drafts)) or _ids(tok, "42"))
    assert asked and tok.decode(asked[0]) == 'Bo"' and tok.decode(more).startswith('Bo","age":42')
    # Complete: the closing brace and then EOS, which ends the drafts.
    grammar.advance(_ids(tok, 'Bo","age":42'))
    end = grammar.guided_drafts(_ids(tok, "}}}"), 20)
    assert end[-1] == tok.eos_token_id and tok.decode(end[:-1]) == "}"
    grammar.advance(end[:-1])
    assert grammar.finished


def test_the_ngram_drafter_drafts_within_the_grammar(tiny_target, compiler, tiny_tokenizer):
    """Unguided, the lookup proposes what the grammar refuses; guided, every draft is allowed and
    the forced opening is drafted even where the lookup finds nothing."""
    engine = SpeculativeEngine(tiny_target, drafter="ngram")
    prompt = engine.encode("the cat; the cat; the cat; the")
    proposals = {}
    for guided in (False, True):
        grammar = compiler.row(("json_schema", json.dumps(PERSON)))
        drafter = engine.drafter.for_batch()
        drafter.add_rows(1)
        drafter.grammars = [grammar] if guided else None
        proposal = drafter.propose([prompt], [6], GREEDY)
        proposals[guided] = (proposal.host[0], grammar.allowed(proposal.host[0]))
    (free, free_allowed), (guided, guided_allowed) = proposals[False], proposals[True]
    assert free and free_allowed == 0                       # " cat; ..." is no JSON
    assert guided_allowed == len(guided) == 6 and tiny_tokenizer.decode(guided).startswith('{"')


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 5)])
def test_output_equals_constrained_target_only_on_many_schemas(tiny_target, temperature, seed):
    engine = SpeculativeEngine(tiny_target, drafter="ngram",
                               speculation=SpeculationConfig(k=4, dynamic_k=False, fallback_threshold=0))
    drafted = accepted = 0
    for schema in SCHEMAS:
        params = GenerationParams(max_new_tokens=48, temperature=temperature, seed=seed,
                                  structure=("json_schema", json.dumps(schema)))
        spec = engine.generate(PROMPTS, params)
        alone = engine.generate(PROMPTS, params, speculate=False)
        for a, b in zip(spec, alone):
            assert a.token_ids == b.token_ids, schema
            if a.finish_reason == "stop":
                assert reply_valid(("json_schema", json.dumps(schema)), a.text), a.text
            drafted += a.stats.num_draft_tokens
            accepted += a.stats.num_accepted_tokens
            assert a.stats.num_accepted_tokens <= a.stats.num_draft_tokens
    # Drafting happened and paid: forced tokens are drafts, counted as such.
    assert drafted > 0 and accepted > 0


def test_forced_drafts_are_counted_and_accepted_where_the_grammar_leaves_one_token(tiny_target,
                                                                                   tiny_tokenizer):
    """A choice between two long strings: once the first byte picks one, the rest is forced.
    Those rounds draft the forced tokens (counted as drafts) and the target, whose mask leaves
    at most their tokenizations, accepts them; target-only takes one round a token."""
    choices = ["zebra crossing at midnight", "alpha beta gamma delta"]
    engine = SpeculativeEngine(tiny_target, drafter="ngram",
                               speculation=SpeculationConfig(k=6, dynamic_k=False, fallback_threshold=0))
    params = GenerationParams(max_new_tokens=40, structure=("choice", json.dumps(choices)))
    spec = engine.generate(["Pick one:"], params)[0]
    alone = engine.generate(["Pick one:"], params, speculate=False)[0]
    assert spec.token_ids == alone.token_ids and spec.text in choices
    stats = spec.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert stats.num_target_steps < alone.stats.num_target_steps


def test_lookup_first_copies_within_the_grammar(one_layer_target):
    """LookupFirstDrafter: grammar rows copy what the grammar allows and forces (point masses),
    the head drafts elsewhere (its drafts cut by the Batch); greedy output equals target-only."""
    engine = SpeculativeEngine(one_layer_target, draft=mirror_head(one_layer_target, vocab_every=2),
                               speculation=SpeculationConfig(k=3, dynamic_k=False, fallback_threshold=0,
                                                             tree_width=1, lookup_min_match=1))
    assert isinstance(engine.drafter, LookupFirstDrafter)
    for schema in SCHEMAS[:3]:
        params = GenerationParams(max_new_tokens=40, structure=("json_schema", json.dumps(schema)))
        spec = engine.generate(PROMPTS, params)
        alone = engine.generate(PROMPTS, params, speculate=False)
        assert [r.token_ids for r in spec] == [r.token_ids for r in alone]
    rounds = engine.drafter.describe()["rounds"]
    assert rounds["copied"] > 0, rounds


def test_mask_words_unpack_to_token_order():
    """grammar.unpack_bits: bit j of word i is token 32 i + j, sign bit included, per row."""
    from specpair.grammar import unpack_bits

    words = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(4))
    expected = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(3, -1).bool()
    assert torch.equal(unpack_bits(words), expected)
    assert torch.equal(unpack_bits(words[1]), expected[1])
    one = torch.zeros(4, dtype=torch.int32)
    one[2] = 1 << 5
    assert unpack_bits(one).nonzero().flatten().tolist() == [2 * 32 + 5]
