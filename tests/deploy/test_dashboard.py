"""deploy/grafana: the dashboard queries only metrics (and labels) the sidecar exports.

"Exports" is read from the sidecar's own registry (kvxfer.metrics.SidecarMetrics), and the
contract's metric table must say the same, so neither the docs nor the dashboard can drift.
"""

from __future__ import annotations

import json
import re
from typing import Any

from . import contract
from .conftest import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "kvxfer.json"
# Labels Prometheus adds on scrape (ServiceMonitor/PodMonitor; `role` and `rank` by their
# relabelings, which tests/deploy/test_chart.py checks).
TARGET_LABELS = {"namespace", "pod", "container", "service", "endpoint", "job", "instance", "role", "rank"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs() -> list[tuple[str, str]]:
    out = []
    for panel in _dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in _dashboard()["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"${var['name']}", var["query"]["query"]))
    return out


def _metric(token: str, exported: dict[str, contract.Metric]) -> contract.Metric | None:
    if token in exported:
        return exported[token]
    for suffix in HISTOGRAM_SUFFIXES:
        base = token.removesuffix(suffix)
        if base != token and base in exported and exported[base].type == "histogram":
            return exported[base]
    return None


def test_contract_table_matches_the_registry() -> None:
    registry = contract.exported_metrics()
    table = contract.contract_metrics()
    assert registry, "the sidecar registers no metrics"
    assert table == registry, (
        "docs/sidecar-contract.md's metric table differs from kvxfer.metrics: "
        f"only in the table {sorted(set(table) - set(registry))}, only exported {sorted(set(registry) - set(table))}, "
        f"different {sorted(k for k in set(table) & set(registry) if table[k] != registry[k])}"
    )


def test_queries_use_exported_metrics_only() -> None:
    exported = contract.exported_metrics()
    used: set[str] = set()
    for title, expr in _exprs():
        tokens = set(re.findall(r"\bkvxfer_[a-z0-9_]+", expr))
        assert tokens, f"{title}: no kvxfer metric in {expr}"
        metrics = []
        for token in tokens:
            m = _metric(token, exported)
            assert m is not None, f"{title}: {token} is not exported by kvxfer.metrics.SidecarMetrics"
            metrics.append(m)
            used.add(m.name)
        allowed = TARGET_LABELS.union(*(m.labels for m in metrics))
        if any(m.type == "histogram" for m in metrics):
            allowed |= {"le"}
        labels = set()
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            labels |= {x.strip() for x in group.split(",") if x.strip()}
        for selector in re.findall(r"\{([^}]*)\}", expr):
            labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", selector))
        labels |= set(re.findall(r",\s*([a-z_]+)\)\s*$", expr)) if expr.startswith("label_values") else set()
        assert labels <= allowed, f"{title}: labels {sorted(labels - allowed)} are not on {sorted(tokens)}"
    # Every exported metric is on the dashboard.
    assert used == set(exported), f"not on the dashboard: {sorted(set(exported) - used)}"


def test_rate_only_on_counters_and_histograms() -> None:
    exported = contract.exported_metrics()
    for title, expr in _exprs():
        for token in re.findall(r"\b(?:rate|increase)\(\s*(kvxfer_[a-z0-9_]+)", expr):
            m = _metric(token, exported)
            assert m is not None, f"{title}: {token} is not exported"
            assert m.type in {"counter", "histogram"}, f"{title}: rate() of the {m.type} {token}"


def test_dashboard_layout() -> None:
    dash = _dashboard()
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "namespace", "role", "pod"]
    assert dash["uid"] == "kvxfer-overview"
