"""Checking a GenerateRequest before it reaches the engine: pure functions, no gRPC, no torch.

Every rejection names the field and the reason ("max_new_tokens: must be >= 1, got 0"), so a
client can fix its request without reading server logs. Limits a client could abuse to slow the
server for everyone (giant requests, many long stop strings, unbounded metric label values) are
checked here too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor

from specpair import contract
from specpair.config import GenerationParams

CHAT_ROLES = ("system", "user", "assistant", "tool")
CATEGORY_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# Requests without a category are counted (and judged by drift) in the gate's default one.
DEFAULT_CATEGORY = contract.DEFAULT_CATEGORY
DEFAULT_MAX_NEW_TOKENS = 64
# Temperatures this close to 0 overflow logits / T to inf (NaN probabilities); 0 means greedy.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0


class InvalidField(Exception):
    """A request field the server refuses; becomes INVALID_ARGUMENT "field: reason"."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 1 << 20
    max_new_tokens: int = 1024
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_chat_messages: int = 256
    max_request_id_chars: int = 128


@dataclass
class CheckedRequest:
    """What the engine needs: a prompt (text or chat messages) and validated decoding params."""

    prompt: str | list[dict]
    chat: bool
    params: GenerationParams
    prompt_field: str          # the field to blame when the prompt is too long for the context


def check_generate(request, limits: Limits) -> CheckedRequest:
    """GenerateRequest (protobuf) -> CheckedRequest, or InvalidField."""
    if len(request.request_id) > limits.max_request_id_chars:
        raise InvalidField("request_id", f"at most {limits.max_request_id_chars} characters")
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidField("prompt", "empty prompt: set prompt, prompt_utf8 or chat")
    if which == "prompt_utf8":
        try:
            text = request.prompt_utf8.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidField("prompt_utf8", f"malformed UTF-8: byte 0x{request.prompt_utf8[exc.start]:02x} "
                                              f"at offset {exc.start} ({exc.reason})") from None
        prompt, chat = _check_text("prompt_utf8", text), False
    elif which == "prompt":
        prompt, chat = _check_text("prompt", request.prompt), False
    else:
        prompt, chat = _check_chat(request.chat.messages, limits), True

    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    if max_new <= 0:
        raise InvalidField("max_new_tokens", f"must be >= 1, got {max_new}")
    if max_new > limits.max_new_tokens:
        raise InvalidField("max_new_tokens", f"{max_new} is beyond this server's limit of {limits.max_new_tokens}")

    temperature = request.temperature if request.HasField("temperature") else 0.0
    if not math.isfinite(temperature):
        raise InvalidField("temperature", f"must be a finite number, got {temperature}")
    if temperature < 0:
        raise InvalidField("temperature", f"must be >= 0 (0 = greedy), got {temperature:g}")
    if 0 < temperature < MIN_TEMPERATURE or temperature > MAX_TEMPERATURE:
        raise InvalidField("temperature", f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                                          f"{MAX_TEMPERATURE:g}], got {temperature:g}")

    top_p = request.top_p if request.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidField("top_p", f"must be in (0, 1], got {top_p:g}")
    top_k = request.top_k if request.HasField("top_k") else 0
    if top_k < 0:
        raise InvalidField("top_k", f"must be >= 0 (0 = off), got {top_k}")

    if len(request.stop) > limits.max_stop_strings:
        raise InvalidField("stop", f"at most {limits.max_stop_strings} stop strings, got {len(request.stop)}")
    for i, s in enumerate(request.stop):
        if not s:
            raise InvalidField(f"stop[{i}]", "empty stop string")
        if len(s) > limits.max_stop_chars:
            raise InvalidField(f"stop[{i}]", f"at most {limits.max_stop_chars} characters")

    speculation_k = None
    if request.HasField("speculation"):
        if request.speculation.off:
            speculation_k = 0
        elif request.speculation.k:
            speculation_k = request.speculation.k
            if speculation_k > 32:
                raise InvalidField("speculation.k", f"must be <= 32, got {speculation_k}")

    category = request.category or DEFAULT_CATEGORY
    if not CATEGORY_PATTERN.fullmatch(category):
        raise InvalidField("category", "1-64 characters from A-Z a-z 0-9 _ . -")

    params = GenerationParams(max_new_tokens=max_new, temperature=float(temperature), top_k=top_k,
                              top_p=float(top_p), seed=request.seed if request.HasField("seed") else None,
                              stop=tuple(request.stop), speculation_k=speculation_k, category=category)
    return CheckedRequest(prompt=prompt, chat=chat, params=params,
                          prompt_field="chat" if chat else which)


def _check_text(field: str, text: str) -> str:
    if not text.strip():
        raise InvalidField(field, "empty prompt")
    return text


def _check_chat(messages, limits: Limits) -> list[dict]:
    if not messages:
        raise InvalidField("chat.messages", "empty prompt: at least one message is needed")
    if len(messages) > limits.max_chat_messages:
        raise InvalidField("chat.messages", f"at most {limits.max_chat_messages} messages, got {len(messages)}")
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidField(f"chat.messages[{i}].role",
                               f"unknown chat role {m.role!r}; use one of {', '.join(CHAT_ROLES)}")
        out.append({"role": m.role, "content": m.content})
    if not any(m["content"].strip() for m in out):
        raise InvalidField("chat.messages", "empty prompt: every message is empty")
    return out


def check_context(prompt_tokens: int, max_new_tokens: int, context_length: int, prompt_field: str) -> None:
    """The prompt and the reply must fit the target's context window."""
    if prompt_tokens >= context_length:
        raise InvalidField(prompt_field, f"prompt has {prompt_tokens} tokens; the model's context "
                                         f"is {context_length}")
    if prompt_tokens + max_new_tokens > context_length:
        raise InvalidField("max_new_tokens", f"{max_new_tokens} new tokens after a {prompt_tokens}-token "
                                             f"prompt exceed the model's context of {context_length}")


# -- malformed UTF-8 in string fields -----------------------------------------------------------

def find_invalid_utf8(data: bytes, descriptor, prefix: str = "") -> str | None:
    """The path of the first string field whose bytes are not UTF-8 ("chat.messages[1].content").

    protobuf refuses to parse such a message at all and says only which message type failed; this
    walks the wire format with the message's descriptor to name the field for the client.
    Returns None when no string field is malformed (the bytes are broken some other way).
    """
    counts: dict[str, int] = {}
    pos, end = 0, len(data)
    try:
        while pos < end:
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
                continue
            if wire_type == 1:
                pos += 8
                continue
            if wire_type == 5:
                pos += 4
                continue
            if wire_type != 2:
                return None
            length, pos = _varint(data, pos)
            chunk, pos = data[pos:pos + length], pos + length
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            name = prefix + field.name
            if is_repeated(field):
                index = counts.get(field.name, 0)
                counts[field.name] = index + 1
                name = f"{name}[{index}]"
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                inner = find_invalid_utf8(chunk, field.message_type, name + ".")
                if inner:
                    return inner
    except IndexError:
        return None
    return None


def is_repeated(field) -> bool:
    # protobuf 5+ exposes is_repeated; older releases only the label.
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")
