"""specpair.vllm_peer: our speculation settings as vLLM's, its /metrics counters, and a real vLLM
server (its own virtualenv, scripts/setup-vllm.sh) whose greedy ids equal our engine's, and whose
/metrics the operator's serving-health watch reads (engine_probe.VllmProbe).

The pure tests run everywhere. The `vllm` ones share one real server: the vLLM container of the
engine pod the operator renders for a pair at tensor parallel 2, its command and env exactly as
rendered (`specpair.vllm_serve --release ... --uds ...`, VLLM_CPU_OMP_THREADS_BIND "0|1"), its
target split over two CPU processes: its greedy ids equal our engine's target-only ones, so
tensor parallel 2 answers as 1 does (issue 53;
one vLLM start for it in CI, here rather than in the devcluster pair test, where each tensor
parallel 2 start took 7-10 min under load). They skip where the vLLM virtualenv is absent unless SPECPAIR_REQUIRE_VLLM is set (conftest), and
`-m "not vllm"` leaves them out on purpose.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import vllm_structured_golden

from specpair.config import SpeculationConfig
from specpair.contract import content_hash
from specpair.errors import SpecpairError
from specpair.vllm_peer import (VLLM_METHODS, SpecDecodeCounters, VllmServer, default_python, ngram_defaults,
                                parse_spec_decode_metrics, serving_flags, speculative_config)

# Captured from vLLM 0.32.0's /metrics (SmolLM2 fp32, ngram k=4, after two requests), cut to
# the spec-decode block and its neighbours: the `_created` gauges must not count, nor others.
REAL_METRICS = """\
# HELP process_open_fds Number of open file descriptors.
# TYPE process_open_fds gauge
process_open_fds 34.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="smol"} 15.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="smol"} 1.7954755806401868e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="smol"} 57.0
# HELP vllm:spec_decode_num_draft_tokens_created Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_created gauge
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="smol"} 1.7954755806402216e+09
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="smol"} 7.0
# HELP vllm:spec_decode_num_accepted_tokens_created Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_created gauge
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="smol"} 1.7954755806402452e+09
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="0"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="2"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="3"} 1.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_created Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smol",position="0"} 1.795475580640279e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smol",position="1"} 1.7954755806402884e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smol",position="2"} 1.795475580640296e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smol",position="3"} 1.7954755806404524e+09
# HELP vllm:estimated_flops_per_gpu_total Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).
# TYPE vllm:estimated_flops_per_gpu_total counter
vllm:estimated_flops_per_gpu_total{engine="0",model_name="smol"} 0.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="smol"} 60.0
"""


# -- speculative_config -----------------------------------------------------------------------


def test_ngram_release_maps_to_vllm_ngram_with_the_engines_defaults():
    max_n, min_n = ngram_defaults()
    from specpair.drafters import NgramDrafter
    assert (max_n, min_n) == (NgramDrafter().max_ngram, NgramDrafter().min_ngram)  # the drafter's own
    release = {"target": {"source": "default"}, "draft": {"drafter": "ngram"}, "speculation": {"k": 5}}
    assert speculative_config(release) == {"method": "ngram", "num_speculative_tokens": 5,
                                           "prompt_lookup_max": max_n, "prompt_lookup_min": min_n}
    # No k in the release: the engine's default k.
    assert speculative_config({"draft": {"drafter": "ngram"}})["num_speculative_tokens"] == SpeculationConfig().k


def test_engine_descriptions_and_draft_models_map_too():
    # What the bench has: the drafter's describe() and the engine's k.
    assert speculative_config({"kind": "ngram", "max_ngram": 4, "min_ngram": 2}, k=6) == {
        "method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert speculative_config({"kind": "model", "source": "x", "path": "/models/draft"}, k=3) == {
        "model": "/models/draft", "num_speculative_tokens": 3}
    assert speculative_config({"draft": {"source": "/models/draft"}, "speculation": {"k": 2}}) == {
        "model": "/models/draft", "num_speculative_tokens": 2}
    # An explicit k wins over the release's.
    assert speculative_config({"draft": {"drafter": "ngram"}, "speculation": {"k": 2}}, k=7)[
        "num_speculative_tokens"] == 7


def test_target_only_and_bad_settings():
    assert speculative_config(None) is None
    assert speculative_config({}) is None
    assert speculative_config({"draft": {"drafter": "ngram"}, "speculation": {"enabled": False}}) is None
    with pytest.raises(SpecpairError, match="no vLLM speculative config for drafter 'eagle'"):
        speculative_config({"draft": {"drafter": "eagle"}})
    with pytest.raises(SpecpairError, match="k must be >= 1"):
        speculative_config({"kind": "ngram"}, k=0)
    with pytest.raises(SpecpairError, match="min_ngram <= max_ngram"):
        speculative_config({"kind": "ngram", "max_ngram": 1, "min_ngram": 2})
    with pytest.raises(SpecpairError, match="'source'"):
        speculative_config({"draft": {}})
    with pytest.raises(SpecpairError, match="treeWidth"):    # token trees: our engine's only
        speculative_config({"draft": {"drafter": "ngram"}, "speculation": {"treeWidth": 2}})
    with pytest.raises(SpecpairError, match="lookupMinMatch"):   # lookup before a head: ours too
        speculative_config({"draft": {"source": "/models/head"}, "speculation": {"lookupMinMatch": 2}})


@pytest.mark.parametrize("method", [m for m in VLLM_METHODS if m != "ngram"])
def test_a_draft_models_method_and_draft_tensor_parallel_size_reach_the_config(method):
    release = {"draft": {"source": "/models/head", "method": method, "draftTensorParallel": 2},
               "speculation": {"k": 3}}
    assert speculative_config(release) == {"model": "/models/head", "num_speculative_tokens": 3,
                                           "method": VLLM_METHODS[method], "draft_tensor_parallel_size": 2}


def test_a_method_that_is_no_draft_models_is_refused():
    for method in ("ngram", "lookahead"):
        with pytest.raises(SpecpairError, match=f"draft method '{method}' with a draft model"):
            speculative_config({"draft": {"source": "/models/draft", "method": method}})


def test_serving_flags_say_the_split_always_and_the_rest_where_set():
    structured = {"--structured-outputs-config": '{"backend": "guidance", "disable_any_whitespace": true}'}
    assert serving_flags({"engine": {"kind": "vllm", "dtype": "auto"}}) == {
        "--tensor-parallel-size": "1", "--pipeline-parallel-size": "1", **structured}
    flags = serving_flags({"parallelism": {"tensor": 8, "pipeline": 2},
                           "engine": {"kind": "vllm", "dtype": "auto", "gpuMemoryUtilization": 0.9,
                                      "maxModelLen": 32768, "quantization": "awq", "kvCacheDtype": "fp8"}})
    assert flags == {"--tensor-parallel-size": "8", "--pipeline-parallel-size": "2",
                     "--gpu-memory-utilization": "0.9", "--max-model-len": "32768", "--quantization": "awq",
                     "--kv-cache-dtype": "fp8", **structured}


# -- /metrics ---------------------------------------------------------------------------------


def test_real_metrics_text_parses_to_ints():
    c = parse_spec_decode_metrics(REAL_METRICS)
    assert c == SpecDecodeCounters(drafts=15, draft_tokens=57, accepted_tokens=7,
                                   accepted_per_position=[2, 2, 2, 1])
    assert all(isinstance(x, int) for x in (c.drafts, c.draft_tokens, c.accepted_tokens, *c.accepted_per_position))
    assert c.acceptance_rate == pytest.approx(7 / 57)
    assert c.mean_acceptance_length == pytest.approx(1 + 7 / 15)
    assert c.acceptance_per_position == pytest.approx([2 / 15, 2 / 15, 2 / 15, 1 / 15])


def test_label_sets_are_summed_and_a_server_without_speculation_reads_zero():
    # Two engines (data parallel) or two served names: the counters add up, position by position.
    second = REAL_METRICS.replace('engine="0"', 'engine="1"')
    c = parse_spec_decode_metrics(REAL_METRICS + second)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position) == (30, 114, 14, [4, 4, 4, 2])
    target_only = "\n".join(line for line in REAL_METRICS.splitlines() if "spec_decode" not in line)
    assert parse_spec_decode_metrics(target_only) == SpecDecodeCounters()
    assert parse_spec_decode_metrics("").acceptance_rate == 0.0


def test_counter_deltas_between_scrapes():
    before = SpecDecodeCounters(2, 8, 3, [2, 1])
    after = parse_spec_decode_metrics(REAL_METRICS)
    delta = after - before
    assert delta == SpecDecodeCounters(13, 49, 4, [0, 1, 2, 1])
    assert delta + before == after
    assert SpecDecodeCounters.from_dict(delta.to_dict()) == delta


# -- the server's lifecycle, without vLLM ------------------------------------------------------


def _fake_python(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return script


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"max_position_embeddings": 512}')
    return d


def test_a_server_that_exits_fails_with_its_log(tmp_path):
    python = _fake_python(tmp_path, 'echo "no module named vllm (fake)"; exit 3')
    server = VllmServer(python, _model_dir(tmp_path), start_timeout=30)
    with pytest.raises(SpecpairError, match=r"(?s)exited with code 3.*no module named vllm \(fake\)"):
        server.start()
    assert server.proc is None


def test_a_server_that_never_gets_healthy_is_stopped_with_its_group(tmp_path):
    # The fake leaves a child in its process group, as vLLM's engine core and worker are.
    pidfile = tmp_path / "child.pid"
    python = _fake_python(tmp_path, f'sleep 300 & echo $! > {pidfile}; echo "loading (fake)"; wait')
    server = VllmServer(python, _model_dir(tmp_path), start_timeout=2)
    started = time.monotonic()
    with pytest.raises(SpecpairError, match=r"(?s)not healthy after 2 s.*loading \(fake\)"):
        server.start()
    assert time.monotonic() - started < 30
    child = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_missing_python_or_model_directory(tmp_path):
    with pytest.raises(SpecpairError, match="setup-vllm.sh"):
        VllmServer(tmp_path / "nope" / "python", _model_dir(tmp_path)).start()
    with pytest.raises(SpecpairError, match="local model directory"):
        VllmServer(_fake_python(tmp_path, "exit 0"), tmp_path / "hub-id").start()


UNIX_HTTP_SERVER = """
import http.server, os, socketserver, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):    # a Unix socket's client has no address to log
        pass
    def do_GET(self):
        body = b"ok" if self.path == "/health" else b"vllm:num_requests_running 0.0\\n"
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        data = self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"choices": [{"token_ids": [7, 8], "text": "ab", "finish_reason": "length"}]}'
        self.send_response(200 if b'"max_tokens": 2' in data else 400)
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
socketserver.UnixStreamServer.allow_reuse_address = True
with socketserver.UnixStreamServer(sys.argv[1], Handler) as server:
    server.serve_forever()
