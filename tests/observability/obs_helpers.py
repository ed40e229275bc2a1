"""Shared pieces of the observability tests: the chart rendered by the real helm, and the shipped
alert rules and dashboard, read from the chart (never copied)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml
from specpair_devcluster.processes import repo_tool

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "specpair"
# The one home of the alert rules: the chart's PrometheusRule embeds this file.
RULES = CHART / "rules" / "specpair-alerts.yaml"
DASHBOARD = CHART / "dashboards" / "specpair.json"


def helm(*args: str, values: dict[str, Any] | None = None, kubeconfig: Path | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    argv = [repo_tool("helm"), *(["--kubeconfig", str(kubeconfig)] if kubeconfig else []), *args]
    if values is not None:
        argv += ["--values", "-"]
    done = subprocess.run(argv, input=json.dumps(values) if values is not None else None,
                          capture_output=True, text=True, timeout=300)
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args[:2])} failed: {done.stderr[-3000:]}")
    return done


def render(values: dict[str, Any], release: str = "obs", namespace: str = "specpair-obs") -> list[dict[str, Any]]:
    out = helm("template", release, str(CHART), "--namespace", namespace, values=values).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def panel_targets() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel the dashboard ships."""
    def walk(panels: list[dict[str, Any]]):
        for p in panels:
            yield p
            yield from walk(p.get("panels") or [])
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in walk(board["panels"]) for t in p.get("targets") or [] if t.get("expr")]


def dashboard_variables() -> list[dict[str, Any]]:
    return [v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v.get("type") == "query"]


def annotation_queries() -> list[tuple[str, str]]:
    """(annotation name, PromQL) of every annotation the dashboard ships."""
    return [(a["name"], a["expr"]) for a in json.loads(DASHBOARD.read_text())["annotations"]["list"] if a.get("expr")]


def with_grafana_values(expr: str, *, pair: str, version: str, rate_interval: str, range_: str,
                        engine: str = ".*") -> str:
    """A dashboard query with the values Grafana puts in for its variables and macros (`engine`:
    the engine variable's "All" value unless given)."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$__range", range_)
            .replace("$pair", pair).replace("$version", version).replace("$engine", engine))
