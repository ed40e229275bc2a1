"""The Grafana dashboard shipped in the chart: well-formed, covers what operators watch, and reads
only metrics that docs/install.md lists, with the labels the engine really exports (the engine's
own EngineMetrics is the reference), so a renamed metric or label breaks a test, not a dashboard."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

from ship_helpers import CHART_DIR, REPO_ROOT

DASHBOARD = json.loads((CHART_DIR / "dashboards" / "specpair.json").read_text())
METRIC = re.compile(r"\bspecpair_[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Documented:
    type: str
    source: str
    labels: frozenset[str]


def documented_metrics() -> dict[str, Documented]:
    """The metrics table in docs/install.md: name -> type, source, labels."""
    text = (REPO_ROOT / "docs" / "install.md").read_text()
    out = {}
    for line in text.splitlines():
        if not line.startswith("| `specpair_"):
            continue
        name, type_, source, labels = [cell.strip().strip("`") for cell in line.strip("|").split("|")][:4]
        extra = {label.strip() for label in re.sub(r"\(.*?\)", "", labels).split(",") if label.strip()}
        # The engine's series are labelled by the engine that served them too (the table's header).
        base = {"pair"} if "(pair only)" in labels else {"pair", "version"} | ({"engine"} if source == "engine" else set())
        out[name] = Documented(type_, source, frozenset(base | extra))
    return out


def engine_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """Exposed name -> (type, label names) from the engine's real metrics registry."""
    from specpair.server.metrics import EngineMetrics
    metrics = EngineMetrics("pair", "1")
    out = {}
    for collector in set(metrics.registry._names_to_collectors.values()):
        name = collector._name + ("_total" if collector._type == "counter" else "")
        out[name] = (collector._type, frozenset(collector._labelnames))
    return out


def base_name(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def expressions() -> list[str]:
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
    exprs += [a.get("expr", "") for a in DASHBOARD["annotations"]["list"]]
    exprs += [v.get("definition", "") for v in DASHBOARD["templating"]["list"]]
    return [e for e in exprs if e]


def test_docs_list_exactly_the_engine_metrics_with_their_types_and_labels():
    documented = documented_metrics()
    engine = engine_metrics()
    live = {n: d for n, d in documented.items() if d.source == "engine"}
    assert live.keys() == engine.keys(), (f"in docs, not exported: {sorted(live.keys() - engine.keys())}; "
                                          f"exported, not in docs: {sorted(engine.keys() - live.keys())}")
    for name, (type_, labels) in engine.items():
        assert documented[name].type == type_, name
        assert documented[name].labels == labels, f"{name}: docs {sorted(documented[name].labels)}, engine {sorted(labels)}"
    assert all(d.source == "operator" for n, d in documented.items() if n not in engine)


def operator_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """Exposed name -> (type, label names) from the operator's real metrics registry."""
    from specpair_operator.act import metrics
    out = {}
    for collector in set(metrics.REGISTRY._names_to_collectors.values()):
        name = collector._name + ("_total" if collector._type == "counter" else "")
        out[name] = (collector._type, frozenset(collector._labelnames))
    return out


def test_docs_list_exactly_the_operator_metrics_with_their_types_and_labels():
    documented = {n: d for n, d in documented_metrics().items() if d.source == "operator"}
    operator = operator_metrics()
    assert documented.keys() == operator.keys(), (f"in docs: {sorted(documented)}; exported: {sorted(operator)}")
    for name, (type_, labels) in operator.items():
        assert documented[name].type == type_, name
        assert documented[name].labels == labels, f"{name}: docs {sorted(documented[name].labels)}, operator {sorted(labels)}"


def expression_problems(expr: str, documented: dict[str, Documented]) -> list[str]:
    """What is wrong with one PromQL expression against the documented metrics and labels."""
    problems = []
    names = {base_name(n) for n in METRIC.findall(expr)}
    if names - documented.keys():
        return [f"undocumented {sorted(names - documented.keys())}"]
    labels = set().union(*(documented[n].labels for n in names)) | {"le"}
    for clause in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr):
        used = {label.strip() for label in clause.split(",") if label.strip()}
        if used - labels:
            problems.append(f"{sorted(used - labels)} are not labels of {sorted(names)}")
    for name in re.findall(r"(specpair_[a-z0-9_]+)_bucket", expr):
        if documented[name].type != "histogram":
            problems.append(f"{name}_bucket but {name} is a {documented[name].type}")
    for name in re.findall(r"rate\((specpair_[a-z0-9_]+)\{", expr):
        if not name.endswith("_bucket") and documented[name].type != "counter":
            problems.append(f"rate() over {name}, a {documented[name].type}")
    return problems


def test_dashboard_reads_only_documented_metrics_by_their_real_labels():
    documented = documented_metrics()
    problems = {expr: expression_problems(expr, documented) for expr in expressions()}
    assert {e: p for e, p in problems.items() if p} == {}


@pytest.mark.parametrize("expr,problem", [
    ('sum by (pair, reason) (rate(specpair_fallback_events_total[5m]))', "['reason'] are not labels"),
    ('rate(specpair_speculation_k{pair="x"}[5m])', "rate() over specpair_speculation_k, a gauge"),
    ('sum(rate(specpair_fallbacks_total[5m]))', "undocumented ['specpair_fallbacks_total']"),
])
def test_expression_check_catches_mistakes(expr, problem):
    assert any(problem in p for p in expression_problems(expr, documented_metrics()))


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
        for target in panel["targets"]:
            for open_, close in ("()", "{}", "[]"):
                assert target["expr"].count(open_) == target["expr"].count(close), target["expr"]
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    assert {"datasource", "pair", "version"} <= variables
