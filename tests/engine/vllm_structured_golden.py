"""Golden prompts that ask for structure, as the vLLM gate sends them (gate/vllm.golden_requests)
to a real vLLM server: tests/engine/test_engine_vllm_peer.py runs them on its one server (no vLLM
start of their own) and checks each reply is valid as our engine's gate judges it and equal to our
engine's greedy reply under the same grammar."""

from __future__ import annotations

# The tools and the template that renders them are the server's tool tests' too (tool_fixtures).
from tool_fixtures import WEATHER, tools_tokenizer  # noqa: F401

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"enum": ["Ann", "Bob"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
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


def run_on(server) -> list:
    """Each golden prompt's (GoldenRequest, vLLM's Completion) from a real VllmServer."""
    from specpair.gate.vllm import golden_requests

    requests = golden_requests(tools_tokenizer(), GOLDEN, chat=True)
    return [(r, server.complete_greedy(r.ids, MAX_TOKENS, structured_outputs=r.structured_outputs))
            for r in requests]
