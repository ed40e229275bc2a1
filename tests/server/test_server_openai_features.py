"""What API clients send beyond a prompt, through the official `openai` client against a real
server on the tiny pair: log-probabilities, several choices, structured outputs; each equal with
speculation on (and drafting) and off."""

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pydantic
import pytest

from serving_helpers import openai_client, tiny_server

CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]
OFF = {"specpair": {"k": 0}}          # speculation off for this request


@pytest.fixture(scope="module")
def http_server(tiny_pair):
    with tiny_server(tiny_pair, metrics_port=None, http_port=0, max_queue=128) as server:
        yield server


def figures(reply) -> dict:
    return reply.model_extra["specpair"]


def warm(client, **prompt) -> None:
    """One token for this prompt, so its blocks are in the prefix store for what follows."""
    if "messages" in prompt:
        client.chat.completions.create(model="tiny", max_tokens=1, **prompt)
    else:
        client.completions.create(model="tiny", max_tokens=1, **prompt)


def chat_logprobs(choice) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in choice.logprobs.content]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 5)])
def test_chat_logprobs_equal_with_and_without_speculation(http_server, tiny_pair, temperature, seed):
    client = openai_client(http_server)
    ask = dict(model="tiny", messages=CHAT, max_tokens=24, temperature=temperature, seed=seed,
               logprobs=True, top_logprobs=3)
    # Both replies below take the prompt's blocks from the prefix store, as this one leaves them
    # (a prompt computed in one prefill and one read back from the store differ in the last bits).
    warm(client, messages=CHAT)
    on = client.chat.completions.create(**ask)
    off = client.chat.completions.create(**ask, extra_body=OFF)
    assert figures(on)["drafted_tokens"] > 0 and figures(off)["drafted_tokens"] == 0
    assert on.choices[0].message.content == off.choices[0].message.content
    got = chat_logprobs(on.choices[0])
    assert got == chat_logprobs(off.choices[0])          # bitwise, accepted and bonus tokens alike
    assert len(got) == on.usage.completion_tokens and all(len(top) == 3 for _, _, top in got)
    # Each token's bytes, joined, are the reply (its text decodes them, a broken UTF-8
    # sequence as U+FFFD).
    raw = bytes(b for e in on.choices[0].logprobs.content for b in e.bytes)
    assert raw.decode("utf-8", "replace") == on.choices[0].message.content
    if temperature == 0:      # greedy: each token is its distribution's most likely
        assert all(top[0] == (token, lp) for token, lp, top in got)

    # Streamed: the same figures, chunk by chunk.
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in chat_logprobs(c.choices[0])]
    assert streamed == got



def test_completion_logprobs_streamed_and_whole(http_server):
    client = openai_client(http_server)
    ask = dict(model="tiny", prompt="def foo(x):", max_tokens=20, temperature=0, logprobs=2)
    warm(client, prompt="def foo(x):")
    on = client.completions.create(**ask)
    off = client.completions.create(**ask, extra_body=OFF)
    assert figures(on)["drafted_tokens"] > 0
    lp = on.choices[0].logprobs
    assert lp.token_logprobs == off.choices[0].logprobs.token_logprobs
    assert lp.tokens == off.choices[0].logprobs.tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # (a dict by token text: two tokens that both read "\ufffd" share a key)
    assert all(1 <= len(top) <= 2 and max(top.values()) == p for top, p in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(client.completions.create(**ask, stream=True))
    assert [p for c in chunks if c.choices[0].logprobs for p in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs


def test_n_choices_each_seeded_and_reproducible(http_server):
    client = openai_client(http_server)
    ask = dict(model="tiny", messages=CHAT, max_tokens=16, temperature=1.0, seed=41, n=3)
    first = client.chat.completions.create(**ask)
    again = client.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1                  # each choice draws with its own seed
    # Choice i is the request with seed 41 + i alone, speculation off; usage counts them all.
    completion_tokens = 0
    for i, text in enumerate(texts):
        alone = client.chat.completions.create(**{**ask, "n": 1, "seed": 41 + i}, extra_body=OFF)
        assert alone.choices[0].message.content == text
        completion_tokens += alone.usage.completion_tokens
        assert alone.usage.prompt_tokens == first.usage.prompt_tokens
    assert first.usage.completion_tokens == completion_tokens
    assert len(figures(first)["choices"]) == 3
    # Streamed: every choice's pieces, told apart by index, add up to the same texts.
    pieces = ["", "", ""]
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            pieces[c.index] += c.delta.content or ""
    assert pieces == texts


def test_n_choices_share_the_prompts_cache(http_server):
    """The choices of one request prefill their prompt once: choices 1 and 2 take its full
    blocks from the prefix store (by reference on the paged cache), as requests with a shared
    system prompt do; each choice is still its seed's reply alone."""
    from specpair.prefix_cache import BLOCK_TOKENS

    engine = http_server.engine
    client = openai_client(http_server)
    system = "You keep a ledger of every colour you were ever asked about, in order. " * 6
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name one colour."}]
    ids = engine.encode(messages)
    blocks = BLOCK_TOKENS * ((len(ids) - 1) // BLOCK_TOKENS)     # all but the last token's block
    assert blocks >= 3 * BLOCK_TOKENS
    served = engine.prefix_stats.served
    ask = dict(model="tiny", messages=messages, max_tokens=8, temperature=1.0, seed=7, n=3)
    reply = client.chat.completions.create(**ask)
    assert reply.usage.prompt_tokens == len(ids) and len(reply.choices) == 3
    assert engine.prefix_stats.served - served >= 2 * blocks, (engine.prefix_stats, blocks)
    for i, choice in enumerate(reply.choices):
        alone = client.chat.completions.create(**{**ask, "n": 1, "seed": 7 + i}, extra_body=OFF)
        assert alone.choices[0].message.content == choice.message.content


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=12)
    role: str = pydantic.Field(json_schema_extra={"enum": ["admin", "user", "guest"]})
    age: int = pydantic.Field(ge=0, le=120)


def test_parse_helper_with_a_pydantic_model(http_server):
    client = openai_client(http_server)
    done = client.chat.completions.parse(model="tiny", messages=CHAT, max_tokens=80, temperature=0,
                                         response_format=Person)
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and figures(done)["drafted_tokens"] > 0


def test_json_schema_replies_validate_and_equal_target_only_for_50_prompts(http_server):
    schema = Person.model_json_schema()
    client = openai_client(http_server).with_options(timeout=300)    # 100 replies on 2 busy cores
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}

    def ask(i: int, extra: dict):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Describe person number {i}."}],
            max_tokens=80, temperature=0, response_format=fmt, extra_body=extra)
    with ThreadPoolExecutor(8) as pool:
        on = list(pool.map(lambda i: ask(i, {}), range(50)))
        off = list(pool.map(lambda i: ask(i, OFF), range(50)))
    drafted = accepted = 0
    for a, b in zip(on, off):
        Person.model_validate_json(a.choices[0].message.content)
        assert a.choices[0].message.content == b.choices[0].message.content
        drafted += figures(a)["drafted_tokens"]
        accepted += figures(a)["accepted_tokens"]
    assert drafted > 0 and 0 < accepted <= drafted