"""


def test_a_command_of_its_own_on_a_unix_socket_is_started_asked_and_stopped(tmp_path):
    """`argv` and `uds` (an engine pod's rendered vLLM container, listening on the pod's socket):
    health, requests and /metrics go to the socket; stop ends the process."""
    import sys

    sock = tmp_path / "s.sock"
    server = VllmServer(default_python(), _model_dir(tmp_path), start_timeout=120, uds=sock,
                        argv=[sys.executable, "-c", UNIX_HTTP_SERVER, str(sock)])
    assert server.command()[-1] == str(sock)
    with server:
        pid = server.proc.pid
        reply = server.complete_greedy([1, 2], 2)
        assert (reply.token_ids, reply.text) == ([7, 8], "ab")
        assert "vllm:num_requests_running" in server.metrics_text()
        with pytest.raises(SpecpairError, match="answered 400"):
            server.complete_greedy([1, 2], 3)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_command_and_environment_follow_the_cpu_recipe(tmp_path):
    server = VllmServer("/venv/bin/python", _model_dir(tmp_path), port=8123,
                        speculative={"method": "ngram", "num_speculative_tokens": 4})
    cmd = server.command()
    assert cmd[:4] == ["/venv/bin/python", "-P", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--dtype", "float32"), ("--port", "8123"), ("--host", "127.0.0.1"),
                        ("--max-model-len", "512"), ("--generation-config", "vllm"),
                        ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}')):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enforce-eager" in cmd
    env = server.environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert "PYTHONPATH" not in env


# -- a real vLLM server -------------------------------------------------------------------------


def _processes(field: int, value: int) -> list[int]:
    """Live processes whose /proc stat field (after the name: 1 ppid, 2 process group) is `value`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'.
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[field]) == value and fields[0] != "Z":
                pids.append(int(entry))
    return pids


