"""specpair.vllm_companion's pure parts: the category a request names, what vLLM is sent, what a
reply (whole or streamed) says about acceptance and timing, and the per-category counts the
GetStats contract carries. Replies are vLLM 0.32's own, captured from a real server (tiny
random Llama, n-gram k=4, --per-request-spec-decode-metrics summary --enable-per-request-metrics).
The companion in front of a real vLLM server: tests/engine/test_engine_vllm_peer.py (one shared
vLLM start); in a pod on the devcluster: tests/operator/test_operator_vllm.py."""

from __future__ import annotations

import json

import pytest

from specpair.contract import DEFAULT_CATEGORY
from specpair.stats import RequestMoments
from specpair.vllm_companion import (InvalidRequest, Reply, SseScanner, Tally, acceptance_of, prepare,
                                     read_final)

@pytest.fixture(params=["c", "python"], autouse=True)
def front(request, monkeypatch):
    """Every test here runs with each of the companion's HTTP fronts (vllm_front_native: the
    compiled one, the default; the Python one)."""
    monkeypatch.setenv("SPECPAIR_COMPANION_FRONT", request.param)
    return request.param


# The last two events of a streamed chat completion (stream_options.include_usage), as vLLM wrote them.
USAGE_CHUNK = (b'data: {"id":"chatcmpl-b1240c439eb969e9","object":"chat.completion.chunk","created":1796558686,'
               b'"model":"peer","choices":[],"usage":{"prompt_tokens":43,"total_tokens":51,"completion_tokens":8},'
               b'"system_fingerprint":"vllm-0.32.0-3ea94921","metrics":{"time_to_first_token_ms":222.40942499956873,'
               b'"generation_time_ms":599.1785059995891,"queue_time_ms":0.04736800110549666,'
               b'"mean_itl_ms":85.59692942851272,"tokens_per_second":9.737241381176277,"speculative_decoding":'
               b'{"mean_acceptance_length":1.0,"draft_acceptance_rate":0.0,"acceptance_histogram":[1,0,0,0,0],'
               b'"num_spec_steps":1,"num_accepted_draft_tokens":0,"num_draft_tokens":4,"num_spec_tokens":4}}}\n\n')
TOKEN_CHUNK = (b'data: {"id":"chatcmpl-b1240c439eb969e9","object":"chat.completion.chunk","created":1796558686,'
               b'"model":"peer","choices":[{"index":0,"delta":{"content":"V"},"logprobs":null,"finish_reason":null,'
               b'"token_ids":null}]}\n\n')
DONE = b"data: [DONE]\n\n"
# metrics of a whole /v1/completions reply that accepted drafts (histogram: steps by accepted count).
SPEC = {"mean_acceptance_length": 2.0, "draft_acceptance_rate": 0.3125, "acceptance_histogram": [2, 1, 0, 0, 1],
        "num_spec_steps": 4, "num_accepted_draft_tokens": 5, "num_draft_tokens": 16, "num_spec_tokens": 4}


def test_a_requests_category_is_read_where_our_engine_reads_it_and_checked_alike():
    body = {"model": "chat", "prompt": "x", "specpair": {"category": "code"}}
    prep = prepare(json.dumps(body).encode())
    assert prep.category == "code" and json.loads(prep.body) == body and not prep.stream
    assert prepare(b'{"model": "chat", "prompt": "x"}').category == DEFAULT_CATEGORY
    assert prepare(b'{"specpair": {"category": ""}}').category == DEFAULT_CATEGORY
    for ext, field in (({"category": "no spaces"}, "specpair.category"), ({"category": 3}, "specpair.category"),
                       ("code", "specpair"), ({"category": "x" * 65}, "specpair.category")):
        with pytest.raises(InvalidRequest) as refused:
            prepare(json.dumps({"prompt": "x", "specpair": ext}).encode())
        assert refused.value.param == field
    # Not JSON, or no object: vLLM's to refuse, forwarded as it came, counted in the default category.
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        prep = prepare(raw)
        assert (prep.category, prep.body) == (DEFAULT_CATEGORY, raw)


