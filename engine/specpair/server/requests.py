"""Checking a GenerateRequest before it reaches the engine: pure functions, no gRPC, no torch.

Every rejection names the field and the reason ("max_new_tokens: must be >= 1, got 0"), so a
client can fix its request without reading server logs. Limits a client could abuse to slow the
server for everyone (giant requests, many long stop strings, unbounded metric label values) are
checked here too.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor

from specpair import contract
from specpair.config import SEED_LIMIT, GenerationParams

CHAT_ROLES = ("system", "user", "assistant", "tool")
CATEGORY_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# Requests without a category are counted (and judged by drift) in the gate's default one.
DEFAULT_CATEGORY = contract.DEFAULT_CATEGORY
DEFAULT_MAX_NEW_TOKENS = 64
# Temperatures this close to 0 overflow logits / T to inf (NaN probabilities); 0 means greedy.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
MAX_SPECULATION_K = contract.MAX_SPECULATION_K
# Alternatives a request may ask to see beside each token's log-probability (OpenAI's and vLLM's
# default limit).
MAX_TOP_LOGPROBS = 20


class InvalidField(Exception):
    """A request field the server refuses; becomes INVALID_ARGUMENT "field: reason" (HTTP 400)."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


class TooLarge(InvalidField):
    """A request or prompt beyond a size limit: INVALID_ARGUMENT over gRPC, 413 over HTTP."""


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 1 << 20
    max_new_tokens: int = 1024
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_chat_messages: int = 256
    max_request_id_chars: int = 128


@dataclass
class RequestFields:
    """One generation request as plain values, whichever protocol carried it (None: not set).

    Field names in refusals are the gRPC ones (`max_new_tokens`, `chat.messages[1].role`); the HTTP
    front translates them to its own (`max_tokens`, `messages[1].role`).
    """

    prompt: str | None = None
    prompt_field: str = "prompt"                  # which field held the text prompt
    messages: list[tuple[str, str]] | None = None   # chat (role, content): the server applies the template
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    speculation_k: int | None = None              # None: the engine's k; 0: off
    category: str = ""
    request_id: str = ""
    logprobs: int | None = None                   # top alternatives per token (0: the token's own); None: none
    structure: tuple[str, str] | None = None      # constrained decoding (grammar.py); checked by the front


@dataclass
class CheckedRequest:
    """What the engine needs: a prompt (text or chat messages) and validated decoding params."""

    prompt: str | list[dict]
    chat: bool
    params: GenerationParams
    prompt_field: str          # the field to blame when the prompt is too long for the context
    fill_context: bool = False  # no max_new_tokens given and no default: as many as limit and context allow


def check_size(num_bytes: int, limits: Limits) -> None:
    if num_bytes > limits.max_request_bytes:
        raise TooLarge("request", f"{num_bytes} bytes is more than the limit of {limits.max_request_bytes} bytes")


def generate_fields(request) -> RequestFields:
    """GenerateRequest (protobuf) -> RequestFields: the values as its client wrote them.

    float fields travel as float32: 0.01 arrives as 0.009999999776; it is read back as the
    shortest decimal that float32 rounds to the same value, so bounds hold as documented.
    """
    which = request.WhichOneof("input")
    fields = RequestFields(
        max_new_tokens=request.max_new_tokens if request.HasField("max_new_tokens") else None,
        temperature=float32_as_written(request.temperature) if request.HasField("temperature") else None,
        top_p=float32_as_written(request.top_p) if request.HasField("top_p") else None,
        top_k=request.top_k if request.HasField("top_k") else None,
        seed=request.seed if request.HasField("seed") else None,
        stop=tuple(request.stop), category=request.category, request_id=request.request_id)
    if which == "prompt_utf8":
        try:
            fields.prompt = request.prompt_utf8.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidField("prompt_utf8", f"malformed UTF-8: byte 0x{request.prompt_utf8[exc.start]:02x} "
                                              f"at offset {exc.start} ({exc.reason})") from None
        fields.prompt_field = "prompt_utf8"
    elif which == "prompt":
        fields.prompt = request.prompt
    elif which == "chat":
        fields.messages = [(m.role, m.content) for m in request.chat.messages]
    if request.HasField("speculation"):
        if request.speculation.off:
            fields.speculation_k = 0
        elif request.speculation.k:
            fields.speculation_k = request.speculation.k
    return fields


