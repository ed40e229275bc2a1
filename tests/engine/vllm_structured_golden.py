"""Golden prompts that ask for structure, as the vLLM gate sends them (gate/vllm.golden_requests)
to a real vLLM server: tests/engine/test_engine_vllm_peer.py runs them on its one server (no vLLM
start of their own) and checks what vLLM returned is judged as our engine's gate judges it."""

from __future__ import annotations

from tiny_models import make_tokenizer

# The tiny tokenizer's tokens with a template that renders tools (Hermes style), as
# tests/server/test_server_openai_tools.py uses: the gate renders tools through the target's own
# template, and the rendered ids are what vLLM receives.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}"
    "{{ t.function.name }}({{ t.function.parameters.properties | list | join(', ') }})\n"
    "{% endfor %}</tools>\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"enum": ["Ann", "Bob"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
GOLDEN = [
    {"prompt": "A person as JSON:", "category": "json",
     "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    {"prompt": "Someone else:", "category": "json", "structured_outputs": {"json": PERSON}},
    {"prompt": "Yes or no?", "category": "choice", "structured_outputs": {"choice": ["yes", "no"]}},
    {"prompt": "Four digits:", "category": "regex", "structured_outputs": {"regex": "[0-9]{4}"}},
    {"prompt": "The weather in Oslo for three days?", "category": "tools", "tools": [WEATHER],
     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"prompt": "Hello there", "category": "free"},
]
MAX_TOKENS = 128


def tools_tokenizer():
    return make_tokenizer(chat_template=HERMES_TEMPLATE)


def run_on(server) -> list:
    """Each golden prompt's (GoldenRequest, vLLM's Completion) from a real VllmServer."""
    from specpair.gate.vllm import golden_requests

    requests = golden_requests(tools_tokenizer(), GOLDEN, chat=True)
    return [(r, server.complete_greedy(r.ids, MAX_TOKENS, structured_outputs=r.structured_outputs))
            for r in requests]