def _group_members(pgid: int) -> list[int]:
    return _processes(2, pgid)


@pytest.fixture(scope="module")
def tiny_vllm_model(tmp_path_factory, tiny_tokenizer):
    """The tiny random Llama shaped for vLLM's CPU attention (head size 64; 16 fails) and for tensor
    parallel 2 (4 heads, 2 KV heads: each rank takes 2 and 1)."""
    from tiny_models import make_model, save_tiny
    loaded = make_model(tiny_tokenizer, seed=3, hidden=256, heads=4, kv_heads=2)
    return loaded, save_tiny(loaded, tmp_path_factory.mktemp("vllm-tiny") / "target")


@pytest.mark.vllm
def test_the_vllm_venv_imports_nothing_of_ours(tmp_path):
    probe = subprocess.run([str(default_python()), "-P", "-c", "import specpair"], cwd=tmp_path,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'specpair'" in probe.stderr


VLLM_PROMPTS = ("def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
                "import json\nimport os\nimport json\nimport os\nimport",
                "The quick brown fox")
VLLM_MAX_TOKENS = 24


COMPANION_TOKEN = "companion-s3cret"
SERVER_NAME = "engine-peer.t.svc"
# Through the companion: (category, prompt, how it is sent). Code prompts repeat themselves, so
# n-gram lookup drafts and is accepted; the chat prompt gives it little to copy.
COMPANION_REQUESTS = (("code", VLLM_PROMPTS[0], "whole"), ("code", VLLM_PROMPTS[1], "stream"),
                      ("chat", VLLM_PROMPTS[2], "stream+usage"), ("chat", "Hello there, friend", "chat"))


def control_tls(tmp_path) -> tuple[object, object]:
    """The operator's CA, an engine certificate for the companion's control port (mutual TLS),
    and the operator's client certificate, as the operator issues them."""
    from specpair.server.tls import TLSFiles
    from specpair_operator.desired import tls as tls_mod
    from specpair_operator.clients.engine_probe import ClientTLS

    ca = tls_mod.new_ca()
    leaf = tls_mod.issue(ca, "engine-peer", (SERVER_NAME,), server=True, days=1)
    client = tls_mod.issue(ca, tls_mod.OPERATOR_NAME, server=False, days=1)
    for name, data in (("tls.crt", leaf.cert_pem), ("tls.key", leaf.key_pem), ("ca.crt", ca.cert_pem)):
        (tmp_path / name).write_bytes(data)
    return (TLSFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(tmp_path / "ca.crt")),
            ClientTLS(ca=ca.cert_pem, cert=client.cert_pem, key=client.key_pem))


