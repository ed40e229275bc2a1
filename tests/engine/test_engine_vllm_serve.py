"""specpair.vllm_serve (the engine pods of vLLM releases) without vLLM: the command line a release
becomes (on a port for the gate, on the pod's Unix socket behind its companion), and the identity
name the companion reads back for the operator. The real vLLM pods run in
tests/operator/test_operator_vllm.py; that the command line of every release setting is one vLLM
takes is proven against the installed vLLM's own parser (tests marked vllm)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from specpair.contract import content_hash
from specpair.gate.vllm import SPECULATION_OFF
from specpair.vllm_k_schedule import k_at
from specpair.vllm_peer import VLLM_METHODS, default_python
from specpair.vllm_serve import (POD_DRAIN_SECONDS, VLLM_PER_REQUEST_FLAGS, VLLM_SPEC_DECODE_FLAGS, command,
                                 identity_name, parse_identity_name)


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
    # In a pod: on the Unix socket its companion fronts, with the per-request timings, and the
    # per-request acceptance where it speculates (vLLM refuses that flag without speculation).
    for flags, spec in ((), True), (("--no-speculation",), False):
        code, out, err = dry_run(tmp_path, rel, "--uds", "/run/v/vllm.sock", *flags)
        cmd = json.loads(out)
        assert code == 0 and cmd[cmd.index("--uds") + 1] == "/run/v/vllm.sock", err
        assert "--host" not in cmd and "--port" not in cmd
        assert all(f in cmd for f in VLLM_PER_REQUEST_FLAGS)
        # SIGTERM finishes the requests in flight (vLLM's default aborts them), as the companion does.
        assert cmd[cmd.index("--shutdown-timeout") + 1] == str(POD_DRAIN_SECONDS)
        assert (VLLM_SPEC_DECODE_FLAGS[0] in cmd) is spec
        if spec:
            assert cmd[cmd.index(VLLM_SPEC_DECODE_FLAGS[0]) + 1] == VLLM_SPEC_DECODE_FLAGS[1]
    # A draft model is resolved by our loader and handed to vLLM as a directory.
    code, out, _ = dry_run(tmp_path, release(tiny_pair_dirs["target"], {"source": tiny_pair_dirs["draft"]}))
    cmd = json.loads(out)
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["model"] == tiny_pair_dirs["draft"]


def test_the_launcher_imports_neither_torch_nor_transformers(tiny_pair_dirs, tmp_path):
    """A vLLM pod's launcher only resolves sources and renders flags: importing torch cost every
    vLLM pod 3-4 s before vLLM itself started."""
    path = tmp_path / "release.json"
    path.write_text(json.dumps(release(tiny_pair_dirs["target"], {"source": tiny_pair_dirs["draft"]})))
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "specpair.vllm_serve", "--release", str(path),
                           "--dry-run"], capture_output=True, text=True, timeout=120,
                          env={"SPECPAIR_VLLM_PYTHON": "/opt/vllm/python", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "specpair.vllm_serve" in imported or "specpair.vllm_peer" in imported
    assert not imported & {"torch", "transformers"}, sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers"))


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_a_split_target_and_its_settings_become_vllms_flags(tiny_pair_dirs):
    rel = {**release(tiny_pair_dirs["target"], {"source": tiny_pair_dirs["draft"], "method": "eagle3",
                                                "draftTensorParallel": 1},
                     gpuMemoryUtilization=0.85, maxModelLen=8192, quantization="fp8", kvCacheDtype="fp8_e4m3"),
           "parallelism": {"tensor": 4, "pipeline": 2}}
    cmd = command(rel, python="/py", host="0.0.0.0", port=8000, speculation=True, enforce_eager=False)
    assert [_flag(cmd, f) for f in ("--tensor-parallel-size", "--pipeline-parallel-size", "--gpu-memory-utilization",
                                    "--max-model-len", "--quantization", "--kv-cache-dtype")] == \
        ["4", "2", "0.85", "8192", "fp8", "fp8_e4m3"]
    spec = json.loads(_flag(cmd, "--speculative-config"))
    assert spec == {"model": tiny_pair_dirs["draft"], "num_speculative_tokens": 3, "method": "eagle3",
                    "draft_tensor_parallel_size": 1}
    # A release that sets none of them: one device, no other flag (vLLM's defaults hold).
    cmd = command(release(tiny_pair_dirs["target"], {"source": tiny_pair_dirs["draft"]}), python="/py",
                  host="0.0.0.0", port=8000, speculation=True, enforce_eager=False)
    assert _flag(cmd, "--tensor-parallel-size") == _flag(cmd, "--pipeline-parallel-size") == "1"
    assert not {"--gpu-memory-utilization", "--max-model-len", "--quantization", "--kv-cache-dtype"} & set(cmd)
    assert set(json.loads(_flag(cmd, "--speculative-config"))) == {"model", "num_speculative_tokens"}


# Run in the vLLM virtualenv: each command line (JSON on stdin) through what vLLM's server runs
# first (make_arg_parser, validate_parsed_serve_args), then EngineArgs.from_cli_args; the
# speculative config's keys and values checked against SpeculativeConfig's own fields and types,
# quantization against vLLM's methods, the cache settings against CacheConfig's fields. Prints
# what vLLM understood, or the error, per command line; and vLLM's speculative methods.
VLLM_PARSE = r"""
import dataclasses, json, sys, typing
import pydantic
from vllm.config.cache import CacheConfig
from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