def test_a_stream_asks_vllm_for_the_usage_chunk_and_keeps_the_clients_options():
    prep = prepare(b'{"stream": true, "stream_options": {"continuous_usage_stats": false}, "prompt": "x"}')
    assert prep.stream and not prep.client_usage
    assert json.loads(prep.body)["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    # Without stream_options the field is put in before the closing brace: the client's bytes are
    # kept, whatever braces its strings hold, trailing whitespace, UTF-8 or UTF-16 alike.
    for raw in (b'{"stream": true, "prompt": "a } b"}\n', '{"stream":true,"prompt":"\u00e9}"}'.encode(),
                '{"stream": true, "prompt": "x"}'.encode("utf-16"), b'{"stream": true, "stream_options": null}'):
        prep = prepare(raw)
        assert json.loads(prep.body) == {**json.loads(raw), "stream_options": {"include_usage": True}}, raw
    assert prepare(b'{"stream": true, "prompt": "a } b"}').body.startswith(b'{"stream": true, "prompt": "a } b"')
    raw = b'{"stream": true, "stream_options": {"include_usage": true}, "prompt": "x"}'
    prep = prepare(raw)
    assert prep.client_usage and prep.body == raw          # untouched: the client asked for it itself
    raw = b'{"stream": false, "prompt": "x"}'
    assert prepare(raw).body == raw


@pytest.mark.parametrize("client_usage", [False, True])
def test_the_usage_chunk_is_read_and_dropped_unless_the_client_asked(client_usage):
    stream = TOKEN_CHUNK * 3 + USAGE_CHUNK + DONE
    scanner = SseScanner(keep_usage=client_usage)
    out = b""
    # Cut anywhere: events are passed on whole, in order.
    for i in range(0, len(stream), 37):
        out += scanner.feed(stream[i:i + 37], now=1.0 + i)
    out += scanner.rest()
    assert out == (stream if client_usage else TOKEN_CHUNK * 3 + DONE)
    assert scanner.first_at is not None and scanner.final["usage"]["completion_tokens"] == 8 and not scanner.error
    error = b'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}\n\n'
    scanner = SseScanner(keep_usage=False)
    assert scanner.feed(TOKEN_CHUNK + error, 0.0) == TOKEN_CHUNK + error and scanner.error


def test_vllms_timings_are_the_replys_and_the_companions_clock_stands_in_without_them():
    reply = Reply("chat")
    read_final(reply, json.loads(USAGE_CHUNK[6:]), arrived=10.0, first_at=10.5, now=11.0)
    assert reply.completion_tokens == 8 and reply.spec["num_draft_tokens"] == 4
    assert reply.ttft == pytest.approx((222.40942499956873 + 0.04736800110549666) / 1000)
    assert reply.tpot == pytest.approx(0.08559692942851272)
    bare = Reply("chat")
    read_final(bare, {"usage": {"completion_tokens": 5}}, arrived=10.0, first_at=10.5, now=11.5)
    assert (bare.ttft, bare.tpot, bare.spec) == (0.5, 0.25, None)


def test_vllms_per_request_summary_becomes_the_engines_acceptance_counts():
    stats = acceptance_of(SPEC, 13)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_emitted_tokens) == \
        (4, 16, 5, 13)
    # Position p accepted in every step that accepted more than p: [1+0+1, 0+1, 1, 1].
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1, 1]
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert acceptance_of(None, 3).num_draft_tokens == 0


def test_getstats_carries_each_categorys_request_sums_and_serving_counts():
    from specpair_operator.clients.engine_probe import serving_stats

    tally = Tally("p", "1")
    tally.record(Reply("code", completion_tokens=13, spec=SPEC, ttft=0.2, tpot=0.01, e2e=0.4))
    tally.record(Reply("code", completion_tokens=8, spec={**SPEC, "acceptance_histogram": [4, 0, 0, 0, 0],
                                                          "num_accepted_draft_tokens": 0}, ttft=0.3, tpot=0.02))
    tally.record(Reply("chat", completion_tokens=1, spec=None, ttft=0.1))
    tally.record(Reply("chat", status="invalid"))
    msg = tally.stats_message("p", "1", True, 5.0)
    code = msg.categories["code"]
    assert RequestMoments.from_message(code.finished) == RequestMoments.of_request(16, 5) + RequestMoments.of_request(16, 0)
    assert code.requests == 2 and code.cumulative.num_accepted_tokens == 5 and code.cumulative.num_emitted_tokens == 21
    chat = msg.categories["chat"]
    assert chat.requests == 1 and chat.finished.requests == 0          # drafted nothing: no unit of acceptance
    served = {name: serving_stats(cat.serving) for name, cat in msg.categories.items()}
    assert served["code"]["requests"] == {"ok": 2} and served["code"]["ttft"]["count"] == 2
    assert served["code"]["tpot"]["count"] == 2 and served["chat"]["tpot"]["count"] == 0   # one token: no gap
    assert served["chat"]["requests"] == {"ok": 1, "invalid": 1}
    assert msg.overall.requests == 3 and msg.overall.finished.draft_tokens == 32 and msg.speculating
    # The same counts under the engine's series names, per category.
    from prometheus_client import generate_latest
    text = generate_latest(tally.metrics.registry).decode()
    assert 'specpair_num_draft_tokens_total{category="code",engine="vllm",pair="p",version="1"} 32.0' in text
    assert 'specpair_requests_total{category="chat",engine="vllm",pair="p",protocol="http",status="invalid",version="1"} 1.0' in text