def through_companion(port: int, model: str) -> dict:
    """COMPANION_REQUESTS through the companion with the official client: texts, usage as each
    client saw it, and the chunks of each stream."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=COMPANION_TOKEN, timeout=300)
    out = []
    for category, prompt, how in COMPANION_REQUESTS:
        extra = {"specpair": {"category": category}}
        if how == "whole":
            reply = client.completions.create(model=model, prompt=prompt, max_tokens=VLLM_MAX_TOKENS,
                                              temperature=0, extra_body=extra)
            out.append({"text": reply.choices[0].text, "usage": reply.usage, "chunks": None})
        elif how == "chat":
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=8, temperature=0, extra_body=extra)
            out.append({"text": reply.choices[0].message.content, "usage": reply.usage, "chunks": None})
        else:
            chunks = list(client.completions.create(
                model=model, prompt=prompt, max_tokens=VLLM_MAX_TOKENS, temperature=0, stream=True, extra_body=extra,
                **({"stream_options": {"include_usage": True}} if how == "stream+usage" else {})))
            out.append({"text": "".join(c.choices[0].text for c in chunks if c.choices), "chunks": chunks,
                        "usage": next((c.usage for c in chunks if c.usage), None)})
    try:
        client.with_options(api_key="wrong").models.list()
        out.append({"wrong_token": "answered"})
    except openai.AuthenticationError:
        out.append({"wrong_token": 401})
    return out


# The stream the drain waits on: long enough (ignore_eos) to be seen in flight by a poll every
# 10 ms on a loaded machine; 24 tokens of the tiny model were once over between two polls in CI.
DRAIN_MAX_TOKENS = 256
DRAIN_TIMEOUT = 300


def drain_with_a_stream_in_flight(companion, model: str) -> dict:
    """SIGTERM's drain (Companion.drain) while a client streams through it: what the client got,
    and what /health said meanwhile."""
    import threading

    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{companion.port}/v1", api_key=COMPANION_TOKEN, timeout=300)
    got: dict = {}

    def stream() -> None:
        chunks = client.completions.create(model=model, prompt=VLLM_PROMPTS[0], max_tokens=DRAIN_MAX_TOKENS,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True, "specpair": {"category": "code"}})
        got["usage"] = [c.usage for c in chunks if c.usage]
    streaming = threading.Thread(target=stream)
    streaming.start()
    from waiting import wait_until
    wait_until("the stream in flight", lambda: companion.in_flight == 1, timeout=60, interval=0.01)
    draining = asyncio.run_coroutine_threadsafe(companion.drain(), companion._loop)
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{companion.port}/health", timeout=10)
        got["health"] = 200
    except urllib.error.HTTPError as exc:
        got["health"] = exc.code
    got["left"] = draining.result(DRAIN_TIMEOUT + 30)
    streaming.join(60)
    return got


TENSOR_PARALLEL = 2
TP2_START_TIMEOUT = 900
# The pair whose engine pod the module serves: what a user writes (its target: the tiny model),
# its serving port with TLS and a token.
TP2_PAIR = {"engine": "vllm", "vllm": {"dtype": "float32"}, "draft": {"drafter": "ngram"},
            "speculation": {"k": 4}, "parallelism": {"tensor": TENSOR_PARALLEL},
            "rollout": {"auth": {"tokenSecretRef": {"name": "serving-token"}}, "tls": {"enabled": True}}}


def rendered_engine_pod(model_dir: Path, run: Path) -> dict:
    """The engine pod the operator renders for TP2_PAIR (release.build_release, then the served
    release with its MLflow version as serving_steps.served_release writes it, then
    engine_objects.engine_deployment), with the pod's files laid out under `run` as the kubelet
    mounts them: the release file from the pod's annotation (the downward API), vLLM's socket
    folder. Returns its vLLM container's command and env with their paths moved under `run`,
    the release file's content, the socket's path and the companion container's command (as
    rendered)."""
    import sys

    from specpair.vllm_peer import default_python
    from specpair.vllm_serve import VLLM_SOCKET
    from specpair_operator.desired import engine_objects, manifests
    from specpair_operator.release import content as release_mod

    spec = {**TP2_PAIR, "target": {"source": str(model_dir)}}
    rel = release_mod.build_release("peer", "t", spec, [{"prompt": VLLM_PROMPTS[0], "category": "code"}])
    served = release_mod.with_mlflow(rel, "http://127.0.0.1:1", "peer", "3")
    pod = engine_objects.engine_deployment("peer", "t", served, "ab" * 32, "3", spec["rollout"],
                                           "http://127.0.0.1:1")["spec"]["template"]
    vllm, companion = pod["spec"]["containers"]
    release_file = run / manifests.RELEASE_FILE.lstrip("/")
    release_file.parent.mkdir(parents=True)
    release_file.write_text(pod["metadata"]["annotations"][manifests.ANN_RELEASE])
    (run / VLLM_SOCKET.lstrip("/")).parent.mkdir(parents=True)

    def here(value: str) -> str:
        if not value.startswith("/"):
            return value
        (run / value.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        return str(run / value.lstrip("/"))
    assert vllm["command"][:3] == ["python", "-m", "specpair.vllm_serve"]
    argv = [sys.executable, *(here(arg) for arg in vllm["command"][1:])]
    env = {e["name"]: here(e["value"]) for e in vllm["env"] if "value" in e}
    # The image holds vLLM and specpair in one environment; here vLLM has a virtualenv of its own.
    env["SPECPAIR_VLLM_PYTHON"] = str(default_python())
    return {"argv": argv, "env": env, "release": json.loads(release_file.read_text()),
            "socket": str(run / VLLM_SOCKET.lstrip("/")), "companion": companion["command"]}


def through_the_pairs_tls(pod: dict, run: Path, model: str) -> dict:
    """The pair's rollout.tls against real vLLM: the pod's companion container run from its
    rendered command (TLS with the pair's engine certificate as the operator issues it into the
    Secret, the token Secret, free ports) on the pod's socket, in front of the module's vLLM. The
    official client trusting only the Secret's ca.crt sends a greedy completion, whole and
    streamed, over HTTPS; what a client trusting only the system's CAs, and one speaking
    plaintext, get; the name the served certificate answers to. The companion stopped after."""
    import socket
    import ssl

    import openai
    import rendered_companion
    from cryptography import x509

    from specpair.vllm_peer import free_port
    from specpair_operator.desired import manifests
    from specpair_operator.desired import tls as tls_mod

    service = manifests.engine_name("peer")
    issued = rendered_companion.write_engine_secret(run, tls_mod.new_ca(), service, "t")
    (run / manifests.AUTH_DIR.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (run / manifests.AUTH_DIR.lstrip("/") / "token").write_text(COMPANION_TOKEN + "\n")
    ports = {flag: free_port() for flag in rendered_companion.PORT_FLAGS}
    argv = rendered_companion.local_argv(pod["companion"], run, ports)
    base = f"https://127.0.0.1:{ports['--port']}"
    ca_file = str(run / manifests.TLS_DIR.lstrip("/") / "ca.crt")
    out: dict = {"argv": argv, "issued": x509.load_pem_x509_certificate(issued.cert_pem).serial_number}
    proc = rendered_companion.start(argv, base)
    try:
        # The served certificate, verified against the Secret's CA for the Service's name.
        with socket.create_connection(("127.0.0.1", ports["--port"]), timeout=30) as raw:
            with ssl.create_default_context(cafile=ca_file).wrap_socket(
                    raw, server_hostname=tls_mod.server_name(service, "t")) as conn:
                out["served"] = x509.load_der_x509_certificate(conn.getpeercert(binary_form=True)).serial_number
        by_ip = ssl.create_default_context(cafile=ca_file)
        by_ip.check_hostname = False        # the chain is still verified; the name was checked above
        extra = {"specpair": {"category": "code"}}
        with openai.OpenAI(base_url=f"{base}/v1", api_key=COMPANION_TOKEN, max_retries=0, timeout=300,
                           http_client=openai.DefaultHttpx2Client(verify=by_ip)) as client:
            out["whole"] = client.completions.create(model=model, prompt=VLLM_PROMPTS[0], max_tokens=VLLM_MAX_TOKENS,
                                                     temperature=0, extra_body=extra).choices[0].text
            out["stream"] = "".join(c.choices[0].text for c in client.completions.create(
                model=model, prompt=VLLM_PROMPTS[1], max_tokens=VLLM_MAX_TOKENS, temperature=0, stream=True,
                extra_body=extra) if c.choices)
        # The system's CAs do not know the operator's: the handshake fails, before any request.
        with openai.OpenAI(base_url=f"{base}/v1", api_key=COMPANION_TOKEN, max_retries=0, timeout=60) as system:
            try:
                system.models.list()
                out["system_cas"] = "answered"
            except openai.APIConnectionError as exc:
                out["system_cas"] = repr(exc.__cause__ or exc)
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{ports['--port']}/health", timeout=30)
            out["plaintext"] = "answered"
        except Exception as exc:     # noqa: BLE001 (the TLS port's answer to plaintext, whatever its form)
            out["plaintext"] = repr(exc)
    finally:
        proc.terminate()
        out["exit"] = proc.wait(120)
    return out


@pytest.fixture(scope="module")
def vllm_served(tiny_vllm_model, tmp_path_factory) -> dict:
    """One real vLLM server from start to stop, for the tests below: the engine pod's vLLM
    container of a pair at tensor parallel 2 (n-gram, k=4), its command and env exactly as the
    operator renders them (rendered_engine_pod: `specpair.vllm_serve --release ... --uds ...`,
    VLLM_CPU_OMP_THREADS_BIND; each reply's timings and acceptance in it, structured outputs as
    every vLLM we start decodes them), on the pod's Unix socket: its processes while serving
    and after stop, its spec-decode counters over three greedy requests
    sent to it directly, the vLLM gate's structured golden requests (vllm_structured_golden), and
    the pod's companion
    (specpair.vllm_companion) in front of it: requests of two categories through it, vLLM's own
    counters around them, and what the operator's probe (engine_probe.VllmProbe, mutual TLS) reads
    from it before and after."""
    import tempfile

    from specpair.vllm_companion import Companion, CompanionOptions
    from specpair.vllm_serve import drained_marker, identity_name
    from specpair_operator.clients.engine_probe import EngineUnreachable, NoRuntimeSwitch, VllmProbe

    loaded, model_dir = tiny_vllm_model
    prompts = [loaded.tokenizer(text)["input_ids"] for text in VLLM_PROMPTS]
    run = Path(tempfile.mkdtemp(prefix="sp-tp2-"))      # short: a Unix socket path has ~100 bytes
    pod = rendered_engine_pod(model_dir, run)
    identity = identity_name("peer", "3", content_hash(pod["release"]), True)
    # A start took 247-268 s at tensor parallel 1 beside other jobs (load 8-19); at 2, 7-10 min
    # in the devcluster under load. Stopping, the pod's supervisor holds vLLM's SIGTERM until the
    # companion's drained marker (or stop delay + drain + 10 s), then allows vLLM 10 s.
    server = VllmServer(default_python(), model_dir, start_timeout=TP2_START_TIMEOUT, served_model_name="peer",
                        argv=pod["argv"], extra_env=pod["env"], uds=pod["socket"], stop_seconds=180)
    files, client_tls = control_tls(tmp_path_factory.mktemp("control-tls"))
    probe = VllmProbe(tls=client_tls)
    out: dict = {"pod": pod}
    with server:
        supervisor = server.proc.pid
        # vLLM runs in a session of its own under the pod's supervisor (vllm_serve.supervise).
        vllm_pids = _processes(1, supervisor)
        groups = [supervisor, *vllm_pids]
        serving_members = [pid for group in groups for pid in _group_members(group)]
        out["vllm_argv"] = [Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") for pid in vllm_pids]
        before = server.spec_decode_counters()
        outs = [server.complete_greedy(ids, VLLM_MAX_TOKENS) for ids in prompts]
        counters = server.spec_decode_counters() - before
        out["structured"] = vllm_structured_golden.run_on(server)
        # Before the in-process companion starts (it removes the drained marker this one leaves).
        out["tls"] = through_the_pairs_tls(pod, run, identity)
        # The drain waits for the whole 256-token stream: past the pod's 25 s at tensor parallel 2
        # under load (~38 s at load 32).
        companion = Companion(CompanionOptions(upstream=f"unix:{pod['socket']}", port=0, pair="peer", version="3",
                                               auth_token=COMPANION_TOKEN, control_port=0, control_tls=files,
                                               drain_timeout=DRAIN_TIMEOUT,
                                               drained_marker=drained_marker(pod["socket"]))).start()
        try:
            control = f"127.0.0.1:{companion.control_port}"

            async def read(call):
                try:
                    return await call
                finally:
                    await probe.close()
            out["info"] = asyncio.run(read(probe.model_info(control, server_name=SERVER_NAME)))
            out["stats_before"] = asyncio.run(read(probe.stats(control, server_name=SERVER_NAME)))
            at = server.spec_decode_counters()
            out["replies"] = through_companion(companion.port, identity)
            out["vllm_counters"] = server.spec_decode_counters() - at
            out["stats_after"] = asyncio.run(read(probe.stats(control, server_name=SERVER_NAME)))
            with urllib.request.urlopen(f"http://127.0.0.1:{companion.port}/metrics", timeout=30) as r:
                out["metrics"] = r.read().decode()
            for call in (probe.set_speculation(control, False, server_name=SERVER_NAME),
                         super(VllmProbe, probe).set_speculation(control, False, server_name=SERVER_NAME)):
                try:
                    asyncio.run(read(call))
                except (NoRuntimeSwitch, EngineUnreachable) as exc:
                    out.setdefault("switch", []).append(exc)
            # Without the operator's client certificate the control port refuses the handshake.
            try:
                asyncio.run(read(VllmProbe().stats(control)))
            except EngineUnreachable as exc:
                out["plaintext"] = exc
            out["drain"] = drain_with_a_stream_in_flight(companion, identity)
        finally:
            out["left_in_flight"] = companion.stop()
    print(f"vLLM at tensor parallel {TENSOR_PARALLEL} started in {server.start_seconds:.1f} s")
    stopped = [pid for group in groups for pid in _group_members(group)]
    return {"prompts": prompts, "outs": outs, "counters": counters, "server": server, "identity": identity,
            "serving_members": serving_members, "stopped_members": stopped, **out}


@pytest.mark.vllm
@pytest.mark.timeout(1500)   # the module's vLLM start counts in the first test that uses it
def test_vllm_greedy_equals_ours_and_reports_ngram_drafts(tiny_vllm_model, vllm_served):
    from specpair.bench import _run_one
    from specpair.config import GenerationParams
    from specpair.decoding import SpeculativeEngine

    loaded, _model_dir = tiny_vllm_model
    engine = SpeculativeEngine(loaded, speculation=SpeculationConfig(enabled=False))
    ours = [_run_one(engine, ids, GenerationParams(max_new_tokens=VLLM_MAX_TOKENS), speculate=False).token_ids
            for ids in vllm_served["prompts"]]
    assert sum(len(ids) for ids in ours) > 2 * VLLM_MAX_TOKENS      # not a comparison of early EOSes

    outs, counters, server = vllm_served["outs"], vllm_served["counters"], vllm_served["server"]
    # The operator's rendering: the pod binds each rank to a core of its own, and its vLLM
    # process (under the pod's supervisor) was started split in two, on the pod's socket.
    assert vllm_served["pod"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    [vllm_argv] = vllm_served["vllm_argv"]
    assert vllm_argv[vllm_argv.index("--tensor-parallel-size") + 1] == str(TENSOR_PARALLEL)
    assert vllm_argv[vllm_argv.index("--uds") + 1].endswith("/var/run/specpair/vllm/vllm.sock")
    # The supervisor, vLLM's API server, engine core, a worker per tensor-parallel rank.
    assert len(vllm_served["serving_members"]) >= 3 + TENSOR_PARALLEL
    # fp32 on both sides, greedy: the same ids, prompt by prompt (speculation included).
    assert [o.token_ids for o in outs] == ours
    assert all(o.seconds > 0 for o in outs)
    assert counters.drafts > 0 and counters.draft_tokens > 0
    assert len(counters.accepted_per_position) == 4
    # Stopped: nothing of its process group is left.
    assert vllm_served["stopped_members"] == []
    assert server.proc is None and "Application startup complete" in server.last_log


@pytest.mark.vllm
@pytest.mark.timeout(1500)   # the module's vLLM start counts in the first test that uses it
def test_the_structured_golden_prompts_are_answered_as_our_engine_answers_them(tiny_vllm_model, vllm_served):
    """The vLLM gate's requests for golden prompts that ask for structure (a JSON schema, both
    ways of asking; a choice; a regex; a forced tool call, its tools rendered by the template),
    answered by real vLLM while it drafts: each reply is what it asked for, judged as our gate
    judges it (gate/structured.judged), and token for token our engine's greedy reply under the
    same grammar (llguidance on both sides, JSON without free whitespace)."""
    import dataclasses

    from specpair.config import GenerationParams
    from specpair.decoding import SpeculativeEngine
    from specpair.gate.structured import judged, prepared

    tok = vllm_structured_golden.tools_tokenizer()
    loaded, _model_dir = tiny_vllm_model
    ours = SpeculativeEngine(dataclasses.replace(loaded, tokenizer=tok), speculation=SpeculationConfig(enabled=False))
    answered = vllm_served["structured"]
    assert len(answered) == len(vllm_structured_golden.GOLDEN)
    for golden, (request, reply) in zip(vllm_structured_golden.GOLDEN, answered):
        verdicts = judged(tok, request.ask, reply.text)
        asked = {key: value for key, value in verdicts.items() if value is not None}
        assert all(asked.values()), (golden, reply.text, verdicts)
        text, text_chat, structure = prepared(tok, golden["prompt"], request.ask, True)
        mine = ours.generate([text], GenerationParams(max_new_tokens=vllm_structured_golden.MAX_TOKENS,
                                                      structure=structure), chat=text_chat, speculate=False)[0]
        assert reply.token_ids == mine.token_ids, (golden["category"], reply.text, mine.text)
    # Asked for: schema (4 prompts: both JSON ones, the choice, the regex) and the tool call.
    kinds = [tuple(k for k, v in judged(tok, r.ask, c.text).items() if v is not None) for r, c in answered]
    assert kinds == [("schema_valid",)] * 4 + [("tool_call_parsed",), ()], kinds


@pytest.mark.vllm
@pytest.mark.timeout(1500)   # the module's vLLM start counts in the first test that uses it
def test_the_companion_passes_replies_through_and_counts_vllms_own_acceptance_by_category(vllm_served):
    """The pod's companion in front of real vLLM (0.32, CPU): clients get vLLM's replies (the
    usage chunk only where they asked for it), the token is the pair's, and the operator's probe
    reads per category, over mutual TLS, the acceptance vLLM counted for each request: summed over
    categories, exactly what vLLM's own counters moved by."""
    replies, vllm_counters = vllm_served["replies"], vllm_served["vllm_counters"]
    assert vllm_served["info"]["pair"] == "peer" and vllm_served["info"]["releaseVersion"] == "3"
    assert vllm_served["info"]["speculationEnabled"] is True
    assert vllm_served["info"]["contentHash"] == content_hash(vllm_served["pod"]["release"])
    whole, stream, stream_usage, chat, refused = replies
    assert refused == {"wrong_token": 401}
    # Greedy through the companion = greedy straight from vLLM (the same prompt, ids decoded).
    direct = vllm_served["outs"]
    assert whole["text"] == direct[0].text and whole["usage"].completion_tokens == len(direct[0].token_ids)
    assert stream["usage"] is None and all(c.choices for c in stream["chunks"])      # did not ask: no usage chunk
    assert stream["text"] == direct[1].text
    assert stream_usage["text"] == direct[2].text
    assert stream_usage["usage"].completion_tokens == len(direct[2].token_ids)
    assert stream_usage["chunks"][-1].model_extra["metrics"]["speculative_decoding"]["num_spec_tokens"] == 4
    before, after = vllm_served["stats_before"], vllm_served["stats_after"]
    assert before["categories"] == {} and set(after["categories"]) == {"code", "chat"}
    drafted = sum(c["drafted"] for c in after["categories"].values())
    accepted = sum(c["accepted"] for c in after["categories"].values())
    assert (drafted, accepted) == (vllm_counters.draft_tokens, vllm_counters.accepted_tokens) and drafted > 0
    code = after["categories"]["code"]
    # (A tiny random model repeats its prompt seldom: what it accepts is vLLM's count, whatever it is.)
    assert code["requests"] == 2 and code["drafted"] > 0 and code["draftedSq"] >= code["drafted"]
    # Serving health's counters, per category: every request ok, each timed.
    assert after["serving"]["code"]["requests"] == {"ok": 2} and after["serving"]["chat"]["requests"] == {"ok": 2}
    assert after["serving"]["code"]["ttft"]["count"] == 2 and after["serving"]["code"]["tpot"]["count"] == 2
    assert after["speculating"] is True and vllm_served["left_in_flight"] == 0
    # /metrics: vLLM's series and the engine's, per category, on the one port.
    text = vllm_served["metrics"]
    assert "vllm:spec_decode_num_draft_tokens_total" in text
    assert f'specpair_num_draft_tokens_total{{category="code",engine="vllm",pair="peer",version="3"}} ' \
           f'{float(code["drafted"])}' in text
    # No runtime switch: the probe refuses to ask, and the companion refuses when asked.
    refusal, answered = vllm_served["switch"]
    assert "cannot switch speculation off at run time" in str(refusal)
    assert "FAILED_PRECONDITION" in str(answered) and "rollout" in str(answered)
    assert "GetStats" in str(vllm_served["plaintext"])
    # SIGTERM's drain: /health says 503 at once (readiness takes the pod out), and the stream in
    # flight runs to its end.
    drain = vllm_served["drain"]
    assert drain["health"] == 503 and drain["left"] == 0
    assert [u.completion_tokens for u in drain["usage"]] == [DRAIN_MAX_TOKENS]


