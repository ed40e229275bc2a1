"""A pair's engine limits: `spec.rollout.kvBudget` and `spec.rollout.maxBatchSize` reach the
engine pods as `specpair engine serve --kv-budget/--max-batch-size`, read by the engine's own
parser (maxBatchSize on a vLLM pair as vLLM's --max-num-seqs); values the engine cannot take are refused by the CRD and by the operator's own check,
in the same words, on the real control plane.
"""

from __future__ import annotations

import argparse

import pytest

from specpair.config import parse_kv_budget
from specpair.server.cli import add_engine_parser
from specpair_operator.desired import engine_objects, manifests
from specpair_operator.crd.validation import validate_spec

RELEASE = {"target": {"source": "t"}, "draft": {"drafter": "ngram"}, "speculation": {}, "gating": {}}


def _engine_args(rollout: dict):
    """The engine Deployment's command for `rollout`, parsed as `specpair engine serve` parses it."""
    dep = engine_objects.engine_deployment("p", "ns", RELEASE, "d" * 64, "1", rollout, "http://m")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:3] == ["specpair", "engine", "serve"]
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers())
    return command, parser.parse_args(command[1:])


@pytest.mark.parametrize("quantity, flag, budget", [
    ("2Gi", "2GiB", 2 << 30),
    ("512Mi", "512MiB", 512 << 20),
    ("64Ki", "64KiB", 64 << 10),
    ("1Ti", "1TiB", 1 << 40),
    ("4G", "4GB", 4 * 10**9),
    ("500M", "500MB", 500 * 10**6),
    ("8k", "8KB", 8000),
    ("1T", "1TB", 10**12),
    (2147483648, "2147483648B", 2147483648),      # an integer counts bytes, not tokens
    ("1048576", "1048576B", 1048576),
])
def test_kv_budget_reaches_the_engine_as_bytes(quantity, flag, budget):
    assert validate_spec({"target": {"source": "t"}, "draft": {"drafter": "ngram"},
                          "rollout": {"kvBudget": quantity}}) == []
    command, args = _engine_args({"kvBudget": quantity, "maxBatchSize": 16})
    assert command[command.index("--kv-budget") + 1] == flag
    assert parse_kv_budget(args.kv_budget) == (budget, "bytes")
    assert args.max_batch_size == 16


def test_absent_limits_pass_no_flags_and_the_token_stays_last():
    command, args = _engine_args({})
    assert "--kv-budget" not in command and "--max-batch-size" not in command
    assert args.kv_budget is None
    command, _ = _engine_args({"maxBatchSize": 1, "auth": {"tokenSecretRef": {"name": "serving-token"}}})
    assert command[command.index("--max-batch-size") + 1] == "1"
    assert command[-2:] == ["--auth-token-file", f"{manifests.AUTH_DIR}/token"]


@pytest.mark.parametrize("rollout, words", [
    ({"kvBudget": "2GiB"}, "spec.rollout.kvBudget in body should match"),
    ({"kvBudget": "1.5Gi"}, "spec.rollout.kvBudget in body should match"),
    ({"kvBudget": "0"}, "spec.rollout.kvBudget in body should match"),
    ({"kvBudget": "2m"}, "spec.rollout.kvBudget in body should match"),     # milli-bytes: no
    ({"kvBudget": "lots"}, "spec.rollout.kvBudget in body should match"),
    ({"kvBudget": "99999999999999999Gi"}, "spec.rollout.kvBudget in body should match"),
    ({"kvBudget": 0}, "spec.rollout.kvBudget in body should be greater than or equal to 1"),
    ({"kvBudget": -4096}, "spec.rollout.kvBudget in body should be greater than or equal to 1"),
    ({"maxBatchSize": 0}, "spec.rollout.maxBatchSize in body should be greater than or equal to 1"),
    ({"maxBatchSize": 257}, "spec.rollout.maxBatchSize in body should be less than or equal to 256"),
    ({"maxBatchSize": "8"}, "spec.rollout.maxBatchSize in body must be of type integer"),
])
def test_limits_the_engine_cannot_take_are_refused(rollout, words):
    errors = validate_spec({"target": {"source": "t"}, "draft": {"drafter": "ngram"}, "rollout": rollout})
    assert any(words in e for e in errors), errors


