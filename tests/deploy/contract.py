"""What docs/sidecar-contract.md promises: flags, ports and metrics, parsed from its tables.

The deployment (chart, manifests, dashboard) may only use what this module returns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "docs" / "sidecar-contract.md"


@dataclass(frozen=True)
class Metric:
    """One exported metric family, as Prometheus exposes it."""

    name: str
    type: str  # counter, gauge or histogram
    labels: frozenset[str]


def _table(heading: str) -> list[list[str]]:
    """The rows (cells stripped of backticks) of the first table under `## heading`."""
    text = CONTRACT.read_text()
    start = text.index(f"## {heading}")
    rows: list[list[str]] = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:]  # without the header row


@cache
def flags() -> frozenset[str]:
    """Every `--flag` of `kvxfer serve`."""
    out: set[str] = set()
    for row in _table("Settings"):
        out.update(re.findall(r"`(--[a-z0-9-]+)`", row[0]))
    return frozenset(out)


@cache
def flag_defaults() -> dict[str, str]:
    """`--flag` -> its default as the Settings table writes it (backticks dropped)."""
    out: dict[str, str] = {}
    for row in _table("Settings"):
        for flag in re.findall(r"`(--[a-z0-9-]+)`", row[0]):
            out[flag] = row[1].replace("`", "")
    return out


def env_var(flag: str) -> str:
    """The environment variable of a flag: KVXFER_<FLAG>, upper case, dashes as underscores."""
    return "KVXFER_" + flag.removeprefix("--").replace("-", "_").upper()


@cache
def ports() -> dict[str, int]:
    """Port name -> default number."""
    return {row[0].strip("`"): int(row[1]) for row in _table("Ports (named in Kubernetes)")}


def _contract_metrics() -> dict[str, Metric]:
    out: dict[str, Metric] = {}
    for row in _table("Metrics (Prometheus, base units)"):
        name = row[0].strip("`")
        kind = row[1].split()[0]
        # Only the label names: values such as (`read`,`write`) are in parentheses.
        labels = frozenset(x for x in re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", row[2])))
        out[name] = Metric(name, kind, labels)
    return out


def _registry_metrics() -> dict[str, Metric]:
    """The same, read from the sidecar's own metric objects (kvxfer.metrics.SidecarMetrics)."""
    from prometheus_client.metrics import MetricWrapperBase

    from kvxfer.metrics import GcPauses, SidecarMetrics

    out: dict[str, Metric] = {}
    for obj in vars(SidecarMetrics(backend="nixl")).values():
        if isinstance(obj, GcPauses):  # a collector of its own, not a metric object
            for family in obj.describe():
                out[family.name] = Metric(family.name, family.type, frozenset(obj.LABELS))
        elif isinstance(obj, MetricWrapperBase):
            # prometheus_client keeps a counter's name without "_total" and adds it on export.
            name = obj._name + ("_total" if obj._type == "counter" else "")
            out[name] = Metric(name, obj._type, frozenset(obj._labelnames))
    return out


def exported_metrics() -> dict[str, Metric]:
    """Name -> metric, for every metric the sidecar really exports: read from its registry.

    tests/deploy/test_dashboard.py also checks that the contract's table says the same.
    """
    return _registry_metrics()


def contract_metrics() -> dict[str, Metric]:
    """Name -> metric, as docs/sidecar-contract.md's table lists them."""
    return _contract_metrics()


def port_name(kind: str, rank: int) -> str:
    """The Kubernetes name of rank ``rank``'s sidecar port ``kind`` (peer, metrics, data).

    Rank 0 keeps the contract's names; a port name has at most 15 characters, so rank r > 0 uses
    ``<kind>-<r>`` ("kvxfer-metrics-1" would have 16).
    """
    return f"kvxfer-{kind}" if rank == 0 else f"{kind}-{rank}"
