"""Tool calls: OpenAI's `tools` / `tool_choice` checked, the grammar that forces a call, and a
reply parsed into `tool_calls`. Pure functions: no torch, no server.

Two reply styles, told apart by the model's chat template:
  hermes  (Hermes, Qwen2/2.5/3, SmolLM3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
          one block per call, text before the first block is the reply's content;
  llama3  (Llama 3.1+ JSON tool calling): the reply is `{"name": ..., "parameters": {...}}`,
          optionally after `<|python_tag|>`, several separated by `;`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

HERMES, LLAMA3 = "hermes", "llama3"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


class ToolError(ValueError):
    """A `tools` or `tool_choice` the server refuses: (field, reason)."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str          # JSON text, as OpenAI's `function.arguments`
    id: str = ""


def style_of(chat_template: str | None) -> str:
    """The tool-call style a chat template writes (hermes unless it is Llama 3's)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "<|eom_id|>" in template or '"parameters"' in template:
        return LLAMA3
    return HERMES


def check_tools(tools, tool_choice) -> tuple[list[dict], str | None]:
    """-> (the tools' function specs, the tool a call must name: None for auto/none, "" for any
    (required), else its name). Raises ToolError naming the field."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools", "must be a non-empty array")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f"tools[{i}]", "only {\"type\": \"function\"} tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools[{i}].function.name", "required: a non-empty string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters", "must be a JSON schema object")
        functions.append({**fn, "parameters": params})
    names = [f["name"] for f in functions]
    if tool_choice is None or tool_choice in ("auto", "none"):
        return functions, None
    if tool_choice == "required":
        return functions, ""
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ToolError("tool_choice.function.name", f"{name!r} is not one of the tools: {', '.join(names)}")
        return functions, name
    raise ToolError("tool_choice", "must be none, auto, required or {\"type\": \"function\", "
                                   "\"function\": {\"name\": ...}}")


def render_prompt(tok, messages: list[dict], functions: list[dict]) -> str:
    """The prompt text with the tools, rendered by the tokenizer's own chat template. The engine
    tokenizes a text prompt with the tokenizer's special tokens, so a BOS the template wrote is
    cut here (not added twice). Raises ToolError: a template that does not render tools, or one
    that refuses the messages (a role order it does not take)."""
    template = getattr(tok, "chat_template", None) or ""
    if "tools" not in template:
        raise ToolError("tools", "this model's chat template does not render tools")
    try:
        text = tok.apply_chat_template(messages, tools=[{"type": "function", "function": f} for f in functions],
                                       add_generation_prompt=True, tokenize=False)
    except Exception as exc:     # the template's own refusal
        raise ToolError("messages", f"the chat template refused them: {exc}") from None
    bos = tok.bos_token
    if bos and text.startswith(bos) and tok("x", add_special_tokens=True)["input_ids"][:1] == [tok.bos_token_id]:
        text = text[len(bos):]
    return text


def call_grammar(functions: list[dict], tool_choice, style: str) -> str | None:
    """The grammar a `tool_choice` forces (`required`, a named function), else None."""
    _, forced = check_tools([{"type": "function", "function": f} for f in functions], tool_choice)
    return None if forced is None else forced_call_grammar(functions, forced, style)


def calls_valid(text: str, style: str, functions: list[dict]) -> bool:
    """Whether a reply parses into at least one call, each to one of the tools with arguments its
    parameters' schema accepts (the gate's tool-call parse rate)."""
    import jsonschema

    _, calls = parse_tool_calls(text, style)
    if not calls:
        return False
    by_name = {f["name"]: f["parameters"] for f in functions}
    for call in calls:
        if call.name not in by_name:
            return False
        schema = by_name[call.name]
        if not jsonschema.validators.validator_for(schema)(schema).is_valid(json.loads(call.arguments)):
            return False
    return True


def forced_call_grammar(functions: list[dict], name: str, style: str) -> str:
    """A Lark grammar (llguidance's, with %json) whose every sentence is one call in `style` to
    `name`, or to any of the functions when name is ""."""
    chosen = [f for f in functions if not name or f["name"] == name]
    key = "parameters" if style == LLAMA3 else "arguments"
    schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", key],
                         "properties": {"name": {"const": f["name"]}, key: f["parameters"]}}
                        for f in chosen],
              # One compact form: a model is not left free to pad the call with whitespace.
              "x-guidance": {"whitespace_flexible": False}}
    call = "%json " + json.dumps(schema)
    if style == LLAMA3:
        return f"start: call\ncall: {call}\n"
    return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {call}\n'