def float32_as_written(value: float) -> float:
    """The shortest decimal (as a float) that float32 rounds to `value`: what the client wrote."""
    if not math.isfinite(value):
        return value
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == packed:
            return short
    return value


def check_fields(fields: RequestFields, limits: Limits, *, vocab_size: int | None = None,
                 default_max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS) -> CheckedRequest:
    """The one check of a generation request, for every protocol: RequestFields -> CheckedRequest.

    Every value is checked against the range of what it becomes (a tensor of int64 or float32, a
    torch.Generator seed, UTF-8 for the tokenizer), so nothing a client sends can make a step
    raise. vocab_size: the target's vocabulary, top_k's upper bound (None: not checked).
    default_max_new_tokens=None: a request without max_new_tokens gets as many tokens as the
    server's limit and the model's context allow (see fit_context), as OpenAI's API does.
    """
    for name in ("max_new_tokens", "top_k", "seed", "speculation_k", "logprobs"):
        value = getattr(fields, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidField(_FIELD_NAMES.get(name, name), f"must be an integer, got {value!r}")
    for name in ("temperature", "top_p"):
        value = getattr(fields, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InvalidField(name, f"must be a number, got {value!r}")
    if len(fields.request_id) > limits.max_request_id_chars:
        raise InvalidField("request_id", f"at most {limits.max_request_id_chars} characters")
    _check_encodes("request_id", fields.request_id)
    if fields.messages is not None:
        prompt, chat = _check_chat(fields.messages, limits), True
    elif fields.prompt is not None:
        prompt, chat = _check_text(fields.prompt_field, fields.prompt), False
    else:
        raise InvalidField("prompt", "empty prompt: set prompt, prompt_utf8 or chat")

    fill = fields.max_new_tokens is None and default_max_new_tokens is None
    max_new = fields.max_new_tokens if fields.max_new_tokens is not None else \
        (default_max_new_tokens or limits.max_new_tokens)
    if max_new <= 0:
        raise InvalidField("max_new_tokens", f"must be >= 1, got {max_new}")
    if max_new > limits.max_new_tokens:
        raise InvalidField("max_new_tokens", f"{max_new} is beyond this server's limit of {limits.max_new_tokens}")

    temperature = fields.temperature if fields.temperature is not None else 0.0
    if not math.isfinite(temperature):
        raise InvalidField("temperature", f"must be a finite number, got {temperature}")
    if temperature < 0:
        raise InvalidField("temperature", f"must be >= 0 (0 = greedy), got {temperature:g}")
    if 0 < temperature < MIN_TEMPERATURE or temperature > MAX_TEMPERATURE:
        raise InvalidField("temperature", f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                                          f"{MAX_TEMPERATURE:g}], got {temperature:g}")

    top_p = fields.top_p if fields.top_p is not None else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidField("top_p", f"must be in (0, 1], got {top_p:g}")
    top_k = fields.top_k if fields.top_k is not None else 0
    if top_k < 0:
        raise InvalidField("top_k", f"must be >= 0 (0 = off), got {top_k}")
    if vocab_size is not None and top_k > vocab_size:
        raise InvalidField("top_k", f"must be at most the vocabulary size {vocab_size} (0 = off), got {top_k}")
    if fields.seed is not None and not 0 <= fields.seed < SEED_LIMIT:
        raise InvalidField("seed", f"must be in [0, 2**64), got {fields.seed}")

    if len(fields.stop) > limits.max_stop_strings:
        raise InvalidField("stop", f"at most {limits.max_stop_strings} stop strings, got {len(fields.stop)}")
    for i, s in enumerate(fields.stop):
        if not s:
            raise InvalidField(f"stop[{i}]", "empty stop string")
        if len(s) > limits.max_stop_chars:
            raise InvalidField(f"stop[{i}]", f"at most {limits.max_stop_chars} characters")
        _check_encodes(f"stop[{i}]", s)

    speculation_k = fields.speculation_k
    if speculation_k is not None and speculation_k < 0:
        raise InvalidField("speculation.k", f"must be >= 0 (0 = off), got {speculation_k}")
    if speculation_k is not None and speculation_k > MAX_SPECULATION_K:
        raise InvalidField("speculation.k", f"must be <= {MAX_SPECULATION_K}, got {speculation_k}")

    if fields.logprobs is not None and not 0 <= fields.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidField("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {fields.logprobs}")

    category = fields.category or DEFAULT_CATEGORY
    if not CATEGORY_PATTERN.fullmatch(category):
        raise InvalidField("category", "1-64 characters from A-Z a-z 0-9 _ . -")

    params = GenerationParams(max_new_tokens=max_new, temperature=float(temperature), top_k=top_k,
                              top_p=float(top_p), seed=fields.seed, stop=tuple(fields.stop),
                              speculation_k=speculation_k, category=category,
                              logprobs=fields.logprobs, structure=fields.structure)
    return CheckedRequest(prompt=prompt, chat=chat, params=params,
                          prompt_field="chat" if chat else fields.prompt_field, fill_context=fill)


# RequestFields attribute -> the field a refusal names
_FIELD_NAMES = {"speculation_k": "speculation.k"}


def _check_encodes(field: str, text: str) -> None:
    """Text the tokenizer can take: UTF-8-encodable (JSON's "\\ud800", a lone surrogate, is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidField(field, f"not valid Unicode: U+{ord(text[exc.start]):04X} at character "
                                  f"{exc.start} ({exc.reason})") from None


def _check_text(field: str, text: str) -> str:
    if not isinstance(text, str):
        raise InvalidField(field, "must be a string")
    if not text.strip():
        raise InvalidField(field, "empty prompt")
    _check_encodes(field, text)
    return text


def _check_chat(messages, limits: Limits) -> list[dict]:
    if not messages:
        raise InvalidField("chat.messages", "empty prompt: at least one message is needed")
    if len(messages) > limits.max_chat_messages:
        raise InvalidField("chat.messages", f"at most {limits.max_chat_messages} messages, got {len(messages)}")
    out = []
    for i, (role, content) in enumerate(messages):
        if role not in CHAT_ROLES:
            raise InvalidField(f"chat.messages[{i}].role",
                               f"unknown chat role {role!r}; use one of {', '.join(CHAT_ROLES)}")
        _check_encodes(f"chat.messages[{i}].content", content)
        out.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise InvalidField("chat.messages", "empty prompt: every message is empty")
    return out


def fit_context(checked: CheckedRequest, prompt_tokens: int, context_length: int) -> None:
    """After tokenizing: the prompt and the reply must fit the context (an open-ended request is
    cut to what fits)."""
    if checked.fill_context and prompt_tokens < context_length:
        checked.params = dataclasses.replace(
            checked.params, max_new_tokens=min(checked.params.max_new_tokens, context_length - prompt_tokens))
    check_context(prompt_tokens, checked.params.max_new_tokens, context_length, checked.prompt_field)


def check_context(prompt_tokens: int, max_new_tokens: int, context_length: int, prompt_field: str) -> None:
    """The prompt and the reply must fit the target's context window."""
    if prompt_tokens >= context_length:
        raise TooLarge(prompt_field, f"prompt has {prompt_tokens} tokens; the model's context "
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