def test_json_object_replies_are_json_objects_equal_with_speculation_off(http_server):
    client = openai_client(http_server)
    ask = dict(model="tiny", messages=CHAT, max_tokens=60, temperature=0,
               response_format={"type": "json_object"})
    warm(client, messages=CHAT)      # both replies read the prompt's blocks from the store
    on = client.chat.completions.create(**ask)
    off = client.chat.completions.create(**ask, extra_body=OFF)
    assert on.choices[0].message.content == off.choices[0].message.content
    assert figures(on)["drafted_tokens"] > 0
    if on.choices[0].finish_reason == "stop":       # complete: an object (else cut at max_tokens)
        assert isinstance(json.loads(on.choices[0].message.content), dict)
    else:
        assert on.choices[0].message.content.startswith("{")


def test_structured_outputs_extension_regex_choice_and_grammar(http_server):
    client = openai_client(http_server)
    for outputs, check in [
        ({"regex": "(yes|no), because [a-z ]{3,12}\\."}, lambda t: t.startswith(("yes, ", "no, ")) and t.endswith(".")),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'start: "x=" NUM ";"\nNUM: /[0-9]{1,4}/'}, lambda t: t.startswith("x=") and t.endswith(";")),
    ]:
        on = client.completions.create(model="tiny", prompt="Answer:", max_tokens=30, temperature=0.7, seed=3,
                                       extra_body={"structured_outputs": outputs})
        off = client.completions.create(model="tiny", prompt="Answer:", max_tokens=30, temperature=0.7, seed=3,
                                        extra_body={"structured_outputs": outputs, **OFF})
        assert check(on.choices[0].text), (outputs, on.choices[0].text)
        assert on.choices[0].text == off.choices[0].text


@pytest.mark.parametrize("body, param, words", [
    ({"n": 17}, "n", ["must be in [1, 16]"]),
    ({"top_logprobs": 3}, "top_logprobs", ["needs logprobs: true"]),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", ["[0, 20]"]),
    ({"response_format": {"type": "xml"}}, "response_format.type", ["json_object or json_schema"]),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", ["required"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", ["does not compile"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", ["exactly one"]),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", ["does not compile"]),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", ["does not render tools"]),
    ({"logit_bias": {"1": 5}}, "logit_bias", ["not supported"]),
    # vLLM's sampling extensions and older names, which would change the reply if dropped.
    ({"repetition_penalty": 1.2}, "repetition_penalty", ["not supported"]),
    ({"min_p": 0.1}, "min_p", ["not supported"]),
    ({"min_tokens": 5}, "min_tokens", ["not supported"]),
    ({"ignore_eos": True}, "ignore_eos", ["not supported"]),
    ({"prompt_logprobs": 0}, "prompt_logprobs", ["not supported"]),
    ({"guided_json": {"type": "object"}}, "guided_json", ["structured_outputs"]),
    ({"modalities": ["text", "audio"]}, "modalities", ["text only"]),
    ({"repetition_penalty": "high"}, "repetition_penalty", ["must be"]),
])
def test_what_is_refused_names_its_field(http_server, body, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(http_server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,
                                                           extra_body=body)
    error = info.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    for w in words:
        assert w in error["message"], error


def test_fields_holding_the_value_that_asks_for_nothing_are_accepted(http_server):
    """vLLM clients send its defaults explicitly: those are no request to refuse."""
    neutral = {"repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0, "ignore_eos": False,
               "skip_special_tokens": True, "include_stop_str_in_output": False, "modalities": ["text"],
               "allowed_token_ids": None, "prompt_logprobs": None}
    reply = openai_client(http_server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=3,
                                                               extra_body=neutral)
    assert reply.usage.completion_tokens > 0
