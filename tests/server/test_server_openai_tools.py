"""Tool calls through the official `openai` client against a real server whose model's chat
template renders tools (Hermes style), and the Llama 3 JSON style through the engine; the reply
parsers on their own."""

import copy
import dataclasses
import json

import openai
import pytest

from serving_helpers import openai_client
from tool_fixtures import HERMES_TEMPLATE, WEATHER, tools_tokenizer

from specpair.config import GenerationParams
from specpair.decoding import SpeculativeEngine
from specpair.server.app import EngineServer, ServerOptions
from specpair.server.requests import Limits
from specpair.tool_calls import HERMES, LLAMA3, CallStream, forced_call_grammar, parse_tool_calls, style_of

TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo for three days?"}]


@pytest.fixture(scope="module")
def tool_server(tiny_pair):
    """The tiny pair with a chat template that renders tools (its tokens unchanged)."""
    target, draft = tiny_pair
    tok = tools_tokenizer()
    target, draft = dataclasses.replace(target, tokenizer=tok), dataclasses.replace(draft, tokenizer=copy.deepcopy(tok))
    engine = SpeculativeEngine(target, draft=draft)
    server = EngineServer(lambda: engine, ServerOptions(
        port=0, metrics_port=None, http_port=0, pair="tiny", version="1",
        limits=Limits(max_request_bytes=64 * 1024, max_new_tokens=256)), progress=lambda _m: None)
    server.start(wait_ready=True, timeout=60)
    try:
        yield server
    finally:
        server.stop(drain_timeout=1.0)


def test_a_named_tool_choice_is_a_parsed_call_equal_with_speculation_off(tool_server):
    client = openai_client(tool_server)
    ask = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    on = client.chat.completions.create(**ask)
    off = client.chat.completions.create(**ask, extra_body={"specpair": {"k": 0}})
    choice = on.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7
    assert off.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    assert on.model_extra["specpair"]["drafted_tokens"] > 0
    # The tools were rendered into the prompt by the template.
    bare = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    assert on.usage.prompt_tokens > bare.usage.prompt_tokens + 20

    # Streamed as OpenAI streams calls: the call's id, type and name with empty arguments first,
    # then the arguments piece by piece, adding up to the whole reply's; finish_reason tool_calls.
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls for d in c.choices[0].delta.tool_calls]
    head, pieces = deltas[0], deltas[1:]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert len(pieces) > 1 and all(p.index == 0 and p.id is None and p.function.name is None for p in pieces)
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


@pytest.mark.parametrize("tool_choice", ["auto", {"type": "function", "function": {"name": "get_time"}}])
def test_logprobs_stream_with_tools_and_add_up_to_the_whole_reply(tool_server, tool_choice):
    """With tools, each streamed step's log-probabilities ride on its first chunk (an empty delta
    where the text is held as a possible call): joined in order they are the non-streamed reply's
    `logprobs.content`, one entry per completion token, equal with speculation off."""
    client = openai_client(tool_server)
    ask = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
               tool_choice=tool_choice, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**ask)
    entries = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
               for e in whole.choices[0].logprobs.content]
    assert len(entries) == whole.usage.completion_tokens > 0
    for extra in ({}, {"specpair": {"k": 0}}):
        chunks = list(client.chat.completions.create(**ask, stream=True, extra_body=extra))
        streamed_entries = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                            for c in chunks if c.choices and c.choices[0].logprobs
                            for e in c.choices[0].logprobs.content]
        assert streamed_entries == entries
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    if isinstance(tool_choice, dict):      # forced: the call streamed as without logprobs
        assert whole.choices[0].finish_reason == "tool_calls"
        # Where the grammar leaves one token, the alternatives it refuses (-inf) read as OpenAI's
        # floor, -9999 (JSON has no infinity).
        assert any(lp == -9999.0 for _, _, top in entries for _, lp in top)
        assert all(lp >= -9999.0 for _, lp, top in entries for lp in [lp, *(a for _, a in top)])
        names = [d.function.name for c in chunks if c.choices and c.choices[0].delta.tool_calls
                 for d in c.choices[0].delta.tool_calls if d.function.name]
        assert names == ["get_time"]


def test_required_calls_one_of_the_tools(tool_server):
    reply = openai_client(tool_server).chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80,
        temperature=0.8, seed=9)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time")
    json.loads(calls[0].function.arguments)


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tools_name_their_field(tool_server, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(tool_server).chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=body)
    assert info.value.body["param"] == param


def test_llama3_json_style_forced_through_the_grammar(tiny_pair):
    target, draft = tiny_pair
    engine = SpeculativeEngine(target, draft=draft)
    functions = [WEATHER["function"], TIME["function"]]
    params = GenerationParams(max_new_tokens=80, structure=("grammar", forced_call_grammar(functions, "get_time", LLAMA3)))
    spec = engine.generate(["Call a tool:"], params)[0]
    alone = engine.generate(["Call a tool:"], params, speculate=False)[0]
    assert spec.token_ids == alone.token_ids
    content, calls = parse_tool_calls(spec.text, LLAMA3)
    assert content is None and [c.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")


def streamed(text: str, step: int) -> tuple[str, dict, dict, bool]:
    """A reply fed to a CallStream `step` characters at a time -> (content, names, arguments by
    call index, whether it called), as a client adds the deltas up."""
    stream, deltas = CallStream(HERMES), []
    for at in range(0, len(text), step):
        deltas += stream.feed(text[at:at + step])
    owed, called = stream.finish()
    names, args = {}, {}
    for delta in deltas + owed:
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                assert call["index"] not in names       # one head per call
                names[call["index"]] = call["function"]["name"]
            args[call["index"]] = args.get(call["index"], "") + call["function"]["arguments"]
    return "".join(d.get("content", "") for d in deltas + owed), names, args, called


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streamed_calls_add_up_to_the_whole_reply(step):
    text = ('Sure. <tool_call>\n{"name": "f", "arguments": {"a": "x}y\\"", "b": [1, {"c": 2}]}}\n</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    content, calls = parse_tool_calls(text, HERMES)
    assert streamed(text, step) == (content, {0: "f", 1: "g"}, {i: c.arguments for i, c in enumerate(calls)}, True)
    assert calls[0].arguments == '{"a": "x}y\\"", "b": [1, {"c": 2}]}'     # as written
    # No call: all of it is content, even what looked like the start of one.
    assert streamed("a <tool_ b", step) == ("a <tool_ b", {}, {}, False)
    assert streamed("<tool_call>{broken", step)[0] == "<tool_call>{broken"
    # Arguments written before the name: sent whole when the reply ends.
    late = '<tool_call>{"arguments": {"x": 1}, "name": "h"}</tool_call>'
    assert streamed(late, step) == ("", {0: "h"}, {0: '{"x": 1}'}, True)


def test_reply_parsers_and_styles():
    assert style_of(HERMES_TEMPLATE) == HERMES and style_of("{{ '<|python_tag|>' }}") == LLAMA3
    content, calls = parse_tool_calls('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
                                      '<tool_call>{"name": "g", "arguments": {}}</tool_call>', HERMES)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    content, calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; '
                                      '{"name": "g", "parameters": {}}', LLAMA3)
    assert content is None and [c.name for c in calls] == ["f", "g"]
    # Not a call: the reply stays content, nothing is lost.
    assert parse_tool_calls("<tool_call>{broken", HERMES) == ("<tool_call>{broken", [])
    assert parse_tool_calls("Hello there", LLAMA3) == ("Hello there", [])
