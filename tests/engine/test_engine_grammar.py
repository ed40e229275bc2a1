"""Constrained decoding under speculation (grammar.py, Batch): the output is target-only
constrained decoding's, drafts the grammar refuses cost no wrong token and count as drafted and
not accepted; and each token's log-probabilities are the target's own distribution's."""

import json

import pytest
import torch

from specpair.config import GenerationParams
from specpair.decoding import SpeculativeEngine
from specpair.grammar import check_structure
from specpair.errors import SpecpairError

# The prompt repeats a phrase, so n-gram lookup proposes its continuation every round; the
# grammar allows digits only, so the grammar refuses every one of those drafts.
REPEATING = "the quick brown fox jumps over the lazy dog; " * 6
DIGITS = ("regex", "[0-9]{12}")


def test_proposals_the_grammar_refuses_are_never_drafted_and_cost_no_wrong_token(tiny_target):
    """The lookup's proposals (letters) are cut where the grammar (digits) refuses them, before
    they are drafts (NgramDrafter under RowGrammar.guided_drafts): the first round drafts
    nothing (no digit is forced) and emits the target's digit; later rounds draft digits the
    reply repeats, and EOS once the grammar is complete. Output equals target-only, and
    acceptance counts only what was verified."""
    from specpair.config import SpeculationConfig

    # Speculation held on (no fallback, fixed k): rounds of refused proposals must not stop it.
    engine = SpeculativeEngine(tiny_target, drafter="ngram",
                               speculation=SpeculationConfig(k=4, dynamic_k=False, fallback_threshold=0))
    params = GenerationParams(max_new_tokens=20, structure=DIGITS)
    free = engine.generate([REPEATING], GenerationParams(max_new_tokens=20))[0]
    assert free.stats.num_draft_tokens > 0            # unconstrained, lookup drafts this prompt
    spec = engine.generate([REPEATING], params)[0]
    alone = engine.generate([REPEATING], params, speculate=False)[0]
    assert spec.token_ids == alone.token_ids and spec.text == alone.text
    assert len(spec.text) == 12 and spec.text.isdigit() and spec.finish_reason == "stop"
    assert 0 < spec.stats.num_accepted_tokens <= spec.stats.num_draft_tokens   # digits it copied, EOS
    batch = engine.new_batch()
    seq = batch.add(engine.encode(REPEATING), params)
    first = batch.step()[0]
    assert seq.stats.num_draft_tokens == 0 and seq.stats.num_accepted_tokens == 0
    assert len(first.token_ids) == 1 and first.text.isdigit()


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 17)])
def test_json_schema_under_a_draft_model_equals_target_only(tiny_target, tiny_draft, temperature, seed):
    schema = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                             "tags": {"type": "array", "maxItems": 3,
                                      "items": {"type": "string", "enum": ["a", "bb", "ccc"]}}}}
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft)
    params = GenerationParams(max_new_tokens=60, temperature=temperature, seed=seed,
                              structure=("json_schema", json.dumps(schema)))
    prompts = ["def foo(x):", "import json\n", "class A:\n    pass\n"]
    spec = engine.generate(prompts, params)
    alone = engine.generate(prompts, params, speculate=False)
    for a, b in zip(spec, alone):
        assert a.token_ids == b.token_ids
        value = json.loads(a.text)
        assert set(value) == {"id", "tags"} and 0 <= value["id"] <= 9999
    assert sum(r.stats.num_draft_tokens for r in spec) > 0