def test_replies_counted_in_a_batch_count_as_they_do_one_by_one():
    """Tally.record_many (the compiled front's batches: one step delta a category) leaves the
    same series and GetStats as record() a reply at a time."""
    from prometheus_client import generate_latest

    replies = [Reply("code", completion_tokens=13, spec=SPEC, ttft=0.2, tpot=0.01, e2e=0.4),
               Reply("chat", completion_tokens=1, spec=None, ttft=0.1, e2e=0.2),
               Reply("code", completion_tokens=8, spec={**SPEC, "acceptance_histogram": [4, 0, 0, 0, 0]},
                     ttft=0.3, tpot=0.02, e2e=0.5),
               Reply("code", status="cancelled"), Reply("chat", status="invalid"),
               Reply("code", completion_tokens=5, spec={**SPEC, "acceptance_histogram": [0, 0, 1]}, e2e=0.1)]
    one, batch = Tally("p", "1"), Tally("p", "1")
    for reply in replies:
        one.record(reply)
    batch.record_many(replies)

    def series(tally: Tally) -> list[str]:
        return sorted(line for line in generate_latest(tally.metrics.registry).decode().splitlines()
                      if "_created" not in line)       # (the time each series was made)
    assert series(batch) == series(one)
    assert any(line.startswith("specpair_num_accepted_tokens_per_pos_total") for line in series(one))
    assert batch.stats_message("p", "1", True, 1.0) == one.stats_message("p", "1", True, 1.0)
    assert one.stats_message("p", "1", True, 1.0).categories["code"].requests == 3


