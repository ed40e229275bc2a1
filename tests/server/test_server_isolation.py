"""One request's fault stays its own: six requests stream on, over gRPC and HTTP (the official
`openai` client), while bad requests are refused and a request that makes a step raise is ended
alone. Real servers over 127.0.0.1, tiny real models; every reply equals what it is alone."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from serving_helpers import client_for, make_engine, openai_client, reference, rpc_error, wait_for
from specpair.server import admission
from specpair.server.client import request
from specpair.server.requests import Limits

PROMPTS = ["def foo(x):", "import os", "class Stack:", "for i in range(10):", "The quick brown fox", "while True:"]
# (each runs to the length limit: none ends before the others are probed)
LONG = 96


def _post(server, body, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _requests(server, status: str, protocol: str) -> float:
    return server.metrics.registry.get_sample_value("specpair_requests_total", {
        "pair": "tiny", "version": "1", "engine": "specpair", "category": "general", "protocol": protocol,
        "status": status}) or 0.0


class Streams:
    """Requests streaming in threads of their own; each records its text and when its pieces came."""

    def __init__(self, server, jobs: list[tuple[str, str, dict]]):
        self.server, self.jobs = server, jobs     # (protocol, prompt, options)
        self.texts: list[str | Exception] = [""] * len(jobs)
        self.times: list[list[float]] = [[] for _ in jobs]
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(jobs))]

    def run_alone(self) -> list[str]:
        for i in range(len(self.jobs)):
            self._run(i)
        return list(self.texts)

    def start(self) -> "Streams":
        for t in self.threads:
            t.start()
        return self

    def join(self) -> list[str]:
        for t in self.threads:
            t.join(120)
        return list(self.texts)

    def _run(self, i: int) -> None:
        protocol, prompt, options = self.jobs[i]
        self.texts[i], self.times[i] = "", []
        try:
            if protocol == "grpc":
                with client_for(self.server) as c:
                    pieces = (m.text for m in c.stream(request(prompt, max_new_tokens=LONG, **options), timeout=120))
                    self._collect(i, pieces)
            else:
                extra = {"specpair": {"k": options["speculation_k"]}} if "speculation_k" in options else {}
                stream = openai_client(self.server).completions.create(
                    model="tiny", prompt=prompt, max_tokens=LONG, stream=True, extra_body=extra,
                    temperature=options.get("temperature", 0), seed=options.get("seed"))
                self._collect(i, (chunk.choices[0].text for chunk in stream))
        except Exception as exc:   # kept for the assertion that names it
            self.texts[i] = exc

    def _collect(self, i: int, pieces) -> None:
        for text in pieces:
            self.texts[i] += text
            self.times[i].append(time.monotonic())

    def all_running(self) -> bool:
        return self.server.worker.running >= len(self.jobs) and all(self.times)

    def still_streaming_after(self, moment: float) -> bool:
        """Every stream had pieces before `moment` and after it: it ran through it."""
        return all(t[0] < moment < t[-1] for t in self.times)


GREEDY_SIX = [("grpc" if i % 2 else "http", p, {}) for i, p in enumerate(PROMPTS)]


def test_bad_fields_are_refused_while_six_requests_stream_on_untouched(tiny_pair, start_server):
    server = start_server(engine=make_engine(tiny_pair, delay=0.05), http_port=0, max_batch_size=8,
                          limits=Limits(max_new_tokens=256))
    streams = Streams(server, GREEDY_SIX).start()
    wait_for(streams.all_running, timeout=60)
    chat = [{"role": "user", "content": "hi"}]
    deep = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 5000 + \
        b"]" * 5000 + b"}"
    refusals = [   # (body, path, param, words)
        ({"messages": chat, "top_k": 2 ** 63}, "/v1/chat/completions", "top_k", "vocabulary size 400"),
        (b'{"prompt": "ab\\ud800cd", "max_tokens": 4}', "/v1/completions", "prompt", "U+D800 at character 2"),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "/v1/chat/completions",
         "messages[0].content", "not valid Unicode"),
        ({"messages": chat, "stop": ["ok", "\ud800"]}, "/v1/chat/completions", "stop[1]", "not valid Unicode"),
        (deep, "/v1/chat/completions", None, "nested too deeply"),
        ({"messages": chat, "temperature": 10 ** 400}, "/v1/chat/completions", "temperature", "finite"),
        ({"messages": chat, "max_tokens": 2 ** 63}, "/v1/chat/completions", "max_tokens", "limit of 256"),
        ({"messages": chat, "seed": 2 ** 64}, "/v1/chat/completions", "seed", "[0, 2**64)"),
        ({"messages": chat, "seed": -1}, "/v1/chat/completions", "seed", "[0, 2**64)"),
    ]
    for body, path, param, words in refusals:
        if isinstance(body, dict):
            body = json.dumps({"model": "tiny", **body}).encode()    # "\ud800" goes out as its JSON escape
        status, reply = _post(server, body, path)
        assert status == 400, (body[:80], reply)
        assert reply["error"]["param"] == param and words in reply["error"]["message"], reply
    with pytest.raises(openai.BadRequestError) as info:
        openai_client(server).chat.completions.create(model="tiny", messages=chat, max_tokens=4,
                                                      extra_body={"top_k": 2 ** 63})
    assert info.value.body["param"] == "top_k"
    with client_for(server) as c:
        err = rpc_error(lambda: c.generate("hi", max_new_tokens=4, top_k=401, timeout=30))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("top_k: ")
        # The documented lower bound arrives as float32 0.0099999998 and is taken as written.
        assert len(c.generate("hi", max_new_tokens=4, temperature=0.01, seed=7, timeout=30).token_ids) == 4
    refused_at = time.monotonic()
    texts = streams.join()
    assert streams.still_streaming_after(refused_at), "the six ended before the refusals: nothing was probed"
    assert texts == [reference(tiny_pair, p, LONG).text for p in PROMPTS]
    assert _requests(server, "invalid", "http") == len(refusals) + 1
    assert _requests(server, "invalid", "grpc") == 1
    assert _requests(server, "error", "http") == _requests(server, "error", "grpc") == 0


@pytest.mark.slow
def test_a_request_that_makes_a_step_raise_fails_alone(tiny_pair, start_server, monkeypatch):
    # The checks refuse every value known to make a step raise; let one through as before them:
    # top_k = 2**63 then overflows the step's int64 top-k tensor and Batch.step() raises.
    check = admission.check_fields
    monkeypatch.setattr(admission, "check_fields", lambda fields, limits, **kw: check(
        fields, limits, **{**kw, "vocab_size": None}))
    engine = make_engine(tiny_pair, delay=0.05)
    server = start_server(engine=engine, http_port=0, max_batch_size=8, limits=Limits(max_new_tokens=256))
    sampled = dict(temperature=0.9, seed=1234, speculation_k=0)
    jobs = GREEDY_SIX[:4] + [("grpc", PROMPTS[4], sampled), ("http", PROMPTS[5], sampled)]
    # Each reply alone, unpaced: pacing changes when steps run, never what they compute (29 s paced).
    engine.step_delay = 0.0
    alone = Streams(server, jobs).run_alone()
    engine.step_delay = 0.05
    assert alone[:4] == [reference(tiny_pair, p, LONG).text for p in PROMPTS[:4]]
    assert all(isinstance(t, str) and t for t in alone), alone

    streams = Streams(server, jobs).start()
    wait_for(streams.all_running, timeout=60)
    with pytest.raises(openai.InternalServerError) as info:
        openai_client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4, extra_body={"top_k": 2 ** 63})
    failed_at = time.monotonic()
    message = info.value.body["message"]
    assert "this request makes the engine step fail" in message and "Overflow" in message, message
    texts = streams.join()
    assert streams.still_streaming_after(failed_at), "the six ended before the failure: nothing was probed"
    assert texts == alone
    assert _requests(server, "error", "http") == 1 and _requests(server, "error", "grpc") == 0
    with client_for(server) as c:     # and the server goes on
        assert c.generate(PROMPTS[0], max_new_tokens=8, timeout=30).text == reference(tiny_pair, PROMPTS[0], 8).text
