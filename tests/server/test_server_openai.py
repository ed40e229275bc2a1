"""The OpenAI-compatible HTTP front: the official `openai` client and curl against real servers."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from tiny_models import save_tiny

from serving_helpers import client_for, make_engine, openai_client, reference, rpc_error, tiny_server, wait_for

CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]
LONG = 400


@pytest.fixture(scope="module")
def http_server(tiny_pair):
    with tiny_server(tiny_pair, metrics_port=None, http_port=0, max_queue=64) as server:
        yield server


def post(server, path: str, body, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), {k.lower(): v for k, v in err.headers.items()}


def get(server, path: str, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def assert_openai_error(body: dict, param, *words):
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == param, body
    for w in words:
        assert w in body["error"]["message"], body


def sample(server, name: str, **labels) -> float:
    base = {"pair": server.options.pair, "version": server.options.version, "engine": "specpair"}
    return server.metrics.registry.get_sample_value(name, {**base, **labels}) or 0.0


def test_openai_client_streams_a_chat_completion_equal_to_grpc_and_generate(tiny_pair, http_server):
    client = openai_client(http_server)
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    figures = finals[0].model_extra["specpair"]
    assert figures["drafted_tokens"] > 0 and 0 <= figures["accepted_tokens"] <= figures["drafted_tokens"]
    assert figures["acceptance_rate"] == pytest.approx(figures["accepted_tokens"] / figures["drafted_tokens"])
    assert figures["mean_acceptance_length"] >= 1.0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 24
    # The same text as target-only decoding of the chat prompt, and as the gRPC path.
    ref = reference(tiny_pair, CHAT, 24, chat=True)
    assert text == ref.text
    with client_for(http_server) as c:
        assert c.generate(CHAT, max_new_tokens=24).text == text
    # Not streamed: the same reply in one object.
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=24, temperature=0)
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 24 and whole.model_extra["specpair"]["drafted_tokens"] > 0


def test_completions_and_models(tiny_pair, http_server):
    client = openai_client(http_server)
    ref = reference(tiny_pair, "def foo(x):", 12)
    done = client.completions.create(model="tiny", prompt="def foo(x):", max_tokens=12, temperature=0)
    assert done.choices[0].text == ref.text and done.choices[0].finish_reason == "length"
    streamed = client.completions.create(model="tiny", prompt="def foo(x):", max_tokens=12, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ref.text
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["specpair"]["pair"] == "tiny"
    assert models[0].model_extra["specpair"]["version"] == "1"
    assert models[0].model_extra["max_model_len"] == 512
    status, health = get(http_server, "/health")
    assert status == 200 and health["status"] == "serving"
    # Without max_tokens a reply may run to the limit (256 here), as OpenAI's API does.
    status, body, _ = post(http_server, "/v1/completions", {"prompt": "def foo(x):", "stop": ["\n\n\n"]})
    assert status == 200 and body["usage"]["completion_tokens"] <= 256


def test_curl_streams_a_chat_completion(tiny_pair, http_server):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 16, "temperature": 0, "stream": True}
    out = subprocess.run(["curl", "-sSN", f"http://127.0.0.1:{http_server.http_port}/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=60, check=True)
    events = [line[len("data: "):] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == reference(tiny_pair, CHAT, 16, chat=True).text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "specpair" in chunks[-1]


@pytest.mark.parametrize("body, status, param, words", [
    ({"max_tokens": -5}, 400, "max_tokens", ["max_tokens: must be >= 1, got -5"]),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens", ["must be >= 1"]),
    ({"max_tokens": 300}, 400, "max_tokens", ["beyond this server's limit of 256"]),
    ({"n": 0}, 400, "n", ["must be in [1, 16]"]),
    ({"logprobs": 3}, 400, "logprobs", ["must be a boolean"]),
    ({"temperature": -1}, 400, "temperature", ["must be >= 0"]),
    ({"temperature": "hot"}, 400, "temperature", ["must be a number"]),
    ({"top_p": 0}, 400, "top_p", ["(0, 1]"]),
    ({"stop": ["ok", ""]}, 400, "stop[1]", ["empty stop string"]),
    ({"stop": 3}, 400, "stop", ["string or an array"]),
    ({"seed": -1}, 400, "seed", ["[0, 2**64)"]),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", ["unknown chat role"]),
    ({"messages": []}, 400, "messages", ["empty prompt"]),
    ({"messages": [{"role": "user", "content": "x " * 700}]}, 413, "messages", ["the model's context is 512"]),
    ({"max_tokens": 200, "messages": [{"role": "user", "content": "x " * 200}]}, 400, "max_tokens",
     ["exceed the model's context of 512"]),
    ({"model": "gpt-4"}, 404, "model", ["not served here"]),
    ({"specpair": {"k": 99}}, 400, "specpair.k", ["<= 16"]),
])
def test_bad_requests_get_openai_errors(http_server, body, status, param, words):
    before = sample(http_server, "specpair_requests_total", category="general", protocol="http", status="invalid")
    got, reply, _ = post(http_server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, **body})
    assert got == status, reply
    assert_openai_error(reply, param, *words)
    assert sample(http_server, "specpair_requests_total", category="general", protocol="http",
                  status="invalid") == before + 1


def test_bad_bodies_and_the_openai_client_raising(http_server):
    got, reply, _ = post(http_server, "/v1/chat/completions", b"{not json")
    assert got == 400 and "not valid JSON" in reply["error"]["message"]
    got, reply, _ = post(http_server, "/v1/completions", b"x" * (64 * 1024 + 1))
    assert got == 413 and reply["error"]["code"] == "request_too_large"
    got, reply, _ = post(http_server, "/v1/completions", {"prompt": ["a", "b"]})
    assert got == 400 and reply["error"]["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(http_server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=-5)
    assert info.value.status_code == 400 and info.value.body["param"] == "max_tokens"


def test_stop_strings_end_the_reply_before_the_stop(tiny_pair, http_server):
    ref = reference(tiny_pair, CHAT, 40, chat=True).text
    stop = ref[len(ref) // 2: len(ref) // 2 + 3]
    expected = ref[:ref.index(stop)]
    client = openai_client(http_server)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=0,
                                                 stop=stop, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == expected and all(stop not in p for p in pieces)
    assert chunks[-1].choices[0].finish_reason == "stop"
    whole = client.completions.create(model="tiny", prompt="def foo(x):", max_tokens=40, temperature=0,
                                      stop=[reference(tiny_pair, "def foo(x):", 40).text[5:8], "zzz"])
    assert whole.choices[0].text == reference(tiny_pair, "def foo(x):", 40).text[:5]


def test_64_concurrent_streaming_clients_all_complete(tiny_pair, http_server):
    prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(4)]
    refs = [reference(tiny_pair, p, 16, chat=True).text for p in prompts]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http_server.http_port}/v1", api_key="none",
                                max_retries=0, timeout=120)

    async def one(i):
        stream = await client.chat.completions.create(model="tiny", messages=prompts[i % 4], max_tokens=16,
                                                      temperature=0, stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return i, text, reason

    async def all_of_them():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 120)
        finally:
            await client.close()

    before = sample(http_server, "specpair_requests_total", category="general", protocol="http", status="ok")
    started = time.monotonic()
    results = asyncio.run(all_of_them())
    assert time.monotonic() - started < 120
    assert all(reason == "length" and text == refs[i % 4] for i, text, reason in results)
    assert sample(http_server, "specpair_requests_total", category="general", protocol="http",
                  status="ok") == before + 64
    assert sample(http_server, "specpair_time_to_first_token_seconds_count", category="general",
                  protocol="http") >= 64


def _raw_request(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot(tiny_pair, start_server, stream):
    server = start_server(engine=make_engine(tiny_pair, delay=0.02), http_port=0, max_batch_size=2)
    running = lambda: sample(server, "specpair_num_requests_running")   # noqa: E731
    sock = _raw_request(server.http_port, {"messages": CHAT, "max_tokens": LONG, "stream": stream})
    if stream:      # it is streaming
        seen = b""
        while b"data:" not in seen:
            seen += sock.recv(4096)
    assert wait_for(lambda: running() == 1, timeout=60)
    sock.close()
    assert wait_for(lambda: server.worker.running == 0 and running() == 0, timeout=60)
    assert wait_for(lambda: sample(server, "specpair_requests_total", category="general", protocol="http",
                                   status="cancelled") == 1)
    # The slot is free: the next request runs at once.
    reply = openai_client(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert reply.usage.completion_tokens == 4


def test_queue_full_is_429_and_loading_is_503(tiny_pair, start_server):
    server = start_server(engine=make_engine(tiny_pair, delay=0.02), http_port=0, max_batch_size=1, max_queue=0)
    sock = _raw_request(server.http_port, {"messages": CHAT, "max_tokens": LONG, "stream": True})
    try:
        assert wait_for(lambda: server.worker.running == 1, timeout=60)
        got, body, headers = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
        assert got == 429 and body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
        assert "queue is full" in body["error"]["message"] and headers.get("retry-after") == "1"
        # At once: refused while the long stream still runs (was: within 1 s of wall time).
        assert server.worker.running == 1
        assert sample(server, "specpair_requests_total", category="general", protocol="http", status="rejected") == 1
    finally:
        sock.close()

    gate = threading.Event()
    engine = make_engine(tiny_pair)
    loading = start_server(load=lambda: gate.wait(30) and engine, wait=False, http_port=0)
    assert wait_for(lambda: loading.http_port and loading.phase == "loading")
    got, body, _ = post(loading, "/v1/chat/completions", {"messages": CHAT})
    assert got == 503 and "still loading" in body["error"]["message"]
    assert get(loading, "/health")[0] == 503
    gate.set()
    assert wait_for(lambda: get(loading, "/health")[0] == 200, timeout=30)


def test_draining_lets_streams_finish_and_refuses_new_requests(tiny_pair, start_server):
    server = start_server(engine=make_engine(tiny_pair, delay=0.01), http_port=0, drain_timeout=10)
    results = {}

    def consume():
        results["chunks"] = list(openai_client(server).chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=60, stream=True))
    reader = threading.Thread(target=consume)
    reader.start()
    assert wait_for(lambda: server.worker.running == 1, timeout=60)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    assert wait_for(lambda: server.phase == "draining")
    got, body, _ = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
    assert got == 503 and body["error"]["code"] == "unavailable"
    reader.join(30)
    stopper.join(30)
    assert results["chunks"][-1].choices[0].finish_reason in ("stop", "length")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_command_with_http_and_a_bearer_token(tiny_pair, tmp_path):
    target, draft = tiny_pair
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    http_port, grpc_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "specpair.server", "engine", "serve", "--target", save_tiny(target, tmp_path / "t"),
           "--draft", save_tiny(draft, tmp_path / "d"), "--pair", "cli-pair", "--version", "3",
           "--host", "127.0.0.1", "--port", str(grpc_port), "--metrics-port", "-1", "--insecure", "--device", "cpu",
           "--http-port", str(http_port), "--auth-token-file", str(token), "--http-read-timeout", "5"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{http_port}"

    def health():
        try:
            return urllib.request.urlopen(base + "/health", timeout=1).status == 200
        except OSError:
            return server.poll() is not None
    try:
        assert wait_for(health, timeout=90, interval=0.2) and server.poll() is None
        body = json.dumps({"model": "cli-pair", "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True})
        curl = ["curl", "-sN", "-w", "\n%{http_code}", base + "/v1/chat/completions",
                "-H", "Content-Type: application/json", "-d", body]
        refused = subprocess.run(curl, capture_output=True, text=True, timeout=60)
        assert refused.stdout.endswith("\n401"), refused.stdout
        assert json.loads(refused.stdout.rsplit("\n", 1)[0])["error"]["code"] == "invalid_api_key"
        wrong = subprocess.run(curl + ["-H", "Authorization: Bearer nope"], capture_output=True, text=True, timeout=60)
        assert wrong.stdout.endswith("\n401")
        ok = subprocess.run(curl + ["-H", "Authorization: Bearer s3cret"], capture_output=True, text=True, timeout=60)
        assert ok.stdout.endswith("\n200") and "data: [DONE]" in ok.stdout
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
        client = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert client.models.list().data[0].model_extra["specpair"]["version"] == "3"
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="cli-pair", messages=CHAT, max_tokens=8, temperature=0, stream=True))
        assert text == reference(tiny_pair, CHAT, 8, chat=True).text
        # The same token guards the gRPC serving port.
        from specpair.server.client import EngineClient
        with EngineClient(f"127.0.0.1:{grpc_port}", insecure=True) as anonymous:
            err = rpc_error(lambda: anonymous.generate("def foo(x):", max_new_tokens=4, timeout=30))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        with EngineClient(f"127.0.0.1:{grpc_port}", token="s3cret", insecure=True) as c:
            assert c.generate("def foo(x):", max_new_tokens=4, timeout=30).token_ids == \
                reference(tiny_pair, "def foo(x):", 4).token_ids
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
        assert "OpenAI-compatible HTTP on" in server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_unknown_routes_and_a_taken_port(tiny_pair, http_server, start_server):
    status, body = get(http_server, "/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"
    got, body, _ = post(http_server, "/v1/models", {})
    assert got == 405 and set(body["error"]) == {"message", "type", "param", "code"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="HTTP server did not start"):
            start_server(engine=make_engine(tiny_pair), http_port=taken.getsockname()[1])
