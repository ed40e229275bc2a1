"""The OpenAI-compatible HTTP front: /v1/chat/completions, /v1/completions, /v1/models, /health.

Starlette on uvicorn, in its own thread and event loop, in front of the same EngineWorker (so the
same continuous batch) as the gRPC service. A request is read into `RequestFields` and enters
through the gRPC service's `Admission` (admission.py): the one check of the limits both protocols
enforce, tokenizing, the context fit, the queue; refusals come back in OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}`:

    400 bad input (the field in `param`, in OpenAI's names: `max_tokens`, `messages[1].role`)
    401 a bearer token is required and missing or wrong (--auth-token-file)
    404 a `model` this server does not serve
    408 a request that did not arrive in full within --http-read-timeout (the connection closes,
        after reading what the client still sends for a moment: it reads the 408, not a reset);
        a kept-alive connection idle that long between requests is closed
    413 a body over --max-request-bytes, or a prompt the model's context cannot hold
    429 the request queue is full (Retry-After: 1)
    503 models still loading, or the server draining

`stream: true` answers server-sent events (`data: {chunk}` ... `data: [DONE]`); a client that goes
away mid-reply is cancelled and its batch slot freed at the next engine step. The final chunk (or
the response) carries this request's speculation figures in the extension field `specpair`.
Extension request fields: `top_k`, and `specpair: {"k": 0 (off) .. 32, "category": "code"}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import socket
import ssl
import threading
import time
import uuid

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from google.protobuf.json_format import MessageToDict
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specpair.contract import DEFAULT_CATEGORY
from specpair.server.admission import Admission
from specpair.server.auth import bearer_token_matches
from specpair.config import SEED_LIMIT
from specpair.grammar import StructureError, request_structure
from specpair.server.requests import MAX_TOP_LOGPROBS, InvalidField, RequestFields, TooLarge, check_size
from specpair.server.worker import Failed, Finished, Job, NotAccepting, QueueFull, Tokens
from specpair.tool_calls import (CallStream, ToolError, check_tools, forced_call_grammar, parse_tool_calls,
                                 render_prompt, style_of)

log = logging.getLogger("specpair.server.http")

PROTOCOL = "http"
# Roles OpenAI accepts that the chat template knows under another name.
ROLE_ALIASES = {"developer": "system"}
# Choices one request may ask for (`n`): each is a row of the batch.
MAX_CHOICES = 16


class APIError(Exception):
    """An error answered in OpenAI's shape. `count`: a generation request refused (metrics)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None, count: str | None = "invalid"):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers, self.count = headers, count

    def uncounted(self) -> "APIError":
        self.count = None
        return self

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


def bad_request(param: str | None, reason: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {reason}" if param else reason, param=param, code=code)


def from_invalid(exc: InvalidField, max_tokens_name: str) -> APIError:
    """The shared checker names gRPC fields; say them as an OpenAI client wrote them."""
    field = exc.field
    if field == "request":
        param = None
    elif field.startswith("chat.messages"):
        param = "messages" + field[len("chat.messages"):]
    elif field == "chat":
        param = "messages"
    elif field == "max_new_tokens":
        param = max_tokens_name
    elif field in ("speculation.k", "category"):
        param = "specpair." + field.split(".")[-1]
    else:
        param = field
    if isinstance(exc, TooLarge):
        code = "context_length_exceeded" if field != "request" else "request_too_large"
        return APIError(413, f"{param}: {exc.reason}" if param else exc.reason, param=param, code=code)
    return bad_request(param, exc.reason)


# -- reading a request body ------------------------------------------------------------------------

_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
          dict: "an object"}