@pytest.mark.vllm
@pytest.mark.timeout(1500)   # the module's vLLM start counts in the first test that uses it
def test_the_pairs_tls_serves_real_vllm_to_a_client_that_verifies_the_operators_certificate(vllm_served):
    """rollout.tls on a vLLM pair, in front of real vLLM (0.32, CPU, tensor parallel 2): the pod's
    companion, run from the command the operator renders, serves HTTPS with the certificate the
    operator issues (the one in the pair's Secret, for the engine Service's name). A client
    trusting that Secret's ca.crt gets vLLM's greedy replies, whole and streamed, exactly as vLLM
    answers them directly; a client trusting only the system's CAs fails the handshake, and
    plaintext is refused. vLLM itself listens on the pod's Unix socket only, so TLS is the
    companion's and vLLM's command has no --ssl-* flag."""
    tls, direct = vllm_served["tls"], vllm_served["outs"]
    argv = tls["argv"]
    assert argv[argv.index("--tls-cert") + 1].endswith("/tls.crt") and "--auth-token-file" in argv
    assert tls["served"] == tls["issued"]
    assert tls["whole"] == direct[0].text and tls["stream"] == direct[1].text and direct[0].token_ids
    assert "CERTIFICATE_VERIFY_FAILED" in tls["system_cas"], tls["system_cas"]
    assert tls["plaintext"] != "answered", tls["plaintext"]
    [vllm_argv] = vllm_served["vllm_argv"]
    assert not [a for a in vllm_argv if a.startswith("--ssl")], vllm_argv
    assert tls["exit"] == 0