def literals(tp):
    args = typing.get_args(tp)
    return [tp] if not args and isinstance(tp, str) else [x for a in args for x in literals(a)]

def check(fields, values):
    for key, value in values.items():
        if key not in fields:
            raise ValueError(f"{key} is no field of {sorted(fields)}")
        pydantic.TypeAdapter(fields[key].type).validate_python(value)

spec_fields = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}
cache_fields = {f.name: f for f in dataclasses.fields(CacheConfig)}
parser = make_arg_parser(FlexibleArgumentParser())
out = []
for argv in json.load(sys.stdin):
    try:
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
        engine = AsyncEngineArgs.from_cli_args(args)
        dense = None
        if engine.speculative_config is not None:
            check(spec_fields, engine.speculative_config)
            schedule = engine.speculative_config.get("num_speculative_tokens_per_batch_size")
            if schedule is not None:
                # What the scheduler drafts at each batch size from 1 to 64 (index 0 unused).
                dense = build_dynamic_sd_schedule_lookup(schedule, 64,
                                                         engine.speculative_config["num_speculative_tokens"])[1:]
        check(cache_fields, {"gpu_memory_utilization": engine.gpu_memory_utilization,
                             "cache_dtype": engine.kv_cache_dtype})
        if engine.quantization is not None and engine.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization {engine.quantization!r} is none of {QUANTIZATION_METHODS}")
        out.append({k: getattr(engine, k) for k in ("model", "dtype", "tensor_parallel_size",
                    "pipeline_parallel_size", "gpu_memory_utilization", "max_model_len", "quantization",
                    "kv_cache_dtype", "speculative_config", "per_request_spec_decode_metrics", "max_num_seqs")}
                   | {"uds": args.uds, "enable_per_request_metrics": args.enable_per_request_metrics,
                      "k_by_batch_size": dense})
    except (Exception, SystemExit) as exc:
        out.append({"error": f"{type(exc).__name__}: {exc}"})