def _get(body: dict, name: str, kind, default=None):
    """body[name] if it has the JSON type asked for (a number may be an integer; a boolean is never
    a number), None/absent -> default, anything else a 400 naming the field."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:     # an integer beyond any float
            raise bad_request(name, f"must be a finite number, got {str(value)[:40]}...") from None
    if not ok:
        raise bad_request(name, f"must be {_KINDS[kind]}, got {json.dumps(value)[:40]}")
    return value


def choices_asked(body: dict) -> int:
    """`n`: how many choices, each decoded as its own row (1 .. MAX_CHOICES)."""
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request("n", f"must be in [1, {MAX_CHOICES}], got {n}")
    return n


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: the request's plus the index (as vLLM numbers them), within 64 bits."""
    return seed if seed is None or not 0 <= seed < SEED_LIMIT else (seed + index) % SEED_LIMIT


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: `logprobs: true` and `top_logprobs: 0..20`; completions: `logprobs: 0..20` (the
    alternatives' count). -> alternatives per token, or None (no log-probabilities)."""
    if chat:
        top = _get(body, "top_logprobs", int)
        if not _get(body, "logprobs", bool, False):
            if top is not None:
                raise bad_request("top_logprobs", "needs logprobs: true")
            return None
        top = top if top is not None else 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        return top
    top = _get(body, "logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return top


def _structure(body: dict) -> tuple[str, str] | None:
    """The reply's constraint (`response_format`, or vLLM's `structured_outputs`) as grammar.py
    reads it; None: free text. A bad one is refused naming its field."""
    try:
        return request_structure(_get(body, "response_format", dict, {}), _get(body, "structured_outputs", dict, {}))
    except StructureError as exc:
        raise bad_request(exc.field, exc.reason) from None


# Fields clients (vLLM's among them) send that would change the reply if they were dropped:
# refused by name unless they hold the value that asks for nothing. name -> (JSON type, that
# value (None: any value asks for something), why).
_CHANGES_THE_REPLY = {
    "repetition_penalty": (float, 1.0, "repetition penalties are not supported by this server (1 only)"),
    "min_p": (float, 0.0, "min_p is not supported by this server (0 only)"),
    "min_tokens": (int, 0, "min_tokens is not supported by this server (0 only)"),
    "ignore_eos": (bool, False, "ignore_eos is not supported by this server (false only)"),
    "use_beam_search": (bool, False, "beam search is not supported by this server"),
    "length_penalty": (float, 1.0, "length_penalty (beam search) is not supported by this server"),
    "prompt_logprobs": (int, None, "prompt_logprobs are not supported by this server"),
    "allowed_token_ids": (list, [], "allowed_token_ids is not supported by this server"),
    "bad_words": (list, [], "bad_words is not supported by this server"),
    "include_stop_str_in_output": (bool, False, "the stop string is never included (false only)"),
    "skip_special_tokens": (bool, True, "special tokens are always skipped in the text (true only)"),
    "truncate_prompt_tokens": (int, None, "prompts are never truncated: one too long is refused"),
}
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend")


def _refuse_unsupported(body: dict, chat: bool) -> None:
    if not chat:
        if _get(body, "echo", bool, False):
            raise bad_request("echo", "echo is not supported by this server")
        if _get(body, "best_of", int, 1) != 1:
            raise bad_request("best_of", "only best_of=1 is supported")
        if body.get("suffix"):
            raise bad_request("suffix", "suffix is not supported by this server")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, float, 0.0) != 0.0:
            raise bad_request(name, "penalties are not supported by this server (0 only)")
    if _get(body, "logit_bias", dict, {}):
        raise bad_request("logit_bias", "logit_bias is not supported by this server")
    if _get(body, "functions", list, []):
        raise bad_request("functions", "the legacy functions field is not supported: send tools")
    for name, (kind, neutral, reason) in _CHANGES_THE_REPLY.items():
        value = _get(body, name, kind)
        if value is not None and value != neutral:
            raise bad_request(name, reason)
    for name in _GUIDED:
        if body.get(name) is not None:
            raise bad_request(name, "vLLM's removed guided_* fields are not supported: send "
                                    "structured_outputs (json, regex, choice or grammar) or response_format")
    modalities = _get(body, "modalities", list, ["text"])
    if modalities != ["text"] or body.get("audio") is not None:
        raise bad_request("modalities" if modalities != ["text"] else "audio",
                          "this server replies in text only")
    if not chat and body.get("tools"):
        raise bad_request("tools", "tools are for /v1/chat/completions")


def _messages(body: dict) -> list[tuple[str, str]]:
    messages = _get(body, "messages", list)
    if messages is None:
        raise bad_request("messages", "required")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}]", "must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise bad_request(f"messages[{i}].role", "must be a string")
        if content is None:
            content = ""
        elif isinstance(content, list):     # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad_request(f"messages[{i}].content[{j}]", "only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content", "must be a string or an array of text parts")
        out.append((ROLE_ALIASES.get(role, role), content))
    return out


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise bad_request("prompt", f"one prompt per request, got {len(prompt)}")
    if prompt is None:
        raise bad_request("prompt", "required")
    if not isinstance(prompt, str):
        raise bad_request("prompt", "must be a string (token arrays are not supported)")
    return prompt


