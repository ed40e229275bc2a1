"""The Grafana dashboard shipped in the chart: well-formed, covers what operators watch, and reads
only the metrics docs/install.md lists (so a renamed metric breaks a test, not a dashboard)."""

from __future__ import annotations

import json
import re

from ship_helpers import CHART_DIR, REPO_ROOT

DASHBOARD = json.loads((CHART_DIR / "dashboards" / "specpair.json").read_text())
METRIC = re.compile(r"\bspecpair_[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _documented_metrics() -> dict[str, str]:
    """`name` -> type from the metrics table in docs/install.md."""
    text = (REPO_ROOT / "docs" / "install.md").read_text()
    rows = re.findall(r"^\| `(specpair_[a-z0-9_]+)` \| (\w+) \|", text, flags=re.M)
    return dict(rows)


def _used_metrics() -> set[str]:
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
    exprs += [a.get("expr", "") for a in DASHBOARD["annotations"]["list"]]
    exprs += [v.get("definition", "") for v in DASHBOARD["templating"]["list"]]
    used = set()
    for name in METRIC.findall(" ".join(exprs)):
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
        used.add(name)
    return used


def test_dashboard_reads_only_documented_metrics():
    documented = _documented_metrics()
    assert len(documented) >= 12
    used = _used_metrics()
    assert used - documented.keys() == set(), "undocumented metrics in the dashboard"
    # Histogram quantiles need _bucket series: only documented histograms may be read that way.
    exprs = " ".join(t["expr"] for p in DASHBOARD["panels"] for t in p["targets"])
    for name in re.findall(r"(specpair_[a-z0-9_]+)_bucket", exprs):
        assert documented[name] == "histogram", name
    for name in re.findall(r"rate\((specpair_[a-z0-9_]+)\{", exprs):
        if name.endswith("_bucket"):
            continue  # histogram buckets, checked above
        assert documented[name] == "counter", f"rate() over {name}, a {documented[name]}"


def test_dashboard_shows_what_the_issue_asks_for():
    titles = " | ".join(p["title"].lower() for p in DASHBOARD["panels"])
    for topic in ("acceptance rate per category", "speedup", "speculation k", "fallback", "rollback",
                  "time to first token", "time per output token"):
        assert topic in titles, f"no panel about {topic}: {titles}"
    acceptance = next(p for p in DASHBOARD["panels"] if "per category" in p["title"].lower())
    assert any("by (pair, category)" in t["expr"] for t in acceptance["targets"])


def test_dashboard_is_well_formed():
    assert DASHBOARD["uid"] == "specpair-overview"
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in DASHBOARD["panels"]:
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"])
        assert panel["datasource"]["uid"] == "${datasource}"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another"
                cells.add((x, y))
        # Balanced parentheses and braces in every query: a cheap PromQL sanity check.
        for target in panel["targets"]:
            for open_, close in ("()", "{}", "[]"):
                assert target["expr"].count(open_) == target["expr"].count(close), target["expr"]
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert {"datasource", "pair", "version"} <= variables
