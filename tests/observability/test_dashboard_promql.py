"""Every query the Grafana dashboard ships (panels, annotations, the variables' metric selectors)
parsed by the real promtool, with the values Grafana puts in for its variables and macros: a
query no Prometheus would run fails here in a second, including those the live scenario has no
data for (test_prometheus_live.py evaluates them all against live engines)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from obs_helpers import annotation_queries, dashboard_variables, panel_targets, with_grafana_values


def dashboard_queries() -> list[str]:
    exprs = [expr for _, expr in panel_targets() + annotation_queries()]
    exprs += [re.fullmatch(r"label_values\((.+), (\w+)\)", v["definition"]).group(1) for v in dashboard_variables()]
    return [with_grafana_values(e, pair=".*", version=".*", rate_interval="1m", range_="6h") for e in exprs]


def promtool_check(exprs: list[str], prometheus_bin: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    # Recording rules are what promtool parses offline; each query becomes one.
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"specpair_dashboard:query{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard.rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([str(prometheus_bin / "promtool"), "check", "rules", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_promtool_parses_every_dashboard_query(prometheus_bin, tmp_path):
    exprs = dashboard_queries()
    assert any("specpair_shadow_alpha_sum_total" in e for e in exprs)
    assert any("specpair_canary_decisions_total" in e for e in exprs)
    done = promtool_check(exprs, prometheus_bin, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout


def test_promtool_refuses_a_broken_dashboard_query(prometheus_bin, tmp_path):
    # The check above can fail: the shadow panel's query with one parenthesis dropped.
    (expr,) = [e for e in dashboard_queries() if "specpair_shadow_alpha_sum_total" in e]
    done = promtool_check([expr.replace("(rate(", "(rate", 1)], prometheus_bin, tmp_path)
    assert done.returncode != 0 and "parse error" in done.stdout + done.stderr
