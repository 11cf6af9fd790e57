"""tools/helm-render behaves like Helm where a chart can tell: a small chart exercises it."""

from __future__ import annotations

from pathlib import Path

import yaml

from .conftest import load_docs, run

MINI = Path(__file__).parent / "data" / "minichart"


def _render(helm_render: Path, *args: str) -> tuple[int, str, str]:
    out = run([str(helm_render), "-chart", str(MINI), "-release-name", "rel", "-namespace", "ns", *args])
    return out.returncode, out.stdout, out.stderr


def test_helm_semantics(helm_render: Path, tmp_path: Path) -> None:
    override = tmp_path / "v.yaml"
    override.write_text("name: over\nnested:\n  drop: null\n")
    rc, out, err = _render(helm_render, "-f", str(override), "-api-versions", "monitoring.coreos.com/v1")
    assert rc == 0, err
    assert "# Source: mini/templates/cm.yaml" in out
    (cm,) = load_docs(out)
    d = cm["data"]
    assert cm["metadata"] == {"name": "mini-rel", "namespace": "ns"}
    # Helm hands numbers to templates as float64: printing a large one needs int64.
    assert d["bigRaw"] == "6.7108864e+07"
    assert d["bigInt"] == "67108864"
    assert d["kind"] == "float64"
    assert d["ratio"] == "0.5"
    assert d["tpl"] == "hello over"
    assert d["required"] == "over"
    assert d["nestedKeys"] == "keep", "a null in a later values file deletes the key"
    assert d["list"] == "a,b"
    assert d["chart"] == "mini/1.2.3/4.5"
    assert d["kube"] == "v1.30.0"
    assert d["hasMonitoring"] == "true"
    assert d["template"] == "mini/templates/cm.yaml"
    assert yaml.safe_load(d["yaml"]) == {"n": 67108864, "s": "8000", "l": [1, "x"]}
    assert d["json"] == '{"b":67108864}'
    assert d["fromYaml"] == "x"
    assert "notes for" not in out


def test_notes_and_capabilities(helm_render: Path) -> None:
    rc, out, err = _render(helm_render, "-notes", "-kube-version", "1.29.4")
    assert rc == 0, err
    assert "NOTES:\nnotes for rel" in out
    (cm,) = load_docs(out.split("\nNOTES:")[0])
    assert cm["data"]["kube"] == "v1.29.4"
    assert cm["data"]["hasMonitoring"] == "false"


def test_required_and_strict(helm_render: Path, tmp_path: Path) -> None:
    empty = tmp_path / "v.yaml"
    empty.write_text('name: ""\n')
    rc, _, err = _render(helm_render, "-f", str(empty))
    assert rc != 0
    assert "name is required" in err
    missing = tmp_path / "m.yaml"
    missing.write_text("list: null\n")
    rc, _, err = _render(helm_render, "-f", str(missing))
    assert rc != 0
    assert 'map has no entry for key "list"' in err


def test_kube_version_constraint(helm_render: Path) -> None:
    """Chart.yaml's kubeVersion is enforced like `helm template --kube-version`."""
    rc, _, err = _render(helm_render, "-kube-version", "1.28.15")
    assert rc != 0
    assert "chart requires kubeVersion: >=1.29.0-0 which is incompatible with Kubernetes v1.28.15" in err
    rc, _, err = _render(helm_render, "-kube-version", "v1.29.0")
    assert rc == 0, err
