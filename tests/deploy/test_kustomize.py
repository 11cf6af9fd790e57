"""deploy/: the kustomize overlays render offline and validate strictly; the base is the chart's."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import OVERLAYS, ROOT, load_docs, run, tool, validate_manifests
from .test_chart import check_metrics_objects, check_mps_pod, check_worker_pod, pod_specs, sidecars


def _kustomize(overlay: Path) -> str:
    out = run([tool("kubectl"), "kustomize", str(overlay)])
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_overlays_exist() -> None:
    assert {p.name for p in OVERLAYS} >= {"cpu", "rdma"}


def _worker_pods(overlay: Path, tmp_path: Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The overlay rendered and validated strictly: its objects, and the two roles' checked pod specs."""
    docs = load_docs(_kustomize(overlay))
    validate_manifests(docs, tmp_path)
    pods = pod_specs(docs)
    assert set(pods) == {"prefill", "decode"}
    for role, spec in pods.items():
        check_worker_pod(role, spec)
    return docs, pods


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_overlay_validates(overlay: Path, tmp_path: Path) -> None:
    docs, _ = _worker_pods(overlay, tmp_path)
    check_metrics_objects(docs)


def test_cpu_overlay_has_no_gpu() -> None:
    text = _kustomize(ROOT / "deploy" / "overlays" / "cpu")
    assert "nvidia.com/gpu" not in text
    assert "NVIDIA_VISIBLE_DEVICES" not in text
    assert "ghcr.io/kvxfer/kvxfer:0.1.0-cpu" in text
    pods = pod_specs(load_docs(text))
    for spec in pods.values():
        (vllm,) = spec["containers"]
        # The overlay appends to vLLM's args: each role keeps its own kv_role from the base.
        assert vllm["args"][-2:] == ["--block-size=32", "--max-num-seqs=16"]
        (sidecar,) = sidecars(spec)
        assert {"name": "UCX_TLS", "value": "tcp,sm,self"} in sidecar["env"]


def test_rdma_overlay_resources() -> None:
    docs = load_docs(_kustomize(ROOT / "deploy" / "overlays" / "rdma"))
    for spec in pod_specs(docs).values():
        (sidecar,) = sidecars(spec)
        assert sidecar["resources"]["limits"]["rdma/ib"] == 1
        assert sidecar["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        env = {e["name"] for e in sidecar["env"]}
        assert {"UCX_TLS", "UCX_NET_DEVICES", "UCX_IB_GID_INDEX"} <= env
    assert any(d["kind"] == "ServiceMonitor" for d in docs)


def test_base_is_generated_from_the_chart(helm_render: Path) -> None:
    out = run([sys.executable, "deploy/generate_base.py", "--check", "--renderer", str(helm_render)])
    assert out.returncode == 0, out.stdout + out.stderr


def test_mps_component_joins_both_containers_to_the_node_daemon(tmp_path: Path) -> None:
    """components/mps on the base: what the chart's gpu.mps renders (test_chart.py), for kustomize users."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    deploy = ROOT / "deploy"
    base, mps = (os.path.relpath(deploy / p, overlay) for p in ("base", "components/mps"))
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {base}\ncomponents:\n  - {mps}\n"
    )
    _, pods = _worker_pods(overlay, tmp_path)
    for spec in pods.values():
        check_mps_pod(spec, "/tmp/nvidia-mps")
