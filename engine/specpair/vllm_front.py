"""The vLLM companion's HTTP/1.1 front and its keep-alive connections to vLLM, on asyncio's own
protocols (issue 53: the companion may add <= 2 ms p50 and <= 5% of a core at 200 requests/s of
short streamed replies).

aiohttp's server and client cost ~1 ms of CPU a proxied stream (two request objects, a task and
a coroutine chain a chunk, header multidicts); this front does per request one parse of the
head, one write to vLLM, and per chunk vLLM streams one callback that re-frames it for the
client (docs/measurements/2026-12-07c-vllm-companion-cpu.md has the figures). What it
relays and counts is the companion's (specpair.vllm_companion.Companion.dispatch and its
exchange callbacks); this module only speaks HTTP/1.1:

- requests: Content-Length or chunked bodies, keep-alive, `Expect: 100-continue`, one request
  at a time per connection (a pipelined one waits in the buffer);
- replies to vLLM's: Content-Length kept where the body passes unchanged, else chunked;
- vLLM's replies: Content-Length, chunked (with trailers skipped) or ended by close; an idle
  connection vLLM closed just as a request was written is retried once on a new one.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any, Callable

# A request head or vLLM's reply head longer than this is refused (431) / treated as broken.
MAX_HEAD_BYTES = 64 << 10
SECONDS_TO_CONNECT = 10.0

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class BadMessage(Exception):
    """A request (or vLLM's reply) that is not HTTP/1.1 as this front reads it."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Request:
    """One request as parsed: `headers` keep the client's names and order; `lower` maps lower-cased
    names to values (the last one wins) for the few the companion reads."""
    __slots__ = ("method", "target", "path", "version", "headers", "lower", "body")

    def __init__(self, method: str, target: str, version: bytes, headers: list[tuple[bytes, bytes]]):
        self.method, self.target, self.version, self.headers = method, target, version, headers
        self.path = target.split("?", 1)[0]
        self.lower = {k.lower(): v for k, v in headers}
        self.body = b""

    def header(self, name: bytes) -> str:
        value = self.lower.get(name)
        return value.decode("latin-1") if value is not None else ""

    @property
    def keep_alive(self) -> bool:
        connection = self.lower.get(b"connection", b"").lower()
        return b"close" not in connection if self.version == b"HTTP/1.1" else b"keep-alive" in connection


def parse_head(head: bytes) -> Request:
    """The request line and headers (without the blank line)."""
    lines = head.split(b"\r\n")
    try:
        method, target, version = lines[0].split(b" ")
    except ValueError:
        raise BadMessage(400, "malformed request line") from None
    if not version.startswith(b"HTTP/1."):
        raise BadMessage(505, "HTTP/1.x only")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise BadMessage(400, "malformed header line")
        headers.append((name, value.strip()))
    return Request(method.decode("latin-1"), target.decode("latin-1"), version, headers)


def reply_head(status: int, headers: list[tuple[bytes, bytes]], length: int | None, keep_alive: bool) -> bytes:
    """A reply's status line and headers: `length` None: chunked."""
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
    parts += [b"%s: %s\r\n" % kv for kv in headers]
    parts.append(b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length)
    if not keep_alive:
        parts.append(b"Connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


class ChunkedReader:
    """Incremental decoder of a chunked body: feed bytes, get the data; `done` after the last
    chunk and its trailers."""

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0          # bytes left of the current chunk's data
        self._crlf = False      # the CRLF after a chunk's data is due
        self._trailers = False  # past the last chunk: skipping trailers up to the blank line
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        pos, out, n = 0, [], len(buf)
        while not self.done:
            if self._left:
                take = min(self._left, n - pos)
                if not take:
                    break
                out.append(buf[pos:pos + take])
                pos += take
                self._left -= take
                if self._left:
                    break
                self._crlf = True
            if self._crlf:
                if n - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise BadMessage(502, "chunk not followed by CRLF")
                pos += 2
                self._crlf = False
            if self._trailers:
                # Past the last chunk: trailer lines are skipped up to the empty line.
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                self.done = eol == pos
                pos = eol + 2
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > 1024:
                    raise BadMessage(502, "chunk size line too long")
                break
            try:
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
            except ValueError:
                raise BadMessage(502, "bad chunk size") from None
            pos = eol + 2
            if size == 0:
                self._trailers = True
                continue
            self._left = size
        self._buf = buf[pos:]
        return b"".join(out) if len(out) != 1 else out[0]

    def rest(self) -> bytes:
        """Bytes past the body's end (a pipelined reply: none from vLLM)."""
        return self._buf

    def whole_chunks(self, data: bytes) -> bool:
        """Whether `data` is whole chunks only (no extensions, not the last chunk) and the reader
        sits at a chunk's start: then it is left as it is, unread (else `feed` it). A streamed
        event as vLLM writes it is one such chunk (a few, where the loop was late to read them):
        passed on in its own framing, it is neither decoded nor framed again."""
        if self._buf or self._left or self._crlf or self._trailers or self.done:
            return False
        pos, n = 0, len(data)
        while pos < n:
            eol = data.find(b"\r\n", pos, pos + 18)
            if eol <= pos:
                return False
            try:
                size = int(data[pos:eol], 16)
            except ValueError:
                return False
            pos = eol + 4 + size
            if not size or pos > n or data[pos - 2:pos] != b"\r\n":
                return False
        return n > 0


class FrontConnection(asyncio.Protocol):
    """One client connection. A whole request goes to `dispatch(conn, request)`, which answers it
    with `respond`, or by `start`/`write`/`end` (a relayed reply), now or later; the next
    request on the connection is read once it has (`done`)."""

    def __init__(self, dispatch: Callable[["FrontConnection", Request], None], max_body: int):
        self._dispatch = dispatch
        self._max_body = max_body
        self.transport: Any = None
        self._buf = b""
        self._request: Request | None = None     # head read, body not yet whole
        self._body_left = 0
        self._chunked: ChunkedReader | None = None
        self._body: list[bytes] = []
        self.busy = False                        # a request is being answered
        self._out: list[bytes] = []              # written at the end of this turn of the loop
        self._flush_due = False
        # Set while a relay answers: its writes wait for the end of each read from vLLM (the
        # relay's on_turn) or of the reply (done), so a read's events cost one write.
        self.hold = False
        self.keep_alive = True
        self.closed = False
        self.chunked_reply = False
        # Set by the relay answering the request in flight: told when the client goes or pauses.
        self.on_lost: Callable[[], None] | None = None
        self.on_pause: Callable[[bool], None] | None = None
        # Bytes already read from a connection the compiled front handed over (vllm_front_native):
        # read first, as if they had just arrived.
        self.prefix = b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if self.prefix:
            prefix, self.prefix = self.prefix, b""
            self.data_received(prefix)

    def _send(self, data: bytes) -> None:
        """Bytes for the client, joined with the others of this turn of the loop into one write
        (a reply's head, events and end that arrive together cost one system call, not three)."""
        self._out.append(data)
        if not self.hold and not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_due = False
        out, self._out = self._out, []
        if out and not self.closed:
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._out = []
        if self.on_lost is not None:
            lost, self.on_lost = self.on_lost, None
            lost()

    def pause_writing(self) -> None:
        if self.on_pause is not None:
            self.on_pause(True)

    def resume_writing(self) -> None:
        if self.on_pause is not None:
            self.on_pause(False)

    def data_received(self, data: bytes) -> None:
        self._buf = self._buf + data if self._buf else data
        if not self.busy:
            self._read()

    def _read(self) -> None:
        try:
            while not self.busy and not self.closed and self._buf:
                if self._request is None:
                    end = self._buf.find(b"\r\n\r\n")
                    if end < 0:
                        if len(self._buf) > MAX_HEAD_BYTES:
                            raise BadMessage(431, "request head too large")
                        return
                    request = parse_head(self._buf[:end])
                    self._buf = self._buf[end + 4:]
                    if b"chunked" in request.lower.get(b"transfer-encoding", b"").lower():
                        self._chunked, self._body_left = ChunkedReader(), 0
                    else:
                        try:
                            self._body_left = int(request.lower.get(b"content-length", b"0"))
                        except ValueError:
                            raise BadMessage(400, "bad Content-Length") from None
                        if self._body_left < 0:
                            raise BadMessage(400, "bad Content-Length")
                    if self._body_left > self._max_body:
                        raise BadMessage(413, "request body too large")
                    if request.lower.get(b"expect", b"").lower() == b"100-continue":
                        self._send(b"HTTP/1.1 100 Continue\r\n\r\n")
                    self._request, self._body = request, []
                if self._chunked is not None:
                    data = self._chunked.feed(self._buf)
                    self._buf = b""
                    if data:
                        self._body.append(data)
                        if sum(map(len, self._body)) > self._max_body:
                            raise BadMessage(413, "request body too large")
                    if not self._chunked.done:
                        return
                    self._buf, self._chunked = self._chunked.rest(), None
                elif self._body_left:
                    take = self._buf[:self._body_left]
                    self._buf = self._buf[len(take):]
                    self._body.append(take)
                    self._body_left -= len(take)
                    if self._body_left:
                        return
                request, self._request = self._request, None
                request.body = b"".join(self._body)
                self._body = []
                self.busy, self.keep_alive, self.chunked_reply = True, request.keep_alive, False
                self._dispatch(self, request)
        except BadMessage as exc:
            self.keep_alive = False
            self.busy = True
            body = b'{"error": {"message": "%s", "type": "invalid_request_error", "param": null, "code": %d}}' % (
                str(exc).encode(), exc.status)
            self.respond(exc.status, [(b"Content-Type", b"application/json")], body)

    # -- answering ----------------------------------------------------------------------------------

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole reply."""
        if not self.closed:
            self._send(reply_head(status, headers, len(body), self.keep_alive) + body)
        self.done()

    def start(self, status: int, headers: list[tuple[bytes, bytes]], length: int | None, first: bytes = b"") -> None:
        """A reply's head (chunked when `length` is None) and its first bytes, in one write."""
        self.chunked_reply = length is None
        if not self.closed:
            self._send(reply_head(status, headers, length, self.keep_alive)
                       + (chunk(first) if first and self.chunked_reply else first))

    def write(self, data: bytes) -> None:
        if data and not self.closed:
            self._send(chunk(data) if self.chunked_reply else data)

    def write_framed(self, framed: bytes) -> bool:
        """Whole chunks already framed (vLLM's own) for a chunked reply, written at once; False
        (nothing written) where the reply is not chunked or bytes wait before them."""
        if not self.chunked_reply or self._out:
            return False
        if not self.closed:
            self.transport.write(framed)
        return True

    def end(self, whole: bool = True) -> None:
        """The reply's end; not `whole` (vLLM broke off): the connection is closed without the
        last chunk, so the client sees a cut reply rather than a short one."""
        if not self.closed:
            if not whole:
                self.keep_alive = False
            elif self.chunked_reply:
                self._send(LAST_CHUNK)
        self.done()

    def done(self) -> None:
        self.on_lost = self.on_pause = None
        self.busy = self.hold = False
        if self._out:
            self.flush()
        if not self.keep_alive:
            if not self.closed:
                self.flush()
                self.transport.close()
            self.closed = True
            return
        if self._buf and not self.closed:
            self._read()


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to vLLM. `send(sink, data)` writes a request; the reply goes to
    the sink: `on_head(status, headers, length)`, `on_body(data)`, `on_end()`, or
    `on_lost(replied, exc)` when the connection goes first (`replied`: any byte of the reply came);
    `on_chunks(raw)` is offered first a read of a chunked body that is whole chunks and returns
    whether it passed `raw` on itself; `on_turn()` after each read otherwise."""

    def __init__(self, pool: "UpstreamPool"):
        self._pool = pool
        self.transport: Any = None
        self.sink: Any = None
        self.reused = False
        self._buf = b""
        self._head = True
        self._left: int | None = None
        self._chunked: ChunkedReader | None = None
        self._replied = False
        self._reusable = True
        self._no_body = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def send(self, sink: Any, data: bytes, head_request: bool = False) -> None:
        """`head_request`: a HEAD, whose reply has no body whatever its headers say."""
        self.sink, self._buf, self._head, self._replied, self._chunked, self._left = sink, b"", True, False, None, None
        self._no_body = head_request
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:
            self.transport.close()      # bytes vLLM sent with no request in flight: not reusable
            return
        # A streamed event on its own (vLLM writes one chunk a decoding step): the sink may pass it
        # on as it came, in one write (issue 53: the companion's CPU a streamed event).
        chunked = self._chunked
        if chunked is not None and chunked.whole_chunks(data) and sink.on_chunks(data):
            return
        try:
            self._received(sink, data)
        finally:
            sink.on_turn()              # what this read gave the client goes out in one write

    def _received(self, sink: Any, data: bytes) -> None:
        self._replied = True
        try:
            if self._head:
                data = self._buf + data if self._buf else data
                end = data.find(b"\r\n\r\n")
                if end < 0:
                    if len(data) > MAX_HEAD_BYTES:
                        raise BadMessage(502, "vLLM's reply head too large")
                    self._buf = data
                    return
                self._buf = b""
                lines = data[:end].split(b"\r\n")
                parts = lines[0].split(b" ", 2)
                status = int(parts[1])
                data = data[end + 4:]
                if 100 <= status < 200:       # 100 Continue: the reply proper follows
                    if data:
                        self._received(sink, data)
                    return
                headers, lower = [], {}
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    value = value.strip()
                    headers.append((name, value))
                    lower[name.lower()] = value
                self._head = False
                self._reusable = (parts[0] == b"HTTP/1.1" and b"close" not in lower.get(b"connection", b"").lower())
                if self._no_body or status in (204, 304):
                    length = int(lower.get(b"content-length", b"0")) if self._no_body else 0
                    self._left = 0
                elif b"chunked" in lower.get(b"transfer-encoding", b"").lower():
                    self._chunked = ChunkedReader()
                    length = None
                elif b"content-length" in lower:
                    self._left = length = int(lower[b"content-length"])
                else:
                    length, self._reusable = None, False      # ends with the connection
                sink.on_head(status, headers, lower, length)
                if self._left == 0:
                    self._finish()
                    return
                if not data:
                    return
            if self._chunked is not None:
                out = self._chunked.feed(data)
                if out:
                    sink.on_body(out)
                if self._chunked.done:
                    self._finish()
            elif self._left is not None:
                out = data[:self._left]
                self._left -= len(out)
                sink.on_body(out)
                if not self._left:
                    self._finish()
            else:
                sink.on_body(data)
        except (BadMessage, ValueError, IndexError) as exc:
            self.sink = None
            self._reusable = False
            self.transport.abort()
            sink.on_lost(True, exc)

    def _finish(self) -> None:
        sink, self.sink = self.sink, None
        if self._reusable and not self.transport.is_closing():
            self._pool.give_back(self)
        else:
            self.transport.close()
        sink.on_end()

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool.forget(self)
        sink, self.sink = self.sink, None
        if sink is not None:
            if not self._head and self._chunked is None and self._left is None:
                sink.on_end()           # a reply that ends with the connection has ended
            else:
                sink.on_lost(self._replied, exc)


class UpstreamPool:
    """Keep-alive connections to vLLM: `unix:PATH` or `host:port`."""

    def __init__(self, upstream: str):
        self._upstream = upstream
        self._idle: list[UpstreamConnection] = []
        self._all: set[UpstreamConnection] = set()

    def take(self) -> UpstreamConnection | None:
        """An idle connection, if one is open."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.transport.is_closing():
                conn.reused = True
                return conn
        return None

    async def connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        if self._upstream.startswith("unix:"):
            made = loop.create_unix_connection(lambda: UpstreamConnection(self),
                                               self._upstream[len("unix:"):])
        else:
            host, _, port = self._upstream.rpartition(":")
            made = loop.create_connection(lambda: UpstreamConnection(self), host, int(port))
        _, conn = await asyncio.wait_for(made, SECONDS_TO_CONNECT)
        conn.reused = False
        self._all.add(conn)
        return conn

    def give_back(self, conn: UpstreamConnection) -> None:
        self._idle.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        self._all.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    def close(self) -> None:
        for conn in list(self._all):
            conn.transport.close()
        self._idle.clear()
