"""specpair.vllm_serve (the engine pods of vLLM releases) and what the operator reads back from
them (engine_probe.VllmProbe), without vLLM: the command line a release becomes, and the
identity name the operator parses from /metrics (or /v1/models, from pods without it there). The
real vLLM pods run in tests/operator/test_operator_vllm.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specpair.contract import content_hash
from specpair.vllm_serve import identity_name, parse_identity_name


def release(target: str, draft: dict, **engine) -> dict:
    return {"pair": "chat", "namespace": "t", "target": {"source": target}, "draft": draft, "speculation": {"k": 3},
            "engine": {"image": "x", "kind": "vllm", "dtype": "float32", **engine},
            "gating": {"prompts": [{"prompt": "hi", "category": "chat"}]}, "mlflow": {"version": "7"}}


def dry_run(tmp_path, rel: dict, *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "release.json"
    path.write_text(json.dumps(rel))
    done = subprocess.run([sys.executable, "-m", "specpair.vllm_serve", "--release", str(path), "--dry-run", *flags],
                          capture_output=True, text=True, timeout=120, env={"SPECPAIR_VLLM_PYTHON": "/opt/vllm/python",
                                                                             "PATH": "/usr/bin:/bin"})
    return done.returncode, done.stdout, done.stderr


def test_a_vllm_release_becomes_vllms_command_line_with_its_identity(tiny_pair_dirs, tmp_path):
    rel = release(tiny_pair_dirs["target"], {"drafter": "ngram"})
    code, out, err = dry_run(tmp_path, rel, "--port", "8000", "--enforce-eager")
    assert code == 0, err
    cmd = json.loads(out)
    assert cmd[:3] == ["/opt/vllm/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::1], cmd[4::1]))
    assert flags["--model"] == tiny_pair_dirs["target"] and flags["--dtype"] == "float32" and flags["--port"] == "8000"
    names = cmd[cmd.index("--served-model-name") + 1:cmd.index("--served-model-name") + 3]
    # The identity first: vLLM labels /metrics with the first served name only.
    assert names == [identity_name("chat", "7", content_hash(rel), True), "chat"]
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3 and "--enforce-eager" in cmd
    # SpeculationOff: no speculative config, and the identity says so.
    code, out, _ = dry_run(tmp_path, rel, "--no-speculation")
    cmd = json.loads(out)
    assert "--speculative-config" not in cmd and \
        parse_identity_name(cmd[cmd.index("--served-model-name") + 1])["speculating"] is False
    # A draft model is resolved by our loader and handed to vLLM as a directory.
    code, out, _ = dry_run(tmp_path, release(tiny_pair_dirs["target"], {"source": tiny_pair_dirs["draft"]}))
    cmd = json.loads(out)
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["model"] == tiny_pair_dirs["draft"]


def test_bad_releases_are_refused_with_a_clear_error(tmp_path):
    code, _, err = dry_run(tmp_path, {**release("/nowhere", {"drafter": "ngram"}), "engine": {"image": "x"}})
    assert code == 2 and "not a vLLM release" in err
    code, _, err = dry_run(tmp_path, release(str(tmp_path / "missing-model"), {"drafter": "ngram"}))
    assert code == 2 and "not found" in err


def test_identity_names_round_trip_and_others_are_ignored():
    name = identity_name("chat", "12", "ab" * 32, False)
    assert parse_identity_name(name) == {"pair": "chat", "version": "12", "digest": "ab" * 32, "speculating": False}
    for other in ("chat", "specpair:chat:12:abc:spec", "specpair:chat:v1:abc:maybe", "x:chat:v1:abc:spec"):
        assert parse_identity_name(other) is None


def serve_as_vllm(pages: dict[str, str]) -> ThreadingHTTPServer:
    """An HTTP server answering GET with `pages` (others 404), on a loopback port."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write((body or "").encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def vllm_metrics(model_name: str) -> str:
    """/metrics text as vLLM 0.32 writes it: every sample labelled with the first served name."""
    return ('# TYPE vllm:num_requests_running gauge\n'
            f'vllm:num_requests_running{{engine="0",model_name="{model_name}"}} 0.0\n'
            '# TYPE vllm:spec_decode_num_draft_tokens_total counter\n'
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="{model_name}"}} 120.0\n'
            f'vllm:spec_decode_num_draft_tokens_created{{engine="0",model_name="{model_name}"}} 1.79e+09\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="{model_name}"}} 45.0\n'
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{model_name}"}} 5.0\n'
            f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{model_name}"}} 2.0\n')


def test_the_operator_reads_identity_and_counters_from_a_vllm_pods_metrics():
    """VllmProbe against an HTTP server answering as vLLM with an API key does (/v1/* refused,
    /metrics open): what the operator verifies and judges drift on."""
    from specpair_operator.engine_probe import VllmProbe

    name = identity_name("chat", "3", "cd" * 32, True)
    server = serve_as_vllm({"/metrics": vllm_metrics(name)})
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        probe = VllmProbe()
        info = asyncio.run(probe.model_info(address))
        assert info == {"pair": "chat", "releaseVersion": "3", "contentHash": "cd" * 32, "tokenizer": {},
                        "speculationEnabled": True}
        stats = asyncio.run(probe.stats(address))
        assert stats["categories"] == {"all": {"drafted": 120, "accepted": 45, "requests": 7}}
    finally:
        server.shutdown()


def test_a_pod_without_its_identity_in_metrics_is_read_from_v1_models():
    """A pod rolled out with the pair's name first (its metrics say "chat") is read from
    /v1/models; where that is closed too, the probe says so instead of reporting no identity."""
    from specpair_operator.engine_probe import EngineUnreachable, VllmProbe

    name = identity_name("chat", "4", "ef" * 32, False)
    server = serve_as_vllm({"/metrics": vllm_metrics("chat"),
                            "/v1/models": json.dumps({"data": [{"id": "chat"}, {"id": name}]})})
    closed = serve_as_vllm({"/metrics": vllm_metrics("chat")})
    try:
        info = asyncio.run(VllmProbe().model_info(f"127.0.0.1:{server.server_address[1]}"))
        assert (info["pair"], info["releaseVersion"], info["speculationEnabled"]) == ("chat", "4", False)
        with pytest.raises(EngineUnreachable, match="/v1/models.*HTTP 404"):
            asyncio.run(VllmProbe().model_info(f"127.0.0.1:{closed.server_address[1]}"))
    finally:
        server.shutdown()
        closed.shutdown()


def test_metric_model_names_reads_labels_with_their_escapes():
    from specpair_operator.engine_probe import metric_model_names

    text = ('# HELP vllm:x model_name="not-a-sample"\n'
            'vllm:a{engine="0",model_name="specpair:p:v1:ab:spec"} 1\n'
            'vllm:b{model_name="q\\"uote\\\\n"} 2\n'
            'vllm:a{engine="1",model_name="specpair:p:v1:ab:spec"} 1\n'
            'python_gc{model_name="other"} 3\n')
    assert metric_model_names(text) == ["specpair:p:v1:ab:spec", 'q"uote\\n']