print("RESULT " + json.dumps({"parsed": out, "methods": literals(SpeculativeMethod)}))
"""


def vllm_parses(argvs: list[list[str]], tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(default_python()), "-P", "-c", VLLM_PARSE], input=json.dumps(argvs), cwd=tmp_path,
                          env={**env, "VLLM_LOGGING_LEVEL": "ERROR"}, capture_output=True, text=True, timeout=400)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.vllm
@pytest.mark.timeout(480)
def test_vllms_own_parser_takes_every_setting_a_release_renders(tiny_pair_dirs, tmp_path):
    """The rendered command lines, through the installed vLLM's argument parser and config
    classes: every method the CRD offers, the parallel sizes and each serving setting arrive in
    the field vLLM reads them from; a wrong key or method is caught by the same check."""
    target, draft = tiny_pair_dirs["target"], tiny_pair_dirs["draft"]
    settings = {"gpuMemoryUtilization": 0.85, "maxModelLen": 4096, "quantization": "fp8", "kvCacheDtype": "fp8_e5m2"}
    releases = [{**release(target, {"source": target if method == "mtp" else draft, "method": method,
                                    "draftTensorParallel": 1}, **settings),
                 "parallelism": {"tensor": 4, "pipeline": 2}}
                for method in VLLM_METHODS if method != "ngram"]
    releases += [release(target, {"drafter": "ngram"}), release(target, {"source": draft})]
    # The gate's k by load (vllm_k_schedule), as the operator serves it.
    schedule = [[1, 3, 3], [4, 15, 2], [16, 16, 0]]
    with_schedule = release(target, {"drafter": "ngram"})
    with_schedule["speculation"]["kByBatchSize"] = schedule
    releases.append(with_schedule)
    # A release the gate shipped with speculation off (gate/vllm.SPECULATION_OFF): k 0 throughout.
    shipped_off = release(target, {"source": draft, "method": "eagle3"})
    shipped_off["speculation"].update(copy.deepcopy(SPECULATION_OFF))
    releases.append(shipped_off)

    def argv(rel: dict, on_socket: bool) -> list[str]:
        # Half as the gate starts vLLM (a port), half as a pod does (the companion's socket, with
        # a pair's rollout.maxBatchSize).
        cmd = command(rel, python="/py", host="127.0.0.1", port=8000, speculation=True, enforce_eager=True,
                      uds=str(tmp_path / "vllm.sock") if on_socket else None, max_num_seqs=2 if on_socket else None)
        assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        return cmd[3:]
    rendered = [argv(r, i % 2 == 1) for i, r in enumerate(releases)]
    # Controls: the check refuses a key SpeculativeConfig lacks and a method name that is ours, not vLLM's.
    spec_at = rendered[0].index("--speculative-config") + 1
    controls = []
    for bad in ({"draft_tensor_parallel": 1}, {"method": "draft-model"}):
        broken = list(rendered[0])
        broken[spec_at] = json.dumps({**json.loads(broken[spec_at]), **bad})
        controls.append(broken)
    got = vllm_parses(rendered + controls, tmp_path)
    assert [p.get("uds") is not None for p in got["parsed"][:len(releases)]] == [i % 2 == 1 for i in range(len(releases))]

    assert set(VLLM_METHODS.values()) <= set(got["methods"]), got["methods"]
    for rel, parsed in zip(releases, got["parsed"]):
        assert "error" not in parsed, parsed
        split = rel.get("parallelism") or {}
        engine = rel["engine"]
        assert (parsed["tensor_parallel_size"], parsed["pipeline_parallel_size"]) == \
            (split.get("tensor", 1), split.get("pipeline", 1))
        assert parsed["dtype"] == engine["dtype"] and parsed["model"] == target
        assert (parsed["gpu_memory_utilization"], parsed["max_model_len"], parsed["quantization"],
                parsed["kv_cache_dtype"]) == (engine.get("gpuMemoryUtilization", parsed["gpu_memory_utilization"]),
                                              engine.get("maxModelLen"), engine.get("quantization"),
                                              engine.get("kvCacheDtype", "auto"))
        # On the pod's socket, vLLM puts each reply's timings and acceptance in the reply.
        on_socket = parsed["uds"] is not None
        assert (parsed["enable_per_request_metrics"], parsed["per_request_spec_decode_metrics"]) == \
            ((True, "summary") if on_socket else (False, "none"))
        assert parsed["max_num_seqs"] == (2 if on_socket else None), parsed
        spec = parsed["speculative_config"]
        method = rel["draft"].get("method") or rel["draft"].get("drafter")
        assert spec.get("method") == (VLLM_METHODS[method] if method else None)
        assert spec["num_speculative_tokens"] == rel["speculation"]["k"]
        assert spec.get("draft_tensor_parallel_size") == rel["draft"].get("draftTensorParallel")
        # vLLM's scheduler drafts at each batch size what k_at reads from the shipped schedule.
        shipped = rel["speculation"].get("kByBatchSize")
        assert parsed["k_by_batch_size"] == (None if shipped is None else
                                             [k_at(shipped, b, spec["num_speculative_tokens"]) for b in range(1, 65)])
    assert got["parsed"][releases.index(with_schedule)]["k_by_batch_size"] == [3] * 3 + [2] * 12 + [0] * 49
    assert got["parsed"][releases.index(shipped_off)]["k_by_batch_size"] == [0] * 64
    bad_key, bad_method = got["parsed"][len(releases):]
    assert "draft_tensor_parallel is no field" in bad_key["error"], bad_key
    assert "error" in bad_method and "draft-model" in bad_method["error"], bad_method


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
