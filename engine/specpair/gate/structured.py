"""Golden prompts that ask for structure: a `response_format` (or vLLM's `structured_outputs`)
and `tools` / `tool_choice`, as a client sends them. The gate decodes them as the server would
(the grammar, the tools rendered by the chat template, a forced call through the grammar) and
judges each reply apart from the grammar that shaped it: schema validity (the reply parses and
its schema accepts it) and tool-call parsing (the reply is a call to one of the tools, with
arguments its parameters accept). A release whose rates fall under the floors is refused
(contract.threshold_failures), so a draft or target revision that breaks a team's JSON is caught
before it serves. The keys read are contract.GOLDEN_STRUCTURE_KEYS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specpair.errors import SpecpairError
from specpair.grammar import StructureError, reply_valid, request_structure
from specpair.tool_calls import ToolError, call_grammar, calls_valid, check_tools, render_prompt, style_of


@dataclass(frozen=True)
class GoldenAsk:
    """What one golden prompt asks beyond its text: the reply's structure (grammar.py's (kind,
    text)), and the tools with the tool_choice."""

    structure: tuple[str, str] | None = None     # from response_format / structured_outputs
    functions: tuple[dict, ...] = ()
    tool_choice: object = None

    @property
    def plain(self) -> bool:
        return self.structure is None and not self.functions


def golden_chat(prompt: dict, chat: bool) -> bool:
    """Whether the gate sends golden prompt `prompt` chat-formatted: its own `chat` where it says
    (a learned release's prompts of the category its draft was trained for say how that category
    was served: training_runner.learned_release), else the release's gating.chat."""
    own = prompt.get("chat")
    return own if isinstance(own, bool) else chat


def golden_ask(prompt: dict, index: int, chat: bool) -> GoldenAsk:
    """Golden prompt `index` -> what it asks; SpecpairError naming the field
    (`gating.prompts[3].response_format.type`) on anything the server would refuse."""
    where = f"gating.prompts[{index}]"
    for key in ("response_format", "structured_outputs"):
        if prompt.get(key) is not None and not isinstance(prompt[key], dict):
            raise SpecpairError(f"{where}.{key}: must be an object")
    try:
        structure = request_structure(prompt.get("response_format"), prompt.get("structured_outputs"))
    except StructureError as exc:
        raise SpecpairError(f"{where}.{exc.field}: {exc.reason}") from None
    tools, choice = prompt.get("tools"), prompt.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise SpecpairError(f"{where}.tool_choice: needs tools")
        return GoldenAsk(structure=structure)
    try:
        functions, forced = check_tools(tools, choice)
    except ToolError as exc:
        raise SpecpairError(f"{where}.{exc.field}: {exc.reason}") from None
    if not chat:
        raise SpecpairError(f"{where}.tools: tools are rendered by the chat template (gating.chat: true)")
    if forced is not None and structure is not None:
        raise SpecpairError(f"{where}.tool_choice: a forced tool call cannot be combined with response_format")
    if choice == "none":
        return GoldenAsk(structure=structure)
    return GoldenAsk(structure=structure, functions=tuple(functions), tool_choice=choice)


def prepared(tokenizer, text: str, ask: GoldenAsk, chat: bool) -> tuple[str, bool, tuple[str, str] | None]:
    """(the prompt to decode, whether the engine applies the chat template to it, the grammar's
    structure) of one golden prompt, as the server decodes the same request."""
    if not ask.functions:
        return text, chat, ask.structure
    style = style_of(getattr(tokenizer, "chat_template", None))
    try:
        rendered = render_prompt(tokenizer, [{"role": "user", "content": text}], list(ask.functions))
    except ToolError as exc:
        raise SpecpairError(f"golden prompt with tools: {exc.field}: {exc.reason}") from None
    forced = call_grammar(list(ask.functions), ask.tool_choice, style)
    return rendered, False, ("grammar", forced) if forced is not None else ask.structure


def vllm_structured_outputs(structure: tuple[str, str] | None) -> dict | None:
    """A golden prompt's structure (grammar.py's (kind, text)) as vLLM's `structured_outputs`
    request field, for the vLLM gate's requests (every vLLM we start decodes them with llguidance,
    JSON without free whitespace, as specpair.grammar does: vllm_peer.STRUCTURED_OUTPUTS). None:
    free text."""
    if structure is None:
        return None
    kind, text = structure
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        return {"json": json.loads(text)}
    if kind == "choice":
        return {"choice": json.loads(text)}
    if kind in ("regex", "grammar"):
        return {kind: text}
    raise SpecpairError(f"unknown structure kind {kind!r}")


def judged(tokenizer, ask: GoldenAsk, reply: str) -> dict:
    """{"schema_valid": bool | None, "tool_call_parsed": bool | None}: None where the prompt did
    not ask (or, for a Lark grammar, where nothing judges it apart from itself)."""
    out = {"schema_valid": None, "tool_call_parsed": None}
    if ask.structure is not None:
        out["schema_valid"] = reply_valid(ask.structure, reply)
    if ask.functions:
        out["tool_call_parsed"] = calls_valid(reply, style_of(getattr(tokenizer, "chat_template", None)),
                                              list(ask.functions))
    return out


def rate(values: list) -> float | None:
    """The share of True among the judged (None: not judged), rounded as the verdict's figures."""
    judged_values = [v for v in values if v is not None]
    return round(sum(judged_values) / len(judged_values), 4) if judged_values else None
