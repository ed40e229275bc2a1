"""The committed stubs are current and torch-free; `engine serve` / `engine generate` as a user runs them."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tiny_models import save_tiny

from serving_helpers import reference, wait_for

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "engine" / "specpair" / "_proto"


def _normalised(text: str) -> list[str]:
    # Version stamps change with the grpcio-tools release; the content must not.
    return [line for line in text.splitlines()
            if "Protobuf Python Version" not in line and "GRPC_GENERATED_VERSION =" not in line
            and not line.strip().startswith(("_runtime_version.ValidateProtobufRuntimeVersion", "_runtime_version.Domain"))
            and not (line.strip().rstrip(",").isdigit() or line.strip() in ("'',", "''"))]


def test_committed_stubs_match_the_proto(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "scripts" / "gen-protos.sh"), str(tmp_path)], check=True, env=env,
                   capture_output=True, timeout=120)
    for name in ("engine_pb2.py", "engine_pb2_grpc.py", "engine_pb2.pyi"):
        fresh, committed = (tmp_path / name).read_text(), (STUBS / name).read_text()
        assert _normalised(fresh) == _normalised(committed), \
            f"{name} is stale: run scripts/gen-protos.sh and commit engine/specpair/_proto/"


def test_stubs_import_without_torch():
    code = ("import sys; from specpair._proto import engine_pb2, engine_pb2_grpc; "
            "from specpair.server import client, requests; "
            "assert 'torch' not in sys.modules; print(engine_pb2.GenerateRequest.DESCRIPTOR.full_name)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "specpair.engine.v1.GenerateRequest"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_and_generate_commands(tiny_pair, tmp_path):
    target, draft = tiny_pair
    target_dir = save_tiny(target, tmp_path / "target")
    draft_dir = save_tiny(draft, tmp_path / "draft")
    port = _free_port()
    cmd = [sys.executable, "-m", "specpair.server", "engine", "serve", "--target", target_dir, "--draft", draft_dir,
           "--pair", "cli-pair", "--version", "3", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", "-1", "--insecure", "--device", "cpu", "--kv-budget", "4096"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def serving():
                try:
                    return stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    return server.poll() is not None
            assert wait_for(serving, timeout=90, interval=0.2)
            assert server.poll() is None, server.stdout.read()

        gen = [sys.executable, "-m", "specpair.server", "engine", "generate", "--address", f"127.0.0.1:{port}",
               "--insecure", "--max-new-tokens", "10"]
        out = subprocess.run(gen + ["--json", "def foo(x):"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout)
        assert reply["token_ids"] == reference(tiny_pair, "def foo(x):", 10).token_ids
        assert reply["finish_reason"] == "FINISH_REASON_LENGTH"
        assert reply["stats"]["num_draft_tokens"] > 0

        streamed = subprocess.run(gen + ["import os"], capture_output=True, text=True, timeout=60)
        assert streamed.returncode == 0
        assert streamed.stdout.rstrip("\n") == reference(tiny_pair, "import os", 10).text.rstrip("\n")
        assert "10 tokens in" in streamed.stderr and "acceptance" in streamed.stderr

        bad = subprocess.run(gen[:-2] + ["--max-new-tokens", "0", "hi"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1
        assert "INVALID_ARGUMENT: max_new_tokens: must be >= 1, got 0" in bad.stderr

        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
        log = server.stdout.read()
        assert "loading target" in log and "warm-up step" in log and "serving on" in log and "draining" in log
        assert "KV budget" in log and "(4096 target tokens)" in log    # --kv-budget reached the engine
        # No --batch-size-threshold: measured at start-up (test_engine_startup_speculation.py), and
        # the threshold said is the one served.
        measured = next(line for line in log.splitlines() if line.startswith("speculation by batch size, measured in"))
        threshold = int(measured.rsplit("threshold ", 1)[1])
        assert threshold >= 1 and f"off above {threshold} concurrent requests" in log
        # No --max-batch-size: the rows decoded together were measured first, up to the rows
        # the 4096-token pool admits (test_server_decode_rows.py).
        decoding = next(line for line in log.splitlines() if line.startswith("decode rows by measured step cost"))
        rows = int(decoding.split("decoding up to ", 1)[1].split(" rows", 1)[0])
        admitted = int(decoding.split("the rest of the ", 1)[1].split(" rows", 1)[0])
        assert 1 <= rows <= admitted and threshold <= max(1, rows)
        assert "stopped (0 in-flight requests finished while draining, 0 ended by the drain timeout)" in log
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_serve_refuses_plaintext_unless_asked():
    out = subprocess.run([sys.executable, "-m", "specpair.server", "engine", "serve", "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--insecure" in out.stderr and "Traceback" not in out.stderr


def test_serve_exits_with_the_reason_when_the_model_cannot_load(tmp_path):
    out = subprocess.run([sys.executable, "-m", "specpair.server", "engine", "serve", "--insecure",
                          "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
                          "--target", str(tmp_path / "missing-model")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "model path not found" in out.stderr and "Traceback" not in out.stderr


def _serve_options(*flags):
    import argparse

    from specpair.server.cli import add_engine_parser, server_options
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers())
    return server_options(parser.parse_args(["engine", "serve", "--insecure", *flags]))


def test_the_token_flag_and_its_old_name_and_the_read_timeout(tmp_path):
    from specpair.errors import SpecpairError
    token = tmp_path / "token"
    token.write_text("  s3cret\n")
    for flag in ("--auth-token-file", "--http-token-file"):    # the old name keeps working
        assert _serve_options(flag, str(token)).auth_token == "s3cret"
    assert _serve_options().auth_token is None
    assert (_serve_options().http_read_timeout, _serve_options("--http-read-timeout", "2.5").http_read_timeout) == \
        (30.0, 2.5)
    (tmp_path / "empty").write_text("\n")
    for flags, words in ((("--auth-token-file", str(tmp_path / "empty")), "is empty"),
                         (("--auth-token-file", str(tmp_path / "missing")), "No such file"),
                         (("--http-read-timeout", "0"), "must be > 0")):
        with pytest.raises(SpecpairError, match=words):
            _serve_options(*flags)


def test_the_kv_budget_flag_is_read_as_the_environment_variable_is():
    """--kv-budget takes what SPECPAIR_KV_BUDGET takes, into the pair the server loads, with or
    without a release; a bad value stops the command before anything loads, in the same words."""
    import argparse

    from specpair.config import Release, parse_kv_budget
    from specpair.server.cli import add_engine_parser, served_pair
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers())

    def args(*flags):
        return parser.parse_args(["engine", "serve", "--insecure", *flags])
    for given, parsed in (("4096", (4096, "tokens")), ("2GiB", (2 << 30, "bytes")), ("1.5GB", (1_500_000_000, "bytes"))):
        assert served_pair(args("--kv-budget", given), None, "cpu").kv_budget == given
        assert parse_kv_budget(given) == parsed
    assert served_pair(args(), None, "cpu").kv_budget is None
    release = Release.from_dict({"target": {"source": "default"}, "draft": {"drafter": "ngram"}, "pair": "p"})
    assert served_pair(args("--kv-budget", "2GiB"), release, "cpu").kv_budget == "2GiB"
    for bad in ("12XB", "0", "-5MiB", "lots"):
        out = subprocess.run([sys.executable, "-m", "specpair.server", "engine", "serve", "--insecure",
                              f"--kv-budget={bad}"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, bad
        assert "argument --kv-budget: KV budget" in out.stderr and "Traceback" not in out.stderr, out.stderr
    help_text = subprocess.run([sys.executable, "-m", "specpair.server", "engine", "serve", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    assert "--kv-budget BUDGET" in help_text and "SPECPAIR_KV_BUDGET" in help_text