@pytest.mark.vllm
@pytest.mark.timeout(1500)   # the module's vLLM start counts in the first test that uses it
def test_a_real_vllm_servers_latency_and_finishes_reach_the_serving_watch(vllm_served):
    """The serving-health watch on a vLLM pair: what the companion counted from real vLLM's
    replies becomes the same per-category serving counters GetStats gives for specpair's engine."""
    from specpair_operator.policy import serving_health

    before = serving_health.serving_pod("p/u", vllm_served["stats_before"], None)
    after = serving_health.serving_pod("p/u", vllm_served["stats_after"], None)
    counts = after.categories["code"] - before.categories.get("code", serving_health.ServingCounts())
    assert (counts.finished, counts.failed) == (2, 0)
    assert counts.ttft.count == 2 and counts.ttft.upper_bounds and counts.ttft.counts[-1] == 2
    assert 0 < counts.ttft.quantile(0.95) and counts.tpot.count == 2
    assert after.categories["chat"].finished == 2


# -- the bench's vLLM columns -------------------------------------------------------------------


def test_bench_report_puts_vllm_beside_ours():
    from specpair.bench import BenchReport, PromptResult, format_table
    from specpair.stats import AcceptanceStats

    costs = {"target_step": 0.05, "draft_step": 0.0001, "verify": {4: 0.06}, "draft_per_token": False}

    def row(category, vllm_spec_seconds, identical):
        counters = SpecDecodeCounters(drafts=4, draft_tokens=16, accepted_tokens=8, accepted_per_position=[4, 2, 1, 1])
        return PromptResult(category=category, target_seconds=2.0, spec_seconds=1.0, tokens=20, identical=True,
                            stats=AcceptanceStats(), rounds_without_draft=0, target_ids=list(range(20)),
                            vllm={"target": {"seconds": 4.0, "tokens": 20, "identical": True},
                                  "spec": {"seconds": vllm_spec_seconds, "tokens": 20, "identical": identical,
                                           "counters": counters.to_dict()}})

    report = BenchReport(pair={}, device="cpu", k=4, runs=1, costs=costs,
                         prompts=[row("code", 2.0, True), row("qa", 2.0, False)])
    report.vllm = {"version": "0.32.0", "dtype": "float32", "threads": 1, "ours_threads": 1,
                   "speculative_config": {"method": "ngram"}, "start_seconds": {"target": 40.0, "spec": 41.0}}
    d = report.to_dict()
    overall = d["overall"]
    assert overall["vllm_target_tokens_per_s"] == 5.0 and overall["vllm_spec_tokens_per_s"] == 10.0
    assert overall["target_vs_vllm"] == 2.0 and overall["spec_vs_vllm"] == 2.0   # ours: 10 and 20 tok/s
    assert overall["vllm_speedup"] == 2.0
    assert (overall["vllm_target_identical"], overall["vllm_spec_identical"]) == (2, 1)
    assert overall["vllm_acceptance_rate"] == 0.5 and overall["vllm_mean_acceptance_length"] == 3.0
    assert overall["vllm_acceptance_per_position"] == [1.0, 0.5, 0.25, 0.25]   # per draft
    assert d["categories"]["qa"]["vllm_spec_identical"] == 0
    table = format_table(d)
    assert "vLLM tgt" in table and "spec/vLLM" in table and "2/2" in table and "1/2" in table
    # Without the peer, the table and the report are as before.
    report.vllm = None
    for r in report.prompts:
        r.vllm = None
    plain = report.to_dict()
    assert "vllm" not in plain and "vllm_target_tokens_per_s" not in plain["overall"]
    assert "vLLM" not in format_table(plain)