def request_fields(body: dict, chat: bool) -> tuple[RequestFields, str]:
    """A chat or completion request body -> RequestFields, and the name its client used for max tokens."""
    _refuse_unsupported(body, chat)
    fields = RequestFields()
    if chat:
        fields.messages = _messages(body)
    else:
        fields.prompt = _prompt(body)
    max_tokens_name = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens_name = "max_completion_tokens"
    fields.max_new_tokens = _get(body, max_tokens_name, int)
    fields.temperature = _get(body, "temperature", float)
    fields.top_p = _get(body, "top_p", float)
    fields.top_k = _get(body, "top_k", int)
    if fields.top_k == -1:     # vLLM's spelling of "no top-k filter"
        fields.top_k = 0
    fields.seed = _get(body, "seed", int)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("stop", "must be a string or an array of strings")
    fields.stop = tuple(stop or ())
    ext = _get(body, "specpair", dict, {})
    k = ext.get("k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise bad_request("specpair.k", "must be an integer (0: speculation off for this request)")
    fields.speculation_k = k
    category = ext.get("category", "")
    if not isinstance(category, str):
        raise bad_request("specpair.category", "must be a string")
    fields.category = category
    fields.logprobs = _logprobs(body, chat)
    fields.structure = _structure(body)
    return fields, max_tokens_name


def speculation_figures(event: Finished) -> dict:
    """This request's speculation, for the final chunk / response's `specpair` field."""
    s = event.stats
    return {"drafts": s.num_drafts, "drafted_tokens": s.num_draft_tokens, "accepted_tokens": s.num_accepted_tokens,
            "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length,
            "accepted_per_position": list(s.num_accepted_tokens_per_pos), "target_steps": s.num_target_steps,
            "queue_seconds": event.queue_seconds, "time_to_first_token_seconds": event.time_to_first_token,
            "total_seconds": event.total_seconds}


def usage(event: Finished) -> dict:
    """OpenAI's usage, with the prompt tokens served from the prefix store as its
    `prompt_tokens_details.cached_tokens` (prefix_cache.py)."""
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}


def call_chunks(reply: "Reply", calls: CallStream, index: int, event) -> list[dict]:
    """The chunks one step of a reply with tools streams: the deltas its text completes (content,
    `delta.tool_calls`), the step's tokens' log-probabilities on the first of them, or on a chunk
    with an empty delta where the text is held (a possible start of a call), so every token's
    entry is streamed once, in order, adding up to the whole response's `logprobs.content`."""
    deltas = calls.feed(event.text)
    chunks = [reply.chunk(delta, index=index) for delta in deltas]
    if event.logprobs and reply.logprobs:
        carrier = deltas[0] if deltas else {}
        carried = reply.chunk(carrier, index=index, logprobs=event.logprobs, token_ids=event.token_ids)
        chunks[:1] = [carried]
    return chunks


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed and `on_close` always called, however
    the client leaves (even before the first chunk): it cancels the request in the engine."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's shape too."""
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                    code="not_found" if exc.status_code == 404 else None, count=None).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("HTTP handler failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", code="internal_error",
                    count=None).response()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# After a 408 the server stops reading requests but keeps reading (and dropping) what the client
# still sends, for up to LINGER_IDLE_SECONDS between pieces and LINGER_SECONDS in all, before it
# closes the socket ("lingering close", as nginx and Apache do). A socket closed while its peer is
# still sending answers the next bytes with a TCP reset: a client that writes its whole request
# before it reads (every HTTP library does) then fails on its write with "connection reset" and
# never reads the 408 waiting for it.
LINGER_SECONDS = 5.0
LINGER_IDLE_SECONDS = 2.0


