"""The operator's entry point takes every `kopf run` flag (the chart's operator.extraArgs may
hold any of them) and offers JSON logs: parsed as a pure function, and launched for real."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ship_helpers import REPO_ROOT, one, run
from specpair_operator.__main__ import HANDLERS_MODULE, kopf_run_args


def test_defaults_are_standalone_all_namespaces_with_the_liveness_endpoint():
    args, env = kopf_run_args([])
    assert args == ["run", "--module", HANDLERS_MODULE, "--standalone", "--all-namespaces",
                    "--liveness=http://0.0.0.0:8080/healthz"]
    assert env == {}


def test_kopf_flags_pass_through_in_order_after_ours():
    args, env = kopf_run_args(["--namespace=team-a", "--log-format=json", "-n", "team-b", "--debug",
                               "--log-refkey", "k8s", "--mlflow-tracking-uri=https://m.example.com",
                               "--liveness="])
    assert args == ["run", "--module", HANDLERS_MODULE, "--standalone", "--namespace=team-a",
                    "--namespace=team-b", "--log-format=json", "--debug", "--log-refkey", "k8s"]
    assert env == {"SPECPAIR_MLFLOW_TRACKING_URI": "https://m.example.com"}


def test_peering_replaces_standalone():
    args, _ = kopf_run_args(["--peering=specpair"])
    assert "--peering=specpair" in args and "--standalone" not in args


def test_namespace_and_all_namespaces_exclude_each_other():
    with pytest.raises(SystemExit, match="exclude each other"):
        kopf_run_args(["-n", "a", "-A"])


def _launch(*flags: str):
    """The entry point as the image runs it, with no cluster and no MLflow: Kopf starts, loads the
    handlers, and its startup handler stops it for the missing tracking URI (a logged error)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "SPECPAIR_", "KUBE"))}
    env["KUBECONFIG"] = os.devnull
    return run([sys.executable, "-m", "specpair_operator", *flags], check=False, env=env, cwd=REPO_ROOT,
               timeout=120)


def test_entry_point_runs_with_kopf_json_logs():
    result = _launch("--log-format=json", "--log-refkey=k8s", "--liveness=")
    output = result.stdout + result.stderr
    assert "unrecognized arguments" not in output and "No such option" not in output, output[-3000:]
    records = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert records, output[-3000:]
    assert any("SPECPAIR_MLFLOW_TRACKING_URI" in r["message"] and r["severity"] == "error" for r in records), records


def test_a_misspelt_kopf_flag_is_refused_by_kopf_with_its_name():
    result = _launch("--log-formt=json")
    assert result.returncode == 2
    assert "No such option '--log-formt'" in result.stderr and "--log-format" in result.stderr


@pytest.mark.parametrize("log_format", ["full", "plain", "json"])
def test_chart_log_format_reaches_the_entry_point(render, log_format):
    container = one(render({"operator": {"logFormat": log_format}}), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    args, _ = kopf_run_args(container["args"])
    assert f"--log-format={log_format}" in args


def test_chart_leader_election_reaches_the_entry_point_and_not_kopf(render):
    """The chart's leaderElection values are the entry point's own flags: parsed into the election
    it runs before Kopf starts, never handed to Kopf (which would refuse them)."""
    from specpair_operator.__main__ import election
    from specpair_operator.leadership import Timing

    values = {"replicaCount": 2, "leaderElection": {"leaseDurationSeconds": 30, "renewDeadlineSeconds": 20,
                                                    "retryPeriodSeconds": 4}}
    container = one(render(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    args, _ = kopf_run_args(container["args"])
    assert not [a for a in args if "lease" in a or "leader" in a or "renew" in a or "retry" in a], args
    chosen = election(container["args"], {"SPECPAIR_OPERATOR_NAMESPACE": "specpair-system"})
    assert (chosen.namespace, chosen.lease, chosen.timing) == ("specpair-system", "ship-specpair", Timing(30, 20, 4))
    off = one(render({"leaderElection": {"enabled": False}}), "Deployment")
    assert election(off["spec"]["template"]["spec"]["containers"][0]["args"], {"SPECPAIR_OPERATOR_NAMESPACE": "x"}) is None
    assert off["spec"]["strategy"] == {"type": "Recreate"}


def test_chart_refuses_timings_that_let_a_leader_act_after_a_takeover(render):
    values = {"leaderElection": {"leaseDurationSeconds": 10, "renewDeadlineSeconds": 10, "retryPeriodSeconds": 2}}
    container = one(render(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    from specpair_operator.__main__ import election
    with pytest.raises(SystemExit, match="renew deadline .* < lease duration"):
        election(container["args"], {"SPECPAIR_OPERATOR_NAMESPACE": "specpair-system"})