def test_a_client_that_closes_after_done_is_counted_ok_and_one_that_leaves_early_cancelled():
    """Over real sockets: the companion in front of vLLM's captured stream replayed (the bench's
    --replay upstream). The openai client closes once it has read [DONE], before the chunked
    body's end: that reply was whole (ok). A client that leaves mid-stream is counted cancelled."""
    import socket

    from specpair.vllm_companion import Companion, CompanionOptions
    from specpair.vllm_companion_bench import ReplayServer
    from waiting import wait_until

    def stream(port: int, read_until: bytes, max_tokens: int = 400) -> bytes:
        body = json.dumps({"model": "peer", "prompt": "x", "max_tokens": max_tokens, "stream": True,
                           "specpair": {"category": "code"}}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            got = b""
            while read_until not in got:
                got += s.recv(65536)
            return got

    with ReplayServer() as upstream:
        companion = Companion(CompanionOptions(upstream=f"127.0.0.1:{upstream.port}", port=0)).start()
        try:
            assert b"data: [DONE]" in stream(companion.port, b"data: [DONE]")
            # Leaves after the first token, of a reply larger than the sockets' buffers hold (the
            # replay writes it at once: a smaller one was all written before the close was seen).
            stream(companion.port, b'"text":"V"', max_tokens=40_000)
            wait_until("both counted", lambda: sum(companion.tally.metrics.serving_counts().get("code", {})
                                                   .get("requests", {}).values()) == 2, timeout=30)
            assert companion.tally.metrics.serving_counts()["code"]["requests"] == {"ok": 1, "cancelled": 1}
        finally:
            companion.stop()


def test_the_metrics_port_serves_the_same_series_as_the_http_port_and_nothing_else():
    """--metrics-port: /metrics alone, plain HTTP, on the container port `metrics` Prometheus
    scrapes on both engines' pods (the chart's ServiceMonitor); the API stays on the HTTP port."""
    import urllib.error
    import urllib.request

    from specpair.vllm_companion import Companion, CompanionOptions
    from specpair.vllm_companion_bench import ReplayServer

    def get(port: int, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""

    with ReplayServer() as upstream:
        companion = Companion(CompanionOptions(upstream=f"127.0.0.1:{upstream.port}", port=0, metrics_port=0,
                                               pair="p", version="3")).start()
        try:
            assert companion.metrics_port not in (None, 0, companion.port)
            body = json.dumps({"model": "peer", "prompt": "x", "max_tokens": 8, "stream": True,
                               "specpair": {"category": "code"}}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{companion.port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as r:
                assert b"data: [DONE]" in r.read()
            status, text = get(companion.metrics_port, "/metrics")
            counted = 'specpair_requests_total{category="code",engine="vllm",pair="p",protocol="http",status="ok",version="3"} 1.0'
            assert status == 200 and counted in text, text[-2000:]
            assert counted in get(companion.port, "/metrics")[1]
            assert get(companion.metrics_port, "/v1/models")[0] == 404
        finally:
            companion.stop()


def test_a_draining_companion_refuses_new_requests_before_they_start():
    """After SIGTERM (draining), /health and every /v1 request answer 503 "shutting down": a
    request reaching the pod before readiness takes it out of its Service is sent elsewhere by
    its client, not started on a vLLM that is stopping (seen on the devcluster: an empty stream)."""
    import urllib.error
    import urllib.request

    from specpair.vllm_companion import Companion, CompanionOptions
    from specpair.vllm_companion_bench import ReplayServer

    with ReplayServer() as upstream:
        companion = Companion(CompanionOptions(upstream=f"127.0.0.1:{upstream.port}", port=0)).start()
        try:
            body = json.dumps({"model": "peer", "prompt": "x", "max_tokens": 4, "stream": True}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{companion.port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as r:
                assert r.status == 200 and b"data: [DONE]" in r.read()
            companion.draining = True
            for path, data in (("/v1/completions", body), ("/health", None)):
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(urllib.request.Request(
                        f"http://127.0.0.1:{companion.port}{path}", data, {"Content-Type": "application/json"}),
                        timeout=30)
                assert refused.value.code == 503
                if path != "/health":
                    assert "shutting down" in json.loads(refused.value.read())["error"]["message"]
        finally:
            companion.stop(drain=False)


def test_a_chunked_body_is_read_whole_however_it_is_cut():
    """specpair.vllm_front.ChunkedReader: chunk extensions, a trailer, the bytes after the body,
    fed whole and one byte at a time; a size that is no hex number is refused."""
    from specpair.vllm_front import BadMessage, ChunkedReader

    wire = b"5;ext=1\r\nhello\r\n1\r\n \r\nb\r\nworld, once\r\n0\r\nX-Trailer: t\r\n\r\nNEXT"
    for step in (len(wire), 1, 3):
        reader, got = ChunkedReader(), b""
        for i in range(0, len(wire), step):
            got += reader.feed(wire[i:i + step])
        assert (got, reader.done, reader.rest()) == (b"hello world, once", True, b"NEXT"), step
    with pytest.raises(BadMessage):
        ChunkedReader().feed(b"zz\r\nhello\r\n")


def test_whole_chunks_are_told_from_cut_ones_extensions_and_the_last_chunk():
    """ChunkedReader.whole_chunks: the reads the companion passes on in vLLM's own framing
    (whole chunks, the reader at a chunk's start); any other read is decoded."""
    from specpair.vllm_front import ChunkedReader

    event = b"%x\r\n%s\r\n" % (len(TOKEN_CHUNK), TOKEN_CHUNK)
    reader = ChunkedReader()
    assert reader.whole_chunks(event) and reader.whole_chunks(event * 3)
    for read in (event[:-1], event[:-2], event + event[:9], b"5;ext=1\r\nhello\r\n", b"0\r\n\r\n",
                 event + b"0\r\n\r\n", b"zz\r\nhello\r\n", b"5\r\nhelloXY", b"", b"\r\nhello\r\n"):
        assert not reader.whole_chunks(read), read
    first = reader.feed(event[:9])          # mid-chunk: nothing is whole from here
    assert not reader.whole_chunks(event)
    assert first + reader.feed(event[9:] + event) == TOKEN_CHUNK * 2 and reader.whole_chunks(event)


def test_a_stream_of_events_one_read_each_reaches_the_client_whole_and_is_counted():
    """Over real sockets, the replay upstream on vLLM's step clock (events 5 ms apart): each event
    comes on a read of its own and goes on in vLLM's framing; the client's chunked body decodes
    to every event in order, [DONE] last, no usage chunk (it did not ask), and the reply counted
    with its tokens; a client that asks for usage gets it."""
    import socket

    from specpair.vllm_companion import Companion, CompanionOptions
    from specpair.vllm_companion_bench import ReplayServer
    from specpair.vllm_front import ChunkedReader

    def streamed(port: int, tokens: int, usage: bool) -> bytes:
        body = json.dumps({"model": "peer", "prompt": "x", "max_tokens": tokens, "stream": True,
                           "stream_options": {"include_usage": usage}, "specpair": {"category": "code"}}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            got = b""
            while b"\r\n0\r\n\r\n" not in got:
                data = s.recv(65536)
                assert data, got
                got += data
        head, _, chunked = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in head.lower()
        reader = ChunkedReader()
        events = reader.feed(chunked)
        assert reader.done and reader.rest() == b""
        return events

    with ReplayServer(gap_ms=5, steps=True) as upstream:
        companion = Companion(CompanionOptions(upstream=f"127.0.0.1:{upstream.port}", port=0)).start()
        try:
            events = streamed(companion.port, 12, usage=False)
            token = events.split(b"\n\n")[0] + b"\n\n"
            assert token.startswith(b"data: {") and b'"text":"V"' in token
            assert events == token * 12 + DONE
            events = streamed(companion.port, 3, usage=True)
            assert events.startswith(token * 3) and events.endswith(DONE) and events.count(b'"usage"') == 1
            counts = companion.tally.metrics.serving_counts()["code"]
            assert counts["requests"] == {"ok": 2} and counts["tpot"]["count"] == 2
            assert companion.tally.stats_message("p", "1", True, 1.0).categories["code"].cumulative \
                .num_emitted_tokens == 2 * 8       # the replayed usage chunk says 8 completion tokens
        finally:
            companion.stop()


def test_one_connection_carries_a_chunked_request_and_two_pipelined_ones_in_order():
    """The companion's own HTTP/1.1 front (specpair.vllm_front) over a real socket, the replay
    upstream behind it: a chunked request body with `Expect: 100-continue`, then two requests
    sent in one write, each answered whole and in order on the same kept-alive connection."""
    import socket

    from specpair.vllm_companion import Companion, CompanionOptions
    from specpair.vllm_companion_bench import ReplayServer

    def body(tokens: int) -> bytes:
        return json.dumps({"model": "peer", "prompt": "x", "max_tokens": tokens, "stream": True,
                           "specpair": {"category": "code"}}).encode()

    def read_reply(s: socket.socket, buf: bytes) -> tuple[bytes, bytes]:
        """One chunked reply (its head and body) from the socket; the bytes after it."""
        while b"\r\n0\r\n\r\n" not in buf:
            data = s.recv(65536)
            assert data, buf
            buf += data
        end = buf.index(b"\r\n0\r\n\r\n") + 7
        return buf[:end], buf[end:]

    with ReplayServer() as upstream:
        companion = Companion(CompanionOptions(upstream=f"127.0.0.1:{upstream.port}", port=0)).start()
        try:
            with socket.create_connection(("127.0.0.1", companion.port), timeout=30) as s:
                first = body(2)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                          b"Expect: 100-continue\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
                s.sendall(b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, first[:10], len(first) - 10, first[10:]))
                reply, rest = read_reply(s, b"")
                assert reply.startswith(b"HTTP/1.1 200 ") and reply.count(b'"text":"V"') == 2
                assert b'"usage"' not in reply and b"data: [DONE]" in reply     # usage read, not passed on
                pipelined = b"".join(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                                     % (len(b), b) for b in (body(3), body(5)))
                s.sendall(pipelined)
                second, rest = read_reply(s, rest)
                third, rest = read_reply(s, rest)
                assert (second.count(b'"text":"V"'), third.count(b'"text":"V"'), rest) == (3, 5, b"")
                # A HEAD's reply has no body, whatever its Content-Length says: the next reply follows it.
                s.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n"
                          b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                          % (len(body(1)), body(1)))
                fourth, rest = read_reply(s, b"")
                head, _, post = fourth.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 ") and post.startswith(b"HTTP/1.1 200 "), fourth
                assert post.count(b'"text":"V"') == 1 and rest == b""
            counts = companion.tally.metrics.serving_counts()["code"]["requests"]
            assert counts == {"ok": 4}
        finally:
            companion.stop()