class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a read timeout: a request, headers and body, must arrive in
    full within `read_timeout` seconds of its first byte (of the connection, for the first one), or
    it is answered 408 and the connection closed after a lingering close (LINGER_SECONDS). A
    kept-alive connection idle for `read_timeout` between requests is closed too (uvicorn's
    keep-alive timeout, set to it by OpenAIFront). Without these a client sending a byte a minute,
    or holding an idle connection, keeps a connection for ever."""

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._read_timer: asyncio.TimerHandle | None = None
        self._before = None       # the cycle (request) before the one being read
        self._linger_timer: asyncio.TimerHandle | None = None    # set: answered 408, lingering
        self._linger_until = 0.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            self._linger()        # dropped: the request was answered 408
            return
        if self._read_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()           # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self._read_timer is not None and self.cycle is not self._before and not self.cycle.more_body:
            self._disarm()        # read in full

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self._linger_timer is not None:     # the server stops: no need to linger on
            self.transport.close()
            return
        super().shutdown()

    def _arm(self) -> None:
        self._before = self.cycle
        self._read_timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        reading = self.cycle is not self._before
        if reading and self.cycle.response_started:
            self.transport.close()     # a reply is under way: a 408 cannot follow it
            return
        body = json.dumps({"error": {
            "message": f"the request did not arrive in full within {self.read_timeout:g} s",
            "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: " + str(len(body)).encode() +
                             b"\r\n\r\n" + body)
        if reading:
            # A handler still waiting for the body sees the client gone (and writes nothing more).
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self._unset_keepalive_if_required()
        if self.transport.can_write_eof():     # plaintext: the client reads the 408, then EOF
            self.transport.write_eof()
        self.flow.resume_reading()
        self._linger_until = self.loop.time() + LINGER_SECONDS
        self._linger()

    def _linger(self) -> None:
        """(Re)start the wait for the client's next bytes; close once it stops, or at the end."""
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        wait = min(LINGER_IDLE_SECONDS, self._linger_until - self.loop.time())
        if wait <= 0:
            self._linger_timer = None
            self.transport.close()
            return
        self._linger_timer = self.loop.call_later(wait, self.transport.close)


