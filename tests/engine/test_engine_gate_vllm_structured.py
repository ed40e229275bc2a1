"""The vLLM gate's golden prompts that ask for structure, up to the request it sends
(gate/vllm.golden_requests, gate/structured.vllm_structured_outputs): the prompt ids are those our
gate decodes (tools rendered by the template), the structure is vLLM's `structured_outputs`
field, and a bad golden prompt is refused by name before any server. vLLM answering them, judged:
tests/engine/test_engine_vllm_peer.py (its one real server)."""

from __future__ import annotations

import json

import pytest
from vllm_structured_golden import GOLDEN, PERSON, WEATHER, tools_tokenizer

from specpair.decoding import encode_prompt
from specpair.errors import SpecpairError
from specpair.gate.structured import vllm_structured_outputs
from specpair.gate.vllm import golden_requests
from specpair.grammar import request_structure
from specpair.tool_calls import HERMES, forced_call_grammar


def test_each_structure_kind_is_vllms_field():
    assert vllm_structured_outputs(None) is None
    assert vllm_structured_outputs(("json_object", "")) == {"json_object": True}
    assert vllm_structured_outputs(("json_schema", json.dumps(PERSON))) == {"json": PERSON}
    assert vllm_structured_outputs(("choice", '["a", "b"]')) == {"choice": ["a", "b"]}
    assert vllm_structured_outputs(("regex", "[0-9]+")) == {"regex": "[0-9]+"}
    assert vllm_structured_outputs(("grammar", 'start: "x"')) == {"grammar": 'start: "x"'}
    # A response_format as a client sends it reaches vLLM as the same schema.
    structure = request_structure({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}, None)
    assert vllm_structured_outputs(structure) == {"json": PERSON}


def test_golden_requests_are_what_our_gate_decodes():
    tok = tools_tokenizer()
    requests = golden_requests(tok, GOLDEN, chat=True)
    assert [r.structured_outputs for r in requests] == [
        {"json": PERSON}, {"json": PERSON}, {"choice": ["yes", "no"]}, {"regex": "[0-9]{4}"},
        {"grammar": forced_call_grammar([WEATHER["function"]], "get_weather", HERMES)}, None]
    # Plain prompts through the chat template; the tool prompt with its tools rendered in it.
    assert requests[0].ids == encode_prompt(tok, "A person as JSON:", True)
    tools_prompt = tok.decode(requests[4].ids)
    assert "get_weather(city, days)" in tools_prompt and "The weather in Oslo" in tools_prompt
    assert [r.ask.plain for r in requests] == [False] * 5 + [True]


def test_a_bad_golden_prompt_is_refused_by_its_field():
    with pytest.raises(SpecpairError, match=r"gating.prompts\[1\].structured_outputs.regex"):
        golden_requests(tools_tokenizer(), [GOLDEN[0], {"prompt": "x", "structured_outputs": {"regex": "(open"}}],
                        chat=True)