def parse_tool_calls(text: str, style: str) -> tuple[str | None, list[ToolCall]]:
    """A reply -> (its content, the calls in it). A reply with no well-formed call is content."""
    calls: list[ToolCall] = []
    if style == HERMES:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        for block in _HERMES_BLOCK.findall(text[start:]):
            call = _call(block, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].strip()
        return (content or None), calls
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    for part in _split_json_objects(body):
        call = _call(part, "parameters") or _call(part, "arguments")
        if call is None:
            return text, []
        calls.append(call)
    return (None, calls) if calls else (text, [])


def _call(block: str, key: str) -> ToolCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str) and key in value):
        return None
    return ToolCall(name=value["name"], arguments=_arguments_text(block, key, value[key]),
                    id=new_call_id())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments_text(block: str, key: str, value) -> str:
    """The arguments as the model wrote them (what a stream sends piece by piece, so a streamed
    call and a whole one read alike), or re-serialised where they cannot be found as written."""
    at = re.search(r'"%s"\s*:\s*' % key, block)
    if at:
        try:
            found, end = json.JSONDecoder().raw_decode(block, at.end())
            if found == value:
                return block[at.end():end]
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at text[start] ends (one past its closing
    bracket), None while it is still open. Brackets inside strings do not count."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class CallStream:
    """A reply's tool calls as OpenAI streams them (`delta.tool_calls`): first a call's index, id,
    type and name with empty arguments, then its arguments piece by piece, as the text arrives.

    Hermes style is streamed as it is written: content before the first `<tool_call>` (held where
    it may be the start of one, and trailing whitespace held), a call once its name is whole,
    then its arguments (an object or array) as the model writes them. Llama 3's JSON style and
    anything not written name-first are sent whole when the reply ends (`finish`), which also
    sends what the whole reply's parse has beyond what was streamed, so the streamed deltas add
    up to the non-streamed message."""

    def __init__(self, style: str):
        self.style = style
        self.text = ""
        self._content_sent = 0
        self._calls: list[dict] = []          # per call: id, name, arguments sent so far

    def feed(self, piece: str) -> list[dict]:
        """New text -> the deltas it completes (each a chat delta dict)."""
        self.text += piece
        if self.style != HERMES:
            return []
        out = []
        start = self.text.find("<tool_call>")
        if start < 0:
            safe = len(self.text)
            for n in range(min(len("<tool_call>") - 1, len(self.text)), 0, -1):
                if "<tool_call>".startswith(self.text[-n:]):
                    safe -= n
                    break
            content_end = len(self.text[:safe].rstrip())
        else:
            content_end = len(self.text[:start].rstrip()) if self.text[:start].strip() else 0
        if content_end > self._content_sent:
            out.append({"content": self.text[self._content_sent:content_end]})
            self._content_sent = content_end
        if start < 0:
            return out
        blocks = self.text[start:].split("<tool_call>")[1:]
        for index, block in enumerate(blocks):
            block = block.split("</tool_call>")[0]
            named = _NAME.match(block)
            if named is None:
                break           # not name-first (or not yet): finish sends it
            if index == len(self._calls):
                if index and not self._calls[index - 1]["closed"]:
                    break
                name = json.loads(f'"{named.group(1)}"')
                self._calls.append({"id": new_call_id(), "name": name, "sent": "", "closed": False})
                out.append({"tool_calls": [{"index": index, "id": self._calls[index]["id"], "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            call = self._calls[index]
            if call["closed"] or named.end() >= len(block) or block[named.end()] not in "{[":
                continue
            end = _value_end(block, named.end())
            written = block[named.end():end if end is not None else len(block)]
            if len(written) > len(call["sent"]) and written.startswith(call["sent"]):
                out.append({"tool_calls": [{"index": index, "function": {"arguments": written[len(call["sent"]):]}}]})
                call["sent"] = written
            call["closed"] = end is not None
        return out

    def finish(self) -> tuple[list[dict], bool]:
        """The reply is whole -> (the deltas still owed, whether it called a tool)."""
        content, calls = parse_tool_calls(self.text, self.style)
        out = []
        if not calls:
            if len(self.text) > self._content_sent:
                out.append({"content": self.text[self._content_sent:]})
            return out, False
        if not self._calls and content and self._content_sent == 0:
            out.append({"content": content})
        for index, call in enumerate(calls):
            if index < len(self._calls) and self._calls[index]["name"] == call.name:
                sent = self._calls[index]["sent"]
                rest = call.arguments[len(sent):] if call.arguments.startswith(sent) else ""
                if rest:
                    out.append({"tool_calls": [{"index": index, "function": {"arguments": rest}}]})
                continue
            out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": call.arguments}}]})
        return out, True


def _split_json_objects(body: str) -> list[str]:
    """`{...}; {...}` -> each object's text (raw_decode finds where each ends)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    body = body.strip()
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except ValueError:
            return [body]       # not JSON: _call refuses it, the reply is content
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return parts