class OpenAIFront:
    """The HTTP server of one EngineServer (`state`: engine, worker, limits, metrics, phase)."""

    def __init__(self, state, admission: Admission, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, read_timeout: float = 30.0, tls: ssl.SSLContext | None = None):
        """admission: the gRPC service's, so both protocols enter the worker one way (and one
        thread tokenizes for both). read_timeout: seconds a request may take to arrive in full.
        tls: HTTPS with this server context (tls.ReloadingTLS.ssl_context); None: plaintext."""
        self.state = state
        self.admission = admission
        self.host, self.port = host, port
        self._token = token or None
        self.read_timeout = read_timeout
        self.tls = tls
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = Starlette(exception_handlers={HTTPException: _http_error, Exception: _server_error}, routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ])

    # -- life ------------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "OpenAIFront":
        """Bind (an OSError if the port is taken) and serve in a thread of its own."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, backlog=1024,
                                # An idle kept-alive connection is held no longer than a slow
                                # request may take to arrive: one setting bounds both.
                                timeout_keep_alive=self.read_timeout,
                                http=functools.partial(ReadTimeoutH11Protocol, read_timeout=self.read_timeout))
        config.load()
        # uvicorn builds its SSLContext from file names, once; this one re-reads them on rotation.
        config.ssl = self.tls
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[sock])),
                                        name="specpair-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.stop()
            raise OSError(f"HTTP server did not start on {self.host}:{self.port}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    # -- handlers --------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        state = self.state
        # Not ready once told to stop, though requests are still served for the stop delay (app.py).
        ready = state.phase == "serving" and not state.leaving
        body = {"status": "leaving" if state.phase == "serving" and state.leaving else state.phase,
                "pair": state.options.pair, "version": state.options.version}
        if not ready:
            body["message"] = state.unavailable_reason()
        return JSONResponse(body, status_code=200 if ready else 503)

    def _model_card(self) -> dict:
        state = self.state
        card = {"id": state.options.pair, "object": "model", "created": int(state.started_at),
                "owned_by": "specpair", "specpair": {"pair": state.options.pair, "version": state.options.version}}
        if state.phase == "serving":
            card["specpair"] = MessageToDict(state.model_info(), preserving_proto_field_name=True)
            card["max_model_len"] = state.engine.target.context_length
        return card

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except APIError as err:
            return err.response()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        try:
            self._authorize(request)
            self._check_model(request.path_params["model"])
        except APIError as err:
            return err.response()
        return JSONResponse(self._model_card())

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    # -- generation --------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self._token is None:
            return
        if not bearer_token_matches(request.headers.get("authorization", ""), self._token):
            raise APIError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                           "authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"}, count=None)

    def _check_model(self, model) -> None:
        pair = self.state.options.pair
        if model is not None and model != pair:
            raise APIError(404, f"model {model!r} is not served here; this server serves {pair!r}",
                           param="model", code="model_not_found")

    async def _read_json(self, request: Request) -> dict:
        limits = self.state.limits
        declared = request.headers.get("content-length")
        if declared and declared.isdigit():
            check_size(int(declared), limits)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            check_size(len(body), limits)
        try:
            parsed = json.loads(body)
        except ValueError as exc:
            raise bad_request(None, f"the body is not valid JSON: {exc}") from None
        except RecursionError:
            raise bad_request(None, "the body is nested too deeply") from None
        if not isinstance(parsed, dict):
            raise bad_request(None, "the body must be a JSON object")
        return parsed

    async def _generate(self, request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        state = self.state
        admitted: list = []      # one per choice
        try:
            self._authorize(request)
            if state.phase != "serving":
                raise APIError(503, state.unavailable_reason(), "server_error", code="unavailable", count=None)
            max_tokens_name = "max_tokens"
            try:
                body = await self._read_json(request)
                fields, max_tokens_name = request_fields(body, chat)
                n = choices_asked(body)
                tool_style = self._tools(body, fields) if chat else None
                model = body.get("model")
                self._check_model(model)
                stream = _get(body, "stream", bool, False)
                include_usage = bool(_get(body, "stream_options", dict, {}).get("include_usage"))
            except InvalidField as exc:
                raise from_invalid(exc, max_tokens_name) from None
            except RecursionError:            # a value nested too deeply to describe
                raise bad_request(None, "the body is nested too deeply") from None
            except ClientDisconnect:          # the client left while its body was read
                self.admission.refused(DEFAULT_CATEGORY, "cancelled", PROTOCOL)
                return Response(status_code=499)
            # Each choice is a row of its own with a seed of its own; the prompt's prefill is
            # shared through the prefix store (the worker holds the later rows back one step).
            for index in range(n):
                choice = dataclasses.replace(fields, seed=choice_seed(fields.seed, index)) if n > 1 else fields
                try:
                    admitted.append(await self.admission.admit(choice, protocol=PROTOCOL, arrived=arrived,
                                                               default_max_new_tokens=None))
                except InvalidField as exc:       # counted by admit
                    raise from_invalid(exc, max_tokens_name).uncounted() from None
                except QueueFull as exc:
                    raise APIError(429, str(exc), "rate_limit_error", code="queue_full",
                                   headers={"Retry-After": "1"}, count=None) from None
                except NotAccepting as exc:
                    raise APIError(503, str(exc), "server_error", code="unavailable", count=None) from None
        except APIError as err:
            self._end(admitted)
            if err.count:
                self.admission.refused(DEFAULT_CATEGORY, err.count, PROTOCOL)
            return err.response()
        reply = Reply(chat=chat, model=model or state.options.pair, include_usage=include_usage, n=n,
                      logprobs=fields.logprobs is not None, token_text=self._token_text,
                      tool_style=tool_style)
        for a in admitted:
            a.job.client_id = reply.id
        if stream:
            # Cancelling a finished job does nothing: on_close only matters for a reply cut short.
            return EventStream(self._stream(admitted, reply), lambda: self._end(admitted))
        try:
            return await self._complete(request, admitted, reply)
        finally:
            self._end(admitted)

    def _tools(self, body: dict, fields: RequestFields) -> str | None:
        """`tools` / `tool_choice`: the prompt rendered through the model's chat template with the
        tools (fields.prompt), a forced call (`required`, a named function) as a grammar
        (fields.structure). -> the tool-call style to parse the reply with, or None (no tools)."""
        tools, choice = body.get("tools"), body.get("tool_choice")
        if not tools:
            if choice not in (None, "none", "auto"):
                raise bad_request("tool_choice", "needs tools")
            return None
        try:
            functions, forced = check_tools(tools, choice)
        except ToolError as exc:
            raise bad_request(exc.field, exc.reason) from None
        if choice == "none":
            return None
        tok = self.state.engine.target.tokenizer
        style = style_of(getattr(tok, "chat_template", None))
        messages = []
        for (role, content), raw in zip(fields.messages, body["messages"]):
            message = {"role": role, "content": content}
            for key in ("tool_calls", "tool_call_id", "name"):
                if raw.get(key) is not None:
                    message[key] = raw[key]
            messages.append(message)
        try:
            text = render_prompt(tok, messages, functions)
        except ToolError as exc:
            raise bad_request(exc.field, exc.reason) from None
        fields.messages, fields.prompt, fields.prompt_field = None, text, "messages"
        if forced is not None:
            if fields.structure is not None:
                raise bad_request("tool_choice", "a forced tool call cannot be combined with response_format")
            fields.structure = ("grammar", forced_call_grammar(functions, forced, style))
        return style

    def _end(self, admitted: list) -> None:
        """The reply has ended, however it ended: the choices still running are cancelled."""
        for a in admitted:
            self.state.worker.cancel(a.job, "cancelled")
            a.replied()

    def _token_text(self, token: int) -> tuple[str, bytes]:
        """A token as text and as the bytes it stands for (a piece of a UTF-8 character is
        '\\ufffd' as text, its own bytes as bytes)."""
        engine = self.state.engine
        text = engine.target.tokenizer.decode([token])
        llg = engine.grammars.tokenizer()
        raw = text.encode("utf-8") if llg.is_special_token(token) else llg.decode_bytes([token])
        return text, raw

    async def _stream(self, admitted: list, reply: "Reply"):
        finished = False
        usage_sum = None
        calls = [CallStream(reply.tool_style) for _ in admitted] if reply.tool_style else None
        try:
            if reply.chat:
                for index in range(reply.n):
                    yield sse(reply.chunk({"role": "assistant", "content": ""}, index=index))
            async for index, event in _choice_events(admitted):
                if isinstance(event, Tokens):
                    if calls:       # content and calls as OpenAI streams them (delta.tool_calls)
                        for chunk in call_chunks(reply, calls[index], index, event):
                            yield sse(chunk)
                    elif event.text or event.logprobs:
                        yield sse(reply.chunk(event.text, index=index, logprobs=event.logprobs,
                                              token_ids=event.token_ids))
                elif isinstance(event, Finished):
                    finish_reason = event.finish_reason
                    if calls:
                        for chunk in call_chunks(reply, calls[index], index, event):
                            yield sse(chunk)
                        owed, called = calls[index].finish()
                        for delta in owed:
                            yield sse(reply.chunk(delta, index=index))
                        finish_reason = "tool_calls" if called else finish_reason
                    elif event.text or event.logprobs:
                        yield sse(reply.chunk(event.text, index=index, logprobs=event.logprobs,
                                              token_ids=event.token_ids))
                    final = reply.chunk(None, finish_reason=finish_reason, index=index)
                    final["specpair"] = speculation_figures(event)
                    yield sse(final)
                    usage_sum = add_usage(usage_sum, event)
                elif isinstance(event, Failed):
                    finished = True
                    err = failure(event)
                    yield sse({"error": {"message": err.message, "type": err.type, "param": None, "code": err.code}})
                    yield "data: [DONE]\n\n"
                    return
            finished = True
            if reply.include_usage:
                yield sse({**reply.chunk(None), "choices": [], "usage": usage_sum})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:    # the client went away (or the stream broke): free the batch slots
                self._end(admitted)

    async def _complete(self, request: Request, admitted: list, reply: "Reply") -> Response:
        gone = asyncio.ensure_future(_wait_disconnect(request))
        events = _choice_events(admitted)
        pieces: list[list[str]] = [[] for _ in admitted]
        logprobs: list[list] = [[] for _ in admitted]
        token_ids: list[list[int]] = [[] for _ in admitted]
        finals: list[Finished | None] = [None] * len(admitted)
        try:
            while True:
                get = asyncio.ensure_future(events.__anext__())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return Response(status_code=499)    # nobody reads it
                try:
                    index, event = get.result()
                except StopAsyncIteration:
                    return JSONResponse(reply.whole(["".join(p) for p in pieces], finals, logprobs, token_ids))
                if isinstance(event, (Tokens, Finished)):
                    pieces[index].append(event.text)
                    logprobs[index].extend(event.logprobs or ())
                    token_ids[index].extend(event.token_ids)
                    if isinstance(event, Finished):
                        finals[index] = event
                elif isinstance(event, Failed):
                    return failure(event).response()
        finally:
            gone.cancel()
            await events.aclose()


async def _choice_events(admitted: list):
    """(choice index, event) from every choice's queue as they arrive, until each has finished
    or failed (a failure ends them all: the caller answers it)."""
    gets = {asyncio.ensure_future(a.events.get()): i for i, a in enumerate(admitted)}
    try:
        while gets:
            done, _ = await asyncio.wait(gets, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=gets.get):
                index = gets.pop(future)
                event = future.result()
                yield index, event
                if isinstance(event, Failed):
                    return
                if not isinstance(event, Finished):
                    gets[asyncio.ensure_future(admitted[index].events.get())] = index
    finally:
        for future in gets:
            future.cancel()


def failure(event: Failed) -> APIError:
    if event.kind == "unavailable":
        return APIError(503, event.message, "server_error", code="unavailable", count=None)
    if event.kind == "invalid":
        return APIError(400, event.message, count=None)
    return APIError(500, event.message, "server_error", code="internal_error", count=None)


def add_usage(total: dict | None, event: Finished) -> dict:
    """Usage over the choices: the prompt counted once (they share it), their completions summed."""
    this = usage(event)
    if total is None:
        return this
    total = dict(total)
    total["completion_tokens"] += this["completion_tokens"]
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    return total


# A log-probability of a token the grammar's mask refuses is -inf, which JSON cannot carry:
# written as this floor, as vLLM and OpenAI write it.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class Reply:
    """The OpenAI objects of one reply: chunks while streaming, or the whole response.

    logprobs: render each token's log-probability (chat: `logprobs.content`; completions:
    `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`); token_text(id) -> (text, bytes).
    """

    def __init__(self, *, chat: bool, model: str, include_usage: bool, n: int = 1, logprobs: bool = False,
                 token_text=None, tool_style: str | None = None):
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.tool_style = tool_style
        self.n, self.logprobs, self.token_text = n, logprobs, token_text
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offsets = [0] * n      # completions' text_offset: characters of each choice so far

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, index: int, entries, token_ids) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            content = []
            for token, (logprob, top) in zip(token_ids, entries or ()):
                text, raw = self.token_text(token)
                content.append({"token": text, "logprob": finite(logprob), "bytes": list(raw), "top_logprobs": [
                    {"token": t, "logprob": finite(lp), "bytes": list(b)}
                    for t, b, lp in ((*self.token_text(alt), lp) for alt, lp in top)]})
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, (logprob, top) in zip(token_ids, entries or ()):
            text, _ = self.token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(finite(logprob))
            alternatives: dict[str, float] = {}
            for alt, lp in top:    # most likely first; tokens that read alike keep the first
                alternatives.setdefault(self.token_text(alt)[0], finite(lp))
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(self._offsets[index])
            self._offsets[index] += len(text)
        return out

    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The assistant's message (its tool calls parsed when the request had tools), and the
        finish reason: `tool_calls` when it called one."""
        if not self.tool_style:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = parse_tool_calls(text, self.tool_style)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": content, "tool_calls": [
            {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]}, "tool_calls"

    def chunk(self, content, finish_reason: str | None = None, *, index: int = 0, logprobs=None,
              token_ids=()) -> dict:
        """content: text, a chat delta dict, or None (no new text)."""
        rendered = self._logprobs(index, logprobs, token_ids) if logprobs else None
        if self.chat:
            delta = content if isinstance(content, dict) else ({"content": content} if content else {})
            choice = {"index": index, "delta": delta, "logprobs": rendered, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": content or "", "logprobs": rendered, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def whole(self, texts: list[str], events: list[Finished], logprobs: list, token_ids: list) -> dict:
        choices = []
        for index, (text, event) in enumerate(zip(texts, events)):
            rendered = self._logprobs(index, logprobs[index], token_ids[index])
            if self.chat:
                message, finish_reason = self.message(text, event.finish_reason)
                choices.append({"index": index, "message": message, "logprobs": rendered,
                                "finish_reason": finish_reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": rendered,
                                "finish_reason": event.finish_reason})
        head = self._head("chat.completion" if self.chat else "text_completion")
        total = None
        for event in events:
            total = add_usage(total, event)
        figures = speculation_figures(events[0])
        if len(events) > 1:
            figures = {"choices": [speculation_figures(e) for e in events]}
        return {**head, "choices": choices, "usage": total, "specpair": figures}