def test_logprobs_are_the_targets_own_distribution(tiny_target, tiny_draft):
    """Computed apart from the engine: one forward over prompt and reply, each position's
    log-softmax at the request's temperature; equal with speculation on (bitwise) and off."""
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft)
    prompt = engine.encode("def foo(x):\n    return")
    for temperature, seed in ((0.0, None), (0.7, 3)):
        params = GenerationParams(max_new_tokens=24, temperature=temperature, seed=seed, logprobs=4)
        runs = []
        for speculate in (True, False):
            batch = engine.new_batch()
            batch.speculate = speculate
            seq = batch.add(prompt, params)
            got = []
            while batch.active:
                for out in batch.step():
                    got += out.logprobs
            runs.append((seq.generated, got, seq.stats.num_draft_tokens))
        (ids, got, drafted), (ids_off, got_off, _) = runs
        assert drafted > 0 and ids == ids_off and got == got_off and len(got) == len(ids)
        with torch.no_grad():
            logits = tiny_target.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits.float() / (temperature or 1.0), -1)
        for j, (token, (logprob, top)) in enumerate(zip(ids, got)):
            assert abs(logprob - float(expected[j, token])) < 1e-4
            assert [t for t, _ in top] == expected[j].topk(4).indices.tolist()


def test_a_structure_that_does_not_compile_is_refused():
    with pytest.raises(SpecpairError):
        check_structure(("regex", "(unclosed"))
    with pytest.raises(SpecpairError):
        check_structure(("json_schema", "{not json"))
    check_structure(("json_object", ""))


def test_a_draft_model_proposes_within_the_grammar(tiny_target, tiny_draft):
    """The draft's own proposals are masked by the row's grammar (drafters.model, grammar.
    DraftGrammar): every draft it proposes under a digits-only grammar is one the grammar allows,
    where the same draft unguided proposes what the grammar refuses; the grammar's committed
    state is as before the round; output equals target-only and acceptance counts every draft."""
    from specpair.drafters.base import RowSampling

    engine = SpeculativeEngine(tiny_target, draft=tiny_draft)
    prompt = engine.encode("Write twelve digits:")
    greedy = RowSampling(temperature=torch.zeros(1), top_k=torch.zeros(1, dtype=torch.long),
                         top_p=torch.ones(1), generators=[None], greedy=True)

    def proposal(guided: bool) -> tuple[list[int], int]:
        grammar = engine.grammars.row(DIGITS)
        drafter = engine.drafter.for_batch()
        drafter.add_rows(1)
        drafter.grammars = [grammar] if guided else None
        drafts = drafter.propose([prompt], [6], greedy).tokens[0].tolist()
        assert grammar.allowed([]) == 0 and not grammar.matcher.is_error()   # its state is the committed one
        return drafts, grammar.allowed(drafts)

    free, free_allowed = proposal(guided=False)
    guided, guided_allowed = proposal(guided=True)
    assert free_allowed < len(free)                  # unguided, the random draft writes no digits
    assert guided_allowed == len(guided) == 6        # guided, every draft is a digit run

    params = GenerationParams(max_new_tokens=12, structure=DIGITS)
    spec = engine.generate(["Write twelve digits:"], params)[0]
    alone = engine.generate(["Write twelve digits:"], params, speculate=False)[0]
    assert spec.token_ids == alone.token_ids and spec.text.isdigit()
    stats = spec.stats
    assert stats.num_draft_tokens > 0 and 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens


def test_drafts_past_the_grammars_end_leave_its_committed_state(tiny_tokenizer):
    """Drafts that complete the grammar and go on to EOS: a stopped matcher takes EOS without
    recording it, so masks() must not roll it back (it undid a committed token: the next
    commit was refused). Seen with a draft model under a JSON schema."""
    from specpair.grammar import GrammarCompiler
    tok = tiny_tokenizer
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    grammar = compiler.row(("json_schema", json.dumps({"type": "array", "items": {"enum": ["a"]}})))
    head, tail = tok("[")["input_ids"], tok("]")["input_ids"]
    grammar.advance(head)
    drafts = tail + [tok.eos_token_id]
    assert grammar.allowed(drafts) == len(drafts)
    masks = grammar.masks(drafts, len(tok))
    assert masks[-2, tok.eos_token_id] and masks[-2].sum() == 1      # complete: EOS only
    guide = grammar.drafting()
    for token in drafts:
        guide.take(token)
    guide.close()
    grammar.advance(tail)                   # the committed state is still "["
    assert grammar.finished