def test_the_kv_budget_is_the_specpair_engines_alone():
    for rollout in ({"kvBudget": "2Gi"}, {"kvBudget": "2Gi", "maxBatchSize": 8}):
        errors = validate_spec({"engine": "vllm", "target": {"source": "t"}, "draft": {"source": "d"},
                                "rollout": rollout})
        assert errors == ["spec: Invalid value: rollout.kvBudget needs engine specpair (it is its --kv-budget; "
                          "vLLM sizes its cache with vllm.gpuMemoryUtilization)"], errors
    assert validate_spec({"target": {"source": "t"}, "draft": {"drafter": "ngram"},
                          "rollout": {"maxBatchSize": 256, "kvBudget": "2Gi"}}) == []
    assert validate_spec({"engine": "vllm", "target": {"source": "t"}, "draft": {"source": "d"},
                          "rollout": {"maxBatchSize": 256}}) == []


VLLM_RELEASE = {**RELEASE, "engine": {"kind": "vllm", "dtype": "float32"}}


def _vllm_command(rollout: dict) -> list[str]:
    """The vLLM container's command (specpair.vllm_serve) of a vLLM pair's engine Deployment."""
    dep = engine_objects.engine_deployment("p", "ns", VLLM_RELEASE, "d" * 64, "1", rollout, "http://m")
    (vllm,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["command"][2] == "specpair.vllm_serve"]
    return vllm["command"]


def test_max_batch_size_reaches_vllm_as_its_max_num_seqs(tmp_path):
    """rollout.maxBatchSize on a vLLM pair: the pod's vllm_serve command carries it, and vLLM's
    own command line (vllm_serve's dry run: what it would exec) has --max-num-seqs; absent, no
    flag (vLLM's default). That vLLM's parser takes the flag: test_engine_vllm_serve's parse test;
    that vLLM then queues past it: test_operator_vllm's effectiveLoad phase."""
    import json
    import subprocess
    import sys

    rendered = _vllm_command({"maxBatchSize": 2})
    assert rendered[rendered.index("--max-num-seqs") + 1] == "2"
    assert "--max-num-seqs" not in _vllm_command({})
    (tmp_path / "config.json").write_text("{}")     # a model directory to the launcher (it reads no more)
    release = tmp_path / "release.json"
    release.write_text(json.dumps({**VLLM_RELEASE, "draft": {"drafter": "ngram"}, "target": {"source": str(tmp_path)},
                                   "pair": "p", "mlflow": {"version": "1"}}))
    args = [a if a != engine_objects.RELEASE_FILE else str(release) for a in rendered[3:]]

    def dry_run(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "specpair.vllm_serve", *argv, "--dry-run"], capture_output=True,
                              text=True, timeout=120, env={"SPECPAIR_VLLM_PYTHON": "/opt/vllm/python",
                                                           "PATH": "/usr/bin:/bin"})
    done = dry_run(args)
    assert done.returncode == 0, done.stderr
    vllm = json.loads(done.stdout)
    assert vllm[vllm.index("--max-num-seqs") + 1] == "2", vllm
    # Bad input is refused by the launcher, before vLLM starts.
    at = args.index("--max-num-seqs") + 1
    done = dry_run(args[:at] + ["0"] + args[at + 1:])
    assert done.returncode == 2 and "--max-num-seqs must be >= 1, got 0" in done.stderr, done.stderr


# -- the real API server ------------------------------------------------------------------------

def _pair(name: str, **rollout) -> dict:
    return {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": name},
            "spec": {"target": {"source": "t"}, "draft": {"drafter": "ngram"}, "rollout": rollout}}


def test_the_api_server_admits_and_refuses_as_the_operator_does(operator_kubeconfig, ns):
    """The chart's CRD (installed with the chart) on the real control plane."""
    created = ns.create(_pair("limits", kvBudget="2Gi", maxBatchSize=16))
    assert (created["spec"]["rollout"]["kvBudget"], created["spec"]["rollout"]["maxBatchSize"]) == ("2Gi", 16)
    assert ns.create(_pair("bytes", kvBudget=2147483648))["spec"]["rollout"]["kvBudget"] == 2147483648
    for i, rollout in enumerate(({"kvBudget": "2GiB"}, {"kvBudget": 0}, {"maxBatchSize": 0},
                                 {"maxBatchSize": 257})):
        ns.assert_refused_in_the_operators_words(_pair(f"bad-{i}", **rollout))
    vllm = _pair("vllm", kvBudget="2Gi")
    vllm["spec"].update(engine="vllm", draft={"source": "d"})
    ns.assert_refused_in_the_operators_words(vllm)
    vllm = _pair("vllm-batch", maxBatchSize=8)
    vllm["spec"].update(engine="vllm", draft={"source": "d"})
    assert ns.create(vllm)["spec"]["rollout"]["maxBatchSize"] == 8
