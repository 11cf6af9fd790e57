"""yamllint over the hand-written and generated YAML of the deployment."""

from __future__ import annotations

from .conftest import ROOT, run, tool

PATHS = ["deploy", "helm/kvxfer/Chart.yaml", "helm/kvxfer/values.yaml", "helm/kvxfer/examples", "tests/deploy/data"]


def test_yamllint() -> None:
    out = run([tool("yamllint"), "--strict", "-c", str(ROOT / "deploy" / "yamllint.yaml"), "-f", "parsable", *PATHS])
    assert out.returncode == 0, out.stdout + out.stderr
