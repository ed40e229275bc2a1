"""Tools as the tests send them: a chat template that renders tools (Hermes style) on the tiny
tokenizer, and a function to call. The server's tool tests (tests/server/test_server_openai_tools.py)
and the vLLM gate's structured golden prompts (tests/engine/vllm_structured_golden.py) share them,
so the prompt vLLM is judged on is the one our server is tested with."""

from __future__ import annotations

from tiny_models import make_tokenizer

HERMES_TEMPLATE = (
    # Each tool as its name and parameters' names: the tiny tokenizer spends a token on most
    # characters of JSON, and the tiny model's context is 512.
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}"
    "{{ t.function.name }}({{ t.function.parameters.properties | list | join(', ') }})\n"
    "{% endfor %}</tools>\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


def tools_tokenizer():
    """The tiny tokenizer with HERMES_TEMPLATE (its tokens unchanged)."""
    return make_tokenizer(chat_template=HERMES_TEMPLATE)
